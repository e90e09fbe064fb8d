//! Mirrored writes that complete later: the NBD reactor's path for a
//! mirror with remote legs.
//!
//! A blocking `write_shared` to a remote leg costs its thread a sleep per
//! write: the NBD reactor hands the write to a worker, the worker sleeps
//! until the replica connection's reader thread wakes it with the answer,
//! then wakes the reactor to send the reply. Here nobody sleeps on the
//! write. `begin` (on the reactor, never blocking) takes the stripes
//! without waiting, seals the blocks once and records them as written;
//! `start` sends the remote legs' requests (`write_sealed_then`), writes
//! the local legs inline (their write-back buffers had room) and returns.
//! The last leg to answer — usually on a replica connection's reader
//! thread — judges the legs by the blocking path's rule (`Mirror::judge`:
//! a leg that failed is taken out exactly as there), releases the stripes and
//! the record, and calls the write's `WriteDone`, which queues the NBD
//! reply. The stripes and the record belong to the write (`Flight`), not
//! to a thread's stack; a remote leg's request is bounded by its
//! connection's timeout, enforced by its reader thread, so a write whose
//! replica never answers still completes (the leg taken out as stale).
//!
//! Crash ordering: as `Mirror::write_shared` (device.rs): its extents
//! are in the activity log on disk before any leg is written (`begin`
//! declines a write whose extent is not logged yet: adding one syncs),
//! each leg keeps
//! the engine's order, none between legs, and the write is acknowledged
//! (`WriteDone` called with `Ok`) only once every target leg answered,
//! the stripe lock held until then. No FUA here: a FUA write takes the
//! blocking path.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use vouch_format::mirror::LegState;

use crate::activity::Entered;
use crate::device::{Mirror, Reserved};
use crate::legs::PerLeg;
use crate::stripes::OwnedStripes;
use crate::written::Recording;
use vouch_engine::device::{SealedBlock, StartWrite, WriteDone};
use vouch_engine::error::{Error, Result};
use vouch_engine::BLOCK;

/// A write in flight: what it holds until its last leg answered.
struct Flight {
    mirror: Arc<Mirror>,
    /// The legs written, each with whether it was resyncing (not active)
    /// when the write was issued.
    targets: PerLeg<(usize, bool)>,
    /// Each target's outcome, by position in `targets`.
    outcomes: Mutex<PerLeg<Option<Result<()>>>>,
    /// Outcomes still to come, plus one for the starter while it issues
    /// the legs' writes: the last to arrive finishes the write.
    remaining: AtomicUsize,
    blocks: Range<u64>,
    held: Mutex<Option<Held>>,
}

/// Released when the write finishes, before its `WriteDone` is called.
struct Held {
    _stripes: OwnedStripes,
    _recorded: Recording,
    _logged: Option<Entered>,
    done: WriteDone,
}

/// Reports one leg's outcome to its flight exactly once: a callback
/// dropped without being called (a connection that lost it) reports a
/// failure, so the write never holds its stripes forever.
struct LegDone {
    flight: Option<Arc<Flight>>,
    at: usize,
}

impl LegDone {
    fn report(mut self, outcome: Result<()>) {
        if let Some(flight) = self.flight.take() {
            flight.arrived(self.at, outcome);
        }
    }
}

impl Drop for LegDone {
    fn drop(&mut self) {
        if let Some(flight) = self.flight.take() {
            flight.arrived(
                self.at,
                Err(Error::Unreachable(
                    "a mirror leg's write was dropped without an answer".into(),
                )),
            );
        }
    }
}

/// `Mirror::try_begin_write` (see `BlockDevice::try_begin_write`): only
/// whole blocks, when no stripe of the range is held, no leg keeps a
/// resync map (marking one may sync), room is reserved in every local
/// target's write-back buffer, every remote target completes its writes
/// later, and no target seals the write at a cost the reactor should not
/// pay (`inline_seal_max_bytes`).
/// A mirror without a remote target declines (`try_write_shared` is its
/// inline path).
pub(super) fn begin(mirror: Arc<Mirror>, offset: u64, data: &Bytes) -> Result<Option<StartWrite>> {
    let whole = offset.is_multiple_of(BLOCK) && (data.len() as u64).is_multiple_of(BLOCK);
    if data.is_empty() || !whole {
        return Ok(None);
    }
    let count = data.len() / BLOCK as usize;
    let first = offset / BLOCK;
    let remote = |leg: usize| mirror.legs[leg].remote;
    if !(0..mirror.legs.len()).any(remote) {
        return Ok(None);
    }
    mirror.foreground.fetch_add(1, Ordering::Relaxed);
    let Some(stripes) = mirror.stripes.try_lock_owned(first, first + count as u64) else {
        return Ok(None);
    };
    // Its extents must be in the activity log already: adding one syncs.
    let Some(logged) = mirror.try_enter_log(first, first + count as u64) else {
        return Ok(None);
    };
    // Recorded before the check below (as `Mirror::write_shared` records
    // before it marks): a leg taken out meanwhile builds its map from the
    // record, so this write is in that map or the check declines it.
    let recorded = mirror.record_bytes(offset, data.len() as u64);
    if mirror.tracks_any_leg() {
        return Ok(None);
    }
    // The targets under the stripes, after the check: a leg that finished
    // its resync before it is written too.
    let targets: PerLeg<usize> = mirror.write_targets();
    if !targets.iter().any(|&leg| remote(leg)) {
        return Ok(None);
    }
    let ready = targets.iter().all(|&leg| {
        let device = mirror.device(leg);
        data.len() <= device.inline_seal_max_bytes()
            && (!remote(leg) || device.writes_sealed_then())
    });
    if !ready {
        return Ok(None);
    }
    // Room on every local leg first: their writes then never wait, and
    // the write is never half done (as `Mirror::try_write_shared`).
    let local: PerLeg<usize> = targets
        .iter()
        .copied()
        .filter(|&leg| !remote(leg))
        .collect();
    let Some(reserved) = Reserved::on(Arc::clone(&mirror), &local, count) else {
        return Ok(None);
    };
    let Some(sealed) = mirror.seal_write(offset, data)? else {
        return Ok(None);
    };
    let targets: PerLeg<(usize, bool)> = targets
        .into_iter()
        .map(|leg| {
            let state = mirror.legs[leg].state();
            (leg, state != LegState::Active)
        })
        .collect();
    Ok(Some(Box::new(move |done: WriteDone| {
        let flight = Arc::new(Flight {
            remaining: AtomicUsize::new(targets.len() + 1),
            outcomes: Mutex::new((0..targets.len()).map(|_| None).collect()),
            targets,
            mirror,
            blocks: first..first + count as u64,
            held: Mutex::new(Some(Held {
                _stripes: stripes,
                _recorded: recorded,
                _logged: logged,
                done,
            })),
        });
        start(&flight, &sealed, reserved);
    })))
}

/// Issue the write to every target: remote legs first (their round trips
/// overlap the local writes), then the local legs inline; the starter's
/// own share of `remaining` is given up last. The local legs write into
/// the room `reserved` holds for them.
fn start(flight: &Arc<Flight>, sealed: &[SealedBlock], mut reserved: Reserved<Arc<Mirror>>) {
    // Given up when this returns, or while unwinding from a panic here
    // (the legs not written then count as failed): never held forever.
    let _starter = Starter(Arc::clone(flight));
    let mirror = &flight.mirror;
    for (at, &(leg, _)) in flight.targets.iter().enumerate() {
        if !mirror.legs[leg].remote {
            continue;
        }
        let reporter = LegDone {
            flight: Some(Arc::clone(flight)),
            at,
        };
        mirror.device(leg).write_sealed_then(
            sealed,
            false,
            Box::new(move |outcome| reporter.report(outcome)),
        );
    }
    for (at, &(leg, _)) in flight.targets.iter().enumerate() {
        if mirror.legs[leg].remote {
            continue;
        }
        reserved.take(leg);
        flight.arrived(at, mirror.device(leg).write_sealed_reserved(sealed));
    }
}

/// The starter's share of a flight's `remaining`.
struct Starter(Arc<Flight>);

impl Drop for Starter {
    fn drop(&mut self) {
        self.0.starter_done();
    }
}

impl Flight {
    fn arrived(&self, at: usize, outcome: Result<()>) {
        self.outcomes.lock()[at] = Some(outcome);
        self.starter_done();
    }

    /// One share of `remaining` given up; the last finishes the write.
    fn starter_done(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.finish();
        }
    }

    /// Judge the legs, release the stripes and the record, answer.
    fn finish(&self) {
        let outcomes: PerLeg<Result<()>> = std::mem::take(&mut *self.outcomes.lock())
            .into_iter()
            .map(|outcome| {
                // Only a panic in the starter leaves a leg without one.
                outcome.unwrap_or_else(|| {
                    Err(Error::FailStopped(
                        "the write to this leg was abandoned".into(),
                    ))
                })
            })
            .collect();
        let result = self.judge(outcomes);
        let held = self.held.lock().take().expect("a write finishes once");
        let Held {
            _stripes,
            _recorded,
            _logged,
            done,
        } = held;
        drop(_stripes);
        drop(_recorded);
        drop(_logged);
        done(result);
    }

    /// The legs' outcomes judged by the rule every route uses
    /// (`Mirror::judge`); a resyncing leg that took the write has the
    /// blocks land in its map, as on the blocking path.
    fn judge(&self, outcomes: PerLeg<Result<()>>) -> Result<()> {
        let mirror = &self.mirror;
        let outcomes = self
            .targets
            .iter()
            .zip(outcomes)
            .map(|(&(leg, resyncing), outcome)| (leg, resyncing, outcome));
        for leg in mirror.judge("write", outcomes)? {
            if let Some(map) = mirror.legs[leg].map.read().as_ref() {
                map.landed(self.blocks.clone());
            }
        }
        Ok(())
    }
}
