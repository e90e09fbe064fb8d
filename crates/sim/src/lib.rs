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

/// The `BlockDevice` methods every device must write, but for
/// `read_blocks_collecting`, each passed on unchanged to the device in
/// field `$below`: for the simulators' layers over a leg, which break or
/// watch one or two of its calls and write only those (and
/// `read_blocks_collecting`, forwarded or not).
macro_rules! forward_device {
    ($below:tt) => {
        fn size(&self) -> u64 {
            self.$below.size()
        }
        fn is_read_only(&self) -> bool {
            self.$below.is_read_only()
        }
        fn read(
            &self,
            offset: u64,
            buf: &mut [u8],
        ) -> vouch_engine::Result<Vec<std::ops::Range<u64>>> {
            self.$below.read(offset, buf)
        }
        fn submit_write(
            &self,
            offset: u64,
            data: &bytes::Bytes,
            fua: bool,
            admission: vouch_engine::Admission,
        ) -> vouch_engine::Result<vouch_engine::Submitted> {
            self.$below.submit_write(offset, data, fua, admission)
        }
        fn flush(&self) -> vouch_engine::Result<()> {
            self.$below.flush()
        }
        fn trim(&self, offset: u64, length: u64, fua: bool) -> vouch_engine::Result<()> {
            self.$below.trim(offset, length, fua)
        }
        fn write_zeroes(
            &self,
            offset: u64,
            length: u64,
            flags: vouch_engine::ZeroFlags,
        ) -> vouch_engine::Result<()> {
            self.$below.write_zeroes(offset, length, flags)
        }
        fn block_status(
            &self,
            offset: u64,
            length: u64,
            max_blocks: u64,
        ) -> vouch_engine::Result<Vec<(u64, vouch_engine::Allocation)>> {
            self.$below.block_status(offset, length, max_blocks)
        }
    };
}

/// The `SealedDevice` methods every sealed device must write, each passed
/// on unchanged to the device in field `$below` (`forward_device`'s
/// twin for the sealed face of the same layers).
macro_rules! forward_sealed {
    ($below:tt) => {
        fn read_sealed(
            &self,
            first: u64,
            count: u64,
        ) -> vouch_engine::Result<Vec<vouch_engine::SealedBlock>> {
            self.$below.read_sealed(first, count)
        }
        fn write_sealed(&self, blocks: &[vouch_engine::SealedBlock]) -> vouch_engine::Result<()> {
            self.$below.write_sealed(blocks)
        }
    };
}

pub mod crash;
pub mod faults;
pub mod fuzz;
pub mod keychange;
pub mod map_store;
pub mod metadata;
pub mod migrate;
pub mod migrate_power;
pub mod mirror;
pub mod mirror_faults;
pub mod mirror_midrun;
pub mod mirror_reconcile;
pub mod mirror_write;
mod model_files;
pub mod offload;
pub mod recorder;
pub mod replica_server;
pub mod resize;
pub mod resize_mirror;
pub mod resize_regions;
pub mod resync;
pub mod rng;
pub mod snapshot;
pub mod snapshot_layer;
pub mod snapshot_legs;
pub mod snapshot_online;
pub mod snapshot_online_regions;
pub mod snapshot_regions;
pub mod stepper;
pub mod upgrade;

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
