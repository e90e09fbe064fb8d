//! Crashes of a replica server while it answers an exporter's requests
//! through its own routes (`vouch_replica::server::try_serve_inline`,
//! `serve_request`), the replica on the production scheduling
//! (`vouch_sim::replica_server`); and each route's ordering broken on
//! purpose (`RouteBreaks`) is caught.

use vouch_replica::server::RouteBreaks;
use vouch_sim::replica_server::{run, run_with, ReplicaServerReport};

#[test]
fn a_replica_server_crash_keeps_every_answered_write() {
    let report = run(1, if !cfg!(sim_full) { 8 } else { 64 });
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
    // Both routes answered, the inline one also while commits ran; the
    // background committer ran; flushes, FUA writes and both kinds of
    // crash were checked.
    assert!(report.inline_answers > 0, "{}", report.summary());
    assert!(report.inline_at_steps > 0, "{}", report.summary());
    assert!(report.blocking_answers > 0, "{}", report.summary());
    assert!(report.background_commits > 0, "{}", report.summary());
    assert!(
        report.flushes > 0 && report.fua_writes > 0,
        "{}",
        report.summary()
    );
    assert!(
        report.process_images > 0 && report.images > report.process_images,
        "{}",
        report.summary()
    );
    eprintln!("{}", report.summary());
}

/// Both routes answering a WRITE_SEALED before its blocks are written
/// (before the replica's held log has them): a crash of the server
/// process right after the answer loses an acknowledged write.
#[test]
fn a_write_answered_before_it_is_written_is_caught() {
    let report = run_with(
        1,
        8,
        RouteBreaks {
            answer_before_write: true,
            ..RouteBreaks::NONE
        },
    );
    assert_caught(&report, "process crash");
}

/// A FLUSH (or a FUA write) answered before its flush committed: a power
/// cut right after the answer loses what it promised durable.
#[test]
fn a_flush_answered_before_its_commit_is_caught() {
    let report = run_with(
        1,
        8,
        RouteBreaks {
            answer_before_flush: true,
            ..RouteBreaks::NONE
        },
    );
    assert_caught(&report, "power cut");
}

fn assert_caught(report: &ReplicaServerReport, cut: &str) {
    assert!(
        report
            .violations
            .iter()
            .any(|violation| violation.contains(cut)),
        "no {cut} found the broken route: {}\n{}",
        report.summary(),
        report
            .violations
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
