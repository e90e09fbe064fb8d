//! The write path: writes are sealed on the writer's thread and buffered
//! (acknowledged, not yet durable, as NBD allows); a commit — on flush,
//! FUA, a full buffer, or a trim — journals and writes them home
//! (`commit.rs` has the crash ordering). Writers block only on flush/FUA or
//! when the buffer has doubled (backpressure).

use std::sync::Arc;

use vouch_format::superblock::STATE_CLEAN;

use vouch_format::Context;

use crate::device::SealedBlock;
use crate::engine::Engine;
use crate::error::{Error, Fault, Result};
use crate::state::{shared_block, Block, DirtyBlock, RangeOp, BLOCK};

/// How `write_zeroes` zeroes a range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// Durable when the call returns (NBD FUA).
    pub fua: bool,
    /// Record the blocks as written zeroes rather than holes (NBD NO_HOLE).
    /// Either way no data is written.
    pub allocate: bool,
}

impl Engine {
    /// Write `data` at `offset` (512-byte aligned). With `fua` the write is
    /// durable when this returns; otherwise after the next flush.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let shared = &self.shared;
        shared.io.check_writable()?;
        shared.check_range(offset, data.len() as u64)?;
        shared.io.stats.add_client_write(data.len() as u64);
        let mut blocks = Vec::with_capacity(data.len() / BLOCK as usize + 2);
        let mut at = 0usize;
        while at < data.len() {
            let byte = offset + at as u64;
            let lba = byte / BLOCK;
            let within = (byte % BLOCK) as usize;
            let n = (BLOCK as usize - within).min(data.len() - at);
            if n == BLOCK as usize {
                blocks.push((lba, shared_block(&data[at..at + n])));
            } else {
                // Sub-block write: read-modify-write under the block's stripe
                // lock so two partial writes to one block cannot lose either.
                let _stripe = self.stripe(lba).lock();
                let mut block: Box<Block> = Box::new([0u8; BLOCK as usize]);
                shared.read_blocks(lba, 1, &mut block[..], None)?;
                block[within..within + n].copy_from_slice(&data[at..at + n]);
                self.buffer_blocks(vec![(lba, Arc::from(block))])?;
            }
            at += n;
        }
        if !blocks.is_empty() {
            self.buffer_blocks(blocks)?;
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// `write` of whole blocks without FUA, only if it can complete without
    /// waiting (issue 11's inline NBD path): the blocks fit in the
    /// write-back buffer below the level where writers commit themselves,
    /// and a background committer takes the commit. `Ok(false)` when it
    /// would wait, with nothing written or counted; then call `write`.
    pub fn try_write(&self, offset: u64, data: &[u8]) -> Result<bool> {
        let shared = &self.shared;
        shared.io.check_writable()?;
        shared.check_range(offset, data.len() as u64)?;
        let whole_blocks =
            offset.is_multiple_of(BLOCK) && (data.len() as u64).is_multiple_of(BLOCK);
        if data.is_empty() || !whole_blocks || !self.committer.is_background() {
            return Ok(false);
        }
        let first = offset / BLOCK;
        let sealed = self.seal_blocks(
            data.chunks_exact(BLOCK as usize)
                .zip(first..)
                .map(|(bytes, lba)| (lba, shared_block(bytes))),
        );
        Ok(self.buffer_without_waiting(sealed))
    }

    /// Buffer sealed blocks if that needs no wait: below twice the dirty
    /// limit (where writers commit themselves); past the limit the
    /// background committer is asked to commit. False, with nothing
    /// buffered or counted, when there is no room.
    fn buffer_without_waiting(&self, sealed: Vec<(u64, DirtyBlock)>) -> bool {
        let shared = &self.shared;
        let bytes = sealed.len() as u64 * BLOCK;
        let limit = self.tuning.dirty_limit_blocks;
        let buffered = {
            let mut state = shared.state.write();
            if state.active.len() + sealed.len() >= 2 * limit {
                return false;
            }
            for (lba, dirty) in sealed {
                state.active.insert(lba, dirty);
            }
            state.active.len()
        };
        shared.io.stats.add_client_write(bytes);
        if buffered >= limit {
            self.committer.request();
        }
        true
    }

    /// Seal fresh copies of blocks (not shared yet) in place: the seal, and
    /// for an encrypted volume the ciphertext.
    fn seal_blocks(
        &self,
        blocks: impl Iterator<Item = (u64, Arc<Block>)>,
    ) -> Vec<(u64, DirtyBlock)> {
        let generation = self.shared.sealing_generation();
        blocks
            .map(|(lba, mut data)| {
                let bytes = Arc::get_mut(&mut data).expect("a block buffered now is not shared");
                let seal = self.shared.protection.seal(lba, &mut bytes[..], generation);
                (lba, DirtyBlock { data, seal })
            })
            .collect()
    }

    fn buffer_blocks(&self, blocks: Vec<(u64, Arc<Block>)>) -> Result<()> {
        let sealed = self.seal_blocks(blocks.into_iter());
        self.buffer_sealed(sealed)
    }

    fn buffer_sealed(&self, sealed: Vec<(u64, DirtyBlock)>) -> Result<()> {
        if sealed.is_empty() {
            return Ok(());
        }
        let shared = &self.shared;
        let buffered = {
            let mut state = shared.state.write();
            for (lba, dirty) in sealed {
                state.active.insert(lba, dirty);
            }
            state.active.len()
        };
        if buffered >= self.tuning.dirty_limit_blocks {
            // Hand the buffer to the background committer, or commit inline
            // unless another commit is running. Writers block (and commit
            // themselves) only when the buffer has doubled: backpressure.
            let lock = if buffered >= 2 * self.tuning.dirty_limit_blocks {
                Some(self.committer.lock())
            } else if self.committer.is_background() {
                self.committer.request();
                None
            } else {
                self.committer.try_lock()
            };
            if let Some(mut journal) = lock {
                self.committer.commit(shared, &mut journal, &[])?;
            }
        }
        Ok(())
    }

    /// `write_sealed` of data blocks only if it can complete without
    /// waiting (the mirror's inline write path, like `try_write`): every
    /// block verified first, then buffered if the write-back buffer has
    /// room below the level where writers commit themselves and a
    /// background committer takes the commit. `Ok(false)` when it would
    /// wait, with nothing stored.
    pub fn try_write_sealed(&self, blocks: &[SealedBlock]) -> Result<bool> {
        let shared = &self.shared;
        shared.io.check_writable()?;
        if blocks.is_empty() || !self.committer.is_background() {
            return Ok(false);
        }
        let mut dirty = Vec::with_capacity(blocks.len());
        for block in blocks {
            self.check_sealed(block)?;
            let Some(seal) = shared.protection.seal_of(&block.context) else {
                return Ok(false); // a zero-reading block is a range operation
            };
            dirty.push((
                block.lba,
                DirtyBlock {
                    data: Arc::clone(&block.data),
                    seal,
                },
            ));
        }
        Ok(self.buffer_without_waiting(dirty))
    }

    /// A block moved with its context: inside the volume, and verified
    /// against that context for its LBA (a failure names it).
    fn check_sealed(&self, block: &SealedBlock) -> Result<()> {
        let shared = &self.shared;
        if block.lba >= shared.io.geometry.blocks {
            return Err(Error::OutOfRange {
                offset: block.lba.saturating_mul(BLOCK),
                length: BLOCK,
                size: shared.io.geometry.size_bytes,
            });
        }
        shared
            .protection
            .open(block.lba, &Ok(block.context), &block.data[..])
            .map_err(|kind| {
                Error::Fault(Fault {
                    lba: block.lba,
                    kind,
                })
            })
    }

    /// Whether `try_write_sealed` of `count` blocks would find room now
    /// (it may not a moment later: another writer can fill the buffer).
    pub fn has_room_for(&self, count: usize) -> bool {
        self.committer.is_background()
            && self.shared.state.read().active.len() + count < 2 * self.tuning.dirty_limit_blocks
    }

    /// Seal whole blocks for storing elsewhere or here with `write_sealed`
    /// (`BlockDevice::seal_blocks`): each block's stored bytes (ciphertext
    /// on an encrypted volume) and its context carrying `generation`.
    pub fn seal_for_transfer(
        &self,
        first: u64,
        data: &[u8],
        generation: u64,
    ) -> Result<Vec<SealedBlock>> {
        let shared = &self.shared;
        if !data.len().is_multiple_of(BLOCK as usize) {
            return Err(Error::Misaligned {
                offset: first * BLOCK,
                length: data.len() as u64,
            });
        }
        shared.check_range(first * BLOCK, data.len() as u64)?;
        // A plain seal keeps a non-zero generation; 0 would mean "take the
        // commit's", so the lowest generation a transfer carries is 1.
        let generation = generation.max(1);
        Ok(data
            .chunks_exact(BLOCK as usize)
            .zip(first..)
            .map(|(bytes, lba)| {
                let mut block = shared_block(bytes);
                let stored = Arc::get_mut(&mut block).expect("a new block is not shared");
                let mut seal = shared.protection.seal(lba, &mut stored[..], generation);
                seal.generation = generation as u32;
                SealedBlock {
                    lba,
                    context: shared.protection.context(lba, seal, generation),
                    data: block,
                }
            })
            .collect())
    }

    /// Store blocks moved with their contexts (`BlockDevice::write_sealed`):
    /// each is verified against its context for its LBA first, and any
    /// failure refuses the whole call. Data blocks keep their seal (the PI
    /// computed where the data was created); zero-reading contexts become
    /// a trim or written zeroes.
    pub fn write_sealed(&self, blocks: &[SealedBlock]) -> Result<()> {
        let shared = &self.shared;
        shared.io.check_writable()?;
        for block in blocks {
            self.check_sealed(block)?;
        }
        // In the order given, so a later block for an LBA wins: data blocks
        // are buffered, and a run of consecutive zero-reading blocks of one
        // kind becomes one trim or write-zeroes (one commit, not one each),
        // after the data blocks before it are buffered.
        let mut data_blocks = Vec::with_capacity(blocks.len());
        let mut index = 0;
        while index < blocks.len() {
            let block = &blocks[index];
            if let Some(seal) = shared.protection.seal_of(&block.context) {
                data_blocks.push((
                    block.lba,
                    DirtyBlock {
                        data: Arc::clone(&block.data),
                        seal,
                    },
                ));
                index += 1;
                continue;
            }
            let allocate = matches!(block.context, Context::Zero { .. });
            let mut end = index + 1;
            while end < blocks.len()
                && blocks[end].lba == blocks[end - 1].lba + 1
                && shared.protection.seal_of(&blocks[end].context).is_none()
                && matches!(blocks[end].context, Context::Zero { .. }) == allocate
            {
                end += 1;
            }
            self.buffer_sealed(std::mem::take(&mut data_blocks))?;
            let template = shared.protection.zero_template(allocate);
            let length = (end - index) as u64 * BLOCK;
            self.zero_range(block.lba * BLOCK, length, false, template)?;
            index = end;
        }
        self.buffer_sealed(data_blocks)
    }

    /// Make every write completed before this call durable.
    pub fn flush(&self) -> Result<()> {
        let shared = &self.shared;
        if shared.io.is_read_only() {
            return Ok(()); // nothing can be dirty
        }
        shared.io.check_writable()?;
        let mut journal = self.committer.lock();
        self.committer.commit_for_flush(shared, &mut journal)?;
        self.committer.sync_data(shared, &mut journal)?;
        shared
            .io
            .stats
            .flushes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Deallocate: the range reads as zeros afterwards. Sub-block edges are
    /// written as zeros (read-modify-write).
    pub fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.zero_range(offset, length, fua, vouch_format::Context::Unwritten)
    }

    /// Write zeroes (see `ZeroFlags`).
    pub fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()> {
        let template = self.shared.protection.zero_template(flags.allocate);
        self.zero_range(offset, length, flags.fua, template)
    }

    fn zero_range(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        template: vouch_format::Context,
    ) -> Result<()> {
        let shared = &self.shared;
        shared.io.check_writable()?;
        shared.check_range(offset, length)?;
        if length == 0 {
            return Ok(());
        }
        let first_full = offset.div_ceil(BLOCK);
        let end_full = (offset + length) / BLOCK;
        // Partial blocks at either edge become explicit zero writes.
        let head_end = (first_full * BLOCK).min(offset + length);
        if head_end > offset {
            self.write(offset, &vec![0u8; (head_end - offset) as usize], false)?;
        }
        let tail_start = (end_full * BLOCK).max(head_end);
        if offset + length > tail_start && end_full >= first_full {
            self.write(
                tail_start,
                &vec![0u8; (offset + length - tail_start) as usize],
                false,
            )?;
        }
        if end_full > first_full {
            let mut journal = self.committer.lock();
            // Buffered writes inside the range are superseded by it.
            shared.state.write().drop_buffered(first_full, end_full);
            let range = RangeOp {
                start: first_full,
                end: end_full,
                template,
            };
            self.committer.commit(shared, &mut journal, &[range])?;
            if fua {
                self.committer.sync_data(shared, &mut journal)?;
            }
        } else if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Commit, checkpoint and mark the volume clean (`Volume::close`).
    pub fn shutdown(&self) -> Result<()> {
        let shared = &self.shared;
        if shared.io.is_read_only() || shared.io.has_failed() {
            return Ok(());
        }
        let mut journal = self.committer.lock();
        self.committer.commit(shared, &mut journal, &[])?;
        self.committer.checkpoint(shared, &mut journal, STATE_CLEAN)
    }
}
