//! The mirror's written log: what is being and was written, the two
//! records every write enters before any leg is written, in one type that
//! owns them (the legs, a repair and the write executor reach them
//! without the `Mirror`):
//!
//! - the blocks written since the last flush (`written.rs`): what a leg
//!   taken out mid-run may lack, the start of its resync map;
//! - the activity log (`activity.rs`): the extents that may be written
//!   now, durable before any leg is, reconciled after an unclean stop.
//!   Set once, when the set keeps one, and replaced only by an online
//!   resize (`resize.rs`).
//!
//! The resync maps of stale legs stay with their legs (`legs.rs`): a map
//! that cannot record a write stops its leg's resync, and a leg taken out
//! gets its map under the legs' decision lock.

use std::ops::Range;
use std::sync::Arc;

use crate::activity::{ActivityLog, Entered};
use crate::swap::Swap;
use crate::written::{Recording, Written};
use vouch_engine::error::{Error, Result};
use vouch_engine::BLOCK;

pub(crate) struct WrittenLog {
    /// Blocks written since the last flush.
    written: Written,
    /// The extents that may be written now (`None`: the set keeps no log).
    activity: Swap<Arc<ActivityLog>>,
}

impl WrittenLog {
    /// The record of a mirror of `blocks` blocks, keeping no activity log
    /// yet (`keep_activity_log`).
    pub(crate) fn new(blocks: u64) -> WrittenLog {
        WrittenLog {
            written: Written::new(blocks),
            activity: Swap::new(),
        }
    }

    /// Record blocks `[first, end)` (a write, trim or zeroing about to be
    /// issued to the legs) until the returned `Recording` drops.
    pub(crate) fn record(&self, first: u64, end: u64) -> Recording {
        self.written.record(first, end)
    }

    /// `record` of bytes `[offset, offset + length)`.
    pub(crate) fn record_bytes(&self, offset: u64, length: u64) -> Recording {
        self.record(offset / BLOCK, (offset + length).div_ceil(BLOCK))
    }

    /// The blocks recorded since the last flush, in runs.
    pub(crate) fn runs(&self) -> Vec<Range<u64>> {
        self.written.runs()
    }

    /// The mirror has `blocks` blocks now (an online resize, under every
    /// stripe).
    pub(crate) fn set_blocks(&self, blocks: u64) {
        self.written.set_blocks(blocks);
    }

    /// A flush of every leg, `flush_legs`: on its success the blocks
    /// recorded before it started are forgotten, and the activity log it
    /// began on may forget the extents whose writes all returned before
    /// it began (`ActivityLog::flush_begins`; an online resize may put a
    /// new log in place meanwhile, whose numbers start again).
    pub(crate) fn flush(&self, flush_legs: impl FnOnce() -> Result<()>) -> Result<()> {
        let ticket = self.written.flush_started();
        let log = self.activity.get();
        let number = log.map(|log| log.flush_begins());
        flush_legs()?;
        self.written.flush_succeeded(ticket);
        if let (Some(log), Some(number)) = (log, number) {
            log.flush_succeeded(number);
        }
        Ok(())
    }

    /// Keep `log` from now on. Set once (at open, before serving).
    pub(crate) fn keep_activity_log(&self, log: Arc<ActivityLog>) -> Result<()> {
        self.activity
            .set(log)
            .map_err(|_| Error::InvalidArgument("the mirror keeps an activity log already".into()))
    }

    /// Put `log` in place of the activity log (an online resize, under
    /// every stripe, after a flush).
    pub(crate) fn replace_activity_log(&self, log: Arc<ActivityLog>) {
        self.activity.replace(log);
    }

    /// The activity log, if the set keeps one.
    pub(crate) fn activity_log(&self) -> Option<&Arc<ActivityLog>> {
        self.activity.get()
    }

    /// Enter blocks `[first, end)` in the activity log (the caller holds
    /// their stripes), flushing the legs (`flush`) if that is what makes
    /// room, or waiting for writes in flight to return. `None`: no log.
    pub(crate) fn enter(
        &self,
        first: u64,
        end: u64,
        flush: impl Fn() -> Result<()>,
    ) -> Result<Option<Entered>> {
        let Some(log) = self.activity.get() else {
            return Ok(None);
        };
        // Every extent that could leave having a write in flight,
        // `enter_waiting` waits for one to return (each returns without
        // waiting on this writer: it holds no lock this writer wants). When
        // a flush made no room (each flushed extent written again
        // meanwhile), the next round flushes again.
        loop {
            match log.enter_waiting(first, end)? {
                Ok(entered) => return Ok(Some(entered)),
                Err(_) => flush()?,
            }
        }
    }

    /// `enter` without I/O or waiting, for the inline paths: `None`
    /// (decline) when an extent is not logged yet; `Some(None)`: no log.
    pub(crate) fn try_enter(&self, first: u64, end: u64) -> Option<Option<Entered>> {
        match self.activity.get() {
            None => Some(None),
            Some(log) => log.try_enter(first, end).map(Some),
        }
    }

    /// `[offset, offset + length)` in the pieces a large trim or zeroing
    /// enters the log by (`ActivityLog::pieces`; one piece without a log).
    pub(crate) fn pieces(&self, offset: u64, length: u64) -> Vec<Range<u64>> {
        let end = offset + length;
        let Some(log) = self.activity.get() else {
            return std::iter::once(offset..end).collect();
        };
        log.pieces(offset, end)
    }
}
