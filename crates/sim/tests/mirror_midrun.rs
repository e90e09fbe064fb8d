//! Crashes while a leg lost mid-run is given its resync map: where the
//! records call it stale, its map is valid and covers every block its
//! surviving copy lacks, or it has unknown history (a full resync)
//! (`vouch_sim::mirror_midrun`). A map that misses the unflushed writes is
//! caught.

#[test]
fn a_crash_while_a_lost_leg_gets_its_map_leaves_a_covering_map_or_unknown_history() {
    let report = vouch_sim::mirror_midrun::run(1, if !cfg!(sim_full) { 4 } else { 24 });
    assert!(
        report.violations.is_empty(),
        "{}\n{}",
        report.violations.join("\n"),
        report.summary()
    );
    assert!(
        report.mapped > 0 && report.lacking_blocks > 0,
        "nothing was tested: {}",
        report.summary()
    );
    // The volumes' background committers (stepped) took commits.
    assert!(report.background_commits > 0, "{}", report.summary());
    eprintln!("{}", report.summary());
}

/// Maps created without the blocks written since the last flush (the
/// route's first step broken): where the records call the leg stale, its
/// map misses blocks the replica lost unflushed.
#[test]
fn a_map_created_without_the_unflushed_writes_is_caught() {
    let report = vouch_sim::mirror_midrun::run_with(1, 4, true);
    assert!(
        report
            .violations
            .iter()
            .any(|violation| violation.contains("misses blocks the replica lacks")),
        "not caught: {}",
        report.summary()
    );
    eprintln!("{}", report.summary());
}
