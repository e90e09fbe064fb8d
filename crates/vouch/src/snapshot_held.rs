//! What a snapshot's create and delete hold, for a single volume
//! (`snapshot.rs`) and a mirror (`snapshot_mirror.rs`) alike: the server's
//! one-at-a-time lock, a snapshot's own lock for its delete, and the times
//! an online create reports. A leaf: it imports no module of this crate.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use vouch_engine::FileStorage;

/// Creates and deletes of snapshots on a server run one at a time: a
/// create's tidying must not take another's half-made snapshot.
pub static ONLINE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// How long an online create took.
pub struct Times {
    /// How long the volume was held at its flush point: the longest a
    /// client's flush waited for it. `flush` of it the commit and the
    /// checkpoint, the rest the clones.
    pub held: Duration,
    pub flush: Duration,
    pub total: Duration,
}

/// Hold snapshot `name` (at `snapshot_dir`) of `volume` for its delete:
/// a snapshot served, checked or cloned holds its own lock, and deleting
/// it under that process would leave it reading a snapshot no name leads
/// to (and a new snapshot of the same name a different one).
pub fn hold_snapshot(
    volume: &Path,
    name: &str,
    snapshot_dir: &Path,
) -> Result<Option<std::fs::File>> {
    match FileStorage::lock_for_writing(snapshot_dir) {
        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => anyhow::bail!(
            "snapshot {name} of {} is open in another vouch process (a serve, check or clone): stop it first",
            volume.display()
        ),
        // A missing snapshot is named by `delete`.
        other => Ok(other.ok()),
    }
}
