#!/usr/bin/env bash
# The generator of the compatibility corpus (issue 33), kept for the record.
#
# NEVER re-run it to overwrite the corpus: the corpus is the format as a
# binary of the past wrote it, and its whole value is that it does not
# change when the format does. This script refuses to run while any
# archive it would write exists. A new corpus volume (a later format) gets
# a new archive name made by a new script, beside these.
#
# Usage (from the repository root, with the binary to record built):
#   VOUCH=target/ci/vouch tests/corpus/make.sh
# It works in /tmp/vouch-corpus (a fixed path: a mirror's record names its
# legs by absolute path, and the test rewrites that prefix), writes
# tests/corpus/NAME.tar.gz for every volume and prints the lines of the
# README's table (sha256 of each exported image, computed from the data
# model below and cross-checked against `vouch export` of an unpacked copy).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
VOUCH=$(realpath "${VOUCH:-target/ci/vouch}")
PYTHON=/usr/bin/python3 # python3-nbd lives here (a pyenv python3 hides it)
WORK=/tmp/vouch-corpus
KEY=$here/test-only.key

if compgen -G "$here/*.tar.gz" >/dev/null; then
    echo "make.sh: $here already holds corpus archives; the corpus is never regenerated (see README.md)" >&2
    exit 2
fi
if [ -e "$WORK" ]; then
    echo "make.sh: $WORK exists; remove it first" >&2
    exit 2
fi
mkdir -p "$WORK/run" "$WORK/check"
export VOUCH_RUNTIME_DIR=$WORK/run
SERVER_PID=
trap '[ -n "$SERVER_PID" ] && kill -9 "$SERVER_PID" 2>/dev/null; rm -rf "$WORK"' EXIT

# The test-only key of the encrypted volumes: 32 bytes anyone can derive.
if [ ! -e "$KEY" ]; then
    printf 'vouch compatibility corpus: a test-only key, never a secret' | sha256sum | cut -c1-64 | xxd -r -p >"$KEY"
fi

# The data model and NBD writer. Block at LBA n written with tag T holds the
# 16-byte line "%-7s%08x\n" % (T, n) 256 times; trimmed and zeroed blocks
# read as zeros; never-written blocks read as zeros. Ops: w:START:COUNT
# (write), t:START:COUNT (trim), z:START:COUNT (write zeroes), f (flush).
# With a URI it runs them against the server; it always prints the sha256
# of the image the model says the volume exports.
cat >"$WORK/ops.py" <<'PY'
import hashlib, sys
uri, tag, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
ops = sys.argv[4:]
B = 4096
assert len(tag) <= 7, "a tag is at most 7 characters"
def block(n):
    return (("%-7s%08x\n" % (tag, n)) * 256).encode()
image = bytearray(size)
h = None
if uri != "-":
    import nbd
    h = nbd.NBD()
    h.connect_uri(uri)
for op in ops:
    if op == "f":
        if h: h.flush()
        continue
    kind, start, count = op.split(":")
    start, count = int(start), int(count)
    if kind == "w":
        for first in range(start, start + count, 16):
            n = min(16, start + count - first)
            buf = b"".join(block(l) for l in range(first, first + n))
            image[first * B:(first + n) * B] = buf
            if h: h.pwrite(buf, first * B)
    elif kind in ("t", "z"):
        image[start * B:(start + count) * B] = bytes(count * B)
        if h:
            (h.trim if kind == "t" else h.zero)(count * B, start * B)
    else:
        raise SystemExit("unknown op " + op)
if h: h.shutdown()
print(hashlib.sha256(image).hexdigest())
PY

SIZE=$((4 << 20))
WRITES="w:0:64 w:256:4 w:511:2 w:1000:24 f"
# Ciphertext does not compress: the encrypted volumes write fewer blocks.
WRITES_ENCRYPTED="w:0:8 w:256:4 w:511:2 w:1020:4 f"

# serve VOLUME_DIR [serve args...]: start `vouch serve` on a unix socket and
# wait for it; sets SERVER_PID and SOCKET.
serve() {
    local volume=$1
    shift
    SOCKET=$WORK/nbd.sock
    rm -f "$SOCKET" "$WORK/serve.out"
    "$VOUCH" serve "$volume" --socket "$SOCKET" --name corpus "$@" >"$WORK/serve.out" 2>"$WORK/serve.err" &
    SERVER_PID=$!
    for _ in $(seq 600); do
        grep -q "serving on nbd+unix" "$WORK/serve.out" && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/serve.err" >&2; exit 1; }
        sleep 0.1
    done
    echo "server did not start" >&2
    exit 1
}

# make NAME TAG STOP(clean|kill9) CREATE_ARGS... -- OPS...
make_volume() {
    local name=$1 tag=$2 stop=$3
    shift 3
    local create=() ops=()
    while [ "$1" != "--" ]; do create+=("$1"); shift; done
    shift
    ops=("$@")
    local dir=$WORK/$name leg0=$WORK/$name
    local serve_args=()
    if [ "${create[0]:-}" = --mirror ]; then
        mkdir -p "$dir"
        leg0=$dir/leg0
        create=(--mirror "$dir/leg1" "${create[@]:1}")
    fi
    if printf '%s\n' "${create[@]}" | grep -q -- --encrypt; then
        serve_args+=(--key-file "$KEY")
    fi
    "$VOUCH" create "$leg0" --size $SIZE --journal 1M "${create[@]}" >/dev/null
    serve "$leg0" "${serve_args[@]}"
    local expected
    expected=$("$PYTHON" "$WORK/ops.py" "nbd+unix:///corpus?socket=$SOCKET" "$tag" $SIZE "${ops[@]}")
    if [ "$stop" = kill9 ]; then
        # Acknowledged and flushed, not yet checkpointed: the journal holds
        # them and the next open replays it.
        kill -9 "$SERVER_PID"
        wait "$SERVER_PID" || true
        SERVER_PID=
        # The held log's slots live in tmpfs and belong to this boot; a
        # committed corpus cannot carry them. `held` is made to name
        # another boot (all zeros, never a real boot id): what this
        # directory holds after the machine restarted, so its slots are
        # ignored as a power cut's are (they were empty: every write was
        # flushed).
        sed -i 's/^[^ ]* /00000000-0000-0000-0000-000000000000 /' "$leg0/held"
        rm -f "$WORK"/run/*
        "$VOUCH" info "$leg0" | grep -E '^(journal|state):' >&2
    else
        kill -TERM "$SERVER_PID"
        wait "$SERVER_PID"
        SERVER_PID=
    fi
    local model
    model=$("$PYTHON" "$WORK/ops.py" - "$tag" $SIZE "${ops[@]}")
    [ "$model" = "$expected" ] || { echo "model differs from itself" >&2; exit 1; }
    tar --sparse --format=gnu --sort=name --owner=0 --group=0 --numeric-owner \
        --mtime=@0 -C "$WORK" -czf "$here/$name.tar.gz" "$name"
    # Cross-check: unpack the archive elsewhere and export it.
    rm -rf "$WORK/check"/*
    tar -xzf "$here/$name.tar.gz" -C "$WORK/check"
    local copy=$WORK/check/$name export_args=()
    [ -d "$copy/leg0" ] && copy=$copy/leg1 # a leg alone opens as a plain volume
    [ ${#serve_args[@]} -gt 0 ] && export_args=(--key-file "$KEY")
    "$VOUCH" export "$copy" "$WORK/check/image" "${export_args[@]}" >/dev/null
    local exported
    exported=$(sha256sum "$WORK/check/image" | cut -d' ' -f1)
    [ "$exported" = "$expected" ] || { echo "$name: export $exported, model $expected" >&2; exit 1; }
    printf '| %s | %s | %s | %s | %s |\n' "$name" "$tag" "$(echo "${create[*]}" | sed "s#$here/##; s#$WORK/##")" "${ops[*]}" "$expected"
}

echo "binary: $("$VOUCH" --version), commit $(git -C "$here" rev-parse HEAD)"
for layout in split packed; do
    for guard in crc32c crc64nvme crc16t10dif xxh3 none; do
        make_volume "$layout-$guard" "${layout:0:1}${guard:0:6}" clean --layout $layout --guard $guard -- $WRITES
    done
done
for layout in split packed; do
    make_volume "$layout-encrypted" "${layout:0:1}-enc" clean --layout $layout --encrypt --key-file "$KEY" -- $WRITES_ENCRYPTED
    make_volume "$layout-trim-zero" "${layout:0:1}-trim" clean --layout $layout -- \
        $WRITES t:16:16 z:40:8 z:600:8 t:700:4 w:20:2 t:1010:14 f
    make_volume "$layout-unclean" "${layout:0:1}-kill" kill9 --layout $layout -- $WRITES w:64:8 z:8:4 f
done
make_volume mirror-split mirror clean --mirror -- $WRITES
