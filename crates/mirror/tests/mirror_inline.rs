//! The mirror's inline write path (`submit_write` with `Admission::MustNotWait`, the NBD
//! reactor's): it never encrypts more than `Volume` would inline, and it
//! never waits — a leg without room declines the whole write, with
//! nothing written, rather than committing on the caller's thread.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use vouch_engine::{
    open_volume, Admission, Allocation, BlockDevice, CreateOptions, Fault, OpenOptions, Result,
    SealedAdmission, SealedBlock, SealedDevice, Submitted, UserSecret, Volume, BLOCK,
};
use vouch_mirror::{create_mirror, open_mirror, LegState, Mirror, MirrorLeg};

fn legs(dir: &Path, n: usize) -> Vec<PathBuf> {
    (0..n).map(|i| dir.join(format!("leg{i}"))).collect()
}

fn key() -> UserSecret {
    UserSecret::key(&[5u8; 32]).expect("32 bytes")
}

fn pattern(blocks: usize, tag: u8) -> Bytes {
    (0..blocks * BLOCK as usize)
        .map(|i| (i as u8).wrapping_mul(13) ^ tag)
        .collect::<Vec<u8>>()
        .into()
}

fn close(mirror: Arc<Mirror>, volumes: Vec<Option<Arc<Volume>>>) {
    drop(mirror);
    for volume in volumes.into_iter().flatten() {
        Arc::try_unwrap(volume)
            .ok()
            .expect("sole owner")
            .close()
            .expect("close");
    }
}

/// Over encrypted legs a write larger than 128 KiB declines (it would be
/// encrypted on the reactor); one of 128 KiB is buffered inline. Over
/// plain legs 1 MiB is taken inline.
#[test]
fn encrypted_legs_take_at_most_128_kib_inline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = legs(dir.path(), 2);
    let mut create = CreateOptions::new(4 << 20);
    create.encrypt = Some(key());
    create_mirror(&paths, &create)
        .expect("create")
        .close()
        .expect("close");
    let keyed = OpenOptions {
        key: Some(key()),
        ..OpenOptions::default() // background committers: the inline path
    };
    let (mirror, volumes) = open_mirror(&paths[0], true, &mut |leg| open_volume(leg, &keyed))
        .expect("open")
        .into_mirror(true)
        .expect("mirror");
    assert!(
        !mirror
            .submit_write(0, &pattern(64, 1), false, Admission::MustNotWait)
            .map(|submitted| submitted.is_done())
            .expect("try 256 KiB"),
        "256 KiB over encrypted legs goes to a worker"
    );
    let mut buf = vec![0u8; 64 * BLOCK as usize];
    mirror.read(0, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 0), "nothing was written");
    assert!(
        mirror
            .submit_write(0, &pattern(32, 2), false, Admission::MustNotWait)
            .map(|submitted| submitted.is_done())
            .expect("try 128 KiB"),
        "128 KiB is taken inline"
    );
    mirror
        .read(0, &mut buf[..32 * BLOCK as usize])
        .expect("read");
    assert_eq!(&buf[..32 * BLOCK as usize], &pattern(32, 2)[..]);
    close(mirror, volumes);

    let plain = legs(&dir.path().join("plain"), 2);
    std::fs::create_dir(dir.path().join("plain")).expect("mkdir");
    create_mirror(&plain, &CreateOptions::new(4 << 20))
        .expect("create")
        .close()
        .expect("close");
    let (mirror, volumes) = open_mirror(&plain[0], true, &mut |leg| {
        open_volume(leg, &OpenOptions::default())
    })
    .expect("open")
    .into_mirror(true)
    .expect("mirror");
    assert!(mirror
        .submit_write(0, &pattern(256, 3), false, Admission::MustNotWait)
        .map(|submitted| submitted.is_done())
        .expect("try 1 MiB"));
    close(mirror, volumes);
}

/// A leg over a real volume: every call passed to it, the writes that
/// may block (commit on the caller's thread) counted.
struct RoomGone {
    volume: Arc<Volume>,
    blocking_writes: AtomicUsize,
}

impl BlockDevice for RoomGone {
    fn size(&self) -> u64 {
        self.volume.size()
    }
    fn is_read_only(&self) -> bool {
        self.volume.is_read_only()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<std::ops::Range<u64>>> {
        self.volume.read(offset, buf)
    }
    /// Only the waiting route, counted.
    fn submit_write(
        &self,
        offset: u64,
        data: &Bytes,
        fua: bool,
        admission: Admission,
    ) -> Result<Submitted> {
        if admission != Admission::MayWait {
            return Ok(Submitted::Declined);
        }
        self.blocking_writes.fetch_add(1, Ordering::Relaxed);
        self.volume.submit_write(offset, data, fua, admission)
    }
    fn flush(&self) -> Result<()> {
        self.volume.flush()
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.volume.trim(offset, length, fua)
    }
    fn write_zeroes(&self, offset: u64, length: u64, flags: vouch_engine::ZeroFlags) -> Result<()> {
        self.volume.write_zeroes(offset, length, flags)
    }
    fn block_status(&self, offset: u64, length: u64, max: u64) -> Result<Vec<(u64, Allocation)>> {
        self.volume.block_status(offset, length, max)
    }
    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        self.volume.read_blocks_collecting(first, count, out)
    }
}

impl SealedDevice for RoomGone {
    fn read_sealed(&self, first: u64, count: u64) -> Result<Vec<SealedBlock>> {
        self.volume.read_sealed(first, count)
    }
    /// Counts the writes that may wait (on the caller's thread).
    fn submit_sealed(
        &self,
        blocks: &[SealedBlock],
        fua: bool,
        admission: SealedAdmission,
    ) -> Result<Submitted> {
        if matches!(admission, SealedAdmission::MayWait | SealedAdmission::Here) {
            self.blocking_writes.fetch_add(1, Ordering::Relaxed);
        }
        self.volume.submit_sealed(blocks, fua, admission)
    }
    fn reserve_room(&self, count: usize) -> bool {
        self.volume.reserve_room(count)
    }
    fn release_room(&self, count: usize) {
        self.volume.release_room(count)
    }
    fn seal_blocks(&self, first: u64, data: &Bytes, generation: u64) -> Result<Vec<SealedBlock>> {
        self.volume.seal_blocks(first, data, generation)
    }
    fn generation_clock(&self) -> u64 {
        self.volume.generation_clock()
    }
}

/// Leg b has no room (no background committer takes its commits, so it
/// reserves none), as a leg whose buffer another writer just filled: the
/// inline write declines whole — leg a does not get it either, its
/// reservation is given back — and no leg's blocking write runs on the
/// caller's thread (before the reservations, a leg without room at its
/// turn took the blocking `write_sealed_here`). Leg a alone: taken inline.
#[test]
fn a_leg_without_room_declines_the_whole_inline_write_without_blocking() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = legs(dir.path(), 2);
    create_mirror(&paths, &CreateOptions::new(4 << 20))
        .expect("create")
        .close()
        .expect("close");
    let with_room = Arc::new(RoomGone {
        volume: Arc::new(open_volume(&paths[0], &OpenOptions::default()).expect("leg 0")),
        blocking_writes: AtomicUsize::new(0),
    });
    let without = Arc::new(RoomGone {
        volume: Arc::new(open_volume(&paths[1], &OpenOptions::foreground()).expect("leg 1")),
        blocking_writes: AtomicUsize::new(0),
    });
    let leg = |name: &str, device: &Arc<RoomGone>| MirrorLeg {
        name: name.into(),
        device: Some(Arc::clone(device) as Arc<dyn SealedDevice>),
        state: LegState::Active,
    };
    let mirror = Mirror::new(vec![leg("a", &with_room), leg("b", &without)], None).expect("mirror");
    let data = pattern(4, 7);
    assert!(
        !mirror
            .submit_write(8 * BLOCK, &data, false, Admission::MustNotWait)
            .map(|submitted| submitted.is_done())
            .expect("try"),
        "declined: leg b has no room"
    );
    for device in [&with_room, &without] {
        assert_eq!(device.blocking_writes.load(Ordering::Relaxed), 0);
        let mut buf = vec![0u8; data.len()];
        device.volume.read(8 * BLOCK, &mut buf).expect("read");
        assert!(buf.iter().all(|&b| b == 0), "nothing written on any leg");
    }
    // The reservation leg a took was given back: it still has all its room.
    assert!(with_room.volume.reserve_room(2 * 4096 - 1));
    with_room.volume.release_room(2 * 4096 - 1);
    drop(mirror);

    let alone = Mirror::new(vec![leg("a", &with_room)], None).expect("mirror");
    assert!(alone
        .submit_write(8 * BLOCK, &data, false, Admission::MustNotWait)
        .map(|submitted| submitted.is_done())
        .expect("try"));
    assert_eq!(with_room.blocking_writes.load(Ordering::Relaxed), 0);
    let mut buf = vec![0u8; data.len()];
    with_room.volume.read(8 * BLOCK, &mut buf).expect("read");
    assert_eq!(&buf[..], &data[..]);
}
