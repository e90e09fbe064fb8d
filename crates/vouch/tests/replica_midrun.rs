//! A remote leg lost mid-run (`vouch replica serve` over loopback, the
//! replica SIGKILLed while the exporter writes), the bad cases: a resync
//! map that cannot be made durable leaves the leg stale with unknown
//! history (a full verified resync, never a partial one), and a replica
//! that comes back holding another volume is refused by name on the
//! online resync, nothing written to it. (The good cases, with real
//! links: replica_netns.rs.)

mod common;
mod replica_support;

use common::*;
use replica_support::*;

/// Blocks 0..32 written with `tag`, flushed, through `uri`.
fn write_blocks(uri: &str, tag: u64) {
    py_json(
        r#"
h = connect(sys.argv[1])
for lba in range(32):
    h.pwrite(block_data(lba, int(sys.argv[2]) + lba), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[uri, &tag.to_string()],
    );
}

/// Blocks of 0..32 that do not read back as written with `tag`.
fn bad_blocks(uri: &str, tag: u64) -> serde_json::Value {
    py_json(
        r#"
h = connect(sys.argv[1])
bad = [lba for lba in range(32)
       if h.pread(4096, lba * 4096) != block_data(lba, int(sys.argv[2]) + lba)]
print(json.dumps(bad))
"#,
        &[uri, &tag.to_string()],
    )
}

#[test]
fn a_map_that_cannot_be_made_durable_means_a_full_resync() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    let mut replica = replica_server(&replicas, "127.0.0.1:0", &[], None).expect("replica");
    let listen = replica.addr.clone();
    let a = dir.path().join("a");
    let url = format!("vouch://{listen}/disk");
    vouch_ok(&["create", s(&a), "--size", "4MiB", "--mirror", &url]);
    // The map's temporary file cannot be written: a directory is there.
    // (`DirtyMap` writes `mirror.dirty.tmp`, then renames it.)
    let blocker = a.join("mirror.dirty.tmp");
    std::fs::create_dir(&blocker).expect("blocker");
    let mut server = Server::start(dir.path(), &[s(&a)]);
    write_blocks(&server.uri, 100);
    replica.kill9();
    write_blocks(&server.uri, 200);
    server.stop();
    let log = server.log_text();
    assert!(
        log.contains("cannot create the stale leg's resync map")
            && log.contains("resynced in full (unknown history)"),
        "{log}"
    );
    assert!(!a.join("mirror.dirty.1").exists(), "no map left behind");
    let status = text(&vouch(&["mirror", "status", s(&a)]));
    assert!(
        status.contains(&format!("leg 1: {url}: stale")) && status.contains("unknown history"),
        "{status}"
    );

    std::fs::remove_dir(&blocker).expect("unblock");
    // While the replica is down, a resync says so and changes nothing.
    let output = vouch(&["mirror", "resync", s(&a), "--leg", "1"]);
    assert!(
        !output.status.success() && text(&output).contains("cannot be reached"),
        "{}",
        text(&output)
    );
    assert!(text(&vouch(&["mirror", "status", s(&a)])).contains(&format!("leg 1: {url}: stale")));

    let mut replica = replica_server(&replicas, &listen, &[], None).expect("replica back");
    let output = vouch(&["mirror", "resync", s(&a), "--leg", "1", "--json"]);
    assert!(output.status.success(), "{}", text(&output));
    let value: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let progress = &value["legs"][1]["resync"];
    // Every block of 4 MiB. (The failed attempt above already wrote the
    // full map of unknown history, so this run reports it as a map.)
    assert_eq!(progress["blocks_to_copy"], 1024, "{value}");
    assert_eq!(progress["copied"], 1024, "every block: {value}");
    assert_check_clean(&a);
    let mut server = Server::start(dir.path(), &[s(&a)]);
    assert_eq!(bad_blocks(&server.uri, 200), serde_json::json!([]));
    server.stop();
    replica.stop();
}

#[test]
fn a_replica_back_with_another_volume_is_refused_by_the_online_resync() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    let mut replica = replica_server(&replicas, "127.0.0.1:0", &[], None).expect("replica");
    let listen = replica.addr.clone();
    let a = dir.path().join("a");
    let url = format!("vouch://{listen}/disk");
    vouch_ok(&["create", s(&a), "--size", "4MiB", "--mirror", &url]);
    let mut server = Server::start(dir.path(), &[s(&a), "--control", "127.0.0.1:0"]);
    write_blocks(&server.uri, 100);
    replica.kill9();
    write_blocks(&server.uri, 200);
    let log = server.log_text();
    assert!(log.contains("STALE (unreachable)"), "{log}");

    // Another replica server at the same address, holding another volume
    // under the same name.
    let others = dir.path().join("others");
    let _impostor = replica_server(&others, &listen, &[], None).expect("impostor");
    let b = dir.path().join("b");
    vouch_ok(&["create", s(&b), "--size", "4MiB", "--mirror", &url]);
    let data = others.join("disk").join("data.00000");
    let before = std::fs::read(&data).unwrap_or_default();
    let control = common::control::control(&server).to_string();
    let output = vouch(&["mirror", "resync", "a", "--leg", "1", "--server", &control]);
    assert!(!output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains("holds another volume"),
        "{}",
        text(&output)
    );
    assert_eq!(
        std::fs::read(&data).unwrap_or_default(),
        before,
        "nothing written to the other volume"
    );
    // Still stale with its map; the data reads from the local leg.
    let status = text(&vouch(&["mirror", "status", "a", "--server", &control]));
    assert!(
        status.contains("stale") && status.contains("blocks to copy"),
        "{status}"
    );
    assert_eq!(bad_blocks(&server.uri, 200), serde_json::json!([]));
    server.stop();
}
