//! Counters: what the engine did, by kind. Read by `info`, benchmarks
//! (write amplification = backing bytes written / client bytes written)
//! and the Prometheus endpoint.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::FaultKind;
use crate::storage::ObjectId;

#[derive(Default, Debug)]
pub struct Stats {
    pub client_bytes_written: AtomicU64,
    pub client_bytes_read: AtomicU64,
    pub journal_bytes_written: AtomicU64,
    pub data_bytes_written: AtomicU64,
    pub context_bytes_written: AtomicU64,
    pub superblock_bytes_written: AtomicU64,
    pub backing_bytes_read: AtomicU64,
    pub syncs: AtomicU64,
    pub commits: AtomicU64,
    pub checkpoints: AtomicU64,
    pub flushes: AtomicU64,
    pub rechecks_recovered: AtomicU64,
    faults: [AtomicU64; FaultKind::ALL.len()],
}

/// A copy of the counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub client_bytes_written: u64,
    pub client_bytes_read: u64,
    pub journal_bytes_written: u64,
    pub data_bytes_written: u64,
    pub context_bytes_written: u64,
    pub superblock_bytes_written: u64,
    pub backing_bytes_read: u64,
    pub syncs: u64,
    pub commits: u64,
    pub checkpoints: u64,
    pub flushes: u64,
    pub rechecks_recovered: u64,
    pub faults: [u64; FaultKind::ALL.len()],
}

impl StatsSnapshot {
    pub fn backing_bytes_written(&self) -> u64 {
        self.journal_bytes_written
            + self.data_bytes_written
            + self.context_bytes_written
            + self.superblock_bytes_written
    }

    /// Backing bytes written per client byte written, over the interval
    /// since `before`.
    pub fn write_amplification_since(&self, before: &StatsSnapshot) -> f64 {
        let client = self.client_bytes_written - before.client_bytes_written;
        if client == 0 {
            return 0.0;
        }
        (self.backing_bytes_written() - before.backing_bytes_written()) as f64 / client as f64
    }

    pub fn faults_of(&self, kind: FaultKind) -> u64 {
        self.faults[FaultKind::ALL
            .iter()
            .position(|k| *k == kind)
            .expect("listed")]
    }
}

impl Stats {
    pub(crate) fn add_written(&self, object: ObjectId, bytes: u64) {
        let counter = match object {
            ObjectId::Journal => &self.journal_bytes_written,
            ObjectId::Contexts => &self.context_bytes_written,
            ObjectId::Superblock | ObjectId::Written | ObjectId::Held(_) => {
                &self.superblock_bytes_written
            }
            ObjectId::Data(_) => &self.data_bytes_written,
        };
        counter.fetch_add(bytes, Ordering::Relaxed);
    }
    pub(crate) fn add_read(&self, bytes: u64) {
        self.backing_bytes_read.fetch_add(bytes, Ordering::Relaxed);
    }
    pub(crate) fn add_client_write(&self, bytes: u64) {
        self.client_bytes_written
            .fetch_add(bytes, Ordering::Relaxed);
    }
    pub(crate) fn add_client_read(&self, bytes: u64) {
        self.client_bytes_read.fetch_add(bytes, Ordering::Relaxed);
    }
    pub(crate) fn count_fault(&self, kind: FaultKind) {
        let index = FaultKind::ALL
            .iter()
            .position(|k| *k == kind)
            .expect("listed");
        self.faults[index].fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        StatsSnapshot {
            client_bytes_written: load(&self.client_bytes_written),
            client_bytes_read: load(&self.client_bytes_read),
            journal_bytes_written: load(&self.journal_bytes_written),
            data_bytes_written: load(&self.data_bytes_written),
            context_bytes_written: load(&self.context_bytes_written),
            superblock_bytes_written: load(&self.superblock_bytes_written),
            backing_bytes_read: load(&self.backing_bytes_read),
            syncs: load(&self.syncs),
            commits: load(&self.commits),
            checkpoints: load(&self.checkpoints),
            flushes: load(&self.flushes),
            rechecks_recovered: load(&self.rechecks_recovered),
            faults: std::array::from_fn(|index| load(&self.faults[index])),
        }
    }
}
