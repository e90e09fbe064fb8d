//! A `Storage` wrapper around `SimStorage` that
//! - keeps the global issue order of the unsynced operations (the sim keeps
//!   them per object), so crash images can persist a *prefix in issue
//!   order* across objects;
//! - calls a hook right before every write, hole punch and sync: a crash
//!   point inside an engine operation (CrashMonkey / ALICE style);
//! - counts the bytes it forwarded, so `FaultPlan::enospc_after_bytes` can be
//!   set relative to "now".

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use vouch_engine::sim::PendingOp;
use vouch_engine::storage::ReadLater;
use vouch_engine::{CloneRange, ObjectId, SimStorage, Storage};

/// Called at a crash point with the sim and the issue order of its pending ops.
pub type Hook = Box<dyn FnMut(&SimStorage, &[ObjectId]) + Send>;

pub struct Recorder {
    pub sim: SimStorage,
    order: Mutex<Vec<ObjectId>>,
    bytes_written: AtomicU64,
    hook: Mutex<Option<Hook>>,
    /// Sabotage for self-tests: `sync` succeeds without syncing, the way a
    /// store that ignores flushes would. The crash checker must catch it.
    pub sabotage_sync: std::sync::atomic::AtomicBool,
    /// Sabotage for self-tests: writes to the held log succeed without
    /// writing, the way an engine that acknowledged before logging would
    /// leave it. Process-crash images must catch it.
    pub sabotage_held: std::sync::atomic::AtomicBool,
    /// Sabotage for self-tests, set before the volume opens: its landing
    /// area is memory a crash of the process does not keep (`decoy`'s, not
    /// the storage's), the way an engine whose held log named payloads in
    /// process memory would be. Process-crash images must catch it.
    pub sabotage_landing: std::sync::atomic::AtomicBool,
    decoy: SimStorage,
}

impl Recorder {
    pub fn new(sim: SimStorage) -> Recorder {
        Recorder {
            sim,
            order: Mutex::new(Vec::new()),
            bytes_written: AtomicU64::new(0),
            hook: Mutex::new(None),
            sabotage_sync: std::sync::atomic::AtomicBool::new(false),
            sabotage_held: std::sync::atomic::AtomicBool::new(false),
            sabotage_landing: std::sync::atomic::AtomicBool::new(false),
            decoy: SimStorage::new(),
        }
    }

    pub fn set_hook(&self, hook: Option<Hook>) {
        *self.hook.lock() = hook;
    }

    /// Bytes written through this wrapper (successful writes only).
    pub fn bytes_written(&self) -> u64 {
        self.bytes_written.load(Ordering::Relaxed)
    }

    /// Unsynced ops in global issue order.
    pub fn order(&self) -> Vec<ObjectId> {
        self.order.lock().clone()
    }

    /// Run the hook now (a crash point between operations).
    pub fn crash_point(&self) {
        let order = self.order.lock().clone();
        let mut hook = self.hook.lock();
        if let Some(hook) = hook.as_mut() {
            hook(&self.sim, &order);
        }
    }
}

impl Storage for Recorder {
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.sim.read_at(object, offset, buf)
    }

    fn read_at_nowait(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.sim.read_at_nowait(object, offset, buf)
    }

    fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
        self.crash_point();
        if matches!(object, ObjectId::Held(_)) && self.sabotage_held.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.sim.write_at(object, offset, data)?;
        self.order.lock().push(object);
        self.bytes_written
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn has_held(&self) -> bool {
        self.sim.has_held()
    }

    /// Reads are no crash point: they change nothing on the media.
    fn start_read(
        &self,
        object: ObjectId,
        offset: u64,
        len: usize,
        done: ReadLater,
    ) -> Result<(), ReadLater> {
        self.sim.start_read(object, offset, len, done)
    }

    fn reap_reads(&self) -> io::Result<()> {
        self.sim.reap_reads()
    }

    fn reads_ready(&self) -> bool {
        self.sim.reads_ready()
    }

    fn reads_in_flight(&self) -> usize {
        self.sim.reads_in_flight()
    }

    fn boot_id(&self) -> [u8; 16] {
        self.sim.boot_id()
    }

    fn landing_window(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        match self.sabotage_landing.load(Ordering::Relaxed) {
            true => self.decoy.landing_window(),
            false => self.sim.landing_window(),
        }
    }

    fn grow_landing(&self, from: u64, end: u64) -> io::Result<()> {
        self.sim.grow_landing(from, end)
    }

    fn read_landing(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
        self.sim.read_landing(at, buf)
    }

    fn object_len(&self, object: ObjectId) -> io::Result<Option<u64>> {
        self.sim.object_len(object)
    }

    fn sync(&self, object: ObjectId) -> io::Result<()> {
        self.crash_point();
        if self.sabotage_sync.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.sim.sync(object)?;
        self.order.lock().retain(|o| *o != object);
        Ok(())
    }

    fn punch_hole(&self, object: ObjectId, offset: u64, len: u64) -> io::Result<()> {
        self.crash_point();
        self.sim.punch_hole(object, offset, len)?;
        self.order.lock().push(object);
        Ok(())
    }

    fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>> {
        self.sim.next_data(object, offset)
    }

    fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64> {
        self.sim.allocated_bytes(object)
    }

    /// The sim's reflink: one unsynced write per 4 KiB block (each kept or
    /// lost by a crash, like any write).
    fn clone_range(&self, clone: CloneRange<'_>) -> io::Result<()> {
        self.crash_point();
        let (object, len) = (clone.object, clone.len);
        self.sim.clone_range(clone)?;
        let mut order = self.order.lock();
        order.extend(std::iter::repeat_n(object, len.div_ceil(4096) as usize));
        self.bytes_written.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    fn probe_clone(&self, source: &dyn Storage, source_object: ObjectId) -> io::Result<()> {
        self.sim.probe_clone(source, source_object)
    }
}

/// How the unsynced writes of a crash image are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Nothing since the last sync survives.
    Dropped,
    /// Everything issued survives.
    Persisted,
    /// Each op independently: dropped, persisted, or torn.
    Subset,
    /// The first k ops in global issue order survive.
    Prefix,
}

pub const STRATEGIES: [Strategy; 4] = [
    Strategy::Dropped,
    Strategy::Persisted,
    Strategy::Subset,
    Strategy::Prefix,
];

/// Tearing granularity of the media: 4096 (4 KiB-atomic) or 512 (sectors).
pub fn tear_mask(op: &PendingOp, unit: u64, rng: &mut crate::rng::Rng) -> u64 {
    let PendingOp::Write { offset, data } = op else {
        return u64::MAX;
    };
    let first = offset / 512;
    let all_sectors = op.sectors();
    let sectors = all_sectors.min(64);
    let mut mask = 0u64;
    let mut chosen: BTreeMap<u64, bool> = BTreeMap::new();
    if all_sectors > 64 {
        // The sim always persists sectors past the 64th of a kept op: the
        // unit holding sector 64 must then be kept whole.
        chosen.insert((first + 64) * 512 / unit, true);
    }
    for i in 0..sectors {
        let absolute = (first + i) * 512;
        let group = absolute / unit;
        let keep = *chosen.entry(group).or_insert_with(|| rng.chance(1, 2));
        if keep {
            mask |= 1 << i;
        }
    }
    let _ = data;
    // A mask of 0 is a dropped write.
    mask
}

/// Build one crash image of `sim` with `strategy`. `order` is the issue
/// order of its pending ops; `unit` the tearing granularity.
pub fn crash_image(
    sim: &SimStorage,
    order: &[ObjectId],
    strategy: Strategy,
    unit: u64,
    rng: &mut crate::rng::Rng,
) -> SimStorage {
    match strategy {
        Strategy::Dropped => sim.crash_image(|_, _, _| 0),
        Strategy::Persisted => sim.crash_image(|_, _, _| u64::MAX),
        Strategy::Subset => sim.crash_image(|_, _, op| match rng.below(3) {
            0 => 0,
            1 => u64::MAX,
            _ => tear_mask(op, unit, rng),
        }),
        Strategy::Prefix => {
            let k = rng.range(0, order.len() as u64) as usize;
            let mut per_object: BTreeMap<ObjectId, usize> = BTreeMap::new();
            for object in &order[..k] {
                *per_object.entry(*object).or_default() += 1;
            }
            // The op at the prefix boundary may be torn.
            let boundary = order.get(k).copied();
            let boundary_index = boundary.map(|o| per_object.get(&o).copied().unwrap_or(0));
            let tear_boundary = rng.chance(1, 2);
            sim.crash_image(|object, index, op| {
                if index < per_object.get(&object).copied().unwrap_or(0) {
                    u64::MAX
                } else if tear_boundary && Some(object) == boundary && Some(index) == boundary_index
                {
                    tear_mask(op, unit, rng)
                } else {
                    0
                }
            })
        }
    }
}
