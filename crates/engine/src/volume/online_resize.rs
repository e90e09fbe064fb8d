//! `Volume::resize_online`: a served volume resized in place of its
//! handle (`vouch resize --server`, the control API). Beside the engine:
//! the handle's lock on its engine is taken for writing, the engine is
//! closed cleanly, the files are resized by the offline code
//! (`resize::resize`, the same crash ordering: docs/CRASH_MODEL.md,
//! "Resize"), and an engine of the new size is opened in its place. The
//! calls of clients wait meanwhile (none is in the old engine once the
//! lock is held, none reaches it after); nothing acknowledged is in the
//! old engine's memory only: its close committed and checkpointed it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vouch_format::{FeatureFlags, Superblock};

use super::{start_committer, Volume};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::storage::Storage;

/// How long a resize waits for others holding the engine (reads of the
/// ring in flight, a copy running on it) to let go of it.
const LET_GO: Duration = Duration::from_secs(10);

/// What an online resize did and how long clients waited.
#[derive(Clone, Copy, Debug)]
pub struct OnlineResized {
    pub old_bytes: u64,
    pub new_bytes: u64,
    /// Waiting for the calls in the engine to finish (the lock taken).
    pub waited: Duration,
    /// The lock held: the longest a client's call (a flush) waited, on
    /// top of `waited`.
    pub held: Duration,
}

/// The steps of an online resize its caller supplies: the files resized
/// (the volume closed cleanly: `resize::resize`), and the storage opened
/// again for the geometry the superblock says after it (sharing the old
/// storage's lock: `Storage::reopen`).
pub struct ResizeSteps<'a> {
    pub files: &'a mut dyn FnMut(u64) -> Result<()>,
    pub reopen: &'a mut Reopen<'a>,
}

/// The storage of the volume opened again for a geometry.
pub type Reopen<'a> =
    dyn FnMut(&dyn Storage, &vouch_format::Geometry) -> Result<Arc<dyn Storage>> + 'a;

impl Volume {
    /// Resize this open, writable volume to `new_bytes` (see the module).
    /// A shrink is refused when its tail holds anything (judged under the
    /// lock, after everything buffered was committed: no write can land
    /// there between). Connections keep the size they negotiated; the
    /// engine refuses what lies past its size (EINVAL to NBD).
    pub fn resize_online(&self, new_bytes: u64, steps: ResizeSteps<'_>) -> Result<OnlineResized> {
        self.resize_online_as(new_bytes, steps, false)
    }

    /// `resize_online`; `member`: a member of a volume with regions
    /// (`RegionVolume::resize_online`, which judged a shrink's tail over
    /// its region layer, and whose `files` step resizes both members).
    pub(crate) fn resize_online_as(
        &self,
        new_bytes: u64,
        steps: ResizeSteps<'_>,
        member: bool,
    ) -> Result<OnlineResized> {
        crate::superblock::check_volume_size(new_bytes)?;
        {
            let engine = self.current();
            engine.shared().io().check_writable()?;
            if member {
                crate::resize::refuse_kind_of("the member", &engine.superblock(), true)?;
            } else {
                refuse_online(&engine.superblock())?;
            }
        }
        // Most of the close's work first, while clients go on (as an
        // online snapshot does): the close then has only what came since
        // to commit and move home.
        self.checkpoint_now()?;
        let asked = Instant::now();
        let mut current = self.engine.write();
        let waited = asked.elapsed();
        let locked = Instant::now();
        let engine = Arc::clone(&current);
        let old_bytes = engine.shared().io().geometry.size_bytes;
        // The committer thread holds the engine too.
        self.stop_committer(&engine);
        let restart = |engine: &Arc<Engine>| {
            *self.committer.lock() = start_committer(engine, &self.options);
        };
        let mine = if Arc::ptr_eq(&engine, &self.first) {
            3
        } else {
            2
        };
        while Arc::strong_count(&engine) > mine {
            if locked.elapsed() > LET_GO {
                restart(&engine);
                return Err(Error::InvalidArgument(
                    "the volume is busy (a copy or verify job runs on it): try the resize again when it ends".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let resized = |held: Duration| OnlineResized {
            old_bytes,
            new_bytes,
            waited,
            held,
        };
        if new_bytes == old_bytes {
            restart(&engine);
            return Ok(resized(locked.elapsed()));
        }
        let size = |bytes: u64| self.size.store(bytes, Ordering::Release);
        if new_bytes < old_bytes {
            let tail = if member {
                Ok(())
            } else {
                refuse_written_tail(&engine, new_bytes, old_bytes)
            };
            if let Err(error) = tail {
                restart(&engine);
                return Err(error);
            }
            // New connections from here on get the smaller size.
            size(new_bytes);
        }
        if let Err(error) = engine.shutdown() {
            // The engine stopped itself (fail-stop) or keeps what it had.
            size(old_bytes);
            restart(&engine);
            return Err(error);
        }
        let outcome = (steps.files)(new_bytes);
        let storage = engine.shared().io().storage_arc();
        let reopened = crate::superblock::read_superblock(&*storage)
            .and_then(|superblock| {
                superblock
                    .geometry()
                    .map_err(|error| Error::Corrupt(format!("corrupt superblock: {error}")))
            })
            .and_then(|geometry| (steps.reopen)(&*storage, &geometry))
            .and_then(|storage| {
                Engine::open_counting(
                    storage,
                    &self.options,
                    Some(Arc::clone(&engine.shared().io().stats)),
                )
            });
        match reopened {
            Ok(new) => {
                let new = Arc::new(new);
                restart(&new);
                size(new.shared().io().geometry.size_bytes);
                *current = new;
            }
            Err(error) => {
                // Closed cleanly on disk, at the old size or the new one;
                // the old engine no longer matches its files.
                let error = engine.shared().io().fail_stop(Error::InvalidArgument(format!(
                    "the volume was closed for a resize and could not be opened again ({error}): restart the server"
                )));
                return Err(error);
            }
        }
        outcome.map(|()| resized(locked.elapsed()))
    }
}

/// A served volume this resize does not take (the offline resize refuses
/// the same, and more, with its files).
fn refuse_online(superblock: &Superblock) -> Result<()> {
    if superblock.features.incompat & FeatureFlags::INCOMPAT_REGIONS != 0 {
        // A member of a REGIONS volume: `RegionVolume` serves it.
        return Err(Error::InvalidArgument(
            "a member of a volume with regions is resized through its region layer (`RegionVolume::resize_online`), not alone".into(),
        ));
    }
    crate::resize::refuse_kind("the volume", superblock)
}

/// Refuse a shrink over anything written in `[new_bytes, old_bytes)`,
/// naming its first LBA. Everything buffered is committed first.
fn refuse_written_tail(engine: &Engine, new_bytes: u64, old_bytes: u64) -> Result<()> {
    {
        let mut journal = engine.committer().lock();
        engine
            .committer()
            .commit(engine.shared(), &mut journal, &[])?;
    }
    let shared = engine.shared();
    let found = crate::resize::first_written_by(
        &|lba| shared.next_possible_data(lba),
        &|lba, count| shared.block_status(lba * crate::BLOCK, count * crate::BLOCK, count),
        new_bytes / crate::BLOCK,
        old_bytes / crate::BLOCK,
    )?;
    match found {
        Some(lba) => Err(Error::InvalidArgument(format!(
            "cannot shrink to {new_bytes} bytes: LBA {lba} (byte {}) is written; a shrink cuts only a tail that holds nothing (never written, or trimmed)",
            lba * crate::BLOCK
        ))),
        None => Ok(()),
    }
}
