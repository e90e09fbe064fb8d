//! `vouch snapshot create`, `vouch clone` and `vouch snapshot delete`
//! crashed at every file operation they issue (`vouch-sim snapshot`).
//!
//! Per seed: a volume written on random data, zeroes and trims (the
//! production scheduling: `metadata`'s write rounds) and closed cleanly,
//! its files put in a model filesystem (`ModelFs`) that keeps, through a
//! power cut, only what was synced: a file's bytes after `sync_file`, a
//! directory's entries (made, renamed, removed) after `sync_dir` of it,
//! each inode independently. Then the engine's own `snapshot::create`,
//! `snapshot::clone` and `snapshot::delete` run on it in turn; right before
//! each operation they issue, three crash images are taken: a process
//! crash (everything issued kept), a power cut that loses everything not
//! synced, and a power cut that keeps a random subset of the unsynced
//! inodes (any order the kernel may have written them in). On each image,
//! after the tidy the next command does:
//!
//! - the volume's files are exactly as before (a snapshot never writes
//!   them), and it opens and reads every block as the model says;
//! - a snapshot that has its name is complete: every file byte for byte
//!   the volume's (its superblock but for the snapshot flag), it opens
//!   read-only and reads every block as the model says, `check` finds
//!   nothing (absence is never emptiness: a file cut short would read as
//!   faults, never as zeros);
//! - a clone at its path is complete and writable, with the same data;
//! - nothing half made or half deleted is left in `snapshots/`;
//! - what a step finished (its last sync returned) is there: the
//!   snapshot after create, the clone after clone, no snapshot after delete;
//! - the command run again (as an operator would after the crash)
//!   succeeds or says the snapshot exists, leaving it complete.
//!
//! `--break-publish` runs create with its name published before its files
//! are synced (`SnapshotBreaks::publish_before_sync`): the power-cut
//! images must then show violations.

use std::collections::BTreeMap;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use vouch_engine::snapshot::{self, SnapshotBreaks, SnapshotFs};
use vouch_engine::storage::objects_of;
use vouch_engine::{
    BlockDevice, LayoutKind, ObjectId, OpenOptions, OrderingBreaks, SimStorage, Volume,
};
use vouch_format::FeatureFlags;

use crate::faults::{segment_blocks, BLOCKS};
use crate::rng::Rng;
use crate::BLOCK;

#[derive(Clone, Debug)]
pub struct SnapshotConfig {
    pub layout: LayoutKind,
    pub seeds: u64,
    pub seed: u64,
    pub breaks: SnapshotBreaks,
}

#[derive(Debug, Default)]
pub struct SnapshotReport {
    pub points: u64,
    pub images: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl SnapshotReport {
    pub fn summary(&self, config: &SnapshotConfig) -> String {
        format!(
            "snapshot: layout={}{} seeds={} crash points={} images={} violations={} time={:.1}s",
            config.layout.name(),
            if config.breaks.publish_before_sync {
                " BROKEN(publish before sync)"
            } else {
                ""
            },
            config.seeds,
            self.points,
            self.images,
            self.violations.len(),
            self.seconds
        )
    }
}

/// One inode of the model filesystem: what a reader sees now (`live`) and
/// what a power cut keeps (`durable`). A file's bytes are shared between
/// the two and with the crash images made of it, copied on the next
/// write (`file`): an image costs no copy of the files.
#[derive(Clone, Debug)]
pub(crate) enum Node {
    File {
        live: Arc<Vec<u8>>,
        durable: Arc<Vec<u8>>,
    },
    Dir {
        live: BTreeMap<String, usize>,
        durable: BTreeMap<String, usize>,
    },
}

/// A filesystem of inodes (0 is the root) that loses, in a power cut,
/// whatever was not synced.
#[derive(Clone, Debug)]
pub(crate) struct ModelFs {
    pub(crate) nodes: Vec<Node>,
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{}: no such file", path.display()),
    )
}

impl ModelFs {
    pub(crate) fn new() -> ModelFs {
        ModelFs {
            nodes: vec![Node::Dir {
                live: BTreeMap::new(),
                durable: BTreeMap::new(),
            }],
        }
    }

    fn names_of(path: &Path) -> Vec<String> {
        path.components()
            .filter_map(|part| match part {
                Component::Normal(name) => Some(name.to_string_lossy().into_owned()),
                _ => None,
            })
            .collect()
    }

    pub(crate) fn lookup(&self, path: &Path) -> Option<usize> {
        let mut at = 0;
        for name in Self::names_of(path) {
            match &self.nodes[at] {
                Node::Dir { live, .. } => at = *live.get(&name)?,
                Node::File { .. } => return None,
            }
        }
        Some(at)
    }

    /// The directory holding `path`, and `path`'s name in it.
    fn parent(&self, path: &Path) -> io::Result<(usize, String)> {
        let mut names = Self::names_of(path);
        let name = names.pop().ok_or_else(|| not_found(path))?;
        let dir: PathBuf = names.iter().collect();
        let parent = self.lookup(&dir).ok_or_else(|| not_found(path))?;
        match self.nodes[parent] {
            Node::Dir { .. } => Ok((parent, name)),
            Node::File { .. } => Err(not_found(path)),
        }
    }

    fn entries(&mut self, dir: usize) -> &mut BTreeMap<String, usize> {
        match &mut self.nodes[dir] {
            Node::Dir { live, .. } => live,
            Node::File { .. } => unreachable!("a parent is a directory"),
        }
    }

    fn link(&mut self, path: &Path, node: Node) -> io::Result<usize> {
        let (parent, name) = self.parent(path)?;
        if self.entries(parent).contains_key(&name) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists", path.display()),
            ));
        }
        self.nodes.push(node);
        let id = self.nodes.len() - 1;
        self.entries(parent).insert(name, id);
        Ok(id)
    }

    /// Make file `path` (which must not exist) holding `bytes`, none of
    /// them durable yet.
    pub(crate) fn link_unsynced(&mut self, path: &Path, bytes: Vec<u8>) -> io::Result<()> {
        self.link(
            path,
            Node::File {
                live: Arc::new(bytes),
                durable: Arc::default(),
            },
        )
        .map(drop)
    }

    /// `link_unsynced`, or where `path` is a file already, its bytes
    /// replaced (not yet durable): a clone over a warm copy.
    pub(crate) fn put_unsynced(&mut self, path: &Path, bytes: Vec<u8>) -> io::Result<()> {
        match self.lookup(path) {
            Some(_) => {
                *self.file(path)? = bytes;
                Ok(())
            }
            None => self.link_unsynced(path, bytes),
        }
    }

    /// The bytes of file `path`, to change (a copy of them made first
    /// where they are shared).
    pub(crate) fn file(&mut self, path: &Path) -> io::Result<&mut Vec<u8>> {
        let id = self.lookup(path).ok_or_else(|| not_found(path))?;
        match &mut self.nodes[id] {
            Node::File { live, .. } => Ok(Arc::make_mut(live)),
            Node::Dir { .. } => Err(io::Error::other("a directory")),
        }
    }

    /// The bytes of file `path`, to read.
    pub(crate) fn bytes(&self, path: &Path) -> io::Result<&[u8]> {
        let id = self.lookup(path).ok_or_else(|| not_found(path))?;
        match &self.nodes[id] {
            Node::File { live, .. } => Ok(live),
            Node::Dir { .. } => Err(io::Error::other("a directory")),
        }
    }

    /// The file at `path`, made empty (not yet durable) when missing.
    fn file_or_new(&mut self, path: &Path) -> io::Result<&mut Vec<u8>> {
        if self.lookup(path).is_none() {
            self.link(
                path,
                Node::File {
                    live: Arc::default(),
                    durable: Arc::default(),
                },
            )?;
        }
        self.file(path)
    }

    /// After a power cut: each inode as synced, or (`keep` says so, for
    /// the unsynced state the kernel may have written anyway) as it was.
    pub(crate) fn power_cut(&self, mut keep: impl FnMut() -> bool) -> ModelFs {
        let nodes = self
            .nodes
            .iter()
            .map(|node| {
                let kept = keep();
                match node {
                    Node::File { live, durable } => {
                        let now = if kept { live } else { durable };
                        Node::File {
                            live: Arc::clone(now),
                            durable: Arc::clone(now),
                        }
                    }
                    Node::Dir { live, durable } => {
                        let now = if kept { live } else { durable };
                        Node::Dir {
                            live: now.clone(),
                            durable: now.clone(),
                        }
                    }
                }
            })
            .collect();
        ModelFs { nodes }
    }

    pub(crate) fn put_file(&mut self, path: &Path, bytes: Vec<u8>) {
        let bytes = Arc::new(bytes);
        self.link(
            path,
            Node::File {
                live: Arc::clone(&bytes),
                durable: bytes,
            },
        )
        .expect("a new file");
    }

    pub(crate) fn put_dir(&mut self, path: &Path) {
        self.link(
            path,
            Node::Dir {
                live: BTreeMap::new(),
                durable: BTreeMap::new(),
            },
        )
        .expect("a new directory");
        self.sync_all_dirs();
    }

    pub(crate) fn sync_all_dirs(&mut self) {
        for node in &mut self.nodes {
            if let Node::Dir { live, durable } = node {
                *durable = live.clone();
            }
        }
    }
}

/// Called with the model's state and the operation about to change it.
pub(crate) type Hook = Box<dyn FnMut(&ModelFs, &str) + Send>;

/// `SnapshotFs` on a `ModelFs`, calling `hook` with the state right
/// before every operation that changes it.
pub(crate) struct Recording {
    pub(crate) fs: Mutex<ModelFs>,
    pub(crate) hook: Mutex<Option<Hook>>,
}

impl Recording {
    pub(crate) fn new(fs: ModelFs) -> Recording {
        Recording {
            fs: Mutex::new(fs),
            hook: Mutex::new(None),
        }
    }

    pub(crate) fn change<T>(
        &self,
        what: &str,
        path: &Path,
        op: impl FnOnce(&mut ModelFs) -> io::Result<T>,
    ) -> io::Result<T> {
        let mut fs = self.fs.lock();
        if let Some(hook) = self.hook.lock().as_mut() {
            hook(&fs, &format!("{what} {}", path.display()));
        }
        op(&mut fs)
    }
}

impl SnapshotFs for Recording {
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        self.change("mkdir", path, |fs| {
            fs.link(
                path,
                Node::Dir {
                    live: BTreeMap::new(),
                    durable: BTreeMap::new(),
                },
            )
            .map(drop)
        })
    }
    fn clone_file(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.change("clone", to, |fs| {
            let bytes = fs.bytes(from)?.to_vec();
            fs.put_unsynced(to, bytes)
        })
    }
    fn new_file(&self, path: &Path, len: u64, _allocate: bool) -> io::Result<()> {
        self.change("create", path, |fs| {
            fs.link_unsynced(path, vec![0; len as usize])
        })
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.fs.lock().bytes(path).map(<[u8]>::to_vec)
    }
    fn write_at(&self, path: &Path, offset: u64, bytes: &[u8]) -> io::Result<()> {
        self.change("write", path, |fs| {
            let file = fs.file_or_new(path)?;
            let end = offset as usize + bytes.len();
            if file.len() < end {
                file.resize(end, 0);
            }
            file[offset as usize..end].copy_from_slice(bytes);
            Ok(())
        })
    }
    fn sync_file(&self, path: &Path) -> io::Result<()> {
        self.change("fsync", path, |fs| {
            let id = fs.lookup(path).ok_or_else(|| not_found(path))?;
            if let Node::File { live, durable } = &mut fs.nodes[id] {
                *durable = live.clone();
            }
            Ok(())
        })
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.change("fsync dir", path, |fs| {
            let id = fs.lookup(path).ok_or_else(|| not_found(path))?;
            if let Node::Dir { live, durable } = &mut fs.nodes[id] {
                *durable = live.clone();
            }
            Ok(())
        })
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.change("rename", from, |fs| {
            let (old_parent, old_name) = fs.parent(from)?;
            let (new_parent, new_name) = fs.parent(to)?;
            // A file replaces a file (rename(2)); nothing replaces a
            // directory here.
            let existing = fs.entries(new_parent).get(&new_name).copied();
            if let Some(existing) = existing {
                let file_over_file = matches!(fs.nodes[existing], Node::File { .. })
                    && fs
                        .lookup(from)
                        .is_some_and(|id| matches!(fs.nodes[id], Node::File { .. }));
                if !file_over_file {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "target exists",
                    ));
                }
            }
            let id = fs
                .entries(old_parent)
                .remove(&old_name)
                .ok_or_else(|| not_found(from))?;
            fs.entries(new_parent).insert(new_name, id);
            Ok(())
        })
    }
    fn remove_all(&self, path: &Path) -> io::Result<()> {
        self.change("remove", path, |fs| {
            let (parent, name) = fs.parent(path)?;
            fs.entries(parent)
                .remove(&name)
                .map(drop)
                .ok_or_else(|| not_found(path))
        })
    }
    fn names(&self, dir: &Path) -> io::Result<Option<Vec<String>>> {
        let fs = self.fs.lock();
        Ok(fs.lookup(dir).and_then(|id| match &fs.nodes[id] {
            Node::Dir { live, .. } => Some(live.keys().cloned().collect()),
            Node::File { .. } => None,
        }))
    }
    fn exists(&self, path: &Path) -> bool {
        self.fs.lock().lookup(path).is_some()
    }
    fn set_len(&self, path: &Path, len: u64) -> io::Result<()> {
        self.change("set_len", path, |fs| {
            fs.file_or_new(path)?.resize(len as usize, 0);
            Ok(())
        })
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.remove_all(path)
    }
}

/// A before-image log (`storage/before.rs`) that is a file of a
/// `Recording`'s model filesystem: its appends, syncs and cut are the
/// recording's operations (each a crash point), its bytes the file's (a
/// power cut keeps the synced ones, or, for the unsynced state kept, all
/// of them). Bound to the inode, as an open file is: a rename of its
/// directory does not move it.
pub(crate) struct ModelLog {
    recording: Arc<Recording>,
    inode: usize,
    path: PathBuf,
}

impl ModelLog {
    /// The file at `path` of `recording` as a log.
    pub(crate) fn open(recording: &Arc<Recording>, path: &Path) -> io::Result<ModelLog> {
        let fs = recording.fs.lock();
        let inode = fs.lookup(path).ok_or_else(|| not_found(path))?;
        if !matches!(fs.nodes[inode], Node::File { .. }) {
            return Err(io::Error::other(format!("{}: a directory", path.display())));
        }
        Ok(ModelLog {
            recording: Arc::clone(recording),
            inode,
            path: path.to_path_buf(),
        })
    }

    fn change(&self, what: &str, op: impl FnOnce(&mut Arc<Vec<u8>>, &mut Arc<Vec<u8>>)) {
        let inode = self.inode;
        let _ = self.recording.change(what, &self.path, |fs| {
            if let Node::File { live, durable } = &mut fs.nodes[inode] {
                op(live, durable);
            }
            Ok(())
        });
    }
}

impl vouch_engine::storage::before::BeforeLog for ModelLog {
    fn bytes(&self) -> io::Result<u64> {
        match &self.recording.fs.lock().nodes[self.inode] {
            Node::File { live, .. } => Ok(live.len() as u64),
            Node::Dir { .. } => Err(io::Error::other("a directory")),
        }
    }
    fn read_at(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
        match &self.recording.fs.lock().nodes[self.inode] {
            Node::File { live, .. } => {
                let bytes = live
                    .get(at as usize..at as usize + buf.len())
                    .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
                buf.copy_from_slice(bytes);
                Ok(())
            }
            Node::Dir { .. } => Err(io::Error::other("a directory")),
        }
    }
    fn write_at(&self, at: u64, bytes: &[u8]) -> io::Result<()> {
        self.change("append to the log", |live, _| {
            let file = Arc::make_mut(live);
            let end = at as usize + bytes.len();
            if file.len() < end {
                file.resize(end, 0);
            }
            file[at as usize..end].copy_from_slice(bytes);
        });
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        self.change("fsync the log", |live, durable| *durable = Arc::clone(live));
        Ok(())
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        self.change("cut the log", |live, durable| {
            Arc::make_mut(live).truncate(len as usize);
            *durable = Arc::clone(live);
        });
        Ok(())
    }
}

const VOLUME: &str = "/v";
const CLONE: &str = "/c";
const NAME: &str = "s1";

/// What the steps have finished, for what an image must show.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Done {
    Nothing,
    Created,
    Cloned,
}

/// What every image is checked against.
struct Expected {
    /// The volume's files, by name.
    files: BTreeMap<String, Vec<u8>>,
    /// Every block's data.
    model: Vec<Vec<u8>>,
    layout: LayoutKind,
}

pub fn run(config: &SnapshotConfig) -> SnapshotReport {
    let flag = config
        .breaks
        .publish_before_sync
        .then_some("--break-publish");
    run_seeds(
        ("snapshot", config.layout, flag),
        config.seed..config.seed + config.seeds,
        |seed, report| run_seed(config, seed, report),
    )
}

/// `run_seed` for every seed, a violation (with the command that replays
/// it: the simulator's `command`, its layout and break `flag`) for each
/// that fails.
pub(crate) fn run_seeds(
    (command, layout, flag): (&str, LayoutKind, Option<&str>),
    seeds: std::ops::Range<u64>,
    mut run_seed: impl FnMut(u64, &mut SnapshotReport) -> Result<(), String>,
) -> SnapshotReport {
    let started = Instant::now();
    let mut report = SnapshotReport::default();
    for seed in seeds {
        if let Err(violation) = run_seed(seed, &mut report) {
            report.violations.push(format!(
                "VIOLATION layout={} seed={seed}: {violation}\n  replay: cargo run --release -p vouch-sim -- {command} --layout {} --seed {seed} --seeds 1{}",
                layout.name(),
                layout.name(),
                flag.map(|flag| format!(" {flag}")).unwrap_or_default()
            ));
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// A volume of `BLOCKS` blocks written on random data, zeroes and trims
/// (`metadata`'s write round, the production scheduling) and closed
/// cleanly, and every block's data.
pub(crate) fn written_volume(
    layout: LayoutKind,
    rng: &mut Rng,
) -> Result<(SimStorage, Vec<Vec<u8>>), String> {
    let storage = crate::upgrade::small_volume(layout, None)?;
    let written_with = crate::stepper::Stepper::new(OrderingBreaks::default())
        .options(crate::stepper::stepped_tuning(rng));
    let mut model = vec![vec![0u8; BLOCK]; BLOCKS as usize];
    let mut scheduled = crate::metadata::Scheduled::default();
    crate::metadata::write_round(&storage, &written_with, &mut model, rng, 60, &mut scheduled)?;
    Ok((storage, model))
}

/// What the crash images of one seed found, shared with its hook.
#[derive(Clone, Default)]
pub(crate) struct Findings {
    found: Arc<Mutex<Vec<String>>>,
    /// Crash points, images.
    counts: Arc<Mutex<(u64, u64)>>,
}

impl Findings {
    /// A hook that, before each operation, takes three crash images (a
    /// process crash, a power cut keeping nothing unsynced, one keeping a
    /// random subset of the unsynced inodes) and `check`s each.
    pub(crate) fn hook(
        &self,
        mut rng: Rng,
        mut check: impl FnMut(ModelFs) -> Result<(), String> + Send + 'static,
    ) -> Hook {
        let (found, counts) = (self.found.clone(), self.counts.clone());
        let mut point = 0u64;
        Box::new(move |fs: &ModelFs, what: &str| {
            point += 1;
            let images = [
                (fs.clone(), "process crash"),
                (fs.power_cut(|| false), "power cut (nothing unsynced kept)"),
                (
                    fs.power_cut(|| rng.chance(1, 2)),
                    "power cut (some unsynced kept)",
                ),
            ];
            let mut counts = counts.lock();
            counts.0 += 1;
            for (image, kind) in images {
                counts.1 += 1;
                if let Err(error) = check(image) {
                    let mut found = found.lock();
                    if found.len() < 10 {
                        found.push(format!(
                            "before operation {point} ({what}), {kind}: {error}"
                        ));
                    }
                }
            }
        })
    }

    /// The seed's end: its counts into `report`, and the first violation.
    pub(crate) fn end(&self, report: &mut SnapshotReport) -> Result<(), String> {
        let (points, images) = *self.counts.lock();
        report.points += points;
        report.images += images;
        if points == 0 {
            return Err("the commands issued no operation: nothing was crashed".into());
        }
        let found = std::mem::take(&mut *self.found.lock());
        match found.into_iter().next() {
            Some(first) => Err(first),
            None => Ok(()),
        }
    }
}

/// The geometry the superblock of `storage` describes.
pub(crate) fn geometry_of(storage: &SimStorage) -> Result<vouch_format::Geometry, String> {
    vouch_engine::read_superblock(storage)
        .and_then(|superblock| {
            superblock
                .geometry()
                .map_err(|e| vouch_engine::Error::Corrupt(e.to_string()))
        })
        .map_err(|e| format!("superblock: {e}"))
}

fn run_seed(config: &SnapshotConfig, seed: u64, report: &mut SnapshotReport) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let (storage, model) = written_volume(config.layout, &mut rng)?;

    let geometry = geometry_of(&storage)?;
    let mut fs = ModelFs::new();
    fs.put_dir(Path::new(VOLUME));
    let mut files = BTreeMap::new();
    for object in objects_of(&geometry) {
        let bytes = storage.object_bytes(object);
        fs.put_file(&Path::new(VOLUME).join(object.file_name()), bytes.clone());
        files.insert(object.file_name(), bytes);
    }
    fs.sync_all_dirs();
    let expected = Expected {
        files,
        model,
        layout: config.layout,
    };

    let recording = Recording::new(fs);
    let done = Arc::new(Mutex::new(Done::Nothing));
    let deleting = Arc::new(Mutex::new(false));
    let findings = Findings::default();
    let expected = Arc::new(expected);
    {
        let (done, deleting, expected) = (done.clone(), deleting.clone(), expected.clone());
        let breaks = config.breaks;
        *recording.hook.lock() = Some(findings.hook(rng.fork(), move |image| {
            verify(image, &expected, *done.lock(), *deleting.lock(), breaks)
        }));
    }
    let volume = Path::new(VOLUME);
    snapshot::create(&recording, volume, NAME, "reflink", config.breaks)
        .map_err(|e| format!("create failed: {e}"))?;
    *done.lock() = Done::Created;
    snapshot::clone(
        &recording,
        &snapshot::snapshot_path(volume, NAME),
        Path::new(CLONE),
    )
    .map_err(|e| format!("clone failed: {e}"))?;
    *done.lock() = Done::Cloned;
    *deleting.lock() = true;
    snapshot::delete(&recording, volume, NAME).map_err(|e| format!("delete failed: {e}"))?;
    *recording.hook.lock() = None;
    let ended = findings.end(report);
    let after = recording.fs.lock().clone();
    if after
        .lookup(&snapshot::snapshot_path(volume, NAME))
        .is_some()
    {
        return Err("the snapshot is still there after its delete".into());
    }
    verify(after, &expected, Done::Cloned, true, config.breaks)
        .map_err(|e| format!("after every command: {e}"))?;
    ended
}

/// A volume directory of `fs` as a `SimStorage`.
fn storage_of(fs: &mut ModelFs, dir: &Path, expected: &Expected) -> Result<SimStorage, String> {
    let layout = expected.layout;
    let storage = SimStorage::new();
    let geometry =
        vouch_format::Geometry::new(layout, BLOCKS * BLOCK as u64, segment_blocks(layout))
            .map_err(|e| e.to_string())?;
    for object in objects_of(&geometry) {
        let path = dir.join(object.file_name());
        let bytes = fs
            .file(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        storage.overwrite(object, 0, bytes);
        // The volume's own objects have no length (they end where written):
        // a file shorter than the volume's is cut, as a short file would be.
        let whole = expected.files.get(&object.file_name()).map_or(0, Vec::len);
        if bytes.len() < whole {
            storage.truncate(object, bytes.len() as u64);
        }
    }
    Ok(storage)
}

/// Open the volume directory `dir` of `fs`, read every block and check.
fn read_all(
    fs: &mut ModelFs,
    dir: &Path,
    expected: &Expected,
    want_read_only: bool,
) -> Result<(), String> {
    let storage = storage_of(fs, dir, expected)?;
    let volume = Volume::open(Arc::new(storage), &OpenOptions::default())
        .map_err(|e| format!("{}: open: {e}", dir.display()))?;
    if volume.is_read_only() != want_read_only {
        return Err(format!(
            "{}: opened {} (want {})",
            dir.display(),
            if volume.is_read_only() {
                "read-only"
            } else {
                "writable"
            },
            if want_read_only {
                "read-only"
            } else {
                "writable"
            }
        ));
    }
    let mut buf = vec![0u8; BLOCK];
    for (lba, data) in expected.model.iter().enumerate() {
        volume
            .read((lba * BLOCK) as u64, &mut buf)
            .map_err(|e| format!("{}: LBA {lba}: {e}", dir.display()))?;
        if &buf != data {
            return Err(format!("{}: LBA {lba} reads other data", dir.display()));
        }
    }
    let check = volume
        .check(|_, _| {})
        .map_err(|e| format!("{}: check: {e}", dir.display()))?;
    if !check.faults.is_empty() {
        return Err(format!(
            "{}: check found {} faults, the first {:?}",
            dir.display(),
            check.faults.len(),
            check.faults[0]
        ));
    }
    volume
        .close()
        .map_err(|e| format!("{}: close: {e}", dir.display()))
}

/// The snapshot at `dir` byte for byte the volume's files, its superblock
/// but for the flag (and a clone's instance) and (a `copy`: a snapshot or
/// clone) its journal new, zeros.
fn same_files(
    fs: &mut ModelFs,
    dir: &Path,
    expected: &Expected,
    flag: bool,
    copy: bool,
) -> Result<(), String> {
    for (name, bytes) in &expected.files {
        let path = dir.join(name);
        let got = fs
            .file(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        file_as_expected(&path, got, bytes, flag, copy)?;
    }
    Ok(())
}

/// One file of a snapshot or clone at `path` (`got`) against the volume's
/// (`bytes`): a superblock the volume's but for the flag (`flag`: the
/// snapshot's set, a clone's clear with a new instance), a journal (of a
/// `copy`) new zeros, any other byte for byte.
pub(crate) fn file_as_expected(
    path: &Path,
    got: &[u8],
    bytes: &[u8],
    flag: bool,
    copy: bool,
) -> Result<(), String> {
    let name = path.file_name().and_then(|name| name.to_str());
    if name == Some("superblock") {
        let read = |bytes: &[u8]| {
            let storage = SimStorage::new();
            storage.overwrite(ObjectId::Superblock, 0, bytes);
            vouch_engine::read_superblock(&storage)
        };
        let mut superblock = read(got).map_err(|e| format!("{}: {e}", path.display()))?;
        let marked = superblock.features.ro_compat & FeatureFlags::RO_COMPAT_SNAPSHOT != 0;
        if marked != flag {
            return Err(format!(
                "{}: snapshot flag {marked}, want {flag}",
                path.display()
            ));
        }
        superblock.features.ro_compat &= !FeatureFlags::RO_COMPAT_SNAPSHOT;
        let original = read(bytes).map_err(|e| format!("the volume's superblock: {e}"))?;
        // A clone (a copy without the flag) is another instance of the
        // volume: a new instance id, everything else the same.
        if copy && !flag {
            if superblock.instance == original.instance {
                return Err(format!(
                    "{}: a clone with its origin's instance",
                    path.display()
                ));
            }
            superblock.instance = original.instance;
        }
        if superblock != original {
            return Err(format!(
                "{}: another superblock than the volume's",
                path.display()
            ));
        }
    } else if copy && name == Some("journal") {
        // Never shared: a new journal of zeros (the volume was closed
        // cleanly, nothing in its journal is to be replayed).
        if got.is_empty() || got.iter().any(|&byte| byte != 0) {
            return Err(format!(
                "{}: {} bytes, not a new journal of zeros",
                path.display(),
                got.len()
            ));
        }
    } else if got != bytes {
        return Err(format!(
            "{}: {} bytes, not the volume's {} bytes as they were",
            path.display(),
            got.len(),
            bytes.len()
        ));
    }
    Ok(())
}

/// `fs` after what the next command on `volume` does first (create, list,
/// delete: `tidy`); a violation when the tidy fails or leaves a name
/// starting with '.' in `snapshots/`.
pub(crate) fn tidied(fs: ModelFs, volume: &Path) -> Result<ModelFs, String> {
    let recovered = Recording::new(fs);
    snapshot::tidy(&recovered, volume).map_err(|e| format!("tidy: {e}"))?;
    let fs = recovered.fs.lock().clone();
    let snapshots = volume.join(snapshot::SNAPSHOTS_DIR);
    if let Some(id) = fs.lookup(&snapshots) {
        if let Node::Dir { live, .. } = &fs.nodes[id] {
            if let Some(left) = live.keys().find(|name| name.starts_with('.')) {
                return Err(format!("{left} is left in snapshots/ after the tidy"));
            }
        }
    }
    Ok(fs)
}

/// `list` on `volume` shows one snapshot, with its record read.
pub(crate) fn listed_one(fs: &ModelFs, volume: &Path) -> Result<(), String> {
    let listed =
        snapshot::list(&Recording::new(fs.clone()), volume).map_err(|e| format!("list: {e}"))?;
    if listed.len() != 1 || listed[0].is_err() {
        return Err(format!("list shows {listed:?}"));
    }
    Ok(())
}

fn verify(
    mut fs: ModelFs,
    expected: &Expected,
    done: Done,
    deleting: bool,
    breaks: SnapshotBreaks,
) -> Result<(), String> {
    let volume = Path::new(VOLUME);
    fs = tidied(fs, volume)?;
    same_files(&mut fs, volume, expected, false, false).map_err(|e| format!("the volume: {e}"))?;
    read_all(&mut fs, volume, expected, false)?;
    let path = snapshot::snapshot_path(volume, NAME);
    let present = fs.lookup(&path).is_some();
    if present {
        same_files(&mut fs, &path, expected, true, true)?;
        read_all(&mut fs, &path, expected, true)?;
        listed_one(&fs, volume)?;
    } else if done >= Done::Created && !deleting {
        return Err("the snapshot create returned but its snapshot is gone".into());
    }
    let clone = Path::new(CLONE);
    if fs.lookup(clone).is_some() {
        same_files(&mut fs, clone, expected, false, true).map_err(|e| format!("the clone: {e}"))?;
        read_all(&mut fs, clone, expected, false)?;
    } else if done >= Done::Cloned {
        return Err("the clone returned but its volume is gone".into());
    }
    // The operator runs the command again.
    let again = Recording::new(fs);
    match snapshot::create(&again, volume, NAME, "reflink", breaks) {
        Ok(_) => {}
        Err(error) if present && error.to_string().contains("already exists") => {}
        Err(error) => return Err(format!("create again: {error}")),
    }
    let mut fs = again.fs.lock().clone();
    same_files(&mut fs, &path, expected, true, true).map_err(|e| format!("created again: {e}"))?;
    if fs.lookup(clone).is_none() {
        let again = Recording::new(fs);
        snapshot::clone(&again, &path, clone).map_err(|e| format!("clone again: {e}"))?;
        let mut fs = again.fs.lock().clone();
        same_files(&mut fs, clone, expected, false, true)
            .map_err(|e| format!("cloned again: {e}"))?;
    }
    Ok(())
}
