//! `vouch migrate` crashed (a process abort) right before each of its file
//! operations, to the other layout and back: every image reads what was written, and
//! running the migration again finishes it; split -> packed is also judged
//! after a reboot (the members' held logs gone). The deliberate breaks (the
//! old layout released before the record switches; the record switched
//! before the new member's flush) must be caught.

use std::path::PathBuf;

use vouch_sim::migrate::{run, MigrateConfig};
use vouch_sim::migrate_power::{PowerBreaks, PowerConfig, PowerReport};
use vouch_sim::LayoutKind;

fn config(layout: LayoutKind, seed: u64, break_release: bool) -> MigrateConfig {
    MigrateConfig {
        layout,
        seeds: 1,
        seed,
        child: PathBuf::from(env!("CARGO_BIN_EXE_vouch-sim")),
        break_release,
        break_switch: false,
        reboot: false,
        back: false,
        online: false,
        break_recopy: false,
        again_every: 1,
    }
}

#[test]
fn a_crash_at_any_operation_of_a_split_to_packed_migration_loses_nothing() {
    let config = MigrateConfig {
        reboot: true,
        ..config(LayoutKind::Split, 1, false)
    };
    let report = run(&config);
    eprintln!("{}", report.summary(&config));
    assert!(report.violations.is_empty(), "{:#?}", report.violations);
    assert!(
        report.images >= 20 && report.reboot_images == report.images,
        "{}",
        report.summary(&config)
    );
}

#[test]
fn a_crash_at_any_operation_of_a_migration_back_to_packed_loses_nothing() {
    // Packed -> split uncrashed, then packed again, crashed: the way back
    // ends by making it a one-layout volume (flag cleared, record and
    // member removed).
    let config = MigrateConfig {
        back: true,
        ..config(LayoutKind::Packed, 3, false)
    };
    let report = run(&config);
    eprintln!("{}", report.summary(&config));
    assert!(report.violations.is_empty(), "{:#?}", report.violations);
    assert!(report.images >= 20, "{}", report.summary(&config));
}

#[test]
fn releasing_the_old_layout_before_the_switch_is_caught() {
    let config = MigrateConfig {
        seeds: 1,
        ..config(LayoutKind::Split, 5, true)
    };
    let report = run(&config);
    eprintln!("{}", report.summary(&config));
    assert!(!report.violations.is_empty(), "{}", report.summary(&config));
}

/// The record switched before the new member's flush: the region's new
/// copy is still only in that member's write-back buffer and held log, so
/// an image after the switch reads it whole after a process crash, and
/// loses it after a reboot.
#[test]
fn switching_before_the_new_member_is_flushed_is_caught_by_a_reboot() {
    let config = MigrateConfig {
        break_switch: true,
        reboot: true,
        ..config(LayoutKind::Split, 1, false)
    };
    let report = run(&config);
    eprintln!("{}", report.summary(&config));
    assert!(
        report.violations.iter().any(|v| v.contains("rebooted")),
        "{}",
        report.summary(&config)
    );
}

/// The online move (issue 33) with a foreground write before each of its
/// file operations, crashed at each: every acknowledged write is in the
/// image, and running it again finishes.
#[test]
fn a_crash_at_any_step_of_an_online_move_with_writes_loses_nothing() {
    let config = MigrateConfig {
        online: true,
        // Each run again moves a whole 62 MiB region: after every 4th
        // crash point (and the last) keeps CI's time; `vouch-sim migrate
        // --online` runs it again after each.
        again_every: 4,
        ..config(LayoutKind::Split, 7, false)
    };
    let report = run(&config);
    eprintln!("{}", report.summary(&config));
    assert!(report.violations.is_empty(), "{:#?}", report.violations);
    assert!(report.images >= 20, "{}", report.summary(&config));
}

#[test]
fn an_online_move_that_never_copies_again_what_was_written_mid_move_is_caught() {
    let config = MigrateConfig {
        online: true,
        break_recopy: true,
        ..config(LayoutKind::Packed, 9, false)
    };
    let report = run(&config);
    eprintln!("{}", report.summary(&config));
    assert!(!report.violations.is_empty(), "{}", report.summary(&config));
}

fn power(layout: LayoutKind, seed: u64, breaks: PowerBreaks) -> PowerConfig {
    PowerConfig {
        layout,
        seeds: 1,
        seed,
        back: false,
        // Nothing unsynced kept and everything kept at every point, the
        // migration run again on the images of every 8th (and the last):
        // CI's time. `vouch-sim migrate --power` keeps subsets too and runs
        // it again at each.
        subsets: 0,
        again_every: 8,
        from_point: 1,
        breaks,
    }
}

/// Each break runs the configuration of the test without one
/// (`a_power_cut_at_any_operation_of_a_migration_loses_nothing`: split,
/// seed 1), which finds nothing.
fn power_run(config: &PowerConfig) -> PowerReport {
    let report = vouch_sim::migrate_power::run(config);
    eprintln!("{}", report.summary(config));
    report
}

/// Power cuts (issue 33): every file and directory of the volume in the
/// model filesystem; at each operation of a split -> packed migration,
/// images that keep nothing unsynced, everything, a random subset (renames
/// not yet made durable undone): each reads what was written, and the
/// migration run again finishes; the open that catches up a record newer
/// than the superblock is cut at each of its steps too.
#[test]
fn a_power_cut_at_any_operation_of_a_migration_loses_nothing() {
    let config = PowerConfig {
        // One image keeping a random subset of the unsynced files too.
        subsets: 1,
        ..power(LayoutKind::Split, 1, PowerBreaks::default())
    };
    let report = power_run(&config);
    assert!(report.violations.is_empty(), "{:#?}", report.violations);
    assert!(
        report.points >= 20 && report.rewrites >= 2 && report.rewrite_images >= 12,
        "{}",
        report.summary(&config)
    );
}

/// The same on the way back to the home layout (packed -> split -> packed),
/// which ends by making it a one-layout volume again.
#[test]
fn a_power_cut_at_any_operation_of_a_migration_back_loses_nothing() {
    let config = PowerConfig {
        back: true,
        ..power(LayoutKind::Packed, 3, PowerBreaks::default())
    };
    let report = power_run(&config);
    assert!(report.violations.is_empty(), "{:#?}", report.violations);
    assert!(report.points >= 20, "{}", report.summary(&config));
}

/// The run on split seed 1 with `breaks` on, judged from operation
/// `from_point` on.
fn broken(breaks: PowerBreaks, from_point: u64) -> PowerReport {
    power_run(&PowerConfig {
        from_point,
        ..power(LayoutKind::Split, 1, breaks)
    })
}

#[test]
fn a_switch_before_the_new_member_is_flushed_is_caught_by_a_power_cut() {
    let breaks = PowerBreaks {
        switch: true,
        ..PowerBreaks::default()
    };
    // Caught at operation 28 (the first switch): judged from 26 on.
    assert!(!broken(breaks, 26).violations.is_empty(), "not caught");
}

#[test]
fn a_record_not_synced_before_the_superblock_names_it_is_caught() {
    let breaks = PowerBreaks {
        record_sync: true,
        ..PowerBreaks::default()
    };
    assert!(!broken(breaks, 1).violations.is_empty(), "not caught");
}

#[test]
fn a_member_and_record_not_durable_in_the_directory_before_the_flag_is_caught() {
    let breaks = PowerBreaks {
        dir_sync: true,
        ..PowerBreaks::default()
    };
    assert!(!broken(breaks, 1).violations.is_empty(), "not caught");
}

#[test]
fn an_open_catching_up_the_record_without_its_fsync_is_caught() {
    let breaks = PowerBreaks {
        rewrite_sync: true,
        ..PowerBreaks::default()
    };
    // The first switch's catch-up is cut at operation 28-29: judged from
    // 26 on.
    let report = broken(breaks, 26);
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.contains("the open catching the record up")),
        "{:#?}",
        report.violations
    );
}
