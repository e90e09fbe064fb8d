//! Lost metadata on both layouts, every guard, plain and encrypted: no
//! block reads as zeros or wrong data where the design claims detection
//! (`metadata::claimed`), nothing the damage did not touch is disturbed,
//! `check()` agrees with reads, and a checkpoint never turns a loss into
//! zeros. The volumes are written on the production scheduling.

use vouch_sim::metadata::{run, MetaConfig, MetaKind};
use vouch_sim::GuardKind;

fn run_and_check(config: &MetaConfig) {
    let report = run(config);
    let table = report.render(config);
    eprintln!("{table}");
    assert!(report.violations.is_empty(), "{table}");
    // The write rounds ran the production scheduling.
    assert!(
        report.inline_writes > 0 && report.background_commits > 0,
        "{table}"
    );
    for index in 0..config.cells.len() {
        for kind in MetaKind::ALL {
            let tally = report
                .tallies
                .get(&(index, kind))
                .copied()
                .unwrap_or_default();
            assert_eq!(
                tally.detected + tally.silent + tally.harmless,
                config.count,
                "{} in cell {index}",
                kind.label()
            );
        }
        // The losses the written map exists for are found, not merely
        // harmless: a zeroed unit, a deleted file (refused at open), an
        // older copy of every data and contexts file and of `written`
        // (refused at open: issue 28).
        for kind in [
            MetaKind::UnitZeroed,
            MetaKind::Deleted,
            MetaKind::OlderVolumeCopy,
        ] {
            let tally = report.tallies[&(index, kind)];
            assert_eq!(
                tally.detected,
                config.count,
                "{} in cell {index}: {table}",
                kind.label()
            );
        }
    }
}

#[test]
fn lost_metadata_is_never_read_as_never_written() {
    run_and_check(&MetaConfig::all(6, 11, false));
}

#[test]
fn lost_metadata_is_never_read_as_never_written_encrypted() {
    let mut config = MetaConfig::all(6, 12, true);
    config
        .cells
        .retain(|(_, guard)| *guard == GuardKind::Crc32c);
    run_and_check(&config);
}
