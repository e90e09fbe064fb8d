//! The write-back buffer keeps the payloads it was given (zero-copy
//! `write_shared`): a buffered 4 KiB window keeps its whole payload alive.
//! Its limits must count that memory, whatever a client overwrites.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use vouch_engine::BlockDevice;
use vouch_engine::{CreateOptions, OpenOptions, SimStorage, Storage, Tuning, Volume, BLOCK};

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
    let options = OpenOptions {
        tuning: Tuning {
            background_commit: false,
            ..Tuning::default()
        },
        ..OpenOptions::default()
    };
    let volume = Volume::open(storage, &options).expect("open");
    let mut most_live = 0;
    for k in 0..2000u64 {
        volume
            .write_shared(k * BLOCK, &payload(k as u8), false)
            .expect("write");
        let live = LIVE.load(Ordering::SeqCst);
        most_live = most_live.max(live);
        let accounted = volume.resident_bytes();
        assert!(
            (live * MIB) as u64 <= accounted + MIB as u64,
            "after write {k}: {live} MiB of payloads alive, {} MiB counted",
            accounted >> 20
        );
    }
    // The default limits (4,096 blocks, twice that before writers wait)
    // bound what is alive to tens of MiB.
    assert!(
        most_live <= 64,
        "{most_live} MiB of payloads were alive at once"
    );
    volume.flush().expect("flush");
    volume.close().expect("close");
    assert_eq!(
        LIVE.load(Ordering::SeqCst),
        0,
        "payloads outlived the volume"
    );
}
