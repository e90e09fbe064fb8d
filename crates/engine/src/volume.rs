//! `Volume`: the public handle on an open volume. It owns the engine's
//! parts (`engine.rs`) and, unless `Tuning::background_commit` is off, the
//! volume is read-only or its caller steps the commits
//! (`OpenOptions::schedule`), the background committer thread. Dropping
//! the handle stops the thread; `close` also checkpoints and marks the
//! volume clean. Its data path is the `BlockDevice` trait.

use std::ops::Range;
use std::sync::Arc;
use std::thread::JoinHandle;

use bytes::Bytes;
use vouch_format::{FeatureFlags, Geometry, GuardKind, LayoutKind, BLOCK_SIZE};

use crate::device::{BlockDevice, ReadDone, SealedBlock, StartRead};
use crate::engine::Engine;
use crate::error::{Error, Fault, Result};
use crate::keys::UserSecret;
use crate::layout::Allocation;
use crate::options::{CreateOptions, OpenOptions};
use crate::recovery::RecoveryReport;
use crate::stats::Stats;
use crate::storage::{objects_of, ObjectId, ReadLater, Storage};
use crate::superblock::{new_superblock, write_superblock_copy};
use crate::write::SealCheck;
use crate::write::ZeroFlags;

pub use crate::state::BLOCK;

pub struct Volume {
    engine: Arc<Engine>,
    committer: Option<JoinHandle<()>>,
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
    /// This vouch opens the volume read-only whatever is asked: it carries
    /// ro_compat features this build does not know. A property of the
    /// volume, not of how it was opened (`info` itself opens read-only).
    pub read_only: bool,
    pub allocated_bytes: u64,
    /// Encrypted (AES-256-GCM-SIV); `kdf` says how its key is given.
    pub encrypted: bool,
    /// Encrypted volumes: "raw key" or "passphrase (Argon2id)".
    pub key_kind: Option<&'static str>,
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
        let open = OpenOptions {
            key: options.encrypt.clone(),
            ..OpenOptions::default()
        };
        Volume::open(storage, &open)
    }

    /// Rewrap an encrypted volume's data key under a new key or
    /// passphrase (crash-safe: `Engine::change_key`). The data is not
    /// rewritten; afterwards only the new key opens the volume.
    pub fn change_key(&self, secret: &UserSecret) -> Result<()> {
        self.engine.change_key(secret)
    }

    /// Is the volume encrypted?
    pub fn encrypted(&self) -> bool {
        self.engine.encrypted()
    }

    /// Open a volume, recovering from the journal if it was not closed cleanly.
    pub fn open(storage: Arc<dyn Storage>, options: &OpenOptions) -> Result<Volume> {
        let engine = Arc::new(Engine::open(storage, options)?);
        let background = options.tuning.background_commit && !engine.shared.io.is_read_only();
        let committer = if background && engine.committer.is_stepped() {
            // The caller runs the commits writers request
            // (`run_requested_commit`): no thread.
            engine.committer.set_background(true);
            None
        } else if background {
            engine.committer.set_background(true);
            let shared = Arc::clone(&engine);
            let spawned = std::thread::Builder::new()
                .name("vouch-commit".into())
                .spawn(move || shared.committer.run(&shared.shared));
            match spawned {
                Ok(handle) => Some(handle),
                Err(error) => {
                    engine.committer.set_background(false);
                    tracing::warn!(%error, "cannot start the background committer; committing inline");
                    None
                }
            }
        } else {
            None
        };
        Ok(Volume { engine, committer })
    }

    /// Stop the background committer (it finishes the commit it is in).
    fn stop_committer(&mut self) {
        if let Some(handle) = self.committer.take() {
            self.engine.committer.stop();
            if handle.join().is_err() {
                tracing::error!("the background committer panicked");
            }
        }
    }

    /// Run the background commit a writer requested, if one did, on this
    /// thread: the committer thread's work, for a volume whose caller
    /// steps its commits (`OpenOptions::schedule`, the simulator). Returns
    /// whether a commit ran; always false for other volumes (their thread,
    /// if any, takes the requests).
    pub fn run_requested_commit(&self) -> bool {
        let committer = &self.engine.committer;
        committer.is_stepped()
            && committer.is_background()
            && committer.run_requested(&self.engine.shared)
    }

    /// Flush, checkpoint and mark the volume clean.
    pub fn close(mut self) -> Result<()> {
        self.stop_committer();
        self.engine.shutdown()
    }

    /// The engine behind the handle (for offloads such as `copy`).
    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn geometry(&self) -> Geometry {
        self.engine.shared.io.geometry
    }
    pub fn guard(&self) -> GuardKind {
        self.engine.guard
    }
    pub fn layout(&self) -> LayoutKind {
        self.engine.shared.layouts.primary().kind()
    }
    pub fn stats(&self) -> &Stats {
        &self.engine.shared.io.stats
    }
    pub fn recovery_report(&self) -> &RecoveryReport {
        &self.engine.recovery
    }
    pub fn uuid_string(&self) -> String {
        uuid::Uuid::from_bytes(self.engine.shared.uuid)
            .hyphenated()
            .to_string()
    }

    /// Verify every block that may hold data (`check::check`).
    pub fn check(&self, progress: impl FnMut(u64, u64)) -> Result<crate::check::CheckReport> {
        crate::check::check(self, progress)
    }

    /// Files shorter than the volume needs, found at open: each names the
    /// LBAs whose data or metadata lies past its end (they read as faults).
    pub fn short_objects(&self) -> &[crate::damage::ShortObject] {
        &self.engine.short_objects
    }

    /// Why block `lba` has no protection information (the cause of a
    /// `metadata_lost` fault): "contexts: page 40 is zeroed: LBAs
    /// 5120-5247 have no protection information".
    pub fn metadata_cause(&self, lba: u64) -> String {
        self.engine.shared.metadata_cause(lba)
    }

    /// Why the blocks of `lba`'s unit fail their tags when the unit was
    /// copied in from another place or volume (`None` otherwise): "contexts:
    /// page 3 belongs to another place (its slots name LBAs 640-767): LBAs
    /// 384-511 have no valid protection information".
    pub fn misplaced_cause(&self, lba: u64) -> Option<String> {
        self.engine.shared.misplaced_cause(lba)
    }

    /// The LBAs whose protection information is kept with `lba`'s (its
    /// written-map unit: a split context page, a packed row).
    pub fn metadata_unit(&self, lba: u64) -> Range<u64> {
        let written = &self.engine.shared.io.written;
        written.lbas_of(written.unit_of(lba), self.geometry().blocks)
    }

    /// Memory held by caches and buffers now.
    pub fn resident_bytes(&self) -> u64 {
        self.engine.shared.state.read().resident_bytes()
    }

    pub fn info(&self) -> Result<VolumeInfo> {
        let geometry = self.geometry();
        let io = &self.engine.shared.io;
        let mut allocated = 0;
        for object in objects_of(&geometry) {
            allocated += io.storage().allocated_bytes(object).unwrap_or(0);
        }
        let mut info = VolumeInfo::of(&self.engine.superblock(), &geometry, allocated);
        info.journal_bytes = self.engine.committer.journal_bytes();
        info.clean = self.engine.recovery.was_clean;
        Ok(info)
    }
}

impl VolumeInfo {
    /// What `superblock` says, with the objects' allocation; `clean` is
    /// the superblock's state (an open volume knows better: its recovery).
    pub(crate) fn of(
        superblock: &vouch_format::Superblock,
        geometry: &Geometry,
        allocated_bytes: u64,
    ) -> VolumeInfo {
        let encrypted = superblock.features.incompat & FeatureFlags::INCOMPAT_ENCRYPTED != 0;
        VolumeInfo {
            uuid: uuid::Uuid::from_bytes(superblock.uuid)
                .hyphenated()
                .to_string(),
            size_bytes: geometry.size_bytes,
            blocks: geometry.blocks,
            block_size: BLOCK_SIZE,
            layout: geometry.layout,
            guard: superblock.guard,
            features: superblock.features,
            segments: geometry.segments(),
            segment_blocks: geometry.segment_blocks,
            journal_bytes: superblock.journal_bytes,
            checkpoint_seq: superblock.checkpoint_seq,
            clean: superblock.state == vouch_format::superblock::STATE_CLEAN,
            read_only: superblock.features.unknown_ro_compat() != 0,
            allocated_bytes,
            encrypted,
            key_kind: encrypted.then_some(match superblock.key_wrap.kdf {
                vouch_format::superblock::KDF_ARGON2ID => "passphrase (Argon2id)",
                _ => "raw 32-byte key",
            }),
        }
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        self.stop_committer();
        // Dropped without `close`: when no acknowledged write waits for its
        // commit, the held log's files go as well, so a handle dropped
        // (a command that failed, a test) leaves nothing in tmpfs; when
        // some do, they stay for the next open, as after a crash.
        self.engine.release_held_if_empty();
    }
}

/// A `verify` of this many blocks (4 MiB) or more runs on the scan's
/// reader threads.
const PARALLEL_VERIFY_BLOCKS: u64 = 4 * crate::jobs::SCAN_CHUNK_BLOCKS;

impl BlockDevice for Volume {
    fn size(&self) -> u64 {
        self.engine.shared.io.geometry.size_bytes
    }
    fn is_read_only(&self) -> bool {
        self.engine.shared.io.is_read_only()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        self.engine.shared.read(offset, buf)
    }
    fn try_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<Vec<Range<u64>>>> {
        self.engine.shared.try_read(offset, buf)
    }
    /// One I/O through the storage's ring; the blocks are verified on the
    /// reaping thread against the contexts planned before it started.
    fn try_begin_read(&self, offset: u64, len: usize) -> Option<StartRead> {
        if !self.engine.shared.io.reads_ready() {
            return None;
        }
        let read = self.engine.shared.plan_ring_read(offset, len)?;
        let engine = Arc::clone(&self.engine);
        Some(Box::new(move |done: ReadDone| {
            let span = read.span;
            let io = &engine.shared.io;
            let answer = Arc::clone(&engine);
            let finish: ReadLater = Box::new(move |bytes| {
                done(
                    bytes
                        .ok()
                        .and_then(|bytes| answer.shared.finish_ring_read(&read, &bytes)),
                )
            });
            if let Err(finish) = io.start_read(span.object, span.offset, span.len, finish) {
                finish(Err(std::io::ErrorKind::WouldBlock.into()));
            }
        }))
    }
    fn read_events(&self) -> Option<std::os::fd::RawFd> {
        self.engine.shared.io.read_events()
    }
    fn reap_reads(&self) -> std::io::Result<()> {
        self.engine.shared.io.reap_reads()
    }
    fn reads_in_flight(&self) -> usize {
        self.engine.shared.io.reads_in_flight()
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.engine.write(offset, data, fua)
    }
    fn try_write(&self, offset: u64, data: &[u8]) -> Result<bool> {
        self.engine
            .try_write_shared(offset, &Bytes::copy_from_slice(data))
    }
    fn write_shared(&self, offset: u64, data: &Bytes, fua: bool) -> Result<()> {
        self.engine.write_shared(offset, data, fua)
    }
    fn try_write_shared(&self, offset: u64, data: &Bytes) -> Result<bool> {
        self.engine.try_write_shared(offset, data)
    }
    fn landing_buffer(&self, len: usize) -> Option<crate::LandingBuffer> {
        self.engine.landing_buffer(len)
    }
    fn flush(&self) -> Result<()> {
        self.engine.flush()
    }
    fn flush_then(&self, done: crate::device::FlushDone) {
        self.engine.flush_then(done)
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.engine.trim(offset, length, fua)
    }
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()> {
        self.engine.write_zeroes(offset, length, flags)
    }
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>> {
        self.engine.shared.block_status(offset, length, max_blocks)
    }
    fn as_volume(&self) -> Option<&Volume> {
        Some(self)
    }
    /// Long ranges on the scan's reader threads (`verify::verify`), short
    /// ones on the calling thread (starting threads would cost more).
    fn verify(&self, first: u64, count: u64) -> Result<Vec<Fault>> {
        if count < PARALLEL_VERIFY_BLOCKS {
            return crate::device::verify_in_turn(self, first, count);
        }
        let report = crate::verify::verify(
            self,
            first,
            count,
            &crate::verify::VerifyOptions::default(),
            &crate::jobs::JobControl::default(),
        )?;
        Ok(report.faults)
    }
    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        self.engine.shared.read_blocks_collecting(first, count, out)
    }
    fn next_possible_data(&self, lba: u64) -> Result<u64> {
        self.engine.shared.next_possible_data(lba)
    }
    fn metadata_unit(&self, lba: u64) -> Range<u64> {
        Volume::metadata_unit(self, lba)
    }
    fn read_sealed(&self, first: u64, count: u64) -> Result<Vec<SealedBlock>> {
        let generation = self.engine.committer.lock().next_seq;
        self.engine.shared.read_sealed(first, count, generation)
    }
    fn write_sealed(&self, blocks: &[SealedBlock]) -> Result<()> {
        self.engine.write_sealed(blocks, SealCheck::Full)
    }
    fn try_write_sealed(&self, blocks: &[SealedBlock]) -> Result<bool> {
        self.engine.try_write_sealed(blocks, SealCheck::Full)
    }
    fn write_sealed_here(&self, blocks: &[SealedBlock]) -> Result<()> {
        self.engine.write_sealed(blocks, SealCheck::Placement)
    }
    fn reserve_room(&self, count: usize) -> bool {
        self.engine.reserve_room(count)
    }
    fn release_room(&self, count: usize) {
        self.engine.release_room(count)
    }
    fn write_sealed_reserved(&self, blocks: &[SealedBlock]) -> Result<()> {
        self.engine
            .write_sealed_reserved(blocks, SealCheck::Placement)
    }
    fn inline_seal_max_bytes(&self) -> usize {
        self.engine.inline_seal_max_bytes()
    }
    fn seal_blocks(&self, first: u64, data: &Bytes, generation: u64) -> Result<Vec<SealedBlock>> {
        self.engine.seal_for_transfer(first, data, generation)
    }
    fn generation_clock(&self) -> u64 {
        self.engine.shared.sealing_generation()
    }
    /// Copy within the volume next to the data (`copy::copy`, method
    /// `Auto`): reflink when the filesystem shares extents, else pipelined.
    fn copy(&self, source: u64, destination: u64, count: u64) -> Result<()> {
        let options = crate::copy::CopyOptions::default();
        let control = crate::jobs::JobControl::default();
        crate::copy::copy(self, source, self, destination, count, &options, &control).map(|_| ())
    }
}
