//! ADAPTER (see `engine_api`): scrub with a record (`scrub.json`) in the
//! volume directory that holds its cursor, so it resumes after a restart.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use vouch_engine::jobs::{scan, Cursor, JobControl, ScanEnd, ScanOptions};
use vouch_engine::{BlockDevice, Error, Fault, FaultKind, Result, BLOCK};

#[derive(Clone, Default)]
/// How fast a scrub reads and what it yields to.
pub struct ScrubOptions {
    pub rate_bytes_per_second: Option<u64>,
    pub foreground: Option<Arc<dyn Fn() -> u64 + Send + Sync>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScrubState {
    Running,
    Finished,
    Cancelled,
    Failed,
}

#[derive(Clone, Debug)]
pub struct ScrubRecord {
    pub state: ScrubState,
    pub started_unix: u64,
    pub finished_unix: Option<u64>,
    pub cursor: u64,
    pub blocks_total: u64,
    pub blocks_checked: u64,
    pub faults: Vec<Fault>,
    pub error: Option<String>,
}

/// `ScrubRecord` as this adapter stores it (`scrub.json`).
#[derive(Serialize, Deserialize)]
struct StoredRecord {
    state: ScrubState,
    started_unix: u64,
    finished_unix: Option<u64>,
    cursor: u64,
    blocks_total: u64,
    blocks_checked: u64,
    faults: Vec<(u64, String)>,
    error: Option<String>,
}

const SCRUB_RECORD: &str = "scrub.json";
/// The record is rewritten at most this often while a scrub runs.
const SAVE_INTERVAL: Duration = Duration::from_millis(500);
/// How long a scrub pauses when foreground requests arrived.
const FOREGROUND_BACKOFF: Duration = Duration::from_millis(20);

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn kind_from_name(name: &str) -> Option<FaultKind> {
    FaultKind::ALL.into_iter().find(|kind| kind.name() == name)
}

fn save_record(dir: &Path, record: &ScrubRecord) -> Result<()> {
    let stored = StoredRecord {
        state: record.state,
        started_unix: record.started_unix,
        finished_unix: record.finished_unix,
        cursor: record.cursor,
        blocks_total: record.blocks_total,
        blocks_checked: record.blocks_checked,
        faults: record
            .faults
            .iter()
            .map(|f| (f.lba, f.kind.name().to_string()))
            .collect(),
        error: record.error.clone(),
    };
    let path = dir.join(SCRUB_RECORD);
    let temporary = dir.join("scrub.json.tmp");
    let write = || -> std::io::Result<()> {
        let text = serde_json::to_vec_pretty(&stored).map_err(std::io::Error::other)?;
        let file = std::fs::File::create(&temporary)?;
        std::io::Write::write_all(&mut &file, &text)?;
        file.sync_all()?;
        std::fs::rename(&temporary, &path)?;
        std::fs::File::open(dir)?.sync_all()
    };
    write().map_err(|error| Error::Path {
        action: "save the scrub record",
        path,
        cause: error.to_string(),
    })
}

/// The last scrub's record, if any.
pub fn last_scrub(dir: &Path) -> Result<Option<ScrubRecord>> {
    let path = dir.join(SCRUB_RECORD);
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => {
            return Err(Error::Path {
                action: "read the scrub record",
                path,
                cause: error.to_string(),
            })
        }
    };
    let stored: StoredRecord = serde_json::from_slice(&text).map_err(|error| Error::Path {
        action: "parse the scrub record",
        path: path.clone(),
        cause: error.to_string(),
    })?;
    let mut faults = Vec::new();
    for (lba, name) in stored.faults {
        let kind = kind_from_name(&name).ok_or_else(|| Error::Path {
            action: "parse the scrub record",
            path: path.clone(),
            cause: format!("unknown fault kind {name:?}"),
        })?;
        faults.push(Fault { lba, kind });
    }
    Ok(Some(ScrubRecord {
        state: stored.state,
        started_unix: stored.started_unix,
        finished_unix: stored.finished_unix,
        cursor: stored.cursor,
        blocks_total: stored.blocks_total,
        blocks_checked: stored.blocks_checked,
        faults,
        error: stored.error,
    }))
}

/// The scan cursor lives in the record: saving it rewrites the record (at
/// most every `SAVE_INTERVAL`; the cursor never runs ahead of the faults).
struct RecordCursor<'a> {
    dir: &'a Path,
    record: &'a Mutex<ScrubRecord>,
    last_save: Mutex<Instant>,
}

impl Cursor for RecordCursor<'_> {
    fn load(&self) -> Result<Option<u64>> {
        Ok(Some(self.record.lock().cursor))
    }
    fn save(&self, lba: u64) -> Result<()> {
        let mut record = self.record.lock();
        record.cursor = lba;
        let mut last = self.last_save.lock();
        if last.elapsed() >= SAVE_INTERVAL {
            *last = Instant::now();
            save_record(self.dir, &record)?;
        }
        Ok(())
    }
    fn clear(&self) -> Result<()> {
        Ok(())
    }
}

/// Scrub the whole device, resuming a Running/Cancelled record from its cursor.
pub fn scrub(
    device: &dyn BlockDevice,
    dir: &Path,
    options: &ScrubOptions,
    control: &JobControl,
) -> Result<ScrubRecord> {
    let blocks = device.size() / BLOCK;
    let record = match last_scrub(dir)? {
        Some(old)
            if matches!(old.state, ScrubState::Running | ScrubState::Cancelled)
                && old.blocks_total == blocks =>
        {
            ScrubRecord {
                state: ScrubState::Running,
                finished_unix: None,
                error: None,
                ..old
            }
        }
        _ => ScrubRecord {
            state: ScrubState::Running,
            started_unix: now_unix(),
            finished_unix: None,
            cursor: 0,
            blocks_total: blocks,
            blocks_checked: 0,
            faults: Vec::new(),
            error: None,
        },
    };
    save_record(dir, &record)?;
    let record = Mutex::new(record);
    let cursor = RecordCursor {
        dir,
        record: &record,
        last_save: Mutex::new(Instant::now()),
    };
    let mut seen = options.foreground.as_ref().map(|count| count());
    let scan_options = ScanOptions {
        start: 0,
        end: None,
        rate_bytes_per_second: options.rate_bytes_per_second,
    };
    let result = scan(device, scan_options, control, Some(&cursor), |chunk| {
        let mut record = record.lock();
        record.faults.extend_from_slice(chunk.faults);
        record.blocks_checked += chunk.count;
        drop(record);
        if let (Some(count), Some(last)) = (options.foreground.as_ref(), seen.as_mut()) {
            let now = count();
            if now != *last {
                *last = now;
                std::thread::sleep(FOREGROUND_BACKOFF);
            }
        }
        Ok(())
    });
    let mut record = record.into_inner();
    match result {
        Ok(ScanEnd::Finished) => {
            record.state = ScrubState::Finished;
            record.cursor = blocks;
            record.finished_unix = Some(now_unix());
        }
        Ok(ScanEnd::Cancelled { at }) => {
            record.state = ScrubState::Cancelled;
            record.cursor = at;
        }
        Err(error) => {
            record.state = ScrubState::Failed;
            record.error = Some(error.to_string());
            record.finished_unix = Some(now_unix());
        }
    }
    save_record(dir, &record)?;
    Ok(record)
}
