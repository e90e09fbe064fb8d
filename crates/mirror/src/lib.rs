//! Mirrors (the `vouch-mirror` crate, above `vouch-engine`): a `Mirror`
//! is a `BlockDevice` over 2 or 3 legs, each another `BlockDevice` (a
//! local `Volume`, or a remote replica: vouch-replica's `RemoteLeg`,
//! members named `vouch://HOST:PORT/NAME`, `remote.rs`; another
//! implementation of the same trait). It sits outside the engine's paths:
//! it sees its legs only through the trait, and the engine only through
//! its public API.
//!
//! The map, in reading order (docs/ARCHITECTURE.md, "Modules import
//! downward", has the rows). The mirror is a thin composition (`device.rs`,
//! `Mirror`) of types that own their state and methods: `Legs`
//! (`legs.rs`: each leg's device, state, resync map and counters;
//! membership, judging an outcome, the fault threshold, taking a leg
//! out, the read turn), `Stripes` (`stripes.rs`, the stripe lock),
//! `WrittenLog` (`written_log.rs`: the blocks written since the last
//! flush, `written.rs`, and the activity log, `activity.rs`), `Threads`
//! (`threads.rs`, the jobs' threads); `Repair` (`repair.rs`) and `Resync`
//! (`resync.rs`, a stale leg's online copy from its map, `dirty.rs`) run
//! on borrowed parts, not on the `Mirror`. Then `admit.rs` (every write's
//! route), `complete.rs` (the reactor's completion path), `scrub.rs`
//! (making legs agree), `reconcile.rs` (the activity log's extents after
//! an unclean stop), `progress.rs` (what those jobs report), `set.rs`,
//! `manage.rs` and `map_file.rs` (the set on disk), `still.rs` (the set
//! held at one flush point for a snapshot of its legs).
//!
//! - Writes, trims and zeroes go to every active leg under the mirror's
//!   stripe lock (so two writers or a write and a repair cannot order
//!   themselves differently on two legs); each leg seals what it stores.
//!   A leg that fails a write or flush while another succeeds is faulted.
//!   Flush flushes every active leg.
//! - Reads go to one active leg, round robin over the local legs (remote
//!   legs are read only when no local leg is active). A block that fails
//!   verification there is repaired (`repair.rs`, md's order): fetched
//!   from another leg with `read_sealed` after that leg verified it,
//!   written to the bad leg with `write_sealed` (which verifies it again),
//!   flushed and re-read there. The client gets the good data. A block bad
//!   on every leg fails naming its LBA and nothing is rewritten.
//! - Each leg counts the errors it made on its own and that were
//!   corrected; past `FAULT_THRESHOLD` (md's 20) it is faulted: no more
//!   I/O, recorded in `Membership`. The count halves every hour and
//!   starts afresh when the leg is attached or resynced in full.
//! - `scrub.rs` checks every leg and repairs every repairable block; where
//!   two legs verify but differ, the higher generation wins.
//!
//! - A stale leg's writes are tracked block by block in a resync map
//!   (`dirty.rs`, marked before each write is issued); `resync.rs` copies
//!   exactly those blocks to the leg online, rate-limited, while it is
//!   written to but not read, then makes it active again.
//! - A leg that stops answering mid-run (unreachable, timed out) gets its
//!   map when it is taken out, starting from the blocks written since the
//!   last flush (`written.rs`): those it may have acknowledged and lost.
//!
//! - A mirror with remote legs takes the NBD reactor's non-FUA writes
//!   without a thread waiting on them (`complete.rs`): the remote legs'
//!   requests are sent, the local legs written, and the leg that answers
//!   last judges the legs, releases the stripes and answers the client.
//!
//! `set.rs` keeps the set on disk (the `mirror` record of each leg).

pub mod activity;
mod admit;
mod complete;
mod device;
pub mod dirty;
mod legs;
pub mod manage;
mod map_file;
pub mod migrate;
pub mod progress;
pub mod reconcile;
pub mod remote;
mod repair;
mod resize;
pub mod resync;
pub mod scrub;
pub mod set;
mod still;
mod stripes;
mod swap;
mod threads;
mod written;
mod written_log;

pub use activity::{ActivityGeometry, ActivityLog, Recovered, EXTENT_BLOCKS};
pub use device::Mirror;
pub use dirty::{DirtyMap, FileMaps, LandedTicket, MapFile, MapStore};
pub use legs::{LegStatus, MirrorLeg, RepairCount};
pub use progress::{ReconcileProgress, ResyncProgress, ResyncRate};
pub use reconcile::ReconcileCursor;
pub use remote::{is_remote_member, LegTemplate};
pub use resize::MirrorResizeSteps;
pub use resync::{ResyncCursor, ResyncStep};
pub use set::{
    create_mirror, create_mirror_with, is_mirrored, open_mirror, open_mirror_with, FileMembership,
    OpenedSet, RECORD_FILE,
};
pub use still::{StillLeg, StillRemote};
pub use vouch_format::mirror::LegState;
pub use vouch_format::Context;

use vouch_engine::error::Result;

/// Corrected errors a leg may need before it is faulted (md's default
/// `max_corrected_read_errors`). Only errors the leg made on its own
/// count (not legs differing after an unclean shutdown), the count halves
/// every `CORRECTED_HALF_LIFE`, and it starts at 0 when the leg is opened,
/// attached, or resynced in full.
pub const FAULT_THRESHOLD: u64 = 20;
/// The corrected-error count halves once per this (md: every hour).
pub const CORRECTED_HALF_LIFE: std::time::Duration = std::time::Duration::from_secs(3600);

/// Where a mirror records a leg's change of state, so it survives a
/// restart (the legs' records locally; a remote set's coordinator later).
pub trait Membership: Send + Sync {
    fn set_state(&self, leg: usize, state: LegState) -> Result<()>;

    /// Record that the legs may differ on some blocks (after an unclean
    /// shutdown) until a scrub makes them agree, or that they agree again.
    fn set_unsynced(&self, unsynced: bool) -> Result<()> {
        let _ = unsynced;
        Ok(())
    }

    /// Create the resync map of leg `leg` (a volume of `blocks` blocks),
    /// which is being marked stale now, with the blocks of `marked`
    /// dirty: durable in the surviving legs' directories (file and
    /// directory fsynced) when this returns. Unsupported by default (the
    /// leg then has unknown history: a full resync).
    fn create_map(
        &self,
        leg: usize,
        blocks: u64,
        marked: &[std::ops::Range<u64>],
    ) -> Result<DirtyMap> {
        let _ = (leg, blocks, marked);
        Err(vouch_engine::error::Error::Unsupported(
            "this mirror keeps no resync maps".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::legs::decayed;
    use super::CORRECTED_HALF_LIFE;

    #[test]
    fn the_corrected_count_halves_once_per_half_life() {
        let hour = CORRECTED_HALF_LIFE;
        assert_eq!(decayed(25, hour / 2), (25, 0));
        assert_eq!(decayed(25, hour), (12, 1));
        assert_eq!(decayed(25, hour * 3 + hour / 2), (3, 3));
        assert_eq!(decayed(25, hour * 100), (0, 100));
        assert_eq!(decayed(u64::MAX, hour * 64), (0, 64));
    }
}
