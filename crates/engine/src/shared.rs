//! `Shared`: the parts of a volume every path borrows — the backing
//! storage, the protection scheme, the layout map and the in-memory state.
//! The read path is a method set on it (`read.rs`); the committer and
//! recovery are handed it. What a path owns (the journal position, the
//! committer's signal, the writers' stripe locks) lives with that path.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;

use crate::backing::Backing;
use crate::error::{Error, Result};
use crate::layout::LayoutMap;
use crate::protection::Protection;
use crate::state::VolumeState;

pub(crate) struct Shared {
    pub io: Backing,
    pub protection: Box<dyn Protection>,
    pub layouts: LayoutMap,
    pub state: RwLock<VolumeState>,
    /// What makes a buffered write survive a process crash (`held.rs`):
    /// its lock is taken before `state`'s.
    pub held: crate::held::HeldLog,
    pub uuid: [u8; 16],
    /// The journal sequence the next commit will take (kept by the
    /// committer). A block sealed now gets it as its generation when the
    /// seal needs one before the commit (encryption's associated data).
    pub sealing_seq: AtomicU64,
    /// The schedule's self-test breaks (`schedule.rs`), read once; none
    /// without a schedule.
    pub breaks: crate::schedule::OrderingBreaks,
}

impl Shared {
    /// The generation a block sealed now carries (see `sealing_seq`).
    pub fn sealing_generation(&self) -> u64 {
        self.sealing_seq.load(Ordering::Acquire)
    }

    /// Validate a byte range: in bounds. Any byte offset and length is
    /// served: a read copies the requested bytes out of its verified
    /// blocks, and a write or zeroing that covers part of a block
    /// read-modify-writes that block (`Engine::write_partial`).
    pub fn check_range(&self, offset: u64, length: u64) -> Result<()> {
        let size = self.io.geometry.size_bytes;
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(Error::OutOfRange {
                offset,
                length,
                size,
            });
        }
        Ok(())
    }
}
