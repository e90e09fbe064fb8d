//! What a leg may lose if it dies now: the blocks written since the last
//! flush every leg completed (docs/CRASH_MODEL.md, "A leg lost mid-run").
//!
//! A replica promises durability only at a flush: until then a write it
//! acknowledged may vanish with it (SIGKILL, power, a cut link before its
//! write-back reached disk). So the mirror keeps, in memory and always, a
//! bitmap of the blocks written since the last successful flush, and when
//! a leg is taken out as stale mid-run its resync map starts from it
//! (`Legs::map_stale_leg`, `legs.rs`): the resync then copies those
//! blocks and the ones written while it is away, not the whole volume.
//!
//! One record serves every leg: a flush goes to every active leg, a leg
//! whose flush fails is taken out (its map built from this record) before
//! the record is cleared, so "since the last flush of the mirror" is
//! "since the last flush of each active leg".
//!
//! Flush rule: only blocks whose write completed before the flush started
//! are cleared when it succeeds. Two slots: writes record into the current
//! one (counted in flight until they return); a flush makes the other slot
//! current, waits briefly for the old slot's writes in flight to return,
//! and on success clears the old slot only if none was still in flight
//! when its legs' flushes were sent and no later flush swapped the slots
//! again. Anything else leaves the bits set: a map too large is slower to
//! resync, never wrong.
//!
//! Grown online (`Mirror::resize_online`, `resize.rs`): the bitmaps keep
//! the size the mirror was opened at, and a slot records a write at or
//! past their end as "something past the bitmaps" (`past`), which stands
//! for every block from there to the mirror's size: larger, never wrong.
//!
//! Hot path: a write does two atomic loads, three read-modify-writes on
//! counters and one per 64 blocks of bitmap (plus one on the summary when
//! a bitmap word goes from empty to not), and takes no lock.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How long a flush waits for writes that were in flight when it started.
const DRAIN: Duration = Duration::from_millis(20);

/// One generation of the record.
struct Slot {
    /// One bit per block.
    words: Box<[AtomicU64]>,
    /// One bit per word of `words` that may be non-zero.
    summary: Box<[AtomicU64]>,
    /// Writes recording here that have not returned yet.
    in_flight: AtomicU64,
    /// A block past the bitmaps (the mirror grew online) was recorded.
    past: AtomicBool,
}

impl Slot {
    fn new(blocks: u64) -> Slot {
        let words = blocks.div_ceil(64);
        Slot {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            summary: (0..words.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            in_flight: AtomicU64::new(0),
            past: AtomicBool::new(false),
        }
    }

    fn set(&self, first: u64, end: u64) {
        let mut lba = first;
        while lba < end {
            let word = lba / 64;
            let upto = end.min((word + 1) * 64);
            let bits = (upto - lba) as u32;
            let mask = if bits == 64 {
                u64::MAX
            } else {
                ((1u64 << bits) - 1) << (lba % 64)
            };
            if self.words[word as usize].fetch_or(mask, SeqCst) == 0 {
                self.summary[(word / 64) as usize].fetch_or(1 << (word % 64), SeqCst);
            }
            lba = upto;
        }
    }

    fn clear(&self) {
        self.past.store(false, SeqCst);
        for (at, summary) in self.summary.iter().enumerate() {
            let mut flagged = summary.swap(0, SeqCst);
            while flagged != 0 {
                let bit = flagged.trailing_zeros() as usize;
                flagged &= flagged - 1;
                self.words[at * 64 + bit].store(0, SeqCst);
            }
        }
    }

    /// Add every set block to `into` (one bit per block).
    fn collect(&self, into: &mut [u64]) {
        for (at, summary) in self.summary.iter().enumerate() {
            let mut flagged = summary.load(SeqCst);
            while flagged != 0 {
                let bit = flagged.trailing_zeros() as usize;
                flagged &= flagged - 1;
                into[at * 64 + bit] |= self.words[at * 64 + bit].load(SeqCst);
            }
        }
    }
}

/// The blocks written since the last successful flush (see the module's
/// documentation).
pub(super) struct Written {
    /// Shared with the writes recording in them (`Recording` owns its
    /// slot: a write that completes on another thread keeps it).
    slots: [Arc<Slot>; 2],
    /// Flushes started; the current slot is `epoch % 2`.
    epoch: AtomicU64,
    /// Orders a flush's swap against another's clear.
    swapping: Mutex<()>,
    /// The bitmaps' blocks (the size the mirror was opened at).
    capacity: u64,
    /// The mirror's blocks now (an online resize changes it).
    blocks: AtomicU64,
}

/// A write being recorded: dropped when the write returned (done or not).
pub(super) struct Recording {
    slot: Arc<Slot>,
}

impl Drop for Recording {
    fn drop(&mut self) {
        self.slot.in_flight.fetch_sub(1, SeqCst);
    }
}

/// A flush in progress: what it may clear when it succeeds.
pub(super) struct FlushTicket {
    /// The epoch the flush ended (its old slot is `epoch % 2`).
    epoch: u64,
    /// No write recorded in the old slot was in flight when it started.
    drained: bool,
}

impl Written {
    pub(super) fn new(blocks: u64) -> Written {
        Written {
            slots: [Arc::new(Slot::new(blocks)), Arc::new(Slot::new(blocks))],
            epoch: AtomicU64::new(0),
            swapping: Mutex::new(()),
            capacity: blocks,
            blocks: AtomicU64::new(blocks),
        }
    }

    /// The mirror now has `blocks` blocks (an online resize, every write
    /// held: `resize.rs`).
    pub(super) fn set_blocks(&self, blocks: u64) {
        self.blocks.store(blocks, SeqCst);
    }

    /// Record blocks `[first, end)` before a write to them is issued; keep
    /// the returned value until the write returned.
    pub(super) fn record(&self, first: u64, end: u64) -> Recording {
        let slot = loop {
            let epoch = self.epoch.load(SeqCst);
            let slot = &self.slots[(epoch % 2) as usize];
            slot.in_flight.fetch_add(1, SeqCst);
            // A flush that swapped meanwhile may have found the slot
            // drained: record in the new one instead.
            if self.epoch.load(SeqCst) == epoch {
                break slot;
            }
            slot.in_flight.fetch_sub(1, SeqCst);
        };
        slot.set(first, end.min(self.capacity));
        if end > self.capacity {
            slot.past.store(true, SeqCst);
        }
        Recording {
            slot: Arc::clone(slot),
        }
    }

    /// A flush is about to be sent to the legs: writes from now on record
    /// in the other slot; waits (briefly) for the old one's to return.
    pub(super) fn flush_started(&self) -> FlushTicket {
        let epoch = {
            let _swap = self.swapping.lock();
            self.epoch.fetch_add(1, SeqCst)
        };
        let old = &self.slots[(epoch % 2) as usize];
        let started = Instant::now();
        while old.in_flight.load(SeqCst) != 0 && started.elapsed() < DRAIN {
            std::thread::sleep(Duration::from_micros(50));
        }
        FlushTicket {
            epoch,
            drained: old.in_flight.load(SeqCst) == 0,
        }
    }

    /// The flush of `ticket` succeeded on every leg it was sent to: forget
    /// the blocks written before it started, if that can be told (see the
    /// module's documentation). Returns whether it did.
    pub(super) fn flush_succeeded(&self, ticket: FlushTicket) -> bool {
        if !ticket.drained {
            return false;
        }
        let _swap = self.swapping.lock();
        if self.epoch.load(SeqCst) != ticket.epoch + 1 {
            return false; // a later flush made the old slot current again
        }
        self.slots[(ticket.epoch % 2) as usize].clear();
        true
    }

    /// The recorded blocks, as sorted runs.
    pub(super) fn runs(&self) -> Vec<Range<u64>> {
        let blocks = self.blocks.load(SeqCst);
        let mut bits = vec![0u64; self.capacity.div_ceil(64) as usize];
        let mut past = false;
        for slot in &self.slots {
            slot.collect(&mut bits);
            past |= slot.past.load(SeqCst);
        }
        let mut runs: Vec<Range<u64>> = Vec::new();
        for (at, &word) in bits.iter().enumerate() {
            let mut left = word;
            while left != 0 {
                let lba = at as u64 * 64 + u64::from(left.trailing_zeros());
                left &= left - 1;
                match runs.last_mut() {
                    Some(run) if run.end == lba => run.end += 1,
                    _ => runs.push(lba..lba + 1),
                }
            }
        }
        if past && blocks > self.capacity {
            match runs.last_mut() {
                Some(run) if run.end == self.capacity => run.end = blocks,
                _ => runs.push(self.capacity..blocks),
            }
        }
        // Shrunk online: nothing past the mirror's end is a block.
        runs.retain_mut(|run| {
            run.end = run.end.min(blocks);
            run.start < run.end
        });
        runs
    }
}

/// Blocks in `runs`.
pub(super) fn count(runs: &[Range<u64>]) -> u64 {
    runs.iter().map(|run| run.end - run.start).sum()
}

/// The parts of `new` not in `old` (both sorted, disjoint runs).
pub(super) fn minus(new: &[Range<u64>], old: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut out = Vec::new();
    for run in new {
        let mut start = run.start;
        for cut in old
            .iter()
            .filter(|c| c.end > run.start && c.start < run.end)
        {
            if cut.start > start {
                out.push(start..cut.start);
            }
            start = start.max(cut.end);
        }
        if start < run.end {
            out.push(start..run.end);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grown_blocks_past_the_bitmaps_are_recorded_as_the_whole_tail() {
        let written = Written::new(100);
        written.set_blocks(300);
        drop(written.record(98, 102));
        assert_eq!(written.runs(), vec![98..300]);
        let ticket = written.flush_started();
        assert!(written.flush_succeeded(ticket));
        drop(written.record(10, 11));
        drop(written.record(250, 251));
        assert_eq!(written.runs(), vec![10..11, 100..300]);
        written.set_blocks(50);
        assert_eq!(written.runs(), vec![10..11]);
    }

    #[test]
    fn runs_cover_exactly_the_recorded_blocks() {
        let written = Written::new(1000);
        drop(written.record(3, 5));
        drop(written.record(60, 70));
        drop(written.record(70, 71));
        drop(written.record(999, 1005));
        assert_eq!(written.runs(), vec![3..5, 60..71, 999..1000]);
        assert_eq!(count(&written.runs()), 14);
    }

    #[test]
    fn a_flush_clears_what_completed_before_it_started() {
        let written = Written::new(256);
        drop(written.record(0, 8));
        let ticket = written.flush_started();
        drop(written.record(100, 101)); // after the flush started
        assert!(written.flush_succeeded(ticket));
        assert_eq!(written.runs(), vec![100..101]);
    }

    #[test]
    fn a_write_racing_a_flush_stays_recorded() {
        let written = Written::new(256);
        // Issued before the flush started, still in flight when the legs
        // are flushed: the flush may not cover it.
        let racing = written.record(10, 12);
        let ticket = written.flush_started();
        drop(racing);
        assert!(!written.flush_succeeded(ticket), "nothing may be cleared");
        assert_eq!(written.runs(), vec![10..12]);
        // The next flush, with nothing in flight, clears it.
        let ticket = written.flush_started();
        assert!(written.flush_succeeded(ticket));
        assert_eq!(written.runs(), vec![10..12], "it was in the other slot");
        let ticket = written.flush_started();
        assert!(written.flush_succeeded(ticket));
        assert!(written.runs().is_empty());
    }

    #[test]
    fn a_failed_or_overtaken_flush_clears_nothing() {
        let written = Written::new(256);
        drop(written.record(1, 2));
        let _failed = written.flush_started(); // its legs' flush failed: no `flush_succeeded`
        let first = written.flush_started();
        drop(written.record(5, 6));
        let second = written.flush_started();
        drop(written.record(7, 8)); // in the slot `first` would clear
        assert!(!written.flush_succeeded(first), "overtaken by `second`");
        assert_eq!(written.runs(), vec![1..2, 5..6, 7..8]);
        // Both completed before `second` started.
        assert!(written.flush_succeeded(second));
        assert_eq!(written.runs(), vec![7..8]);
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)]
    fn minus_keeps_what_the_old_runs_lack() {
        assert_eq!(
            minus(&[0..10, 20..30], &[2..4, 8..22]),
            vec![0..2, 4..8, 22..30]
        );
        assert_eq!(minus(&[5..6], &[]), vec![5..6]);
        assert!(minus(&[5..6], &[0..100]).is_empty());
    }

    #[test]
    fn writes_on_threads_racing_flushes_are_never_lost() {
        use std::sync::atomic::AtomicBool;
        let written = std::sync::Arc::new(Written::new(4096));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flusher = {
            let (written, stop) = (written.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(SeqCst) {
                    let ticket = written.flush_started();
                    written.flush_succeeded(ticket);
                }
            })
        };
        // Each write is still in flight (its block must stay recorded)
        // while another flush may run; checked before it returns.
        for lba in 0..4096 {
            let recording = written.record(lba, lba + 1);
            assert!(written.runs().iter().any(|run| run.contains(&lba)), "{lba}");
            drop(recording);
        }
        stop.store(true, SeqCst);
        flusher.join().expect("flusher");
    }
}
