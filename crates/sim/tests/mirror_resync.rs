//! Crashes of the exporter during a mirror resync under client writes,
//! the resync map's own writes included: leg 0 keeps every flushed write,
//! each block of leg 1 older than the last flush is covered by the map on
//! disk (or the map fails its CRC: a full resync), and a restart leaves
//! the legs equal (`vouch_sim::resync`).

#[test]
fn a_crash_during_a_resync_under_writes_is_covered_by_the_map_and_a_restart_finishes() {
    let report = vouch_sim::resync::run(1, if !cfg!(sim_full) { 2 } else { 12 });
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
    eprintln!("{summary}");
}
