//! `Volume`: the public handle on an open volume. It owns the engine's
//! parts (`engine.rs`) and, unless `Tuning::background_commit` is off, the
//! volume is read-only or its caller steps the commits
//! (`OpenOptions::schedule`), the background committer thread. Dropping
//! the handle stops the thread; `close` also checkpoints and marks the
//! volume clean. Its data path is the `BlockDevice` trait.

use std::ops::Range;
use std::sync::Arc;
use std::thread::JoinHandle;

use vouch_format::{FeatureFlags, Geometry, GuardKind, LayoutKind, BLOCK_SIZE};

mod device;
mod online_resize;

pub use online_resize::{OnlineResized, Reopen, ResizeSteps};

use crate::copy::MethodCache;
use crate::device::BlockDevice;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::keys::UserSecret;
use crate::options::{CreateOptions, OpenOptions};
use crate::recovery::RecoveryReport;
use crate::stats::Stats;
use crate::storage::{objects_of, ObjectId, Storage};
use crate::superblock::{new_superblock, write_superblock_copy};

pub use crate::state::BLOCK;

pub struct Volume {
    /// The open engine. Every call takes this lock for reading while it
    /// uses the engine; an online resize (`resize_online`) takes it for
    /// writing, closes the engine, resizes the files and puts the engine
    /// of the new size here.
    engine: parking_lot::RwLock<Arc<Engine>>,
    /// The engine the volume was opened with: its storage's read ring is
    /// the one the server watches (`read_events`), so it stays alive.
    first: Arc<Engine>,
    committer: parking_lot::Mutex<Option<JoinHandle<()>>>,
    /// The size new callers see (`BlockDevice::size`, which the NBD
    /// handshake asks on its reactor, so it never waits for a resize):
    /// the engine's, lowered before a shrink and raised after a grow.
    size: std::sync::atomic::AtomicU64,
    /// How the volume was opened (an online resize opens it again so).
    options: OpenOptions,
    /// The copy method `Auto` chose per source volume (`copy.rs`).
    copy_methods: MethodCache,
}

/// The volume behind a device when it is one (`BlockDevice::as_any`):
/// `copy::copy`'s reflink path between two volumes.
pub(crate) trait AsVolume {
    fn as_volume(&self) -> Option<&Volume>;
}

impl<D: BlockDevice + ?Sized> AsVolume for D {
    fn as_volume(&self) -> Option<&Volume> {
        self.as_any()?.downcast_ref()
    }
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
        self.current().change_key(secret)
    }

    /// Make this volume a member of a REGIONS volume (`regions.rs`): set
    /// the REGIONS flag and `regions_seq` (the home member's record seq;
    /// 0 in the other member), a superblock write.
    pub(crate) fn set_regions(&self, seq: u64) -> Result<()> {
        self.current().update_superblock(|superblock| {
            superblock.features.incompat |= vouch_format::FeatureFlags::INCOMPAT_REGIONS;
            superblock.regions_seq = seq;
        })
    }

    /// No longer a member of a REGIONS volume: the flag and `regions_seq`
    /// cleared (every region back in this, the home member).
    pub(crate) fn clear_regions(&self) -> Result<()> {
        self.current().update_superblock(|superblock| {
            superblock.features.incompat &= !vouch_format::FeatureFlags::INCOMPAT_REGIONS;
            superblock.regions_seq = 0;
        })
    }

    /// Set (`on`) or clear the FENCED flag (a fenced snapshot is being
    /// materialised: `snapshot/fenced.rs`), a superblock write when it
    /// changes.
    pub fn set_fenced(&self, on: bool) -> Result<()> {
        use vouch_format::FeatureFlags;
        let engine = self.current();
        let has = engine.superblock().features.incompat & FeatureFlags::INCOMPAT_FENCED != 0;
        if has == on {
            return Ok(());
        }
        engine.update_superblock(|superblock| {
            if on {
                superblock.features.incompat |= FeatureFlags::INCOMPAT_FENCED;
            } else {
                superblock.features.incompat &= !FeatureFlags::INCOMPAT_FENCED;
            }
        })
    }

    /// Does the superblock carry OVERLAID?
    pub fn overlaid(&self) -> bool {
        self.current().superblock().features.incompat
            & vouch_format::FeatureFlags::INCOMPAT_OVERLAID
            != 0
    }

    /// Set or clear OVERLAID (the volume has an overlay snapshot,
    /// `snapshot/overlay.rs`), a superblock write. Not at a flush point
    /// (it takes the commit lock).
    pub fn set_overlaid(&self, overlaid: bool) -> Result<()> {
        self.current().update_superblock(|superblock| {
            if overlaid {
                superblock.features.incompat |= vouch_format::FeatureFlags::INCOMPAT_OVERLAID;
            } else {
                superblock.features.incompat &= !vouch_format::FeatureFlags::INCOMPAT_OVERLAID;
            }
        })
    }

    /// Is the volume encrypted?
    pub fn encrypted(&self) -> bool {
        self.first.encrypted()
    }

    /// Open a volume, recovering from the journal if it was not closed cleanly.
    pub fn open(storage: Arc<dyn Storage>, options: &OpenOptions) -> Result<Volume> {
        let engine = Arc::new(Engine::open(storage, options)?);
        let committer = start_committer(&engine, options);
        Ok(Volume {
            size: engine.shared().io().geometry.size_bytes.into(),
            first: Arc::clone(&engine),
            engine: parking_lot::RwLock::new(engine),
            committer: parking_lot::Mutex::new(committer),
            options: options.clone(),
            copy_methods: MethodCache::default(),
        })
    }

    /// Stop the background committer (it finishes the commit it is in).
    fn stop_committer(&self, engine: &Engine) {
        if let Some(handle) = self.committer.lock().take() {
            engine.committer().stop();
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
        let engine = self.engine.read();
        let committer = engine.committer();
        committer.is_stepped()
            && committer.is_background()
            && committer.run_requested(engine.shared())
    }

    /// Flush, checkpoint and mark the volume clean.
    pub fn close(self) -> Result<()> {
        let engine = self.engine();
        self.stop_committer(&engine);
        engine.shutdown()
    }

    /// Run `at` with the volume's files at a flush point (an online
    /// snapshot, `snapshot.rs`): under the commit lock, the write-back
    /// buffer (and with it the held log's records) is committed and a
    /// checkpoint moves every committed context home, syncs the data, the
    /// written map and the superblock. Until `at` returns no commit runs,
    /// so nothing reaches the volume's files: writers meanwhile are still
    /// admitted into the buffer and the held log (acknowledged as ever,
    /// durable there) until the buffer reaches twice its dirty limit; a
    /// flush or FUA waits for the lock. `at` is given the superblock the
    /// checkpoint wrote (state open: the volume is in use).
    pub fn at_flush_point<R>(
        &self,
        at: &mut dyn FnMut(&vouch_format::Superblock) -> Result<R>,
    ) -> Result<R> {
        let engine = self.engine.read();
        let journal = commit_and_checkpoint(&engine)?;
        let superblock = journal.superblock();
        at(&superblock)
    }

    /// Commit the write-back buffer and checkpoint now, the commit lock
    /// released after: run before `at_flush_point`, it does most of that
    /// one's work while writers and flushes go on, so the flush point has
    /// only what came since to commit and move home.
    pub fn checkpoint_now(&self) -> Result<()> {
        commit_and_checkpoint(&self.engine.read()).map(drop)
    }

    /// The storage under the volume now (a fenced snapshot arms its
    /// before-image layer, `snapshot/fenced.rs`).
    pub fn storage(&self) -> Arc<dyn crate::storage::Storage> {
        self.current().shared().io().storage_arc()
    }

    /// The engine behind the handle now (for offloads such as `copy`,
    /// which run on the engine they started with: `resize_online` waits
    /// until no one else holds it).
    pub(crate) fn engine(&self) -> Arc<Engine> {
        Arc::clone(&self.engine.read())
    }

    /// The engine, held for one call: an online resize waits for it.
    fn current(&self) -> parking_lot::RwLockReadGuard<'_, Arc<Engine>> {
        self.engine.read()
    }

    /// `current`, without waiting: `None` while a resize holds the
    /// volume (a call that must not block then declines).
    fn current_now(&self) -> Option<parking_lot::RwLockReadGuard<'_, Arc<Engine>>> {
        self.engine.try_read()
    }

    /// The copy method `Auto` chose per source volume, for copies into
    /// this one (`copy.rs`).
    pub(crate) fn copy_methods(&self) -> &MethodCache {
        &self.copy_methods
    }

    pub fn geometry(&self) -> Geometry {
        self.current().shared().io().geometry
    }
    // Fixed at creation: the first engine answers without waiting for a
    // resize (the control API asks on its reactor).
    pub fn guard(&self) -> GuardKind {
        self.first.guard()
    }
    pub fn layout(&self) -> LayoutKind {
        self.first.shared().layouts().primary().kind()
    }
    pub fn stats(&self) -> &Stats {
        // Shared by every engine the volume has had (`resize_online`).
        &self.first.shared().io().stats
    }
    pub fn recovery_report(&self) -> &RecoveryReport {
        // What the open's recovery found (a resize's reopen recovers nothing).
        self.first.recovery()
    }
    pub fn uuid_string(&self) -> String {
        uuid::Uuid::from_bytes(self.first.shared().uuid())
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
        // Found at open (a resize makes every file its nominal length).
        self.first.short_objects()
    }

    /// Why block `lba` has no protection information (the cause of a
    /// `metadata_lost` fault): "contexts: page 40 is zeroed: LBAs
    /// 5120-5247 have no protection information".
    pub fn metadata_cause(&self, lba: u64) -> String {
        self.current().shared().metadata_cause(lba)
    }

    /// Why the blocks of `lba`'s unit fail their tags when the unit was
    /// copied in from another place or volume (`None` otherwise): "contexts:
    /// page 3 belongs to another place (its slots name LBAs 640-767): LBAs
    /// 384-511 have no valid protection information".
    pub fn misplaced_cause(&self, lba: u64) -> Option<String> {
        self.current().shared().misplaced_cause(lba)
    }

    /// The LBAs whose protection information is kept with `lba`'s (its
    /// written-map unit: a split context page, a packed row).
    pub fn metadata_unit(&self, lba: u64) -> Range<u64> {
        let engine = self.current();
        let written = &engine.shared().io().written;
        // Not `self.geometry()`: a second read of the engine lock waits
        // behind a queued resize that waits for this one (parking_lot's
        // lock is fair).
        written.lbas_of(written.unit_of(lba), engine.shared().io().geometry.blocks)
    }

    /// Memory held by caches and buffers now.
    pub fn resident_bytes(&self) -> u64 {
        self.current().shared().state().read().resident_bytes()
    }

    pub fn info(&self) -> Result<VolumeInfo> {
        let engine = self.current();
        let io = engine.shared().io();
        let mut allocated = 0;
        for object in objects_of(&io.geometry) {
            allocated += io.storage().allocated_bytes(object).unwrap_or(0);
        }
        let mut info = VolumeInfo::of(&engine.superblock(), &io.geometry, allocated);
        info.journal_bytes = engine.committer().journal_bytes();
        info.clean = self.first.recovery().was_clean;
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
            read_only: superblock.features.unknown_ro_compat() != 0
                || superblock.features.ro_compat & FeatureFlags::RO_COMPAT_SNAPSHOT != 0,
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
        let engine = self.engine();
        self.stop_committer(&engine);
        // Dropped without `close`: when no acknowledged write waits for its
        // commit, the held log's files go as well, so a handle dropped
        // (a command that failed, a test) leaves nothing in tmpfs; when
        // some do, they stay for the next open, as after a crash.
        engine.release_held_if_empty();
    }
}

/// Commit and checkpoint (the volume's state unchanged), returning
/// the commit lock held.
fn commit_and_checkpoint(
    engine: &Engine,
) -> Result<parking_lot::MutexGuard<'_, crate::journal::Journal>> {
    let shared = engine.shared();
    shared.io().check_writable()?;
    let mut journal = engine.committer().lock();
    engine.committer().commit(shared, &mut journal, &[])?;
    let state = journal.superblock().state;
    engine.committer().checkpoint(shared, &mut journal, state)?;
    Ok(journal)
}

/// The background committer of a newly opened `engine`, unless it is
/// read-only, its commits are foreground, or its caller steps them.
fn start_committer(engine: &Arc<Engine>, options: &OpenOptions) -> Option<JoinHandle<()>> {
    let background = options.tuning.background_commit && !engine.shared().io().is_read_only();
    if background && engine.committer().is_stepped() {
        // The caller runs the commits writers request
        // (`run_requested_commit`): no thread.
        engine.committer().set_background(true);
        None
    } else if background {
        engine.committer().set_background(true);
        let shared = Arc::clone(engine);
        let spawned = std::thread::Builder::new()
            .name("vouch-commit".into())
            .spawn(move || shared.committer().run(shared.shared()));
        match spawned {
            Ok(handle) => Some(handle),
            Err(error) => {
                engine.committer().set_background(false);
                tracing::warn!(%error, "cannot start the background committer; committing inline");
                None
            }
        }
    } else {
        None
    }
}
