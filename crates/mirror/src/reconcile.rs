//! Reconciliation after an unclean stop (docs/CRASH_MODEL.md, "Crash
//! reconciliation by an activity log"): the extents the activity log
//! named when the set was opened (`activity.rs`) are the only places the
//! legs may differ. A thread checks them a scan chunk at a time (1 MiB,
//! ending on the legs' metadata units: `jobs::chunk_end`) under the
//! chunk's stripe locks, with the scrub's rule (`scrub_chunk`):
//! reads go to the first active leg until it is done, so that leg's
//! verifying copy wins and is written to every other leg that differs
//! (md resyncs from the disk it reads), listed as `reconcile` repairs and
//! never counted toward a leg's fault threshold (the set's crash made
//! them differ, not the leg). A block that fails verification on a leg is
//! that leg's own error and counted as a scrub counts it.
//!
//! Crash ordering: an extent leaves the set to reconcile (`unpin`) only
//! after its last chunk was checked, each repair flushed on its leg
//! (`Mirror::rewrite`); until then the log keeps naming it, so a crash
//! mid-way reconciles it again at the next open. Client writes go on
//! meanwhile, to every leg as always.
//!
//! A job (`jobs::Visit`) whose positions are the blocks of the extents in
//! the order the log named them: the cursor is a position in that set
//! (every extent before it checked and unpinned). Paced like a resync
//! (`ResyncRate`, the jobs' `Pacer`): its ceiling while no client request
//! arrived during the last chunk, its floor while they do.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::device::Mirror;
pub use crate::progress::ReconcileProgress;
use crate::progress::ResyncRate;
use crate::scrub::MirrorScrubReport;
use vouch_engine::device::BlockDevice;
use vouch_engine::error::{Error, Result};
use vouch_engine::jobs::{chunk_end, JobControl, ScanEnd, Throughput, Visit};
use vouch_engine::BLOCK;

/// A reconciliation between two steps (`Mirror::begin_reconcile`).
pub struct ReconcileCursor {
    extents: Vec<u64>,
    extent_blocks: u64,
    /// Blocks of `extents` (each counted whole, in their order) behind the
    /// cursor: the extent being checked is `position / extent_blocks`.
    position: u64,
    report: MirrorScrubReport,
    started: Instant,
    /// Its progress as a job, paced waits and cancel.
    control: Arc<JobControl>,
}

impl ReconcileCursor {
    /// Blocks copied so far.
    pub fn copied(&self) -> u64 {
        self.report.repaired
    }

    /// Blocks checked so far.
    pub fn checked(&self) -> u64 {
        self.report.blocks_checked
    }

    /// Blocks found bad or different and not settled.
    pub fn unsettled(&self) -> u64 {
        self.report.left
    }

    /// Blocks of its extents, each counted whole.
    fn blocks(&self) -> u64 {
        self.extents.len() as u64 * self.extent_blocks
    }

    /// The extent being checked (index into `extents`).
    fn extent_index(&self) -> usize {
        (self.position / self.extent_blocks) as usize
    }
}

impl Mirror {
    /// Start reconciling the extents the activity log carried from the
    /// last run: reads go to the first active leg until it ends. `None`
    /// when there is nothing to reconcile (no log, or it was empty).
    pub fn begin_reconcile(&self) -> Option<ReconcileCursor> {
        let log = self.written.activity_log()?;
        let extents = log.pinned();
        if extents.is_empty() {
            return None;
        }
        self.legs.hold_reads_on_one_leg();
        self.reconciling.store(true, Ordering::Release);
        let cursor = ReconcileCursor {
            extents,
            extent_blocks: log.extent_blocks(),
            position: 0,
            report: MirrorScrubReport::default(),
            started: Instant::now(),
            control: Arc::new(JobControl::default()),
        };
        *self.reconcile.lock() = Some(self.reconcile_progress_of(&cursor, "running", None));
        tracing::info!(
            extents = cursor.extents.len(),
            "mirror: reconciling the extents written at an unclean stop"
        );
        Some(cursor)
    }

    /// One chunk: check and repair it on every active leg; after the last
    /// chunk of an extent, the extent leaves the set to reconcile.
    /// Returns the blocks checked (0: finished; `end_reconcile` next).
    pub fn reconcile_step(&self, cursor: &mut ReconcileCursor) -> Result<u64> {
        let Some(log) = self.written.activity_log() else {
            return Ok(0);
        };
        let index = cursor.extent_index();
        let Some(&extent) = cursor.extents.get(index) else {
            return Ok(0);
        };
        let extent_blocks = cursor.extent_blocks;
        let lba = extent * extent_blocks + cursor.position % extent_blocks;
        let blocks = self.size() / BLOCK;
        let extent_end = ((extent + 1) * extent_blocks).min(blocks);
        // On the scan's grid, so a packed row inside the extent is read
        // once on each leg.
        let count = chunk_end(self, lba).min(extent_end) - lba;
        self.scrub_chunk(lba, count, &mut cursor.report, "reconcile")?;
        cursor.position += count;
        if lba + count >= extent_end {
            log.unpin(extent);
            // The device's last extent may end early: the next one starts
            // at its whole extent's position.
            cursor.position = (index as u64 + 1) * extent_blocks;
        }
        *self.reconcile.lock() = Some(self.reconcile_progress_of(cursor, "running", None));
        Ok(count)
    }

    /// The end of a reconciliation: `result` is `Ok(true)` when every
    /// extent was checked. Reads go round robin again only then, and only
    /// if nothing was left unsettled. Returns its final progress.
    pub fn end_reconcile(
        &self,
        cursor: ReconcileCursor,
        result: Result<bool>,
    ) -> ReconcileProgress {
        let (state, error) = match result {
            Ok(true) if cursor.report.left == 0 => ("done", None),
            Ok(true) => (
                "done",
                Some(format!(
                    "{} blocks left unsettled: reads stay on one leg until a scrub",
                    cursor.report.left
                )),
            ),
            Ok(false) => (
                "stopped",
                Some("server stopping; the log keeps what is left for the next start".into()),
            ),
            Err(error) => ("failed", Some(error.to_string())),
        };
        if state == "done" && error.is_none() {
            self.legs.release_reads_from_one_leg();
        }
        // The final progress is in place before the legs stop reading as
        // reconciling, so `mirror status` never shows a leg in sync beside
        // a reconciliation still `running`.
        let progress = self.reconcile_progress_of(&cursor, state, error.clone());
        *self.reconcile.lock() = Some(progress.clone());
        self.reconciling.store(false, Ordering::Release);
        tracing::info!(
            state,
            checked = cursor.report.blocks_checked,
            copied = cursor.report.repaired,
            left = cursor.report.left,
            error = error.as_deref().unwrap_or(""),
            "mirror: reconciliation ended"
        );
        progress
    }

    /// Reconcile on a thread, paced by `rate` (see the module's
    /// documentation). `false` when there is nothing to reconcile.
    pub fn start_reconcile(self: &Arc<Self>, rate: ResyncRate) -> Result<bool> {
        if rate.min == 0 || rate.max < rate.min {
            return Err(Error::InvalidArgument(format!(
                "reconcile rate floor {} and ceiling {} (bytes/s): the floor must be positive and at most the ceiling",
                rate.min, rate.max
            )));
        }
        let Some(cursor) = self.begin_reconcile() else {
            return Ok(false);
        };
        let mirror = Arc::clone(self);
        let spawned = self.threads.spawn("vouch-reconcile".into(), move || {
            let mut cursor = cursor;
            let result = mirror.reconcile_loop(&mut cursor, rate);
            mirror.end_reconcile(cursor, result);
        });
        match spawned {
            Ok(()) => Ok(true),
            Err(error) => {
                self.reconciling.store(false, Ordering::Release);
                Err(Error::InvalidArgument(format!(
                    "cannot start reconciling: {error}"
                )))
            }
        }
    }

    /// Run steps until every extent was checked (`Ok(true)`) or the
    /// mirror stops or the job is cancelled (`Ok(false)`), pacing them: a
    /// `Visit` over the blocks of the extents.
    fn reconcile_loop(&self, cursor: &mut ReconcileCursor, rate: ResyncRate) -> Result<bool> {
        let foreground = || self.foreground.load(Ordering::Relaxed);
        let stop = || self.threads.stopping();
        let control = Arc::clone(&cursor.control);
        let end = Visit::begin(
            &control,
            cursor.position..cursor.blocks(),
            rate.pace(),
            Some(&foreground),
            None,
        )?
        .stop_when(&stop)
        .run(|run| {
            let checked = self.reconcile_step(cursor)?;
            if checked > 0 {
                run.step(cursor.position, checked, checked * BLOCK)?;
            }
            Ok(checked > 0)
        })?;
        Ok(end == ScanEnd::Finished)
    }

    /// The running (or last) reconciliation's progress.
    pub fn reconcile_progress(&self) -> Option<ReconcileProgress> {
        self.reconcile.lock().clone()
    }

    fn reconcile_progress_of(
        &self,
        cursor: &ReconcileCursor,
        state: &'static str,
        error: Option<String>,
    ) -> ReconcileProgress {
        let extent_blocks = cursor.extent_blocks;
        let extents = cursor.extents.len() as u64;
        let extents_left = extents - (cursor.extent_index() as u64).min(extents);
        let blocks_left = cursor.blocks() - cursor.position.min(cursor.blocks());
        let checked = cursor.report.blocks_checked;
        let throughput = Throughput::measure(cursor.started, checked, blocks_left);
        ReconcileProgress {
            extents,
            extents_left,
            extent_blocks,
            blocks_checked: checked,
            blocks_left,
            blocks_copied: cursor.report.repaired,
            blocks_left_unsettled: cursor.report.left,
            rate: throughput.rate,
            eta_seconds: throughput.eta_seconds,
            state,
            error,
            elapsed_ms: throughput.elapsed_ms,
            paced_waits: cursor.control.paced_waits(),
        }
    }
}
