//! An overlay snapshot's flag on the live volume (OVERLAID, which keeps
//! binaries that know no overlays off it): a create a crash cut after the
//! flag was made durable and before the name was published leaves it set;
//! the next writable open clears it, and keeps it while an overlay is
//! published. A failed create whose undo of the flag fails too says so.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vouch_engine::snapshot::{overlay, RealFs, SnapshotFs};
use vouch_engine::storage::before::BeforeImages;
use vouch_engine::{
    create_volume, open_volume, CreateOptions, DeviceWrites, LayoutKind, ObjectId, OpenOptions,
    SimStorage, Storage, Volume, BLOCK,
};
use vouch_format::{FeatureFlags, Superblock};

const BLOCKS: u64 = 256;

/// The real filesystem, except that publishing a snapshot (the rename of
/// its `.NAME.partial`) fails: a create cut at its last step, as a crash
/// there leaves it.
struct CutAtPublish(RealFs);

impl SnapshotFs for CutAtPublish {
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        self.0.create_dir(path)
    }
    fn clone_file(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.0.clone_file(from, to)
    }
    fn new_file(&self, path: &Path, len: u64, allocate: bool) -> io::Result<()> {
        self.0.new_file(path, len, allocate)
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.0.read(path)
    }
    fn write_at(&self, path: &Path, offset: u64, bytes: &[u8]) -> io::Result<()> {
        self.0.write_at(path, offset, bytes)
    }
    fn sync_file(&self, path: &Path) -> io::Result<()> {
        self.0.sync_file(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.0.sync_dir(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        if from.to_string_lossy().ends_with(".partial") {
            return Err(io::Error::other("cut before the name was published"));
        }
        self.0.rename(from, to)
    }
    fn remove_all(&self, path: &Path) -> io::Result<()> {
        self.0.remove_all(path)
    }
    fn names(&self, dir: &Path) -> io::Result<Option<Vec<String>>> {
        self.0.names(dir)
    }
    fn exists(&self, path: &Path) -> bool {
        self.0.exists(path)
    }
    fn set_len(&self, path: &Path, len: u64) -> io::Result<()> {
        self.0.set_len(path, len)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.0.remove_file(path)
    }
    fn make_read_only(&self, path: &Path) -> io::Result<()> {
        self.0.make_read_only(path)
    }
}

fn incompat(path: &Path) -> u64 {
    vouch_engine::volume_superblock(path)
        .expect("superblock")
        .features
        .incompat
}

/// A split volume at `dir/volume` with some blocks written, closed.
fn volume(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("volume");
    let mut options = CreateOptions::new(BLOCKS * BLOCK);
    options.layout = LayoutKind::Split;
    options.journal_bytes = Some(1 << 20);
    let volume = create_volume(&path, &options).expect("create");
    volume
        .write(0, &vec![0x5a; 16 * BLOCK as usize], false)
        .expect("write");
    volume.close().expect("close");
    path
}

#[test]
fn the_open_after_a_create_cut_before_its_name_clears_overlaid() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = volume(dir.path());
    let before = incompat(&path);
    assert_eq!(before & FeatureFlags::INCOMPAT_OVERLAID, 0);
    let cut = overlay::create_offline(&CutAtPublish(RealFs::default()), &path, "cut", "id-1");
    assert!(cut.is_err(), "the create was cut");
    assert_ne!(
        incompat(&path) & FeatureFlags::INCOMPAT_OVERLAID,
        0,
        "the flag is durable before the name: what a crash there leaves"
    );
    // The next writable open: no overlay published, so no flag.
    let volume = open_volume(&path, &OpenOptions::default()).expect("open");
    assert!(!volume.overlaid());
    volume.close().expect("close");
    assert_eq!(incompat(&path), before, "the flags as before the create");

    // A published overlay keeps its flag across opens.
    overlay::create_offline(&RealFs::default(), &path, "kept", "id-2").expect("create");
    let volume = open_volume(&path, &OpenOptions::default()).expect("open");
    assert!(volume.overlaid());
    volume.close().expect("close");
    assert_eq!(incompat(&path), before | FeatureFlags::INCOMPAT_OVERLAID);
    // And its delete clears it.
    overlay::delete_offline(&RealFs::default(), &path, "kept").expect("delete");
    assert_eq!(incompat(&path), before);
}

/// Simulated files where, once a superblock with OVERLAID was written,
/// every superblock write without it fails: a create's undo of the flag
/// cannot be written.
struct KeepsOverlaid {
    sim: SimStorage,
    seen: AtomicBool,
}

impl Storage for KeepsOverlaid {
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.sim.read_at(object, offset, buf)
    }
    fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
        if object == ObjectId::Superblock {
            if let Ok(superblock) = Superblock::decode(&data[..vouch_format::SUPERBLOCK_BYTES]) {
                if superblock.features.incompat & FeatureFlags::INCOMPAT_OVERLAID != 0 {
                    self.seen.store(true, Ordering::Relaxed);
                } else if self.seen.load(Ordering::Relaxed) {
                    return Err(io::Error::other("the superblock cannot be written"));
                }
            }
        }
        self.sim.write_at(object, offset, data)
    }
    fn sync(&self, object: ObjectId) -> io::Result<()> {
        self.sim.sync(object)
    }
    fn punch_hole(&self, object: ObjectId, offset: u64, len: u64) -> io::Result<()> {
        self.sim.punch_hole(object, offset, len)
    }
    fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>> {
        self.sim.next_data(object, offset)
    }
    fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64> {
        self.sim.allocated_bytes(object)
    }
    fn object_len(&self, object: ObjectId) -> io::Result<Option<u64>> {
        self.sim.object_len(object)
    }
}

#[test]
fn a_failed_create_whose_flag_cannot_be_cleared_says_so() {
    // The volume's directory holds only its superblock (its other files
    // are simulated): the create fails at its flush point, reading their
    // lengths for the fence, after OVERLAID was set.
    let dir = tempfile::tempdir().expect("tempdir");
    let files = Arc::new(KeepsOverlaid {
        sim: SimStorage::new(),
        seen: AtomicBool::new(false),
    });
    let layered = Arc::new(BeforeImages::new(files.clone()));
    let volume = Volume::create(layered, &CreateOptions::new(BLOCKS * BLOCK)).expect("create");
    volume
        .write(0, &vec![1; BLOCK as usize], false)
        .expect("write");
    // Its superblock (what a create checks first) is there.
    let mut superblock = vec![0u8; 8192];
    files
        .read_at(ObjectId::Superblock, 0, &mut superblock)
        .expect("superblock");
    std::fs::write(dir.path().join("superblock"), &superblock).expect("superblock file");
    let error = overlay::create_online(dir.path(), &volume, "snap", "id-1")
        .expect_err("no volume files in the directory");
    assert!(
        files.seen.load(Ordering::Relaxed),
        "OVERLAID was set: {error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("OVERLAID flag, set for it, could not be cleared"),
        "{message}"
    );
    assert!(
        message.contains("stat"),
        "the create's own cause: {message}"
    );
}
