//! Crashes during mirror repair: each block of the repaired leg reads its
//! old or its new contents, the block bad on both legs is never rewritten,
//! the source leg is only read (`vouch_sim::mirror`). A repair that
//! reseals bad bytes is caught.

#[test]
fn a_crash_during_repair_leaves_old_or_new_contents_on_each_leg() {
    let report = vouch_sim::mirror::run(1, if !cfg!(sim_full) { 4 } else { 24 });
    assert!(
        report.violations.is_empty(),
        "{}\n{}",
        report.violations.join("\n"),
        report.summary()
    );
    assert!(
        report.repaired > 0 && report.images > 0,
        "{}",
        report.summary()
    );
    // The legs' background committers (stepped) took repair writes.
    assert!(report.background_commits > 0, "{}", report.summary());
    assert!(
        report.new_blocks > 0 && report.old_blocks > 0,
        "{}",
        report.summary()
    );
    eprintln!("{}", report.summary());
}

/// Leg 1 resealing a block that fails its verification from its own bytes
/// (the sealed block no longer moves whole from a leg that verifies it):
/// clients read wrong bytes, and the block bad on both legs is rewritten.
#[test]
fn a_repair_that_reseals_bad_bytes_is_caught() {
    let report = vouch_sim::mirror::run_with(1, 2, true);
    let found = |text: &str| report.violations.iter().any(|v| v.contains(text));
    assert!(
        found("wrong data") && found("reads neither its old nor its new contents"),
        "not caught: {}\n{}",
        report.violations.join("\n"),
        report.summary()
    );
    eprintln!("{}", report.summary());
}
