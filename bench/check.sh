#!/usr/bin/env bash
# bench/check.sh -- `vouch check` of a SIZE volume imported from random data, VOUCH against
# VOUCH_BASE (each checks its own volume, made by its own `vouch import` of the same source), per
# layout, REPS interleaved rounds (base, new), median seconds and their ratio; then `pread64`
# calls per check of each (strace -c), which do not depend on the machine's load.
#   VOUCH=<new> VOUCH_BASE=<old> bench/check.sh
#   SIZE=4G REPS=7 LAYOUTS=packed VOUCH=... VOUCH_BASE=... bench/check.sh
# Needs strace. The page cache holds the volumes (the check's CPU and reads are compared, not the
# disk). Output: report lines on stdout; DIR (default /var/tmp/vouch-check-bench) is removed at exit.
set -euo pipefail
VOUCH=${VOUCH:?VOUCH=<the vouch binary to measure>}
VOUCH_BASE=${VOUCH_BASE:?VOUCH_BASE=<the vouch binary to compare with>}
SIZE=${SIZE:-2G}
REPS=${REPS:-5}
LAYOUTS=${LAYOUTS:-"split packed"}
DIR=${DIR:-/var/tmp/vouch-check-bench}
command -v strace >/dev/null || { echo "strace missing: apt-get install -y strace" >&2; exit 1; }
rm -rf "$DIR"
mkdir -p "$DIR"
trap 'rm -rf "$DIR"' EXIT
head -c "$SIZE" /dev/urandom >"$DIR/source.raw"
seconds() { # binary volume -> elapsed seconds of one check
    local t0 t1
    t0=$(date +%s.%N)
    "$1" check "$2" >/dev/null
    t1=$(date +%s.%N)
    echo "$t1 - $t0" | bc
}
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
for layout in $LAYOUTS; do
    "$VOUCH_BASE" import "$DIR/source.raw" "$DIR/base-$layout" --layout "$layout" >/dev/null
    "$VOUCH" import "$DIR/source.raw" "$DIR/new-$layout" --layout "$layout" >/dev/null
    : >"$DIR/base.t"
    : >"$DIR/new.t"
    for round in $(seq "$REPS"); do
        b=$(seconds "$VOUCH_BASE" "$DIR/base-$layout")
        n=$(seconds "$VOUCH" "$DIR/new-$layout")
        echo "$b" >>"$DIR/base.t"
        echo "$n" >>"$DIR/new.t"
        echo "$layout round $round: base $b s, new $n s"
    done
    base=$(median <"$DIR/base.t")
    new=$(median <"$DIR/new.t")
    reads() { strace -f -c -e trace=pread64 "$1" check "$2" 2>&1 >/dev/null | awk '/pread64/ { print $4 }'; }
    echo "$layout: median base $base s, new $new s, new/base $(echo "scale=3; $new / $base" | bc); pread64 base $(reads "$VOUCH_BASE" "$DIR/base-$layout"), new $(reads "$VOUCH" "$DIR/new-$layout")"
    rm -rf "$DIR/base-$layout" "$DIR/new-$layout"
done
