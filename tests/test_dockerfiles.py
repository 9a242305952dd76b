"""The chart's two images (docker/*.Dockerfile) and the workflow that publishes them: they parse, have the stages
we mean, install exactly pyproject.toml's pins, the engine's Mooncake wheel is the variant built for vLLM's CUDA,
and they agree with the chart (user, ports, entrypoint, repositories, tag). No container engine runs here, so the
files are parsed, not built; docs/helm.md says how to build and push them.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
CHART = ROOT / "helm" / "mooncake-lookout"
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]


def parse(text: str) -> Dockerfile:
    """A small Dockerfile parser: comments, line continuations, global and stage ARGs, stages."""
    logical: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # comment lines inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1].rstrip() + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "dangling line continuation"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    stage_args: dict[str, str] = {}
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        assert keyword in INSTRUCTIONS, f"unknown instruction {keyword!r}"
        rest = rest.strip()
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            if not stages:
                global_args[name] = default.strip('"')
            else:
                assert default or name in global_args, f"stage ARG {name} has no value"
                stage_args[name] = default.strip('"') if default else global_args[name]
            continue
        if keyword == "FROM":
            parts = expand(rest, global_args).split()
            assert len(parts) in (1, 3) and (len(parts) == 1 or parts[1].upper() == "AS"), rest
            stages.append(Stage(base=parts[0], name=parts[2] if len(parts) == 3 else str(len(stages))))
            stage_args = {}
            continue
        assert stages, f"{keyword} before any FROM"
        stages[-1].instructions.append((keyword, expand(rest, stage_args)))
    return Dockerfile(global_args, stages)


def expand(text: str, args: dict[str, str]) -> str:
    """Substitute ${NAME} and $NAME from the ARGs in scope; an unknown name is an error."""
    def sub(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in args, f"${name} is not an ARG in scope"
        return args[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, text)


def tool_args(stage: Stage, tool: str, verb: str) -> list[str]:
    """What a stage's RUN instructions give ``tool verb`` (e.g. pip install, apt-get install), options dropped."""
    found: list[str] = []
    for keyword, rest in stage.instructions:
        if keyword != "RUN":
            continue
        for command in re.split(r"&&|;", rest):
            tokens = shlex.split(command)
            if tool in tokens and verb in tokens:
                found += [t for t in tokens[tokens.index(verb) + 1:] if not t.startswith("-")]
    return found


def pip_installs(stage: Stage) -> list[str]:
    """Requirements given to `pip install` in a stage's RUN instructions (options dropped)."""
    return tool_args(stage, "pip", "install")


def of(stage: Stage, keyword: str) -> list[str]:
    return [rest for k, rest in stage.instructions if k == keyword]


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PINS = {name: dep for group in PROJECT["optional-dependencies"].values() for dep in group
        if "==" in dep for name in [dep.split("==", 1)[0]]}
ENGINE = parse((DOCKER / "engine.Dockerfile").read_text())
MASTER = parse((DOCKER / "master.Dockerfile").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def test_parser_rejects_what_docker_would():
    with pytest.raises(AssertionError):
        parse("FROM x\nRUNN echo\n")
    with pytest.raises(AssertionError):
        parse("RUN echo\n")
    with pytest.raises(AssertionError):
        parse("FROM img:${MISSING}\n")
    assert parse("ARG V=1\nFROM a:$V AS b\nARG V\nRUN echo ${V} \\\n  done\n").stages[0].instructions == [
        ("RUN", "echo 1 done")]


def pip_uninstalls(stage: Stage) -> list[str]:
    """Packages given to `pip uninstall` in a stage's RUN instructions, in order."""
    return tool_args(stage, "pip", "uninstall")


def vllm_cuda_major() -> int:
    """The CUDA major version the installed vLLM wheel (the one the image carries) is built for, from its pins."""
    import importlib.metadata

    requires = importlib.metadata.requires("vllm") or []
    majors = {int(m) for r in requires for m in re.findall(r"\[cu(\d+)\]", r)}
    assert len(majors) == 1, f"vLLM's requirements name CUDA {majors or 'nothing'}"
    return majors.pop()


def test_engine_image_is_the_pinned_vllm_image_with_mooncake_cuda_and_our_wheel():
    assert [s.name for s in ENGINE.stages] == ["wheel", "engine"]
    wheel, engine = ENGINE.stages
    assert PINS["vllm"] == "vllm==0.33.0"
    assert engine.base == "vllm/vllm-openai:v" + PINS["vllm"].split("==")[1]
    # Exactly the Mooncake CUDA wheel pin and this package's wheel, nothing else.
    installs = pip_installs(engine)
    assert installs[0] == PINS["mooncake-transfer-engine-cuda13"]
    assert len(installs) == 2 and re.fullmatch(r"/tmp/dist/mooncake_lookout-\*\.whl", installs[1])
    assert of(engine, "COPY") == ["--from=wheel /dist/ /tmp/dist/"]
    # The wheel stage builds from the source tree, without dependencies.
    assert any("pip wheel" in r and "--no-deps" in r for r in of(wheel, "RUN"))


def test_engine_mooncake_variant_matches_vllms_cuda():
    """vLLM 0.33.0 is built for CUDA 13 (cu13 extras); Mooncake's CUDA 13 build is the -cuda13 variant (the plain
    wheel is CUDA 12). Whatever variant vLLM's image brings is removed first: both own the same files."""
    major = vllm_cuda_major()
    assert major == 13
    (engine_stage,) = [s for s in ENGINE.stages if s.name == "engine"]
    mooncake = pip_installs(engine_stage)[0]
    assert mooncake.startswith(f"mooncake-transfer-engine-cuda{major}==")
    assert set(pip_uninstalls(engine_stage)) == {"mooncake-transfer-engine", "mooncake-transfer-engine-cuda13"}
    # The uninstall comes before the install, in the same layer.
    (run,) = [rest for k, rest in engine_stage.instructions if k == "RUN" and "uninstall" in rest]
    assert run.index("uninstall") < run.index("install --no-cache-dir")
    # Client and master run the same Mooncake version.
    assert mooncake.split("==")[1] == pip_installs(MASTER.stages[0])[0].split("==")[1]


def test_engine_entrypoint_matches_the_chart_command():
    (entrypoint,) = of(ENGINE.stages[-1], "ENTRYPOINT")
    template = (CHART / "templates" / "engine-deployment.yaml").read_text()
    command = json.loads(re.search(r"command: (\[.*\])", template).group(1))
    assert json.loads(entrypoint) == command


def test_engine_build_context_holds_what_the_wheel_stage_copies():
    patterns = [line.strip() for line in (DOCKER / "engine.Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        verdict = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            pattern = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
                verdict = not negate
        return verdict

    sources = [src for rest in of(ENGINE.stages[0], "COPY") for src in rest.split()[:-1]]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not ignored(src), f"{src} is excluded from the build context"
    assert ignored(".venv") and ignored("tests")


def test_master_image_installs_the_pinned_wheel_and_runs_as_the_charts_user():
    (stage,) = MASTER.stages
    assert stage.base.startswith("python:3.11-")
    assert pip_installs(stage) == [PINS["mooncake-transfer-engine-non-cuda"]]
    cpu, gpu = PINS["mooncake-transfer-engine-non-cuda"], PINS["mooncake-transfer-engine-cuda13"]
    assert cpu.split("==")[1] == gpu.split("==")[1]
    (user,) = of(stage, "USER")
    uid, _, gid = user.partition(":")
    assert int(uid) != 0 and int(uid) == VALUES["master"]["podSecurityContext"]["runAsUser"]
    assert int(gid) == VALUES["master"]["podSecurityContext"]["runAsGroup"]
    assert json.loads(of(stage, "ENTRYPOINT")[0]) == ["mooncake_master"]
    (expose,) = of(stage, "EXPOSE")
    ports = [VALUES["master"]["rpcPort"], VALUES["master"]["metricsPort"]]
    assert sorted(int(p) for p in expose.split()) == sorted(ports)


@pytest.mark.parametrize("image", ["engine", "master"])
def test_both_images_carry_the_rdma_drivers_libibverbs_loads(image):
    """libibverbs finds a NIC only through a provider (libmlx5 and the others of ibverbs-providers); installed with
    --no-install-recommends, libibverbs1 leaves them out. The master image also runs the store pods."""
    stage = (ENGINE if image == "engine" else MASTER).stages[-1]
    installs = tool_args(stage, "apt-get", "install")
    assert {"libibverbs1", "ibverbs-providers"} <= set(installs), installs
    (run,) = [rest for k, rest in stage.instructions if k == "RUN" and "apt-get install" in rest]
    assert "apt-get update" in run and "rm -rf /var/lib/apt/lists/*" in run  # one layer, no stale index


def test_chart_annotations_name_the_versions_the_images_install():
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())["annotations"]
    assert ENGINE.stages[-1].base.endswith("v" + meta["mooncake-lookout/vllm-version"])
    assert pip_installs(MASTER.stages[0])[0].endswith("==" + meta["mooncake-lookout/mooncake-version"])


# -- the workflow that builds and publishes them ------------------------------------------------------------

WORKFLOW = ROOT / ".github" / "workflows" / "images.yml"


def test_workflow_builds_both_images_where_the_chart_pulls_them_from():
    doc = yaml.safe_load(WORKFLOW.read_text())
    triggers = doc.get("on", doc.get(True))  # YAML 1.1 reads a bare `on` as true
    assert triggers["push"]["tags"] == ["v*"] and "pull_request" in triggers
    assert doc["permissions"]["packages"] == "write"
    (job,) = doc["jobs"].values()
    builds = {m["image"]: m for m in job["strategy"]["matrix"]["include"]}
    # Each Dockerfile with the build context its header names (engine: the repository root; master: docker/).
    assert builds["engine"] == {"image": "engine", "file": "docker/engine.Dockerfile", "context": "."}
    assert builds["master"] == {"image": "master", "file": "docker/master.Dockerfile", "context": "docker"}
    for name, build in builds.items():
        header = (ROOT / build["file"]).read_text()
        assert f"-f {build['file']} " in header and header.split(f"-f {build['file']} ", 1)[1].split("\n")[0].endswith(
            f" {build['context']}"), name
    # Tagged <owner>/<image>:<version>: the chart's default repositories, with the appVersion as tag.
    steps = job["steps"]
    push = next(s for s in steps if s.get("uses", "").startswith("docker/build-push-action"))
    assert push["with"]["tags"] == ("ghcr.io/${{ steps.meta.outputs.owner }}/${{ matrix.image }}:"
                                    "${{ steps.meta.outputs.version }}")
    for component in ("engine", "master"):
        repository = VALUES[component]["image"]["repository"]
        assert repository.startswith("ghcr.io/") and repository.rsplit("/", 1)[1] == component
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["appVersion"] == PROJECT["version"]
    meta_step = next(s for s in steps if s.get("id") == "meta")
    assert "['project']['version']" in meta_step["run"]
    # Only a release tag that names that version publishes; pull requests only build.
    assert push["with"]["push"] == "${{ startsWith(github.ref, 'refs/tags/') }}"
    login = next(s for s in steps if s.get("uses", "").startswith("docker/login-action"))
    assert login["if"] == "startsWith(github.ref, 'refs/tags/')"
    check = next(s for s in steps if "A release tag" in s.get("name", ""))
    assert "${GITHUB_REF_NAME#v}" in check["run"] and "steps.meta.outputs.version" in check["run"]
