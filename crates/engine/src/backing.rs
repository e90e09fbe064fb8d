//! `Backing`: the storage under a volume with what every path needs to use
//! it — the geometry, counted I/O (stats), errors with their object and
//! offset, and the fail-stop latch (after a failed write or sync the volume
//! refuses writes until reopened; fsync is never retried).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use vouch_format::{ContextKind, Geometry, CONTEXT_BYTES};

use crate::contexts::CONTEXTS_PER_PAGE;
use crate::damage::short::ShortObject;
use crate::error::{Error, Result};
use crate::stats::Stats;
use crate::storage::{ObjectId, ReadLater, Run, Storage, Wait};
use crate::written::WrittenMap;

pub(crate) struct Backing {
    storage: Arc<dyn Storage>,
    pub geometry: Geometry,
    /// Shared with the engine a resize opens in this one's place.
    pub stats: Arc<Stats>,
    /// Which metadata units hold protection information (`written.rs`).
    pub written: WrittenMap,
    /// Split data segments shorter than the volume needs, found at open
    /// (`damage::short_objects`): the data of their LBAs past the end is
    /// gone, so a block there with a data context is lost, never zeros
    /// (`stamp_short_data`).
    pub short_data: Vec<ShortObject>,
    /// Why the volume cannot be written (read-only open, unknown ro-compat
    /// features), as the end of an error message.
    read_only: Option<String>,
    /// The first durability failure: its message, and whether it was a
    /// full disk (refusals then say so, as `StoppedFull`).
    failed: Mutex<Option<(String, bool)>>,
    has_failed: AtomicBool,
}

impl Backing {
    pub fn new(
        storage: Arc<dyn Storage>,
        geometry: Geometry,
        read_only: Option<String>,
        written: WrittenMap,
    ) -> Backing {
        Backing {
            storage,
            geometry,
            stats: Arc::default(),
            written,
            short_data: Vec::new(),
            read_only,
            failed: Mutex::new(None),
            has_failed: AtomicBool::new(false),
        }
    }

    pub fn storage(&self) -> &dyn Storage {
        &*self.storage
    }

    /// The storage, to keep it alive beside the volume (the landing
    /// area's regions outlive a request).
    pub fn storage_arc(&self) -> Arc<dyn Storage> {
        Arc::clone(&self.storage)
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only.is_some()
    }

    pub fn has_failed(&self) -> bool {
        self.has_failed.load(Ordering::Acquire)
    }

    pub fn check_writable(&self) -> Result<()> {
        if let Some(why) = &self.read_only {
            return Err(Error::ReadOnly(why.clone()));
        }
        if self.has_failed() {
            let (why, full) = self.failed.lock().clone().unwrap_or_default();
            return Err(if full {
                Error::StoppedFull(why)
            } else {
                Error::FailStopped(why)
            });
        }
        Ok(())
    }

    /// Record a durability failure: no further writes until reopened.
    pub fn fail_stop(&self, error: Error) -> Error {
        let mut failed = self.failed.lock();
        if failed.is_none() {
            *failed = Some((error.to_string(), error.is_no_space()));
            tracing::error!(%error, "volume failed stop: refusing writes until reopened");
        }
        self.has_failed.store(true, Ordering::Release);
        error
    }

    /// Split: turn the slots of `page_no` whose block has a data context
    /// (plain or encrypted) and whose data lies past the end of a short data
    /// segment (`short_data`) into lost markers. Its data is gone (the file
    /// was cut or emptied); without this, guard `none` would read the hole
    /// past the end as the block's zeros. Returns whether any changed.
    pub fn stamp_short_data(&self, page_no: u64, page: &mut [u8; 4096]) -> bool {
        let per_page = CONTEXTS_PER_PAGE;
        let lbas = page_no * per_page..(page_no + 1) * per_page;
        let mut changed = false;
        for short in &self.short_data {
            let start = short.lbas.start.max(lbas.start);
            let end = short.lbas.end.min(lbas.end);
            for lba in start..end {
                let at = (lba - lbas.start) as usize * CONTEXT_BYTES;
                let slot = &mut page[at..at + CONTEXT_BYTES];
                if slot[0] == ContextKind::Data as u8 || slot[0] == ContextKind::Encrypted as u8 {
                    slot.copy_from_slice(&self.written.lost(lba));
                    changed = true;
                }
            }
        }
        changed
    }

    // --- counted I/O ---------------------------------------------------------

    pub fn write_object(&self, object: ObjectId, offset: u64, data: &[u8]) -> Result<()> {
        self.storage
            .write_at(object, offset, data)
            .map_err(|error| Error::io("write", object, offset, error))?;
        self.stats.add_written(object, data.len() as u64);
        Ok(())
    }

    /// The concatenation of `parts` at `offset`, written without joining
    /// them (`Storage::write_vectored_at`).
    pub fn write_object_parts(&self, object: ObjectId, offset: u64, parts: &[&[u8]]) -> Result<()> {
        self.storage
            .write_vectored_at(object, offset, parts)
            .map_err(|error| Error::io("write", object, offset, error))?;
        self.stats
            .add_written(object, parts.iter().map(|part| part.len() as u64).sum());
        Ok(())
    }

    /// Several runs to one object in one batch (their order on the media
    /// does not matter to the caller); a failure names the run it hit.
    pub fn write_runs(&self, object: ObjectId, runs: &[Run<'_>]) -> Result<()> {
        self.storage
            .write_runs(object, runs)
            .map_err(|failed| Error::io("write", object, failed.offset, failed.error))?;
        self.stats
            .add_written(object, runs.iter().map(Run::len).sum());
        Ok(())
    }

    pub fn read_object(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.storage
            .read_at(object, offset, buf)
            .map_err(|error| Error::io("read", object, offset, error))?;
        self.stats.add_read(buf.len() as u64);
        Ok(())
    }

    /// A read whose failure is a fault of the blocks it covers, not an
    /// error of the call: the caller names the LBAs (and counts the bytes).
    pub fn try_read(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.storage.read_at(object, offset, buf)
    }

    /// `Storage::start_read`: a read that completes later (the caller
    /// counts its bytes when it does).
    pub fn start_read(
        &self,
        object: ObjectId,
        offset: u64,
        len: usize,
        done: ReadLater,
    ) -> std::result::Result<(), ReadLater> {
        self.storage.start_read(object, offset, len, done)
    }

    /// `Storage::read_events`.
    pub fn read_events(&self) -> Option<std::os::fd::RawFd> {
        self.storage.read_events()
    }

    /// `Storage::reap_reads`.
    pub fn reap_reads(&self) -> std::io::Result<()> {
        self.storage.reap_reads()
    }

    /// `Storage::reads_ready`.
    pub fn reads_ready(&self) -> bool {
        self.storage.reads_ready()
    }

    /// `Storage::reads_in_flight`.
    pub fn reads_in_flight(&self) -> usize {
        self.storage.reads_in_flight()
    }

    /// `try_read`, or with `Wait::NoWait` only from memory
    /// (`ErrorKind::WouldBlock` when some byte is not there).
    pub fn try_read_with(
        &self,
        object: ObjectId,
        offset: u64,
        buf: &mut [u8],
        wait: Wait,
    ) -> std::io::Result<()> {
        match wait {
            Wait::Block => self.storage.read_at(object, offset, buf),
            Wait::NoWait => self.storage.read_at_nowait(object, offset, buf),
        }
    }

    pub fn punch(&self, object: ObjectId, offset: u64, len: u64) -> Result<()> {
        self.storage
            .punch_hole(object, offset, len)
            .map_err(|error| Error::io("punch", object, offset, error))
    }

    pub fn sync_object(&self, object: ObjectId) -> Result<()> {
        self.storage
            .sync(object)
            .map_err(|error| Error::io("sync", object, 0, error))?;
        self.stats.syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// `sync_object` of each of `objects`, at once where the storage can.
    pub fn sync_objects(&self, objects: &[ObjectId]) -> Result<()> {
        self.storage
            .sync_each(objects)
            .map_err(|(object, error)| Error::io("sync", object, 0, error))?;
        self.stats
            .syncs
            .fetch_add(objects.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    pub fn seek_data(&self, object: ObjectId, offset: u64) -> Result<Option<u64>> {
        self.storage
            .next_data(object, offset)
            .map_err(|error| Error::io("seek", object, offset, error))
    }
}
