//! How a volume is created and opened, and the engine's tuning knobs.

use std::sync::Arc;

use vouch_format::{GuardKind, LayoutKind};

use crate::keys::UserSecret;
use crate::schedule::CommitSchedule;

/// Knobs with measured defaults (see docs/BENCHMARKS.md).
#[derive(Clone, Copy, Debug)]
pub struct Tuning {
    /// Blocks buffered before a commit starts (16 MiB). Writers block at twice this.
    pub dirty_limit_blocks: usize,
    /// Clean context pages cached (split layout): 16384 pages = 64 MiB,
    /// enough for every context of an 8 GiB volume.
    pub context_cache_pages: usize,
    /// Committed-but-not-checkpointed contexts before a checkpoint (split):
    /// 1 Mi = at most 64 MiB resident. Each checkpoint writes back every
    /// dirty data page (order point B), so a larger overlay (and journal)
    /// means fewer of them: measured in docs/BENCHMARKS.md.
    pub overlay_limit: usize,
    /// Commit full write-back buffers on a background thread, so writers
    /// never wait for the journal or home writes until the buffer reaches
    /// twice `dirty_limit_blocks`. Off: the writer that fills the buffer
    /// commits it inline (tests, and the simulators' checks of their crash
    /// images; their workloads step the background committer instead:
    /// `OpenOptions::schedule`).
    pub background_commit: bool,
    /// Commit before the dirty limit as writes come, once more than a
    /// flush's redo record was written since the last flush
    /// (`Committer::prompt`). Off: only at the limit, a flush or FUA
    /// (fewer journal fsyncs for a client that never flushes).
    pub prompt_commits: bool,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            dirty_limit_blocks: 4096,
            context_cache_pages: 16384,
            overlay_limit: 1024 * 1024,
            background_commit: true,
            prompt_commits: true,
        }
    }
}

#[derive(Clone, Debug)]
pub struct CreateOptions {
    pub size_bytes: u64,
    pub layout: LayoutKind,
    pub guard: GuardKind,
    /// Blocks per data segment file (default: 1 TiB of data).
    pub segment_blocks: Option<u64>,
    /// Journal capacity (default: 128 MiB split, 64 MiB packed).
    pub journal_bytes: Option<u64>,
    /// Encrypt the volume, its data key wrapped by this key or passphrase
    /// (`keys.rs`); `None`: a plain volume.
    pub encrypt: Option<UserSecret>,
}

impl CreateOptions {
    pub fn new(size_bytes: u64) -> CreateOptions {
        CreateOptions {
            size_bytes,
            layout: LayoutKind::Split,
            guard: GuardKind::Crc32c,
            segment_blocks: None,
            journal_bytes: None,
            encrypt: None,
        }
    }

    pub fn journal_bytes(&self) -> u64 {
        self.journal_bytes
            .unwrap_or_else(|| default_journal_bytes(self.layout))
    }

    pub fn segment_blocks(&self) -> u64 {
        self.segment_blocks
            .unwrap_or_else(|| vouch_format::layout::default_segment_blocks(self.layout))
    }
}

/// Default journal capacity per layout: a packed journal carries data.
fn default_journal_bytes(kind: LayoutKind) -> u64 {
    match kind {
        LayoutKind::Split => 128 << 20,
        LayoutKind::Packed => 64 << 20,
    }
}

#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    pub read_only: bool,
    /// Data segments bypass the host page cache (O_DIRECT, like qemu's
    /// cache=none); used by `open_volume` (file storage only).
    pub direct: bool,
    pub tuning: Tuning,
    /// The key (or passphrase) of an encrypted volume; ignored by a plain
    /// one. An encrypted volume opened without it is refused, unless
    /// `keyless` is set.
    pub key: Option<UserSecret>,
    /// Open an encrypted volume without its key, read-only: reads return
    /// ciphertext checked only by the keyless guard (`check --keyless`,
    /// scrub and verify without handing out the key). Never served.
    pub keyless: bool,
    /// Build the written map from the metadata on disk (`vouch upgrade`):
    /// a volume made before the map becomes writable, and a map that is
    /// missing or damaged is made again. Needs a writable open.
    pub rebuild_written_map: bool,
    /// Open a member of a REGIONS volume (`regions.rs`): a superblock
    /// with the REGIONS flag is refused without it, so no caller serves
    /// one member as if it held the whole volume.
    pub region_member: bool,
    /// Who runs the background committer (with `Tuning::background_commit`
    /// on): `None`, a thread of the volume's; `Some`, the caller, which
    /// runs each requested commit (`Volume::run_requested_commit`) and is
    /// called at every commit's steps (`schedule.rs`: the simulator).
    pub schedule: Option<Arc<dyn CommitSchedule>>,
}

impl OpenOptions {
    /// Defaults, but commits run only when a writer or the caller commits
    /// (no background committer): tests and the simulators, where what is
    /// buffered or committed must be settled whenever a call returns.
    pub fn foreground() -> OpenOptions {
        OpenOptions {
            tuning: Tuning {
                background_commit: false,
                ..Tuning::default()
            },
            ..OpenOptions::default()
        }
    }
}
