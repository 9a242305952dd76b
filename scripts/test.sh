#!/usr/bin/env bash
# The README's test command: install everything (idempotent), then run the whole suite.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  -h|--help)
    cat <<'USAGE'
usage: bash scripts/test.sh [PYTEST ARGS...]

Installs everything on its first run (bash scripts/setup.sh: the Debian packages as root, a .venv with vLLM's
CPU recipe and the Mooncake wheel, the real engine's venv, helm; later runs skip what is done), then runs the
whole suite in three parts, each with pytest -q -rfE --durations=15 (the slowest tests named, to keep it short):
  1. the tests that bound no time, two at a time (pytest-xdist, one test file per worker);
  2. the tests marked "engine" (real vllm serve engines, ~3.2 GB each), one file at a time with nothing else
     running, so that the engines a file starts together are all the memory and CPU in use;
  3. the tests marked "timed" (a deadline, a slack, a measured share: pyproject.toml's markers), one at a time
     with nothing else running, so that a bound is judged on a quiet machine.
Arguments go to pytest, and then the tests they select run in one part, one at a time, e.g.:
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
run_pytest() {  # pytest's exit status; 5 (no test collected) is a failure here
  local rc=0
  .venv/bin/python -m pytest -q -rfE --durations=15 "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing on purpose" >&2
    rc=1
  fi
  return "$rc"
}
if [ "$#" -gt 0 ]; then
  run_pytest "$@"
  exit
fi
untimed=0 engine=0 timed=0
run_pytest -m "not timed and not engine" -n 2 --dist loadfile || untimed=$?
run_pytest -m engine || engine=$?
run_pytest -m "timed and not engine" || timed=$?
if [ "$untimed" -ne 0 ] || [ "$engine" -ne 0 ] || [ "$timed" -ne 0 ]; then
  echo "failed: the untimed part exited $untimed, the engine part $engine, the timed part $timed" >&2
  exit 1
fi
