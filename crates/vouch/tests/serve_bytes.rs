//! Byte-granular NBD requests through a real `vouch serve` and libnbd's
//! Python bindings: a client that negotiates no block size (NBD_OPT_GO
//! without NBD_INFO_BLOCK_SIZE, or NBD_OPT_EXPORT_NAME) reads, writes,
//! zeroes and trims at any byte offset and length (the spec's default
//! sizing); a client that asks for block sizes keeps the advertised
//! minimum (EINVAL as before). Writes that cover part of a block are a
//! verified read-modify-write, serialized per block; they are counted per
//! export in `vouch_nbd_unaligned_requests_total`.

mod common;

use common::*;

/// Byte patterns and a whole-export comparison against a model.
const PY_BYTES: &str = r#"
import random

def pattern(offset, length, tag):
    return bytes((offset + i * 7 + tag) % 251 + 1 for i in range(length))

def check(h, model, label):
    got = h.pread(len(model), 0)
    if got != bytes(model):
        first = next(i for i in range(len(model)) if got[i] != model[i])
        raise AssertionError(f"{label}: first difference at byte {first}")
"#;

fn script(body: &str) -> String {
    format!("{PY_BYTES}\n{body}")
}

/// Odd offsets and lengths against a model, from a client that asked for
/// no block sizes; the bytes survive a reconnect, a clean restart, and
/// `vouch check` finds every block's protection intact.
#[test]
fn unnegotiated_client_reads_and_writes_any_byte_range() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let mut server = Server::start(dir.path(), &[s(&volume), "--create", "1MiB"]);
    let model = dir.path().join("model.bin");
    let body = r#"
uri, model_path = sys.argv[1], sys.argv[2]
h = connect_unnegotiated(uri)
size = h.get_size()
model = bytearray(size)
# Written blocks first, so partial writes patch real data.
for lba in (0, 1, 2, 3):
    data = block_data(lba, 1)
    h.pwrite(data, lba * 4096)
    model[lba * 4096:(lba + 1) * 4096] = data
ops = [("w", 1, 1), ("w", 4095, 2), ("w", 513, 9000), ("w", 8191, 1),
       ("w", 20000, 3), ("z", 4097, 10), ("t", 12290, 5000), ("w", size - 3, 3),
       ("z", 30001, 4096 * 3 + 17), ("w", 0, 1)]
rng = random.Random(32)
for _ in range(60):
    kind = rng.choice("wwwwzt")
    length = rng.randint(1, 3 * 4096)
    ops.append((kind, rng.randrange(0, size - length), length))
for index, (kind, offset, length) in enumerate(ops):
    if kind == "w":
        data = pattern(offset, length, index)
        flags = nbd.CMD_FLAG_FUA if index % 7 == 0 else 0
        h.pwrite(data, offset, flags)
        model[offset:offset + length] = data
    elif kind == "z":
        h.zero(length, offset)
        model[offset:offset + length] = bytes(length)
    else:
        # A trim's partial blocks are written as zeros (the spec lets a
        # server ignore them; vouch zeroes them, as for 512-byte edges).
        h.trim(length, offset)
        model[offset:offset + length] = bytes(length)
    got = h.pread(length, offset)
    assert got == bytes(model[offset:offset + length]), f"op {index} {kind} {offset}+{length}"
# Odd reads of what is there.
for offset, length in ((1, 1), (4095, 2), (513, 9000), (size - 1, 1), (4093, 4099)):
    assert h.pread(length, offset) == bytes(model[offset:offset + length]), (offset, length)
check(h, model, "same connection")
h.flush()
h.shutdown()
h = connect_unnegotiated(uri)
check(h, model, "after reconnect")
h.shutdown()
open(model_path, "wb").write(model)
print(json.dumps({"ops": len(ops), "size": size}))
"#;
    let result = py_json(&script(body), &[&server.uri, s(&model)]);
    assert_eq!(result["size"], MIB, "{result}");
    assert!(result["ops"].as_u64().unwrap_or(0) >= 70, "{result}");

    server.stop();
    let server = server.restart();
    let reread = r#"
uri, model_path = sys.argv[1], sys.argv[2]
model = open(model_path, "rb").read()
h = connect_unnegotiated(uri)
check(h, model, "after a clean restart")
# A client that negotiates block sizes reads the same bytes, aligned.
g = nbd.NBD()
g.connect_uri(uri)
assert g.get_block_size(nbd.SIZE_MINIMUM) == 512
assert g.pread(len(model), 0) == model
print(json.dumps({"ok": True}))
"#;
    assert_eq!(
        py_json(&script(reread), &[&server.uri, s(&model)])["ok"],
        true
    );
    drop(server);
    assert_check_clean(&volume);
}

/// NBD_OPT_EXPORT_NAME (libnbd with the fixed-newstyle flag cleared uses
/// nothing else) carries no block size negotiation: byte ranges work.
#[test]
fn export_name_client_gets_byte_granularity() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let server = Server::start(dir.path(), &[s(&volume), "--create", "1MiB"]);
    let body = r#"
h = connect_unnegotiated(sys.argv[1], export_name=True)
protocol = h.get_protocol()
h.pwrite(b"\xab", 1)
h.pwrite(b"\xcd" * 3, 4094)
assert h.pread(1, 1) == b"\xab"
assert h.pread(5, 4093) == b"\x00" + b"\xcd" * 3 + b"\x00"
assert h.pread(2, 0) == b"\x00\xab"
h.zero(2, 4095)
assert h.pread(4, 4093) == b"\x00\xcd\x00\x00"
h.flush()
h.shutdown()
print(json.dumps({"protocol": protocol}))
"#;
    let result = py_json(&script(body), &[&server.uri]);
    // "newstyle": the handshake where EXPORT_NAME is the only way in.
    assert_eq!(result["protocol"], "newstyle", "{result}");
    drop(server);
    assert_check_clean(&volume);
}

/// A client that asks for block sizes (libnbd's default) is bound by the
/// advertised minimum (512) as before: unaligned requests are EINVAL, and
/// the export is unchanged.
#[test]
fn negotiating_client_keeps_the_advertised_minimum() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let server = Server::start(dir.path(), &[s(&volume), "--create", "1MiB"]);
    let body = r#"
def expect_einval(fn, *args):
    try:
        fn(*args)
    except nbd.Error as e:
        assert e.errnum == errno.EINVAL, (fn.__name__, args, e.errnum, str(e))
        return
    raise AssertionError(f"{fn.__name__}{args} succeeded")

h = nbd.NBD()
h.set_strict_mode(0)   # let libnbd send what the server must refuse
h.connect_uri(sys.argv[1])
sizes = [h.get_block_size(k) for k in (nbd.SIZE_MINIMUM, nbd.SIZE_PREFERRED, nbd.SIZE_MAXIMUM)]
h.pwrite(b"\x11" * 4096, 0)
expect_einval(h.pread, 1, 1)
expect_einval(h.pread, 2, 4095)
expect_einval(h.pwrite, b"x", 1)
expect_einval(h.pwrite, b"x" * 512, 100)
expect_einval(h.zero, 10, 4097)
expect_einval(h.trim, 100, 0)
# 512-byte granularity, the advertised minimum, works as before.
h.pwrite(b"\x22" * 512, 512)
assert h.pread(4096, 0) == b"\x11" * 512 + b"\x22" * 512 + b"\x11" * 3072
h.shutdown()
print(json.dumps({"sizes": sizes}))
"#;
    let result = py_json(&script(body), &[&server.uri]);
    assert_eq!(
        result["sizes"],
        serde_json::json!([512, 4096, 32 * MIB]),
        "{result}"
    );
    drop(server);
    assert_check_clean(&volume);
}

/// Many unaligned writes in flight at once to different bytes of one
/// block (libnbd's asynchronous API over four connections): the
/// read-modify-writes are serialized per block, so none is lost. (Without
/// the engine's stripe lock around the read-modify-write, every round
/// here lost writes.)
#[test]
fn concurrent_unaligned_writes_to_one_block_lose_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let server = Server::start(dir.path(), &[s(&volume), "--create", "1MiB"]);
    let body = r#"
uri = sys.argv[1]
handles = [connect_unnegotiated(uri) for _ in range(4)]
model = bytearray(2 * 4096)
lost = []
for round in range(20):
    # 128 writes of 31 bytes into block 1, disjoint, unaligned, spread
    # over the connections, all in flight together.
    pieces = []
    for i in range(128):
        offset = 4096 + i * 32 + 1
        pieces.append((offset, pattern(offset, 31, round * 128 + i)))
    random.Random(round).shuffle(pieces)
    for index, (offset, data) in enumerate(pieces):
        handles[index % len(handles)].aio_pwrite(data, offset)
        model[offset:offset + 31] = data
    for h in handles:
        while h.aio_in_flight() > 0:
            h.poll(-1)
    got = handles[round % len(handles)].pread(len(model), 0)
    if got != bytes(model):
        lost.append(round)
for h in handles:
    h.flush()
    h.shutdown()
print(json.dumps({"lost_rounds": lost}))
"#;
    let result = py_json(&script(body), &[&server.uri]);
    assert_eq!(result["lost_rounds"], serde_json::json!([]), "{result}");
    drop(server);
    assert_check_clean(&volume);
}

/// Two exports of one server: requests and unaligned requests are counted
/// per export (`export` label), and an aligned client counts none.
#[test]
fn unaligned_requests_are_counted_per_export() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    vouch_ok(&["create", s(&a), "--size", "1MiB"]);
    vouch_ok(&["create", s(&b), "--size", "1MiB"]);
    let server = Server::start(
        dir.path(),
        &[
            s(&a),
            s(&b),
            "--name",
            "one",
            "--name",
            "two",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let body = r#"
one = connect_unnegotiated(sys.argv[1])
for i in range(5):
    one.pwrite(b"\x5a" * 100, 4096 * i + 7)
one.pread(10, 3)
one.zero(4096, 2048)
one.pwrite(b"\x01" * 4096, 8192)    # aligned: not counted
one.shutdown()
two = nbd.NBD()
two.connect_uri(sys.argv[2])
two.pwrite(b"\x02" * 8192, 0)
two.pread(4096, 4096)
two.shutdown()
print(json.dumps({"ok": True}))
"#;
    let result = py_json(
        &script(body),
        &[&server.export_uri("one"), &server.export_uri("two")],
    );
    assert_eq!(result["ok"], true);
    let text = server.metrics_text();
    let value = |series: &str| metric(&text, series).unwrap_or_else(|| panic!("{series}:\n{text}"));
    let unaligned = |command: &str, export: &str| {
        value(&format!(
            r#"vouch_nbd_unaligned_requests_total{{command="{command}",export="{export}"}}"#
        ))
    };
    assert_eq!(unaligned("write", "one"), 5.0);
    assert_eq!(unaligned("read", "one"), 1.0);
    assert_eq!(unaligned("write_zeroes", "one"), 1.0);
    assert_eq!(unaligned("write", "two"), 0.0);
    assert_eq!(unaligned("read", "two"), 0.0);
    let requests = |command: &str, export: &str| {
        value(&format!(
            r#"vouch_nbd_requests_total{{command="{command}",export="{export}"}}"#
        ))
    };
    assert_eq!(requests("write", "one"), 6.0);
    assert_eq!(requests("write", "two"), 1.0);
    assert_eq!(requests("read", "two"), 1.0);
    assert!(
        text.contains("# HELP vouch_nbd_unaligned_requests_total"),
        "{text}"
    );
    drop(server);
    assert_check_clean(&a);
    assert_check_clean(&b);
}
