//! The detection matrix's "repaired" column: media faults on one leg of a
//! 2-leg mirror (`vouch_sim::mirror_faults`). Every fault the layout
//! detects is served from the other leg and repaired by the read; the
//! faults a packed leg cannot see (a lost or misdirected write leaves an
//! older, valid record) are found by a scrub, which repairs them from the
//! newer copy and never overwrites the good leg. The legs run the
//! production scheduling (stepped background committers, the mirror's
//! inline route), and a break of the inline route is caught.

use vouch_sim::faults::Kind;
use vouch_sim::mirror_faults::{run, run_with, Outcome};

#[test]
fn faults_on_one_leg_are_served_and_repaired_from_the_other() {
    let report = run(if !cfg!(sim_full) { 10 } else { 60 }, 7);
    eprintln!("{}\n{}", report.render(), report.summary());
    assert!(
        report.violations.is_empty(),
        "{}\n{}",
        report.violations.join("\n"),
        report.summary()
    );
    assert!(
        report.inline_writes > 0 && report.background_commits > 0,
        "{}",
        report.summary()
    );
    for ((layout, kind), tally) in &report.tallies {
        let count = |outcome| tally.0.get(&outcome).copied().unwrap_or(0);
        let total: u64 = tally.0.values().sum();
        let packed_blind =
            layout == "packed" && matches!(kind, Kind::LostWrite | Kind::MisdirectedWriteLost);
        if packed_blind {
            assert_eq!(
                count(Outcome::SilentThenScrubRepaired),
                total,
                "{layout} {}: a scrub must repair every one",
                kind.label()
            );
        } else {
            assert_eq!(
                count(Outcome::RepairedByRead) + count(Outcome::Harmless),
                total,
                "{layout} {}: every one served right and repaired by the read",
                kind.label()
            );
            assert!(
                count(Outcome::RepairedByRead) > 0,
                "{layout} {}",
                kind.label()
            );
        }
    }
}

/// Leg 1 acknowledging the mirror's inline writes without storing them
/// (the route's fan-out broken): clients are served wrong bytes from it.
#[test]
fn an_inline_route_that_skips_a_leg_is_caught() {
    let report = run_with(2, 7, true);
    // Wrong bytes where the matrix expects none: every kind but those a
    // packed leg cannot see.
    let silent: u64 = report
        .tallies
        .iter()
        .filter(|((layout, kind), _)| {
            layout != "packed" || !matches!(kind, Kind::LostWrite | Kind::MisdirectedWriteLost)
        })
        .map(|(_, tally)| {
            [Outcome::Silent, Outcome::SilentThenScrubRepaired]
                .iter()
                .filter_map(|outcome| tally.0.get(outcome))
                .sum::<u64>()
        })
        .sum();
    assert!(
        silent > 0 && report.inline_writes > 0,
        "not caught: {}\n{}",
        report.render(),
        report.summary()
    );
    eprintln!("{}", report.summary());
}
