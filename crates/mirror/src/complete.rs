//! Mirrored writes that complete later: the NBD reactor's path for a
//! mirror with remote legs.
//!
//! A blocking write (`MayWait`) to a remote leg costs its thread a sleep per
//! write: the NBD reactor hands the write to a worker, the worker sleeps
//! until the replica connection's reader thread wakes it with the answer,
//! then wakes the reactor to send the reply. Here nobody sleeps on the
//! write. `begin` (on the reactor, never blocking) is admitted as every
//! mirrored write is (`Mirror::admit`, `admit.rs`: the stripes without
//! waiting, the log, the record, room on the local legs, sealed once);
//! its start issues the plan (`Issue::run`: the remote legs' requests by
//! callback, `SealedAdmission::Callback`, then the local legs inline into their
//! room) and returns.
//! The last leg to answer — usually on a replica connection's reader
//! thread — judges the legs by the blocking path's rule (`Mirror::judge`:
//! a leg that failed is taken out exactly as there), releases the stripes and
//! the record, and calls the write's `WriteDone`, which queues the NBD
//! reply. The stripes and the record belong to the write (`Flight`), not
//! to a thread's stack; a remote leg's request is bounded by its
//! connection's timeout, enforced by its reader thread, so a write whose
//! replica never answers still completes (the leg taken out as stale).
//!
//! Crash ordering: as every mirrored write's (`admit.rs`): its extents
//! are in the activity log on disk before any leg is written (the
//! admission declines a write whose extent is not logged yet: adding one
//! syncs), each leg keeps the engine's order, none between legs, and the
//! write is acknowledged
//! (`WriteDone` called with `Ok`) only once every target leg answered,
//! the stripe lock held until then. No FUA here: a FUA write takes the
//! blocking path.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

use crate::admit::{no_outcomes, Admission, Answers, Held, Outcomes, Targets};
use crate::device::Mirror;
use vouch_engine::device::{StartWrite, WriteDone};
use vouch_engine::error::{Error, Result};

/// A write in flight: what it holds until its last leg answered.
struct Flight {
    /// Its legs, and how their outcomes are judged.
    targets: Targets<Arc<Mirror>>,
    /// Each target's outcome, by leg.
    outcomes: Mutex<Outcomes>,
    /// Outcomes still to come, plus one for the starter while it issues
    /// the legs' writes: the last to arrive finishes the write.
    remaining: AtomicUsize,
    /// Released when the write finishes, before its `WriteDone` is called.
    held: Mutex<Option<(Held, WriteDone)>>,
}

/// Reports one leg's outcome to its flight exactly once: a callback
/// dropped without being called (a connection that lost it) reports a
/// failure, so the write never holds its stripes forever.
struct LegDone {
    flight: Option<Arc<Flight>>,
    leg: usize,
}

impl LegDone {
    fn report(mut self, outcome: Result<()>) {
        if let Some(flight) = self.flight.take() {
            flight.arrived(self.leg, outcome);
        }
    }
}

impl Drop for LegDone {
    fn drop(&mut self) {
        if let Some(flight) = self.flight.take() {
            flight.arrived(
                self.leg,
                Err(Error::Unreachable(
                    "a mirror leg's write was dropped without an answer".into(),
                )),
            );
        }
    }
}

/// A method, so `device.rs` calls it without importing this module.
impl Mirror {
    /// `submit_write` with `vouch_engine::Admission::Callback`: a
    /// write admitted as `Admission::Callback` (`admit.rs`: whole blocks,
    /// no stripe of the range held, no leg keeping a resync map, room in
    /// every local target's write-back buffer, every remote target
    /// answering by callback, no target sealing at a cost the reactor
    /// should not pay). A mirror without a remote target declines
    /// (`MustNotWait` is its inline path).
    pub(crate) fn begin_write(
        self: Arc<Mirror>,
        offset: u64,
        data: &Bytes,
    ) -> Result<Option<StartWrite>> {
        let Some((held, plan)) = Mirror::admit(self, offset, data, Admission::Callback)? else {
            return Ok(None);
        };
        Ok(Some(Box::new(move |done: WriteDone| {
            let flight = Arc::new(Flight {
                remaining: AtomicUsize::new(plan.targets.len() + 1),
                outcomes: Mutex::new(no_outcomes()),
                targets: plan.targets,
                held: Mutex::new(Some((held, done))),
            });
            // The starter's share of `remaining`, given up when the legs'
            // writes are issued, or while unwinding from a panic there
            // (the legs not written then count as failed): never held
            // forever.
            let _starter = Starter(Arc::clone(&flight));
            plan.issue.run(&flight.targets, false, &flight);
        })))
    }
}

/// The starter's share of a flight's `remaining`.
struct Starter(Arc<Flight>);

impl Drop for Starter {
    fn drop(&mut self) {
        self.0.starter_done();
    }
}

impl Answers for Arc<Flight> {
    fn answer(&self, leg: usize, outcome: Result<()>) {
        self.arrived(leg, outcome);
    }
    fn later(&self, leg: usize) -> Option<WriteDone> {
        let reporter = LegDone {
            flight: Some(Arc::clone(self)),
            leg,
        };
        Some(Box::new(move |outcome| reporter.report(outcome)))
    }
}

impl Flight {
    fn arrived(&self, leg: usize, outcome: Result<()>) {
        self.outcomes.lock()[leg] = Some(outcome);
        self.starter_done();
    }

    /// One share of `remaining` given up; the last finishes the write.
    fn starter_done(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.finish();
        }
    }

    /// Judge the legs (`Targets::settle`, as every route), release the
    /// stripes, the log and the record, answer.
    fn finish(&self) {
        let mut outcomes = std::mem::replace(&mut *self.outcomes.lock(), no_outcomes());
        let result = self.targets.settle(&mut outcomes);
        let (held, done) = self.held.lock().take().expect("a write finishes once");
        drop(held);
        done(result);
    }
}
