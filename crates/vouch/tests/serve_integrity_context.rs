//! The `x-vouch:integrity` NBD metadata context: an unmodified client
//! (`nbdinfo --map`, libnbd's block_status) asks the server to verify a
//! range where the data lives and gets back which blocks are clean, which
//! hold faults and which are holes, without the data crossing the wire.

mod common;

use common::clients::nbdinfo_json;
use common::*;

/// Write 64 blocks, flip bits in blocks 7 and 40 on disk under a stopped
/// server, then map the export: exactly those two blocks are faults, the
/// rest of the written range verified, the unwritten tail a hole. The
/// context is listed, and `base:allocation` still answers beside it.
#[test]
fn nbdinfo_maps_faults_through_the_integrity_context() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let mut server = Server::start(dir.path(), &[s(&volume), "--create", "4MiB"]);
    py_json(
        r#"
h = connect(sys.argv[1])
for lba in range(64):
    h.pwrite(block_data(lba, 7), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.stop();
    flip_bit(&volume.join("data.00000"), 7 * BLOCK + 100, 0x04);
    flip_bit(&volume.join("data.00000"), 40 * BLOCK + 4000, 0x80);

    let server = Server::start(dir.path(), &[s(&volume)]);
    let info = nbdinfo_json(&server.uri, &[]);
    let contexts = info["exports"][0]["contexts"].to_string();
    assert!(
        contexts.contains("x-vouch:integrity") && contexts.contains("base:allocation"),
        "both contexts listed: {info}"
    );
    let map = nbdinfo_json(&server.uri, &["--map=x-vouch:integrity"]);
    let extents: Vec<(u64, u64, u64)> = map
        .as_array()
        .expect("map is an array")
        .iter()
        .map(|e| {
            (
                e["offset"].as_u64().expect("offset"),
                e["length"].as_u64().expect("length"),
                e["type"].as_u64().expect("type"),
            )
        })
        .collect();
    const VERIFIED: u64 = 1;
    const FAULT: u64 = 2;
    const HOLE: u64 = 4;
    assert_eq!(
        extents,
        vec![
            (0, 7 * BLOCK, VERIFIED),
            (7 * BLOCK, BLOCK, FAULT),
            (8 * BLOCK, 32 * BLOCK, VERIFIED),
            (40 * BLOCK, BLOCK, FAULT),
            (41 * BLOCK, 23 * BLOCK, VERIFIED),
            (64 * BLOCK, 4 * 1024 * 1024 - 64 * BLOCK, HOLE),
        ],
        "{map}"
    );

    // Both contexts in one BLOCK_STATUS: one chunk each (the spec's rule),
    // and a query from inside block 6 is answered from the byte asked for
    // (libnbd's block_status takes the count, then the offset).
    let both = py_json(
        r#"
h = nbd.NBD()
h.add_meta_context("base:allocation")
h.add_meta_context("x-vouch:integrity")
h.connect_uri(sys.argv[1])
seen = {}
def callback(metacontext, offset, entries, err):
    seen[metacontext] = list(entries)
h.block_status(8 * 4096, 6 * 4096 + 512, callback)
print(json.dumps(seen))
"#,
        &[&server.uri],
    );
    assert_eq!(
        both["x-vouch:integrity"][0], 3584,
        "the first run starts at the byte asked for: {both}"
    );
    assert_eq!(both["x-vouch:integrity"][1], VERIFIED, "{both}");
    assert_eq!(both["x-vouch:integrity"][2], BLOCK, "block 7: {both}");
    assert_eq!(both["x-vouch:integrity"][3], FAULT, "block 7: {both}");
    assert_eq!(both["base:allocation"][1], 0, "data, allocated: {both}");

    // The faults were found by reading next to the data, and logged with
    // their LBAs, in plain text (stderr is not a terminal).
    let log = server.log_text();
    assert!(log.contains("lba=40"), "{log}");
    assert!(
        !log.contains('\u{1b}'),
        "no terminal escapes in a log file: {log:?}"
    );
}

/// A client that only selects `base:allocation` sees exactly one context in
/// each reply, as before; `x-vouch:` lists vouch's context but selects
/// nothing (the spec's wildcard rule, applied to vouch's namespace).
#[test]
fn the_namespace_wildcard_lists_but_does_not_select() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let server = Server::start(dir.path(), &[s(&volume), "--create", "1MiB"]);
    let result = py_json(
        r#"
h = nbd.NBD()
h.set_opt_mode(True)
h.add_meta_context("x-vouch:")
h.connect_uri(sys.argv[1])
listed = []
h.opt_list_meta_context(lambda name: listed.append(name))
h.opt_go()
selected = h.can_meta_context("x-vouch:integrity")
g = nbd.NBD()
g.add_meta_context("base:allocation")
g.connect_uri(sys.argv[1])
seen = {}
def callback(metacontext, offset, entries, err):
    seen[metacontext] = list(entries)
g.block_status(65536, 0, callback)
print(json.dumps({"listed": listed, "selected": selected,
                  "integrity_on_base_only": g.can_meta_context("x-vouch:integrity"),
                  "seen": sorted(seen)}))
"#,
        &[&server.uri],
    );
    assert_eq!(
        result["listed"],
        serde_json::json!(["x-vouch:integrity"]),
        "{result}"
    );
    assert_eq!(result["selected"], false, "{result}");
    assert_eq!(result["integrity_on_base_only"], false, "{result}");
    assert_eq!(
        result["seen"],
        serde_json::json!(["base:allocation"]),
        "{result}"
    );
}
