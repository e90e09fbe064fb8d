//! A vouch volume: verified reads, buffered writes, journaled commits.
//!
//! Write path (crash ordering in `commit.rs`): a write lands in the `active`
//! write-back buffer (acknowledged, not yet durable, as NBD allows); a
//! commit — on flush, FUA, a full buffer, or a trim — journals the new
//! contexts (fsync), then writes data to its home. A checkpoint later moves
//! contexts into the `contexts` file and restarts the journal.
//!
//! Read path (`read.rs`): write-back buffer first, else data from home
//! verified against its context; a mismatch is re-read once before it is
//! reported as a fault with its LBA.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex, RwLock};
use vouch_format::superblock::{FORMAT_VERSION, STATE_CLEAN, SUPERBLOCK_SLOT_BYTES};
use vouch_format::{
    FeatureFlags, Geometry, GuardKind, LayoutKind, Superblock, BLOCK_SIZE, SECTOR_SIZE,
};

use crate::contexts::ContextStore;
use crate::error::{Error, Result};
use crate::stats::Stats;
use crate::storage::{ObjectId, Storage};

pub type Block = [u8; BLOCK_SIZE as usize];
pub const BLOCK: u64 = BLOCK_SIZE as u64;

/// A shared copy of one block's bytes: one allocation and one copy
/// (`Arc::from(Box)` would allocate and copy twice).
pub(crate) fn shared_block(bytes: &[u8]) -> Arc<Block> {
    Arc::<Block>::try_from(Arc::<[u8]>::from(bytes)).expect("a slice of exactly one block")
}

/// Largest nominal volume: 1 PiB.
pub const MAX_VOLUME_BYTES: u64 = 1 << 50;

/// Knobs with measured defaults (see docs/BENCHMARKS.md).
#[derive(Clone, Copy, Debug)]
pub struct Tuning {
    /// Blocks buffered before a commit starts (16 MiB). Writers block at twice this.
    pub dirty_limit_blocks: usize,
    /// Clean context pages cached (split layout): 16384 pages = 64 MiB,
    /// enough for every context of an 8 GiB volume.
    pub context_cache_pages: usize,
    /// Committed-but-not-checkpointed contexts before a checkpoint (split):
    /// 1 Mi = at most 64 MiB resident. Each checkpoint writes back every
    /// dirty data page (order point B), so a larger overlay (and journal)
    /// means fewer of them: measured in docs/BENCHMARKS.md.
    pub overlay_limit: usize,
    /// Commit full write-back buffers on a background thread, so writers
    /// never wait for the journal or home writes until the buffer reaches
    /// twice `dirty_limit_blocks`. Off: the writer that fills the buffer
    /// commits it inline (deterministic: the simulators replay seeds).
    pub background_commit: bool,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            dirty_limit_blocks: 4096,
            context_cache_pages: 16384,
            overlay_limit: 1024 * 1024,
            background_commit: true,
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct CreateOptions {
    pub size_bytes: u64,
    pub layout: LayoutKind,
    pub guard: GuardKind,
    /// Blocks per data segment file (default: 1 TiB of data).
    pub segment_blocks: Option<u64>,
    /// Journal capacity (default: 128 MiB split, 64 MiB packed).
    pub journal_bytes: Option<u64>,
}

impl CreateOptions {
    pub fn new(size_bytes: u64) -> CreateOptions {
        CreateOptions {
            size_bytes,
            layout: LayoutKind::Split,
            guard: GuardKind::Crc32c,
            segment_blocks: None,
            journal_bytes: None,
        }
    }

    pub fn journal_bytes(&self) -> u64 {
        self.journal_bytes.unwrap_or(match self.layout {
            LayoutKind::Split => 128 << 20,
            LayoutKind::Packed => 64 << 20,
        })
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct OpenOptions {
    pub read_only: bool,
    /// Data segments bypass the host page cache (O_DIRECT, like qemu's
    /// cache=none); used by `open_volume` (file storage only).
    pub direct: bool,
    pub tuning: Tuning,
}

/// A block buffered in memory, acknowledged but not yet committed.
#[derive(Clone)]
pub(crate) struct DirtyBlock {
    pub data: Arc<Block>,
    pub guard: u64,
}

pub(crate) struct State {
    pub active: BTreeMap<u64, DirtyBlock>,
    pub committing: BTreeMap<u64, DirtyBlock>,
    pub contexts: ContextStore,
}

/// Serialized by `Volume::commit_lock`: journal position and durability.
pub(crate) struct CommitState {
    pub superblock: Superblock,
    pub next_seq: u64,
    pub journal_offset: u64,
    pub data_durable_seq: u64,
    pub unsynced: BTreeSet<ObjectId>,
}

/// A volume handle: the shared engine state (`Core`, which every operation
/// is a method of) and, unless `Tuning::background_commit` is off or the
/// volume is read-only, the background committer thread. Dropping the
/// handle stops the thread; `close` also checkpoints and marks the volume
/// clean.
pub struct Volume {
    core: Arc<Core>,
    committer: Option<JoinHandle<()>>,
}

/// Wakes the background committer.
#[derive(Default)]
pub(crate) struct CommitSignal {
    flags: Mutex<SignalFlags>,
    wake: Condvar,
}

#[derive(Default)]
struct SignalFlags {
    wanted: bool,
    stop: bool,
}

/// The engine state behind a `Volume` handle (reached through `Deref`).
pub struct Core {
    pub(crate) storage: Arc<dyn Storage>,
    pub(crate) geometry: Geometry,
    pub(crate) guard: GuardKind,
    pub(crate) uuid: [u8; 16],
    pub(crate) volume_tag: u32,
    pub(crate) journal_bytes: u64,
    read_only: Option<String>,
    pub(crate) tuning: Tuning,
    /// Readers plan under a shared lock; writers, commits and checkpoints
    /// take it exclusively.
    pub(crate) state: RwLock<State>,
    pub(crate) commit_lock: Mutex<CommitState>,
    stripes: Vec<Mutex<()>>,
    pub(crate) failed: Mutex<Option<String>>,
    pub(crate) has_failed: AtomicBool,
    pub(crate) stats: Stats,
    pub(crate) recovery: crate::recovery::RecoveryReport,
    /// Set while a background committer runs; `signal` wakes it.
    background: AtomicBool,
    signal: CommitSignal,
}

/// What `info` shows.
#[derive(Clone, Debug)]
pub struct VolumeInfo {
    pub uuid: String,
    pub size_bytes: u64,
    pub blocks: u64,
    pub block_size: u32,
    pub layout: LayoutKind,
    pub guard: GuardKind,
    pub features: FeatureFlags,
    pub segments: u32,
    pub segment_blocks: u64,
    pub journal_bytes: u64,
    pub checkpoint_seq: u64,
    pub clean: bool,
    pub read_only: bool,
    pub allocated_bytes: u64,
}

const STRIPES: usize = 64;

impl Deref for Volume {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

impl Volume {
    /// Create a new volume on empty storage.
    pub fn create(storage: Arc<dyn Storage>, options: &CreateOptions) -> Result<Volume> {
        let superblock = new_superblock(options)?;
        write_superblock_copy(&*storage, &superblock, 0)?;
        write_superblock_copy(&*storage, &superblock, 1)?;
        storage
            .sync(ObjectId::Superblock)
            .map_err(|error| Error::io("sync", ObjectId::Superblock, 0, error))?;
        Volume::open(storage, &OpenOptions::default())
    }

    /// Open a volume, recovering from the journal if it was not closed cleanly.
    pub fn open(storage: Arc<dyn Storage>, options: &OpenOptions) -> Result<Volume> {
        let core = Arc::new(Core::open(storage, options)?);
        let committer = if options.tuning.background_commit && !core.is_read_only() {
            core.background.store(true, Ordering::Release);
            let shared = Arc::clone(&core);
            let spawned = std::thread::Builder::new()
                .name("vouch-commit".into())
                .spawn(move || shared.run_committer());
            match spawned {
                Ok(handle) => Some(handle),
                Err(error) => {
                    core.background.store(false, Ordering::Release);
                    tracing::warn!(%error, "cannot start the background committer; committing inline");
                    None
                }
            }
        } else {
            None
        };
        Ok(Volume { core, committer })
    }

    /// Stop the background committer (it finishes the commit it is in).
    fn stop_committer(&mut self) {
        if let Some(handle) = self.committer.take() {
            self.core.background.store(false, Ordering::Release);
            self.core.signal.flags.lock().stop = true;
            self.core.signal.wake.notify_all();
            if handle.join().is_err() {
                tracing::error!("the background committer panicked");
            }
        }
    }

    /// Flush, checkpoint and mark the volume clean.
    pub fn close(mut self) -> Result<()> {
        self.stop_committer();
        self.core.shutdown()
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        self.stop_committer();
    }
}

impl Core {
    fn open(storage: Arc<dyn Storage>, options: &OpenOptions) -> Result<Core> {
        let superblock = read_superblock(&*storage)?;
        let unknown = superblock.features.unknown_incompat();
        if unknown != 0 {
            return Err(Error::Volume(format!(
                "volume uses incompatible features this vouch does not support (incompat bits {unknown:#x}); refusing to open"
            )));
        }
        let mut read_only = options
            .read_only
            .then(|| " (opened with --read-only)".to_string());
        let unknown_ro = superblock.features.unknown_ro_compat();
        if unknown_ro != 0 {
            read_only = Some(format!(
                " (unknown ro-compat features {unknown_ro:#x}: opened read-only)"
            ));
        }
        let geometry = superblock
            .geometry()
            .map_err(|error| Error::Volume(format!("corrupt superblock: {error}")))?;
        let volume = Core {
            storage,
            geometry,
            guard: superblock.guard,
            uuid: superblock.uuid,
            volume_tag: superblock.volume_tag(),
            journal_bytes: superblock.journal_bytes,
            read_only,
            tuning: options.tuning,
            state: RwLock::new(State {
                active: BTreeMap::new(),
                committing: BTreeMap::new(),
                contexts: ContextStore::new(options.tuning.context_cache_pages),
            }),
            commit_lock: Mutex::new(CommitState {
                superblock,
                next_seq: superblock.checkpoint_seq + 1,
                journal_offset: 0,
                data_durable_seq: superblock.checkpoint_seq,
                unsynced: BTreeSet::new(),
            }),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            failed: Mutex::new(None),
            has_failed: AtomicBool::new(false),
            stats: Stats::default(),
            recovery: Default::default(),
            background: AtomicBool::new(false),
            signal: CommitSignal::default(),
        };
        volume.recover()
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }
    pub fn size(&self) -> u64 {
        self.geometry.size_bytes
    }
    pub fn guard(&self) -> GuardKind {
        self.guard
    }
    pub fn layout(&self) -> LayoutKind {
        self.geometry.layout
    }
    pub fn is_read_only(&self) -> bool {
        self.read_only.is_some()
    }
    pub fn stats(&self) -> &Stats {
        &self.stats
    }
    pub fn recovery_report(&self) -> &crate::recovery::RecoveryReport {
        &self.recovery
    }
    pub fn uuid_string(&self) -> String {
        uuid::Uuid::from_bytes(self.uuid).hyphenated().to_string()
    }

    /// Memory held by caches and buffers now.
    pub fn resident_bytes(&self) -> u64 {
        let state = self.state.read();
        (state.active.len() + state.committing.len()) as u64 * (BLOCK + 64)
            + state.contexts.resident_bytes()
    }

    pub fn info(&self) -> Result<VolumeInfo> {
        let superblock = self.commit_lock.lock().superblock;
        let mut allocated = 0;
        for object in crate::storage::objects_of(&self.geometry) {
            allocated += self.storage.allocated_bytes(object).unwrap_or(0);
        }
        Ok(VolumeInfo {
            uuid: self.uuid_string(),
            size_bytes: self.geometry.size_bytes,
            blocks: self.geometry.blocks,
            block_size: BLOCK_SIZE,
            layout: self.geometry.layout,
            guard: self.guard,
            features: superblock.features,
            segments: self.geometry.segments(),
            segment_blocks: self.geometry.segment_blocks,
            journal_bytes: self.journal_bytes,
            checkpoint_seq: superblock.checkpoint_seq,
            clean: self.recovery.was_clean,
            read_only: self.is_read_only(),
            allocated_bytes: allocated,
        })
    }

    /// Validate a byte range: in bounds and 512-byte aligned.
    pub fn check_range(&self, offset: u64, length: u64) -> Result<()> {
        let size = self.geometry.size_bytes;
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(Error::OutOfRange {
                offset,
                length,
                size,
            });
        }
        let sector = u64::from(SECTOR_SIZE);
        if !offset.is_multiple_of(sector) || !length.is_multiple_of(sector) {
            return Err(Error::Misaligned { offset, length });
        }
        Ok(())
    }

    pub(crate) fn check_writable(&self) -> Result<()> {
        if let Some(why) = &self.read_only {
            return Err(Error::ReadOnly(why.clone()));
        }
        if self.has_failed.load(Ordering::Acquire) {
            let why = self.failed.lock().clone().unwrap_or_default();
            return Err(Error::FailStopped(why));
        }
        Ok(())
    }

    /// Record a durability failure: no further writes until reopened.
    pub(crate) fn fail_stop(&self, error: Error) -> Error {
        let mut failed = self.failed.lock();
        if failed.is_none() {
            *failed = Some(error.to_string());
            tracing::error!(%error, "volume failed stop: refusing writes until reopened");
        }
        self.has_failed.store(true, Ordering::Release);
        error
    }

    pub(crate) fn stripe(&self, lba: u64) -> &Mutex<()> {
        &self.stripes[(lba % STRIPES as u64) as usize]
    }

    /// Write `data` at `offset` (512-byte aligned). With `fua` the write is
    /// durable when this returns; otherwise after the next flush.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, data.len() as u64)?;
        self.stats.add_client_write(data.len() as u64);
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
                self.read_blocks(lba, 1, &mut block[..], None)?;
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

    fn buffer_blocks(&self, blocks: Vec<(u64, Arc<Block>)>) -> Result<()> {
        let guarded: Vec<(u64, DirtyBlock)> = blocks
            .into_iter()
            .map(|(lba, data)| {
                let guard = self.guard.compute(&data[..]);
                (lba, DirtyBlock { data, guard })
            })
            .collect();
        let buffered = {
            let mut state = self.state.write();
            for (lba, dirty) in guarded {
                state.active.insert(lba, dirty);
            }
            state.active.len()
        };
        if buffered >= self.tuning.dirty_limit_blocks {
            // Hand the buffer to the background committer, or commit inline
            // unless another commit is running. Writers block (and commit
            // themselves) only when the buffer has doubled: backpressure.
            let lock = if buffered >= 2 * self.tuning.dirty_limit_blocks {
                Some(self.commit_lock.lock())
            } else if self.background.load(Ordering::Acquire) {
                self.request_commit();
                None
            } else {
                self.commit_lock.try_lock()
            };
            if let Some(mut commit) = lock {
                self.commit(&mut commit, &[])?;
            }
        }
        Ok(())
    }

    fn request_commit(&self) {
        let mut flags = self.signal.flags.lock();
        if !flags.wanted {
            flags.wanted = true;
            self.signal.wake.notify_one();
        }
    }

    /// The background committer: commit the write-back buffer each time a
    /// writer fills it. A failed commit has already fail-stopped the
    /// volume, so writers see the error on their next call.
    fn run_committer(&self) {
        loop {
            {
                let mut flags = self.signal.flags.lock();
                while !flags.wanted && !flags.stop {
                    self.signal.wake.wait(&mut flags);
                }
                if flags.stop {
                    return;
                }
                flags.wanted = false;
            }
            let mut commit = self.commit_lock.lock();
            if let Err(error) = self.commit(&mut commit, &[]) {
                tracing::debug!(%error, "background commit failed");
            }
        }
    }

    /// Make every write completed before this call durable.
    pub fn flush(&self) -> Result<()> {
        if self.read_only.is_some() {
            return Ok(()); // nothing can be dirty
        }
        self.check_writable()?;
        let mut commit = self.commit_lock.lock();
        self.commit(&mut commit, &[])?;
        self.sync_data(&mut commit)?;
        self.stats.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Deallocate: the range reads as zeros afterwards. Sub-block edges are
    /// written as zeros (read-modify-write).
    pub fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.zero_range(offset, length, fua, vouch_format::Context::Unwritten)
    }

    /// Write zeroes. `allocate` (NBD NO_HOLE) records the blocks as written
    /// zeroes rather than holes; either way no data is written.
    pub fn write_zeroes(&self, offset: u64, length: u64, fua: bool, allocate: bool) -> Result<()> {
        let template = if allocate {
            vouch_format::Context::Zero {
                volume_tag: self.volume_tag,
                ref_tag: 0,
                generation: 0,
            }
        } else {
            vouch_format::Context::Unwritten
        };
        self.zero_range(offset, length, fua, template)
    }

    fn zero_range(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        template: vouch_format::Context,
    ) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, length)?;
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
            let mut commit = self.commit_lock.lock();
            {
                // Buffered writes inside the range are superseded by it.
                let mut state = self.state.write();
                let stale: Vec<u64> = state
                    .active
                    .range(first_full..end_full)
                    .map(|(lba, _)| *lba)
                    .collect();
                for lba in stale {
                    state.active.remove(&lba);
                }
            }
            let range = crate::commit::RangeOp {
                start: first_full,
                end: end_full,
                template,
            };
            self.commit(&mut commit, &[range])?;
            if fua {
                self.sync_data(&mut commit)?;
            }
        } else if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Commit, checkpoint and mark the volume clean (`Volume::close`).
    fn shutdown(&self) -> Result<()> {
        if self.read_only.is_some() || self.has_failed.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut commit = self.commit_lock.lock();
        self.commit(&mut commit, &[])?;
        self.checkpoint(&mut commit, STATE_CLEAN)
    }
}

/// A volume size vouch can create: a positive multiple of 4096 bytes, at
/// most `MAX_VOLUME_BYTES`. Too large is reported first: a huge size is
/// rarely a multiple of 4096, and "too large" is the useful answer.
pub(crate) fn check_volume_size(size_bytes: u64) -> Result<()> {
    if size_bytes > MAX_VOLUME_BYTES {
        return Err(Error::Volume(format!(
            "size {size_bytes} is larger than the largest volume vouch supports ({MAX_VOLUME_BYTES} bytes, 1 PiB)"
        )));
    }
    if size_bytes == 0 || !size_bytes.is_multiple_of(BLOCK) {
        return Err(Error::Volume(format!(
            "size {size_bytes} is not a positive multiple of 4096 bytes"
        )));
    }
    Ok(())
}

fn new_superblock(options: &CreateOptions) -> Result<Superblock> {
    check_volume_size(options.size_bytes)?;
    let journal_bytes = options.journal_bytes();
    if journal_bytes < 1 << 20 || !journal_bytes.is_multiple_of(BLOCK) {
        return Err(Error::Volume(
            "journal must be at least 1 MiB and a multiple of 4096".into(),
        ));
    }
    let segment_blocks = options
        .segment_blocks
        .unwrap_or_else(|| vouch_format::layout::default_segment_blocks(options.layout));
    Geometry::new(options.layout, options.size_bytes, segment_blocks)
        .map_err(|error| Error::Volume(format!("bad geometry: {error}")))?;
    Ok(Superblock {
        version: FORMAT_VERSION,
        features: FeatureFlags::for_layout(options.layout),
        uuid: *uuid::Uuid::new_v4().as_bytes(),
        block_size: BLOCK_SIZE,
        guard: options.guard,
        layout: options.layout,
        size_bytes: options.size_bytes,
        segment_blocks,
        journal_bytes,
        generation: 1,
        checkpoint_seq: 0,
        state: STATE_CLEAN,
        created_unix_secs: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs()),
    })
}

pub(crate) fn write_superblock_copy(
    storage: &dyn Storage,
    superblock: &Superblock,
    copy: u64,
) -> Result<()> {
    let mut slot = vec![0u8; SUPERBLOCK_SLOT_BYTES as usize];
    slot[..vouch_format::SUPERBLOCK_BYTES].copy_from_slice(&superblock.encode());
    let offset = copy * SUPERBLOCK_SLOT_BYTES;
    storage
        .write_at(ObjectId::Superblock, offset, &slot)
        .map_err(|error| Error::io("write", ObjectId::Superblock, offset, error))
}

/// Read both superblock copies and pick the newest valid one.
pub fn read_superblock(storage: &dyn Storage) -> Result<Superblock> {
    let mut copies = Vec::with_capacity(2);
    for copy in 0..2u64 {
        let mut slot = vec![0u8; SUPERBLOCK_SLOT_BYTES as usize];
        let offset = copy * SUPERBLOCK_SLOT_BYTES;
        storage
            .read_at(ObjectId::Superblock, offset, &mut slot)
            .map_err(|error| Error::io("read", ObjectId::Superblock, offset, error))?;
        copies.push(Superblock::decode(&slot));
    }
    let second = copies.pop().expect("two copies");
    let first = copies.pop().expect("two copies");
    if let (Err(a), Err(b)) = (&first, &second) {
        return Err(Error::Volume(format!(
            "not a usable vouch volume: both superblock copies are invalid (copy 0: {a}; copy 1: {b})"
        )));
    }
    if let Err(error) = &first {
        tracing::warn!(%error, "superblock copy 0 is invalid; using copy 1");
    }
    if let Err(error) = &second {
        tracing::warn!(%error, "superblock copy 1 is invalid; using copy 0");
    }
    Superblock::newest(first, second)
        .map_err(|error| Error::Volume(format!("corrupt superblock: {error}")))
}
