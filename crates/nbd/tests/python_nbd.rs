//! Protocol coverage through libnbd's Python bindings (python3-libnbd):
//! every command and flag, structured and simple replies, block status,
//! and error replies for requests libnbd sends with strict mode off.

mod common;

use std::sync::atomic::Ordering;

use common::{python, TestOptions, TestServer};
use vouch_nbd::wire::Command;
use vouch_nbd::Errno;

/// Python helper: assert a call fails with the given errno.
const EXPECT_ERRNO: &str = r#"
def expect_errno(expected, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except nbd.Error as e:
        got = e.errno if isinstance(e.errno, int) else getattr(errno, str(e.errno), e.errno)
        assert got == expected, f"{fn.__name__}{args}: got {e.errno} ({e.string}), want {expected}"
        return e
    raise AssertionError(f"{fn.__name__}{args} succeeded, want errno {expected}")

def connect(structured=True, export="disk", strict=True, meta=True):
    h = nbd.NBD()
    h.set_request_structured_replies(structured)
    if meta:
        h.add_meta_context("base:allocation")
    h.set_export_name(export)
    if not strict:
        h.set_strict_mode(0)
    h.connect_tcp("127.0.0.1", str(PORT))
    return h
"#;

fn script(body: &str) -> String {
    format!("{EXPECT_ERRNO}\n{body}")
}

#[test]
fn every_command_with_structured_and_simple_replies() {
    let server = TestServer::start(TestOptions::default());
    let body = r#"
for structured in (True, False):
    h = connect(structured=structured)
    assert h.get_structured_replies_negotiated() == structured
    assert h.can_df() == structured
    h.pwrite(b"\x5a" * 8192, 0)
    h.pwrite(b"\x6b" * 4096, 8192, nbd.CMD_FLAG_FUA)
    assert h.pread(12288, 0) == b"\x5a" * 8192 + b"\x6b" * 4096
    h.flush()
    h.trim(4096, 0)
    h.trim(4096, 4096, nbd.CMD_FLAG_FUA)
    assert h.pread(8192, 0) == bytes(8192)
    h.pwrite(b"\x01" * 16384, 65536)
    h.zero(4096, 65536)
    h.zero(4096, 69632, nbd.CMD_FLAG_NO_HOLE)
    h.zero(4096, 73728, nbd.CMD_FLAG_FAST_ZERO | nbd.CMD_FLAG_FUA)
    assert h.pread(16384, 65536) == bytes(12288) + b"\x01" * 4096
    h.cache(65536, 0)
    if structured:
        assert h.pread_structured(4096, 8192, lambda *a: 0, nbd.CMD_FLAG_DF) == b"\x6b" * 4096
    # Zero-length requests are answered without touching the export.
    h.set_strict_mode(0)
    assert h.pread(0, 0) == b""
    h.pwrite(b"", 0)
    h.set_strict_mode(nbd.STRICT_MASK)
    h.shutdown()
print("ok")
"#;
    assert_eq!(python(&server, &script(body)).trim(), "ok");
    assert!(server.export.caches.load(Ordering::Relaxed) >= 2);
    assert!(server.export.fua_writes.load(Ordering::Relaxed) >= 4);
    assert!(server.metrics.requests(Command::Read) >= 8);
    assert!(server.metrics.requests(Command::WriteZeroes) >= 6);
    assert!(server.metrics.bytes(Command::Write) >= 2 * (8192 + 4096 + 16384));
}

#[test]
fn structured_reads_use_hole_chunks_and_df_does_not() {
    let server = TestServer::start(TestOptions::default());
    server.export.fill_range(8192, 4096, 0x42);
    let body = r#"
h = connect()
chunks = []
def chunk(subbuf, offset, status, error):
    chunks.append((offset, len(subbuf), status))
    return 0
buf = h.pread_structured(16384, 0, chunk)
assert buf == bytes(8192) + b"\x42" * 4096 + bytes(4096), "content"
assert chunks == [(0, 8192, nbd.READ_HOLE), (8192, 4096, nbd.READ_DATA), (12288, 4096, nbd.READ_HOLE)], chunks
chunks.clear()
buf = h.pread_structured(16384, 0, chunk, nbd.CMD_FLAG_DF)
assert chunks == [(0, 16384, nbd.READ_DATA)], chunks
assert buf == bytes(8192) + b"\x42" * 4096 + bytes(4096)
print("ok")
"#;
    assert_eq!(python(&server, &script(body)).trim(), "ok");
}

#[test]
fn block_status_base_allocation_and_req_one() {
    let server = TestServer::start(TestOptions::default());
    server.export.fill_range(4096, 8192, 0x42);
    let body = r#"
h = connect()
assert h.can_meta_context("base:allocation")
seen = []
def extents(metacontext, offset, entries, err):
    seen.append((metacontext, offset, list(entries)))
    return 0
h.block_status(65536, 0, extents)
assert seen == [("base:allocation", 0, [4096, 3, 8192, 0, 53248, 3])], seen
seen.clear()
h.block_status(65536, 4096, extents, nbd.CMD_FLAG_REQ_ONE)
assert seen == [("base:allocation", 4096, [8192, 0])], seen
seen.clear()
h.block_status(1024, 0, extents, nbd.CMD_FLAG_REQ_ONE)
assert seen == [("base:allocation", 0, [1024, 3])], seen
# Without a negotiated context, BLOCK_STATUS is refused with EINVAL.
h2 = connect(meta=False, strict=False)
expect_errno(errno.EINVAL, h2.block_status, 4096, 0, extents)
# Out of range.
h.set_strict_mode(0)
expect_errno(errno.EINVAL, h.block_status, 8192, h.get_size() - 4096, extents)
print("ok")
"#;
    assert_eq!(python(&server, &script(body)).trim(), "ok");
}

#[test]
fn invalid_requests_get_spec_errors() {
    let server = TestServer::start(TestOptions::default());
    let body = r#"
for structured in (True, False):
    h = connect(structured=structured, strict=False)
    size = h.get_size()
    expect_errno(errno.EINVAL, h.pread, 4096, size)            # read past end
    expect_errno(errno.EINVAL, h.pread, 8192, size - 4096)     # read straddling the end
    expect_errno(errno.ENOSPC, h.pwrite, b"x" * 4096, size)    # write past end
    expect_errno(errno.ENOSPC, h.zero, 4096, size)             # write zeroes past end
    expect_errno(errno.EINVAL, h.trim, 4096, size)             # trim past end
    expect_errno(errno.EINVAL, h.cache, 4096, size)            # cache past end
    expect_errno(errno.EINVAL, h.pread, 100, 0)                # unaligned length
    expect_errno(errno.EINVAL, h.pwrite, b"x" * 512, 100)      # unaligned offset
    expect_errno(errno.EINVAL, h.pread, 512, 0, nbd.CMD_FLAG_NO_HOLE)  # flag not valid for read
    expect_errno(errno.EINVAL, h.pwrite, b"x" * 512, 0, nbd.CMD_FLAG_REQ_ONE)
    if not structured:
        expect_errno(errno.EINVAL, h.pread, 512, 0, nbd.CMD_FLAG_DF)  # DF without structured replies
    # Oversized read: EOVERFLOW with structured replies, EINVAL with simple ones.
    big = 33554432 + 512
    expect_errno(errno.EOVERFLOW if structured else errno.EINVAL, h.pread, big, 0)
    # Oversized write: payload is discarded, the connection stays in sync.
    expect_errno(errno.EINVAL, h.pwrite, b"\x07" * big, 0)
    h.pwrite(b"\x33" * 4096, 0)
    assert h.pread(4096, 0) == b"\x33" * 4096
    h.shutdown()

# A client that asks for no block sizes may use any byte only on an export
# that serves them (Export::can_byte_granularity); this one does not, so
# the advertised minimum (512) still binds it.
h = nbd.NBD()
h.set_request_block_size(False)
h.set_strict_mode(0)
h.set_export_name("disk")
h.connect_tcp("127.0.0.1", str(PORT))
expect_errno(errno.EINVAL, h.pread, 1, 1)
expect_errno(errno.EINVAL, h.pwrite, b"x" * 100, 512)
assert h.pread(512, 40960) == bytes(512)
h.shutdown()

ro = connect(export="ro", strict=False)
assert ro.is_read_only()
assert not ro.can_trim() and not ro.can_zero()
expect_errno(errno.EPERM, ro.pwrite, b"x" * 512, 0)
expect_errno(errno.EPERM, ro.trim, 512, 0)
expect_errno(errno.EPERM, ro.zero, 512, 0)
assert ro.pread(512, 0) == bytes(512)
ro.flush()
# Unknown export: GO fails, connection refused by libnbd.
h = nbd.NBD()
h.set_export_name("nope")
try:
    h.connect_tcp("127.0.0.1", str(PORT))
    raise AssertionError("unknown export accepted")
except nbd.Error:
    pass
print("ok")
"#;
    assert_eq!(python(&server, &script(body)).trim(), "ok");
    assert!(server.metrics.errors(Errno::Inval) >= 10);
    assert!(server.metrics.errors(Errno::NoSpc) >= 4);
    assert!(server.metrics.errors(Errno::Perm) >= 3);
    assert!(server.metrics.errors(Errno::Overflow) >= 1);
}

#[test]
fn verification_fault_is_reported_and_counted() {
    let server = TestServer::start(TestOptions::default());
    server.export.fill_range(0, 65536, 0x10);
    server
        .export
        .fail_read_at
        .store(12288 + 100, Ordering::Relaxed);
    let body = r#"
for structured in (True, False):
    h = connect(structured=structured)
    e = expect_errno(errno.EIO, h.pread, 16384, 0)
    assert h.pread(4096, 0) == b"\x10" * 4096   # connection still usable
print("ok")
"#;
    assert_eq!(python(&server, &script(body)).trim(), "ok");
    assert_eq!(server.metrics.faults("guard_mismatch"), 2);
    assert_eq!(server.metrics.errors(Errno::Io), 2);
    let text = server.metrics.render_prometheus();
    assert!(
        text.contains(
            "vouch_nbd_verification_faults_total{kind=\"guard_mismatch\",export=\"disk\"} 2"
        ),
        "{text}"
    );
}

#[test]
fn multi_connection_concurrent_writes_then_flush() {
    let server = TestServer::start(TestOptions::default());
    let body = r#"
import threading
N = 4
handles = [connect() for _ in range(N)]
assert all(h.can_multi_conn() for h in handles)
def worker(i):
    h = handles[i]
    for j in range(64):
        off = (j * N + i) * 4096
        h.pwrite(bytes([i + 1]) * 4096, off)
threads = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
for t in threads: t.start()
for t in threads: t.join()
# A flush on one connection covers writes completed on all of them.
handles[0].flush()
for j in range(64):
    for i in range(N):
        off = (j * N + i) * 4096
        assert handles[(i + 1) % N].pread(4096, off) == bytes([i + 1]) * 4096
print("ok")
"#;
    assert_eq!(python(&server, &script(body)).trim(), "ok");
    assert!(server.export.flushes.load(Ordering::Relaxed) >= 1);
    assert_eq!(server.export.writes.load(Ordering::Relaxed), 256);
}

#[test]
fn option_negotiation_details() {
    let server = TestServer::start(TestOptions::default());
    let body = r#"
# NBD_OPT_LIST and NBD_OPT_INFO through opt mode.
h = nbd.NBD()
h.set_opt_mode(True)
h.connect_tcp("127.0.0.1", str(PORT))
names = []
h.opt_list(lambda name, desc: names.append(name))
assert sorted(names) == ["disk", "ro"], names
h.set_export_name("ro")
h.opt_info()
assert h.get_size() == 1048576 and h.is_read_only()
assert h.get_block_size(nbd.SIZE_MINIMUM) == 512
assert h.get_block_size(nbd.SIZE_PREFERRED) == 4096
ctx = []
h.set_export_name("disk")
h.clear_meta_contexts()
h.add_meta_context("base:")
h.opt_list_meta_context(lambda name: ctx.append(name))
assert ctx == ["base:allocation"], ctx
ctx.clear()
h.clear_meta_contexts()
h.add_meta_context("qemu:dirty-bitmap:x")
h.add_meta_context("nope:")
h.opt_list_meta_context(lambda name: ctx.append(name))
assert ctx == [], ctx
h.set_export_name("nope")
try:
    h.opt_info()
    raise AssertionError("unknown export")
except nbd.Error:
    pass
h.set_export_name("")
h.set_full_info(True)
h.opt_go()
assert h.get_size() == 16777216
assert h.get_canonical_export_name() == "disk"
assert h.get_export_description() == "in-memory test export"
h.shutdown()
# Default export via the empty name and the old EXPORT_NAME path (no GO).
h = nbd.NBD()
h.set_export_name("")
h.set_request_structured_replies(False)
h.set_handshake_flags(0)   # non-fixed newstyle: only NBD_OPT_EXPORT_NAME
h.connect_tcp("127.0.0.1", str(PORT))
assert h.get_size() == 16777216
h.pwrite(b"\x09" * 512, 0)
assert h.pread(512, 0) == b"\x09" * 512
h.shutdown()
print("ok")
"#;
    assert_eq!(python(&server, &script(body)).trim(), "ok");
}
