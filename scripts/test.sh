#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs the Debian packages
# the tests drive (real NBD clients, fio, nbdfuse, systemd-socket-activate,
# dpkg-dev for the package), then runs formatting,
# lints and every test. Used by .ci/run as is.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v qemu-img >/dev/null 2>&1 || need+=(qemu-utils)
command -v nbdinfo >/dev/null 2>&1 || need+=(libnbd-bin)
command -v nbdcopy >/dev/null 2>&1 || need+=(libnbd-bin)
command -v nbdfuse >/dev/null 2>&1 || need+=(nbdfuse)
command -v nbdkit >/dev/null 2>&1 || need+=(nbdkit)
command -v fio >/dev/null 2>&1 || need+=(fio)
command -v mkfs.ext4 >/dev/null 2>&1 || need+=(e2fsprogs)
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v mkfs.btrfs >/dev/null 2>&1 || need+=(btrfs-progs)
command -v mkfs.xfs >/dev/null 2>&1 || need+=(xfsprogs)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v systemd-socket-activate >/dev/null 2>&1 || need+=(systemd)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
command -v dpkg-shlibdeps >/dev/null 2>&1 || need+=(dpkg-dev)
command -v sysctl >/dev/null 2>&1 || need+=(procps)
/usr/bin/python3 -c 'import nbd' >/dev/null 2>&1 || need+=(python3-libnbd)
if [ ${#need[@]} -gt 0 ]; then
    echo "installing: ${need[*]}"
    if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${need[@]}"
fi

# The held logs of the volumes the tests make and kill go to a directory
# of this run (removed at the end), not to /dev/shm where a killed
# server's would stay until the next boot.
if [ -z "${VOUCH_RUNTIME_DIR:-}" ]; then
    VOUCH_RUNTIME_DIR=$(mktemp -d /tmp/vouch-test-runtime.XXXXXX)
    export VOUCH_RUNTIME_DIR
    trap 'rm -rf "$VOUCH_RUNTIME_DIR"' EXIT
fi

cargo fmt --all --check
cargo clippy --workspace --all-targets --profile ci -- -D warnings
# The fuzz targets live in their own workspace (cargo-fuzz runs them on
# nightly, instrumented): they must keep building, linked against
# libFuzzer, with their lockfile current, against the crates they drive.
# Built here on stable without the instrumentation (a dev build: overflow
# checks on). Their bodies also run on stable in
# crates/sim/tests/fuzz_bodies.rs.
cargo build --manifest-path fuzz/Cargo.toml --bins --locked
cargo test --workspace --profile ci --no-fail-fast
# The real-VM tests (qemu TCG guests, about 5 minutes): they install what
# they need themselves (qemu-system-x86 from qemu-utils' own suite,
# busybox-static) and download Debian's cloud kernel under target/vm/.
./scripts/vm-test.sh
