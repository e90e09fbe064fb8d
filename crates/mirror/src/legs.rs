//! The legs of a mirror: the one handed to `Mirror::new`, the one the
//! mirror keeps (its device, state, resync map and counters), the
//! corrected-error count the fault threshold judges, what its status
//! shows, and how an error is judged (the request's, or the leg's).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};
use smallvec::SmallVec;
use vouch_format::mirror::{LegState, MAX_LEGS};

use crate::dirty::DirtyMap;
use crate::progress::ResyncProgress;
use crate::remote::is_remote_member;
use crate::CORRECTED_HALF_LIFE;
use vouch_engine::device::SealedDevice;
use vouch_engine::error::Error;

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
