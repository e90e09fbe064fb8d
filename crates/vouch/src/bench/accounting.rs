//! Write accounting outside the engine (/proc/self/io, the block device's
//! sysfs counters) and the engine's own counters over one test.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use vouch_engine::StatsSnapshot;

pub(super) fn sync_all() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

/// `write_bytes - cancelled_write_bytes` of this process (all threads).
pub(super) fn proc_write_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    let field = |name: &str| -> Option<u64> {
        text.lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().parse().ok())
    };
    Some(field("write_bytes:")?.saturating_sub(field("cancelled_write_bytes:").unwrap_or(0)))
}

/// The sysfs stat file of the block device under `dir`.
pub(super) fn device_stat_path(dir: &Path) -> Option<PathBuf> {
    let dev = std::fs::metadata(dir).ok()?.dev();
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let path = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/stat"));
    path.exists().then_some(path)
}

pub(super) fn device_write_bytes(stat: Option<&Path>) -> Option<u64> {
    let text = std::fs::read_to_string(stat?).ok()?;
    let sectors: u64 = text.split_whitespace().nth(6)?.parse().ok()?;
    Some(sectors * 512)
}

pub(super) fn engine_delta(after: &StatsSnapshot, before: &StatsSnapshot) -> Value {
    json!({
        "client_bytes_written": after.client_bytes_written - before.client_bytes_written,
        "client_bytes_read": after.client_bytes_read - before.client_bytes_read,
        "journal_bytes_written": after.journal_bytes_written - before.journal_bytes_written,
        "data_bytes_written": after.data_bytes_written - before.data_bytes_written,
        "context_bytes_written": after.context_bytes_written - before.context_bytes_written,
        "superblock_bytes_written": after.superblock_bytes_written - before.superblock_bytes_written,
        "backing_bytes_written": after.backing_bytes_written() - before.backing_bytes_written(),
        "backing_bytes_read": after.backing_bytes_read - before.backing_bytes_read,
        "syncs": after.syncs - before.syncs,
        "commits": after.commits - before.commits,
        "checkpoints": after.checkpoints - before.checkpoints,
        "flushes": after.flushes - before.flushes,
        "rechecks_recovered": after.rechecks_recovered - before.rechecks_recovered,
    })
}
