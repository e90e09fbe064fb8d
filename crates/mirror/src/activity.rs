//! The activity log (docs/FORMAT.md "Activity log", docs/CRASH_MODEL.md
//! "Crash reconciliation"): which extents of a mirror may be written now,
//! kept durably in every active local leg's directory (`mirror.active`,
//! through a `MapStore`: real files, or the crash simulator's), so an
//! unclean stop reconciles only those extents (DRBD's activity log, md's
//! write-intent bitmap), not the whole volume.
//!
//! Crash ordering. ORDER POINT: before a write, trim or zeroing reaches
//! any leg, every extent it touches is in the log *on disk* (written and
//! synced in every file). A write to an extent already logged pays an
//! atomic add, an atomic load and (once per extent until the next
//! eviction scan) an atomic or: a hot extent costs no I/O. A write to an
//! extent not logged takes the log's lock, makes room (below), writes the
//! log with the new extent and syncs it, and only then is issued. The log
//! forgets an extent only when no write to it is in flight and a flush of
//! every active leg that started after its last write returned has
//! succeeded: its blocks are then the same, durably, on every active leg.
//! So at every crash every block that may differ between the legs lies in
//! an extent the log on disk names. The log keeps up to `ACTIVE_EXTENTS`
//! extents besides those still to reconcile; when every logged extent has
//! unflushed writes the writer flushes the legs first (DRBD's al-extents
//! exhausted), and if all of them still have writes in flight it waits for
//! one to return (on a condition variable that a write signals when it
//! leaves an extent with nothing in flight and a writer waits: no polling).
//!
//! Each update writes the copy `seq % 2` of each file and syncs it, so a
//! torn update leaves the previous copy (which names a superset of the
//! extents written so far, less only extents that were flushed).
//!
//! Evicting and entering race without a lock on the fast path: a writer
//! counts itself in the extent's `in_flight` and then checks the extent's
//! `logged` bit; an evictor clears the bit and then checks `in_flight`
//! (all sequentially consistent), so either the writer sees the bit clear
//! and takes the lock, or the evictor sees the writer and keeps the
//! extent.

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use vouch_format::activity::{ActivityLog as Copy, ACTIVITY_COPY_BYTES, ACTIVITY_MAX_EXTENTS};

use crate::map_file::{MapFile, MapStore};
use vouch_engine::error::{Error, Result};
use vouch_engine::BLOCK;

/// The log's file name in each active local leg's directory.
pub const ACTIVITY_FILE: &str = "mirror.active";
/// Blocks per extent (4 MiB of 4 KiB blocks).
pub const EXTENT_BLOCKS: u64 = 1024;
/// Extents the log keeps besides those still to reconcile (DRBD's
/// al-extents, whose default is 1,237): 1,016 x 4 MiB (just under 4 GiB)
/// to check at most after a crash, and a working set that size written at
/// random with
/// no flush of the legs forced. Random writes over more than that with no
/// client flush make the log flush the legs to make room (bench/reconcile.sh
/// measured 64 extents under random 4 KiB writes over 4 GiB: 0.07x).
pub const ACTIVE_EXTENTS: usize = 1016;
/// Extents to reconcile that a log may carry into a new run: the rest of
/// a copy is left for `ACTIVE_EXTENTS` new ones, and it is more than one
/// run logs. A log naming more (a crash during a reconciliation, with
/// writes scattered meanwhile) is treated as unknown: reads stay on one
/// leg until a whole scrub.
pub const MAX_CARRIED_EXTENTS: usize = ACTIVITY_MAX_EXTENTS - ACTIVE_EXTENTS;

/// What the log found at open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recovered {
    /// The extents the last run may have left different (empty after a
    /// clean close), to reconcile.
    Extents(Vec<u64>),
    /// No usable log (none yet, every copy torn, another volume's, or
    /// more extents than a run carries): the legs may differ anywhere.
    Unknown(String),
}

/// Sizes of a log (the crash simulator's volumes use small extents).
#[derive(Clone, Copy, Debug)]
pub struct ActivityGeometry {
    pub uuid: [u8; 16],
    pub blocks: u64,
    pub extent_blocks: u64,
    pub active_extents: usize,
}

impl ActivityGeometry {
    /// A volume's geometry with the production extent size and limit.
    pub fn of(uuid: [u8; 16], blocks: u64) -> ActivityGeometry {
        ActivityGeometry {
            uuid,
            blocks,
            extent_blocks: EXTENT_BLOCKS,
            active_extents: ACTIVE_EXTENTS,
        }
    }

    fn extents(&self) -> u64 {
        self.blocks.div_ceil(self.extent_blocks)
    }
}

/// Read the logs in `dirs` (each active local leg's directory): the union
/// of the valid ones, and the highest copy number seen.
fn read_logs(
    store: &dyn MapStore,
    dirs: &[PathBuf],
    geometry: ActivityGeometry,
) -> Result<(Recovered, u64)> {
    if dirs.is_empty() {
        return Err(Error::Unsupported(
            "no active local leg to keep the activity log in".into(),
        ));
    }
    let mut found: BTreeSet<u64> = BTreeSet::new();
    let mut valid = 0;
    let mut problems = Vec::new();
    let mut seq = 0;
    for dir in dirs {
        let path = dir.join(ACTIVITY_FILE);
        let bytes = store
            .read(&path)
            .map_err(|error| store_error("read", &path, error))?;
        let Some(bytes) = bytes else {
            problems.push(format!("{}: none", path.display()));
            continue;
        };
        match Copy::decode_file(&bytes) {
            Some(copy)
                if copy.uuid == geometry.uuid
                    && copy.blocks == geometry.blocks
                    && u64::from(copy.extent_blocks) == geometry.extent_blocks =>
            {
                valid += 1;
                seq = seq.max(copy.seq);
                found.extend(
                    copy.extents
                        .iter()
                        .copied()
                        .filter(|&e| e < geometry.extents()),
                );
            }
            Some(_) => problems.push(format!("{}: another volume's", path.display())),
            None => problems.push(format!("{}: no valid copy", path.display())),
        }
    }
    let recovered = if valid == 0 {
        Recovered::Unknown(problems.join("; "))
    } else if found.len() > MAX_CARRIED_EXTENTS {
        Recovered::Unknown(format!(
            "it names {} extents, more than {MAX_CARRIED_EXTENTS}",
            found.len()
        ))
    } else {
        Recovered::Extents(found.iter().copied().collect())
    };
    Ok((recovered, seq))
}

/// The in-memory side of the log (see the module's documentation).
pub struct ActivityLog {
    geometry: ActivityGeometry,
    /// Where the files live; it runs each update's writes and syncs.
    store: Arc<dyn MapStore>,
    /// One bit per extent: named by the log on disk.
    logged: Box<[AtomicU64]>,
    /// One bit per extent: written since the last eviction scan.
    referenced: Box<[AtomicU64]>,
    /// Writes to each extent that have not returned.
    in_flight: Box<[AtomicU32]>,
    /// Per extent: `flushes_started` when its last write returned.
    stamp: Box<[AtomicU64]>,
    /// Flushes of the mirror started (numbered from 2: the state found at
    /// open counts as flush 1, everything recovered being durable).
    flushes_started: AtomicU64,
    /// The highest number of a flush that succeeded.
    flushed: AtomicU64,
    /// Updates written (each one sync per file).
    updates: AtomicU64,
    inner: Mutex<Inner>,
    /// Writers waiting for an extent's writes to return (`Blocked::Busy`).
    waiters: AtomicUsize,
    /// Extents left with nothing in flight while a writer waited.
    idled: Mutex<u64>,
    idle: Condvar,
}

struct Inner {
    /// The extents the log on disk names, oldest first.
    entries: Vec<u64>,
    /// Of those, the ones still to reconcile (never evicted).
    pinned: BTreeSet<u64>,
    seq: u64,
    files: Vec<(PathBuf, Box<dyn MapFile>)>,
}

/// A write's place in the log: its extents cannot be forgotten until it
/// is dropped (when the write returned, done or not).
pub struct Entered {
    log: Arc<ActivityLog>,
    extents: Range<u64>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        let now = self.log.flushes_started.load(SeqCst);
        let mut left_idle = false;
        for extent in self.extents.clone() {
            self.log.stamp[extent as usize].fetch_max(now, SeqCst);
            left_idle |= self.log.in_flight[extent as usize].fetch_sub(1, SeqCst) == 1;
        }
        // A writer that found every extent busy may evict this one now.
        // (Sequentially consistent: a waiter counts itself in `waiters`
        // before it checks the extents again, so either it sees this
        // extent idle or this sees it waiting.)
        if left_idle && self.log.waiters.load(SeqCst) > 0 {
            *self.log.idled.lock() += 1;
            self.log.idle.notify_all();
        }
    }
}

/// Why a writer could not enter the log now.
#[derive(Debug, PartialEq, Eq)]
pub enum Blocked {
    /// Every extent that could leave has unflushed writes: flush the legs.
    NeedsFlush,
    /// Every extent that could leave has writes in flight: wait for one.
    Busy,
}

fn bit(words: &[AtomicU64], extent: u64) -> bool {
    words[(extent / 64) as usize].load(SeqCst) & (1 << (extent % 64)) != 0
}

fn set_bit(words: &[AtomicU64], extent: u64) {
    words[(extent / 64) as usize].fetch_or(1 << (extent % 64), SeqCst);
}

fn clear_bit(words: &[AtomicU64], extent: u64) {
    words[(extent / 64) as usize].fetch_and(!(1 << (extent % 64)), SeqCst);
}

fn store_error(action: &'static str, path: &Path, error: std::io::Error) -> Error {
    Error::Path {
        action,
        path: path.to_path_buf(),
        cause: error.to_string(),
    }
}

impl ActivityLog {
    /// `[offset, end)` (bytes) cut at multiples of half the log's active
    /// extents (at least one piece, maybe empty), so a large trim or
    /// zeroing enters the log a piece at a time.
    pub(crate) fn pieces(&self, offset: u64, end: u64) -> Vec<Range<u64>> {
        let piece = (self.geometry.active_extents as u64 / 2).max(1) * self.extent_blocks() * BLOCK;
        let mut pieces = Vec::new();
        let mut at = offset;
        loop {
            let next = ((at / piece) + 1) * piece;
            pieces.push(at..next.min(end));
            if next >= end {
                return pieces;
            }
            at = next;
        }
    }

    /// Read the logs in `dirs` (each active local leg's directory) and
    /// start a new one there naming what they named (to reconcile). The
    /// union of every valid log is taken: each update went to every file,
    /// so any of them names every extent that may differ. A log that is
    /// unknown starts empty; its caller falls back to a whole scrub.
    pub fn open(
        store: Arc<dyn MapStore>,
        dirs: &[PathBuf],
        geometry: ActivityGeometry,
    ) -> Result<(ActivityLog, Recovered)> {
        let (recovered, seq) = read_logs(&*store, dirs, geometry)?;
        let carried: Vec<u64> = match &recovered {
            Recovered::Extents(extents) => extents.clone(),
            Recovered::Unknown(_) => Vec::new(),
        };
        let log = ActivityLog::empty(geometry, Arc::clone(&store));
        let first = Copy {
            uuid: geometry.uuid,
            seq: seq + 1,
            blocks: geometry.blocks,
            extent_blocks: geometry.extent_blocks as u32,
            extents: carried.clone(),
        };
        let encoded = first
            .encode()
            .map_err(|error| Error::InvalidArgument(format!("activity log: {error}")))?;
        let mut image = vec![0u8; 2 * ACTIVITY_COPY_BYTES];
        let at = Copy::copy_offset(first.seq) as usize;
        image[at..at + ACTIVITY_COPY_BYTES].copy_from_slice(&encoded);
        let mut files = Vec::with_capacity(dirs.len());
        for dir in dirs {
            let path = dir.join(ACTIVITY_FILE);
            // Atomic and durable: the old log or this one at every instant.
            let file = store
                .create(&path, &image)
                .map_err(|error| store_error("create", &path, error))?;
            files.push((path, file));
        }
        {
            let mut inner = log.inner.lock();
            inner.files = files;
            inner.seq = first.seq;
            for &extent in &carried {
                set_bit(&log.logged, extent);
                inner.entries.push(extent);
                inner.pinned.insert(extent);
            }
        }
        Ok((log, recovered))
    }

    /// What `open` would find in `dirs`, without writing anything (for an
    /// offline `vouch mirror status` of a set no process holds).
    pub fn peek(
        store: &dyn MapStore,
        dirs: &[PathBuf],
        geometry: ActivityGeometry,
    ) -> Result<Recovered> {
        Ok(read_logs(store, dirs, geometry)?.0)
    }

    fn empty(geometry: ActivityGeometry, store: Arc<dyn MapStore>) -> ActivityLog {
        let extents = geometry.extents() as usize;
        let words = extents.div_ceil(64);
        ActivityLog {
            geometry,
            store,
            logged: (0..words).map(|_| AtomicU64::new(0)).collect(),
            referenced: (0..words).map(|_| AtomicU64::new(0)).collect(),
            in_flight: (0..extents).map(|_| AtomicU32::new(0)).collect(),
            stamp: (0..extents).map(|_| AtomicU64::new(0)).collect(),
            flushes_started: AtomicU64::new(1),
            flushed: AtomicU64::new(1),
            updates: AtomicU64::new(0),
            inner: Mutex::new(Inner {
                entries: Vec::new(),
                pinned: BTreeSet::new(),
                seq: 0,
                files: Vec::new(),
            }),
            waiters: AtomicUsize::new(0),
            idled: Mutex::new(0),
            idle: Condvar::new(),
        }
    }

    /// The extents of blocks `[first, end)`.
    fn extents_of(&self, first: u64, end: u64) -> Range<u64> {
        let size = self.geometry.extent_blocks;
        let end = end.min(self.geometry.blocks).max(first + 1);
        first / size..end.div_ceil(size).min(self.geometry.extents())
    }

    /// Blocks per extent.
    pub fn extent_blocks(&self) -> u64 {
        self.geometry.extent_blocks
    }

    /// Enter blocks `[first, end)` if each of their extents is logged
    /// already (no I/O, no lock); `None` otherwise, with nothing held.
    pub fn try_enter(self: &Arc<Self>, first: u64, end: u64) -> Option<Entered> {
        let extents = self.extents_of(first, end);
        for extent in extents.clone() {
            self.in_flight[extent as usize].fetch_add(1, SeqCst);
            if !bit(&self.logged, extent) {
                for entered in extents.start..=extent {
                    self.in_flight[entered as usize].fetch_sub(1, SeqCst);
                }
                return None;
            }
            if !bit(&self.referenced, extent) {
                set_bit(&self.referenced, extent);
            }
        }
        Some(Entered {
            log: Arc::clone(self),
            extents,
        })
    }

    /// Enter blocks `[first, end)`: each extent not logged yet is added
    /// and the log written and synced before this returns (the ORDER
    /// POINT). `Err(Blocked)` when no room can be made now (nothing held).
    pub fn enter(
        self: &Arc<Self>,
        first: u64,
        end: u64,
    ) -> Result<std::result::Result<Entered, Blocked>> {
        if let Some(entered) = self.try_enter(first, end) {
            return Ok(Ok(entered));
        }
        let extents = self.extents_of(first, end);
        let mut inner = self.inner.lock();
        let missing: Vec<u64> = extents
            .clone()
            .filter(|&extent| !bit(&self.logged, extent))
            .collect();
        if !missing.is_empty() {
            // A write wider than the log's share still fits: the others
            // leave for it (an NBD request of 32 MiB spans 9 extents of
            // the 64; only a caller's own larger write can need this).
            let own = (extents.end - extents.start) as usize;
            let limit = (inner.pinned.len() + self.geometry.active_extents.max(own))
                .min(ACTIVITY_MAX_EXTENTS);
            if own > limit {
                return Err(Error::InvalidArgument(format!(
                    "a mirrored write of {own} extents is more than the activity log holds"
                )));
            }
            let over = (inner.entries.len() + missing.len()).saturating_sub(limit);
            let evicted = self.evict(&mut inner, over, &extents);
            if evicted.len() < over {
                // Put back what was taken out: the log on disk still names it.
                for &extent in &evicted {
                    set_bit(&self.logged, extent);
                    inner.entries.insert(0, extent);
                }
                return Ok(Err(self.why_blocked(&inner)));
            }
            let mut missing = missing;
            missing.extend(self.ahead(&inner, &missing, limit));
            inner.entries.extend(missing.iter().copied());
            if let Err(error) = self.persist(&mut inner) {
                // Not durable: the new extents are not logged, and the
                // evicted ones stay out (they were clean).
                inner.entries.retain(|extent| !missing.contains(extent));
                return Err(error);
            }
            for &extent in &missing {
                set_bit(&self.logged, extent);
            }
        }
        for extent in extents.clone() {
            self.in_flight[extent as usize].fetch_add(1, SeqCst);
            set_bit(&self.referenced, extent);
        }
        Ok(Ok(Entered {
            log: Arc::clone(self),
            extents,
        }))
    }

    /// Extents to add with `adding` in the same update, ahead of a
    /// sequential stream: when the extent before the first one added is in
    /// the log, the next `AHEAD` extents not logged yet, as long as the log
    /// has room for them without evicting anything (one sync then covers
    /// several extents of a sequential writer).
    fn ahead(&self, inner: &Inner, adding: &[u64], limit: usize) -> Vec<u64> {
        const AHEAD: u64 = 3;
        let (Some(&first), Some(&last)) = (adding.first(), adding.last()) else {
            return Vec::new();
        };
        if first == 0 || !bit(&self.logged, first - 1) {
            return Vec::new();
        }
        let room = limit.saturating_sub(inner.entries.len() + adding.len());
        (last + 1..(last + 1 + AHEAD).min(self.geometry.extents()))
            .filter(|&extent| !bit(&self.logged, extent) && !adding.contains(&extent))
            .take(room)
            .collect()
    }

    /// Take up to `count` extents out of the log (in memory): clean ones
    /// (no write in flight, flushed since their last write), not pinned,
    /// those not referenced since the last scan first. Returns them.
    /// `keep` (the writer's own extents) never leaves.
    fn evict(&self, inner: &mut Inner, count: usize, keep: &Range<u64>) -> Vec<u64> {
        let mut evicted = Vec::new();
        for second_chance in [false, true] {
            let mut at = 0;
            while evicted.len() < count && at < inner.entries.len() {
                let extent = inner.entries[at];
                let wanted = !inner.pinned.contains(&extent)
                    && !keep.contains(&extent)
                    && (second_chance || !bit(&self.referenced, extent));
                if wanted && self.take_if_clean(extent) {
                    inner.entries.remove(at);
                    evicted.push(extent);
                } else {
                    at += 1;
                }
            }
        }
        for &extent in &inner.entries {
            clear_bit(&self.referenced, extent);
        }
        evicted
    }

    /// Clear `extent`'s logged bit if it is clean; else leave it set.
    fn take_if_clean(&self, extent: u64) -> bool {
        clear_bit(&self.logged, extent);
        let clean = self.in_flight[extent as usize].load(SeqCst) == 0
            && self.stamp[extent as usize].load(SeqCst) < self.flushed.load(SeqCst);
        if !clean {
            set_bit(&self.logged, extent);
        }
        clean
    }

    /// `enter`, and while every extent that could leave has writes in
    /// flight (`Blocked::Busy`), wait for one of those writes to return
    /// and try again. Returns `Blocked::NeedsFlush` (nothing held) when
    /// only a flush of the legs makes room.
    pub fn enter_waiting(
        self: &Arc<Self>,
        first: u64,
        end: u64,
    ) -> Result<std::result::Result<Entered, Blocked>> {
        loop {
            match self.enter(first, end)? {
                Err(Blocked::Busy) => {}
                done => return Ok(done),
            }
            // Counted as waiting before looking again: a write returning
            // after this `enter` saw its extent busy then signals.
            self.waiters.fetch_add(1, SeqCst);
            let seen = *self.idled.lock();
            let again = self.enter(first, end);
            if !matches!(again, Ok(Err(Blocked::Busy))) {
                self.waiters.fetch_sub(1, SeqCst);
                return again;
            }
            let mut idled = self.idled.lock();
            while *idled == seen {
                self.idle.wait(&mut idled);
            }
            drop(idled);
            self.waiters.fetch_sub(1, SeqCst);
        }
    }

    fn why_blocked(&self, inner: &Inner) -> Blocked {
        let unflushed = inner.entries.iter().any(|&extent| {
            !inner.pinned.contains(&extent)
                && self.in_flight[extent as usize].load(SeqCst) == 0
                && self.stamp[extent as usize].load(SeqCst) >= self.flushed.load(SeqCst)
        });
        if unflushed {
            Blocked::NeedsFlush
        } else {
            Blocked::Busy
        }
    }

    /// Write `inner.entries` as the next copy of every file and sync
    /// each. A file that fails is dropped (its leg's own I/O will fault
    /// it) as long as one file took the update; else the error.
    fn persist(&self, inner: &mut Inner) -> Result<()> {
        let copy = Copy {
            uuid: self.geometry.uuid,
            seq: inner.seq + 1,
            blocks: self.geometry.blocks,
            extent_blocks: self.geometry.extent_blocks as u32,
            extents: inner.entries.clone(),
        };
        let bytes = copy
            .encode()
            .map_err(|error| Error::InvalidArgument(format!("activity log: {error}")))?;
        let offset = Copy::copy_offset(copy.seq);
        let bytes = &bytes[..Copy::used_bytes(copy.extents.len())];
        if inner.files.is_empty() {
            return Err(Error::FailStopped(
                "the mirror's activity log has no file left".into(),
            ));
        }
        // Every file at once (each on its own leg's disk), as the store
        // runs them: the update costs one sync's time, not one per leg.
        let files: Vec<&dyn MapFile> = inner.files.iter().map(|(_, file)| &**file).collect();
        let outcomes = self.store.write_and_sync_each(&files, offset, bytes);
        let mut first_error = None;
        let mut outcomes = outcomes.into_iter();
        inner.files.retain(|(path, _)| match outcomes.next() {
            Some(Err(error)) => {
                tracing::error!(path = %path.display(), %error,
                    "mirror: cannot write the activity log there; going on with the others");
                first_error.get_or_insert(store_error("write", path, error));
                false
            }
            _ => true,
        });
        if inner.files.is_empty() {
            return Err(first_error.unwrap_or_else(|| {
                Error::FailStopped("the mirror's activity log has no file left".into())
            }));
        }
        inner.seq = copy.seq;
        self.updates.fetch_add(1, SeqCst);
        Ok(())
    }

    /// A flush of every active leg is about to be issued: its number.
    pub fn flush_begins(&self) -> u64 {
        self.flushes_started.fetch_add(1, SeqCst) + 1
    }

    /// Flush `number` (from `flush_begins`) succeeded on every active leg.
    pub fn flush_succeeded(&self, number: u64) {
        self.flushed.fetch_max(number, SeqCst);
    }

    /// The extents still to reconcile, in order.
    pub fn pinned(&self) -> Vec<u64> {
        self.inner.lock().pinned.iter().copied().collect()
    }

    /// `extent` was reconciled: it may leave the log like any other.
    pub fn unpin(&self, extent: u64) {
        self.inner.lock().pinned.remove(&extent);
    }

    /// Extents the log names now.
    pub fn logged(&self) -> usize {
        self.inner.lock().entries.len()
    }

    /// Updates written since open (one sync per file each).
    pub fn updates(&self) -> u64 {
        self.updates.load(SeqCst)
    }

    /// A clean close, after the last flush of every leg (no write in
    /// flight, none to come): the log keeps only what is still to
    /// reconcile (nothing, normally).
    pub fn close(&self) -> Result<()> {
        let mut inner = self.inner.lock();
        let keep: Vec<u64> = inner.pinned.iter().copied().collect();
        for &extent in &inner.entries {
            clear_bit(&self.logged, extent);
        }
        inner.entries = keep;
        for &extent in &inner.entries {
            set_bit(&self.logged, extent);
        }
        self.persist(&mut inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map_file::FileMaps;

    fn geometry(active_extents: usize) -> ActivityGeometry {
        ActivityGeometry {
            uuid: [7; 16],
            blocks: 64,
            extent_blocks: 4,
            active_extents,
        }
    }

    fn open(dir: &Path, active: usize) -> (Arc<ActivityLog>, Recovered) {
        let (log, recovered) =
            ActivityLog::open(Arc::new(FileMaps), &[dir.to_path_buf()], geometry(active))
                .expect("open");
        (Arc::new(log), recovered)
    }

    #[test]
    fn a_new_extent_is_durable_before_enter_returns_and_a_hot_one_costs_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (log, recovered) = open(dir.path(), 2);
        assert!(matches!(recovered, Recovered::Unknown(_)));
        let entered = log.enter(5, 6).unwrap().unwrap();
        assert_eq!(log.updates(), 1);
        // What a crash now would find: extent 1.
        let (_, recovered) = open(dir.path(), 2);
        assert_eq!(recovered, Recovered::Extents(vec![1]));
        let (log, _) = open(dir.path(), 2);
        drop(entered);
        let hot = log.enter(4, 8).unwrap().unwrap();
        assert_eq!(log.updates(), 0, "a logged extent is entered without I/O");
        drop(hot);
    }

    #[test]
    fn an_extent_leaves_only_after_a_flush_that_started_after_its_last_write() {
        let dir = tempfile::tempdir().unwrap();
        let (log, _) = open(dir.path(), 1);
        log.unpin(0);
        drop(log.enter(0, 1).unwrap().unwrap());
        // Extent 0 was written and not flushed: extent 1 cannot push it out.
        assert_eq!(log.enter(4, 5).unwrap().err(), Some(Blocked::NeedsFlush));
        let early = log.flush_begins();
        let in_flight = log.enter(1, 2).unwrap().unwrap();
        log.flush_succeeded(early);
        drop(in_flight);
        // Its last write returned after that flush began: still dirty.
        assert_eq!(log.enter(4, 5).unwrap().err(), Some(Blocked::NeedsFlush));
        let held = log.try_enter(0, 1).expect("logged");
        let flush = log.flush_begins();
        log.flush_succeeded(flush);
        assert_eq!(log.enter(4, 5).unwrap().err(), Some(Blocked::Busy));
        drop(held);
        // It returned after flush 3 began: one more flush frees it.
        assert_eq!(log.enter(4, 5).unwrap().err(), Some(Blocked::NeedsFlush));
        let flush = log.flush_begins();
        log.flush_succeeded(flush);
        drop(log.enter(4, 5).unwrap().unwrap());
        let (_, recovered) = open(dir.path(), 1);
        assert_eq!(recovered, Recovered::Extents(vec![1]));
    }

    #[test]
    fn a_writer_blocked_by_writes_in_flight_waits_for_one_to_return() {
        let dir = tempfile::tempdir().unwrap();
        let (log, _) = open(dir.path(), 1);
        log.unpin(0);
        let flush = log.flush_begins();
        log.flush_succeeded(flush);
        // Extent 0 is logged, flushed, and has a write in flight.
        let in_flight = log.enter(0, 1).unwrap().unwrap();
        let (sender, woke) = std::sync::mpsc::channel();
        let waiter = {
            let log = Arc::clone(&log);
            std::thread::spawn(move || sender.send(log.enter_waiting(4, 5).unwrap().err()))
        };
        // The writer of extent 1 waits (bounded poll: a hang guard).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while log.waiters.load(SeqCst) == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the writer never waited"
            );
            std::thread::yield_now();
        }
        assert!(!waiter.is_finished(), "it returned with extent 0 busy");
        // The write returns: the waiter wakes and finds extent 0 idle but
        // written since the last flush.
        drop(in_flight);
        let woke = woke.recv_timeout(std::time::Duration::from_secs(30));
        assert_eq!(woke, Ok(Some(Blocked::NeedsFlush)), "the writer never woke");
        waiter.join().unwrap().unwrap();
        assert_eq!(log.waiters.load(SeqCst), 0);
    }

    #[test]
    fn close_leaves_only_what_is_still_to_reconcile() {
        let dir = tempfile::tempdir().unwrap();
        let (log, _) = open(dir.path(), 4);
        drop(log.enter(0, 12).unwrap().unwrap());
        let (log, recovered) = open(dir.path(), 4);
        assert_eq!(recovered, Recovered::Extents(vec![0, 1, 2]));
        assert_eq!(log.pinned(), vec![0, 1, 2]);
        log.unpin(1);
        log.close().unwrap();
        let (_, recovered) = open(dir.path(), 4);
        assert_eq!(recovered, Recovered::Extents(vec![0, 2]));
    }
}
