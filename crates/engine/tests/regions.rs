//! The region layer (`vouch_engine::regions`) through the engine's API:
//! what a migration does with a member's reply it cannot trust, a switch
//! whose record or superblock write fails, and the way back home.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vouch_engine::DeviceWrites;

use common::pattern;
use vouch_engine::regions::{self, MigrateBreaks, OnlineBreaks, OnlineMigrate, RegionVolume};
use vouch_engine::{
    create_volume, open_volume, BlockDevice, CreateOptions, LayoutKind, OpenOptions, BLOCK,
};
use vouch_format::regions::REGION_BLOCKS;

const BLOCKS: u64 = 512;

/// The review of migrate33, L1: a block-status reply that covers less
/// than the chunk asked about stops the migration; the rest of the chunk
/// is never taken for holes (it would be left behind, then trimmed from
/// the old member, and read as zeros).
#[test]
fn a_short_block_status_reply_stops_the_migration_never_read_as_holes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, data) = split_volume(dir.path(), BLOCKS, BLOCKS, 7);

    let breaks = MigrateBreaks {
        short_status: true,
        ..MigrateBreaks::default()
    };
    let error = regions::migrate(
        &path,
        LayoutKind::Packed,
        &OpenOptions::default(),
        &breaks,
        |_, _| {},
    )
    .expect_err("a short reply: stopped");
    assert!(error.to_string().contains("short reply"), "{error}");

    // Every block still reads back from the member serving it.
    let volume = RegionVolume::open(&path, &OpenOptions::default()).expect("open");
    let mut back = vec![0u8; data.len()];
    volume.read(0, &mut back).expect("read");
    assert!(back == data, "a block changed or reads as zeros");
    assert_eq!(
        volume.record().counts(),
        [1, 0],
        "the region was not switched"
    );
    volume.close().expect("close");
}

/// A closed split volume of `blocks` at `dir/volume` with
/// `pattern(lba, tag)` in its first `written` blocks (returned).
fn split_volume(
    dir: &std::path::Path,
    blocks: u64,
    written: u64,
    tag: u8,
) -> (std::path::PathBuf, Vec<u8>) {
    let path = dir.join("volume");
    let mut options = CreateOptions::new(blocks * BLOCK);
    options.layout = LayoutKind::Split;
    let volume = create_volume(&path, &options).expect("create");
    let data: Vec<u8> = (0..written).flat_map(|lba| pattern(lba, tag)).collect();
    volume.write(0, &data, false).expect("write");
    volume.close().expect("close");
    (path, data)
}

/// A split volume of one region with `pattern(lba, 1)` in its first 64
/// blocks, made a volume with regions (every region home) and open.
fn served_region_volume(dir: &std::path::Path) -> (std::path::PathBuf, RegionVolume) {
    let (path, _) = split_volume(dir, REGION_BLOCKS, 64, 1);
    let home = open_volume(&path, &OpenOptions::default()).expect("open");
    let volume = regions::open_served(&path, home, &OpenOptions::default()).expect("served");
    (path, volume)
}

/// `served_region_volume` migrated online to packed with `breaks` (an
/// injected fault: the migration fails on it), the volume still open.
fn a_failed_switch(breaks: OnlineBreaks) -> (tempfile::TempDir, std::path::PathBuf, RegionVolume) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, volume) = served_region_volume(dir.path());
    let stop = AtomicBool::new(false);
    let how = OnlineMigrate {
        target: LayoutKind::Packed,
        rate: None,
        stop: &stop,
    };
    let error = volume
        .migrate_online_driven(&how, &regions::Steps::new(None), breaks, |_, _| {})
        .expect_err("the switch failed");
    assert!(error.to_string().contains("injected"), "{error}");
    (dir, path, volume)
}

/// MED-1 of the regions review: the region record's fsync fails during an
/// online switch after its bytes were written (they may reach the disk:
/// a restart may read the new record). A write to the region after that
/// must not be acknowledged into the member memory still names: it is
/// refused until a restart decides (without the fix it went to the old
/// member, and the restart served the region from the new one: lost).
#[test]
fn a_failed_record_fsync_mid_switch_refuses_writes_until_a_restart_decides() {
    let fault = OnlineBreaks {
        fail_record_sync: true,
        ..OnlineBreaks::default()
    };
    let (_dir, path, volume) = a_failed_switch(fault);
    let wrote = volume.write(0, &pattern(0, 2), false);
    let refused = wrote.as_ref().err().map(ToString::to_string);
    assert!(
        refused
            .as_deref()
            .is_some_and(|why| why.contains("restarted")),
        "a write after a failed record write was acknowledged: {wrote:?}"
    );
    assert!(volume.fenced().is_some());
    // Reads go on, from either member (both hold the region).
    let mut back = vec![0u8; BLOCK as usize];
    volume.read(0, &mut back).expect("read");
    assert!(back == pattern(0, 1));
    volume.close().expect("close");
    // The restart: whichever member the record names holds every block.
    let volume = RegionVolume::open(&path, &OpenOptions::default()).expect("reopen");
    let mut back = vec![0u8; 64 * BLOCK as usize];
    volume.read(0, &mut back).expect("read");
    let want: Vec<u8> = (0..64).flat_map(|lba| pattern(lba, 1)).collect();
    assert!(back == want, "a block changed across the restart");
    volume
        .write(0, &pattern(0, 3), false)
        .expect("writes again after the restart");
    volume.close().expect("close");
}

/// MED-1 too: the record was written and synced but the home superblock's
/// `regions_seq` write failed. The record on disk names the new member,
/// so memory must too: a write after the failure goes there and is read
/// back after a restart (without the fix it went to the old member, which
/// the restart no longer serves the region from).
#[test]
fn a_failed_regions_seq_write_after_the_record_switches_memory_with_the_record() {
    let (_dir, path, volume) = a_failed_switch(OnlineBreaks {
        fail_regions_seq: true,
        ..OnlineBreaks::default()
    });
    assert_eq!(
        volume.layout_of(0),
        LayoutKind::Packed,
        "memory follows the record"
    );
    let switched = volume.record_seq();
    volume.write(0, &pattern(0, 2), false).expect("write");
    volume.close().expect("close");
    let volume = RegionVolume::open(&path, &OpenOptions::default()).expect("reopen");
    assert_eq!(volume.layout_of(0), LayoutKind::Packed);
    // review38 MED-1: the open found the record newer than `regions_seq`
    // and wrote it again, one newer, fsynced, before serving from it.
    assert_eq!(
        volume.record_seq(),
        switched + 1,
        "the record was not written again"
    );
    let home = vouch_engine::volume_superblock(&path).expect("superblock");
    assert_eq!(home.regions_seq, switched + 1);
    let mut back = vec![0u8; BLOCK as usize];
    volume.read(0, &mut back).expect("read");
    assert!(back == pattern(0, 2), "the acknowledged write was lost");
    volume.close().expect("close");
}

/// MED-2 of the regions review: migrating back home ends by clearing the
/// flag and removing the record and the member; the home's lock must be
/// held until they are gone. A second opener (a server, another
/// `migrate`) tried at every step after the flag is cleared must be
/// refused, or it could make a member of its own that the removal then
/// deletes under it.
#[test]
fn the_way_back_home_holds_the_lock_until_the_member_is_removed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, data) = split_volume(dir.path(), BLOCKS, BLOCKS, 4);
    let none = MigrateBreaks::default();
    let open = OpenOptions::default();
    regions::migrate(&path, LayoutKind::Packed, &open, &none, |_, _| {}).expect("to packed");

    let member = regions::member_path(&path, LayoutKind::Split);
    let tries: Arc<Mutex<Vec<Result<(), String>>>> = Arc::default();
    let hook = {
        let (path, member, tries) = (path.clone(), member.clone(), Arc::clone(&tries));
        Box::new(move |_locked: bool| {
            let flagged = vouch_engine::volume_superblock(&path)
                .map(|superblock| regions::has_regions(&superblock))
                .unwrap_or(true);
            if flagged || !member.exists() {
                return;
            }
            let opened = open_volume(&path, &OpenOptions::default());
            tries.lock().expect("tries").push(match opened {
                Ok(volume) => {
                    volume.close().expect("close");
                    Ok(())
                }
                Err(error) => Err(error.to_string()),
            });
        })
    };
    let steps = regions::Steps::with_hook(None, hook);
    regions::migrate_driven(&path, LayoutKind::Split, &open, &none, &steps, |_, _| {})
        .expect("back home");
    let tries = tries.lock().expect("tries").clone();
    assert!(!tries.is_empty(), "no step came after the flag was cleared");
    assert!(
        tries.iter().all(Result::is_err),
        "a second opener got the volume while the member was still there: {tries:?}"
    );
    assert!(!member.exists());
    let volume = open_volume(&path, &open).expect("open");
    let mut back = vec![0u8; data.len()];
    volume.read(0, &mut back).expect("read");
    assert!(back == data);
    volume.close().expect("close");
}

/// review38 HIGH-1: a write that reached the moving region while its
/// switch held the lock waits for it; if the switch then fails writing
/// the record, the write, once it gets the lock, must be refused too (the
/// fence went up while it waited), not acknowledged into the old member.
#[test]
fn a_write_waiting_on_a_switch_that_fails_is_refused_once_it_gets_the_lock() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, volume) = served_region_volume(dir.path());
    let volume = Arc::new(volume);
    type Writer = std::thread::JoinHandle<Result<(), String>>;
    let writer: Arc<Mutex<Option<Writer>>> = Arc::default();
    let hook = {
        let (volume, writer) = (Arc::clone(&volume), Arc::clone(&writer));
        Box::new(move |locked: bool| {
            let mut writer = writer.lock().expect("writer");
            if !locked || writer.is_some() {
                return;
            }
            // The switch holds the region's lock: a write now waits in it.
            let before = volume.foreground_requests();
            let waiting = Arc::clone(&volume);
            *writer = Some(std::thread::spawn(move || {
                waiting
                    .write(0, &pattern(0, 2), false)
                    .map_err(|error| error.to_string())
            }));
            let deadline = Instant::now() + Duration::from_secs(60);
            while volume.foreground_requests() == before {
                assert!(Instant::now() < deadline, "the write never came");
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let steps = regions::Steps::with_hook(None, hook);
    let stop = AtomicBool::new(false);
    let how = OnlineMigrate {
        target: LayoutKind::Packed,
        rate: None,
        stop: &stop,
    };
    let fault = OnlineBreaks {
        fail_record_sync: true,
        ..OnlineBreaks::default()
    };
    let error = volume
        .migrate_online_driven(&how, &steps, fault, |_, _| {})
        .expect_err("the switch failed");
    assert!(error.to_string().contains("injected"), "{error}");
    drop(steps);
    let wrote = writer
        .lock()
        .expect("writer")
        .take()
        .expect("a write was sent while the lock was held")
        .join()
        .expect("the writer");
    assert!(
        wrote.as_ref().is_err_and(|why| why.contains("restarted")),
        "a write that waited on the failed switch was acknowledged: {wrote:?}"
    );
    let volume = Arc::try_unwrap(volume).unwrap_or_else(|_| panic!("still shared"));
    volume.close().expect("close");
    let volume = RegionVolume::open(&path, &OpenOptions::default()).expect("reopen");
    let mut back = vec![0u8; BLOCK as usize];
    volume.read(0, &mut back).expect("read");
    assert!(back == pattern(0, 1), "block 0 changed across the restart");
    volume.close().expect("close");
}
