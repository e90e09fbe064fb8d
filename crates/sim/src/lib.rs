//! vouch-sim: a crash and fault simulator for the vouch engine.
//!
//! - [`crash`]: random workloads on the simulated backend; at every I/O the
//!   engine issues (and after every operation) post-crash images are built
//!   from `SimStorage::crash_image` — all pending dropped, all persisted,
//!   random subsets, prefixes in issue order, torn writes — and each one is
//!   recovered and checked against a per-block model of the contract.
//! - [`faults`]: a fault injector (bit flips, misdirected / lost writes,
//!   misdirected reads, zeroed sectors, superblock damage, I/O errors,
//!   ENOSPC) that classifies each fault as detected, silently wrong or
//!   harmless and builds the detection matrix.
//! - [`offload`]: verify (with its proof digest) and scrub, interleaved with
//!   the crash workload and run on recovered images.
//! - [`fuzz`]: the bodies of the cargo-fuzz targets in `fuzz/`, as plain
//!   functions so stable `cargo test` exercises them too.
//! - [`stepper`]: the production scheduling the workloads run on (the
//!   background committer, stepped by the seed; the inline write route).
//!
//! See docs/RELIABILITY.md ("What each simulator drives").

pub mod crash;
pub mod faults;
pub mod fuzz;
pub mod keychange;
pub mod map_store;
pub mod metadata;
pub mod mirror;
pub mod mirror_faults;
pub mod mirror_midrun;
pub mod mirror_reconcile;
pub mod mirror_write;
pub mod offload;
pub mod recorder;
pub mod resync;
pub mod rng;
pub mod stepper;

pub use vouch_engine::{GuardKind, LayoutKind};

/// Open options for recovering a crash image (and checks that write
/// nothing): commits only when the caller commits (no background
/// committer), so a check's own open runs no writer. Workloads open on the
/// production scheduling instead (`stepper::stepped_options`).
pub fn foreground_options() -> vouch_engine::OpenOptions {
    vouch_engine::OpenOptions::foreground()
}

/// One 4 KiB block.
pub const BLOCK: usize = 4096;

/// Every block of the first `blocks` of `device`, read (and verified) one
/// at a time; the first read that fails is an error naming its LBA.
pub fn read_blocks(
    device: &dyn vouch_engine::BlockDevice,
    blocks: u64,
) -> Result<Vec<Vec<u8>>, String> {
    (0..blocks)
        .map(|lba| {
            let mut buf = vec![0u8; BLOCK];
            device
                .read(lba * BLOCK as u64, &mut buf)
                .map(|_| buf)
                .map_err(|e| format!("LBA {lba}: {e}"))
        })
        .collect()
}

/// A 64-bit fingerprint of a block's contents (the model stores these).
pub fn fingerprint(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

pub fn parse_layout(name: &str) -> Option<LayoutKind> {
    LayoutKind::from_name(name)
}

pub fn parse_guard(name: &str) -> Option<GuardKind> {
    GuardKind::from_name(name)
}
