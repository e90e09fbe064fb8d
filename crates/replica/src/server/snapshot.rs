//! The snapshot requests of protocol version 3 (docs/PROTOCOL.md,
//! "Snapshots of a replica"): a replica's snapshots are its volume's,
//! `DIR/NAME/snapshots/SNAP` (`vouch_engine::snapshot`), taken, listed and
//! deleted by the exporter holding the replica, and opened read-only by
//! another connection to be served or checked (OPEN_SNAPSHOT).
//!
//! Crash ordering is the engine's: SNAPSHOT_CREATE clones the volume's
//! files at its flush point into `.SNAP.partial`, syncs them, and only
//! then renames the copy to its name (synced) and answers; a crash of the
//! replica server before the answer leaves the copy whole or absent (a
//! `.partial` is removed by the next create, list or delete). The
//! exporter calls it while its mirror is held still (no write in flight
//! on any leg), so the copy holds every write the mirror acknowledged
//! before, and none after.

use std::sync::Arc;

use vouch_engine::snapshot::{self, FlushPoint, RealFs};
use vouch_engine::{OpenOptions, Volume};

use super::{engine_refusal, refusal, Refusal, Registry, Replica, Session};
use crate::wire::{encode_snapshots, ReplicaInfo, Request, SnapshotEntry, Status};

impl Session {
    /// OPEN_SNAPSHOT: the snapshot held for this connection; the answer
    /// is its INFO and its id (`SNAPSHOT_ID_BYTES`).
    pub(super) async fn open_snapshot(
        &mut self,
        name: String,
        snapshot: String,
    ) -> Result<Vec<u8>, Refusal> {
        let registry = Arc::clone(&self.registry);
        let peer = self.peer.clone();
        let key = held_key(&name, &snapshot);
        let opened =
            tokio::task::spawn_blocking(move || registry.open_snapshot(&name, &snapshot, &peer))
                .await
                .unwrap_or_else(|error| Err(refusal(Status::Io, format!("open failed: {error}"))))
                .inspect_err(|(_, body)| {
                    tracing::warn!(peer = self.peer, key, "replica: refused: {}", body.message)
                })?;
        let (volume, info, id) = opened;
        self.opened = Some((key, volume));
        let mut answer = info.encode().to_vec();
        answer.extend_from_slice(id.as_bytes());
        Ok(answer)
    }
}

/// The key an open snapshot is held under in the registry: a replica's
/// name has no `/`, so it is no replica's.
pub(super) fn held_key(name: &str, snapshot: &str) -> String {
    format!("{name}/{}/{snapshot}", snapshot::SNAPSHOTS_DIR)
}

fn entry(snap: &snapshot::Snapshot) -> SnapshotEntry {
    SnapshotEntry {
        name: snap.record.name.clone(),
        id: snap.record.id.clone(),
        checkpoint_seq: snap.record.checkpoint_seq,
        created_unix: snap.record.created_unix,
    }
}

/// Snapshot requests run one at a time on a server.
static SNAPSHOT_REQUESTS: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Run a snapshot request on replica `name` (its volume `volume`, held by
/// this connection): the answer's payload.
pub(super) fn execute(
    registry: &Registry,
    name: &str,
    volume: &Volume,
    request: Request,
) -> Result<Vec<u8>, Refusal> {
    if name.contains('/') {
        return Err(refusal(
            Status::InvalidArgument,
            format!("{name} is a snapshot (OPEN_SNAPSHOT): it takes no snapshot requests"),
        ));
    }
    // One snapshot request at a time on this server: a create's
    // `.SNAP.partial` is never tidied away by another's delete meanwhile.
    let _one = SNAPSHOT_REQUESTS.lock();
    let dir = registry.dir.join(name);
    let refuse = |error: vouch_engine::Error| engine_refusal(&error);
    match request {
        Request::SnapshotCreate {
            name: snap,
            id,
            copy,
        } => {
            // `RealFs::new(copy)` copies the files where asked (and the
            // record then says "copy").
            let fs = RealFs::new(copy);
            let point: &dyn FlushPoint = volume;
            let taken = snapshot::create_with_id(&fs, &dir, point, &snap, &id).map_err(refuse)?;
            tracing::info!(
                replica = name,
                snapshot = snap,
                id,
                "replica snapshot taken"
            );
            Ok(encode_snapshots(&[entry(&taken)]))
        }
        Request::SnapshotList => {
            // No tidy here: a `.partial` is a create's to remove (the
            // next create or delete does), and `list` skips it.
            let fs = RealFs::default();
            let mut entries = Vec::new();
            for listed in snapshot::list(&fs, &dir).map_err(refuse)? {
                // An unreadable snapshot is named, not left out.
                entries.push(entry(&listed.map_err(refuse)?));
            }
            Ok(encode_snapshots(&entries))
        }
        Request::SnapshotDelete { name: snap } => {
            let key = held_key(name, &snap);
            // Held across the delete: no OPEN_SNAPSHOT of it meanwhile.
            let replicas = registry.replicas.lock();
            if let Some(holder) = replicas.get(&key) {
                return Err(refusal(
                    Status::InUse,
                    format!(
                        "snapshot {snap} of replica {name} is open by another connection ({}): stop the serve or check reading it first",
                        holder.holder
                    ),
                ));
            }
            let fs = RealFs::default();
            snapshot::tidy(&fs, &dir).map_err(refuse)?;
            snapshot::delete(&fs, &dir, &snap).map_err(refuse)?;
            tracing::info!(replica = name, snapshot = snap, "replica snapshot deleted");
            Ok(Vec::new())
        }
        _ => Err(refusal(
            Status::InvalidArgument,
            "not a snapshot request".into(),
        )),
    }
}

impl Registry {
    /// Open snapshot `snapshot` of replica `name` read-only and hold it
    /// for `peer` (one connection at a time, as a replica).
    pub(super) fn open_snapshot(
        &self,
        name: &str,
        snapshot: &str,
        peer: &str,
    ) -> Result<(Arc<Volume>, ReplicaInfo, String), Refusal> {
        snapshot::check_name(snapshot).map_err(|e| engine_refusal(&e))?;
        let key = held_key(name, snapshot);
        let mut replicas = self.replicas.lock();
        if let Some(holder) = replicas.get(&key) {
            return Err(refusal(
                Status::InUse,
                format!(
                    "snapshot {snapshot} of replica {name} is open by another connection ({})",
                    holder.holder
                ),
            ));
        }
        let path = snapshot::snapshot_path(&self.dir.join(name), snapshot);
        if !path.join("superblock").exists() {
            return Err(refusal(
                Status::UnknownName,
                format!(
                    "replica {name} in {} has no snapshot named {snapshot}",
                    self.dir.display()
                ),
            ));
        }
        let fs = RealFs::default();
        let record = snapshot::list(&fs, &self.dir.join(name))
            .map_err(|e| engine_refusal(&e))?
            .into_iter()
            .filter_map(Result::ok)
            .find(|snap| snap.record.name == snapshot)
            .map(|snap| snap.record)
            .ok_or_else(|| {
                refusal(
                    Status::Corrupt,
                    format!("snapshot {snapshot} of replica {name}: its record does not read"),
                )
            })?;
        let mut id = record.id.into_bytes();
        id.resize(crate::wire::SNAPSHOT_ID_BYTES, b'-');
        let id = String::from_utf8_lossy(&id[..crate::wire::SNAPSHOT_ID_BYTES]).into_owned();
        let options = OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        };
        let volume =
            Arc::new(vouch_engine::open_volume(&path, &options).map_err(|e| engine_refusal(&e))?);
        let info = Registry::info(&volume, &path)?;
        replicas.insert(
            key.clone(),
            Replica {
                volume: Arc::clone(&volume),
                holder: peer.to_string(),
            },
        );
        tracing::info!(name, snapshot, peer, "replica snapshot opened read-only");
        Ok((volume, info, id))
    }
}
