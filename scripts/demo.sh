#!/usr/bin/env bash
# The README's first command: install everything (idempotent), then run the demo on an embedded Mooncake master.
# --help (or -h) anywhere prints scripts/demo-help.txt (generated from the demo's flags) and installs nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
for arg in "$@"; do
  case "$arg" in
    -h|--help) cat "$here/scripts/demo-help.txt"; exit 0 ;;
  esac
done
cd "$here"
bash scripts/setup.sh
export PATH="$here/.tools:$here/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 MC_LOG_LEVEL=ERROR
exec .venv/bin/mooncake-lookout demo "$@"
