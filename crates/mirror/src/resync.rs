//! Online resync of a stale leg from its resync map (`dirty.rs`).
//!
//! A thread walks the map in windows of one stripe (1 MiB). For each
//! window it takes the mirror's stripe lock, reads the window's dirty
//! blocks that have not landed sealed from an active leg and writes them
//! sealed to the resyncing leg (which verifies each block against its
//! context before storing it; a block that fails there is fetched from
//! another active leg, or left dirty and named); the copied blocks land
//! in the map. Client writes meanwhile go to every active leg *and* the
//! resyncing one; a sealed write that every target took lands its blocks
//! too (`Mirror::write`). After a batch of windows the resyncing leg is
//! flushed and what landed before that flush began is cleared
//! (`DirtyMap::clear_landed`; a block written again meanwhile stays
//! dirty), then the map is synced: a restart resumes from what is left.
//! So a block is copied once, or not at all if a client rewrites it first
//! (again only if a trim or zeroing, which each leg applies itself,
//! touches it after its copy), and a resync ends while clients keep
//! writing: when nothing is left to copy,
//! it holds every stripe for one last flush of the leg (no write in
//! flight), and if the map is then empty records the leg active in
//! memory before any other write starts; then in the records, and the
//! map is removed.
//!
//! The thread is a job (`jobs::Visit`): its positions are the blocks
//! copied, its end those plus the blocks the map still marks (a set that
//! grows when writes mark blocks again), its progress and paced waits in a
//! `JobControl`. The rate has a floor and a ceiling (DRBD's
//! c-min-rate/c-max-rate, md's speed_limit_min/max): the ceiling while no
//! client request arrived during the last batch, the floor while they do
//! (the jobs' `Pacer`, `Pace::FloorCeiling`).
//!
//! `begin_resync`, `resync_step` and `end_resync` are the thread's parts;
//! the crash simulator calls them itself to put client writes between
//! batches in a replayable order.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::device::Mirror;
use crate::dirty::DirtyMap;
use crate::legs::{is_request_error, Legs};
pub use crate::progress::{ResyncProgress, ResyncRate};
use crate::stripes::Stripes;
use crate::threads::Threads;
use vouch_engine::device::{SealedDevice, SealedWrites};
use vouch_engine::error::{Error, Result};
use vouch_engine::jobs::{JobControl, ScanEnd, Throughput, Visit};

/// Blocks per window (one stripe of the mirror's lock).
const WINDOW_BLOCKS: u64 = crate::stripes::STRIPE_BLOCKS;
/// Windows per batch (one flush of the resyncing leg and one map sync).
const BATCH_WINDOWS: usize = 4;

struct Run {
    started: Instant,
    total: u64,
    full: bool,
}

/// A resync between two batches (`Mirror::begin_resync`).
pub struct ResyncCursor {
    leg: usize,
    map: Arc<DirtyMap>,
    run: Run,
    /// Where the next batch looks first.
    lba: u64,
    /// Blocks no active leg holds good: left dirty.
    unrepairable: BTreeSet<u64>,
    copied: u64,
    /// Blocks per window, windows per batch.
    window: u64,
    windows: usize,
    /// Its progress as a job (blocks copied of copied plus left), paced
    /// waits and cancel.
    control: Arc<JobControl>,
}

impl ResyncCursor {
    /// Blocks copied so far.
    pub fn copied(&self) -> u64 {
        self.copied
    }

    /// Copy in windows of `window` blocks (dividing the 256 of a stripe,
    /// so a window is under one stripe lock), `windows` per batch: the
    /// simulator's small volumes take several batches this way.
    pub fn set_batch(&mut self, window: u64, windows: usize) {
        assert!(
            window > 0 && WINDOW_BLOCKS.is_multiple_of(window) && windows > 0,
            "a window divides a stripe"
        );
        (self.window, self.windows) = (window, windows);
    }
}

/// What one batch (`Mirror::resync_step`) did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResyncStep {
    /// Copied this many blocks (0: none to copy, but the map was not
    /// empty yet: a write failed or is still landing).
    Copied(u64),
    /// The map is empty and the leg active in memory; `end_resync`
    /// records it.
    Finished,
}

/// A resync as the mirror runs it: the parts it needs, borrowed from the
/// mirror (its legs, the stripe lock, its job threads and the count of
/// client requests it paces by), never the `Mirror` itself.
pub(crate) struct Resync<'m> {
    legs: &'m Legs,
    stripes: &'m Stripes,
    threads: &'m Threads,
    foreground: &'m AtomicU64,
}

/// A stale leg's way back, as the mirror's public face: each call is the
/// `Resync`'s (or the legs') below.
impl Mirror {
    fn resync(&self) -> Resync<'_> {
        Resync {
            legs: &self.legs,
            stripes: &self.stripes,
            threads: &self.threads,
            foreground: &self.foreground,
        }
    }

    /// Give missing leg `leg` its device (it came back). Fails if the leg
    /// is present already or its size differs.
    pub fn attach(&self, leg: usize, device: Arc<dyn SealedDevice>) -> Result<()> {
        self.resync().attach(leg, device)
    }

    /// Reach stale leg `leg` again before its resync (a remote leg whose
    /// connection died when it was taken out).
    pub fn reconnect(&self, leg: usize) -> Result<()> {
        self.resync().reconnect(leg)
    }

    /// Track writes for stale leg `leg` in `map` from now on.
    pub fn track(&self, leg: usize, map: Arc<DirtyMap>) -> Result<()> {
        self.resync().track(leg, map)
    }

    /// The resync map of `leg`, if it has one.
    pub fn map_of(&self, leg: usize) -> Option<Arc<DirtyMap>> {
        self.legs.map_of(leg)
    }

    /// Start resyncing stale leg `leg` (present, with a map) on a thread.
    /// `full` says the map was started full (unknown history).
    pub fn start_resync(self: &Arc<Self>, leg: usize, rate: ResyncRate, full: bool) -> Result<()> {
        if rate.min == 0 || rate.max < rate.min {
            return Err(Error::InvalidArgument(format!(
                "resync rate floor {} and ceiling {} (bytes/s): the floor must be positive and at most the ceiling",
                rate.min, rate.max
            )));
        }
        let cursor = self.begin_resync(leg, full)?;
        // The thread holds the mirror only to keep its parts alive; the
        // resync runs on them.
        let mirror = Arc::clone(self);
        let spawned = self.threads.spawn(format!("vouch-resync-{leg}"), move || {
            mirror.resync().run(cursor, rate)
        });
        spawned.map_err(|error| {
            self.legs[leg].resyncing.store(false, Ordering::Release);
            Error::InvalidArgument(format!("cannot start a resync: {error}"))
        })
    }

    /// Make stale leg `leg` (present, with a map) a write target and
    /// return the cursor of its resync, to be run by `resync_step` until
    /// it finishes or fails, then `end_resync`.
    pub fn begin_resync(&self, leg: usize, full: bool) -> Result<ResyncCursor> {
        self.resync().begin(leg, full)
    }

    /// Stop every resync (each keeps its map: a restart resumes) and
    /// make every map durable with no region marked (a clean close).
    pub fn stop_resyncs(&self) -> Result<()> {
        self.threads.stop_all();
        self.legs.retire_maps()
    }

    /// The end of a resync: `result` is `Ok(true)` when its last step
    /// finished, `Ok(false)` when it was stopped. A finished resync is
    /// recorded (the leg active in the records, then its map removed).
    /// Returns its final progress.
    pub fn end_resync(&self, cursor: ResyncCursor, result: Result<bool>) -> ResyncProgress {
        self.resync().end(cursor, result)
    }

    /// One batch: copy the blocks left to copy in up to `BATCH_WINDOWS`
    /// windows (or as `set_batch` says), from where the last batch
    /// stopped, wrapping once; then flush the leg and clear what landed
    /// (`flush_landed`). With nothing left to copy, try to finish
    /// (`finish_quiesced`).
    pub fn resync_step(&self, cursor: &mut ResyncCursor) -> Result<ResyncStep> {
        self.resync().step(cursor)
    }
}

impl Resync<'_> {
    fn attach(&self, leg: usize, device: Arc<dyn SealedDevice>) -> Result<()> {
        let slot = self.legs.slot(leg)?;
        if device.size() != self.legs.size() {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {leg} is {} bytes, not {} like the others",
                device.size(),
                self.legs.size()
            )));
        }
        slot.device
            .set(device)
            .map_err(|_| Error::InvalidArgument(format!("mirror leg {leg} is present already")))?;
        slot.reset_corrected();
        Ok(())
    }

    fn reconnect(&self, leg: usize) -> Result<()> {
        let slot = self.legs.slot(leg)?;
        if self.legs.active().contains(&leg) || slot.resyncing.load(Ordering::Acquire) {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {leg} ({}) is in use: not reconnecting it",
                slot.name
            )));
        }
        match slot.device.get() {
            Some(device) => device.reconnect(),
            None => Err(Error::InvalidArgument(format!(
                "mirror leg {leg} ({}) is missing",
                slot.name
            ))),
        }
    }

    fn track(&self, leg: usize, map: Arc<DirtyMap>) -> Result<()> {
        let slot = self.legs.slot(leg)?;
        if self.legs.active().contains(&leg) {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {leg} is active: it needs no resync map"
            )));
        }
        *slot.map.write() = Some(map);
        Ok(())
    }

    fn begin(&self, leg: usize, full: bool) -> Result<ResyncCursor> {
        let slot = self.legs.slot(leg)?;
        if self.legs.active().contains(&leg) {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {leg} ({}) is active: nothing to resync",
                slot.name
            )));
        }
        if slot.device.get().is_none() {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {leg} ({}) is missing: bring it back first",
                slot.name
            )));
        }
        let Some(map) = self.legs.map_of(leg) else {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {leg} ({}) has no resync map",
                slot.name
            )));
        };
        if slot.resyncing.swap(true, Ordering::AcqRel) {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {leg} ({}) is resyncing already",
                slot.name
            )));
        }
        let run = Run {
            started: Instant::now(),
            total: map.count(),
            full,
        };
        let cursor = ResyncCursor {
            leg,
            map,
            run,
            lba: 0,
            unrepairable: BTreeSet::new(),
            copied: 0,
            window: WINDOW_BLOCKS,
            windows: BATCH_WINDOWS,
            control: Arc::new(JobControl::default()),
        };
        *slot.progress.lock() = Some(progress(&cursor, "running", None));
        tracing::info!(leg, name = %slot.name, blocks = cursor.run.total, full,
            "mirror: resync started");
        Ok(cursor)
    }

    fn run(&self, mut cursor: ResyncCursor, rate: ResyncRate) {
        let result = self.run_loop(&mut cursor, rate);
        self.end(cursor, result);
    }

    fn end(&self, cursor: ResyncCursor, result: Result<bool>) -> ResyncProgress {
        let slot = &self.legs[cursor.leg];
        let (state, error) = match result {
            Err(error) => ("failed", Some(error.to_string())),
            Ok(true) => match self.finish(cursor.leg, &cursor.map) {
                Ok(()) => ("done", None),
                Err(error) => ("failed", Some(error.to_string())),
            },
            Ok(false) if self.threads.stopping() => (
                "stopped",
                Some(format!(
                    "server stopping; {} blocks left for the next start",
                    cursor.map.count()
                )),
            ),
            Ok(false) => (
                "stopped",
                Some("the leg failed a write; it stays stale".to_string()),
            ),
        };
        slot.resyncing.store(false, Ordering::Release);
        let mut progress = progress(&cursor, state, error.clone());
        if state == "done" && cursor.run.full {
            // Every block it holds was just copied and verified: what it
            // got wrong before is gone.
            slot.reset_corrected();
        }
        if state == "done" {
            // The map was empty when the leg became active; writes since
            // (to a member) still marked it until `finish` removed it, so
            // a crash in between resyncs them, but none is left to copy.
            progress.left = 0;
            progress.eta_seconds = Some(0);
        }
        tracing::info!(leg = cursor.leg, name = %slot.name, state, copied = cursor.copied,
            left = progress.left, error = error.as_deref().unwrap_or(""), "mirror: resync ended");
        *slot.progress.lock() = Some(progress.clone());
        progress
    }

    /// Run steps until the resync finishes (`Ok(true)`) or is stopped
    /// (`Ok(false)`: the server stops, the leg failed a write, or its job
    /// was cancelled), pacing them: a `Visit` over the blocks copied.
    fn run_loop(&self, cursor: &mut ResyncCursor, rate: ResyncRate) -> Result<bool> {
        let slot = &self.legs[cursor.leg];
        let foreground = || self.foreground.load(Ordering::Relaxed);
        let stop = || self.threads.stopping() || !slot.resyncing.load(Ordering::Acquire);
        let control = Arc::clone(&cursor.control);
        let end = Visit::begin(
            &control,
            0..cursor.copied + cursor.map.count(),
            rate.pace(),
            Some(&foreground),
            None,
        )?
        .stop_when(&stop)
        .run(|run| match self.step(cursor)? {
            ResyncStep::Finished => {
                run.set_end(cursor.copied);
                Ok(false)
            }
            ResyncStep::Copied(moved) => {
                run.set_end(cursor.copied + cursor.map.count());
                run.advance(cursor.copied, moved);
                *slot.progress.lock() = Some(progress(cursor, "running", None));
                run.pace(moved * vouch_engine::BLOCK)?;
                Ok(true)
            }
        })?;
        Ok(end == ScanEnd::Finished)
    }

    fn step(&self, cursor: &mut ResyncCursor) -> Result<ResyncStep> {
        let map = Arc::clone(&cursor.map);
        let mut moved = 0u64;
        let mut windows = 0;
        let mut wrapped = false;
        let width = cursor.window;
        while windows < cursor.windows {
            let Some(next) = map.next_to_copy(cursor.lba) else {
                if cursor.lba == 0 || wrapped {
                    break;
                }
                (cursor.lba, wrapped) = (0, true);
                continue;
            };
            let window = next - next % width;
            cursor.lba = window + width;
            let _locked = self.stripes.lock(window, window + width);
            let lbas: Vec<u64> = map
                .to_copy_in(window, window + width)
                .into_iter()
                .filter(|lba| !cursor.unrepairable.contains(lba))
                .collect();
            if lbas.is_empty() {
                continue;
            }
            let (done, left) = self.copy_blocks(cursor.leg, &lbas)?;
            // Still under the stripe lock: no write slipped in since the copy.
            map.landed(done.iter().copied());
            cursor.unrepairable.extend(left);
            moved += done.len() as u64;
            windows += 1;
        }
        if map.has_landed() {
            self.flush_landed(cursor.leg, &map)?;
        }
        cursor.copied += moved;
        if moved > 0 {
            return Ok(ResyncStep::Copied(moved));
        }
        cursor.unrepairable.retain(|&lba| map.is_dirty(lba));
        if !cursor.unrepairable.is_empty() && map.count() == cursor.unrepairable.len() as u64 {
            return Err(Error::InvalidArgument(format!(
                "{} blocks fail verification on every active leg (first LBA {}): left dirty, the leg stays stale",
                cursor.unrepairable.len(),
                cursor.unrepairable.first().copied().unwrap_or_default()
            )));
        }
        self.finish_quiesced(cursor)
    }

    /// Flush `leg` and clear the blocks that landed on it before the flush
    /// began, then sync the map with no region marked. Crash ordering: the
    /// leg's flush returns before any bit is cleared, and cleared bits
    /// reach the disk only with the sync after it.
    fn flush_landed(&self, leg: usize, map: &DirtyMap) -> Result<()> {
        let ticket = map.begin_flush();
        self.legs.device(leg).flush()?;
        map.clear_landed(ticket);
        map.sync_and_retire()
    }

    /// Nothing is left to copy, but blocks may still be landing (writes in
    /// flight): hold every stripe (no write in flight, none starts), flush
    /// the leg and clear what landed; if the map is then empty, make the
    /// leg active in memory before any write starts again, so every later
    /// write treats it as a member (a failure faults it). Otherwise (a
    /// write failed, or one marked a block after the batch looked), go on.
    fn finish_quiesced(&self, cursor: &ResyncCursor) -> Result<ResyncStep> {
        let _all = self.stripes.lock_all();
        if !self.legs[cursor.leg].resyncing.load(Ordering::Acquire) {
            return Ok(ResyncStep::Copied(0));
        }
        if cursor.map.has_landed() {
            self.flush_landed(cursor.leg, &cursor.map)?;
        }
        if cursor.map.count() > 0 {
            return Ok(ResyncStep::Copied(0));
        }
        self.legs.set_active(cursor.leg);
        Ok(ResyncStep::Finished)
    }

    /// Copy `lbas` (one window, stripe locked) from an active leg to `leg`.
    /// Returns the blocks copied and those no active leg holds good.
    fn copy_blocks(&self, leg: usize, lbas: &[u64]) -> Result<(Vec<u64>, Vec<u64>)> {
        let target = self.legs.device(leg);
        let sources = self.legs.active();
        let Some(&first_source) = sources.first() else {
            return Err(Error::FailStopped("no active mirror leg".into()));
        };
        let sealed = self.legs.read_runs(first_source, lbas);
        if let Ok(blocks) = &sealed {
            match target.write_sealed(blocks) {
                Ok(()) => return Ok((lbas.to_vec(), Vec::new())),
                Err(error) if is_request_error(&error) => return Err(error),
                Err(_) => {}
            }
        }
        // Block by block, from any active leg whose copy the target verifies.
        let mut done = Vec::new();
        let mut left = Vec::new();
        for &lba in lbas {
            let moved = sources.iter().any(|&source| {
                self.legs
                    .device(source)
                    .read_sealed(lba, 1)
                    .and_then(|block| target.write_sealed(&block))
                    .is_ok()
            });
            if moved {
                done.push(lba);
            } else {
                tracing::error!(
                    lba,
                    leg,
                    "mirror: resync: no active leg holds this block good; left dirty"
                );
                left.push(lba);
            }
        }
        Ok((done, left))
    }

    /// The map is empty and the leg active in memory (`finish_quiesced`):
    /// record it active, then remove the map (a crash between leaves a
    /// map for an active leg, removed at open).
    fn finish(&self, leg: usize, map: &DirtyMap) -> Result<()> {
        let slot = &self.legs[leg];
        self.legs.record_active(leg)?;
        *slot.map.write() = None;
        map.remove()?;
        tracing::info!(leg, name = %slot.name, "mirror: resync done: leg active");
        Ok(())
    }
}

/// A resync's progress now, in `state` (with `error`), for its status.
fn progress(cursor: &ResyncCursor, state: &'static str, error: Option<String>) -> ResyncProgress {
    let left = cursor.map.count();
    let throughput = Throughput::measure(cursor.run.started, cursor.copied, left);
    ResyncProgress {
        total: cursor.run.total,
        copied: cursor.copied,
        left,
        full: cursor.run.full,
        rate: throughput.rate,
        eta_seconds: throughput.eta_seconds,
        state,
        error,
        elapsed_ms: throughput.elapsed_ms,
        paced_waits: cursor.control.paced_waits(),
    }
}
