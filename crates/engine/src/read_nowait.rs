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
use crate::layout::ContextFrom;
use crate::read::{push_hole, Source};
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
        let Some((plan, missing)) = self.plan_from_memory(first, count) else {
            return Ok(None);
        };
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
                    if self.protection.reveal(lba, seal, &mut buf[block]).is_err() {
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
        self.io.stats.add_client_read(buf.len() as u64);
        self.io.stats.add_read(home_bytes);
        Ok(Some(holes))
    }

    /// Read and verify a run of consecutive blocks from the page cache with
    /// one I/O. False if it would block, or any block fails verification
    /// (the blocking read rechecks and reports it).
    fn try_read_home_run(&self, first: u64, plan: &[Source], out: &mut [u8]) -> bool {
        let count = plan.len() as u64;
        let layout = self.layouts.of(first);
        let Ok(record_contexts) = layout.read_run(&self.io, first, count, out, Wait::NoWait) else {
            return false;
        };
        for (index, lba) in (first..first + count).enumerate() {
            let block = &mut out[index * BLOCK as usize..(index + 1) * BLOCK as usize];
            let context = match &plan[index] {
                Source::Home(ContextFrom::Known(found)) => found.clone(),
                _ => record_contexts[index].clone(),
            };
            if self
                .protection
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
}
