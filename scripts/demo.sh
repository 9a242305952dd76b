#!/usr/bin/env bash
# The README's first command: install what the demo needs (idempotent: bash scripts/setup.sh --demo, no test tools),
# then run the demo on an embedded Mooncake master.
# --help (or -h) anywhere prints scripts/demo-help.txt (generated from the demo's flags) and installs nothing.
# --engine (real vllm serve engines) also installs the engine's venv (bash scripts/setup-engine.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
engine=0
for arg in "$@"; do
  case "$arg" in
    -h|--help) cat "$here/scripts/demo-help.txt"; exit 0 ;;
    --engine) engine=1 ;;
  esac
done
cd "$here"
bash scripts/setup.sh --demo
if [ "$engine" = 1 ]; then
  bash scripts/setup-engine.sh >/dev/null
fi
export PATH="$here/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 MC_LOG_LEVEL=ERROR
exec .venv/bin/mooncake-lookout demo "$@"
