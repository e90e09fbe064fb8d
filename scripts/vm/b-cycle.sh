#!/bin/sh
# Scenario B, one boot of a power-cut chain: vouch runs here, in the guest,
# its volume a file on ext4 or xfs on /dev/vda (a raw host file that qemu
# opens with cache=none, so nothing survives a SIGKILL of qemu but what
# the guest had written out). Arguments on the kernel command line:
#   vm.fs       ext4 or xfs (the host made the file system)
#   vm.cycle    0 creates the volume; later cycles reopen it (recovery)
#   vm.flushed  the last "FLUSHED n" the previous cycle printed before the
#               host killed qemu (-1: none to check)
#   vm.write    1: start the next cycle's writes; 0: verify only
#   vm.layout   split or packed (used when cycle 0 creates the volume)
#   vm.encrypt  1: the volume is encrypted, its key /vm/test.key (32 bytes
#               the host put in the initramfs)
# Steps: mount (the file system's own journal recovery), serve the volume,
# read back records 0..flushed as the previous cycle wrote them, stop
# vouch (SIGTERM), `vouch check`, then serve again and write records,
# each followed by a flush, printing "FLUSHED n" once the flush returned,
# until the host pulls the plug.
. /vm/lib.sh

fs=$(arg fs)
cycle=$(arg cycle)
flushed=$(arg flushed)
write=$(arg write)
layout=$(arg layout)
create_options="--layout $layout"
if [ "$(arg encrypt)" = 1 ]; then
    create_options="$create_options --encrypt"
    # Every vouch command below (serve, check) takes the key from here.
    export VOUCH_KEY_FILE=/vm/test.key
fi
PORT=10809
URI=nbd://127.0.0.1:$PORT
MAX_RECORDS=40

# Record n: at n * 2 MiB, one of these lengths (KiB), every byte of it
# pattern(cycle, n). Consecutive cycles write different patterns to the
# same offsets, so an overwrite that did not survive reads back wrong.
# In the split layout a flush of at most 256 KiB travels in vouch's
# journal (a redo record), a larger one is written home and fdatasynced
# there: both routes occur. (The packed layout journals all data.)
LENGTHS="4 60 1024 8 516 2048"
STRIDE=2097152
record_length_kib() {
    n=$1
    set -- $LENGTHS
    shift $((n % $#))
    echo "$1"
}
pattern() {
    echo $((($1 * 7 + $2 * 13) % 251 + 1))
}

# serve ARGS...: start vouch serve in the background, wait until it serves.
serve() {
    : >/tmp/serve.out
    vouch serve "$@" --listen "127.0.0.1:$PORT" --log warn >/tmp/serve.out 2>/tmp/serve.err &
    SERVE_PID=$!
    tries=0
    until grep -q '^vouch: serving on' /tmp/serve.out; do
        if ! kill -0 "$SERVE_PID" 2>/dev/null; then
            while read -r line; do say "vouch: $line"; done </tmp/serve.err
            fail "vouch serve $* exited before serving"
        fi
        tries=$((tries + 1))
        [ "$tries" -le 1200 ] || fail "vouch serve $* not serving after 120 s"
        sleep 0.1
    done
}

stop_serving() {
    kill -TERM "$SERVE_PID"
    wait "$SERVE_PID" || fail "vouch serve exited with status $? on SIGTERM"
}

wait_for_device /dev/vda
mount -t "$fs" /dev/vda /mnt || fail "mount -t $fs /dev/vda"
# Odd cycles serve with --direct (O_DIRECT on the volume's files), even
# ones through the guest's page cache: both must be durable at a flush.
direct=""
[ $((cycle % 2)) -eq 1 ] && direct=--direct
if [ "$cycle" -eq 0 ]; then
    serve --create 96M --journal 16M $create_options /mnt/vol
else
    serve $direct /mnt/vol
fi
say "serving (cycle $cycle on $fs, ${direct:-page cache}, $create_options)"

if [ "$flushed" -ge 0 ]; then
    previous=$((cycle - 1))
    set --
    n=0
    while [ "$n" -le "$flushed" ]; do
        set -- "$@" -c "read -P $(pattern "$previous" "$n") $((n * STRIDE)) $(record_length_kib "$n")k"
        n=$((n + 1))
    done
    if ! qemu-io -f raw "$@" "$URI" >/tmp/verify 2>&1; then
        # qemu-io names each failed read by its offset: map it to a record.
        grep -i 'fail\|error' /tmp/verify | while read -r line; do
            offset=$(echo "$line" | sed -n 's/.*at offset \([0-9]*\).*/\1/p')
            if [ -n "$offset" ]; then
                say "LOST record $((offset / STRIDE)) (offset $offset, cycle $previous, pattern $(pattern "$previous" $((offset / STRIDE)))): $line"
            else
                say "qemu-io: $line"
            fi
        done
        fail "records 0..$flushed of cycle $previous, all flushed before the power cut, do not read back"
    fi
    say "verified records 0..$flushed of cycle $previous"
fi
stop_serving
vouch check /mnt/vol >/tmp/check 2>&1 || {
    while read -r line; do say "check: $line"; done </tmp/check
    fail "vouch check /mnt/vol is not clean"
}
say "check clean"

if [ "$write" -ne 1 ]; then
    umount /mnt || fail "umount /mnt"
    exit 0
fi
serve $direct /mnt/vol
n=0
while [ "$n" -lt "$MAX_RECORDS" ]; do
    qemu-io -f raw -c "write -P $(pattern "$cycle" "$n") $((n * STRIDE)) $(record_length_kib "$n")k" \
        -c flush "$URI" >/tmp/write 2>&1 || {
        while read -r line; do say "qemu-io: $line"; done </tmp/write
        fail "write or flush of record $n"
    }
    say "FLUSHED $n"
    n=$((n + 1))
done
# The host kills qemu after at most MAX_RECORDS markers; if it has not,
# say so and stay up so that the host reports it.
say "FAIL the writer ran out of records ($MAX_RECORDS) before the power cut"
exit 1
