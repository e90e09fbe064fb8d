//! The write-back buffer keeps the payloads it was given (zero-copy
//! `write_shared`): a buffered 4 KiB window keeps its whole payload alive.
//! Its limits must count that memory, whatever a client overwrites.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use vouch_engine::DeviceWrites;

use bytes::Bytes;
use vouch_engine::BlockDevice;
use vouch_engine::{CreateOptions, OpenOptions, SimStorage, Storage, UserSecret, Volume, BLOCK};

const MIB: usize = 1 << 20;

/// Payloads not yet dropped.
static LIVE: AtomicUsize = AtomicUsize::new(0);

struct Counted(Vec<u8>);

impl AsRef<[u8]> for Counted {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

fn payload(fill: u8) -> Bytes {
    LIVE.fetch_add(1, Ordering::SeqCst);
    Bytes::from_owner(Counted(vec![fill; MIB]))
}

/// 1 MiB writes, each shifted one block from the one before: every write
/// leaves one block of the previous payload buffered, so without counting
/// the overwritten windows each 4 KiB counted would keep a MiB alive
/// (2,000 MiB held while 8 MiB were counted, before the fix).
#[test]
fn sliding_writes_do_not_pin_more_than_the_buffer_counts() {
    let storage: Arc<dyn Storage> = Arc::new(SimStorage::new());
    Volume::create(storage.clone(), &CreateOptions::new(64 * MIB as u64))
        .expect("create")
        .close()
        .expect("close");
    // Commits inline on the writer (no background committer), so what is
    // buffered and alive is settled whenever a write returns.
    let volume = Volume::open(storage, &OpenOptions::foreground()).expect("open");
    let most_live = slide(&volume, 2000, || LIVE.load(Ordering::SeqCst));
    // The default limits (4,096 blocks, twice that before writers wait)
    // bound what is alive to tens of MiB.
    assert!(
        most_live <= 64,
        "{most_live} MiB of payloads were alive at once"
    );
    volume.close().expect("close");
    assert_eq!(
        LIVE.load(Ordering::SeqCst),
        0,
        "payloads outlived the volume"
    );
}

/// The same on an encrypted volume: each write is sealed into one
/// ciphertext copy of the run, whose blocks share that allocation.
#[test]
fn sliding_encrypted_writes_do_not_pin_more_than_the_buffer_counts() {
    let storage: Arc<dyn Storage> = Arc::new(SimStorage::new());
    let mut create = CreateOptions::new(64 * MIB as u64);
    create.encrypt = Some(UserSecret::key(&[7u8; 32]).expect("key"));
    Volume::create(storage.clone(), &create)
        .expect("create")
        .close()
        .expect("close");
    let options = OpenOptions {
        key: Some(UserSecret::key(&[7u8; 32]).expect("key")),
        ..OpenOptions::foreground()
    };
    let volume = Volume::open(storage, &options).expect("open");
    // The ciphertext copies are made inside the engine, so count blocks:
    // after write k (below the commit limit) the buffer holds 256 + k
    // blocks and 255 k overwritten windows whose runs a neighbour keeps
    // alive, 256 (k + 1) blocks of memory in all. Counting only the
    // buffered blocks would say 256 + k.
    for k in 0..10u64 {
        volume
            .write_bytes(k * BLOCK, &Bytes::from(vec![k as u8 + 1; MIB]), false)
            .expect("write");
        let counted = volume.resident_bytes() / (BLOCK + 64);
        assert!(
            counted >= 256 * (k + 1),
            "after write {k}: {counted} blocks counted"
        );
    }
    volume.close().expect("close");
}

/// Write 1 MiB payloads at one-block steps; after each, what is alive must
/// be within what the volume counts. Returns the most MiB alive at once.
fn slide(volume: &Volume, writes: u64, live: impl Fn() -> usize) -> usize {
    let mut most_live = 0;
    for k in 0..writes {
        volume
            .write_bytes(k * BLOCK, &payload(k as u8), false)
            .expect("write");
        let alive = live();
        most_live = most_live.max(alive);
        let accounted = volume.resident_bytes();
        assert!(
            (alive * MIB) as u64 <= accounted + MIB as u64,
            "after write {k}: {alive} MiB of payloads alive, {} MiB counted",
            accounted >> 20
        );
    }
    volume.flush().expect("flush");
    most_live
}
