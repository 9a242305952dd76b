#!/usr/bin/env bash
# Builds what tests/test_setup_prereqs.py needs to run offline (as root; the set-up runs it): a clean Debian root
# (debootstrap minbase plus python3, as a stock Debian image with Python: no python3-venv, no npm) packed as a
# tarball, and a local apt repository holding the .deb files scripts/prereqs.sh installs in that root, resolved by
# apt in that very root with their dependencies, with a Packages index and a Release file (apt-ftparchive).
# Idempotent: skipped when built by this script from the same prereqs.sh; built in a private tmpfs and moved in
# whole, so an interrupted run leaves nothing half-made and the next run starts afresh.
#
#   bash scripts/clean-root.sh          build it when missing or out of date (downloads; 2 bounded tries)
#   bash scripts/clean-root.sh --check  exit 0 when it is built and up to date, else print what to run, exit 1
#   bash scripts/clean-root.sh --path   print the folder it builds (root.tar.gz, repo/)
#   bash scripts/clean-root.sh --help
#
# It is shared by every clone on the machine (a fresh clone reuses it): LOOKOUT_CACHE (default
# $HOME/.cache/mooncake-lookout) holds it in clean-root/SUITE-HASH, HASH naming this script and prereqs.sh;
# LOOKOUT_TOOLS, when set, holds it in LOOKOUT_TOOLS/clean-root/SUITE instead. LOOKOUT_CLEAN_ROOT_SUITE (default
# trixie) is the Debian release; LOOKOUT_DEBIAN_MIRROR overrides debootstrap's default mirror.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
suite=${LOOKOUT_CLEAN_ROOT_SUITE:-trixie}
mirror=${LOOKOUT_DEBIAN_MIRROR:-}
try_s=900  # one try's bound: debootstrap and the packages' download (~180 MB) took about a minute here

hash=$(cat "$here/scripts/clean-root.sh" "$here/scripts/prereqs.sh" | sha256sum | cut -c1-16)
want="$hash $suite"
if [ -n "${LOOKOUT_TOOLS:-}" ]; then
  dest=$LOOKOUT_TOOLS/clean-root/$suite
else
  dest=${LOOKOUT_CACHE:-$HOME/.cache/mooncake-lookout}/clean-root/$suite-$hash
fi
up_to_date() { [ -f "$dest/stamp" ] && [ "$(cat "$dest/stamp")" = "$want" ]; }

case "${1:-}" in
  -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  --path) echo "$dest"; exit 0 ;;
  --check)
    up_to_date && exit 0
    state=missing; [ -d "$dest" ] && state="out of date (scripts/prereqs.sh or this script changed since)"
    echo "the clean Debian $suite root and its local apt repository are $state: run 'bash scripts/setup.sh'" \
         "as root (its step 'bash scripts/clean-root.sh' downloads them)"
    exit 1 ;;
  "") ;;
  *) echo "clean-root.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac

log() { printf '[setup] %s\n' "$*" >&2; }
if up_to_date; then
  log "clean $suite root up to date: $dest"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "clean-root.sh: building the clean Debian root needs root (debootstrap, chroot, mounts)" >&2
  exit 1
fi
for tool in debootstrap unshare chroot timeout; do
  command -v "$tool" >/dev/null || { echo "clean-root.sh: $tool not found (bash scripts/prereqs.sh)" >&2; exit 1; }
done

# Runs in a mount namespace of its own: the root is built on a tmpfs there, which vanishes with the namespace.
# $OUT (on disk) receives root.tar.gz first, taken before anything else runs in the root, then repo/.
build='
set -euo pipefail
R=$1 OUT=$2 SUITE=$3 STEP=$4 MIRROR=$5
mount -t tmpfs -o size=6g,mode=0755 lookout-clean-root-build "$R"
debootstrap --variant=minbase --include=python3 "$SUITE" "$R" ${MIRROR:+"$MIRROR"} >"$OUT/debootstrap.log" 2>&1 \
  || { tail -n 20 "$OUT/debootstrap.log" >&2; exit 1; }
# The image as a stock one ships: no package lists or downloaded .debs (debootstrap leaves both), nothing of this
# machine: its resolver configuration and host name (debootstrap copies them in).
rm -rf "$R"/var/lib/apt/lists/* "$R"/var/cache/apt/archives/*.deb "$R"/var/cache/apt/*.bin
mkdir -p "$R/var/lib/apt/lists/partial"
tar -C "$R" --numeric-owner --exclude=./etc/resolv.conf --exclude=./etc/hostname -czpf "$OUT/root.tar.gz" .
cp /etc/resolv.conf "$R/etc/resolv.conf"
mkdir -p "$R/opt/lookout" "$R/opt/lookout/repo" "$OUT/repo" && cp "$STEP" "$R/opt/lookout/prereqs.sh"
mount -t proc proc "$R/proc" && mount --rbind /dev "$R/dev" && mount --bind "$OUT/repo" "$R/opt/lookout/repo"
in_root() { chroot "$R" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  DEBIAN_FRONTEND=noninteractive "$@"; }
line=$(in_root bash /opt/lookout/prereqs.sh --dry-run)
case "$line" in
  *"--no-install-recommends "*) read -r -a need <<<"${line#*--no-install-recommends }" ;;
  *) echo "prereqs.sh --dry-run in the clean root printed no apt command: $line" >&2; exit 1 ;;
esac
apt=(apt-get -q -o Acquire::Retries=3)
in_root "${apt[@]}" update >/dev/null
in_root "${apt[@]}" install -y --download-only --no-install-recommends "${need[@]}" >/dev/null
cp "$R"/var/cache/apt/archives/*.deb "$OUT/repo/"
# The indexer comes after the download, so that what it needs does not change what was resolved.
in_root "${apt[@]}" install -y --no-install-recommends apt-utils >/dev/null
in_root sh -c "cd /opt/lookout/repo && apt-ftparchive packages . >Packages && apt-ftparchive release . >/tmp/Release \
  && mv /tmp/Release Release"
echo "${need[*]}" >"$OUT/packages"
'

parent=$(dirname "$dest")
mkdir -p "$parent"
exec 9>"$parent/.lock"
flock 9  # one build at a time on the machine (clones share it); the one that waited finds it built
if up_to_date; then
  log "clean $suite root up to date: $dest"
  exit 0
fi
rm -rf "$parent"/.build.*  # what a killed run left
for try in 1 2; do
  log "clean $suite root and local apt repository (try $try of 2, at most ${try_s}s): $dest"
  work=$(mktemp -d "$parent/.build.XXXXXX")
  mkdir "$work/root" "$work/out"
  if timeout --foreground -k 10 "$try_s" unshare --mount --propagation private --pid --fork --kill-child \
       bash -c "$build" build "$work/root" "$work/out" "$suite" "$here/scripts/prereqs.sh" "$mirror"; then
    rm -f "$work/out/debootstrap.log"
    chmod -R a+rX "$work/out"
    echo "$want" >"$work/out/stamp"
    rm -rf "$dest"
    mv "$work/out" "$dest"
    rm -rf "$work"
    log "clean $suite root: $(du -sh "$dest/root.tar.gz" | cut -f1)," \
        "local apt repository: $(find "$dest/repo" -name '*.deb' | wc -l) packages, $(du -sh "$dest/repo" | cut -f1)"
    exit 0
  else
    rc=$?
  fi
  rm -rf "$work"
  case $rc in
    124|137) log "try $try stopped: it ran out of its ${try_s}s" ;;
    *) log "try $try failed (exit $rc)" ;;
  esac
done
echo "clean-root.sh: could not build the clean $suite root (see above); run the set-up again" >&2
exit 1
