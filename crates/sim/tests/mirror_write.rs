//! Crashes of the exporter between and during the legs' writes: every
//! block reads a value the contract allows, and the scrub after the
//! restart makes the legs agree on what clients read
//! (`vouch_sim::mirror_write`).

use vouch_sim::mirror_write::{MirrorWriteReport, Sabotage};

#[test]
fn an_exporter_crash_during_mirrored_writes_keeps_the_contract() {
    let report = vouch_sim::mirror_write::run(1, if !cfg!(sim_full) { 6 } else { 64 });
    assert!(
        report.violations.is_empty(),
        "{}\n{}",
        report
            .violations
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n"),
        report.summary()
    );
    assert!(
        report.images > 0 && report.diverged > 0,
        "{}",
        report.summary()
    );
    assert!(report.repaired > 0, "{}", report.summary());
    // Both ways of taking a write: a local leg's, a remote replica's.
    assert!(
        report.travelling > 0 && report.travelling < report.seeds,
        "{}",
        report.summary()
    );
    // And writes a remote leg answers by callback (`try_begin_write`),
    // writes the mirror's inline route took (both into room reserved in
    // the legs' write-back buffers), the legs' background commits and
    // crashes of the process alone.
    assert!(report.completed_later > 0, "{}", report.summary());
    assert!(report.inline_writes > 0, "{}", report.summary());
    assert!(report.background_commits > 0, "{}", report.summary());
    assert!(report.process_images > 0, "{}", report.summary());
    eprintln!("{}", report.summary());
}

/// The completion path acknowledging a write before the local leg holds
/// it (here: the local leg's held log keeps nothing of those writes)
/// loses it in a crash of the exporter process: the process-crash images
/// must say so.
#[test]
fn a_completed_write_the_local_leg_does_not_hold_is_caught() {
    assert_route_break_caught(Sabotage::Completion, |report| report.completed_later);
}

/// The mirror's inline route into room reserved on every leg
/// (`try_write_shared`, `SealedAdmission::Reserved`) acknowledging a write
/// before the local leg holds it loses it in a crash of the exporter
/// process: the process-crash images must say so.
#[test]
fn a_reserved_inline_write_the_local_leg_does_not_hold_is_caught() {
    assert_route_break_caught(Sabotage::Reserved, |report| report.inline_writes);
}

/// The worker's route (`write_shared`, the one that may wait: a leg's
/// `SealedAdmission::Here`, a travelling leg answering `Started`)
/// acknowledging a write before the local leg holds it loses it in a
/// crash of the exporter process: the process-crash images must say so.
#[test]
fn a_worker_write_the_local_leg_does_not_hold_is_caught() {
    assert_route_break_caught(Sabotage::Worker, |report| report.worker_writes);
}

/// A break inside the mirror's one executor rather than a leg's held
/// log: the worker's route acknowledging before a travelling leg's
/// started write was waited for (so before that leg holds it) leaves a
/// leg with a value no write or flush allows.
#[test]
fn an_executor_acknowledging_before_a_started_write_landed_is_caught() {
    let report = vouch_sim::mirror_write::run_with(1, 6, Sabotage::Unwaited);
    assert!(
        !report.violations.is_empty(),
        "the unwaited started writes went unnoticed: {}",
        report.summary()
    );
}

/// Seeds 1-6 with `sabotage`'s route broken: the route took writes
/// (`taken`), and a process crash found them lost.
fn assert_route_break_caught(sabotage: Sabotage, taken: fn(&MirrorWriteReport) -> u64) {
    let report = vouch_sim::mirror_write::run_with(1, 6, sabotage);
    assert!(taken(&report) > 0, "{}", report.summary());
    assert_process_crash_caught(&report);
}

fn assert_process_crash_caught(report: &MirrorWriteReport) {
    assert!(
        report
            .violations
            .iter()
            .any(|violation| violation.contains("process crash")),
        "no process crash found the lost writes: {}",
        report.summary()
    );
}
