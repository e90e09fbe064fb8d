//! A small detection-matrix run: no violations, and the headline numbers.

use vouch_engine::OrderingBreaks;
use vouch_sim::faults::{all_cells, run, run_cell_with, FaultConfig, Kind};
use vouch_sim::{GuardKind, LayoutKind};

#[test]
fn detection_matrix_small() {
    // 14 rows x 10 cells; `count` injections per kind per cell.
    let config = FaultConfig {
        cells: all_cells(),
        count: if !cfg!(sim_full) { 60 } else { 200 },
        seed: 7,
        threads: 2,
        encrypted: false,
    };
    let report = run(&config);
    let table = report.render(&config);
    eprintln!("{table}");
    assert!(report.violations.is_empty(), "{table}");
    // The production scheduling ran: inline writes and background commits.
    assert!(
        report.inline_writes > 0 && report.background_commits > 0,
        "inline writes {}, background commits {}",
        report.inline_writes,
        report.background_commits
    );
    let fraction = |layout: LayoutKind, guard: GuardKind, kind: Kind| {
        let index = config
            .cells
            .iter()
            .position(|cell| *cell == (layout, guard))
            .expect("cell");
        report
            .tallies
            .get(&(index, kind))
            .and_then(|tally| tally.fraction())
    };
    // Split with a real guard detects every kind, lost writes included.
    for kind in Kind::ALL {
        if let Some(f) = fraction(LayoutKind::Split, GuardKind::Crc32c, kind) {
            assert_eq!(f, 1.0, "split crc32c {kind:?}");
        }
    }
    // Packed misses a lost write of data and context together.
    assert_eq!(
        fraction(LayoutKind::Packed, GuardKind::Crc32c, Kind::LostWrite),
        Some(0.0)
    );
    assert_eq!(
        fraction(LayoutKind::Packed, GuardKind::Crc32c, Kind::DataBitFlip),
        Some(1.0)
    );
    // Without a guard, bit rot is silent; reference tags still catch packed
    // misdirection.
    assert_eq!(
        fraction(LayoutKind::Split, GuardKind::None, Kind::DataBitFlip),
        Some(0.0)
    );
    assert_eq!(
        fraction(LayoutKind::Packed, GuardKind::None, Kind::MisdirectedRead),
        Some(1.0)
    );
}

/// The encrypted column (issue 13): no violations; split detects every
/// kind, packed misses what its plain crc32c cell misses: a record write
/// lost whole leaves the old record, data and context together, which
/// authenticates at its LBA.
#[test]
fn detection_matrix_encrypted() {
    let config = FaultConfig {
        cells: vec![
            (LayoutKind::Split, GuardKind::Crc32c),
            (LayoutKind::Packed, GuardKind::Crc32c),
        ],
        count: if !cfg!(sim_full) { 60 } else { 200 },
        seed: 11,
        threads: 2,
        encrypted: true,
    };
    let report = run(&config);
    let table = report.render(&config);
    eprintln!("{table}");
    assert!(report.violations.is_empty(), "{table}");
    assert!(table.contains("split crc32c encrypted"), "{table}");
    for kind in Kind::ALL {
        if let Some(f) = report.tallies.get(&(0, kind)).and_then(|t| t.fraction()) {
            assert_eq!(f, 1.0, "split encrypted {kind:?}");
        }
    }
    let packed = |kind| report.tallies.get(&(1, kind)).and_then(|t| t.fraction());
    assert_eq!(packed(Kind::LostWrite), Some(0.0));
    assert_eq!(packed(Kind::DataBitFlip), Some(1.0));
    assert_eq!(packed(Kind::MisdirectedRead), Some(1.0));
}

/// The background committer emptying its held-log slot before its journal
/// record and home writes (`OrderingBreaks::empty_before_home`): when one
/// of those writes fails, the reopen after the error (a process restart)
/// has lost acknowledged writes. Seeds from 1 until one shows it.
#[test]
fn a_commit_emptying_its_slot_before_home_is_caught() {
    let breaks = OrderingBreaks {
        empty_before_home: true,
        ..OrderingBreaks::default()
    };
    let mut seen = Vec::new();
    for seed in 1..=8 {
        let result = run_cell_with(
            LayoutKind::Split,
            GuardKind::Crc32c,
            false,
            20,
            seed,
            breaks,
        );
        if result
            .violations
            .iter()
            .any(|violation| violation.contains("acknowledged write lost"))
        {
            eprintln!("seed {seed}: {}", result.violations.join("\n"));
            return;
        }
        seen.push(format!("seed {seed}: {:?}", result.violations));
    }
    panic!("not caught:\n{}", seen.join("\n"));
}
