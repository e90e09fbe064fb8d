//! Crashes of the exporter during a mirror resync under client writes,
//! the resync map's own writes included: leg 0 keeps every flushed write,
//! each block of leg 1 older than the last flush is covered by the map on
//! disk (or the map fails its CRC: a full resync), and a restart leaves
//! the legs equal (`vouch_sim::resync`). The legs run the production
//! scheduling (stepped background committers, the mirror's inline route),
//! and a break of its orderings is caught.

use vouch_sim::resync::{run, run_with, Sabotage};

#[test]
fn a_crash_during_a_resync_under_writes_is_covered_by_the_map_and_a_restart_finishes() {
    let report = run(1, if !cfg!(sim_full) { 2 } else { 12 });
    assert!(
        report.violations.is_empty(),
        "{}\n{}",
        report.violations.join("\n"),
        report.summary()
    );
    let summary = report.summary();
    assert!(report.copied > 0 && report.images > 0, "{summary}");
    assert!(report.client_ops > 0 && report.map_writes > 0, "{summary}");
    // Images where leg 1 held blocks older than the last flush (the map
    // had to cover them), where the map failed its CRC, and where it was
    // already gone: each case was met.
    assert!(report.covered > 0, "{summary}");
    assert!(report.unknown_maps > 0 && report.no_map > 0, "{summary}");
    // The production scheduling ran: background commits, inline writes
    // (some at the steps of a commit), and process crashes were checked.
    assert!(report.background_commits > 0, "{summary}");
    assert!(
        report.inline_writes > 0 && report.at_step_writes > 0,
        "{summary}"
    );
    assert!(report.process_images > 0, "{summary}");
    eprintln!("{summary}");
}

/// Seeds from 1 until one catches `sabotage` with a violation containing
/// `found` (at most 8).
fn caught(sabotage: Sabotage, found: &str) {
    let mut summaries = Vec::new();
    for seed in 1..=8 {
        let report = run_with(seed, 1, sabotage);
        if report
            .violations
            .iter()
            .any(|violation| violation.contains(found))
        {
            eprintln!("{sabotage:?}: {}", report.summary());
            return;
        }
        summaries.push(report.summary());
    }
    panic!("{sabotage:?} not caught:\n{}", summaries.join("\n"));
}

/// The mirror's inline route acknowledging before leg 0's held log holds
/// the write: a process crash loses an acknowledged write.
#[test]
fn the_inline_route_acknowledging_before_the_held_log_is_caught() {
    caught(
        Sabotage::InlineBeforeHeld,
        "lost an acknowledged write in a process crash",
    );
}

/// Leg 0's background committer emptying the committing held-log slot
/// before its journal record and home writes.
#[test]
fn a_background_commit_emptying_its_slot_before_home_is_caught() {
    caught(
        Sabotage::EmptyBeforeHome,
        "lost an acknowledged write in a process crash",
    );
}
