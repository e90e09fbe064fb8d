//! Offload results as JSON: one shape for the control API and for the
//! CLI's `--json`, online or offline (documented in docs/PROTOCOL.md).

use serde_json::{json, Value};
use vouch_engine::{Fault, BLOCK};

use super::engine_api::{hex, CopyReport, ScrubRecord, ScrubState, VerifyReport};
use super::jobs::{CompareWith, ExportEntry, JobSpec};

pub fn faults_json(faults: &[Fault]) -> Value {
    faults
        .iter()
        .map(|f| json!({"lba": f.lba, "kind": f.kind.name()}))
        .collect()
}

pub fn verify_json(report: &VerifyReport) -> Value {
    let segments: Vec<Value> = report
        .segments
        .iter()
        .map(|s| json!({"lba": s.lba, "count": s.count, "digest": hex(&s.digest)}))
        .collect();
    json!({
        "offset": report.first * BLOCK,
        "length": report.count * BLOCK,
        "blocks": report.count,
        "blocks_read": report.blocks_read,
        "faults": faults_json(&report.faults),
        "clean": report.faults.is_empty(),
        "digest": report.digest.map(|d| hex(&d)),
        "segments": segments,
        "elapsed_seconds": report.elapsed.as_secs_f64(),
    })
}

pub fn scrub_state_name(state: ScrubState) -> &'static str {
    match state {
        ScrubState::Running => "running",
        ScrubState::Finished => "finished",
        ScrubState::Cancelled => "cancelled",
        ScrubState::Failed => "failed",
    }
}

/// A mirror scrub's report, with the fields of `scrub_json` the CLI reads
/// (`faults`: what was left unrepaired) and the mirror's counts.
pub fn mirror_scrub_json(report: &vouch_mirror::scrub::MirrorScrubReport) -> Value {
    let left: Vec<Value> = report
        .findings
        .iter()
        .filter(|finding| !finding.repaired)
        .map(|finding| json!({"lba": finding.lba, "kind": finding.kind, "leg": finding.leg}))
        .collect();
    json!({
        "state": "finished",
        "blocks_checked": report.blocks_checked,
        "faults": left,
        "error": null,
        "mirror": {
            "found": report.found,
            "repaired": report.repaired,
            "left": report.left,
            "findings": report.findings,
        },
    })
}

pub fn scrub_json(record: &ScrubRecord) -> Value {
    json!({
        "state": scrub_state_name(record.state),
        "started_unix": record.started_unix,
        "finished_unix": record.finished_unix,
        "cursor": record.cursor,
        "blocks_total": record.blocks_total,
        "blocks_checked": record.blocks_checked,
        "faults": faults_json(&record.faults),
        "error": record.error,
    })
}

pub fn copy_json(report: &CopyReport) -> Value {
    json!({
        "method": report.method.name(),
        "chosen_by": report.chosen_by,
        "blocks": report.blocks,
        "elapsed_seconds": report.elapsed.as_secs_f64(),
        "paced_waits": report.paced_waits,
    })
}

pub fn compare_json(difference: Option<u64>) -> Value {
    json!({"equal": difference.is_none(), "first_difference": difference})
}

/// The request a job runs, in the API's terms (bytes, export names).
pub fn spec_json(spec: &JobSpec, exports: &[ExportEntry]) -> Value {
    let name = |index: usize| exports[index].name.clone();
    match spec {
        JobSpec::Verify {
            export,
            first,
            count,
            options,
        } => json!({
            "op": "verify", "export": name(*export), "offset": first * BLOCK,
            "length": count * BLOCK, "seed": options.seed.map(|s| s.to_hex()),
            "segments": options.segments, "rate": options.rate_bytes_per_second,
        }),
        JobSpec::Scrub { export, rate } => {
            json!({"op": "scrub", "export": name(*export), "rate": rate})
        }
        JobSpec::Copy {
            source,
            source_first,
            destination,
            destination_first,
            count,
            method,
            rate,
        } => json!({
            "op": "copy",
            "source": {"export": name(*source), "offset": source_first * BLOCK},
            "destination": {"export": name(*destination), "offset": destination_first * BLOCK},
            "length": count * BLOCK, "method": method.name(), "rate": rate,
        }),
        JobSpec::Compare {
            export,
            first,
            count,
            with,
        } => {
            let with = match with {
                CompareWith::Data(data) => json!({"data_bytes": data.len()}),
                CompareWith::Range { export, first } => {
                    json!({"other": {"export": name(*export), "offset": first * BLOCK}})
                }
            };
            json!({
                "op": "compare", "export": name(*export), "offset": first * BLOCK,
                "length": count * BLOCK, "with": with,
            })
        }
    }
}
