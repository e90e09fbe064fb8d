//! Scrub: a verify of the whole device as a background job, its record
//! persisted in the volume directory (`scrub.json`, docs/FORMAT.md) so that
//! `vouch info` and the metrics show the last one and a scrub interrupted
//! by a crash or a cancel resumes from its cursor.
//!
//! The record is replaced atomically (temporary file, fsync, rename, fsync
//! of the directory) together with the cursor, every time the scan saves
//! its cursor (`jobs::CURSOR_SAVE_INTERVAL`): the
//! faults and counts in it are always those of the blocks before the
//! cursor, so a resumed scrub neither loses nor repeats one.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::device::BlockDevice;
use crate::error::{Error, Fault, FaultKind, Result};
use crate::jobs::{scan, Cursor, Foreground, JobControl, ScanEnd, ScanOptions};
use crate::replace::replace_file;
use crate::state::BLOCK;

/// The record's file in the volume directory.
pub const SCRUB_FILE: &str = "scrub.json";

/// Faults kept in the record; past this only `faults_found` grows.
pub const MAX_RECORDED_FAULTS: usize = 65536;

/// How long a scrub waits before its next chunk when foreground requests
/// arrived while it read the last one (the jobs' pacer's back-off).
pub use crate::jobs::FOREGROUND_BACKOFF;

/// How a scrub runs: a volume's (`scrub`) or a mirror's
/// (`vouch_mirror::scrub::scrub`).
#[derive(Clone, Default)]
pub struct ScrubOptions {
    /// Bytes per second read at most (`None`: as fast as it goes).
    pub rate_bytes_per_second: Option<u64>,
    /// A monotonic count of foreground requests (the NBD server's); when it
    /// moves, the scrub backs off so foreground I/O goes first.
    pub foreground: Option<Foreground>,
}

/// Where a scrub is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScrubState {
    Running,
    Finished,
    Cancelled,
    Failed,
}

impl ScrubState {
    /// Stable snake_case name (JSON, metrics, `vouch info`).
    pub fn name(self) -> &'static str {
        match self {
            ScrubState::Running => "running",
            ScrubState::Finished => "finished",
            ScrubState::Cancelled => "cancelled",
            ScrubState::Failed => "failed",
        }
    }
}

/// Persisted in the volume directory (scrub.json, replaced atomically) and
/// shown by `vouch info` and the metrics. `faults` is the shape a repairer
/// (issue 14) consumes.
#[derive(Clone, Debug)]
pub struct ScrubRecord {
    pub state: ScrubState,
    pub started_unix: u64,
    pub finished_unix: Option<u64>,
    /// Every block before it is checked.
    pub cursor: u64,
    pub blocks_total: u64,
    /// Blocks read and verified (holes are skipped, not read).
    pub blocks_checked: u64,
    /// The faulty blocks in LBA order, at most `MAX_RECORDED_FAULTS`.
    pub faults: Vec<Fault>,
    /// Faults found in all, also those past the cap.
    pub faults_found: u64,
    /// Why a `Failed` scrub stopped.
    pub error: Option<String>,
}

/// `scrub.json`, version 1 (docs/FORMAT.md).
#[derive(Serialize, Deserialize)]
struct RecordFile {
    version: u32,
    state: ScrubState,
    started_unix: u64,
    finished_unix: Option<u64>,
    cursor: u64,
    blocks_total: u64,
    blocks_checked: u64,
    faults_found: u64,
    faults: Vec<FaultEntry>,
    error: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct FaultEntry {
    lba: u64,
    kind: String,
}

const RECORD_VERSION: u32 = 1;

impl ScrubRecord {
    fn to_file(&self) -> RecordFile {
        RecordFile {
            version: RECORD_VERSION,
            state: self.state,
            started_unix: self.started_unix,
            finished_unix: self.finished_unix,
            cursor: self.cursor,
            blocks_total: self.blocks_total,
            blocks_checked: self.blocks_checked,
            faults_found: self.faults_found,
            faults: self
                .faults
                .iter()
                .map(|fault| FaultEntry {
                    lba: fault.lba,
                    kind: fault.kind.name().to_string(),
                })
                .collect(),
            error: self.error.clone(),
        }
    }

    fn from_file(file: RecordFile) -> std::result::Result<ScrubRecord, String> {
        if file.version != RECORD_VERSION {
            return Err(format!("unknown version {}", file.version));
        }
        let faults = file
            .faults
            .into_iter()
            .map(|entry| {
                FaultKind::ALL
                    .into_iter()
                    .find(|kind| kind.name() == entry.kind)
                    .map(|kind| Fault {
                        lba: entry.lba,
                        kind,
                    })
                    .ok_or_else(|| format!("unknown fault kind {:?}", entry.kind))
            })
            .collect::<std::result::Result<Vec<_>, String>>()?;
        Ok(ScrubRecord {
            state: file.state,
            started_unix: file.started_unix,
            finished_unix: file.finished_unix,
            cursor: file.cursor,
            blocks_total: file.blocks_total,
            blocks_checked: file.blocks_checked,
            faults,
            faults_found: file.faults_found,
            error: file.error,
        })
    }

    fn note(&mut self, faults: &[Fault]) {
        self.faults_found += faults.len() as u64;
        let room = MAX_RECORDED_FAULTS.saturating_sub(self.faults.len());
        self.faults.extend(faults.iter().take(room).cloned());
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|since| since.as_secs())
        .unwrap_or(0)
}

fn path_error(action: &'static str, path: &Path, cause: impl std::fmt::Display) -> Error {
    Error::Path {
        action,
        path: path.to_path_buf(),
        cause: cause.to_string(),
    }
}

/// Replace `dir/scrub.json` with `record`: temporary file, fsync, rename,
/// fsync of the directory. After a crash the file holds the old or the new
/// record.
fn save_record(dir: &Path, record: &ScrubRecord) -> Result<()> {
    let path = dir.join(SCRUB_FILE);
    let temporary = dir.join(format!("{SCRUB_FILE}.tmp"));
    let mut text = serde_json::to_vec_pretty(&record.to_file())
        .map_err(|error| path_error("encode the scrub record", &path, error))?;
    text.push(b'\n');
    replace_file(&temporary, &path, &text).map_err(|error| {
        let _ = std::fs::remove_file(&temporary);
        let hint = match error.raw_os_error() {
            Some(libc::EROFS) | Some(libc::EACCES) | Some(libc::EPERM) => {
                " (a scrub keeps its record in the volume directory, which must be writable)"
            }
            _ => "",
        };
        path_error("write the scrub record", &path, format!("{error}{hint}"))
    })
}

/// The last scrub's record, if any.
pub fn last_scrub(dir: &Path) -> Result<Option<ScrubRecord>> {
    let path = dir.join(SCRUB_FILE);
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(path_error("read the scrub record", &path, error)),
    };
    let file: RecordFile = serde_json::from_slice(&text)
        .map_err(|error| path_error("parse the scrub record", &path, error))?;
    ScrubRecord::from_file(file)
        .map(Some)
        .map_err(|error| path_error("parse the scrub record", &path, error))
}

/// The scan's cursor is the record's: saving it writes the whole record.
struct RecordCursor<'a> {
    dir: &'a Path,
    record: &'a Mutex<ScrubRecord>,
    resume: Option<u64>,
}

impl Cursor for RecordCursor<'_> {
    fn load(&self) -> Result<Option<u64>> {
        Ok(self.resume)
    }
    fn save(&self, lba: u64) -> Result<()> {
        let snapshot = {
            let mut record = self.record.lock();
            record.cursor = lba;
            record.clone()
        };
        save_record(self.dir, &snapshot)
    }
    fn clear(&self) -> Result<()> {
        // The finished record replaces it (`scrub`).
        Ok(())
    }
}

/// Volume directories with a scrub running in this process.
static RUNNING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Marks `dir` as scrubbing while it lives.
struct RunningGuard(PathBuf);

impl RunningGuard {
    fn take(dir: &Path) -> Result<RunningGuard> {
        let key = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        let mut running = RUNNING.lock();
        if running.contains(&key) {
            return Err(Error::InvalidArgument(format!(
                "a scrub of {} is already running",
                dir.display()
            )));
        }
        running.push(key.clone());
        Ok(RunningGuard(key))
    }
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        RUNNING.lock().retain(|dir| *dir != self.0);
    }
}

/// Run (or resume, if the last record is Running/Cancelled with a cursor) a
/// scrub of the whole device; the record in `dir` is kept up to date.
///
/// Returns the final record: `Finished`, or `Cancelled` (through
/// `control`; the next call resumes from its cursor). An I/O error that
/// stops the scan is recorded as `Failed` with the error, and returned; the
/// next call starts a new scrub. A directory the record cannot be written
/// to fails before anything is read.
pub fn scrub(
    device: &dyn BlockDevice,
    dir: &Path,
    options: &ScrubOptions,
    control: &JobControl,
) -> Result<ScrubRecord> {
    let _running = RunningGuard::take(dir)?;
    let blocks_total = device.size() / BLOCK;
    let resumable = last_scrub(dir).ok().flatten().filter(|last| {
        matches!(last.state, ScrubState::Running | ScrubState::Cancelled)
            && last.blocks_total == blocks_total
            && last.cursor <= blocks_total
    });
    let resume = resumable.as_ref().map(|last| last.cursor);
    let mut record = resumable.unwrap_or(ScrubRecord {
        state: ScrubState::Running,
        started_unix: now_unix(),
        finished_unix: None,
        cursor: 0,
        blocks_total,
        blocks_checked: 0,
        faults: Vec::new(),
        faults_found: 0,
        error: None,
    });
    record.state = ScrubState::Running;
    record.finished_unix = None;
    record.error = None;
    save_record(dir, &record)?;
    if let Some(at) = resume {
        tracing::info!(dir = %dir.display(), at, "resuming the scrub from its cursor");
    }

    let shared = Mutex::new(record);
    let cursor = RecordCursor {
        dir,
        record: &shared,
        resume,
    };
    let scanned = scan(
        device,
        ScanOptions {
            start: 0,
            end: None,
            rate_bytes_per_second: options.rate_bytes_per_second,
            // Foreground requests that arrived while a chunk was read go
            // first: the scan's pacer backs off.
            foreground: options.foreground.clone(),
            fixed_chunks: false,
        },
        control,
        Some(&cursor),
        |chunk| {
            let mut record = shared.lock();
            record.note(chunk.faults);
            record.blocks_checked += chunk.count;
            Ok(())
        },
    );
    let mut record = shared.into_inner();
    match scanned {
        Ok(ScanEnd::Finished) => {
            record.state = ScrubState::Finished;
            record.cursor = blocks_total;
            record.finished_unix = Some(now_unix());
        }
        Ok(ScanEnd::Cancelled { at }) => {
            record.state = ScrubState::Cancelled;
            record.cursor = at;
        }
        Err(error) => {
            // The counts may run ahead of the cursor saved last; the record
            // keeps them (it is advisory) and the next scrub starts anew.
            record.state = ScrubState::Failed;
            record.finished_unix = Some(now_unix());
            record.error = Some(error.to_string());
            if let Err(saving) = save_record(dir, &record) {
                tracing::warn!(%saving, "cannot record the failed scrub");
            }
            return Err(error);
        }
    }
    save_record(dir, &record)?;
    Ok(record)
}
