//! Crashes of the exporter between and during the legs' writes: every
//! block reads a value the contract allows, and the scrub after the
//! restart makes the legs agree on what clients read
//! (`vouch_sim::mirror_write`).

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
    // And writes a remote leg answers by callback (`try_begin_write`).
    assert!(report.completed_later > 0, "{}", report.summary());
    eprintln!("{}", report.summary());
}
