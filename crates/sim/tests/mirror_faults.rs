//! The detection matrix's "repaired" column: media faults on one leg of a
//! 2-leg mirror (`vouch_sim::mirror_faults`). Every fault the layout
//! detects is served from the other leg and repaired by the read; the
//! faults a packed leg cannot see (a lost or misdirected write leaves an
//! older, valid record) are found by a scrub, which repairs them from the
//! newer copy and never overwrites the good leg.

use vouch_sim::faults::Kind;
use vouch_sim::mirror_faults::{run, Outcome};

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
