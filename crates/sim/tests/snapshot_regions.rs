//! `vouch snapshot create`, `vouch clone` and `vouch snapshot delete` of a
//! volume with regions (its home member, its other member `layout.NAME/`
//! and its region record) crashed before each file operation they issue
//! (a process crash and two kinds of power cut each): a snapshot or clone
//! that has its name is complete (every file of both members byte for
//! byte, the record, every block read through the region layer), the
//! volume is untouched, and the command run again finishes. With the name
//! published before the files are synced, the power cuts are caught.

use vouch_engine::snapshot::SnapshotBreaks;
use vouch_sim::snapshot::SnapshotConfig;
use vouch_sim::LayoutKind;

#[test]
fn a_crash_during_a_snapshot_or_clone_of_a_volume_with_regions_leaves_none_or_a_whole_one() {
    for layout in LayoutKind::ALL {
        let config = SnapshotConfig {
            layout,
            seeds: 1,
            seed: 1,
            breaks: SnapshotBreaks::default(),
        };
        let report = vouch_sim::snapshot_regions::run(&config);
        eprintln!("{}", report.summary(&config));
        assert!(
            report.violations.is_empty() && report.images > 3 * 40,
            "{}\n{}",
            report.violations.join("\n"),
            report.summary(&config)
        );
    }
    let broken = SnapshotConfig {
        layout: LayoutKind::Packed,
        seeds: 1,
        seed: 1,
        breaks: SnapshotBreaks {
            publish_before_sync: true,
        },
    };
    let report = vouch_sim::snapshot_regions::run(&broken);
    assert!(
        report.violations.iter().any(|v| v.contains("power cut")),
        "publishing the name before the files are synced went unseen: {}",
        report.summary(&broken)
    );
}

/// The online snapshot of a served volume with regions (the control API's
/// create: region switches paused, both members held at one flush point)
/// taken at a step of its region's move to the other layout and back,
/// foreground writes arriving meanwhile, crashed before each of its file
/// operations (a process crash and two kinds of power cut each): a
/// snapshot that has its name reads exactly the volume's data at the
/// flush point through its region layer, read-only, and each member
/// checks clean; the volume keeps every write. Some seeds take it with
/// the region away from home and some mid-move. The flush point of the
/// home member alone (the control API before the fix) is caught.
#[test]
fn an_online_snapshot_of_a_volume_with_regions_mid_migration_holds_its_flush_point() {
    use vouch_sim::snapshot_online_regions::{run, summary, RegionsOnlineConfig};
    let config = |layout, seeds, break_home_only| RegionsOnlineConfig {
        layout,
        seeds,
        seed: 1,
        breaks: SnapshotBreaks::default(),
        break_home_only,
    };
    let (mut away, mut mid) = (0, 0);
    for layout in LayoutKind::ALL {
        let config = config(layout, 6, false);
        let online = run(&config);
        eprintln!("{}", summary(&online, &config));
        assert!(
            online.report.violations.is_empty() && online.report.images > 3 * 6 * 10,
            "{}\n{}",
            online.report.violations.join("\n"),
            summary(&online, &config)
        );
        away += online.taken_away;
        mid += online.taken_mid_move;
    }
    assert!(
        away > 0 && mid > 0,
        "no seed took its snapshot with the region away ({away}) or mid-move ({mid})"
    );
    let broken = config(LayoutKind::Split, 6, true);
    let online = run(&broken);
    assert!(
        online
            .report
            .violations
            .iter()
            .any(|v| v.contains("the snapshot: LBA")),
        "the home member's flush point alone went unseen: {}",
        summary(&online, &broken)
    );
}
