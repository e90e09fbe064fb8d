//! A mirrored write's admission and its executor, each coded once for the
//! three routes a write to a mirror takes (docs/ARCHITECTURE.md, "The
//! mirror's write"):
//!
//! - the worker's `submit_write` with `vouch_engine::Admission::MayWait`
//!   (`Admission::MayWait`): any bytes, FUA;
//!   it waits for the stripes, for the activity log to take its extents
//!   (a sync), for the resync maps' marks (a sync) and for a leg's full
//!   write-back buffer;
//! - the NBD reactor's inline `submit_write` with `MustNotWait`
//!   (`Admission::Reserved`):
//!   never waits; every target is local and holds room reserved for the
//!   write, so no leg commits on the reactor;
//! - the completion path, `submit_write` with `Callback` (`complete.rs`,
//!   `Admission::Callback`): never waits; the local targets hold reserved
//!   room, the remote ones answer by callback and the leg answering last
//!   completes the write, so no thread sleeps on a replica's round trip.
//!
//! `Mirror::admit` takes, in the one order crash safety needs, what every
//! route takes: the stripes (no repair moves a block between legs while
//! they differ mid-write), the activity log's extents (durable before any
//! leg is written), the record of the blocks written (before the resync
//! maps are looked at: a leg taken out meanwhile builds its map from the
//! record), the resync maps' marks (before any leg is written); then
//! `Mirror::plan` the target legs, the room on every local target and the
//! seal (once, one generation, the same bytes on every leg). Where the
//! worker's route waits, a route that must not wait declines (`None`)
//! with nothing held and nothing written: it cannot enter a log extent
//! that is not logged yet, mark a map, seal dearly or find a full buffer.
//!
//! `Issue::run` writes the plan to every target (remote legs started
//! first, so their round trips overlap the local legs' writes) and each
//! leg's outcome goes to the route's `Answers`; `Targets::settle` judges
//! them by the one rule (`Mirror::judge`) and lands the blocks in the maps
//! of resyncing legs that took them. A route keeps only where it waits for
//! the answers (`Plan::wait` on its own thread; `complete.rs` on the
//! thread of the leg answering last) and what holds its guards meanwhile.

use std::cell::{Cell, RefCell};
use std::ops::{Deref, Range};
use std::sync::atomic::Ordering;

use bytes::Bytes;
use vouch_engine::device::{
    DeviceWrites, SealedAdmission, SealedBlock, StartWrite, Submitted, WriteDone,
};
use vouch_engine::error::{Error, Result};
use vouch_engine::BLOCK;
use vouch_format::mirror::{LegState, MAX_LEGS};

use crate::activity::Entered;
use crate::device::Mirror;
use crate::legs::{is_request_error, LegSet, PerLeg};
use crate::stripes::OwnedStripes;
use crate::written::Recording;

/// How a mirrored write may wait: the route it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// The worker's route: waits for whatever it needs; never declines.
    MayWait,
    /// The reactor's inline route: must not wait; every target local,
    /// with room reserved in its write-back buffer.
    Reserved,
    /// The completion path: must not wait; a remote target answers by
    /// callback, the local ones write into reserved room.
    Callback,
}

/// What an admitted write holds until every leg answered, released (in
/// this order) before the client gets the answer.
pub(crate) struct Held {
    _recorded: Recording,
    _logged: Option<Entered>,
    _stripes: OwnedStripes,
}

/// A write admitted to the legs: who judges it and what is issued.
pub(crate) struct Plan<M: Deref<Target = Mirror> + Clone> {
    pub(crate) targets: Targets<M>,
    pub(crate) issue: Issue<M>,
}

/// The legs a write goes to and how their outcomes are judged.
pub(crate) struct Targets<M: Deref<Target = Mirror>> {
    mirror: M,
    /// The target legs, written and judged in the legs' order.
    legs: LegSet,
    /// The targets that were resyncing (not active) when the write was
    /// planned, under its stripes: a leg becomes active only with every
    /// stripe held (`finish_quiesced`), so only a leg taken out meanwhile
    /// can have changed.
    resyncing: LegSet,
    /// The blocks the sealed write stores, landed in the map of every
    /// resyncing leg that took them (none when each leg seals its own).
    landing: Range<u64>,
}

/// What is written to the targets, and into which room.
pub(crate) struct Issue<M: Deref<Target = Mirror>> {
    admission: Admission,
    blocks: Blocks,
    /// Room on every local target (the routes that must not wait).
    reserved: Option<Reserved<M>>,
}

enum Blocks {
    Sealed(Vec<SealedBlock>),
    /// No leg can seal for the others (only the worker's route goes on):
    /// each leg writes the bytes at `offset` itself.
    Unsealed {
        offset: u64,
        data: Bytes,
    },
}

/// Where a write's legs answer: each target's outcome exactly once, by
/// its leg.
pub(crate) trait Answers {
    fn answer(&self, leg: usize, outcome: Result<()>);
    /// For a route that completes later: the callback remote target `leg`
    /// answers through, on its own thread (`SealedAdmission::Callback`).
    fn later(&self, leg: usize) -> Option<WriteDone>;
}

/// Each leg's outcome of a write, by leg (`None`: not answered).
pub(crate) type Outcomes = [Option<Result<()>>; MAX_LEGS];

pub(crate) fn no_outcomes() -> Outcomes {
    std::array::from_fn(|_| None)
}

/// The routes that wait for their legs on their own thread (the
/// completion path's is `complete.rs`). Methods, so `device.rs`'s
/// `BlockDevice` implementation calls them without importing this module
/// (which imports it: docs/ARCHITECTURE.md "Modules import downward").
impl Mirror {
    /// The worker's route (`MayWait`): it may wait, so it is never
    /// declined.
    pub(crate) fn write_waiting(&self, offset: u64, data: &Bytes, fua: bool) -> Result<()> {
        let (_held, plan) = Mirror::admit(self, offset, data, Admission::MayWait)?
            .expect("a write that may wait is never declined");
        plan.wait(fua)
    }

    /// The inline route (`MustNotWait`): `Ok(false)`, with nothing
    /// held or written, where it would have to wait.
    pub(crate) fn write_reserved(&self, offset: u64, data: &Bytes) -> Result<bool> {
        let Some((_held, plan)) = Mirror::admit(self, offset, data, Admission::Reserved)? else {
            return Ok(false);
        };
        plan.wait(false)?;
        Ok(true)
    }

    /// A write whose caller holds its stripes, record and marks (a trim's
    /// or zeroing's partial sectors), planned and run as the worker's.
    pub(crate) fn write_admitted(&self, offset: u64, data: &Bytes, fua: bool) -> Result<()> {
        Mirror::plan(self, offset, data, Admission::MayWait)?
            .expect("a write that may wait is never declined")
            .wait(fua)
    }

    /// Break the executor on purpose, for the crash simulator's
    /// self-test (`vouch-sim mirror-write`; never in production): a write
    /// started on a travelling leg (answered `Started`) is counted done
    /// without being waited for, so the worker's route acknowledges before
    /// that leg holds the write.
    pub fn break_started_writes(&self) {
        self.unwaited.store(true, Ordering::Relaxed);
    }

    /// The one admission of a mirrored write of `data` at `offset` (see
    /// the module's documentation): what it holds, and its plan; `None`,
    /// with nothing held, when a route that must not wait would have to.
    pub(crate) fn admit<M: Deref<Target = Mirror> + Clone>(
        mirror: M,
        offset: u64,
        data: &Bytes,
        admission: Admission,
    ) -> Result<Option<(Held, Plan<M>)>> {
        let length = data.len() as u64;
        let (first, end) = (offset / BLOCK, (offset + length).div_ceil(BLOCK));
        if admission != Admission::MayWait {
            let whole = offset.is_multiple_of(BLOCK) && length.is_multiple_of(BLOCK);
            if data.is_empty() || !whole || !mirror.may_take(admission) {
                return Ok(None);
            }
        }
        // Client I/O: a resync runs at its floor meanwhile.
        mirror.foreground.fetch_add(1, Ordering::Relaxed);
        let held = if admission == Admission::MayWait {
            let stripes = mirror.stripes.lock_owned(first, end);
            let logged = mirror.enter_log(first, end)?;
            let recorded = mirror.written.record(first, end);
            mirror.mark(first, end)?;
            Held {
                _recorded: recorded,
                _logged: logged,
                _stripes: stripes,
            }
        } else {
            let Some(stripes) = mirror.stripes.try_lock_owned(first, end) else {
                return Ok(None);
            };
            // Its extents must be in the activity log already: adding one
            // syncs.
            let Some(logged) = mirror.try_enter_log(first, end) else {
                return Ok(None);
            };
            // Recorded before the check below, as the waiting route
            // records before it marks: a leg taken out meanwhile builds
            // its map from the record, so the write is in the map or the
            // check declines it.
            let recorded = mirror.written.record(first, end);
            // A stale leg's map must be marked first, which may sync.
            if mirror.tracks_any_leg() {
                return Ok(None);
            }
            Held {
                _recorded: recorded,
                _logged: logged,
                _stripes: stripes,
            }
        };
        Ok(Mirror::plan(mirror, offset, data, admission)?.map(|plan| (held, plan)))
    }

    /// Whether the legs' kinds suit a route that must not wait, looked at
    /// before anything is taken (a write the route cannot finish would
    /// take the stripes, the log, the record and the local legs' room only
    /// to give them back: for every write to a remote mirror that was ~6
    /// of the reactor's ~32 allocations per 4 KiB write). The inline route
    /// has no room to reserve on a remote leg; the completion path is for
    /// a mirror with one.
    fn may_take(&self, admission: Admission) -> bool {
        let remote = |leg: usize| self.legs[leg].remote;
        match admission {
            Admission::MayWait => true,
            Admission::Reserved => {
                !(0..self.legs.len()).any(|leg| remote(leg) && self.is_write_target(leg))
            }
            Admission::Callback => (0..self.legs.len()).any(remote),
        }
    }

    /// The plan of a write whose caller holds its stripes, record and
    /// marks (`admit`; a trim's or zeroing's partial sectors): the targets
    /// under those stripes (a leg that finished its resync before is
    /// written too), then for a route that must not wait a check that
    /// every target takes the write cheaply (`inline_seal_max_bytes`: an
    /// encrypted leg seals up to 128 KiB; a remote one answers by
    /// callback) and room on every local target (their writes then never
    /// wait, and the write is never half done), then the seal
    /// (`seal_write`: once, read-modify-writing a partial block at either
    /// edge from a verified copy under the stripes).
    pub(crate) fn plan<M: Deref<Target = Mirror> + Clone>(
        mirror: M,
        offset: u64,
        data: &Bytes,
        admission: Admission,
    ) -> Result<Option<Plan<M>>> {
        let remote = |leg: usize| mirror.legs[leg].remote;
        let (mut legs, mut local) = (LegSet::default(), LegSet::default());
        for leg in (0..mirror.legs.len()).filter(|&leg| mirror.is_write_target(leg)) {
            legs.insert(leg);
            if !remote(leg) {
                local.insert(leg);
            }
        }
        let mut reserved = None;
        if admission != Admission::MayWait {
            let any_remote = local != legs;
            let route = match admission {
                Admission::Callback => any_remote,
                _ => !any_remote,
            };
            let cheap = |leg: usize| {
                let device = mirror.device(leg);
                data.len() <= device.inline_seal_max_bytes()
                    && (!remote(leg) || device.answers_by_callback())
            };
            if legs.is_empty() || !route || !legs.iter().all(cheap) {
                return Ok(None);
            }
            let count = data.len() / BLOCK as usize;
            let Some(room) = Reserved::on(mirror.clone(), local, count) else {
                return Ok(None);
            };
            reserved = Some(room);
        }
        let blocks = match mirror.seal_write(offset, data)? {
            Some(sealed) => Blocks::Sealed(sealed),
            None if admission == Admission::MayWait => Blocks::Unsealed {
                offset,
                data: data.clone(),
            },
            None => return Ok(None),
        };
        let landing = match &blocks {
            Blocks::Sealed(sealed) => match (sealed.first(), sealed.last()) {
                (Some(first), Some(last)) => first.lba..last.lba + 1,
                _ => 0..0,
            },
            Blocks::Unsealed { .. } => 0..0,
        };
        let mut resyncing = LegSet::default();
        for leg in legs.iter() {
            if mirror.legs[leg].state() != LegState::Active {
                resyncing.insert(leg);
            }
        }
        Ok(Some(Plan {
            targets: Targets {
                mirror,
                legs,
                resyncing,
                landing,
            },
            issue: Issue {
                admission,
                blocks,
                reserved,
            },
        }))
    }
}

impl<M: Deref<Target = Mirror> + Clone> Plan<M> {
    /// Issue the write and wait here for every leg: the routes that
    /// answer on their own thread (the worker's, the inline one).
    pub(crate) fn wait(self, fua: bool) -> Result<()> {
        let Plan { targets, issue } = self;
        let turn = Turn {
            targets: &targets,
            outcomes: RefCell::new(no_outcomes()),
            settled: Cell::new(false),
        };
        issue.run(&targets, fua, &turn);
        turn.settle()
    }
}

impl<M: Deref<Target = Mirror>> Targets<M> {
    pub(crate) fn len(&self) -> usize {
        self.legs.len()
    }

    /// Judge the legs' outcomes (`Mirror::judge`: the rule of every route;
    /// a leg without one, abandoned by a panic, failed) and land the
    /// blocks in the map of each resyncing leg that took them, still
    /// under the stripes: cleared once a flush of that leg issued after
    /// this returned has returned (`resync.rs`).
    pub(crate) fn settle(&self, outcomes: &mut Outcomes) -> Result<()> {
        let mirror = &*self.mirror;
        let outcomes = self.legs.iter().map(|leg| {
            let outcome = outcomes[leg].take().unwrap_or_else(|| {
                Err(Error::FailStopped(
                    "the write to this leg was abandoned".into(),
                ))
            });
            (leg, self.resyncing.contains(leg), outcome)
        });
        for leg in mirror.judge("write", outcomes)? {
            if let Some(map) = mirror.legs[leg].map.read().as_ref() {
                map.landed(self.landing.clone());
            }
        }
        Ok(())
    }
}

impl<M: Deref<Target = Mirror>> Issue<M> {
    /// The one executor: write the blocks to every target of `targets`,
    /// each outcome to `answers`. Remote targets first, so their round
    /// trips overlap the local writes: by callback when the route
    /// completes later (`Answers::later`, submitted
    /// `SealedAdmission::Callback`), else submitted `Here`, which a
    /// travelling write answers `Started` once sent, waited for after the
    /// local targets. The local targets in turn, each with the one
    /// submission: into their reserved room (`SealedAdmission::Reserved`),
    /// or (the worker's route) as the leg's buffer allows
    /// (`SealedAdmission::Here`, checking each context's place
    /// only: the guard was computed in this process from the same
    /// immutable bytes), durable for FUA. Every started write is waited
    /// for before this returns, even while unwinding (`Started`), so no
    /// leg's write is in flight once a waiting route releases its
    /// stripes. Request errors (range) were checked by the seal, so no
    /// leg stores what another refuses as a bad request.
    pub(crate) fn run(mut self, targets: &Targets<M>, fua: bool, answers: &impl Answers) {
        let mirror = &*targets.mirror;
        let sealed = match &self.blocks {
            Blocks::Sealed(sealed) => sealed,
            Blocks::Unsealed { offset, data } => {
                // In turn, each leg checking the request itself: a request
                // error (the caller's) stops the turn, and the legs after
                // it are not asked (`judge` blames none).
                for leg in targets.legs.iter() {
                    let outcome = mirror.device(leg).write_bytes(*offset, data, fua);
                    let request_error = matches!(&outcome, Err(error) if is_request_error(error));
                    answers.answer(leg, outcome);
                    if request_error {
                        break;
                    }
                }
                return;
            }
        };
        let mut issued = LegSet::default();
        let mut started = Started {
            answers,
            pending: PerLeg::new(),
            unwaited: mirror.unwaited.load(Ordering::Relaxed),
        };
        // The remote targets: by callback when the route completes later;
        // on the worker's route submitted `Here` too, a travelling write
        // answering `Started` once sent, waited for after the local ones.
        for leg in targets.legs.iter().filter(|&leg| mirror.legs[leg].remote) {
            let device = mirror.device(leg);
            let outcome = match answers.later(leg) {
                // The outcome goes to `done` whatever it is, exactly once.
                Some(done) => {
                    match device.submit_sealed(sealed, fua, SealedAdmission::Callback) {
                        Ok(Submitted::Started(start)) => start(done),
                        Ok(Submitted::Done) => done(Ok(())),
                        // The plan saw it answer by callback: it stopped
                        // since (its connection died).
                        Ok(Submitted::Declined) => done(Err(Error::Unreachable(
                            "the leg no longer answers writes by callback".into(),
                        ))),
                        Err(error) => done(Err(error)),
                    }
                    issued.insert(leg);
                    continue;
                }
                None if self.admission == Admission::MayWait => {
                    match device.submit_sealed(sealed, fua, SealedAdmission::Here) {
                        Ok(Submitted::Started(start)) => {
                            started.pending.push((leg, start));
                            issued.insert(leg);
                            continue;
                        }
                        Ok(submitted) => submitted.wait(),
                        Err(error) => Err(error),
                    }
                }
                // Not met (`plan` gives a route that must not wait a remote
                // target only with a callback): written below as any leg.
                None => continue,
            };
            answers.answer(leg, outcome);
            issued.insert(leg);
        }
        for leg in targets.legs.iter() {
            if issued.contains(leg) {
                continue;
            }
            let device = mirror.device(leg);
            let admission = match &mut self.reserved {
                Some(reserved) => {
                    reserved.take(leg);
                    SealedAdmission::Reserved
                }
                None => SealedAdmission::Here,
            };
            let outcome = device
                .submit_sealed(sealed, fua, admission)
                .and_then(Submitted::wait);
            answers.answer(leg, outcome);
        }
        drop(started);
    }
}

/// Writes started on remote targets, waited for (in order) when this is
/// dropped: after the local targets' writes, or while unwinding.
struct Started<'a, A: Answers> {
    answers: &'a A,
    pending: PerLeg<(usize, StartWrite)>,
    /// `Mirror::break_started_writes`: count them done unwaited.
    unwaited: bool,
}

impl<A: Answers> Drop for Started<'_, A> {
    fn drop(&mut self) {
        for (leg, start) in std::mem::take(&mut self.pending) {
            let outcome = match self.unwaited {
                true => {
                    drop(start);
                    Ok(())
                }
                false => Submitted::Started(start).wait(),
            };
            self.answers.answer(leg, outcome);
        }
    }
}

/// The answers of a write waited for on its own thread. Dropped without
/// `settle` (a leg's write panicked), it judges what it has, so a leg
/// that failed is still taken out.
struct Turn<'a, M: Deref<Target = Mirror>> {
    targets: &'a Targets<M>,
    outcomes: RefCell<Outcomes>,
    /// Judged (`settle`): the drop has nothing left to do.
    settled: Cell<bool>,
}

impl<M: Deref<Target = Mirror>> Turn<'_, M> {
    fn settle(mut self) -> Result<()> {
        self.settled.set(true);
        self.targets.settle(self.outcomes.get_mut())
    }
}

impl<M: Deref<Target = Mirror>> Answers for Turn<'_, M> {
    fn answer(&self, leg: usize, outcome: Result<()>) {
        self.outcomes.borrow_mut()[leg] = Some(outcome);
    }
    fn later(&self, _: usize) -> Option<WriteDone> {
        None
    }
}

impl<M: Deref<Target = Mirror>> Drop for Turn<'_, M> {
    fn drop(&mut self) {
        if !self.settled.get() {
            // Unwinding: the outcome is nobody's, the legs' judging is.
            let _ = self.targets.settle(self.outcomes.get_mut());
        }
    }
}

/// Room reserved on the local targets of a write that must not wait:
/// each leg's is taken when its write goes in; what is left when this is
/// dropped (the write declined or stopped early) is given back.
pub(crate) struct Reserved<M: Deref<Target = Mirror>> {
    mirror: M,
    legs: LegSet,
    count: usize,
}

impl<M: Deref<Target = Mirror>> Reserved<M> {
    /// Room for `count` blocks on every leg of `targets`, or `None` with
    /// none held.
    fn on(mirror: M, targets: LegSet, count: usize) -> Option<Reserved<M>> {
        let mut reserved = Reserved {
            mirror,
            legs: LegSet::default(),
            count,
        };
        for leg in targets.iter() {
            if !reserved.mirror.device(leg).reserve_room(count) {
                return None;
            }
            reserved.legs.insert(leg);
        }
        Some(reserved)
    }

    /// `leg`'s room is being used: no longer given back.
    fn take(&mut self, leg: usize) {
        self.legs.remove(leg);
    }
}

impl<M: Deref<Target = Mirror>> Drop for Reserved<M> {
    fn drop(&mut self) {
        for leg in self.legs.iter() {
            self.mirror.device(leg).release_room(self.count);
        }
    }
}
