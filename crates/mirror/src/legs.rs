//! The legs of a mirror: the one handed to `Mirror::new`, the one the
//! mirror keeps (its device, state, resync map and counters), the
//! corrected-error count the fault threshold judges, what its status
//! shows, and `Legs`, the type that owns them all and the rules over
//! them: membership (active, stale, faulted, resyncing; recorded through
//! `Membership`), how an outcome is judged (the request's error, or the
//! leg's: `judge`, `judge_read`), the fault threshold (`count_at`),
//! taking a leg out (a stale one mapped from the written log first),
//! which leg a read goes to, and the legs' common size.
//!
//! The methods that may take a leg out (`judge`, `judge_read`, `count_at`,
//! `fault`, `fail`) borrow the written log: a leg taken out as stale gets
//! its resync map from the blocks written since the last flush, made
//! durable under the decision lock before its state says stale, so the
//! log is read at that one moment (`map_stale_leg`) and owned elsewhere.
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};
use smallvec::SmallVec;
use vouch_format::mirror::{LegState, MAX_LEGS};

use crate::dirty::DirtyMap;
use crate::progress::ResyncProgress;
use crate::remote::is_remote_member;
use crate::written::{count, minus};
use crate::written_log::WrittenLog;
use crate::{Membership, CORRECTED_HALF_LIFE, FAULT_THRESHOLD};
use vouch_engine::device::{SealedBlock, SealedDevice};
use vouch_engine::error::{Error, FaultKind, Result};
use vouch_engine::BLOCK;

/// One item per leg, in place: a mirror has at most `MAX_LEGS`, and the
/// reactor starts every 4 KiB write through lists of them, so a heap
/// allocation per list per write was a measurable share of the
/// exporter's CPU.
pub(crate) type PerLeg<T> = SmallVec<[T; MAX_LEGS]>;

/// A set of a mirror's legs by number, in one byte: a write's targets,
/// those resyncing and those holding reserved room. Copied, never
/// allocated, and iterated in the legs' order (the order they are written
/// and judged in): every mirrored write carries a few, and lists per leg
/// built, moved and dropped per 4 KiB write cost the inline route ~5 % of
/// its instructions (docs/ARCHITECTURE.md, "Routes").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LegSet(u8);

const _: () = assert!(MAX_LEGS <= 8, "a LegSet holds up to 8 legs");

impl LegSet {
    /// `leg` < `MAX_LEGS`: `Mirror::new` refuses more legs.
    pub(crate) fn insert(&mut self, leg: usize) {
        debug_assert!(
            leg < MAX_LEGS,
            "leg {leg} of a mirror of at most {MAX_LEGS}"
        );
        self.0 |= 1 << leg;
    }
    pub(crate) fn remove(&mut self, leg: usize) {
        debug_assert!(
            leg < MAX_LEGS,
            "leg {leg} of a mirror of at most {MAX_LEGS}"
        );
        self.0 &= !(1 << leg);
    }
    pub(crate) fn contains(self, leg: usize) -> bool {
        debug_assert!(
            leg < MAX_LEGS,
            "leg {leg} of a mirror of at most {MAX_LEGS}"
        );
        self.0 & (1 << leg) != 0
    }
    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }
    pub(crate) fn len(self) -> usize {
        self.0.count_ones() as usize
    }
    /// Its legs, lowest number first.
    pub(crate) fn iter(self) -> impl Iterator<Item = usize> {
        let mut bits = self.0;
        std::iter::from_fn(move || {
            let leg = (bits != 0).then(|| bits.trailing_zeros() as usize)?;
            bits &= bits - 1;
            Some(leg)
        })
    }
}

/// One leg handed to `Mirror::new`.
pub struct MirrorLeg {
    /// How logs, metrics and status name it (its path or address).
    pub name: String,
    /// `None` when the leg is missing.
    pub device: Option<Arc<dyn SealedDevice>>,
    pub state: LegState,
}

/// A leg as the mirror keeps it: its counters are its own (the methods
/// below), its state and map the mirror changes under its rules.
pub(crate) struct Leg {
    pub(crate) name: String,
    /// A remote replica (`vouch://`): read only when no local leg is active.
    pub(crate) remote: bool,
    /// Set once: at `Mirror::new`, or when a missing leg is attached.
    pub(crate) device: OnceLock<Arc<dyn SealedDevice>>,
    pub(crate) state: AtomicU8,
    /// The resync map while the leg is stale or resyncing.
    pub(crate) map: RwLock<Option<Arc<DirtyMap>>>,
    /// Written to (not read) while its map is copied (`resync.rs`).
    pub(crate) resyncing: AtomicBool,
    pub(crate) progress: Mutex<Option<ResyncProgress>>,
    corrected: Mutex<Corrected>,
    /// 1 + the first LBA of the last lost metadata unit repaired (0:
    /// none): a unit lost is one failure of the leg, counted once towards
    /// the fault threshold however many of its blocks are repaired.
    last_lost_unit: AtomicU64,
    /// Repairs by (fault kind, repaired?).
    repairs: Mutex<BTreeMap<(&'static str, bool), u64>>,
}

impl Leg {
    pub(crate) fn new(leg: MirrorLeg) -> Leg {
        Leg {
            remote: is_remote_member(&leg.name),
            name: leg.name,
            device: leg.device.map(OnceLock::from).unwrap_or_default(),
            state: AtomicU8::new(leg.state as u8),
            map: RwLock::new(None),
            resyncing: AtomicBool::new(false),
            progress: Mutex::new(None),
            corrected: Mutex::new(Corrected::new()),
            last_lost_unit: AtomicU64::new(0),
            repairs: Mutex::new(BTreeMap::new()),
        }
    }

    pub(crate) fn state(&self) -> LegState {
        state_from(self.state.load(Ordering::Acquire))
    }

    /// Record a repair in the counters by kind (not a corrected error).
    pub(crate) fn note_repair(&self, kind: &'static str, repaired: bool) {
        *self.repairs.lock().entry((kind, repaired)).or_insert(0) += 1;
    }

    /// Whether a repair in the metadata unit starting at `unit - 1` is
    /// the first of that unit (the unit is then one corrected error).
    pub(crate) fn first_repair_in_unit(&self, unit: u64) -> bool {
        self.last_lost_unit.swap(unit, Ordering::Relaxed) != unit
    }

    /// Count one corrected error; returns the (decayed) count.
    pub(crate) fn add_corrected(&self) -> u64 {
        self.corrected.lock().add_one()
    }

    /// The corrected-error count now (decayed).
    pub(crate) fn corrected(&self) -> u64 {
        self.corrected.lock().now()
    }

    pub(crate) fn reset_corrected(&self) {
        self.corrected.lock().reset();
    }

    /// The repairs by kind, for its status.
    pub(crate) fn repair_counts(&self) -> Vec<RepairCount> {
        self.repairs
            .lock()
            .iter()
            .map(|(&(kind, repaired), &count)| RepairCount {
                kind,
                repaired,
                count,
            })
            .collect()
    }
}

/// A leg's corrected errors, the count the fault threshold judges: it
/// halves every `CORRECTED_HALF_LIFE` (md halves its corrected read
/// errors every hour, `check_decay_read_errors`), so a leg faults on a
/// burst of its own errors, not on a few spread over its life.
pub(crate) struct Corrected {
    count: u64,
    /// When the count last halved (or started).
    since: std::time::Instant,
}

impl Corrected {
    fn new() -> Corrected {
        Corrected {
            count: 0,
            since: std::time::Instant::now(),
        }
    }

    /// The count now, halved once per half-life passed since `since`.
    fn now(&mut self) -> u64 {
        let (count, halvings) = decayed(self.count, self.since.elapsed());
        self.count = count;
        self.since += CORRECTED_HALF_LIFE * halvings;
        self.count
    }

    fn add_one(&mut self) -> u64 {
        self.now();
        self.count += 1;
        self.count
    }

    fn reset(&mut self) {
        *self = Corrected::new();
    }
}

/// `count` after `elapsed`: halved once per whole `CORRECTED_HALF_LIFE`;
/// also the number of halvings (how far the start moves).
pub(crate) fn decayed(count: u64, elapsed: std::time::Duration) -> (u64, u32) {
    let halvings = (elapsed.as_secs() / CORRECTED_HALF_LIFE.as_secs()).min(u64::from(u32::MAX));
    let halvings = halvings as u32;
    (count.checked_shr(halvings).unwrap_or(0), halvings)
}

/// Repairs of one kind on one leg.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepairCount {
    /// A `FaultKind` name, `stale` (verified but older than another leg's
    /// copy) or `io` (the leg failed the read).
    pub kind: &'static str,
    pub repaired: bool,
    pub count: u64,
}

/// What `vouch mirror status` and the metrics show of a leg.
#[derive(Clone, Debug)]
pub struct LegStatus {
    pub name: String,
    pub state: LegState,
    /// Open and reachable (a remote leg's connection alive).
    pub present: bool,
    /// Open: its device is attached (reachable or not).
    pub attached: bool,
    /// Errors corrected on this leg (what the fault threshold counts).
    pub corrected: u64,
    pub repairs: Vec<RepairCount>,
    /// Written to but not read yet: its resync is running.
    pub resyncing: bool,
    /// Active, but not read while the reconciliation after an unclean
    /// stop runs: it may differ from the leg reads go to in the extents
    /// the activity log named.
    pub reconciling: bool,
    /// Blocks its resync map marks (`None`: no map).
    pub dirty: Option<u64>,
    /// The last (or running) resync's progress.
    pub resync: Option<ResyncProgress>,
}

impl LegStatus {
    /// `resyncing`, `reconciling`, or the recorded state's name.
    pub fn state_name(&self) -> &'static str {
        if self.resyncing {
            "resyncing"
        } else if self.reconciling {
            "reconciling"
        } else {
            self.state.name()
        }
    }
}

/// The legs of a mirror and the rules that judge them: membership (which
/// leg is active, stale, faulted, resyncing; recorded through
/// `Membership`), judging a leg's failure and its corrected errors
/// against the fault threshold, taking a leg out (one decision at a
/// time), the resync maps of stale legs, which leg a read goes to, and
/// the legs' common size. Indexes as the slice of its `Leg`s.
pub(crate) struct Legs {
    legs: Vec<Leg>,
    membership: Option<Box<dyn Membership>>,
    /// Serialises decisions to fault a leg (never the last active one).
    faulting: Mutex<()>,
    /// Bytes; changed only by an online resize (`resize.rs`).
    size: AtomicU64,
    /// The read turn of round robin (`pick`).
    next: AtomicUsize,
    /// Reads go to the first active leg only (`read_one_leg_until_scrubbed`,
    /// or while a reconciliation runs).
    one_leg: AtomicBool,
    /// Reads stay on one leg until a whole scrub (the legs may differ
    /// anywhere), whatever a reconciliation settles.
    scrub_pending: AtomicBool,
}

impl std::ops::Deref for Legs {
    type Target = [Leg];
    fn deref(&self) -> &[Leg] {
        &self.legs
    }
}

impl Legs {
    /// The legs of a new mirror: at most `MAX_LEGS`, every present leg of
    /// the same size, one active.
    pub(crate) fn new(
        legs: Vec<MirrorLeg>,
        membership: Option<Box<dyn Membership>>,
    ) -> Result<Legs> {
        // As the set on disk (`MirrorRecord`): a write's legs are a
        // `LegSet` and its outcomes an array of `MAX_LEGS` (`admit.rs`).
        if legs.len() > MAX_LEGS {
            return Err(Error::InvalidArgument(format!(
                "a mirror has at most {MAX_LEGS} legs, not {}",
                legs.len()
            )));
        }
        let Some(first) = legs.iter().find_map(|leg| leg.device.as_ref()) else {
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
        let legs = Legs {
            legs: legs.into_iter().map(Leg::new).collect(),
            membership,
            faulting: Mutex::new(()),
            size: AtomicU64::new(size),
            next: AtomicUsize::new(0),
            one_leg: AtomicBool::new(false),
            scrub_pending: AtomicBool::new(false),
        };
        if legs.active().is_empty() {
            return Err(Error::InvalidArgument(
                "a mirror needs an active leg".into(),
            ));
        }
        Ok(legs)
    }

    /// The legs' (and the mirror's) size in bytes.
    pub(crate) fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Every leg is `bytes` long now (an online resize).
    pub(crate) fn set_size(&self, bytes: u64) {
        self.size.store(bytes, Ordering::Release);
    }

    /// Leg `leg`, or an error naming the legs there are.
    pub(crate) fn slot(&self, leg: usize) -> Result<&Leg> {
        self.legs.get(leg).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the mirror has no leg {leg} (legs 0..{})",
                self.legs.len()
            ))
        })
    }

    /// Legs that are active and present, in order.
    pub(crate) fn active(&self) -> Vec<usize> {
        self.active_legs().collect()
    }

    pub(crate) fn active_legs(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.legs.len()).filter(|&leg| {
            self.legs[leg].device.get().is_some() && self.legs[leg].state() == LegState::Active
        })
    }

    pub(crate) fn device(&self, leg: usize) -> &dyn SealedDevice {
        &**self.legs[leg]
            .device
            .get()
            .expect("only present legs are used")
    }

    /// Record `leg` active in memory (its resync finished).
    pub(crate) fn set_active(&self, leg: usize) {
        let _decide = self.faulting.lock();
        self.legs[leg]
            .state
            .store(LegState::Active as u8, Ordering::Release);
    }

    /// Record `leg` active in the records (its resync finished), if the
    /// mirror keeps records.
    pub(crate) fn record_active(&self, leg: usize) -> Result<()> {
        match &self.membership {
            Some(membership) => membership.set_state(leg, LegState::Active),
            None => Ok(()),
        }
    }

    /// Legs that get writes: the active ones and those resyncing (in
    /// place: every mirrored write asks, and a mirror has at most
    /// `MAX_LEGS`).
    pub(crate) fn write_targets(&self) -> PerLeg<usize> {
        (0..self.legs.len())
            .filter(|&leg| self.is_write_target(leg))
            .collect()
    }

    pub(crate) fn is_write_target(&self, leg: usize) -> bool {
        self.legs[leg].device.get().is_some()
            && (self.legs[leg].state() == LegState::Active
                || self.legs[leg].resyncing.load(Ordering::Acquire))
    }

    /// The resync map of `leg`, if it has one.
    pub(crate) fn map_of(&self, leg: usize) -> Option<Arc<DirtyMap>> {
        self.legs.get(leg).and_then(|slot| slot.map.read().clone())
    }

    /// Mark blocks `[first, end)` in every stale leg's resync map before
    /// a write to them is issued (the caller holds their stripe lock).
    /// A map that cannot record the mark is dropped (its leg then has
    /// unknown history: a full resync); if it cannot even be removed the
    /// write fails, so no write escapes the map.
    pub(crate) fn mark(&self, first: u64, end: u64) -> Result<()> {
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
    pub(crate) fn tracks_any_leg(&self) -> bool {
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

    /// Make every map durable with no region marked (a clean close).
    pub(crate) fn retire_maps(&self) -> Result<()> {
        for leg in &self.legs {
            let map = leg.map.read().clone();
            if let Some(map) = map {
                map.sync_and_retire()?;
            }
        }
        Ok(())
    }

    /// Flush every write target: the resync maps' block bits are made
    /// durable first (one sync), then the legs flushed under the written
    /// log's rule (`WrittenLog::flush`), each judged (`judge`).
    pub(crate) fn flush(&self, written: &WrittenLog) -> Result<()> {
        self.sync_maps()?;
        written.flush(|| self.each_leg("flush", written, |leg| leg.flush()))
    }

    /// Give `leg`, which is being taken out as stale (the caller decides,
    /// and records the state only after this returns), a resync map that
    /// is durable on return: the blocks written since the last flush
    /// (`written`), then every write (`mark`). Returns the blocks it
    /// marks, or `None` (logged why) when it cannot be made durable: the
    /// leg then has unknown history, and no map of it is left behind.
    fn map_stale_leg(&self, leg: usize, written: &WrittenLog) -> Option<u64> {
        let name = &self.legs[leg].name;
        let membership = self.membership.as_ref()?;
        let blocks = self.size() / BLOCK;
        // Writes recorded from here on and not in `before` are marked
        // below, once the map is in place for the writes after them.
        let before = written.runs();
        let map = match membership.create_map(leg, blocks, &before) {
            Ok(map) => Arc::new(map),
            Err(error) => {
                tracing::error!(leg, name, %error,
                    "mirror: cannot create the stale leg's resync map: it will need a full resync");
                return None;
            }
        };
        *self.legs[leg].map.write() = Some(Arc::clone(&map));
        let late = minus(&written.runs(), &before);
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

    /// Take out every active leg that cannot be reached now (a remote
    /// replica whose connection died: a request timed out, the replica
    /// was killed) as the next write to it would (stale, with a resync
    /// map), so no status shows a leg active on a dead connection while
    /// the volume is idle.
    pub(crate) fn take_out_unreachable(&self, written: &WrittenLog) {
        for leg in self.active() {
            if let Some(why) = self.device(leg).unreachable() {
                self.fail(
                    leg,
                    &format!("connection lost: {why}"),
                    &Error::Unreachable(why.clone()),
                    written,
                );
            }
        }
    }

    /// Each leg's state and counters (`reconciling`: a reconciliation
    /// runs, and the active legs reads do not go to show it). A leg is
    /// present when its device is open and reachable.
    pub(crate) fn status(&self, reconciling: bool) -> Vec<LegStatus> {
        let active = self.active();
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

    /// Reads go to the first active leg until a scrub makes the legs
    /// agree (`Mirror::read_one_leg_until_scrubbed`), recorded by the
    /// membership so a restart keeps it.
    pub(crate) fn read_one_leg_until_scrubbed(&self) {
        self.scrub_pending.store(true, Ordering::Release);
        self.one_leg.store(true, Ordering::Release);
        if let Some(membership) = &self.membership {
            if let Err(error) = membership.set_unsynced(true) {
                tracing::error!(%error, "mirror: could not record that the legs may differ");
            }
        }
    }

    /// True while reads go to one leg only (see above).
    pub(crate) fn reads_one_leg(&self) -> bool {
        self.one_leg.load(Ordering::Acquire)
    }

    /// A scrub left every block agreeing on every leg: round robin again.
    pub(crate) fn legs_agree(&self) {
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
    pub(crate) fn hold_reads_on_one_leg(&self) {
        self.one_leg.store(true, Ordering::Release);
    }

    /// The reconciliation settled every extent: round robin again, unless
    /// a whole scrub is still owed (`read_one_leg_until_scrubbed`).
    pub(crate) fn release_reads_from_one_leg(&self) {
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
    pub(crate) fn pick(&self) -> Result<usize> {
        let legs = self.read_legs();
        if legs.is_empty() {
            return Err(Error::FailStopped("no active mirror leg".into()));
        }
        Ok(legs[self.next.fetch_add(1, Ordering::Relaxed) % legs.len()])
    }

    /// The leg `pick` would return, without taking its turn (`None`: no
    /// leg to read); `take_turn` takes it once that leg answered.
    pub(crate) fn peek(&self) -> Option<usize> {
        let legs = self.read_legs();
        if legs.is_empty() {
            return None;
        }
        Some(legs[self.next.load(Ordering::Relaxed) % legs.len()])
    }

    /// The turn `peek` looked at was taken.
    pub(crate) fn take_turn(&self) {
        self.next.fetch_add(1, Ordering::Relaxed);
    }

    /// The legs a read whose turn is `leg` tries, in order: `leg`, then
    /// every other active leg (the read's plan across legs; what a leg
    /// cannot answer is judged by `judge_read`, what it answers with
    /// faulty blocks is repaired, `repair.rs`).
    pub(crate) fn read_order(&self, leg: usize) -> Vec<usize> {
        let mut order = vec![leg];
        order.extend(self.active().into_iter().filter(|&other| other != leg));
        order
    }

    /// Read `lbas` sealed from `source`, in runs of consecutive LBAs.
    pub(crate) fn read_runs(&self, source: usize, lbas: &[u64]) -> Result<Vec<SealedBlock>> {
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

    /// The one judge of a leg's failed read (not of its faulty blocks,
    /// which the leg names and `repair.rs` repairs), for every read that
    /// goes from leg to leg: the request's own error ends the read (true:
    /// every leg would refuse it); any other is the leg's — logged,
    /// counted against it, a leg that cannot be reached taken out
    /// (`fail`) — and the read goes on to the next leg (false).
    pub(crate) fn judge_read(
        &self,
        leg: usize,
        error: &Error,
        first: u64,
        count: u64,
        written: &WrittenLog,
    ) -> bool {
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
        self.count(leg, "io", false, written);
        if matches!(error, Error::Unreachable(_)) {
            self.fail(leg, &format!("read failed: {error}"), error, written);
        }
        false
    }

    /// Count a repair attempt on `leg` for an error the leg made on its
    /// own (a block that failed verification there, a write it lost); a
    /// corrected error past the threshold faults the leg.
    pub(crate) fn count(
        &self,
        leg: usize,
        kind: &'static str,
        repaired: bool,
        written: &WrittenLog,
    ) {
        self.count_at(leg, kind, repaired, None, written);
    }

    /// `count` of a repair of block `lba`: the blocks of one lost metadata
    /// unit (`BlockDevice::metadata_unit`) are one corrected error.
    pub(crate) fn count_at(
        &self,
        leg: usize,
        kind: &'static str,
        repaired: bool,
        lba: Option<u64>,
        written: &WrittenLog,
    ) {
        self.legs[leg].note_repair(kind, repaired);
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
                    written,
                );
            }
        }
    }

    /// Fault `leg` (no more I/O), unless it is the last active one.
    pub(crate) fn fault(&self, leg: usize, why: &str, written: &WrittenLog) {
        self.take_out(leg, why, LegState::Faulted, written);
    }

    /// Take `leg` out after `error`: a leg that could not be reached (a
    /// remote replica whose connection failed or timed out) is marked
    /// stale, since its copy is only behind, not bad; any other failure
    /// faults it.
    pub(crate) fn fail(&self, leg: usize, why: &str, error: &Error, written: &WrittenLog) {
        let state = if matches!(error, Error::Unreachable(_)) {
            LegState::Stale
        } else {
            LegState::Faulted
        };
        self.take_out(leg, why, state, written);
    }

    /// Mark `leg` faulted or stale (no more I/O), unless it is the last
    /// active one; a stale leg gets its resync map from `written` first.
    fn take_out(&self, leg: usize, why: &str, state: LegState, written: &WrittenLog) {
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
            .then(|| self.map_stale_leg(leg, written))
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
    pub(crate) fn generation_clock(&self) -> u64 {
        // Every write asks: no list of the legs made for it.
        self.active_legs()
            .map(|leg| self.device(leg).generation_clock())
            .max()
            .unwrap_or(0)
    }

    /// Run `op` on every write target. A leg that fails while another
    /// succeeds is faulted; if every leg fails, the first error is returned.
    /// A resyncing leg that fails stops resyncing (its map still covers
    /// the write: it was marked first) and stays stale.
    pub(crate) fn each_leg(
        &self,
        what: &str,
        written: &WrittenLog,
        op: impl Fn(&dyn SealedDevice) -> Result<()>,
    ) -> Result<()> {
        self.each_leg_of(&self.write_targets(), what, written, |_, device| op(device))
            .map(|_| ())
    }

    /// A leg that is not active failed a `what`: if it was resyncing, its
    /// resync stops (said once); a leg already taken out (by another leg
    /// of the same write, or an earlier failure) has nothing to stop.
    pub(crate) fn stop_resync(&self, leg: usize, what: &str, error: &Error) {
        if self.legs[leg].resyncing.swap(false, Ordering::AcqRel) {
            tracing::error!(leg, name = %self.legs[leg].name, %error,
                "mirror: resyncing leg failed a {what}: resync stopped, leg stays stale");
        }
    }

    /// `each_leg` over `targets`, telling `op` each leg's index, in
    /// turn, then judged (`judge`); a request error stops the turn (the
    /// legs after it are not asked). Returns the resyncing legs on which
    /// `op` succeeded.
    pub(crate) fn each_leg_of(
        &self,
        targets: &[usize],
        what: &str,
        written: &WrittenLog,
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
        self.judge(what, outcomes, written)
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
    /// (faulted, or stale if unreachable, its map from `written`).
    /// Returns the resyncing legs that succeeded.
    pub(crate) fn judge(
        &self,
        what: &str,
        outcomes: impl IntoIterator<Item = (usize, bool, Result<()>)>,
        written: &WrittenLog,
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
            self.fail(leg, &format!("{what} failed: {error}"), &error, written);
        }
        Ok(resynced)
    }
}

/// Errors about the request, not the leg: every leg would give the same.
pub(crate) fn is_request_error(error: &Error) -> bool {
    matches!(
        error,
        Error::OutOfRange { .. }
            | Error::Misaligned { .. }
            | Error::ReadOnly(_)
            | Error::InvalidArgument(_)
            | Error::Unsupported(_)
    )
}

fn state_from(byte: u8) -> LegState {
    match byte {
        0 => LegState::Active,
        1 => LegState::Faulted,
        _ => LegState::Stale,
    }
}

#[cfg(test)]
mod tests {
    use super::LegSet;

    /// A write's legs are written and judged lowest number first (the
    /// order `judge` takes "the first active leg's error" in), whatever
    /// order they were added in, and a leg taken out is not visited.
    #[test]
    fn a_leg_set_visits_its_legs_in_order() {
        let mut legs = LegSet::default();
        assert!(legs.is_empty());
        for leg in [2, 0, 1] {
            legs.insert(leg);
        }
        assert_eq!(legs.iter().collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(legs.len(), 3);
        legs.remove(1);
        assert!(!legs.contains(1) && legs.contains(0) && legs.contains(2));
        assert_eq!(legs.iter().collect::<Vec<_>>(), [0, 2]);
        legs.remove(0);
        legs.remove(2);
        assert!(legs.is_empty());
        assert_eq!(legs.iter().next(), None);
    }
}
