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
