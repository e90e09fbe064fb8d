//! The write path: writes are sealed on the writer's thread, appended to
//! the held log and buffered (`log_and_buffer`: acknowledged, not yet
//! durable, as NBD allows, but kept through a crash of this process); a
//! commit — on flush, FUA, a full buffer, or a trim — journals and writes
//! them home (`commit.rs` has the crash ordering). Writers block only on
//! flush/FUA or when the buffer has doubled (backpressure).

use bytes::{Bytes, BytesMut};
use vouch_format::superblock::STATE_CLEAN;

use vouch_format::Context;

use crate::device::{FlushDone, SealedBlock, ZeroFlags};
use crate::engine::Engine;
use crate::error::{Error, Fault, Result};
use crate::state::{BlockData, DirtyBlock, RangeOp, BLOCK};

/// Largest write `try_write_shared` takes when the protection transforms
/// the data (encryption): larger ones decline, to be written on a worker.
const TRANSFORMED_INLINE_MAX_BYTES: usize = 128 * 1024;

/// How a write enters the write-back buffer (`Engine::log_and_buffer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Admission {
    /// Always buffered; the caller commits itself if the buffer doubled.
    MayWait,
    /// Only if it fits below twice the dirty limit (the inline paths).
    MustNotWait,
    /// Into room `reserve_room` set aside (the mirror's inline write).
    Reserved,
}

/// How `write_sealed` checks blocks moved with their contexts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SealCheck {
    /// Recompute each block's guard (and, encrypted, authenticate it)
    /// against its context: blocks that crossed a hop (a replica's wire,
    /// a read from another leg's disk).
    Full,
    /// Blocks this process sealed (`seal_for_transfer`) from immutable
    /// bytes that never left it, stored on a local leg of a mirror: no
    /// hop lies between the seal and the store, as none does on a single
    /// volume's write path, so only the place is checked (LBA and volume
    /// tags) where the protection can judge it without the bytes.
    Placement,
}

impl Engine {
    /// Write `data` at `offset` (any byte range). With `fua` the write is
    /// durable when this returns; otherwise after the next flush.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.write_shared(offset, &Bytes::copy_from_slice(data), fua)
    }

    /// `write` of bytes the engine may keep (an NBD WRITE's payload): whole
    /// blocks are buffered, journaled and written home from `data` itself,
    /// without a copy per block (a protection that transforms data, such as
    /// encryption, seals a copy).
    pub fn write_shared(&self, offset: u64, data: &Bytes, fua: bool) -> Result<()> {
        let shared = self.shared();
        shared.io().check_writable()?;
        shared.check_range(offset, data.len() as u64)?;
        shared.io().stats.add_client_write(data.len() as u64);
        // A partial first or last block is merged into the stored one
        // (read-modify-write); the whole blocks between are one run.
        let head = ((BLOCK - offset % BLOCK) % BLOCK).min(data.len() as u64) as usize;
        let whole = (data.len() - head) / BLOCK as usize * BLOCK as usize;
        if head > 0 {
            self.write_partial(offset, &data[..head])?;
        }
        if whole > 0 {
            let run = data.slice(head..head + whole);
            let first = (offset + head as u64) / BLOCK;
            let sealed = self.seal_run(first, run, shared.sealing_generation());
            self.buffer_sealed(sealed)?;
        }
        if head + whole < data.len() {
            self.write_partial(offset + (head + whole) as u64, &data[head + whole..])?;
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Sub-block write (a write, a zeroing's edge, or an NBD client's
    /// byte-granular request): read-modify-write under the block's stripe
    /// lock so two partial writes to one block cannot lose either. The
    /// stored block is read and verified first (a fault fails the write
    /// and changes nothing), patched in memory, then sealed and buffered
    /// as a whole block, like any aligned write.
    ///
    /// Crash ordering: nothing of the block is written in place; the
    /// patched block travels the commit path whole (journal record fsynced
    /// at ORDER POINT A, then home), so a crash leaves it old in full
    /// (before A) or new in full (after A), never torn between the two;
    /// the bytes of the block the write did not cover are the same in
    /// both. Durable after the next flush, or before the reply with FUA.
    fn write_partial(&self, offset: u64, data: &[u8]) -> Result<()> {
        let lba = offset / BLOCK;
        let within = (offset % BLOCK) as usize;
        let _stripe = self.stripe(lba).lock();
        let mut block = BytesMut::zeroed(BLOCK as usize);
        self.shared().read_blocks(lba, 1, &mut block[..], None)?;
        block[within..within + data.len()].copy_from_slice(data);
        let sealed = self.seal_run(lba, block.freeze(), self.shared().sealing_generation());
        self.buffer_sealed(sealed)
    }

    /// A region of the landing area for a payload of `len` bytes
    /// (`BlockDevice::landing_buffer`).
    pub fn landing_buffer(&self, len: usize) -> Option<crate::LandingBuffer> {
        self.shared().held().landing_buffer(len)
    }

    /// `write_shared` of whole blocks without FUA, only if it can complete
    /// without waiting (issue 11's inline NBD path): the blocks fit in the
    /// write-back buffer below the level where writers commit themselves,
    /// and a background committer takes the commit. `Ok(false)` when it
    /// would wait, with nothing written or counted; then call `write_shared`.
    pub fn try_write_shared(&self, offset: u64, data: &Bytes) -> Result<bool> {
        let shared = self.shared();
        shared.io().check_writable()?;
        shared.check_range(offset, data.len() as u64)?;
        let whole_blocks =
            offset.is_multiple_of(BLOCK) && (data.len() as u64).is_multiple_of(BLOCK);
        if data.is_empty() || !whole_blocks || !self.committer().is_background() {
            return Ok(false);
        }
        // The caller's thread is the NBD reactor: a checksum of up to 1 MiB
        // (~0.1 ms) is fine there, encrypting it (~0.7 ms) is not.
        if data.len() > self.inline_seal_max_bytes() {
            return Ok(false);
        }
        let sealed = self.seal_run(offset / BLOCK, data.clone(), shared.sealing_generation());
        self.buffer_without_waiting(sealed)
    }

    /// Buffer sealed blocks if that needs no wait: below twice the dirty
    /// limit (where writers commit themselves); past the limit the
    /// background committer is asked to commit. False, with nothing
    /// buffered or counted, when there is no room.
    fn buffer_without_waiting(&self, sealed: Vec<(u64, DirtyBlock)>) -> Result<bool> {
        let count = sealed.len();
        let bytes = count as u64 * BLOCK;
        let Some(buffered) = self.log_and_buffer(sealed, Admission::MustNotWait)? else {
            return Ok(false);
        };
        self.shared().io().stats.add_client_write(bytes);
        self.committer()
            .after_buffered(count, buffered, self.tuning().dirty_limit_blocks);
        Ok(true)
    }

    /// The one way blocks enter the write-back buffer, and the held log
    /// with them (`held.rs`): under the log's lock the record's place is
    /// taken (its header written) and the blocks are buffered, so a commit
    /// takes both or neither and both keep one order; then, outside the
    /// lock and beside other writers, the record's body is copied and
    /// marked done, so a crash of this process keeps it. Only then may the
    /// write be acknowledged. Returns the blocks the buffer holds
    /// afterwards, or `None` (nothing logged or buffered) when
    /// `MustNotWait` finds no room below twice the dirty limit.
    fn log_and_buffer(
        &self,
        sealed: Vec<(u64, DirtyBlock)>,
        admission: Admission,
    ) -> Result<Option<usize>> {
        let shared = self.shared();
        let count = sealed.len();
        let entries = shared.held().entries(shared.protection(), &sealed);
        let landed = shared.held().landed(&sealed);
        let mut held = shared.held().lock();
        let mut state = shared.state().write();
        if admission == Admission::MustNotWait
            && state.held_blocks() + count >= 2 * self.tuning().dirty_limit_blocks
        {
            return Ok(None);
        }
        // A held log that cannot take a write fail-stops the volume like
        // any failed write: nothing of this write was acknowledged, and
        // what was (buffered, logged) stays readable until reopened. Room
        // (a full tmpfs) is found here, before anything is buffered.
        let placed = match shared
            .held()
            .place(&mut held, shared.io(), &entries, &sealed, landed)
        {
            Ok(placed) => placed,
            Err(error) => {
                drop(state);
                drop(held);
                return Err(shared.io().fail_stop(error));
            }
        };
        let buffered = {
            if admission == Admission::Reserved {
                state.unreserve(count, "a reserved write without its reservation");
            }
            state.logged(count);
            for (lba, dirty) in &sealed {
                state.buffer(*lba, dirty.clone());
            }
            state.held_blocks()
        };
        drop(state);
        drop(held);
        if let Some(placed) = placed {
            // A copy that fails leaves this unacknowledged write buffered
            // (readable, as a failed pwrite may leave its bytes) and the
            // volume fail-stopped.
            shared
                .held()
                .fill(shared.io(), placed, &entries, &sealed)
                .map_err(|error| shared.io().fail_stop(error))?;
        }
        Ok(Some(buffered))
    }

    /// Seal the whole blocks of `data` (block-aligned), the first at LBA
    /// `first`, with `generation` (`Shared::sealing_generation()`, or a
    /// transfer's). A protection that stores data as it is seals each block
    /// where it lies, and the blocks share `data`; one that transforms it
    /// (encryption) seals in place in `data` if nothing else holds it, else
    /// in one copy of it.
    fn seal_run(&self, first: u64, data: Bytes, generation: u64) -> Vec<(u64, DirtyBlock)> {
        let protection = self.shared().protection();
        if !protection.stores_plain() {
            return self.seal_transformed(first, data, generation);
        }
        let count = data.len() / BLOCK as usize;
        let mut sealed = Vec::with_capacity(count);
        for (index, lba) in (first..first + count as u64).enumerate() {
            let block = BlockData::of_buffer(&data, index);
            let seal = protection
                .seal_unchanged(lba, &block, generation)
                .expect("a protection that stores plain blocks seals them unchanged");
            sealed.push((lba, DirtyBlock { data: block, seal }));
        }
        sealed
    }

    /// `seal_run` for a protection that rewrites the bytes it seals.
    fn seal_transformed(&self, first: u64, data: Bytes, generation: u64) -> Vec<(u64, DirtyBlock)> {
        let mut data = data
            .try_into_mut()
            .unwrap_or_else(|shared| BytesMut::from(&shared[..]));
        // The blocks split off share the run's allocation: windows of it.
        let run_blocks = data.len() / BLOCK as usize;
        let mut sealed = Vec::with_capacity(run_blocks);
        let mut lba = first;
        while !data.is_empty() {
            let mut block = data.split_to(BLOCK as usize);
            let seal = self
                .shared()
                .protection()
                .seal(lba, &mut block[..], generation);
            sealed.push((
                lba,
                DirtyBlock {
                    data: BlockData::part_of_run(block.freeze(), run_blocks),
                    seal,
                },
            ));
            lba += 1;
        }
        sealed
    }

    fn buffer_sealed(&self, sealed: Vec<(u64, DirtyBlock)>) -> Result<()> {
        if sealed.is_empty() {
            return Ok(());
        }
        let shared = self.shared();
        let buffered = self
            .log_and_buffer(sealed, Admission::MayWait)?
            .expect("a write that may wait is always buffered");
        if buffered < self.tuning().dirty_limit_blocks {
            // No prompt commit (`Committer::prompt`) from this route: its
            // writer is a worker thread the reactor handed the request to,
            // so the second CPU is already woken for every write, and a
            // prompt would only add a journal record and its fsync per few
            // blocks. 512-byte writes at QD1 (read-modify-write, this
            // route) paid 29 us of CPU per write for it, 0.79x of
            // committing at the limit.
        } else {
            // Hand the buffer to the background committer, or commit inline
            // unless another commit is running. Writers block (and commit
            // themselves) only when the buffer has doubled: backpressure.
            let lock = if buffered >= 2 * self.tuning().dirty_limit_blocks {
                Some(self.committer().lock())
            } else if self.committer().is_background() {
                self.committer().request();
                None
            } else {
                self.committer().try_lock()
            };
            if let Some(mut journal) = lock {
                self.committer().commit(shared, &mut journal, &[])?;
            }
        }
        Ok(())
    }

    /// `write_sealed` of data blocks only if it can complete without
    /// waiting (the replica server's inline path, like `try_write`): every
    /// block verified first, then buffered if the write-back buffer has
    /// room below the level where writers commit themselves and a
    /// background committer takes the commit. `Ok(false)` when it would
    /// wait, with nothing stored.
    pub fn try_write_sealed(&self, blocks: &[SealedBlock], check: SealCheck) -> Result<bool> {
        self.shared().io().check_writable()?;
        if blocks.is_empty() || !self.committer().is_background() {
            return Ok(false);
        }
        match self.sealed_as_dirty(blocks, check)? {
            Some(dirty) => self.buffer_without_waiting(dirty),
            None => Ok(false),
        }
    }

    /// Reserve room in the write-back buffer for `count` blocks that
    /// `write_sealed_reserved` will store: what `try_write_sealed` would
    /// find, held until then so no other writer that must not wait takes
    /// it (the mirror's inline path reserves on every leg before it writes
    /// any, so it never finds a leg full halfway). False, with nothing
    /// reserved, when there is no room or no background committer.
    pub fn reserve_room(&self, count: usize) -> bool {
        if count == 0 || !self.committer().is_background() {
            return false;
        }
        let mut state = self.shared().state().write();
        if state.held_blocks() + count >= 2 * self.tuning().dirty_limit_blocks {
            return false;
        }
        state.reserve(count);
        true
    }

    /// Give back room `reserve_room` reserved and no write used.
    pub fn release_room(&self, count: usize) {
        self.shared()
            .state()
            .write()
            .unreserve(count, "more room released than reserved");
    }

    /// Store data blocks into room `reserve_room(blocks.len())` reserved,
    /// checked as `write_sealed` checks them, without waiting: buffered,
    /// the commit left to the background committer. The reservation is
    /// used up whatever the outcome. A zero-reading context (a range
    /// operation, which commits) is refused as an invalid argument, with
    /// nothing stored.
    pub fn write_sealed_reserved(&self, blocks: &[SealedBlock], check: SealCheck) -> Result<()> {
        let dirty = match self.sealed_as_dirty(blocks, check) {
            Ok(Some(dirty)) => dirty,
            Ok(None) => {
                self.release_room(blocks.len());
                return Err(Error::InvalidArgument(
                    "a zero-reading block cannot be stored in reserved room".into(),
                ));
            }
            Err(error) => {
                self.release_room(blocks.len());
                return Err(error);
            }
        };
        let shared = self.shared();
        let buffered = match self.log_and_buffer(dirty, Admission::Reserved) {
            Ok(buffered) => buffered.expect("reserved room is always buffered"),
            Err(error) => {
                self.release_room(blocks.len());
                return Err(error);
            }
        };
        shared
            .io()
            .stats
            .add_client_write(blocks.len() as u64 * BLOCK);
        self.committer()
            .after_buffered(blocks.len(), buffered, self.tuning().dirty_limit_blocks);
        Ok(())
    }

    /// Sealed data blocks checked (`check_sealed`) and ready to buffer;
    /// `None` if any is zero-reading (a range operation).
    fn sealed_as_dirty(
        &self,
        blocks: &[SealedBlock],
        check: SealCheck,
    ) -> Result<Option<Vec<(u64, DirtyBlock)>>> {
        let shared = self.shared();
        shared.io().check_writable()?;
        let mut dirty = Vec::with_capacity(blocks.len());
        for block in blocks {
            self.check_sealed(block, check)?;
            let Some(seal) = shared.protection().seal_of(&block.context) else {
                return Ok(None);
            };
            dirty.push((
                block.lba,
                DirtyBlock {
                    data: block.data.clone(),
                    seal,
                },
            ));
        }
        Ok(Some(dirty))
    }

    /// A block moved with its context: inside the volume, and verified
    /// against that context for its LBA (a failure names it); with
    /// `SealCheck::Placement`, the context only, where the protection can
    /// judge it without the bytes.
    fn check_sealed(&self, block: &SealedBlock, check: SealCheck) -> Result<()> {
        let shared = self.shared();
        if block.lba >= shared.io().geometry.blocks {
            return Err(Error::OutOfRange {
                offset: block.lba.saturating_mul(BLOCK),
                length: BLOCK,
                size: shared.io().geometry.size_bytes,
            });
        }
        let placed = match check {
            SealCheck::Full => None,
            SealCheck::Placement => shared.protection().check_place(block.lba, &block.context),
        };
        placed
            .unwrap_or_else(|| {
                shared
                    .protection()
                    .open(block.lba, &Ok(block.context), &block.data[..])
            })
            .map_err(|kind| {
                Error::Fault(Fault {
                    lba: block.lba,
                    kind,
                })
            })
    }

    /// The largest write whose sealing is cheap enough for an inline
    /// (reactor) path: any when blocks are stored as they are (a checksum,
    /// ~0.1 ms per MiB), `TRANSFORMED_INLINE_MAX_BYTES` when sealing
    /// transforms them (encrypting 1 MiB takes ~0.7 ms).
    pub fn inline_seal_max_bytes(&self) -> usize {
        if self.shared().protection().stores_plain() {
            usize::MAX
        } else {
            TRANSFORMED_INLINE_MAX_BYTES
        }
    }

    /// Seal whole blocks for storing elsewhere or here with `write_sealed`
    /// (`SealedDevice::seal_blocks`): each block's stored bytes (ciphertext
    /// on an encrypted volume) and its context carrying `generation`.
    pub fn seal_for_transfer(
        &self,
        first: u64,
        data: &Bytes,
        generation: u64,
    ) -> Result<Vec<SealedBlock>> {
        let shared = self.shared();
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
        Ok(self
            .seal_run(first, data.clone(), generation)
            .into_iter()
            .map(|(lba, DirtyBlock { data, mut seal })| {
                seal.generation = generation as u32;
                SealedBlock {
                    lba,
                    context: shared.protection().context(lba, seal, generation),
                    data,
                }
            })
            .collect())
    }

    /// Store blocks moved with their contexts (`SealedDevice::write_sealed`):
    /// each is verified against its context for its LBA first, and any
    /// failure refuses the whole call. Data blocks keep their seal (the PI
    /// computed where the data was created); zero-reading contexts become
    /// a trim or written zeroes.
    pub fn write_sealed(&self, blocks: &[SealedBlock], check: SealCheck) -> Result<()> {
        let shared = self.shared();
        shared.io().check_writable()?;
        for block in blocks {
            self.check_sealed(block, check)?;
        }
        // In the order given, so a later block for an LBA wins: data blocks
        // are buffered, and a run of consecutive zero-reading blocks of one
        // kind becomes one trim or write-zeroes (one commit, not one each),
        // after the data blocks before it are buffered.
        let mut data_blocks = Vec::with_capacity(blocks.len());
        let mut index = 0;
        while index < blocks.len() {
            let block = &blocks[index];
            if let Some(seal) = shared.protection().seal_of(&block.context) {
                data_blocks.push((
                    block.lba,
                    DirtyBlock {
                        data: block.data.clone(),
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
                && shared.protection().seal_of(&blocks[end].context).is_none()
                && matches!(blocks[end].context, Context::Zero { .. }) == allocate
            {
                end += 1;
            }
            self.buffer_sealed(std::mem::take(&mut data_blocks))?;
            let template = shared.protection().zero_template(allocate);
            let length = (end - index) as u64 * BLOCK;
            self.zero_range(block.lba * BLOCK, length, false, template)?;
            index = end;
        }
        self.buffer_sealed(data_blocks)
    }

    /// Make every write completed before this call durable.
    pub fn flush(&self) -> Result<()> {
        self.flush_answering(&mut None)
    }

    /// `flush`, answered through `done` as soon as it is durable: for a
    /// small flush that is when its redo record is (ORDER POINT A), before
    /// the blocks' home writes (`Committer::commit_for_flush`). An error
    /// after that fail-stops the volume as any failed write does; what
    /// the flush answered is in the journal.
    pub fn flush_then(&self, done: FlushDone) {
        let mut answer = Some(done);
        let flushed = self.flush_answering(&mut answer);
        if let Some(done) = answer {
            done(flushed);
        }
    }

    fn flush_answering(&self, answer: &mut Option<FlushDone>) -> Result<()> {
        let shared = self.shared();
        if shared.io().is_read_only() {
            return Ok(()); // nothing can be dirty
        }
        shared.io().check_writable()?;
        let mut journal = self.committer().lock();
        self.committer()
            .commit_for_flush(shared, &mut journal, answer)?;
        self.committer().sync_data(shared, &mut journal)?;
        shared
            .io()
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
        let template = self.shared().protection().zero_template(flags.allocate);
        self.zero_range(offset, length, flags.fua, template)
    }

    fn zero_range(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        template: vouch_format::Context,
    ) -> Result<()> {
        let shared = self.shared();
        shared.io().check_writable()?;
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
            let mut journal = self.committer().lock();
            // Buffered writes inside the range are superseded by it.
            shared.state().write().drop_buffered(first_full, end_full);
            let range = RangeOp::new(first_full, end_full, template);
            self.committer().commit(shared, &mut journal, &[range])?;
            if fua {
                self.committer().sync_data(shared, &mut journal)?;
            }
        } else if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Commit, checkpoint and mark the volume clean (`Volume::close`).
    pub fn shutdown(&self) -> Result<()> {
        let shared = self.shared();
        if shared.io().is_read_only() || shared.io().has_failed() {
            return Ok(());
        }
        let mut journal = self.committer().lock();
        self.committer().commit(shared, &mut journal, &[])?;
        self.committer()
            .checkpoint(shared, &mut journal, STATE_CLEAN)?;
        // Clean: nothing is held (the commit emptied the log), so the
        // slots go. A failure leaves empty slots, which cost nothing.
        if let Err(error) = shared.io().storage().release_held() {
            tracing::warn!(%error, "cannot remove the held log's files");
        }
        Ok(())
    }
}
