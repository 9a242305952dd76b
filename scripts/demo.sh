#!/usr/bin/env bash
# The README's first command: install everything (idempotent), then run the demo on an embedded Mooncake master.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
export PATH="$here/.tools:$here/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 MC_LOG_LEVEL=ERROR
exec .venv/bin/mooncake-lookout demo "$@"
