#!/bin/sh
# Scenario A, first boot: the guest's /dev/vda is a vouch export on the host
# (qemu's NBD client, reconnect-delay=30). Make ext4 on it and write a
# stream of files until the host writes "stop" into the control disk
# /dev/vdb; meanwhile the host restarts vouch with SIGTERM and with kill -9.
# No write, sync or unmount may fail, and the kernel must log no I/O error.
#
# Each file's content is random; its checksum per 64 KiB chunk goes to a
# manifest (name, offset, length, mode, sha256) (kept in RAM, written to the volume at the end) so that the
# second boot (a-verify.sh) can name every chunk that did not survive.
. /vm/lib.sh

wait_for_device /dev/vda
wait_for_device /dev/vdb
# The full path: busybox sh runs its own ext2-only mke2fs applet first.
/usr/local/bin/mke2fs -q -t ext4 /dev/vda || fail "mke2fs -t ext4 /dev/vda"
mount -t ext4 /dev/vda /mnt || fail "mount /dev/vda"

CHUNK=65536
# Mixed sizes, in KiB: odd files are written with O_DIRECT in 64 KiB
# writes, 2-4 MiB each so that a restart lands inside one (the host
# restarts vouch on the "writing" marker of such a file); even files go
# through the page cache, 4 KiB to 1 MiB.
DIRECT_SIZES="2048 4096 3072"
BUFFERED_SIZES="68 4 1024 260 12"
MAX_FILES=400
: >/tmp/manifest
n=0
while :; do
    control=$(dd if=/dev/vdb bs=512 count=1 iflag=direct 2>/dev/null | head -c 4)
    [ "$control" = stop ] && break
    n=$((n + 1))
    [ "$n" -le "$MAX_FILES" ] || fail "the host never wrote stop into /dev/vdb"
    if [ $((n % 2)) -eq 1 ]; then
        mode=direct
        set -- $DIRECT_SIZES
    else
        mode=buffered
        set -- $BUFFERED_SIZES
    fi
    shift $(((n / 2) % $#))
    size_kib=$1
    head -c $((size_kib * 1024)) /dev/urandom >/tmp/file || fail "making file $n"
    # The checksums first, so that the write follows its "writing" marker
    # at once.
    offset=0
    while [ "$offset" -lt $((size_kib * 1024)) ]; do
        length=$((size_kib * 1024 - offset))
        [ "$length" -le "$CHUNK" ] || length=$CHUNK
        sum=$(dd if=/tmp/file bs=$CHUNK skip=$((offset / CHUNK)) count=1 2>/dev/null | sha256sum)
        echo "f$n $offset $length $mode ${sum%% *}" >>/tmp/manifest
        offset=$((offset + CHUNK))
    done
    say "writing $n ${size_kib}KiB $mode"
    # O_DIRECT writes go to /dev/vda as they are made: each is acknowledged
    # by vouch and none is flushed until ext4's next journal commit (every
    # 5 s) or the sync below; a kill -9 of vouch must not lose them. The
    # page cache's are written back by the kernel, every fourth file synced.
    if [ "$mode" = direct ]; then
        dd if=/tmp/file of="/mnt/f$n" bs=64k oflag=direct 2>/tmp/dd.err ||
            fail "write f$n: $(cat /tmp/dd.err)"
    else
        cp /tmp/file "/mnt/f$n" || fail "write f$n"
        if [ $((n % 4)) -eq 0 ]; then
            sync || fail "sync after f$n"
        fi
    fi
    say "wrote $n ${size_kib}KiB $mode"
done

sync || fail "sync at the end of the stream"
cp /tmp/manifest /mnt/manifest || fail "write the manifest"
sync || fail "sync of the manifest"
umount /mnt || fail "umount /mnt"
errors=$(dmesg | grep -ciE 'I/O error|EXT4-fs error|blk_update_request|critical')
if [ "$errors" -ne 0 ]; then
    dmesg | grep -iE 'I/O error|EXT4-fs error|blk_update_request|critical' |
        while read -r line; do say "dmesg: $line"; done
    fail "the kernel logged $errors I/O errors"
fi
say "stream done: $n files, no I/O error"
