#!/usr/bin/env bash
# The README's test command: install everything (idempotent), then run the whole suite.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
export PATH="$here/.tools:$here/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 MC_LOG_LEVEL=ERROR
set +e
.venv/bin/python -m pytest -q -rfE "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
