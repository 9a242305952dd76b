#!/usr/bin/env bash
# The README's test command: install everything (idempotent), then run the whole suite.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  -h|--help)
    cat <<'USAGE'
usage: bash scripts/test.sh [PYTEST ARGS...]

Installs everything on its first run (bash scripts/setup.sh: the Debian packages as root, a .venv with vLLM's
CPU recipe and the Mooncake wheel, helm; later runs skip what is done), then runs the whole suite with
pytest -q -rfE --durations=15 (the slowest tests named, to keep the suite short). Arguments go to pytest, e.g.:
  bash scripts/test.sh tests/test_cli.py -k serve
CI runs exactly this (.ci/run), as root, with no GPU. pytest's own options: .venv/bin/python -m pytest --help.
--help prints this and installs nothing.
USAGE
    exit 0 ;;
esac
cd "$here"
bash scripts/setup.sh
export PATH="$here/.tools:$here/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 MC_LOG_LEVEL=ERROR
set +e
.venv/bin/python -m pytest -q -rfE --durations=15 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
