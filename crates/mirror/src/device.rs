//! The `Mirror` device: the parts it owns (its legs, `legs.rs`; the
//! stripe lock, `stripes.rs`; the written record, `written.rs`; the
//! activity log, `activity.rs`), taking a leg out, and the `BlockDevice`
//! implementation (reads that repair are in `repair.rs`).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use smallvec::SmallVec;
use vouch_format::mirror::{LegState, MAX_LEGS};

use crate::activity::{ActivityLog, Entered};
use crate::legs::{is_request_error, Leg, LegStatus, MirrorLeg, PerLeg};
use crate::progress::ReconcileProgress;
use crate::stripes::Stripes;
use crate::swap::Swap;
use crate::written::{count, minus, Recording, Written};
use crate::{Membership, CORRECTED_HALF_LIFE, FAULT_THRESHOLD};
use vouch_engine::device::{
    BlockDevice, SealedAdmission, SealedBlock, SealedDevice, Submitted, ZeroFlags,
};
use vouch_engine::error::{Error, Fault, FaultKind, Result};
use vouch_engine::Allocation;
use vouch_engine::BLOCK;

/// A `BlockDevice` over 2 or 3 legs (see the module's documentation).
pub struct Mirror {
    pub(super) legs: Vec<Leg>,
    next: AtomicUsize,
    /// Reads go to the first active leg only (`read_one_leg_until_scrubbed`,
    /// or while a reconciliation runs).
    one_leg: AtomicBool,
    /// Reads stay on one leg until a whole scrub (the legs may differ
    /// anywhere), whatever a reconciliation settles.
    scrub_pending: AtomicBool,
    /// Shared so a write that completes on another thread can own its
    /// stripes (`try_lock_owned`, `complete.rs`).
    pub(super) stripes: Stripes,
    pub(super) membership: Option<Box<dyn Membership>>,
    /// Serialises decisions to fault a leg (never the last active one).
    faulting: Mutex<()>,
    /// Bytes; changed only by an online resize (`resize.rs`).
    pub(super) size: AtomicU64,
    read_only: bool,
    /// Client requests seen (reads and writes): resync backs off while it moves.
    pub(super) foreground: AtomicU64,
    /// Running resyncs' threads, and the flag that stops them.
    pub(super) resyncs: Mutex<Vec<std::thread::JoinHandle<()>>>,
    pub(super) stopping: AtomicBool,
    /// Blocks written since the last flush (`written.rs`).
    pub(super) written: Written,
    /// The extents that may be written now, durable before any leg is
    /// written (`activity.rs`); set once, when the set keeps a log, and
    /// replaced only by an online resize (`resize.rs`).
    pub(super) activity: Swap<Arc<ActivityLog>>,
    /// The reconciliation after an unclean stop (`reconcile.rs`).
    pub(super) reconcile: Mutex<Option<ReconcileProgress>>,
    pub(super) reconciling: AtomicBool,
    /// A deliberate break of the write executor, for the crash
    /// simulator's self-test only (`Mirror::break_started_writes`).
    pub(super) unwaited: AtomicBool,
    /// The mirror itself, for the completion path: a write started there
    /// owns the mirror until its last leg answers (`complete.rs`), though
    /// `submit_write` is called on `&self`. Always upgradable while a
    /// caller holds the mirror (`Mirror::new` returns the `Arc`).
    me: std::sync::Weak<Mirror>,
}

/// The activity log, as the mirror uses it (the log itself: `activity.rs`).
impl Mirror {
    /// Keep `log` from now on: every write, trim and zeroing enters it
    /// before any leg is written. Set once (at open, before serving).
    pub fn keep_activity_log(&self, log: Arc<ActivityLog>) -> Result<()> {
        self.activity
            .set(log)
            .map_err(|_| Error::InvalidArgument("the mirror keeps an activity log already".into()))
    }

    /// A clean close of the log, once no write is in flight or to come:
    /// flush every leg, then write a log that names only what is still to
    /// reconcile (ORDER: the flush returns before the log forgets an
    /// extent). Nothing to do without a log.
    pub fn close_activity_log(&self) -> Result<()> {
        let Some(log) = self.activity.get() else {
            return Ok(());
        };
        vouch_engine::device::BlockDevice::flush(self)?;
        log.close()
    }

    /// Reads go to the first active leg until the extents the log carried
    /// from the last run are reconciled (`begin_reconcile` then does it);
    /// for a set opened before its reconciliation starts.
    pub fn hold_reads_until_reconciled(&self) {
        if self
            .activity
            .get()
            .is_some_and(|log| !log.pinned().is_empty())
        {
            self.hold_reads_on_one_leg();
        }
    }

    /// The activity log, if the set keeps one.
    pub fn activity_log(&self) -> Option<&Arc<ActivityLog>> {
        self.activity.get()
    }

    /// Enter blocks `[first, end)` in the activity log (the caller holds
    /// their stripes), flushing the legs if that is what makes room, or
    /// waiting for writes in flight to return. `None`: no log.
    pub(super) fn enter_log(&self, first: u64, end: u64) -> Result<Option<Entered>> {
        let Some(log) = self.activity.get() else {
            return Ok(None);
        };
        // Every extent that could leave having a write in flight,
        // `enter_waiting` waits for one to return (each returns without
        // waiting on this writer: it holds no lock this writer wants). When
        // a flush made no room (each flushed extent written again
        // meanwhile), the next round flushes again.
        loop {
            match log.enter_waiting(first, end)? {
                Ok(entered) => return Ok(Some(entered)),
                Err(_) => vouch_engine::device::BlockDevice::flush(self)?,
            }
        }
    }

    pub(super) fn enter_log_bytes(&self, offset: u64, length: u64) -> Result<Option<Entered>> {
        self.enter_log(offset / BLOCK, (offset + length).div_ceil(BLOCK))
    }

    /// `enter_log` without I/O or waiting, for the inline paths: `None`
    /// (decline) when an extent is not logged yet; `Some(None)`: no log.
    pub(super) fn try_enter_log(&self, first: u64, end: u64) -> Option<Option<Entered>> {
        match self.activity.get() {
            None => Some(None),
            Some(log) => log.try_enter(first, end).map(Some),
        }
    }

    /// `[offset, offset + length)` in the pieces a large trim or zeroing
    /// enters the log by (`ActivityLog::pieces`; one piece without a log).
    pub(super) fn log_pieces(&self, offset: u64, length: u64) -> Vec<Range<u64>> {
        let end = offset + length;
        let Some(log) = self.activity.get() else {
            return std::iter::once(offset..end).collect();
        };
        log.pieces(offset, end)
    }
}

/// Blocks written since the last flush, as the mirror uses them (the
/// record itself: `written.rs`).
impl Mirror {
    /// Record the blocks of bytes `[offset, offset + length)` (a write,
    /// trim or zeroing about to be issued to the legs).
    pub(super) fn record_bytes(&self, offset: u64, length: u64) -> Recording {
        self.written
            .record(offset / BLOCK, (offset + length).div_ceil(BLOCK))
    }

    /// Give `leg`, which is being taken out as stale (the caller decides,
    /// and records the state only after this returns), a resync map that
    /// is durable on return: the blocks written since the last flush,
    /// then every write (`mark`). Returns the blocks it marks, or `None`
    /// (logged why) when it cannot be made durable: the leg then has
    /// unknown history, and no map of it is left behind.
    pub(super) fn map_stale_leg(&self, leg: usize) -> Option<u64> {
        let name = &self.legs[leg].name;
        let membership = self.membership.as_ref()?;
        let blocks = self.size() / BLOCK;
        // Writes recorded from here on and not in `before` are marked
        // below, once the map is in place for the writes after them.
        let before = self.written.runs();
        let map = match membership.create_map(leg, blocks, &before) {
            Ok(map) => Arc::new(map),
            Err(error) => {
                tracing::error!(leg, name, %error,
                    "mirror: cannot create the stale leg's resync map: it will need a full resync");
                return None;
            }
        };
        *self.legs[leg].map.write() = Some(Arc::clone(&map));
        let late = minus(&self.written.runs(), &before);
        let made = late
            .iter()
            .try_for_each(|run| map.mark(run.start, run.end))
            .and_then(|()| map.sync_and_retire());
        if let Err(error) = made {
            *self.legs[leg].map.write() = None;
            let removed = map.remove();
            tracing::error!(leg, name, %error, removed = ?removed,
                "mirror: cannot make the stale leg's resync map durable: it will need a full resync");
            return None;
        }
        tracing::info!(leg, name, since_flush = count(&before) + count(&late),
            "mirror: the stale leg's resync map starts with the blocks written since the last flush");
        Some(map.count())
    }
}

impl Mirror {
    /// A mirror over `legs`; `membership` records state changes (faults).
    /// Every present leg must have the same size, and one must be active.
    pub fn new(
        legs: Vec<MirrorLeg>,
        membership: Option<Box<dyn Membership>>,
    ) -> Result<Arc<Mirror>> {
        // As the set on disk (`MirrorRecord`): a write's legs are a
        // `LegSet` and its outcomes an array of `MAX_LEGS` (`admit.rs`).
        if legs.len() > MAX_LEGS {
            return Err(Error::InvalidArgument(format!(
                "a mirror has at most {MAX_LEGS} legs, not {}",
                legs.len()
            )));
        }
        let present: Vec<&Arc<dyn SealedDevice>> =
            legs.iter().filter_map(|leg| leg.device.as_ref()).collect();
        let Some(first) = present.first() else {
            return Err(Error::InvalidArgument(
                "a mirror needs a present leg".into(),
            ));
        };
        let size = first.size();
        if let Some((leg, other)) = legs.iter().find_map(|leg| {
            let other = leg.device.as_ref()?.size();
            (other != size).then_some((leg, other))
        }) {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {} is {other} bytes, not {size} like the others (a `vouch resize` cut short between legs: run it again to give every leg the size)",
                leg.name
            )));
        }
        let read_only = present.iter().any(|device| device.is_read_only());
        let mirror = Arc::new_cyclic(|me| Mirror {
            legs: legs.into_iter().map(Leg::new).collect(),
            next: AtomicUsize::new(0),
            one_leg: AtomicBool::new(false),
            scrub_pending: AtomicBool::new(false),
            stripes: Stripes::new(),
            membership,
            faulting: Mutex::new(()),
            size: AtomicU64::new(size),
            read_only,
            foreground: AtomicU64::new(0),
            resyncs: Mutex::new(Vec::new()),
            stopping: AtomicBool::new(false),
            written: Written::new(size / BLOCK),
            activity: Swap::new(),
            reconcile: Mutex::new(None),
            reconciling: AtomicBool::new(false),
            unwaited: AtomicBool::new(false),
            me: me.clone(),
        });
        if mirror.active().is_empty() {
            return Err(Error::InvalidArgument(
                "a mirror needs an active leg".into(),
            ));
        }
        Ok(mirror)
    }

    /// Legs that are active and present, in order.
    pub fn active(&self) -> Vec<usize> {
        self.active_legs().collect()
    }

    fn active_legs(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.legs.len()).filter(|&leg| {
            self.legs[leg].device.get().is_some() && self.legs[leg].state() == LegState::Active
        })
    }

    pub(super) fn device(&self, leg: usize) -> &dyn SealedDevice {
        &**self.legs[leg]
            .device
            .get()
            .expect("only present legs are used")
    }

    /// Record `leg` active in memory (its resync finished).
    pub(super) fn set_leg_active(&self, leg: usize) -> Result<()> {
        let _decide = self.faulting.lock();
        self.legs[leg]
            .state
            .store(LegState::Active as u8, Ordering::Release);
        Ok(())
    }

    /// Legs that get writes: the active ones and those resyncing (in
    /// place: every mirrored write asks, and a mirror has at most
    /// `MAX_LEGS`).
    pub(super) fn write_targets(&self) -> SmallVec<[usize; MAX_LEGS]> {
        (0..self.legs.len())
            .filter(|&leg| self.is_write_target(leg))
            .collect()
    }

    pub(super) fn is_write_target(&self, leg: usize) -> bool {
        self.legs[leg].device.get().is_some()
            && (self.legs[leg].state() == LegState::Active
                || self.legs[leg].resyncing.load(Ordering::Acquire))
    }

    /// Mark blocks `[first, end)` in every stale leg's resync map before
    /// a write to them is issued (the caller holds their stripe lock).
    /// A map that cannot record the mark is dropped (its leg then has
    /// unknown history: a full resync); if it cannot even be removed the
    /// write fails, so no write escapes the map.
    pub(super) fn mark(&self, first: u64, end: u64) -> Result<()> {
        for (index, leg) in self.legs.iter().enumerate() {
            let map = leg.map.read().clone();
            let Some(map) = map else { continue };
            if let Err(error) = map.mark(first, end) {
                tracing::error!(leg = index, name = %leg.name, %error,
                    "mirror: cannot record a write in the resync map; dropping it (the leg will need a full resync)");
                map.remove()?;
                leg.resyncing.store(false, Ordering::Release);
                *leg.map.write() = None;
            }
        }
        Ok(())
    }

    /// Whether any leg has a resync map (writes must mark it first).
    pub(super) fn tracks_any_leg(&self) -> bool {
        self.legs.iter().any(|leg| leg.map.read().is_some())
    }

    /// Make every resync map's block bits durable (part of a flush).
    fn sync_maps(&self) -> Result<()> {
        for leg in &self.legs {
            let map = leg.map.read().clone();
            if let Some(map) = map {
                map.sync()?;
            }
        }
        Ok(())
    }

    /// Take out every active leg that cannot be reached now (a remote
    /// replica whose connection died: a request timed out, the replica
    /// was killed) as the next write to it would (stale, with a resync
    /// map), so no status shows a leg active on a dead connection while
    /// the volume is idle.
    pub fn take_out_unreachable(&self) {
        for leg in self.active() {
            if let Some(why) = self.device(leg).unreachable() {
                self.fail(
                    leg,
                    &format!("connection lost: {why}"),
                    &Error::Unreachable(why.clone()),
                );
            }
        }
    }

    /// Each leg's state and counters. A leg is present when its device is
    /// open and reachable (a remote leg's connection is alive); an active
    /// leg that is not is taken out first (`take_out_unreachable`).
    pub fn status(&self) -> Vec<LegStatus> {
        self.take_out_unreachable();
        let active = self.active();
        let reconciling = self.reconciling.load(Ordering::Acquire);
        self.legs
            .iter()
            .enumerate()
            .map(|(index, leg)| LegStatus {
                reconciling: reconciling
                    && active.contains(&index)
                    && active.first() != Some(&index),
                name: leg.name.clone(),
                state: leg.state(),
                present: leg
                    .device
                    .get()
                    .is_some_and(|device| device.unreachable().is_none()),
                attached: leg.device.get().is_some(),
                corrected: leg.corrected(),
                resyncing: leg.resyncing.load(Ordering::Acquire),
                dirty: leg.map.read().as_ref().map(|map| map.count()),
                resync: leg.progress.lock().clone(),
                repairs: leg.repair_counts(),
            })
            .collect()
    }

    /// After an unclean shutdown the legs may hold different (each valid)
    /// contents of blocks that were being written: round-robin reads could
    /// then return the new contents and later the old. Until a scrub makes
    /// the legs agree, every read goes to the first active leg (md reads
    /// one disk while it resyncs after a crash).
    /// The choice is recorded by the membership (a marker beside each
    /// leg's record), so a restart before the scrub keeps it.
    pub fn read_one_leg_until_scrubbed(&self) {
        self.scrub_pending.store(true, Ordering::Release);
        self.one_leg.store(true, Ordering::Release);
        if let Some(membership) = &self.membership {
            if let Err(error) = membership.set_unsynced(true) {
                tracing::error!(%error, "mirror: could not record that the legs may differ");
            }
        }
    }

    /// True while reads go to one leg only (see above).
    pub fn reads_one_leg(&self) -> bool {
        self.one_leg.load(Ordering::Acquire)
    }

    /// A scrub left every block agreeing on every leg: round robin again.
    pub(super) fn legs_agree(&self) {
        if let Some(membership) = &self.membership {
            if let Err(error) = membership.set_unsynced(false) {
                // Still marked: reads stay on one leg (safe), say why.
                tracing::error!(%error, "mirror: could not record that the legs agree");
                return;
            }
        }
        self.scrub_pending.store(false, Ordering::Release);
        self.one_leg.store(false, Ordering::Release);
    }

    /// Reads go to the first active leg while a reconciliation runs (in
    /// memory: the activity log names the extents again at a restart).
    pub(super) fn hold_reads_on_one_leg(&self) {
        self.one_leg.store(true, Ordering::Release);
    }

    /// The reconciliation settled every extent: round robin again, unless
    /// a whole scrub is still owed (`read_one_leg_until_scrubbed`).
    pub(super) fn release_reads_from_one_leg(&self) {
        if !self.scrub_pending.load(Ordering::Acquire) {
            self.one_leg.store(false, Ordering::Release);
        }
    }

    /// The legs reads go to, in order: the active local legs (the remote
    /// ones only when no local leg is active: a remote read costs a network
    /// round trip for the same verified bytes; DRBD's prefer-local, md's
    /// write-mostly legs), or just the first active leg while
    /// `reads_one_leg`. Remote copies are still checked by scrub, and a
    /// local read that fails verification is repaired from them.
    fn read_legs(&self) -> Vec<usize> {
        let mut active = self.active();
        if self.reads_one_leg() {
            active.truncate(1);
        } else if active.iter().any(|&leg| !self.legs[leg].remote) {
            active.retain(|&leg| !self.legs[leg].remote);
        }
        active
    }

    /// The leg to read next: round robin over `read_legs`.
    fn pick(&self) -> Result<usize> {
        let legs = self.read_legs();
        if legs.is_empty() {
            return Err(Error::FailStopped("no active mirror leg".into()));
        }
        Ok(legs[self.next.fetch_add(1, Ordering::Relaxed) % legs.len()])
    }

    /// The legs a read whose turn is `leg` tries, in order: `leg`, then
    /// every other active leg (the read's plan across legs; what a leg
    /// cannot answer is judged by `judge_read`, what it answers with
    /// faulty blocks is repaired, `repair.rs`).
    pub(super) fn read_order(&self, leg: usize) -> Vec<usize> {
        let mut order = vec![leg];
        order.extend(self.active().into_iter().filter(|&other| other != leg));
        order
    }

    /// The one judge of a leg's failed read (not of its faulty blocks,
    /// which the leg names and `repair.rs` repairs), for every read that
    /// goes from leg to leg: the request's own error ends the read (true:
    /// every leg would refuse it); any other is the leg's — logged,
    /// counted against it, a leg that cannot be reached taken out
    /// (`fail`) — and the read goes on to the next leg (false).
    pub(super) fn judge_read(&self, leg: usize, error: &Error, first: u64, count: u64) -> bool {
        if is_request_error(error) {
            return true;
        }
        tracing::warn!(
            leg,
            name = %self.legs[leg].name,
            first,
            count,
            %error,
            "mirror: leg failed a read; reading another leg"
        );
        self.count(leg, "io", false);
        if matches!(error, Error::Unreachable(_)) {
            self.fail(leg, &format!("read failed: {error}"), error);
        }
        false
    }

    fn mark_bytes(&self, offset: u64, length: u64) -> Result<()> {
        self.mark(offset / BLOCK, (offset + length).div_ceil(BLOCK))
    }

    /// Count a repair attempt on `leg` for an error the leg made on its
    /// own (a block that failed verification there, a write it lost); a
    /// corrected error past the threshold faults the leg.
    pub(super) fn count(&self, leg: usize, kind: &'static str, repaired: bool) {
        self.count_at(leg, kind, repaired, None);
    }

    /// `count` of a repair of block `lba`: the blocks of one lost metadata
    /// unit (`BlockDevice::metadata_unit`) are one corrected error.
    pub(super) fn count_at(
        &self,
        leg: usize,
        kind: &'static str,
        repaired: bool,
        lba: Option<u64>,
    ) {
        self.note_repair(leg, kind, repaired);
        if let Some(lba) = lba.filter(|_| repaired && kind == FaultKind::MetadataLost.name()) {
            let unit = self.device(leg).metadata_unit(lba).start + 1;
            if !self.legs[leg].first_repair_in_unit(unit) {
                return;
            }
        }
        if repaired {
            let corrected = self.legs[leg].add_corrected();
            if corrected > FAULT_THRESHOLD {
                self.fault(
                    leg,
                    &format!(
                        "{corrected} corrected errors (threshold {FAULT_THRESHOLD}, halving every {} s)",
                        CORRECTED_HALF_LIFE.as_secs()
                    ),
                );
            }
        }
    }

    /// Record a repair on `leg` in its counters by kind, without counting
    /// it against the leg: the legs differed because of what happened to
    /// the whole set (blocks written at an unclean shutdown), not because
    /// this leg got them wrong.
    pub(super) fn note_repair(&self, leg: usize, kind: &'static str, repaired: bool) {
        self.legs[leg].note_repair(kind, repaired);
    }

    /// Start `leg`'s corrected-error count afresh: it was rebuilt, or
    /// resynced in full (every block it holds was just copied and
    /// verified), so what it got wrong before is gone.
    pub(super) fn reset_corrected(&self, leg: usize) {
        self.legs[leg].reset_corrected();
    }

    /// Fault `leg` (no more I/O), unless it is the last active one.
    pub fn fault(&self, leg: usize, why: &str) {
        self.take_out(leg, why, LegState::Faulted);
    }

    /// Take `leg` out after `error`: a leg that could not be reached (a
    /// remote replica whose connection failed or timed out) is marked
    /// stale, since its copy is only behind, not bad; any other failure
    /// faults it.
    pub(super) fn fail(&self, leg: usize, why: &str, error: &Error) {
        let state = if matches!(error, Error::Unreachable(_)) {
            LegState::Stale
        } else {
            LegState::Faulted
        };
        self.take_out(leg, why, state);
    }

    /// Mark `leg` faulted or stale (no more I/O), unless it is the last
    /// active one.
    fn take_out(&self, leg: usize, why: &str, state: LegState) {
        let _decide = self.faulting.lock();
        let active = self.active();
        if !active.contains(&leg) {
            return;
        }
        let name = &self.legs[leg].name;
        if active.len() == 1 {
            tracing::error!(
                leg,
                name,
                why,
                "mirror: the last active leg is failing; keeping it"
            );
            return;
        }
        // Its map is durable before the records say it is stale.
        let mapped = (state == LegState::Stale)
            .then(|| self.map_stale_leg(leg))
            .flatten();
        self.legs[leg].state.store(state as u8, Ordering::Release);
        let shown = match state {
            LegState::Stale => "STALE (unreachable)",
            _ => "FAULTED",
        };
        let until = match mapped {
            Some(_) => "resynced (its resync map tracks what it misses)",
            None if state == LegState::Stale => "resynced in full (unknown history)",
            None => "replaced",
        };
        tracing::error!(
            leg,
            name,
            why,
            map_blocks = mapped,
            "mirror: leg {shown}: no more I/O to it until it is {until}"
        );
        if let Some(membership) = &self.membership {
            if let Err(error) = membership.set_state(leg, state) {
                tracing::error!(leg, name, %error, "mirror: cannot record the fault in the mirror records");
            }
        }
    }

    /// The mirror's generation clock: the highest of its active legs'
    /// (each leg's advances with its commits, so a later write of a block
    /// never gets a lower generation than an earlier one).
    pub fn generation_clock(&self) -> u64 {
        // Every write asks: no list of the legs made for it.
        self.active_legs()
            .map(|leg| self.device(leg).generation_clock())
            .max()
            .unwrap_or(0)
    }

    /// The blocks `[offset, offset + data.len())` covers, sealed once by the
    /// first active leg that can seal, with the mirror's generation; a
    /// partial block at either edge is read from a leg first (verified;
    /// the caller holds the stripe lock, so nothing changes it meanwhile).
    /// `None` when no leg can seal.
    pub(super) fn seal_write(&self, offset: u64, data: &Bytes) -> Result<Option<Vec<SealedBlock>>> {
        self.check_bytes(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(Some(Vec::new()));
        }
        let first = offset / BLOCK;
        let end = (offset + data.len() as u64).div_ceil(BLOCK);
        let aligned = offset.is_multiple_of(BLOCK) && (data.len() as u64).is_multiple_of(BLOCK);
        let blocks = if aligned {
            data.clone()
        } else {
            let mut buffer = vec![0u8; ((end - first) * BLOCK) as usize];
            for lba in [first, end - 1] {
                let at = ((lba - first) * BLOCK) as usize;
                self.read_edge(lba, &mut buffer[at..at + BLOCK as usize])?;
            }
            let skip = (offset - first * BLOCK) as usize;
            buffer[skip..skip + data.len()].copy_from_slice(data);
            Bytes::from(buffer)
        };
        let generation = self.generation_clock();
        for leg in self.active() {
            match self.device(leg).seal_blocks(first, &blocks, generation) {
                Ok(sealed) => return Ok(Some(sealed)),
                Err(Error::Unsupported(_)) => continue,
                Err(error) => return Err(error),
            }
        }
        Ok(None)
    }

    /// One block of a partial write, from the first active leg that reads
    /// it good (no repair here: the caller holds the stripe lock).
    fn read_edge(&self, lba: u64, block: &mut [u8]) -> Result<()> {
        let mut last = None;
        for leg in self.active() {
            match self.device(leg).read(lba * BLOCK, block) {
                Ok(_) => return Ok(()),
                Err(error) if is_request_error(&error) => return Err(error),
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| Error::FailStopped("no active mirror leg".into())))
    }

    /// Validate a byte range against the mirror: in bounds. Any byte
    /// offset and length is served (partial blocks: `seal_write`).
    fn check_bytes(&self, offset: u64, length: u64) -> Result<()> {
        let size = self.size.load(Ordering::Acquire);
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(Error::OutOfRange {
                offset,
                length,
                size,
            });
        }
        Ok(())
    }

    /// The whole 512-byte sectors of a trim or zeroing of `[offset,
    /// offset + length)`, after the bytes outside them (less than a sector
    /// at either end, from a client that negotiated no block size) are
    /// written as zeros through the mirror's own read-modify-write
    /// (`write_admitted`: sealed once, the same bytes and generation on
    /// every leg), since legs take trims and zeroes in sectors (a remote
    /// leg's wire does). The caller holds the stripes, the record and the
    /// marks of the whole range. `None` when no whole sector is left.
    fn zero_sector_edges(&self, offset: u64, length: u64, fua: bool) -> Result<Option<Range<u64>>> {
        const SECTOR: u64 = vouch_format::SECTOR_SIZE as u64;
        self.check_bytes(offset, length)?;
        let end = offset + length;
        let sectors = offset.next_multiple_of(SECTOR)..end / SECTOR * SECTOR;
        if sectors.start >= sectors.end {
            let zeros = Bytes::from(vec![0u8; length as usize]);
            return self.write_admitted(offset, &zeros, fua).map(|()| None);
        }
        for edge in [offset..sectors.start, sectors.end..end] {
            if !edge.is_empty() {
                let zeros = Bytes::from(vec![0u8; (edge.end - edge.start) as usize]);
                self.write_admitted(edge.start, &zeros, fua)?;
            }
        }
        Ok(Some(sectors))
    }

    /// Run `op` on every active leg. A leg that fails while another
    /// succeeds is faulted; if every leg fails, the first error is returned.
    /// A resyncing leg that fails stops resyncing (its map still covers
    /// the write: it was marked first) and stays stale.
    fn each_leg(&self, what: &str, op: impl Fn(&dyn SealedDevice) -> Result<()>) -> Result<()> {
        self.each_leg_of(&self.write_targets(), what, |_, device| op(device))
            .map(|_| ())
    }

    /// A leg that is not active failed a `what`: if it was resyncing, its
    /// resync stops (said once); a leg already taken out (by another leg
    /// of the same write, or an earlier failure) has nothing to stop.
    pub(super) fn stop_resync(&self, leg: usize, what: &str, error: &Error) {
        if self.legs[leg].resyncing.swap(false, Ordering::AcqRel) {
            tracing::error!(leg, name = %self.legs[leg].name, %error,
                "mirror: resyncing leg failed a {what}: resync stopped, leg stays stale");
        }
    }

    /// `each_leg` over `targets`, telling `op` each leg's index, in
    /// turn, then judged (`judge`); a request error stops the turn (the
    /// legs after it are not asked). Returns the resyncing legs on which
    /// `op` succeeded.
    fn each_leg_of(
        &self,
        targets: &[usize],
        what: &str,
        mut op: impl FnMut(usize, &dyn SealedDevice) -> Result<()>,
    ) -> Result<PerLeg<usize>> {
        let mut outcomes = PerLeg::new();
        for &leg in targets {
            let resyncing = self.legs[leg].state() != LegState::Active;
            let outcome = op(leg, self.device(leg));
            let request_error = matches!(&outcome, Err(error) if is_request_error(error));
            outcomes.push((leg, resyncing, outcome));
            if request_error {
                break;
            }
        }
        self.judge(what, outcomes)
    }

    /// How an operation's legs are judged, the one rule of every route
    /// (`each_leg_of` for flushes, trims and zeroings; a write's
    /// `Targets::settle`, `admit.rs`, on the thread that waits for it or,
    /// on the completion path, on the thread of the leg answering last).
    /// A write asks every target and every started write is waited for,
    /// so each leg's outcome comes here: no leg is judged apart. Each
    /// outcome names its leg and whether the leg was resyncing (not
    /// active) when the operation began. A request error (range,
    /// alignment) is the caller's: it is the outcome and no leg is blamed.
    /// A resyncing leg that failed stops its resync (it stays stale; its
    /// map was marked first). If no active leg succeeded, the first
    /// active leg's error is the outcome and nothing is taken out (no leg
    /// is known good); else each active leg that failed is taken out
    /// (faulted, or stale if unreachable). Returns the resyncing legs that
    /// succeeded.
    pub(super) fn judge(
        &self,
        what: &str,
        outcomes: impl IntoIterator<Item = (usize, bool, Result<()>)>,
    ) -> Result<PerLeg<usize>> {
        // One pass; only the failures (rare) are kept, in the legs' order,
        // to be judged once every outcome is in.
        let mut succeeded = 0;
        let mut resynced = PerLeg::new();
        let mut failures: PerLeg<(usize, bool, Error)> = PerLeg::new();
        for (leg, resyncing, outcome) in outcomes {
            match outcome {
                Ok(()) if resyncing => resynced.push(leg),
                Ok(()) => succeeded += 1,
                Err(error) => failures.push((leg, resyncing, error)),
            }
        }
        if let Some(at) = failures
            .iter()
            .position(|(_, _, error)| is_request_error(error))
        {
            return Err(failures.swap_remove(at).2);
        }
        let mut failed: PerLeg<(usize, Error)> = PerLeg::new();
        for (leg, resyncing, error) in failures {
            match resyncing {
                true => self.stop_resync(leg, what, &error),
                false => failed.push((leg, error)),
            }
        }
        if succeeded == 0 {
            return match failed.into_iter().next() {
                Some((_, error)) => Err(error),
                None => Err(Error::FailStopped("no active mirror leg".into())),
            };
        }
        for (leg, error) in failed {
            self.fail(leg, &format!("{what} failed: {error}"), &error);
        }
        Ok(resynced)
    }
}

impl BlockDevice for Mirror {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }
    fn is_read_only(&self) -> bool {
        self.read_only
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        self.foreground.fetch_add(1, Ordering::Relaxed);
        let leg = self.pick()?;
        // The leg's own read first (the fast path: it stops at a fault,
        // which it judged and counted); a request error ends it, anything
        // else goes to the repair route with the same order of legs, which
        // judges it. The fault it named is not read again on that leg.
        let judged = match self.device(leg).read(offset, buf) {
            Ok(holes) => return Ok(holes),
            Err(error) if is_request_error(&error) => return Err(error),
            Err(Error::Fault(fault)) => Some(fault),
            Err(_) => None,
        };
        self.read_bytes_repairing(leg, offset, buf, judged)
    }
    /// The leg `read` would pick next, without taking its turn unless it
    /// answers: when it declines (cold data, or a block that fails
    /// verification), the blocking `read` goes to that same leg and
    /// repairs what it finds.
    fn try_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<Vec<Range<u64>>>> {
        // Client I/O, inline or not: a resync runs at its floor meanwhile.
        self.foreground.fetch_add(1, Ordering::Relaxed);
        let legs = self.read_legs();
        if legs.is_empty() {
            return Ok(None);
        }
        let leg = legs[self.next.load(Ordering::Relaxed) % legs.len()];
        match self.device(leg).try_read(offset, buf) {
            Ok(Some(holes)) => {
                self.next.fetch_add(1, Ordering::Relaxed);
                Ok(Some(holes))
            }
            Ok(None) => Ok(None),
            Err(error) if is_request_error(&error) => Err(error),
            Err(_) => Ok(None),
        }
    }
    /// Crash ordering: each leg's write keeps the engine's own order
    /// (docs/CRASH_MODEL.md); between legs there is none. Power lost
    /// between leg 0's write and leg 1's leaves leg 0 with the new block and
    /// leg 1 with the old, each valid: the write was not acknowledged, so
    /// either is allowed, and the next open reads one leg until a scrub
    /// makes them agree (`read_one_leg_until_scrubbed`). With `fua` the
    /// write is acknowledged only after every active leg made it durable.
    /// The stripe lock is held across the legs' writes so a repair never
    /// moves a block between legs while they differ mid-write.
    /// A stale leg's resync map marks the blocks first (`mark`).
    ///
    /// The write is sealed once (`seal_write`) and every leg stores the same
    /// bytes and context, with one generation from the mirror's clock: so
    /// legs' generations are comparable and a scrub can tell a lost write
    /// from the newer copy. A remote leg's replica verifies the blocks
    /// before storing them (they crossed the wire); a local leg checks
    /// only each context's place (`SealedAdmission::Here`), since the guard
    /// was computed in this process from the same immutable bytes, as a
    /// single volume's write path does.
    ///
    /// A resyncing leg that took the sealed write holds the blocks as every
    /// active leg does: they *land* in its map (`DirtyMap::landed`, still
    /// under the stripe lock), to be cleared once a flush of that leg
    /// issued after this returned has returned (`resync.rs`).
    ///
    /// Every route of a mirrored write is admitted and run by the same
    /// code (`admit.rs`), differing only in whether it may wait:
    ///
    /// - `MayWait` (the worker's): any bytes, FUA; it waits for what it
    ///   needs and is never declined.
    /// - `MustNotWait` (the NBD reactor's inline path, like a volume's):
    ///   whole blocks only, no FUA, no larger than every write target seals
    ///   cheaply (`inline_seal_max_bytes`: encrypted legs take up to 128
    ///   KiB), when no stripe of the range is held and every target
    ///   reserves room in its write-back buffer (`reserve_room`); then
    ///   sealed once and buffered on every leg into that room
    ///   (`admit::Admission::Reserved`). Declined, with nothing written
    ///   and every reservation given back, when any of that fails first;
    ///   once every leg holds room, no leg can find its buffer full at its
    ///   turn, so none commits on the caller's thread.
    /// - `Callback` (the completion path, only for a mirror with remote
    ///   legs): started, and completed on the thread of the leg that
    ///   answers last (`complete.rs`).
    fn submit_write(
        &self,
        offset: u64,
        data: &Bytes,
        fua: bool,
        admission: vouch_engine::Admission,
    ) -> Result<Submitted> {
        use vouch_engine::Admission;
        match admission {
            Admission::MayWait => {
                self.write_waiting(offset, data, fua)?;
                Ok(Submitted::Done)
            }
            _ if fua => Ok(Submitted::Declined),
            Admission::MustNotWait => Ok(if self.write_reserved(offset, data)? {
                Submitted::Done
            } else {
                Submitted::Declined
            }),
            Admission::Callback => match self.me.upgrade() {
                Some(me) => Ok(me
                    .begin_write(offset, data)?
                    .map_or(Submitted::Declined, Submitted::Started)),
                None => Ok(Submitted::Declined),
            },
        }
    }

    /// The landing area of the first local leg written: it stores the
    /// sealed blocks as they lie in the payload, so its held log names
    /// them instead of copying them (the other legs copy as before).
    fn landing_buffer(&self, len: usize) -> Option<vouch_engine::LandingBuffer> {
        let leg = self
            .write_targets()
            .into_iter()
            .find(|&leg| !self.legs[leg].remote)?;
        self.device(leg).landing_buffer(len)
    }

    /// The resync maps' block bits are made durable first (one sync).
    /// On success the blocks written before it started are forgotten by
    /// the record of what a lost leg may lack (`written.rs`).
    /// Its success lets the activity log forget extents whose writes all
    /// returned before it began (`ActivityLog::flush_begins`).
    fn flush(&self) -> Result<()> {
        self.foreground.fetch_add(1, Ordering::Relaxed);
        self.sync_maps()?;
        let ticket = self.written.flush_started();
        // Its success goes to the log it began on (an online resize may
        // put a new one in place meanwhile, whose numbers start again).
        let log = self.activity.get();
        let number = log.map(|log| log.flush_begins());
        self.each_leg("flush", |leg| leg.flush())?;
        self.written.flush_succeeded(ticket);
        if let (Some(log), Some(number)) = (log, number) {
            log.flush_succeeded(number);
        }
        Ok(())
    }
    /// In pieces of at most half the activity log's extents, each entered
    /// in the log before its legs are trimmed (a whole-volume trim would
    /// not fit in it at once).
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.foreground.fetch_add(1, Ordering::Relaxed);
        let _locked = self.stripes.lock_bytes(offset, length);
        let _recorded = self.record_bytes(offset, length);
        self.mark_bytes(offset, length)?;
        self.check_bytes(offset, length)?;
        for piece in self.log_pieces(offset, length) {
            let _logged = self.enter_log_bytes(piece.start, piece.end - piece.start)?;
            let (offset, length) = (piece.start, piece.end - piece.start);
            let Some(sectors) = self.zero_sector_edges(offset, length, fua)? else {
                continue;
            };
            let (offset, length) = (sectors.start, sectors.end - sectors.start);
            self.each_leg("trim", |leg| leg.trim(offset, length, fua))?;
        }
        Ok(())
    }
    /// In pieces, as `trim`.
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()> {
        self.foreground.fetch_add(1, Ordering::Relaxed);
        let _locked = self.stripes.lock_bytes(offset, length);
        let _recorded = self.record_bytes(offset, length);
        self.mark_bytes(offset, length)?;
        self.check_bytes(offset, length)?;
        for piece in self.log_pieces(offset, length) {
            let _logged = self.enter_log_bytes(piece.start, piece.end - piece.start)?;
            let (offset, length) = (piece.start, piece.end - piece.start);
            let Some(sectors) = self.zero_sector_edges(offset, length, flags.fua)? else {
                continue;
            };
            let (offset, length) = (sectors.start, sectors.end - sectors.start);
            self.each_leg("write zeroes", |leg| {
                leg.write_zeroes(offset, length, flags)
            })?;
        }
        Ok(())
    }
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>> {
        self.device(self.pick()?)
            .block_status(offset, length, max_blocks)
    }
    /// Faulty blocks are repaired from another leg; only blocks bad on
    /// every leg are listed (zero-filled).
    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        let leg = self.pick()?;
        self.read_blocks_repairing(leg, first, count, out, None)
    }
    /// The unit covering every present leg's unit at `lba`. The legs of a
    /// set share leg 0's superblock (`set.rs`: one layout and geometry), so
    /// their local units agree; a remote leg cannot tell (one block), and
    /// the cover keeps the local legs' unit. Scans step on this grid
    /// (`jobs::scan`, the mirror's scrub), so each leg's packed row is read
    /// once per scan.
    fn metadata_unit(&self, lba: u64) -> Range<u64> {
        let mut cover = lba..lba + 1;
        for leg in 0..self.legs.len() {
            if let Some(device) = self.legs[leg].device.get() {
                let unit = device.metadata_unit(lba);
                cover = cover.start.min(unit.start)..cover.end.max(unit.end);
            }
        }
        cover
    }
    /// The first LBA at or after `lba` that may hold data on any leg.
    fn next_possible_data(&self, lba: u64) -> Result<u64> {
        let mut next = u64::MAX;
        for leg in self.active() {
            next = next.min(self.device(leg).next_possible_data(lba)?);
        }
        Ok(next.max(lba))
    }
}

/// A mirror's own sealed face: blocks read from the first active leg
/// that has them, stored on every active leg under the mirror's rules.
impl SealedDevice for Mirror {
    /// From the first active leg that answers; a leg that fails is
    /// judged as on every read (`judge_read`).
    fn read_sealed(&self, first: u64, count: u64) -> Result<Vec<SealedBlock>> {
        let Some(&leg) = self.active().first() else {
            return Err(Error::FailStopped("no active mirror leg".into()));
        };
        let mut last = None;
        for leg in self.read_order(leg) {
            match self.device(leg).read_sealed(first, count) {
                Ok(blocks) => return Ok(blocks),
                Err(error) if self.judge_read(leg, &error, first, count) => return Err(error),
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| Error::FailStopped("no active mirror leg".into())))
    }
    /// The waiting admissions only, passed on to every write target
    /// under the mirror's stripes, log, record and marks; the others are
    /// declined (a mirror reserves no room of its own and answers no
    /// sealed write by callback).
    fn submit_sealed(
        &self,
        blocks: &[SealedBlock],
        fua: bool,
        admission: SealedAdmission,
    ) -> Result<Submitted> {
        match admission {
            SealedAdmission::MayWait | SealedAdmission::Here => {}
            SealedAdmission::Reserved => {
                return Err(Error::Unsupported("writes into reserved room".into()))
            }
            SealedAdmission::MustNotWait | SealedAdmission::Callback => {
                return Ok(Submitted::Declined)
            }
        }
        let first = blocks.iter().map(|b| b.lba).min().unwrap_or(0);
        let end = blocks.iter().map(|b| b.lba + 1).max().unwrap_or(0);
        let _locked = self.stripes.lock(first, end);
        let _logged = self.enter_log(first, end)?;
        let _recorded = self.written.record(first, end);
        for block in blocks {
            self.mark(block.lba, block.lba + 1)?;
        }
        self.each_leg("write", |leg| {
            leg.submit_sealed(blocks, fua, admission)
                .and_then(Submitted::wait)
        })?;
        Ok(Submitted::Done)
    }
}
