//! What opening a volume found and did: a plain record, filled by
//! recovery and by each layout's replay (a leaf, so layouts need not
//! import recovery).

use std::time::Duration;

#[derive(Clone, Debug, Default)]
pub struct RecoveryReport {
    /// The superblock said the volume was closed cleanly.
    pub was_clean: bool,
    pub records_replayed: u64,
    pub blocks_verified: u64,
    /// Blocks whose newest write had not reached home: they read old data.
    pub blocks_reverted: u64,
    /// Blocks torn below 4 KiB (media broke the atomicity assumption).
    pub blocks_torn: Vec<u64>,
    /// Blocks whose data could not be read back to verify them.
    pub blocks_unreadable: Vec<u64>,
    /// Blocks a crashed process had acknowledged and not committed, put
    /// back from the held log (`held.rs`).
    pub held_blocks: u64,
    pub duration: Duration,
}
