//! A simulated filesystem for resync maps (`vouch_mirror::MapStore`),
//! so the crash simulator cuts and tears the map's own writes as it does a
//! volume's (docs/RELIABILITY.md). Each file is an object of one
//! `SimStorage`: a page write is pending until its file is synced, and a
//! crash image keeps, drops or tears each pending write by the recorder's
//! strategies. Creating a file (the engine's temporary file, fsync,
//! rename, directory fsync) and removing one are atomic and durable when
//! they return, as on a real filesystem; a crash before that leaves the
//! old name. A hook runs before every write, sync, create and remove: a
//! crash point.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use vouch_engine::{ObjectId, SimStorage, Storage};
use vouch_mirror::{MapFile, MapStore};

use crate::recorder::{crash_image, Strategy};
use crate::rng::Rng;

/// Called at each crash point of the map files.
pub type MapHook = Box<dyn FnMut() + Send>;

/// The simulated map files (cloning shares them).
#[derive(Clone)]
pub struct SimMaps {
    shared: Arc<Shared>,
}

struct Shared {
    /// Sabotage for self-tests: `sync` returns without syncing, as a store
    /// that ignores flushes would. The crash checker must catch it.
    sabotage_sync: std::sync::atomic::AtomicBool,
    sim: SimStorage,
    state: Mutex<State>,
    hook: Mutex<Option<MapHook>>,
    /// Chooses the order of an update's writes and syncs across files
    /// (`MapStore::write_and_sync_each`); without it, file by file.
    interleave: Mutex<Option<Rng>>,
}

#[derive(Clone, Default)]
struct State {
    /// The file (object) each name holds now: a create makes a new one,
    /// as a rename over a name gives it a new inode.
    names: BTreeMap<PathBuf, u32>,
    /// Length of each file.
    lengths: BTreeMap<u32, u64>,
    next: u32,
    /// Objects of the unsynced writes, in issue order.
    order: Vec<ObjectId>,
    counts: MapCounts,
}

/// What one run of the map files did (for the report).
#[derive(Clone, Copy, Debug, Default)]
pub struct MapCounts {
    pub writes: u64,
    pub syncs: u64,
    pub creates: u64,
    pub removes: u64,
}

impl Default for SimMaps {
    fn default() -> SimMaps {
        SimMaps::new()
    }
}

impl SimMaps {
    pub fn new() -> SimMaps {
        SimMaps::with(SimStorage::new(), State::default())
    }

    fn with(sim: SimStorage, state: State) -> SimMaps {
        SimMaps {
            shared: Arc::new(Shared {
                sabotage_sync: std::sync::atomic::AtomicBool::new(false),
                sim,
                state: Mutex::new(state),
                hook: Mutex::new(None),
                interleave: Mutex::new(None),
            }),
        }
    }

    /// Make every later `sync` a no-op (see `Shared::sabotage_sync`).
    pub fn sabotage_sync(&self) {
        self.shared
            .sabotage_sync
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Interleave the writes and syncs of each update of several files
    /// (production runs them on a thread per file) in an order `rng`
    /// chooses, instead of file by file.
    pub fn interleave_with(&self, rng: Rng) {
        *self.shared.interleave.lock() = Some(rng);
    }

    pub fn set_hook(&self, hook: Option<MapHook>) {
        *self.shared.hook.lock() = hook;
    }

    fn crash_point(&self) {
        if let Some(hook) = self.shared.hook.lock().as_mut() {
            hook();
        }
    }

    /// The file at `path` now (unsynced writes included), if any.
    pub fn file(&self, path: &Path) -> Option<Vec<u8>> {
        let state = self.shared.state.lock();
        let object = *state.names.get(path)?;
        let mut bytes = vec![0u8; state.lengths[&object] as usize];
        self.shared.sim.peek(ObjectId::Data(object), 0, &mut bytes);
        Some(bytes)
    }

    /// Unsynced writes now.
    pub fn pending(&self) -> usize {
        self.shared.state.lock().order.len()
    }

    /// What was done to the files so far.
    pub fn counts(&self) -> MapCounts {
        self.shared.state.lock().counts
    }

    /// The files after a power loss now: what was synced, and each unsynced
    /// write kept, dropped or torn (at `unit` bytes) by `strategy`.
    pub fn crash_image(&self, strategy: Strategy, unit: u64, rng: &mut Rng) -> SimMaps {
        let state = self.shared.state.lock();
        let sim = crash_image(&self.shared.sim, &state.order, strategy, unit, rng);
        let mut image = state.clone();
        image.order.clear();
        SimMaps::with(sim, image)
    }
}

struct SimMapFile {
    maps: SimMaps,
    object: u32,
}

impl MapFile for SimMapFile {
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.maps.crash_point();
        let shared = &self.maps.shared;
        let mut state = shared.state.lock();
        shared
            .sim
            .write_at(ObjectId::Data(self.object), offset, data)?;
        state.order.push(ObjectId::Data(self.object));
        state.counts.writes += 1;
        let length = state.lengths.entry(self.object).or_default();
        *length = (*length).max(offset + data.len() as u64);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.maps.crash_point();
        let shared = &self.maps.shared;
        if shared
            .sabotage_sync
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Ok(());
        }
        let mut state = shared.state.lock();
        shared.sim.sync(ObjectId::Data(self.object))?;
        let object = ObjectId::Data(self.object);
        state.order.retain(|pending| *pending != object);
        state.counts.syncs += 1;
        Ok(())
    }
}

impl MapStore for SimMaps {
    fn read(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        Ok(self.file(path))
    }

    fn create(&self, path: &Path, image: &[u8]) -> io::Result<Box<dyn MapFile>> {
        self.crash_point();
        let shared = &self.shared;
        let mut state = shared.state.lock();
        let object = state.next;
        state.next += 1;
        // A new file, complete and durable before its name points to it.
        shared.sim.write_at(ObjectId::Data(object), 0, image)?;
        shared.sim.sync(ObjectId::Data(object))?;
        state.lengths.insert(object, image.len() as u64);
        state.names.insert(path.to_path_buf(), object);
        state.counts.creates += 1;
        Ok(Box::new(SimMapFile {
            maps: self.clone(),
            object,
        }))
    }

    /// The writes and syncs of the files one at a time, on this thread:
    /// the next step of a file chosen by the interleaving RNG (the first
    /// file with steps left without one). A failed write ends its file.
    fn write_and_sync_each(
        &self,
        files: &[&dyn MapFile],
        offset: u64,
        data: &[u8],
    ) -> Vec<io::Result<()>> {
        // Per file: the steps done (0, written, synced) and the outcome.
        let mut done = vec![0u8; files.len()];
        let mut outcomes: Vec<io::Result<()>> = files.iter().map(|_| Ok(())).collect();
        loop {
            let left: Vec<usize> = (0..files.len())
                .filter(|&at| done[at] < 2 && outcomes[at].is_ok())
                .collect();
            let Some(&first) = left.first() else {
                return outcomes;
            };
            let at = match self.shared.interleave.lock().as_mut() {
                Some(rng) => left[rng.below(left.len() as u64) as usize],
                None => first,
            };
            outcomes[at] = match done[at] {
                0 => files[at].write_at(offset, data),
                _ => files[at].sync(),
            };
            done[at] += 1;
        }
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        self.crash_point();
        let mut state = self.shared.state.lock();
        state.names.remove(path);
        state.counts.removes += 1;
        Ok(())
    }
}
