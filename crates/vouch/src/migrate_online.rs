//! Online migration of a served volume with regions (issue 33): one
//! background migration per export, started, followed and stopped through
//! the control API (`/v1/exports/{export}/migrate`, docs/PROTOCOL.md),
//! its progress in the metrics too. The move itself is the engine's
//! (`RegionVolume::migrate_online`: foreground requests go on).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use serde_json::{json, Value};
use vouch_engine::regions::{OnlineMigrate, RegionVolume};
use vouch_format::LayoutKind;

/// Where a migration is.
#[derive(Clone, Debug, Default)]
struct Status {
    /// idle (none yet), running, done, stopped or failed.
    state: &'static str,
    target: Option<LayoutKind>,
    rate: Option<u64>,
    done_bytes: u64,
    total_bytes: u64,
    moved: u64,
    seconds: f64,
    error: Option<String>,
}

/// An export's online migration.
pub struct Migration {
    pub volume: Arc<RegionVolume>,
    status: Mutex<Status>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Migration {
    pub fn new(volume: Arc<RegionVolume>) -> Migration {
        Migration {
            volume,
            status: Mutex::new(Status {
                state: "idle",
                ..Status::default()
            }),
            stop: Arc::new(AtomicBool::new(false)),
            thread: Mutex::new(None),
        }
    }

    /// Start moving every region to `target` in the background, at most
    /// `rate` bytes a second. Refused while one runs.
    pub fn start(self: &Arc<Self>, target: LayoutKind, rate: Option<u64>) -> Result<Value, String> {
        let mut thread = self.thread.lock();
        if self.status.lock().state == "running" {
            return Err("a migration of this export is running: stop it first (DELETE)".into());
        }
        if let Some(old) = thread.take() {
            let _ = old.join();
        }
        if vouch_engine::BlockDevice::is_read_only(&*self.volume) {
            return Err("the export is read-only".into());
        }
        self.stop.store(false, Ordering::SeqCst);
        *self.status.lock() = Status {
            state: "running",
            target: Some(target),
            rate,
            ..Status::default()
        };
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("vouch-migrate".into())
            .spawn(move || me.run(target, rate))
            .map_err(|error| format!("cannot start the migration's thread: {error}"))?;
        *thread = Some(spawned);
        Ok(self.status_json())
    }

    fn run(&self, target: LayoutKind, rate: Option<u64>) {
        let started = Instant::now();
        let how = OnlineMigrate {
            target,
            rate,
            stop: &self.stop,
        };
        let result = self.volume.migrate_online(&how, |done, total| {
            let mut status = self.status.lock();
            status.done_bytes = done;
            status.total_bytes = total;
            status.seconds = started.elapsed().as_secs_f64();
        });
        let mut status = self.status.lock();
        status.seconds = started.elapsed().as_secs_f64();
        match result {
            Ok(report) => {
                status.state = "done";
                status.moved = report.moved;
                tracing::info!(
                    moved = report.moved,
                    target = target.name(),
                    "online migration done"
                );
            }
            Err(vouch_engine::Error::Cancelled(message)) => {
                status.state = "stopped";
                status.error = Some(message);
            }
            Err(error) => {
                tracing::warn!(%error, "online migration failed");
                status.state = "failed";
                status.error = Some(error.to_string());
            }
        }
    }

    /// Ask the running migration to stop between regions; the answer is
    /// the status (still "running" until the region in hand is switched).
    pub fn stop(&self) -> Value {
        self.stop.store(true, Ordering::SeqCst);
        self.status_json()
    }

    /// Run `f` with no migration running and none starting meanwhile (an
    /// online resize: `crate::resize::resize_online_regions`).
    pub fn while_idle<T>(&self, f: impl FnOnce() -> T) -> Result<T, String> {
        let _thread = self.thread.lock();
        if self.status.lock().state == "running" {
            return Err("a migration of this export is running: stop it (DELETE /v1/exports/{export}/migrate, or wait for it to end), then resize".into());
        }
        Ok(f())
    }

    /// Wait for the migration's thread (the server is stopping).
    pub fn stop_and_join(&self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
    }

    pub fn status_json(&self) -> Value {
        let status = self.status.lock().clone();
        let [split, packed] = self.volume.record().counts();
        json!({
            "state": status.state,
            "target": status.target.map(|target| target.name()),
            "rate": status.rate,
            "done_bytes": status.done_bytes,
            "total_bytes": status.total_bytes,
            "regions_moved": status.moved,
            "seconds": status.seconds,
            "mb_per_second": if status.seconds > 0.0 { status.done_bytes as f64 / status.seconds / 1e6 } else { 0.0 },
            "error": status.error,
            "regions": {"split": split, "packed": packed},
            "migrate_on_write": self.volume.migrate_on_write().map(|layout| layout.name()),
            // A switch whose record write failed: writes refused until a
            // restart (docs/CRASH_MODEL.md, "A failed switch").
            "fenced": self.volume.fenced(),
        })
    }

    /// Prometheus gauges, one series per export.
    pub fn publish(&self, export: &str) {
        let status = self.status.lock().clone();
        let [split, packed] = self.volume.record().counts();
        metrics::describe_gauge!(
            "vouch_migration_done_bytes",
            "Bytes the online migration has copied"
        );
        metrics::gauge!("vouch_migration_done_bytes", "volume" => export.to_string())
            .set(status.done_bytes as f64);
        metrics::describe_gauge!(
            "vouch_migration_total_bytes",
            "Bytes the online migration has to copy"
        );
        metrics::gauge!("vouch_migration_total_bytes", "volume" => export.to_string())
            .set(status.total_bytes as f64);
        metrics::describe_gauge!(
            "vouch_migration_running",
            "1 while an online migration runs"
        );
        metrics::gauge!("vouch_migration_running", "volume" => export.to_string())
            .set(f64::from(u8::from(status.state == "running")));
        metrics::describe_gauge!("vouch_regions", "Regions served by each layout");
        for (layout, count) in [("split", split), ("packed", packed)] {
            metrics::gauge!("vouch_regions", "volume" => export.to_string(), "layout" => layout)
                .set(count as f64);
        }
    }
}
