//! Offline verification of every written block (`vouch check`): a scan job
//! (`jobs.rs`) that keeps the faults. Holes are skipped with SEEK_DATA, so
//! a sparse 16 TiB volume checks in time proportional to what was written.

use crate::device::BlockDevice;
use crate::error::{Fault, Result};
use crate::jobs::{scan, JobControl, ScanOptions};
use crate::state::BLOCK;

#[derive(Clone, Debug, Default)]
pub struct CheckReport {
    /// Blocks examined (holes skipped without I/O are not counted).
    pub blocks_checked: u64,
    pub faults: Vec<Fault>,
}

/// Verify every block of `device` that may hold data. `progress(done,
/// total)` is called after each chunk, in blocks.
pub fn check(device: &dyn BlockDevice, mut progress: impl FnMut(u64, u64)) -> Result<CheckReport> {
    let total = device.size() / BLOCK;
    let mut report = CheckReport::default();
    let control = JobControl::default();
    scan(device, ScanOptions::default(), &control, None, |chunk| {
        report.faults.extend_from_slice(chunk.faults);
        report.blocks_checked += chunk.count;
        progress(chunk.lba + chunk.count, total);
        Ok(())
    })?;
    progress(total, total);
    Ok(report)
}
