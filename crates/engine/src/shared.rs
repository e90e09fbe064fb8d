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
    io: Backing,
    protection: Box<dyn Protection>,
    layouts: LayoutMap,
    state: RwLock<VolumeState>,
    /// What makes a buffered write survive a process crash (`held.rs`):
    /// its lock is taken before `state`'s.
    held: crate::held::HeldLog,
    uuid: [u8; 16],
    /// The journal sequence the next commit will take (kept by the
    /// committer). A block sealed now gets it as its generation when the
    /// seal needs one before the commit (encryption's associated data).
    sealing_seq: AtomicU64,
    /// The schedule's self-test breaks (`schedule.rs`), read once; none
    /// without a schedule.
    breaks: crate::schedule::OrderingBreaks,
}

impl Shared {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        io: Backing,
        protection: Box<dyn Protection>,
        layouts: LayoutMap,
        state: VolumeState,
        held: crate::held::HeldLog,
        uuid: [u8; 16],
        sealing_seq: u64,
        breaks: crate::schedule::OrderingBreaks,
    ) -> Shared {
        Shared {
            io,
            protection,
            layouts,
            state: RwLock::new(state),
            held,
            uuid,
            sealing_seq: AtomicU64::new(sealing_seq),
            breaks,
        }
    }

    /// The backing storage: the objects, their geometry and counters.
    pub fn io(&self) -> &Backing {
        &self.io
    }

    /// How blocks are sealed and verified (guard or encryption).
    pub fn protection(&self) -> &dyn Protection {
        &*self.protection
    }

    /// Which layout keeps each block (one, or a migrating volume's regions).
    pub fn layouts(&self) -> &LayoutMap {
        &self.layouts
    }

    /// The write-back buffer, the commit in flight and the contexts
    /// (`state.rs`), under one reader-writer lock.
    pub fn state(&self) -> &RwLock<VolumeState> {
        &self.state
    }

    /// The held log (`held.rs`): its lock is taken before `state`'s.
    pub fn held(&self) -> &crate::held::HeldLog {
        &self.held
    }

    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// The schedule's self-test breaks (`schedule.rs`).
    pub fn breaks(&self) -> crate::schedule::OrderingBreaks {
        self.breaks
    }

    /// The journal's next record takes `seq` (after an append, or after
    /// recovery read the records): blocks sealed from now carry it.
    pub fn sealing_from(&self, seq: u64) {
        self.sealing_seq.store(seq, Ordering::Release);
    }

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
