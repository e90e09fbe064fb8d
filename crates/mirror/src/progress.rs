//! What the mirror's background work reports and how fast it may go:
//! the progress of a resync and of a reconciliation (`vouch mirror
//! status`), and the rate limits both run under. A leaf: the `Mirror`
//! keeps these for its status, the jobs fill them in.

use vouch_engine::jobs::Pace;

/// Resync speed limits in bytes per second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResyncRate {
    /// Never slower than this (while clients are busy).
    pub min: u64,
    /// Never faster than this (while clients are idle).
    pub max: u64,
}

impl ResyncRate {
    /// The jobs' pace of this floor and ceiling.
    pub fn pace(self) -> Pace {
        Pace::FloorCeiling {
            min: self.min,
            max: self.max,
        }
    }
}

impl Default for ResyncRate {
    /// md's defaults: 1 MB/s floor, 200 MB/s ceiling.
    fn default() -> ResyncRate {
        ResyncRate {
            min: 1_000_000,
            max: 200_000_000,
        }
    }
}

/// A resync's progress, as `vouch mirror status` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResyncProgress {
    /// Dirty blocks when it started.
    pub total: u64,
    /// Blocks copied so far.
    pub copied: u64,
    /// Dirty blocks left (the map's count).
    pub left: u64,
    /// Whether the map started full (unknown history).
    pub full: bool,
    /// Bytes per second over the resync so far.
    pub rate: u64,
    /// Seconds to go at that rate (`None` before a rate is known).
    pub eta_seconds: Option<u64>,
    /// `running`, `done`, `stopped` or `failed`.
    pub state: &'static str,
    /// Why it failed or stopped, or which blocks are left.
    pub error: Option<String>,
    pub elapsed_ms: u64,
    /// Times the job waited for its pace (`JobControl::paced_waits`).
    pub paced_waits: u64,
}

/// A reconciliation's progress, as `vouch mirror status` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReconcileProgress {
    /// Extents (regions) the activity log named at open.
    pub extents: u64,
    /// Extents left to check.
    pub extents_left: u64,
    /// Blocks per extent.
    pub extent_blocks: u64,
    /// Blocks checked on every active leg so far.
    pub blocks_checked: u64,
    /// Blocks left to check.
    pub blocks_left: u64,
    /// Blocks copied to a leg that differed.
    pub blocks_copied: u64,
    /// Blocks that could not be settled (bad on every leg, or a conflict).
    pub blocks_left_unsettled: u64,
    /// Bytes checked per second so far.
    pub rate: u64,
    /// Seconds to go at that rate (`None` before a rate is known).
    pub eta_seconds: Option<u64>,
    /// `running`, `done`, `stopped` or `failed`.
    pub state: &'static str,
    pub error: Option<String>,
    pub elapsed_ms: u64,
    /// Times the job waited for its pace (`JobControl::paced_waits`).
    pub paced_waits: u64,
}
