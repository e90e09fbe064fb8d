//! The running server's offload jobs: what each one is, a bounded pool of
//! blocking threads that runs them (never the NBD request path), conflict
//! checks, cancellation, and the last finished jobs kept for their results.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};
use serde_json::{json, Value};
use vouch_engine::jobs::JobControl;
use vouch_engine::{BlockDevice, Volume, BLOCK};

use super::engine_api::{self as engine, CopyMethod, CopyOptions, ScrubOptions, VerifyOptions};
use super::render;

/// Jobs running at once; more wait in `queued`.
pub const MAX_RUNNING: usize = 2;
/// Finished (or failed, or cancelled) jobs kept for their results.
pub const KEEP_FINISHED: usize = 64;

/// One export the control API can act on.
pub struct ExportEntry {
    pub name: String,
    /// The volume directory (where scrub keeps its record).
    pub dir: PathBuf,
    pub volume: Arc<Volume>,
    /// A mirrored export: jobs go through the mirror (reads repair, scrub
    /// checks and repairs every leg); `volume` is its first open leg.
    pub mirror: Option<Arc<vouch_mirror::Mirror>>,
    /// A mirrored export's resyncs (`/v1/mirrors`).
    pub resync: Option<Arc<crate::resync::Resyncer>>,
    /// A volume with regions: its online migration
    /// (`/v1/exports/{export}/migrate`); `volume` is its home member.
    pub migration: Option<Arc<crate::migrate_online::Migration>>,
}

/// What the other side of a compare is.
#[derive(Clone, Debug)]
pub enum CompareWith {
    Data(Arc<Vec<u8>>),
    Range { export: usize, first: u64 },
}

/// A validated job request; exports are indexes into `Jobs::exports`.
#[derive(Clone, Debug)]
pub enum JobSpec {
    Verify {
        export: usize,
        first: u64,
        count: u64,
        options: VerifyOptions,
    },
    Scrub {
        export: usize,
        rate: Option<u64>,
    },
    Copy {
        source: usize,
        source_first: u64,
        destination: usize,
        destination_first: u64,
        count: u64,
        method: CopyMethod,
        /// Bytes per second copied at most.
        rate: Option<u64>,
    },
    Compare {
        export: usize,
        first: u64,
        count: u64,
        with: CompareWith,
    },
}

impl JobSpec {
    pub fn op(&self) -> &'static str {
        match self {
            JobSpec::Verify { .. } => "verify",
            JobSpec::Scrub { .. } => "scrub",
            JobSpec::Copy { .. } => "copy",
            JobSpec::Compare { .. } => "compare",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobState {
    Queued,
    Running,
    Finished,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn name(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Finished => "finished",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
    pub fn is_done(self) -> bool {
        !matches!(self, JobState::Queued | JobState::Running)
    }
}

struct Status {
    state: JobState,
    started: Option<Instant>,
    finished: Option<Instant>,
    result: Option<Value>,
    error: Option<String>,
    /// When the error is a block that failed verification: `{lba, kind}`.
    fault: Option<Value>,
}

/// One job: its request, live progress and, once done, its result.
pub struct Job {
    pub id: u64,
    pub spec: JobSpec,
    pub control: JobControl,
    created_unix: u64,
    status: Mutex<Status>,
    done: tokio::sync::watch::Sender<bool>,
}

impl Job {
    pub fn state(&self) -> JobState {
        self.status.lock().state
    }

    /// Wait until the job is done or `timeout` passes.
    pub async fn wait(&self, timeout: Duration) {
        let mut done = self.done.subscribe();
        let _ = tokio::time::timeout(timeout, done.wait_for(|done| *done)).await;
    }

    /// The job as the control API shows it.
    pub fn to_json(&self, exports: &[ExportEntry]) -> Value {
        let status = self.status.lock();
        let (done, total) = self.control.progress();
        let elapsed = status
            .started
            .map(|started| status.finished.unwrap_or_else(Instant::now) - started);
        let bytes_per_second = elapsed
            .filter(|e| e.as_secs_f64() > 0.0)
            .map(|e| (done * BLOCK) as f64 / e.as_secs_f64());
        let eta = match (status.state, bytes_per_second) {
            (JobState::Running, Some(rate)) if rate > 0.0 => {
                Some(((total.saturating_sub(done)) * BLOCK) as f64 / rate)
            }
            _ => None,
        };
        json!({
            "id": self.id,
            "op": self.spec.op(),
            "request": render::spec_json(&self.spec, exports),
            "state": status.state.name(),
            "created_unix": self.created_unix,
            "progress": {"done_blocks": done, "total_blocks": total,
                "paced_waits": self.control.paced_waits()},
            "elapsed_seconds": elapsed.map(|e| e.as_secs_f64()),
            "bytes_per_second": bytes_per_second.map(|r| r.round() as u64),
            "eta_seconds": eta,
            "result": status.result,
            "error": status.error,
            "fault": status.fault,
        })
    }
}

/// Why a job was not accepted.
#[derive(Debug)]
pub struct Conflict(pub String);

struct Inner {
    next_id: u64,
    jobs: BTreeMap<u64, Arc<Job>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// The job table and its thread pool.
pub struct Jobs {
    pub exports: Vec<ExportEntry>,
    foreground: Option<Arc<dyn Fn() -> u64 + Send + Sync>>,
    inner: Mutex<Inner>,
    running: Mutex<usize>,
    slot_free: Condvar,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn overlaps(a_first: u64, b_first: u64, count_a: u64, count_b: u64) -> bool {
    a_first < b_first + count_b && b_first < a_first + count_a
}

impl Jobs {
    /// `foreground`: a monotonic count of NBD requests, for scrub to yield to.
    pub fn new(
        exports: Vec<ExportEntry>,
        foreground: Option<Arc<dyn Fn() -> u64 + Send + Sync>>,
    ) -> Arc<Jobs> {
        Arc::new(Jobs {
            exports,
            foreground,
            inner: Mutex::new(Inner {
                next_id: 1,
                jobs: BTreeMap::new(),
                threads: Vec::new(),
            }),
            running: Mutex::new(0),
            slot_free: Condvar::new(),
        })
    }

    pub fn export_index(&self, name: &str) -> Option<usize> {
        self.exports.iter().position(|e| e.name == name)
    }

    pub fn get(&self, id: u64) -> Option<Arc<Job>> {
        self.inner.lock().jobs.get(&id).cloned()
    }

    pub fn list(&self) -> Vec<Arc<Job>> {
        self.inner.lock().jobs.values().cloned().collect()
    }

    /// A job not yet done that `spec` conflicts with.
    fn conflict(&self, spec: &JobSpec, active: &[&Arc<Job>]) -> Option<Conflict> {
        for job in active {
            match (spec, &job.spec) {
                (JobSpec::Scrub { export, .. }, JobSpec::Scrub { export: other, .. })
                    if export == other =>
                {
                    return Some(Conflict(format!(
                        "a scrub of {} is already {} (job {})",
                        self.exports[*export].name,
                        job.state().name(),
                        job.id
                    )));
                }
                (
                    JobSpec::Copy {
                        destination,
                        destination_first,
                        count,
                        ..
                    },
                    JobSpec::Copy {
                        source: other_source,
                        source_first: other_source_first,
                        destination: other_destination,
                        destination_first: other_first,
                        count: other_count,
                        ..
                    },
                ) => {
                    if destination == other_destination
                        && overlaps(*destination_first, *other_first, *count, *other_count)
                    {
                        return Some(Conflict(format!(
                            "the destination overlaps the destination of copy job {} (blocks {}..{} of {})",
                            job.id,
                            other_first,
                            other_first + other_count,
                            self.exports[*destination].name
                        )));
                    }
                    if destination == other_source
                        && overlaps(
                            *destination_first,
                            *other_source_first,
                            *count,
                            *other_count,
                        )
                    {
                        return Some(Conflict(format!(
                            "the destination overlaps the source of copy job {} (blocks {}..{} of {})",
                            job.id,
                            other_source_first,
                            other_source_first + other_count,
                            self.exports[*destination].name
                        )));
                    }
                }
                _ => {}
            }
        }
        None
    }

    /// Accept a job and start it on its own thread (it waits for a slot).
    pub fn submit(self: &Arc<Jobs>, spec: JobSpec) -> Result<Arc<Job>, Conflict> {
        let mut inner = self.inner.lock();
        let active: Vec<&Arc<Job>> = inner
            .jobs
            .values()
            .filter(|job| !job.state().is_done())
            .collect();
        if let Some(conflict) = self.conflict(&spec, &active) {
            return Err(conflict);
        }
        let id = inner.next_id;
        inner.next_id += 1;
        let (done, _) = tokio::sync::watch::channel(false);
        let job = Arc::new(Job {
            id,
            spec,
            control: JobControl::default(),
            created_unix: now_unix(),
            status: Mutex::new(Status {
                state: JobState::Queued,
                started: None,
                finished: None,
                result: None,
                error: None,
                fault: None,
            }),
            done,
        });
        inner.jobs.insert(id, job.clone());
        let finished: Vec<u64> = inner
            .jobs
            .values()
            .filter(|job| job.state().is_done())
            .map(|job| job.id)
            .collect();
        for id in finished
            .iter()
            .take(finished.len().saturating_sub(KEEP_FINISHED))
        {
            inner.jobs.remove(id);
        }
        inner.threads.retain(|thread| !thread.is_finished());
        let jobs = self.clone();
        let runner = job.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vouch-job-{id}"))
            .spawn(move || jobs.run(&runner))
            .map_err(|error| Conflict(format!("cannot start a job thread: {error}")))?;
        inner.threads.push(thread);
        Ok(job)
    }

    /// Cancel a job (a queued one never starts). `false` if it was done already.
    pub fn cancel(&self, job: &Job) -> bool {
        job.control.cancel();
        self.slot_free.notify_all();
        !job.state().is_done()
    }

    /// Cancel every job and wait for their threads (server shutdown).
    pub fn shutdown(&self) {
        let threads = {
            let mut inner = self.inner.lock();
            for job in inner.jobs.values() {
                job.control.cancel();
            }
            std::mem::take(&mut inner.threads)
        };
        self.slot_free.notify_all();
        for thread in threads {
            let _ = thread.join();
        }
    }

    fn run(&self, job: &Job) {
        {
            let mut running = self.running.lock();
            while *running >= MAX_RUNNING && !job.control.is_cancelled() {
                self.slot_free
                    .wait_for(&mut running, Duration::from_millis(200));
            }
            if job.control.is_cancelled() {
                drop(running);
                job.status.lock().error = Some("cancelled before it started".into());
                self.finish(job, JobState::Cancelled, None);
                return;
            }
            *running += 1;
        }
        {
            let mut status = job.status.lock();
            status.state = JobState::Running;
            status.started = Some(Instant::now());
        }
        let outcome = self.execute(&job.spec, &job.control);
        *self.running.lock() -= 1;
        self.slot_free.notify_one();
        match outcome {
            Ok((state, result)) => self.finish(job, state, Some(result)),
            Err(error) => {
                let state = if job.control.is_cancelled() {
                    JobState::Cancelled
                } else {
                    JobState::Failed
                };
                {
                    let mut status = job.status.lock();
                    status.error = Some(error.to_string());
                    status.fault = error
                        .fault()
                        .map(|f| json!({"lba": f.lba, "kind": f.kind.name()}));
                }
                self.finish(job, state, None);
            }
        }
    }

    fn finish(&self, job: &Job, state: JobState, result: Option<Value>) {
        {
            let mut status = job.status.lock();
            status.state = state;
            status.finished = Some(Instant::now());
            status.result = result;
        }
        job.done.send_replace(true);
    }

    fn execute(
        &self,
        spec: &JobSpec,
        control: &JobControl,
    ) -> vouch_engine::Result<(JobState, Value)> {
        let device = |index: usize| -> &dyn BlockDevice {
            match &self.exports[index].mirror {
                Some(mirror) => &**mirror,
                None => &*self.exports[index].volume,
            }
        };
        match spec {
            JobSpec::Verify {
                export,
                first,
                count,
                options,
            } => {
                let report = engine::verify(device(*export), *first, *count, options, control)?;
                Ok((JobState::Finished, render::verify_json(&report)))
            }
            JobSpec::Scrub { export, rate } => {
                let options = ScrubOptions {
                    rate_bytes_per_second: *rate,
                    foreground: self.foreground.clone(),
                };
                let entry = &self.exports[*export];
                if let Some(mirror) = &entry.mirror {
                    // Its cursor beside the volume scrub's record: a
                    // cancelled or interrupted scrub resumes there.
                    let cursor = vouch_mirror::scrub::cursor_in(&entry.dir);
                    let report =
                        vouch_mirror::scrub::scrub_from(mirror, &options, control, Some(&cursor))?;
                    return Ok((JobState::Finished, render::mirror_scrub_json(&report)));
                }
                let record = engine::scrub(device(*export), &entry.dir, &options, control)?;
                let state = match record.state {
                    engine::ScrubState::Finished => JobState::Finished,
                    engine::ScrubState::Cancelled => JobState::Cancelled,
                    engine::ScrubState::Failed | engine::ScrubState::Running => JobState::Failed,
                };
                Ok((state, render::scrub_json(&record)))
            }
            JobSpec::Copy {
                source,
                source_first,
                destination,
                destination_first,
                count,
                method,
                rate,
            } => {
                // A mirrored destination is copied into through its
                // mirror: every leg gets the blocks.
                let report = engine::copy(
                    device(*source),
                    *source_first,
                    device(*destination),
                    *destination_first,
                    *count,
                    &CopyOptions {
                        method: *method,
                        rate_bytes_per_second: *rate,
                    },
                    control,
                )?;
                // Durable when the job reports finished.
                device(*destination).flush()?;
                Ok((JobState::Finished, render::copy_json(&report)))
            }
            JobSpec::Compare {
                export,
                first,
                count,
                with,
            } => {
                let difference = match with {
                    CompareWith::Data(data) => device(*export).compare(*first * BLOCK, data)?,
                    CompareWith::Range {
                        export: other,
                        first: other_first,
                    } => engine::compare_ranges(
                        device(*export),
                        *first,
                        device(*other),
                        *other_first,
                        *count,
                        control,
                    )?,
                };
                Ok((JobState::Finished, render::compare_json(difference)))
            }
        }
    }
}
