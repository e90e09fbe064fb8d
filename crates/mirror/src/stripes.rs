//! The mirror's stripe lock: LBAs map to stripes, and a write, trim,
//! zeroing, repair or resync window holds the stripes of its blocks, so
//! two of them cannot order themselves differently on two legs.

use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;
use vouch_engine::BLOCK;

/// A held stripe of the mirror's lock that is not tied to a borrow.
pub(crate) type OwnedStripe = parking_lot::ArcMutexGuard<parking_lot::RawMutex, ()>;
/// A write's owned stripes (`try_lock_owned`), in place for the usual one
/// or two: the write holds them until its last leg answers.
pub(crate) type OwnedStripes = SmallVec<[OwnedStripe; 2]>;

/// Stripes of the mirror's lock; LBAs map to them in runs of
/// `STRIPE_BLOCKS` (1 MiB), so a write takes one or two. Many, because a
/// write to remote legs holds its stripes for a network round trip
/// (`complete.rs`) and one that finds a stripe held goes to a blocking
/// worker: with 64, half of 32 random 4 KiB writes in flight would.
const STRIPES: usize = 1024;
pub(crate) const STRIPE_BLOCKS: u64 = 256;

/// The stripes, each a mutex over nothing: holding it is the right to
/// write its blocks on every leg.
pub(crate) struct Stripes(Box<[Arc<Mutex<()>>]>);

impl Stripes {
    pub(crate) fn new() -> Stripes {
        Stripes((0..STRIPES).map(|_| Arc::new(Mutex::new(()))).collect())
    }

    /// Lock the stripes of blocks `[first, end)`, in order.
    pub(crate) fn lock(&self, first: u64, end: u64) -> Vec<MutexGuard<'_, ()>> {
        stripes_of(first, end)
            .iter()
            .map(|&stripe| self.0[stripe].lock())
            .collect()
    }

    pub(crate) fn lock_bytes(&self, offset: u64, length: u64) -> Vec<MutexGuard<'_, ()>> {
        self.lock(offset / BLOCK, (offset + length).div_ceil(BLOCK))
    }

    /// Every stripe, in order: no write, trim or copy is in flight while
    /// they are held.
    pub(crate) fn lock_all(&self) -> Vec<MutexGuard<'_, ()>> {
        self.0.iter().map(|stripe| stripe.lock()).collect()
    }

    /// `lock` with guards that own their stripes, not tied to a borrow:
    /// every write holds its stripes so (`admit.rs`), whichever thread
    /// completes it.
    pub(crate) fn lock_owned(&self, first: u64, end: u64) -> OwnedStripes {
        stripes_of(first, end)
            .iter()
            .map(|&stripe| self.0[stripe].lock_arc())
            .collect()
    }

    /// `lock_owned` without waiting: `None` if any stripe is held (a
    /// writer or a repair is on it), with nothing held.
    pub(crate) fn try_lock_owned(&self, first: u64, end: u64) -> Option<OwnedStripes> {
        stripes_of(first, end)
            .iter()
            .map(|&stripe| self.0[stripe].try_lock_arc())
            .collect()
    }
}

/// The stripes blocks `[first, end)` fall in, in lock order: in place for
/// up to 4, since every mirrored write takes its stripes and nearly all
/// take one or two (no allocation for them).
fn stripes_of(first: u64, end: u64) -> SmallVec<[usize; 4]> {
    let mut stripes: SmallVec<[usize; 4]> = (first / STRIPE_BLOCKS
        ..end.max(first + 1).div_ceil(STRIPE_BLOCKS))
        .take(STRIPES)
        .map(|run| (run % STRIPES as u64) as usize)
        .collect();
    stripes.sort_unstable();
    stripes.dedup();
    stripes
}
