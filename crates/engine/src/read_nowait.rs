//! Verified reads that never wait (issue 11's inline request path): the
//! NBD server answers a read on the connection's own task when every block
//! is in memory — the write-back buffer, a context that says "zero", or
//! home storage in the page cache with its context page loaded — and hands
//! it to a worker (the blocking `Shared::read`) otherwise.
//!
//! Declining has no side effects: nothing is counted or logged, no context
//! page is loaded. A block that fails verification is not judged here
//! either: the blocking read re-reads it and reports the fault with its LBA.

use std::ops::Range;

use crate::error::Result;
use vouch_format::{Context, FormatError};

use crate::layout::{ContextFrom, RunSpan};
use crate::read::{push_hole, Plan, Source};
use crate::shared::Shared;
use crate::state::BLOCK;
use crate::storage::Wait;

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
        let Some((mut plan, missing)) = self.plan_from_memory(first, count) else {
            return Ok(None);
        };
        if self.breaks().inline_read_past_buffer {
            self.plan_buffered_as_home(first, &mut plan);
        }
        if !missing.is_empty() {
            return Ok(None);
        }
        let mut holes = Vec::new();
        let mut home_bytes = 0u64;
        let mut index = 0usize;
        while index < plan.len() {
            let block = index * BLOCK as usize..(index + 1) * BLOCK as usize;
            match &plan[index] {
                Source::Memory(data, seal) => {
                    buf[block.clone()].copy_from_slice(&data[..]);
                    let lba = first + index as u64;
                    if self
                        .protection()
                        .reveal(lba, seal, &mut buf[block])
                        .is_err()
                    {
                        return Ok(None);
                    }
                    index += 1;
                }
                Source::Zero => {
                    buf[block.clone()].fill(0);
                    push_hole(&mut holes, block.start as u64..block.end as u64);
                    index += 1;
                }
                Source::Unreadable => return Ok(None),
                Source::Home(_) => {
                    let end = self.home_run_end(first, &plan, index);
                    let run = &mut buf[index * BLOCK as usize..end * BLOCK as usize];
                    if !self.try_read_home_run(first + index as u64, &plan[index..end], run) {
                        return Ok(None);
                    }
                    home_bytes += run.len() as u64;
                    index = end;
                }
            }
        }
        self.io().stats.add_client_read(buf.len() as u64);
        self.io().stats.add_read(home_bytes);
        Ok(Some(holes))
    }

    /// Read and verify a run of consecutive blocks from the page cache with
    /// one I/O. False if it would block, or any block fails verification
    /// (the blocking read rechecks and reports it).
    fn try_read_home_run(&self, first: u64, plan: &[Source], out: &mut [u8]) -> bool {
        let count = plan.len() as u64;
        let layout = self.layouts().of(first);
        let Ok(record_contexts) = layout.read_run(self.io(), first, count, out, Wait::NoWait)
        else {
            return false;
        };
        self.open_home_run(first, plan, &record_contexts, out)
    }

    /// Verify (and on an encrypted volume decrypt) a run of home blocks
    /// read into `out`: false at the first that fails.
    fn open_home_run(
        &self,
        first: u64,
        plan: &[Source],
        record_contexts: &[std::result::Result<Context, FormatError>],
        out: &mut [u8],
    ) -> bool {
        for (index, lba) in (first..first + plan.len() as u64).enumerate() {
            let block = &mut out[index * BLOCK as usize..(index + 1) * BLOCK as usize];
            let context = match &plan[index] {
                Source::Home(ContextFrom::Known(found)) => found.clone(),
                _ => record_contexts[index].clone(),
            };
            if self
                .protection()
                .open_for_client(lba, &context, block)
                .is_err()
            {
                return false;
            }
            if context.is_ok_and(|c| c.reads_as_zero()) {
                block.fill(0);
            }
        }
        true
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
        let (mut plan, missing) = self.plan_from_memory(first, count)?;
        if self.breaks().ring_read_past_buffer {
            self.plan_buffered_as_home(first, &mut plan);
        }
        let all_home = plan.iter().all(|source| matches!(source, Source::Home(_)));
        if !missing.is_empty() || !all_home || self.home_run_end(first, &plan, 0) != plan.len() {
            return None;
        }
        let span = self.layouts().of(first).run_span(first, count);
        Some(RingRead { first, plan, span })
    }

    /// `OrderingBreaks::ring_read_past_buffer` and
    /// `inline_read_past_buffer` (simulator self-tests only): each block
    /// the buffer holds, planned as at home if its context says it has a
    /// home value.
    fn plan_buffered_as_home(&self, first: u64, plan: &mut Plan) {
        let state = self.state().read();
        for (source, lba) in plan.iter_mut().zip(first..) {
            if !matches!(source, Source::Memory(..)) {
                continue;
            }
            if let crate::layout::Planned::Home(context) =
                self.layouts().of(lba).plan(lba, state.contexts())
            {
                *source = Source::Home(context);
            }
        }
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
        if !self.open_home_run(read.first, &read.plan, &record_contexts, &mut out) {
            return None;
        }
        self.io().stats.add_client_read(out.len() as u64);
        self.io().stats.add_read(span.len() as u64);
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
