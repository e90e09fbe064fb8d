//! The remote legs' copies of a mirror's snapshot (`snapshot_mirror.rs`;
//! docs/PROTOCOL.md, "Snapshots of a replica"): a remote leg's copy is
//! its replica's snapshot, `DIR/NAME/snapshots/SNAP` on the replica's
//! host, taken, listed and deleted through the replica protocol (version
//! 3) and read through it (OPEN_SNAPSHOT, read-only). A replica server
//! from before the snapshot requests is refused by name, never skipped.
//! A leaf: it imports no module of this crate but `replica`.

use std::path::PathBuf;

use anyhow::{anyhow, Result};
use vouch_engine::snapshot::{Snapshot, SnapshotRecord};
use vouch_engine::BlockDevice;
use vouch_mirror::set::MirrorRecord;
use vouch_replica::wire::SnapshotEntry;
use vouch_replica::RemoteLeg;

/// A remote leg of the set: its index and its replica's client.
pub struct RemoteCopyLeg<'a> {
    pub leg: usize,
    pub replica: &'a RemoteLeg,
}

/// The replica client behind a served mirror's remote leg.
pub fn remote_of(device: &dyn BlockDevice) -> Option<&RemoteLeg> {
    device.as_any()?.downcast_ref::<RemoteLeg>()
}

/// Open the remote member `url` of the stopped set `record` (it holds the
/// replica until dropped).
pub fn open_offline(url: &str, record: &MirrorRecord) -> Result<RemoteLeg> {
    crate::replica::open_leg(url, record).map_err(|error| anyhow!("{error}"))
}

/// Where a remote copy is: `URL/snapshots/NAME` (on the replica's host,
/// `DIR/NAME/snapshots/SNAP`).
pub fn copy_path(replica: &RemoteLeg, name: &str) -> PathBuf {
    PathBuf::from(format!(
        "{}/{}/{name}",
        replica.url(),
        vouch_engine::snapshot::SNAPSHOTS_DIR
    ))
}

/// A remote copy as `list` gives it: the record's fields the protocol
/// carries (name, id, checkpoint, creation time), the rest the local
/// copies' (`layout` "remote" where none is known).
pub fn as_snapshot(replica: &RemoteLeg, entry: SnapshotEntry) -> Snapshot {
    Snapshot {
        path: copy_path(replica, &entry.name),
        record: SnapshotRecord {
            uuid: replica.uuid_string(),
            created_unix: entry.created_unix,
            superblock_generation: 0,
            checkpoint_seq: entry.checkpoint_seq,
            generations_seq: 0,
            layout: "remote".into(),
            method: "replica".into(),
            online: false,
            name: entry.name,
            id: entry.id,
        },
        materialising: false,
        failed: None,
    }
}

/// Each remote leg's copies, or why they could not be listed.
pub fn list(legs: &[RemoteCopyLeg]) -> Vec<(usize, std::result::Result<Vec<Snapshot>, String>)> {
    legs.iter()
        .map(|remote| {
            let listed = remote
                .replica
                .snapshot_list()
                .map(|entries| {
                    entries
                        .into_iter()
                        .map(|entry| as_snapshot(remote.replica, entry))
                        .collect()
                })
                .map_err(|error| error.to_string());
            (remote.leg, listed)
        })
        .collect()
}

/// Take each remote leg's copy of snapshot `name` with id `id` (the
/// caller holds the set at its flush point: every write acknowledged
/// before is on each replica, and none after). A failure deletes the
/// copies made and names the leg.
pub fn create(legs: &[RemoteCopyLeg], name: &str, id: &str, copy: bool) -> Result<Vec<Snapshot>> {
    let mut made: Vec<Snapshot> = Vec::new();
    for remote in legs {
        match remote.replica.snapshot_create(name, id, copy) {
            Ok(entry) => made.push(as_snapshot(remote.replica, entry)),
            Err(error) => {
                // Best effort: a copy left is named by `list`.
                let _ = delete(&legs[..made.len()], name);
                return Err(anyhow!(
                    "mirror leg {} ({}): {error}",
                    remote.leg,
                    remote.replica.url()
                ));
            }
        }
    }
    Ok(made)
}

/// Delete each remote leg's copy of snapshot `name` it has: the legs
/// that had one, and why each that could not be deleted was not (`list`
/// names it while it is left).
pub fn delete(legs: &[RemoteCopyLeg], name: &str) -> (Vec<usize>, Vec<String>) {
    let mut deleted = Vec::new();
    let mut failed = Vec::new();
    for remote in legs {
        let why = |error: vouch_engine::Error| {
            format!(
                "leg {} ({}): its copy of snapshot {name} is not deleted: {error}",
                remote.leg,
                remote.replica.url()
            )
        };
        match remote.replica.snapshot_list() {
            Ok(entries) if !entries.iter().any(|entry| entry.name == name) => continue,
            Ok(_) => {}
            Err(error) => {
                failed.push(why(error));
                continue;
            }
        }
        match remote.replica.snapshot_delete(name) {
            Ok(()) => deleted.push(remote.leg),
            Err(error) => failed.push(why(error)),
        }
    }
    (deleted, failed)
}

/// `check` of a remote leg's copy of snapshot `name`: every block verified
/// by the replica's server (VERIFY on the copy opened read-only), and
/// again here as it would be read; whether it is clean (a copy that cannot
/// be opened, or is missing, is not). Its structure (journal, superblock)
/// is checked on the replica's host: `vouch check DIR/NAME/snapshots/SNAP`.
pub fn check_copy(leg: usize, url: &str, name: &str) -> bool {
    let opened = vouch_replica::ReplicaUrl::parse(url)
        .map_err(|error| error.to_string())
        .and_then(|parsed| {
            let options = crate::replica::client_options().map_err(|e| e.to_string())?;
            RemoteLeg::open_snapshot(&parsed, name, &options).map_err(|e| e.to_string())
        });
    println!(
        "leg {leg}'s copy {url}/{}/{name} (remote):",
        vouch_engine::snapshot::SNAPSHOTS_DIR
    );
    let replica = match opened {
        Ok(replica) => replica,
        Err(error) => {
            println!("  not checked: {error}");
            return false;
        }
    };
    let blocks = replica.size() / vouch_engine::BLOCK;
    match replica.verify(0, blocks) {
        Ok(faults) if faults.is_empty() => {
            println!(
                "  clean: {blocks} blocks verified by its replica server (its journal and superblock are checked on that host: `vouch check DIR/NAME/snapshots/{name}`)"
            );
            true
        }
        Ok(faults) => {
            println!("  {} faults:", faults.len());
            for fault in faults.iter().take(32) {
                println!("    LBA {}: {}", fault.lba, fault.kind.name());
            }
            false
        }
        Err(error) => {
            println!("  not checked: {error}");
            false
        }
    }
}
