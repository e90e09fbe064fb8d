//! `vouch snapshot create` and `delete` of a mirror of two local legs
//! (`snapshot::create_legs`: each leg's copy at one flush point, every
//! copy synced before the first is named) crashed before each file
//! operation they issue (a process crash and two kinds of power cut
//! each): each leg's copy is whole or absent, the legs' own files are
//! untouched, copies present are of one snapshot, and the delete of what
//! is there followed by the create again leaves both legs a whole copy.
//! Some images find the legs disagreeing (a crash between the renames),
//! which `vouch snapshot list` reports. With the names published before
//! the files are synced, the power cuts are caught.

use vouch_engine::snapshot::SnapshotBreaks;
use vouch_sim::snapshot::SnapshotConfig;
use vouch_sim::LayoutKind;

#[test]
fn a_crash_during_a_snapshot_of_a_mirror_leaves_each_leg_a_whole_copy_or_none() {
    // One layout: the legs' copies are made by the code every layout's
    // single snapshot runs (`vouch-sim snapshot` crashes both layouts).
    let config = SnapshotConfig {
        layout: LayoutKind::Split,
        seeds: 1,
        seed: 1,
        breaks: SnapshotBreaks::default(),
    };
    let (report, disagreeing) = vouch_sim::snapshot_legs::run(&config);
    eprintln!("{} disagreeing={disagreeing}", report.summary(&config));
    assert!(
        report.violations.is_empty() && report.images > 3 * 40 && disagreeing > 0,
        "{}\n{} disagreeing={disagreeing}",
        report.violations.join("\n"),
        report.summary(&config)
    );
    let broken = SnapshotConfig {
        layout: LayoutKind::Packed,
        seeds: 1,
        seed: 1,
        breaks: SnapshotBreaks {
            publish_before_sync: true,
        },
    };
    let (report, _) = vouch_sim::snapshot_legs::run(&broken);
    assert!(
        report.violations.iter().any(|v| v.contains("power cut")),
        "publishing the names before the files are synced went unseen: {}",
        report.summary(&broken)
    );
}
