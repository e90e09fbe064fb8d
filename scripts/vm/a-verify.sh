#!/bin/sh
# Scenario A, second boot: the same export after the restarts. Check the
# file system read-only, then every chunk of every file against the
# manifest a-write.sh left. Each run of chunks that differ is reported as
#   LOST fN bytes A-B (MODE write): reads as zeros | reads other data
#                                   | the file is missing
# so the host can say exactly what the restarts lost.
. /vm/lib.sh

wait_for_device /dev/vda
status=0
# The full path: busybox sh prefers its own applets.
if ! /usr/local/bin/e2fsck -fn /dev/vda >/tmp/fsck 2>&1; then
    while read -r line; do say "e2fsck: $line"; done </tmp/fsck
    say "FAIL e2fsck -fn /dev/vda found errors"
    status=1
fi
mount -t ext4 -o ro /dev/vda /mnt || fail "mount /dev/vda"
[ -f /mnt/manifest ] || fail "no manifest on the volume"

CHUNK=65536
files=0
chunks=0
lost=0
previous=""
# Consecutive lost chunks of one file that read back alike are reported as
# one range: run_name, run_first, run_last, run_mode, run_what.
run_name=""
report_run() {
    [ -z "$run_name" ] || say "LOST $run_name bytes $run_first-$run_last ($run_mode write): $run_what"
    run_name=""
}
while read -r name offset length mode sum; do
    [ "$name" = "$previous" ] || files=$((files + 1))
    previous=$name
    chunks=$((chunks + 1))
    dd if="/mnt/$name" bs=$CHUNK skip=$((offset / CHUNK)) count=1 2>/dev/null >/tmp/chunk
    actual=$(sha256sum </tmp/chunk)
    [ "${actual%% *}" = "$sum" ] && continue
    lost=$((lost + 1))
    if [ ! -f "/mnt/$name" ]; then
        what="the file is missing"
    elif [ "$(tr -d '\000' </tmp/chunk | wc -c)" -eq 0 ]; then
        what="reads as zeros"
    else
        what="reads other data"
    fi
    if [ "$name" = "$run_name" ] && [ "$offset" -eq $((run_last + 1)) ] && [ "$what" = "$run_what" ]; then
        run_last=$((offset + length - 1))
        continue
    fi
    report_run
    run_name=$name
    run_first=$offset
    run_last=$((offset + length - 1))
    run_mode=$mode
    run_what=$what
done </mnt/manifest
report_run
umount /mnt
[ "$lost" -eq 0 ] || fail "$lost of $chunks 64 KiB chunks in $files files differ"
[ "$status" -eq 0 ] || exit 1
say "verified $chunks 64 KiB chunks in $files files, e2fsck clean"
