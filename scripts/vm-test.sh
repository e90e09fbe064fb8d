#!/usr/bin/env bash
# Real-VM tests of vouch's crash contract (docs/RELIABILITY.md, "VM tests"),
# run by scripts/test.sh after the cargo tests. Guests are Debian's cloud
# kernel with a busybox initramfs built here, under qemu TCG (this machine's
# /dev/kvm runs only paravirtual guests). The guest side lives in
# scripts/vm/ (init, lib.sh and one script per role).
#
# Scenario A, a guest on a vouch export: `vouch serve` runs on the host and
# the guest's /dev/vda is qemu's NBD client with reconnect-delay. The guest
# makes ext4 and writes files while the host restarts vouch, once with
# SIGTERM and once with kill -9; then a second boot checks every chunk
# checksum, and `vouch check` must be clean.
#
# Scenario B, a power cut on the real file backend: vouch runs inside the
# guest, its volume on ext4 (then xfs) on a virtio disk that is a raw host
# file opened with cache=none. A client in the guest writes records and
# flushes, printing "FLUSHED n" after each flush returns; the host SIGKILLs
# qemu after a varied number of those markers. The next boot reopens the
# volume, reads back every record up to the last FLUSHED n, runs `vouch
# check`, and starts the next cycle's writes.
#
# The vouch binary tested: $VOUCH_BIN, else `cargo build --profile ci -p
# vouch`. Everything built or downloaded is kept under target/vm/. Knobs
# (defaults fit the 10-minute CI budget), for diagnosis: VM_POWER_CUTS (20,
# split over ext4 and xfs), VM_SEED (the kill points; printed), VM_MEMORY
# (MiB, 512), VM_A_RESTARTS (the signals of scenario A's restarts, in order:
# "TERM KILL"), VM_SCENARIOS ("a b").
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VM_DIR=$ROOT/target/vm
GUEST_SCRIPTS=$ROOT/scripts/vm
POWER_CUTS=${VM_POWER_CUTS:-20}
A_RESTARTS=${VM_A_RESTARTS:-TERM KILL}
SCENARIOS=${VM_SCENARIOS:-a b}
SEED=${VM_SEED:-$(date +%s)}
MEMORY_MIB=${VM_MEMORY:-512}
# Bounds on waiting for the guest: TCG is slow, and a machine shared with
# other jobs slower still, so these are generous; they only end a hung run.
BOOT_TIMEOUT_S=180
MARKER_TIMEOUT_S=240

declare -a CLEANUP_PIDS=()
cleanup() {
    # A phase a failure ended still gets its time printed.
    [ -z "${PHASE_NAME:-}" ] || phase ""
    local pid
    for pid in "${CLEANUP_PIDS[@]}"; do
        kill -9 "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT

die() {
    echo "vm-test: FAIL: $*" >&2
    exit 1
}

note() {
    echo "vm-test: $*"
}

# Phase timing: each phase's wall time is printed, and the total at the end.
PHASE_NAME=""
PHASE_START=0
phase() {
    local now
    now=$(date +%s.%N)
    if [ -n "$PHASE_NAME" ]; then
        note "$(awk -v name="$PHASE_NAME" -v start="$PHASE_START" -v now="$now" \
            'BEGIN { printf "phase %-30s %6.1f s", name, now - start }')"
    fi
    PHASE_NAME=$1
    PHASE_START=$now
}
TOTAL_START=$(date +%s.%N)

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# ---------------------------------------------------------------- setup

# qemu-system-x86 must come from the suite qemu-utils came from, or apt
# refuses the pair (they share qemu-block-extra's version). Here
# qemu-utils is from bookworm-backports, so that source is added when
# the machine lacks it.
install_qemu_system() {
    local utils_version target=()
    utils_version=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)
    case "$utils_version" in
    *bpo12*)
        target=(-t bookworm-backports)
        if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
            note "adding the bookworm-backports apt source (qemu-utils $utils_version is from it)"
            printf '%s\n' "Types: deb" "URIs: http://deb.debian.org/debian" \
                "Suites: bookworm-backports" "Components: main" \
                "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" |
                as_root tee /etc/apt/sources.list.d/bookworm-backports.sources >/dev/null
        fi
        ;;
    esac
    local command=(apt-get install -y -q --no-install-recommends "${target[@]}" qemu-system-x86)
    note "installing qemu-system-x86: ${command[*]}"
    as_root apt-get update -q >/dev/null &&
        DEBIAN_FRONTEND=noninteractive as_root "${command[@]}" >/dev/null ||
        die "could not install qemu-system-x86; run: apt-get update && ${command[*]}"
}

install_packages() {
    local command=(apt-get install -y -q --no-install-recommends "$@")
    note "installing: $*"
    as_root apt-get update -q >/dev/null &&
        DEBIAN_FRONTEND=noninteractive as_root "${command[@]}" >/dev/null ||
        die "could not install $*; run: apt-get update && ${command[*]}"
}

setup_host_tools() {
    command -v qemu-system-x86_64 >/dev/null || install_qemu_system
    local need=()
    # busybox-static: the guest's userland must not depend on the host's
    # libc layout (the dynamic busybox package would).
    [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1 || need+=(busybox-static)
    command -v qemu-io >/dev/null || need+=(qemu-utils)
    command -v mke2fs >/dev/null || need+=(e2fsprogs)
    command -v mkfs.xfs >/dev/null || need+=(xfsprogs)
    command -v strip >/dev/null || need+=(binutils)
    [ ${#need[@]} -eq 0 ] || install_packages "${need[@]}"
    # Checked again: an install that "succeeded" without the tool is a failure.
    local tool
    for tool in qemu-system-x86_64 qemu-io mke2fs e2fsck mkfs.xfs strip; do
        command -v "$tool" >/dev/null || die "$tool is still missing after the install"
    done
    ldd /bin/busybox >/dev/null 2>&1 &&
        die "/bin/busybox is dynamic; run: apt-get install -y busybox-static"
    return 0
}

# Debian's cloud kernel, downloaded and unpacked under target/vm (never
# installed into the host). The meta package names the versioned one.
KERNEL_ROOT=""
KERNEL_RELEASE=""
setup_kernel() {
    local package
    package=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
        sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -n 1)
    if [ -z "$package" ]; then
        as_root apt-get update -q >/dev/null || true
        package=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
            sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -n 1)
    fi
    [ -n "$package" ] ||
        die "apt knows no linux-image-cloud-amd64; run: apt-get update && apt-cache depends linux-image-cloud-amd64"
    KERNEL_RELEASE=${package#linux-image-}
    KERNEL_ROOT=$VM_DIR/kernel/$KERNEL_RELEASE
    if [ ! -f "$KERNEL_ROOT/boot/vmlinuz-$KERNEL_RELEASE" ]; then
        note "downloading $package"
        rm -rf "$VM_DIR/deb" "$KERNEL_ROOT"
        mkdir -p "$VM_DIR/deb" "$KERNEL_ROOT"
        (cd "$VM_DIR/deb" && apt-get download "$package" >/dev/null 2>&1) ||
            die "could not download $package; run: apt-get update && (cd $VM_DIR/deb && apt-get download $package)"
        dpkg -x "$VM_DIR"/deb/"$package"_*.deb "$KERNEL_ROOT"
        rm -rf "$VM_DIR/deb"
    fi
    note "kernel $KERNEL_RELEASE"
}

# The modules the guest needs, in load order: each module's dependencies
# (its "depends=" field, read from the .ko) come before it.
GUEST_MODULES=(virtio_pci virtio_blk xfs)
declare -A MODULE_DONE=()
MODULE_ORDER=()
module_path() {
    local found
    found=$(find "$KERNEL_ROOT/lib/modules/$KERNEL_RELEASE/kernel" \
        \( -name "$1.ko" -o -name "${1//_/-}.ko" \) | head -n 1)
    [ -n "$found" ] || die "module $1 not in $KERNEL_RELEASE (built in? then drop it from GUEST_MODULES)"
    echo "$found"
}
resolve_module() {
    local name=$1 path depends dependency
    [ -z "${MODULE_DONE[$name]:-}" ] || return 0
    MODULE_DONE[$name]=1
    path=$(module_path "$name")
    depends=$(tr '\0' '\n' <"$path" | sed -n 's/^depends=//p' | head -n 1)
    for dependency in ${depends//,/ }; do
        resolve_module "$dependency"
    done
    MODULE_ORDER+=("$path")
}

# install_binary DEST BINARY [NAME]: BINARY to DEST/usr/local/bin/NAME and
# every shared library ldd lists to the same path under DEST.
install_binary() {
    local dest=$1 binary=$2 name=${3:-$(basename "$2")} library
    mkdir -p "$dest/usr/local/bin"
    cp -L "$binary" "$dest/usr/local/bin/$name"
    for library in $(ldd "$binary" | grep -o '/[^ ]*'); do
        mkdir -p "$dest$(dirname "$library")"
        cp -L "$library" "$dest$library"
    done
}

# The initramfs: busybox, the guest scripts, the modules, and the binaries
# the roles run (vouch, qemu-io as the NBD client inside the guest, mke2fs
# and e2fsck) with their libraries. Rebuilt on every run (a few seconds):
# the vouch binary under test changes.
INITRAMFS=$VM_DIR/initramfs.cpio
build_initramfs() {
    local stage=$VM_DIR/initramfs path
    rm -rf "$stage"
    mkdir -p "$stage"/{bin,proc,sys,dev,tmp,mnt,etc,vm,lib/modules}
    cp /bin/busybox "$stage/bin/busybox"
    ln -s busybox "$stage/bin/sh"
    install -m 0755 "$GUEST_SCRIPTS/init" "$stage/init"
    install -m 0644 "$GUEST_SCRIPTS/lib.sh" "$stage/vm/lib.sh"
    install -m 0755 "$GUEST_SCRIPTS"/*-*.sh "$stage/vm/"
    local module
    for module in "${GUEST_MODULES[@]}"; do resolve_module "$module"; done
    : >"$stage/lib/modules/load-order"
    for path in "${MODULE_ORDER[@]}"; do
        cp "$path" "$stage/lib/modules/"
        basename "$path" >>"$stage/lib/modules/load-order"
    done
    install_binary "$stage" "$VOUCH" vouch
    local tool
    for tool in qemu-io mke2fs e2fsck; do
        install_binary "$stage" "$(command -v "$tool")"
    done
    # The ci profile keeps line tables; the guest needs none of it, and a
    # smaller initramfs boots faster.
    strip "$stage/usr/local/bin/vouch"
    [ -f /etc/mke2fs.conf ] && cp /etc/mke2fs.conf "$stage/etc/"
    # The key of scenario B's encrypted volume (the same for every boot of
    # a run, as it is in this initramfs).
    head -c 32 /dev/urandom >"$stage/vm/test.key"
    (cd "$stage" && find . | busybox cpio -o -H newc 2>/dev/null) >"$INITRAMFS"
    note "initramfs $(du -h "$INITRAMFS" | cut -f1), modules: ${MODULE_ORDER[*]##*/}"
}

# ---------------------------------------------------------------- guests

# boot_guest LOG ROLE_ARGS QEMU_DRIVE_ARGS...: start a guest in the
# background; its serial console goes to LOG. Sets GUEST_PID.
GUEST_PID=""
boot_guest() {
    local log=$1 role_args=$2
    shift 2
    : >"$log"
    qemu-system-x86_64 -accel tcg -M pc -cpu max -smp 1 -m "$MEMORY_MIB" \
        -nographic -monitor none -serial "file:$log" -nic none -no-reboot \
        -kernel "$KERNEL_ROOT/boot/vmlinuz-$KERNEL_RELEASE" -initrd "$INITRAMFS" \
        -append "console=ttyS0 quiet panic=-1 $role_args" \
        "$@" </dev/null >"$log.qemu" 2>&1 &
    GUEST_PID=$!
    CLEANUP_PIDS+=("$GUEST_PID")
}

# wait_marker LOG PATTERN PID: poll LOG until a line matches the extended
# regex PATTERN; fails when the process PID exits first or on the bound.
wait_marker() {
    local log=$1 pattern=$2 pid=$3 deadline=$((SECONDS + MARKER_TIMEOUT_S))
    until grep -Eq "$pattern" "$log"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            grep -Eq "$pattern" "$log" && return 0
            guest_trouble "$log" "the guest stopped before printing /$pattern/"
        fi
        [ "$SECONDS" -lt "$deadline" ] ||
            guest_trouble "$log" "no /$pattern/ within ${MARKER_TIMEOUT_S}s"
        sleep 0.02
    done
}

# guest_trouble LOG MESSAGE: fail with the guest's console.
guest_trouble() {
    echo "---- $1" >&2
    tail -n 60 "$1" >&2 || true
    [ -s "$1.qemu" ] && { echo "---- qemu:" >&2; cat "$1.qemu" >&2; }
    die "$2"
}

# guest_finished LOG PID: wait (bounded) for the guest to power off;
# status 0 when its role exited 0, 1 when it failed, so the caller can say
# what was lost.
guest_finished() {
    local log=$1 pid=$2 deadline=$((SECONDS + BOOT_TIMEOUT_S))
    while kill -0 "$pid" 2>/dev/null; do
        [ "$SECONDS" -lt "$deadline" ] || guest_trouble "$log" "the guest did not power off within ${BOOT_TIMEOUT_S}s"
        sleep 0.1
    done
    wait "$pid" || guest_trouble "$log" "qemu exited with status $?"
    grep -q '^@@vm exit 0' "$log"
}

# wait_guest_exit LOG PID: guest_finished, its role's failure fatal.
wait_guest_exit() {
    guest_finished "$1" "$2" || guest_trouble "$1" "the guest role failed"
}

# ---------------------------------------------------------------- vouch on the host

SERVE_PID=""
SERVE_PORT=""
# serve_start LOG ARGS...: `vouch serve ARGS`, waiting for "serving on".
serve_start() {
    local log=$1 deadline=$((SECONDS + 60))
    shift
    : >"$log"
    "$VOUCH" serve "$@" >"$log" 2>"$log.err" </dev/null &
    SERVE_PID=$!
    CLEANUP_PIDS+=("$SERVE_PID")
    until grep -q '^vouch: serving on nbd://' "$log"; do
        kill -0 "$SERVE_PID" 2>/dev/null || {
            cat "$log.err" >&2
            die "vouch serve $* exited before serving"
        }
        [ "$SECONDS" -lt "$deadline" ] || die "vouch serve $* not serving within 60s"
        sleep 0.05
    done
    SERVE_PORT=$(sed -n 's|^vouch: serving on nbd://127\.0\.0\.1:\([0-9]*\).*|\1|p' "$log" | head -n 1)
}

# serve_stop SIGNAL: stop the host's vouch serve and wait for it.
serve_stop() {
    kill "-$1" "$SERVE_PID"
    local status=0
    # (2>/dev/null: bash's "Killed" notice for the kill -9.)
    wait "$SERVE_PID" 2>/dev/null || status=$?
    if [ "$1" = TERM ] && [ "$status" -ne 0 ]; then
        die "vouch serve exited with status $status on SIGTERM"
    fi
}

# ---------------------------------------------------------------- scenario A

scenario_a() {
    local dir=$VM_DIR/run/a
    rm -rf "$dir"
    mkdir -p "$dir"
    # The control disk: the host writes "stop" into it to end the guest's
    # stream of writes (the guest polls it with O_DIRECT reads).
    truncate -s 1M "$dir/control.raw"

    phase "A: stream, restarts: $A_RESTARTS"
    serve_start "$dir/serve-0.log" --create 1G "$dir/vol" --listen 127.0.0.1:0 --journal 64M
    local port=$SERVE_PORT
    local nbd="driver=nbd,server.type=inet,server.host=127.0.0.1,server.port=$port,export=vol,reconnect-delay=30"
    local drives=(
        -drive "$nbd,if=virtio,cache.direct=on"
        -drive "file=$dir/control.raw,if=virtio,format=raw,cache=none"
    )
    local log=$dir/write.console
    boot_guest "$log" "vm.role=a-write" "${drives[@]}"
    local guest=$GUEST_PID

    # Each restart once the guest wrote at least three more files (through
    # the current server), when it starts writing a file with O_DIRECT
    # (the odd ones, 2-4 MiB in 64 KiB writes): the restart lands inside
    # that stream of acknowledged, unflushed writes, which goes on after.
    local signal restarts="" written=0 count=0 target
    for signal in $A_RESTARTS; do
        target=$((written + 3))
        [ $((target % 2)) -eq 1 ] || target=$((target + 1))
        wait_marker "$log" "^@@vm writing $target " "$guest"
        serve_stop "$signal"
        written=$(last_written "$log")
        count=$((count + 1))
        serve_start "$dir/serve-$count.log" "$dir/vol" --listen "127.0.0.1:$port"
        restarts+="${restarts:+, }SIG$signal while the guest wrote f$target"
        note "A: SIG$signal restart while the guest wrote f$target"
    done
    # Let the guest write through the last server, then stop the stream.
    wait_marker "$log" "^@@vm wrote $((written + 3)) " "$guest"
    printf 'stop' | dd of="$dir/control.raw" conv=notrunc status=none
    wait_guest_exit "$log" "$guest"
    note "A: the guest wrote $(last_written "$log") files without an I/O error"

    phase "A: reboot, verify checksums"
    log=$dir/verify.console
    boot_guest "$log" "vm.role=a-verify" "${drives[@]}"
    guest=$GUEST_PID
    if ! guest_finished "$log" "$guest"; then
        echo "---- guest console (verify boot), all of it in $log:" >&2
        grep -E '^@@vm|EXT4-fs|I/O error' "$log" >&2 || true
        die "A: data lost across the vouch restarts ($restarts):
$(sed -n 's/^@@vm LOST /  lost: /p' "$log")
$(sed -n 's/^@@vm FAIL /  /p' "$log")"
    fi
    note "A: $(sed -n 's/^@@vm \(verified .*\)/\1/p' "$log")"

    phase "A: vouch check"
    serve_stop TERM
    "$VOUCH" check "$dir/vol" >"$dir/check.out" 2>&1 || {
        cat "$dir/check.out" >&2
        die "A: vouch check $dir/vol is not clean"
    }
}

last_written() {
    sed -n 's/^@@vm wrote \([0-9]*\) .*/\1/p' "$1" | tail -n 1
}

# ---------------------------------------------------------------- scenario B

# power_cut_chain FS CYCLES VOLUME_ARGS: CYCLES boots on one disk; each
# verifies the previous cycle, runs `vouch check`, writes until the host
# SIGKILLs qemu. A last boot verifies the last cycle without writing.
# VOLUME_ARGS (vm.layout=..., vm.encrypt=...) choose the volume's kind.
power_cut_chain() {
    local fs=$1 cycles=$2 volume_args=$3 dir=$VM_DIR/run/b-$1
    rm -rf "$dir"
    mkdir -p "$dir"
    truncate -s 512M "$dir/disk.raw"
    case "$fs" in
    ext4) mke2fs -q -t ext4 -F "$dir/disk.raw" ;;
    xfs) mkfs.xfs -q -f "$dir/disk.raw" ;;
    esac
    local drives=(-drive "file=$dir/disk.raw,if=virtio,format=raw,cache=none")
    local cycle flushed=-1 kill_after log summary=""
    # The kill points: after 1..10 FLUSHED markers, from the seed.
    RANDOM=$((SEED + ${#fs}))
    for ((cycle = 0; cycle <= cycles; cycle++)); do
        log=$dir/cycle-$cycle.console
        local write=1
        [ "$cycle" -lt "$cycles" ] || write=0
        boot_guest "$log" "vm.role=b-cycle vm.fs=$fs vm.cycle=$cycle vm.flushed=$flushed vm.write=$write $volume_args" \
            "${drives[@]}"
        local guest=$GUEST_PID
        if [ "$write" -eq 0 ]; then
            guest_finished "$log" "$guest" || b_failed "$fs" "$cycle" "$log"
            break
        fi
        kill_after=$((RANDOM % 10))
        wait_marker "$log" "^@@vm (FLUSHED $kill_after\$|FAIL)" "$guest"
        grep -q '^@@vm FAIL' "$log" && b_failed "$fs" "$cycle" "$log"
        # The power cut: qemu dies with whatever the guest had not written.
        # The marker only places the cut coarsely (the next record's
        # write is starting); a random 0-0.9 s on top spreads it over that
        # record's write and flush. Not a synchronisation: any point is
        # a valid one to cut at.
        sleep "0.$((RANDOM % 10))"
        kill -9 "$guest"
        wait "$guest" 2>/dev/null || true
        flushed=$(sed -n 's/^@@vm FLUSHED \([0-9]*\)$/\1/p' "$log" | tail -n 1)
        summary+=" $flushed"
    done
    note "B/$fs ($volume_args): $cycles power cuts, last flushed record per cycle:$summary; every flushed record read back, vouch check clean after each"
}

b_failed() {
    local fs=$1 cycle=$2 log=$3
    echo "---- guest console (B/$fs cycle $cycle), all of it in $log:" >&2
    grep -E '^@@vm|I/O error|EXT4-fs|XFS' "$log" >&2 || true
    die "B/$fs: after power cut $cycle:
$(sed -n 's/^@@vm LOST /  lost: /p' "$log")
$(sed -n 's/^@@vm FAIL /  /p' "$log")"
}

scenario_b() {
    local ext4_cuts=$(((POWER_CUTS + 1) / 2)) xfs_cuts=$((POWER_CUTS / 2))
    # Two routes each: split and encrypted on ext4, packed (data in the
    # journal) on xfs.
    phase "B: $ext4_cuts power cuts on ext4"
    power_cut_chain ext4 "$ext4_cuts" "vm.layout=split vm.encrypt=1"
    phase "B: $xfs_cuts power cuts on xfs"
    power_cut_chain xfs "$xfs_cuts" "vm.layout=packed vm.encrypt=0"
}

# ---------------------------------------------------------------- main

phase "setup"
setup_host_tools
setup_kernel
if [ -n "${VOUCH_BIN:-}" ]; then
    VOUCH=$VOUCH_BIN
else
    cargo build --profile ci -p vouch -q
    VOUCH=$ROOT/target/ci/vouch
fi
[ -x "$VOUCH" ] || die "no vouch binary at $VOUCH"
note "vouch binary $VOUCH, seed $SEED"
build_initramfs

# Each scenario in a subshell: a failed one is reported and the next still
# runs, so one run shows every failure. (set -e again inside: errexit is
# off in the caller around it, and a subshell inherits that.)
passed=0
failed=0
phase ""
for scenario in $SCENARIOS; do
    case "$scenario" in
    a | b) ;;
    *) die "VM_SCENARIOS: no scenario '$scenario' (a, b)" ;;
    esac
    set +e
    (
        set -e
        # The subshell's own processes (its CLEANUP_PIDS) end with it.
        trap cleanup EXIT
        "scenario_$scenario"
        phase ""
    )
    status=$?
    set -e
    if [ "$status" -eq 0 ]; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        note "scenario $scenario FAILED (above)"
    fi
done
note "$(awk -v start="$TOTAL_START" -v now="$(date +%s.%N)" 'BEGIN { printf "total %.1f s", now - start }')"
echo "vm-test: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
