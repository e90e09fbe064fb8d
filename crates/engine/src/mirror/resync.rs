//! Online resync of a stale leg from its resync map (`dirty.rs`).
//!
//! A thread walks the map in windows of one stripe (1 MiB). For each
//! window it takes the mirror's stripe lock, notes the map's mark
//! sequence, reads the window's dirty blocks sealed from an active leg
//! and writes them sealed to the resyncing leg (which verifies each block
//! against its context before storing it; a block that fails there is
//! fetched from another active leg, or left dirty and named). Client
//! writes meanwhile go to every active leg *and* the resyncing one. After
//! a batch the resyncing leg is flushed, then the batch's bits are cleared
//! unless a client write touched their region since they were copied, and
//! the map is synced: a restart resumes from what is left. When the map is
//! empty the leg is recorded active and the map is removed.
//!
//! The rate has a floor and a ceiling (DRBD's c-min-rate/c-max-rate, md's
//! speed_limit_min/max): the ceiling while no client request arrived
//! during the last batch, the floor while they do.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vouch_format::mirror::LegState;

use super::device::{is_request_error, Mirror};
use super::dirty::DirtyMap;
use crate::device::{BlockDevice, SealedBlock};
use crate::error::{Error, Result};

/// Blocks per window (one stripe of the mirror's lock).
const WINDOW_BLOCKS: u64 = 256;
/// Windows per batch (one flush of the resyncing leg and one map sync).
const BATCH_WINDOWS: usize = 4;

/// Resync speed limits in bytes per second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResyncRate {
    /// Never slower than this (while clients are busy).
    pub min: u64,
    /// Never faster than this (while clients are idle).
    pub max: u64,
}

impl Default for ResyncRate {
    /// md's defaults: 1 MB/s floor, 200 MB/s ceiling.
    fn default() -> ResyncRate {
        ResyncRate {
            min: 1_000_000,
            max: 200_000_000,
        }
    }
}

/// A resync's progress, as `vouch mirror status` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResyncProgress {
    /// Dirty blocks when it started.
    pub total: u64,
    /// Blocks copied so far.
    pub copied: u64,
    /// Dirty blocks left (the map's count).
    pub left: u64,
    /// Whether the map started full (unknown history).
    pub full: bool,
    /// Bytes per second over the resync so far.
    pub rate: u64,
    /// Seconds to go at that rate (`None` before a rate is known).
    pub eta_seconds: Option<u64>,
    /// `running`, `done`, `stopped` or `failed`.
    pub state: &'static str,
    /// Why it failed or stopped, or which blocks are left.
    pub error: Option<String>,
    pub elapsed_ms: u64,
}

struct Run {
    started: Instant,
    total: u64,
    full: bool,
}

impl Mirror {
    /// Give missing leg `leg` its device (it came back). Fails if the leg
    /// is present already or its size differs.
    pub fn attach(&self, leg: usize, device: Arc<dyn BlockDevice>) -> Result<()> {
        let slot = self.leg_slot(leg)?;
        if device.size() != self.size() {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {leg} is {} bytes, not {} like the others",
                device.size(),
                self.size()
            )));
        }
        slot.device
            .set(device)
            .map_err(|_| Error::InvalidArgument(format!("mirror leg {leg} is present already")))
    }

    fn leg_slot(&self, leg: usize) -> Result<&super::device::Leg> {
        self.legs.get(leg).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the mirror has no leg {leg} (legs 0..{})",
                self.legs.len()
            ))
        })
    }

    /// Reach stale leg `leg` again before its resync (a remote leg whose
    /// connection died when it was taken out).
    pub fn reconnect(&self, leg: usize) -> Result<()> {
        let slot = self.leg_slot(leg)?;
        if self.active().contains(&leg) || slot.resyncing.load(Ordering::Acquire) {
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

    /// Track writes for stale leg `leg` in `map` from now on.
    pub fn track(&self, leg: usize, map: Arc<DirtyMap>) -> Result<()> {
        let slot = self.leg_slot(leg)?;
        if self.active().contains(&leg) {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {leg} is active: it needs no resync map"
            )));
        }
        *slot.map.write() = Some(map);
        Ok(())
    }

    /// The resync map of `leg`, if it has one.
    pub fn map_of(&self, leg: usize) -> Option<Arc<DirtyMap>> {
        self.legs.get(leg).and_then(|slot| slot.map.read().clone())
    }

    /// Start resyncing stale leg `leg` (present, with a map) on a thread.
    /// `full` says the map was started full (unknown history).
    pub fn start_resync(self: &Arc<Self>, leg: usize, rate: ResyncRate, full: bool) -> Result<()> {
        let slot = self.leg_slot(leg)?;
        if self.active().contains(&leg) {
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
        let Some(map) = self.map_of(leg) else {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {leg} ({}) has no resync map",
                slot.name
            )));
        };
        if rate.min == 0 || rate.max < rate.min {
            return Err(Error::InvalidArgument(format!(
                "resync rate floor {} and ceiling {} (bytes/s): the floor must be positive and at most the ceiling",
                rate.min, rate.max
            )));
        }
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
        *slot.progress.lock() = Some(self.progress(&run, 0, &map, "running", None));
        tracing::info!(leg, name = %slot.name, blocks = run.total, full,
            "mirror: resync started");
        let mirror = Arc::clone(self);
        let handle = std::thread::Builder::new()
            .name(format!("vouch-resync-{leg}"))
            .spawn(move || mirror.resync_thread(leg, map, run, rate))
            .map_err(|error| Error::InvalidArgument(format!("cannot start a resync: {error}")))?;
        self.resyncs.lock().push(handle);
        Ok(())
    }

    /// Stop every resync (each keeps its map: a restart resumes) and
    /// make every map durable with no region marked (a clean close).
    pub fn stop_resyncs(&self) -> Result<()> {
        self.stopping.store(true, Ordering::Release);
        let handles: Vec<_> = self.resyncs.lock().drain(..).collect();
        for handle in handles {
            let _ = handle.join();
        }
        for leg in &self.legs {
            let map = leg.map.read().clone();
            if let Some(map) = map {
                map.sync_and_retire()?;
            }
        }
        Ok(())
    }

    fn progress(
        &self,
        run: &Run,
        copied: u64,
        map: &DirtyMap,
        state: &'static str,
        error: Option<String>,
    ) -> ResyncProgress {
        let elapsed = run.started.elapsed();
        let rate = if elapsed.as_secs_f64() > 0.0 {
            (copied as f64 * crate::state::BLOCK as f64 / elapsed.as_secs_f64()) as u64
        } else {
            0
        };
        let left = map.count();
        ResyncProgress {
            total: run.total,
            copied,
            left,
            full: run.full,
            rate,
            eta_seconds: (rate > 0).then(|| left * crate::state::BLOCK / rate),
            state,
            error,
            elapsed_ms: elapsed.as_millis() as u64,
        }
    }

    fn resync_thread(&self, leg: usize, map: Arc<DirtyMap>, run: Run, rate: ResyncRate) {
        let slot = &self.legs[leg];
        let (copied, state, error) = match self.resync_loop(leg, &map, &run, rate) {
            Err((copied, error)) => (copied, "failed", Some(error.to_string())),
            Ok(copied) if self.stopping.load(Ordering::Acquire) => (
                copied,
                "stopped",
                Some(format!(
                    "server stopping; {} blocks left for the next start",
                    map.count()
                )),
            ),
            Ok(copied) if !slot.resyncing.load(Ordering::Acquire) => (
                copied,
                "stopped",
                Some("the leg failed a write; it stays stale".to_string()),
            ),
            Ok(copied) => match self.finish(leg, &map) {
                Ok(()) => (copied, "done", None),
                Err(error) => (copied, "failed", Some(error.to_string())),
            },
        };
        slot.resyncing.store(false, Ordering::Release);
        let progress = self.progress(&run, copied, &map, state, error.clone());
        tracing::info!(leg, name = %slot.name, state, copied, left = progress.left,
            error = error.as_deref().unwrap_or(""), "mirror: resync ended");
        *slot.progress.lock() = Some(progress);
    }

    /// Copy until the map is empty; returns the blocks copied.
    fn resync_loop(
        &self,
        leg: usize,
        map: &DirtyMap,
        run: &Run,
        rate: ResyncRate,
    ) -> std::result::Result<u64, (u64, Error)> {
        let slot = &self.legs[leg];
        let target = self.device(leg);
        let mut copied = 0u64;
        map.sync_and_retire().map_err(|e| (copied, e))?;
        let mut lba = 0;
        let mut unrepairable: Vec<u64> = Vec::new();
        loop {
            if self.stopping.load(Ordering::Acquire) || !slot.resyncing.load(Ordering::Acquire) {
                return Ok(copied);
            }
            let started = Instant::now();
            let foreground = self.foreground.load(Ordering::Relaxed);
            let mut batch: Vec<(Vec<u64>, u64)> = Vec::new();
            let mut moved = 0u64;
            while batch.len() < BATCH_WINDOWS {
                let Some(next) = map.next_dirty(lba) else {
                    break;
                };
                let window = next - next % WINDOW_BLOCKS;
                lba = window + WINDOW_BLOCKS;
                let _locked = self.lock(window, window + WINDOW_BLOCKS);
                let since = map.sequence();
                let dirty: Vec<u64> = map
                    .dirty_in(window, window + WINDOW_BLOCKS)
                    .into_iter()
                    .filter(|lba| !unrepairable.contains(lba))
                    .collect();
                if dirty.is_empty() {
                    continue;
                }
                let (done, left) = self.copy_blocks(leg, &dirty).map_err(|e| (copied, e))?;
                unrepairable.extend(left);
                moved += done.len() as u64;
                batch.push((done, since));
            }
            if batch.is_empty() {
                if map.count() > unrepairable.len() as u64 {
                    lba = 0; // written again meanwhile: another pass
                    continue;
                }
                if !unrepairable.is_empty() {
                    return Err((
                        copied,
                        Error::InvalidArgument(format!(
                            "{} blocks fail verification on every active leg (first LBA {}): left dirty, the leg stays stale",
                            unrepairable.len(),
                            unrepairable[0]
                        )),
                    ));
                }
                return Ok(copied);
            }
            target.flush().map_err(|e| (copied, e))?;
            for (done, since) in &batch {
                map.clear_unless_touched(done, *since);
            }
            map.sync_and_retire().map_err(|e| (copied, e))?;
            copied += moved;
            *slot.progress.lock() = Some(self.progress(run, copied, map, "running", None));
            // Pace: the ceiling while clients are idle, the floor while busy.
            let busy = self.foreground.load(Ordering::Relaxed) != foreground;
            let limit = if busy { rate.min } else { rate.max };
            let due = Duration::from_secs_f64((moved * crate::state::BLOCK) as f64 / limit as f64);
            let mut left = due.saturating_sub(started.elapsed());
            while !left.is_zero() && !self.stopping.load(Ordering::Acquire) {
                let nap = left.min(Duration::from_millis(50));
                std::thread::sleep(nap);
                left -= nap;
            }
        }
    }

    /// Copy `lbas` (one window, stripe locked) from an active leg to `leg`.
    /// Returns the blocks copied and those no active leg holds good.
    fn copy_blocks(&self, leg: usize, lbas: &[u64]) -> Result<(Vec<u64>, Vec<u64>)> {
        let target = self.device(leg);
        let sources = self.active();
        let Some(&first_source) = sources.first() else {
            return Err(Error::FailStopped("no active mirror leg".into()));
        };
        let sealed = self.read_runs(first_source, lbas);
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
                self.device(source)
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

    /// Read `lbas` sealed from `source`, in runs of consecutive LBAs.
    fn read_runs(&self, source: usize, lbas: &[u64]) -> Result<Vec<SealedBlock>> {
        let mut out = Vec::with_capacity(lbas.len());
        let mut at = 0;
        while at < lbas.len() {
            let mut end = at + 1;
            while end < lbas.len() && lbas[end] == lbas[end - 1] + 1 {
                end += 1;
            }
            out.extend(
                self.device(source)
                    .read_sealed(lbas[at], (end - at) as u64)?,
            );
            at = end;
        }
        Ok(out)
    }

    /// The map is empty: record the leg active, then remove the map.
    fn finish(&self, leg: usize, map: &DirtyMap) -> Result<()> {
        let slot = &self.legs[leg];
        self.set_leg_active(leg)?;
        if let Some(membership) = &self.membership {
            membership.set_state(leg, LegState::Active)?;
        }
        *slot.map.write() = None;
        map.remove()?;
        tracing::info!(leg, name = %slot.name, "mirror: resync done: leg active");
        Ok(())
    }
}
