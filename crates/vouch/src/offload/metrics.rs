//! Offload metrics: jobs by op and state, and each export's last scrub
//! record, published through the `metrics` facade into the server's
//! recorder at scrape time (`serve --metrics` calls `publish` from its
//! publish closure, with the server's recorder as the local recorder).

use super::engine_api::{last_scrub, ScrubState};
use super::jobs::Jobs;

const OPS: [&str; 4] = ["verify", "scrub", "copy", "compare"];
const STATES: [&str; 5] = ["queued", "running", "finished", "failed", "cancelled"];

/// Publish the offload series (gauges) into the current recorder.
pub fn publish(jobs: &Jobs) {
    metrics::describe_gauge!(
        "vouch_offload_jobs",
        "Offload jobs kept by the control API, by op and state"
    );
    let list = jobs.list();
    for op in OPS {
        for state in STATES {
            let count = list
                .iter()
                .filter(|job| job.spec.op() == op && job.state().name() == state)
                .count();
            metrics::gauge!("vouch_offload_jobs", "op" => op, "state" => state).set(count as f64);
        }
    }
    let records: Vec<_> = jobs
        .exports
        .iter()
        .map(|export| (export.name.clone(), last_scrub(&export.dir).ok().flatten()))
        .collect();
    type Get = fn(&super::engine_api::ScrubRecord) -> u64;
    let series: [(&'static str, &'static str, Get); 6] = [
        (
            "vouch_scrub_running",
            "1 while a scrub runs (per its record)",
            |r| u64::from(r.state == ScrubState::Running),
        ),
        (
            "vouch_scrub_cursor_blocks",
            "Every block before it is checked",
            |r| r.cursor,
        ),
        (
            "vouch_scrub_total_blocks",
            "Blocks the last scrub covers",
            |r| r.blocks_total,
        ),
        (
            "vouch_scrub_checked_blocks",
            "Blocks read by the last scrub (holes skipped)",
            |r| r.blocks_checked,
        ),
        (
            "vouch_scrub_faults",
            "Faulty blocks found by the last scrub",
            |r| r.faults.len() as u64,
        ),
        (
            "vouch_scrub_last_finished_timestamp_seconds",
            "When the last scrub finished (0: not yet)",
            |r| r.finished_unix.unwrap_or(0),
        ),
    ];
    for (name, help, get) in series {
        metrics::describe_gauge!(name, help);
        for (volume, record) in &records {
            if let Some(record) = record {
                metrics::gauge!(name, "volume" => volume.clone()).set(get(record) as f64);
            }
        }
    }
}
