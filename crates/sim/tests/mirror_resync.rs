//! Crashes during mirror resync: each block of the resyncing leg reads its
//! old or its new contents, the map on disk stays valid, and a restart
//! from it finishes with the legs agreeing (`vouch_sim::resync`).

#[test]
fn a_crash_during_resync_leaves_old_or_new_contents_and_a_restart_finishes() {
    let report = vouch_sim::resync::run(1, if cfg!(debug_assertions) { 3 } else { 16 });
    assert!(
        report.violations.is_empty(),
        "{}\n{}",
        report.violations.join("\n"),
        report.summary()
    );
    assert!(
        report.copied > 0 && report.images > 0,
        "{}",
        report.summary()
    );
    assert!(
        report.new_blocks > 0 && report.old_blocks > 0,
        "{}",
        report.summary()
    );
    eprintln!("{}", report.summary());
}
