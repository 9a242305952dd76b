#!/usr/bin/env bash
# The README's first command: install what the demo needs (idempotent: bash scripts/setup.sh --demo, no test tools),
# then run the demo on an embedded Mooncake master; with --engine, also the engine venv (scripts/setup-engine.sh).
# --help (or -h) anywhere prints scripts/demo-help.txt (generated from the demo's flags) and installs nothing.
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
# --engine: real vllm serve engines, in the engine venv (vLLM's CPU build; shared by the machine's clones).
if [ "$engine" = 1 ]; then
  LOOKOUT_ENGINE_PYTHON=$(bash scripts/setup-engine.sh)
  export LOOKOUT_ENGINE_PYTHON
fi
export PATH="$here/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 MC_LOG_LEVEL=ERROR
exec .venv/bin/mooncake-lookout demo "$@"
