//! The routes of the read pipeline (`read.rs`) that never wait (issue
//! 11's inline request path, the ring): the NBD server answers a read on
//! the connection's own task when every block is in memory — the
//! write-back buffer, a context that says "zero", or home storage in the
//! page cache with its context page loaded — or submits its one home I/O
//! to io_uring, and hands it to a worker (the blocking `Shared::read`)
//! otherwise. Both take the same plan (`plan_read`) and the same checks
//! (`execute`, `open_home_run`) as the worker.
//!
//! Declining has no side effects: nothing is counted or logged, no context
//! page is loaded. A block that fails verification is not judged here
//! either: the blocking read re-reads it and reports the fault with its LBA.

use std::ops::Range;

use crate::error::Result;

use crate::layout::RunSpan;
use crate::read::{OnFailure, Plan, Route, Source};
use crate::shared::Shared;
use crate::state::BLOCK;

impl Shared {
    /// `read` if it can complete without waiting for a device, a lock
    /// held by a reflink copy or a context page: `Ok(None)` when it would
    /// have to wait (then `buf` holds garbage; call `read`). Only whole
    /// blocks: a read of part of a block declines.
    pub fn try_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<Vec<Range<u64>>>> {
        self.check_range(offset, buf.len() as u64)?;
        let whole_blocks = offset.is_multiple_of(BLOCK) && (buf.len() as u64).is_multiple_of(BLOCK);
        if buf.is_empty() || !whole_blocks {
            return Ok(None);
        }
        let first = offset / BLOCK;
        let count = buf.len() as u64 / BLOCK;
        let mut plan = Plan::new();
        if !self.plan_read(first, count, Route::Inline, &mut plan) {
            return Ok(None);
        }
        let mut holes = Vec::new();
        let done = self.execute(first, &plan, buf, Some(&mut holes), &mut OnFailure::Decline);
        if !done.complete {
            return Ok(None);
        }
        self.io().stats.add_client_read(buf.len() as u64);
        self.io().stats.add_read(done.home_bytes);
        Ok(Some(holes))
    }

    /// A read `try_read` declined because its blocks must come from the
    /// device, if one I/O can fetch them all: every block at home, one
    /// contiguous run, its context known now (`RingRead`). `None`
    /// otherwise (read it on a worker).
    pub(crate) fn plan_ring_read(&self, offset: u64, len: usize) -> Option<RingRead> {
        let whole_blocks = offset.is_multiple_of(BLOCK) && (len as u64).is_multiple_of(BLOCK);
        if len == 0 || !whole_blocks || self.check_range(offset, len as u64).is_err() {
            return None;
        }
        let first = offset / BLOCK;
        let count = len as u64 / BLOCK;
        let mut plan = Plan::new();
        if !self.plan_read(first, count, Route::Ring, &mut plan) {
            return None;
        }
        let all_home = plan.iter().all(|source| matches!(source, Source::Home(_)));
        if !all_home || self.home_run_end(first, &plan, 0) != plan.len() {
            return None;
        }
        let span = self.layouts().of(first).run_span(first, count);
        Some(RingRead { first, plan, span })
    }

    /// The bytes of a `RingRead` from what its I/O read, each block
    /// verified against the context planned before the I/O was started.
    /// `None` if any fails (a block written or trimmed meanwhile, or a
    /// fault): the blocking read then rereads, judges and reports it.
    pub(crate) fn finish_ring_read(&self, read: &RingRead, span: &[u8]) -> Option<Vec<u8>> {
        let count = read.plan.len() as u64;
        let mut out = vec![0u8; (count * BLOCK) as usize];
        let layout = self.layouts().of(read.first);
        let record_contexts = layout.run_from_span(self.io(), read.first, count, span, &mut out);
        let opened = self.open_home_run(
            read.first,
            &read.plan,
            &record_contexts,
            &mut out,
            &mut OnFailure::Decline,
        );
        if !opened {
            return None;
        }
        // The blocks' bytes, as every route counts them (not the span,
        // which holds a packed run's contexts and alignment too).
        self.io().stats.add_client_read(out.len() as u64);
        self.io().stats.add_read(out.len() as u64);
        Some(out)
    }
}

/// A read started to complete later (`BlockDevice::try_start_read`): its
/// blocks, their planned sources and the one I/O that reads them.
pub(crate) struct RingRead {
    first: u64,
    plan: Plan,
    pub span: RunSpan,
}
