//! Offload metrics in the Prometheus text format: jobs by op and state, and
//! each export's last scrub record. `serve --metrics` appends this to its
//! page; a metrics registry can call `render` the same way.

use std::fmt::Write as _;

use super::engine_api::{last_scrub, ScrubState};
use super::jobs::Jobs;

const OPS: [&str; 4] = ["verify", "scrub", "copy", "compare"];
const STATES: [&str; 5] = ["queued", "running", "finished", "failed", "cancelled"];

/// The offload series, one `# HELP`/`# TYPE` header each.
pub fn render(jobs: &Jobs) -> String {
    let mut out = String::new();
    let list = jobs.list();
    let _ = writeln!(
        out,
        "# HELP vouch_offload_jobs Offload jobs kept by the control API, by op and state\n# TYPE vouch_offload_jobs gauge"
    );
    for op in OPS {
        for state in STATES {
            let count = list
                .iter()
                .filter(|job| job.spec.op() == op && job.state().name() == state)
                .count();
            let _ = writeln!(
                out,
                "vouch_offload_jobs{{op=\"{op}\",state=\"{state}\"}} {count}"
            );
        }
    }
    let records: Vec<_> = jobs
        .exports
        .iter()
        .map(|export| (export.name.as_str(), last_scrub(&export.dir).ok().flatten()))
        .collect();
    type Get = fn(&super::engine_api::ScrubRecord) -> u64;
    let series: [(&str, &str, &str, Get); 6] = [
        (
            "vouch_scrub_running",
            "gauge",
            "1 while a scrub runs (per its record)",
            |r| u64::from(r.state == ScrubState::Running),
        ),
        (
            "vouch_scrub_cursor_blocks",
            "gauge",
            "Every block before it is checked",
            |r| r.cursor,
        ),
        (
            "vouch_scrub_total_blocks",
            "gauge",
            "Blocks the last scrub covers",
            |r| r.blocks_total,
        ),
        (
            "vouch_scrub_checked_blocks",
            "gauge",
            "Blocks read by the last scrub (holes skipped)",
            |r| r.blocks_checked,
        ),
        (
            "vouch_scrub_faults",
            "gauge",
            "Faulty blocks found by the last scrub",
            |r| r.faults.len() as u64,
        ),
        (
            "vouch_scrub_last_finished_timestamp_seconds",
            "gauge",
            "When the last scrub finished (0: not yet)",
            |r| r.finished_unix.unwrap_or(0),
        ),
    ];
    for (name, kind, help, get) in series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (volume, record) in &records {
            if let Some(record) = record {
                let _ = writeln!(out, "{name}{{volume=\"{volume}\"}} {}", get(record));
            }
        }
    }
    out
}
