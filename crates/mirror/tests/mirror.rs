//! Mirrors over real volume directories: the set on disk, read repair
//! (data and context corruption), a block bad on every leg, the fault
//! threshold, scrub repair with a stale copy, a missing leg.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vouch_engine::jobs::{Cursor, JobControl};
use vouch_engine::SealedWrites;
use vouch_engine::{
    open_volume, Admission, BlockDevice, CreateOptions, DeviceWrites, Error, FaultKind,
    OpenOptions, SealedDevice, Volume, ZeroFlags, BLOCK,
};

/// The reactor's inline write (`Admission::MustNotWait`): whether it was done.
fn try_write<D: BlockDevice + ?Sized>(
    device: &D,
    offset: u64,
    data: &[u8],
) -> vouch_engine::Result<bool> {
    device
        .submit_write(
            offset,
            &bytes::Bytes::copy_from_slice(data),
            false,
            Admission::MustNotWait,
        )
        .map(|submitted| submitted.is_done())
}
use vouch_mirror as mirror;
use vouch_mirror::{create_mirror, open_mirror, LegState, Mirror};

fn pattern(lba: u64, tag: u8) -> Vec<u8> {
    (0..BLOCK as usize)
        .map(|i| (i as u8).wrapping_mul(31) ^ (lba as u8) ^ tag)
        .collect()
}

fn legs(dir: &Path, n: usize) -> Vec<PathBuf> {
    (0..n).map(|i| dir.join(format!("leg{i}"))).collect()
}

fn options() -> OpenOptions {
    OpenOptions::foreground()
}

/// Open the set from `path` as a Mirror over its legs.
fn open(path: &Path) -> (Arc<Mirror>, Vec<Option<Arc<Volume>>>) {
    open_mirror(path, true, &mut |leg| open_volume(leg, &options()))
        .expect("open set")
        .into_mirror(true)
        .expect("mirror")
}

fn close(mirror: Arc<Mirror>, volumes: Vec<Option<Arc<Volume>>>) {
    drop(mirror);
    for volume in volumes.into_iter().flatten() {
        Arc::try_unwrap(volume)
            .ok()
            .expect("sole owner")
            .close()
            .expect("close");
    }
}

fn create(dir: &Path, n: usize) -> Vec<PathBuf> {
    let paths = legs(dir, n);
    create_mirror(&paths, &CreateOptions::new(4 << 20))
        .expect("create")
        .close()
        .expect("close");
    paths
}

fn write_blocks(mirror: &Mirror, count: u64, tag: u8) {
    for lba in 0..count {
        mirror
            .write(lba * BLOCK, &pattern(lba, tag), false)
            .expect("write");
    }
    mirror.flush().expect("flush");
}

fn flip(path: &Path, offset: u64) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open");
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, offset).expect("read");
    byte[0] ^= 0x10;
    file.write_all_at(&byte, offset).expect("write");
}

fn read_all_legs(mirror: &Mirror, lba: u64) -> Vec<Result<Vec<u8>, Error>> {
    (0..3)
        .map(|_| {
            let mut buf = vec![0u8; BLOCK as usize];
            mirror.read(lba * BLOCK, &mut buf).map(|_| buf)
        })
        .collect()
}

fn check_clean(path: &Path) {
    let volume = open_volume(
        path,
        &OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        },
    )
    .expect("open leg alone");
    let report = volume.check(|_, _| {}).expect("check");
    assert!(
        report.faults.is_empty(),
        "{}: {:?}",
        path.display(),
        report.faults
    );
}

#[test]
fn a_corrupt_block_on_one_leg_is_served_good_and_repaired_on_disk() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 2);
    assert!(mirror::is_mirrored(&paths[1]));
    let (mirror, volumes) = open(&paths[1]);
    write_blocks(&mirror, 16, 1);
    close(mirror, volumes);
    // A data byte of LBA 5 and the context of LBA 9 on leg 1 (contexts
    // reach their table at the checkpoint of a clean close).
    flip(&paths[1].join("data.00000"), 5 * BLOCK + 77);
    flip(&paths[1].join("contexts"), 9 * 32 + 20);
    let (mirror, volumes) = open(&paths[1]);
    for lba in [5, 9] {
        for result in read_all_legs(&mirror, lba) {
            assert_eq!(result.expect("good data"), pattern(lba, 1));
        }
    }
    let status = mirror.status();
    assert_eq!(status[1].corrected, 2, "{status:?}");
    assert_eq!(status[0].corrected, 0);
    assert!(status[1]
        .repairs
        .iter()
        .any(|r| r.kind == "guard_mismatch" && r.repaired));
    assert!(status[1]
        .repairs
        .iter()
        .any(|r| r.kind == "context_corrupt" && r.repaired));
    close(mirror, volumes);
    check_clean(&paths[1]);
    let mut raw = vec![0u8; BLOCK as usize];
    std::fs::File::open(paths[1].join("data.00000"))
        .expect("open")
        .read_exact_at(&mut raw, 5 * BLOCK)
        .expect("read");
    assert_eq!(raw, pattern(5, 1), "the data on leg 1's disk is repaired");
}

/// A repair writes a leg like any mirror write: its extent is in the
/// activity log on disk before the block reaches the bad leg, so a crash
/// during the repair is reconciled at the next open, not counted later.
#[test]
fn a_read_repair_enters_the_activity_log_before_it_writes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 2);
    let (mirror, volumes) = open(&paths[1]);
    write_blocks(&mirror, 16, 1);
    close(mirror, volumes);
    flip(&paths[1].join("data.00000"), 5 * BLOCK + 77);
    let (mirror, volumes) = open(&paths[1]);
    let record = mirror::set::read_record(&paths[1]).expect("record");
    let blocks = mirror.size() / BLOCK;
    // A set never served has no log yet: nothing carried over.
    let (log, _) = mirror::set::open_activity(&record, blocks).expect("log");
    assert_eq!(log.logged(), 0);
    mirror
        .keep_activity_log(Arc::new(log))
        .expect("keep the log");
    // Only reads from here: whatever the log names, a repair put there.
    for result in read_all_legs(&mirror, 5) {
        assert_eq!(result.expect("good data"), pattern(5, 1));
    }
    assert_eq!(mirror.status()[1].corrected, 1);
    assert_eq!(
        mirror.activity_log().expect("kept").logged(),
        1,
        "the repair's extent is in the log"
    );
    // What a crash now leaves: the extent to reconcile.
    assert_eq!(
        mirror::set::peek_activity(&record, blocks).expect("peek"),
        mirror::Recovered::Extents(vec![0])
    );
    close(mirror, volumes);
}

#[test]
fn a_block_bad_on_every_leg_fails_naming_it_and_nothing_is_rewritten() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 2);
    let (mirror, volumes) = open(&paths[0]);
    write_blocks(&mirror, 8, 2);
    flip(&paths[0].join("data.00000"), 3 * BLOCK + 1);
    flip(&paths[1].join("data.00000"), 3 * BLOCK + 2);
    let before: Vec<Vec<u8>> = paths
        .iter()
        .map(|p| std::fs::read(p.join("data.00000")).expect("read"))
        .collect();
    for result in read_all_legs(&mirror, 3) {
        match result {
            Err(Error::Fault(fault)) => {
                assert_eq!(fault.lba, 3);
                assert_eq!(fault.kind, FaultKind::GuardMismatch);
            }
            other => panic!("expected a fault naming LBA 3: {other:?}"),
        }
    }
    assert_eq!(
        read_all_legs(&mirror, 4)[0].as_ref().expect("ok"),
        &pattern(4, 2)
    );
    let after: Vec<Vec<u8>> = paths
        .iter()
        .map(|p| std::fs::read(p.join("data.00000")).expect("read"))
        .collect();
    assert_eq!(before, after, "nothing rewritten");
    assert!(mirror.status().iter().all(|leg| leg.corrected == 0));
    close(mirror, volumes);
}

#[test]
fn a_leg_needing_more_than_twenty_repairs_is_faulted_and_recorded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 3);
    let (mirror, volumes) = open(&paths[0]);
    write_blocks(&mirror, 32, 3);
    for lba in 0..21 {
        flip(&paths[2].join("data.00000"), lba * BLOCK + 9);
    }
    for lba in 0..21 {
        let mut buf = vec![0u8; BLOCK as usize];
        // The repairing path reads every leg's copy of a faulty block.
        let faults = mirror
            .read_blocks_collecting(lba, 1, &mut buf)
            .expect("read");
        assert!(faults.is_empty());
        assert_eq!(buf, pattern(lba, 3));
        // Round robin reached leg 2 for at most one in three; read the
        // rest through the scrub below.
    }
    let report = mirror::scrub::scrub(
        &mirror,
        &vouch_engine::scrub::ScrubOptions::default(),
        &JobControl::default(),
    )
    .expect("scrub");
    let status = mirror.status();
    assert_eq!(status[2].corrected, 21, "{status:?} {report:?}");
    assert_eq!(status[2].state, LegState::Faulted);
    assert_eq!(mirror.active(), vec![0, 1]);
    close(mirror, volumes);
    let record = mirror::set::read_record(&paths[0]).expect("record");
    assert_eq!(record.members[2].state, LegState::Faulted);
    // Reopened from any leg, the faulted leg stays out.
    let set = open_mirror(&paths[2], false, &mut |p| open_volume(p, &options())).expect("open");
    assert!(set.legs[2].volume.is_none());
    assert!(
        set.warnings.iter().any(|w| w.contains("faulted")),
        "{:?}",
        set.warnings
    );
}

/// A write lost on leg 1 (LBA 2's old data and context put back) makes
/// its context page older than the generation leg 1's written map
/// expects of it: the whole page is lost there (which of its contexts
/// are stale cannot be told) and repaired from leg 0, and a block corrupt
/// on leg 0 in another page is repaired from leg 1.
#[test]
fn scrub_repairs_and_a_stale_copy_loses_to_the_newer_generation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 2);
    let (mirror, volumes) = open(&paths[0]);
    write_blocks(&mirror, 8, 4);
    mirror
        .write(130 * BLOCK, &pattern(130, 4), false)
        .expect("write");
    // Keep leg 1's old sealed LBA 2 (data + context) as stored.
    let old = volumes[1]
        .as_ref()
        .expect("leg")
        .read_sealed(2, 1)
        .expect("sealed");
    mirror
        .write(2 * BLOCK, &pattern(2, 5), false)
        .expect("write");
    mirror.flush().expect("flush");
    close(mirror, volumes);
    // Lose that write on leg 1: put its old bytes and context back on
    // disk, as a lost write would leave them (still valid, older).
    let old_context = match old[0].context {
        vouch_mirror::Context::Data { .. } => old[0].context.encode(),
        other => panic!("data context expected: {other:?}"),
    };
    let data = std::fs::OpenOptions::new()
        .write(true)
        .open(paths[1].join("data.00000"))
        .expect("open");
    data.write_all_at(&old[0].data[..], 2 * BLOCK)
        .expect("write");
    let contexts = std::fs::OpenOptions::new()
        .write(true)
        .open(paths[1].join("contexts"))
        .expect("open");
    contexts.write_all_at(&old_context, 2 * 32).expect("write");
    drop((data, contexts));
    // Corrupt LBA 130 (context page 1) on leg 0 too.
    flip(&paths[0].join("data.00000"), 130 * BLOCK + 3);

    let (mirror, volumes) = open(&paths[0]);
    let report = mirror::scrub::scrub(
        &mirror,
        &vouch_engine::scrub::ScrubOptions::default(),
        &JobControl::default(),
    )
    .expect("scrub");
    // Page 0 on leg 1 (128 blocks), and LBA 130 on leg 0.
    assert_eq!(
        (report.found, report.repaired, report.left),
        (129, 129, 0),
        "{report:?}"
    );
    assert!(report
        .findings
        .iter()
        .any(|f| f.lba == 2 && f.leg == 1 && f.kind == "metadata_lost" && f.repaired));
    assert!(report
        .findings
        .iter()
        .any(|f| f.lba == 130 && f.leg == 0 && f.kind == "guard_mismatch" && f.repaired));
    let again = mirror::scrub::scrub(
        &mirror,
        &vouch_engine::scrub::ScrubOptions::default(),
        &JobControl::default(),
    )
    .expect("scrub");
    assert_eq!(again.found, 0, "{again:?}");
    close(mirror, volumes);
    for path in &paths {
        let volume = open_volume(path, &options()).expect("open");
        let mut buf = vec![0u8; BLOCK as usize];
        volume.read(2 * BLOCK, &mut buf).expect("read");
        assert_eq!(buf, pattern(2, 5), "{}: the newer copy won", path.display());
        volume.close().expect("close");
    }
}

/// Byte ranges (an NBD client that negotiated no block size): a write
/// of one byte is sealed once for every leg, and a zeroing or trim whose
/// ends fall inside a 512-byte sector writes those bytes as zeros through
/// the mirror, the whole sectors going to the legs; every leg then reads
/// the same bytes, and the model's.
#[test]
fn byte_ranges_reach_every_leg_alike() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 2);
    let (mirror, volumes) = open(&paths[0]);
    write_blocks(&mirror, 4, 1);
    let mut model: Vec<u8> = (0..4).flat_map(|lba| pattern(lba, 1)).collect();
    mirror.write(1, &[0xAB], false).expect("one byte");
    model[1] = 0xAB;
    mirror
        .write_zeroes(BLOCK - 1, 3, ZeroFlags::default())
        .expect("three zero bytes across a block boundary");
    model[BLOCK as usize - 1..BLOCK as usize + 2].fill(0);
    let trim = 2 * BLOCK + 7..3 * BLOCK + 9;
    mirror
        .trim(trim.start, trim.end - trim.start, false)
        .expect("trim with sub-sector ends");
    model[trim.start as usize..trim.end as usize].fill(0);
    mirror.flush().expect("flush");
    let mut buf = vec![0u8; model.len()];
    mirror.read(0, &mut buf).expect("read");
    assert!(buf == model, "the mirror reads the model");
    for (leg, volume) in volumes.iter().enumerate() {
        let volume = volume.as_ref().expect("leg");
        volume.read(0, &mut buf).expect("read leg");
        assert!(buf == model, "leg {leg} reads the model");
    }
    let contexts: Vec<_> = volumes
        .iter()
        .map(|v| v.as_ref().expect("leg").read_sealed(0, 1).expect("sealed")[0].context)
        .collect();
    assert_eq!(contexts[0], contexts[1], "one seal for the one-byte write");
    close(mirror, volumes);
    for path in &paths {
        check_clean(path);
    }
}

/// A mirrored write is sealed once: every leg stores the same bytes and
/// the same context (one generation from the mirror's clock), a sub-block
/// write included; a later write of a block gets a higher generation on
/// every leg. A copy whose generation is above the mirror's clock (the
/// exporter never stamped it) does not win a scrub.
#[test]
fn legs_store_one_context_per_write_and_an_impossible_generation_is_not_believed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 2);
    let (mirror, volumes) = open(&paths[0]);
    write_blocks(&mirror, 4, 1);
    mirror
        .write(BLOCK + 512, &[0xAB; 1024], false)
        .expect("sub-block write");
    mirror.flush().expect("flush");
    let sealed = |lba: u64| -> Vec<vouch_engine::SealedBlock> {
        volumes
            .iter()
            .map(|v| {
                v.as_ref()
                    .expect("leg")
                    .read_sealed(lba, 1)
                    .expect("sealed")
                    .remove(0)
            })
            .collect()
    };
    for lba in 0..4 {
        let copies = sealed(lba);
        assert_eq!(
            copies[0].context, copies[1].context,
            "LBA {lba}: one context on both legs"
        );
        assert_eq!(copies[0].data, copies[1].data, "LBA {lba}");
    }
    let mut expected = pattern(1, 1);
    expected[512..1536].fill(0xAB);
    assert_eq!(&sealed(1)[0].data[..], &expected[..]);
    let before = sealed(3)[0].context.generation().expect("generation");
    mirror
        .write(3 * BLOCK, &pattern(3, 2), false)
        .expect("write");
    mirror.flush().expect("flush");
    let after = sealed(3);
    assert_eq!(after[0].context, after[1].context);
    assert!(after[0].context.generation().expect("generation") > before);

    // Forge a copy on leg 1 with a generation far above the clock (its
    // guard right, so it verifies), then scrub: leg 0's copy stays.
    let forged_generation = mirror.generation_clock() + 1000;
    let leg1 = volumes[1].as_ref().expect("leg");
    let forged = leg1
        .seal_blocks(3, &bytes::Bytes::from(pattern(3, 9)), forged_generation)
        .expect("seal");
    assert_eq!(
        forged[0].context.generation(),
        Some(forged_generation as u32)
    );
    leg1.write_sealed(&forged).expect("store the forged copy");
    volumes[1].as_ref().expect("leg").flush().expect("flush");
    let report = mirror::scrub::scrub(
        &mirror,
        &vouch_engine::scrub::ScrubOptions::default(),
        &JobControl::default(),
    )
    .expect("scrub");
    assert!(
        report
            .findings
            .iter()
            .any(|f| f.lba == 3 && f.leg == 1 && f.repaired),
        "the forged copy is repaired from leg 0: {report:?}"
    );
    for (at, volume) in volumes.iter().enumerate() {
        let mut buf = vec![0u8; BLOCK as usize];
        volume
            .as_ref()
            .expect("leg")
            .read(3 * BLOCK, &mut buf)
            .expect("read");
        assert_eq!(buf, pattern(3, 2), "leg {at} holds the last write");
    }
    close(mirror, volumes);
}

/// The inline write path: with background committers, `try_write` of
/// whole blocks buffers the write on every leg at once (one context on
/// both); a partial block, or legs without a background committer,
/// decline with nothing written.
#[test]
fn the_inline_write_buffers_on_every_leg_or_declines_with_nothing_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 2);
    let (mirror, volumes) = open(&paths[0]);
    // Without background committers (these tests' options) it declines.
    assert!(!try_write(&*mirror, 0, &pattern(0, 3)).expect("try"));
    close(mirror, volumes);
    let background = OpenOptions::default();
    let (mirror, volumes) = open_mirror(&paths[0], true, &mut |leg| open_volume(leg, &background))
        .expect("open set")
        .into_mirror(true)
        .expect("mirror");
    assert!(
        !try_write(&*mirror, 512, &[1u8; 4096]).expect("try"),
        "unaligned declines"
    );
    let mut data = pattern(4, 3);
    data.extend(pattern(5, 3));
    assert!(
        try_write(&*mirror, 4 * BLOCK, &data).expect("try"),
        "room: buffered inline"
    );
    for lba in [4, 5] {
        let copies: Vec<_> = volumes
            .iter()
            .map(|v| {
                v.as_ref()
                    .expect("leg")
                    .read_sealed(lba, 1)
                    .expect("sealed")
                    .remove(0)
            })
            .collect();
        assert_eq!(copies[0].context, copies[1].context, "LBA {lba}");
        assert_eq!(&copies[0].data[..], &pattern(lba, 3)[..], "LBA {lba}");
        assert_eq!(copies[0].data, copies[1].data, "LBA {lba}");
    }
    mirror.flush().expect("flush");
    let mut buf = vec![0u8; BLOCK as usize];
    mirror.read(5 * BLOCK, &mut buf).expect("read");
    assert_eq!(buf, pattern(5, 3));
    close(mirror, volumes);
}

#[test]
fn a_missing_leg_is_named_and_marked_stale_when_opened_for_writing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 2);
    std::fs::rename(&paths[1], dir.path().join("moved")).expect("move leg 1 away");
    let set = open_mirror(&paths[0], true, &mut |p| open_volume(p, &options())).expect("degraded");
    assert!(set.legs[1].volume.is_none());
    assert!(
        set.warnings
            .iter()
            .any(|w| w.contains("leg1") && w.contains("missing")),
        "{:?}",
        set.warnings
    );
    assert_eq!(set.record.members[1].state, LegState::Stale);
    drop(set);
    std::fs::rename(dir.path().join("moved"), &paths[1]).expect("bring it back");
    let set = open_mirror(&paths[1], false, &mut |p| open_volume(p, &options())).expect("open");
    assert_eq!(set.legs[1].state, LegState::Stale, "the newer record wins");
    assert!(set.legs[1].volume.is_none());
}

#[test]
fn bad_mirror_creation_is_refused_and_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let one = legs(dir.path(), 1);
    assert!(create_mirror(&one, &CreateOptions::new(1 << 20)).is_err());
    let same = vec![dir.path().join("a"), dir.path().join("a")];
    assert!(create_mirror(&same, &CreateOptions::new(1 << 20)).is_err());
    assert!(!dir.path().join("a").exists());
    std::fs::create_dir(dir.path().join("b")).expect("mkdir");
    let exists = vec![dir.path().join("c"), dir.path().join("b")];
    let Err(error) = create_mirror(&exists, &CreateOptions::new(1 << 20)) else {
        panic!("an existing leg directory is refused");
    };
    assert!(error.to_string().contains("already exists"), "{error}");
    assert!(!dir.path().join("c").exists());
}

#[test]
fn an_encrypted_mirror_shares_its_key_and_repairs_with_sealed_ciphertext() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = legs(dir.path(), 2);
    let key = || vouch_engine::UserSecret::key(&[9u8; 32]).expect("32 bytes");
    let mut create = CreateOptions::new(1 << 20);
    create.encrypt = Some(key());
    create_mirror(&paths, &create)
        .expect("create")
        .close()
        .expect("close");
    let keyed = || OpenOptions {
        key: Some(key()),
        ..options()
    };
    let open_keyed = |path: &Path| {
        open_mirror(path, true, &mut |leg| open_volume(leg, &keyed()))
            .expect("open")
            .into_mirror(false)
            .expect("mirror")
    };
    let (mirror, volumes) = open_keyed(&paths[0]);
    write_blocks(&mirror, 4, 7);
    close(mirror, volumes);
    flip(&paths[1].join("data.00000"), 2 * BLOCK + 50);
    let (mirror, volumes) = open_keyed(&paths[1]);
    for result in read_all_legs(&mirror, 2) {
        assert_eq!(result.expect("good data"), pattern(2, 7));
    }
    assert_eq!(mirror.status()[1].corrected, 1);
    close(mirror, volumes);
    let leg = open_volume(&paths[1], &keyed()).expect("leg 1 alone");
    let report = leg.check(|_, _| {}).expect("check");
    assert!(report.faults.is_empty(), "{:?}", report.faults);
    leg.close().expect("close");

    // A lost write on leg 1: its old sealed block (old generation, still
    // authentic) put back with write_sealed, which keeps an encrypted
    // block's generation. Scrub finds it stale and the newer copy wins.
    let (mirror, volumes) = open_keyed(&paths[0]);
    let leg1 = volumes[1].as_ref().expect("leg 1");
    let old = leg1.read_sealed(3, 1).expect("sealed");
    mirror
        .write(3 * BLOCK, &pattern(3, 8), false)
        .expect("write");
    mirror.flush().expect("flush");
    leg1.write_sealed(&old).expect("the old block is authentic");
    leg1.flush().expect("flush");
    let report = mirror::scrub::scrub(
        &mirror,
        &vouch_engine::scrub::ScrubOptions::default(),
        &JobControl::default(),
    )
    .expect("scrub");
    assert_eq!(
        (report.found, report.repaired, report.left),
        (1, 1, 0),
        "{report:?}"
    );
    assert_eq!(report.findings[0].kind, "stale");
    assert_eq!(report.findings[0].leg, 1);
    let mut buf = vec![0u8; BLOCK as usize];
    leg1.read(3 * BLOCK, &mut buf).expect("read leg 1");
    assert_eq!(buf, pattern(3, 8), "leg 1 holds the newer block again");
    close(mirror, volumes);
}

#[test]
fn after_an_unclean_shutdown_reads_stay_on_one_leg_until_a_scrub_makes_the_legs_agree() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 2);
    let (mirror, volumes) = open(&paths[0]);
    write_blocks(&mirror, 8, 4);
    // As a crash between legs can leave them: leg 1 holds the old (valid)
    // contents of LBA 5, leg 0 the new.
    let leg1 = volumes[1].as_ref().expect("leg 1");
    let old = leg1.read_sealed(5, 1).expect("sealed");
    mirror
        .write(5 * BLOCK, &pattern(5, 9), false)
        .expect("write");
    mirror.flush().expect("flush");
    leg1.write_sealed(&old).expect("the old block is valid");
    leg1.flush().expect("flush");
    let read_many = |mirror: &Mirror| -> std::collections::BTreeSet<Vec<u8>> {
        (0..8)
            .map(|_| {
                let mut buf = vec![0u8; BLOCK as usize];
                mirror.read(5 * BLOCK, &mut buf).expect("read");
                buf
            })
            .collect()
    };
    // Round robin: the reader sees both contents (what one-leg mode avoids).
    assert_eq!(read_many(&mirror).len(), 2, "round robin reads both legs");
    mirror.read_one_leg_until_scrubbed();
    let seen = read_many(&mirror);
    assert_eq!(seen.len(), 1, "one leg only");
    assert!(seen.contains(&pattern(5, 9)), "the first leg's contents");
    assert!(mirror.reads_one_leg());
    let report = mirror::scrub::scrub(
        &mirror,
        &vouch_engine::scrub::ScrubOptions::default(),
        &JobControl::default(),
    )
    .expect("scrub");
    assert_eq!(report.left, 0, "{report:?}");
    assert!(!mirror.reads_one_leg(), "the legs agree: round robin again");
    let seen = read_many(&mirror);
    assert_eq!(seen.len(), 1, "{}", seen.len());
    close(mirror, volumes);
}

/// A mirror scrub is a job like a volume's: at a rate it waits between
/// chunks (counted in its `JobControl`), it yields to foreground requests,
/// and without either it never waits.
#[test]
fn a_mirror_scrub_keeps_its_rate_and_yields_to_foreground_requests() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 2);
    let (mirror, volumes) = open(&paths[0]);
    // 512 blocks: two scan chunks.
    write_blocks(&mirror, 512, 1);
    let scrub = |options: vouch_engine::scrub::ScrubOptions| {
        let control = JobControl::default();
        let report = mirror::scrub::scrub(&mirror, &options, &control).expect("scrub");
        assert_eq!(
            (report.blocks_checked, report.found),
            (512, 0),
            "{report:?}"
        );
        assert_eq!(control.progress(), (1024, 1024));
        control.paced_waits()
    };
    assert_eq!(scrub(Default::default()), 0, "unpaced, no foreground");
    // 1 MiB per chunk at 1 MiB/s: a wait after each.
    let paced = scrub(vouch_engine::scrub::ScrubOptions {
        rate_bytes_per_second: Some(1 << 20),
        foreground: None,
    });
    assert_eq!(paced, 2, "a wait after each chunk at 1 MiB/s");
    // A foreground count that moves on every look: a back-off per chunk.
    let requests = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = Arc::clone(&requests);
    let busy = scrub(vouch_engine::scrub::ScrubOptions {
        rate_bytes_per_second: None,
        foreground: Some(Arc::new(move || {
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        })),
    });
    assert_eq!(busy, 2, "a back-off after each chunk");
    close(mirror, volumes);
}

/// A mirror scrub keeps a cursor as a volume's scan does: at its rate it
/// checks one chunk (256 blocks), then waits (one paced wait); cancelled
/// during that wait it saves where it stands, the next scrub resumes there
/// (checking only the rest, its progress starting there) and forgets the
/// cursor when it finishes, so the one after checks everything again.
/// Counted, not timed: at 4 KiB/s the second chunk is due 256 s on.
#[test]
fn a_mirror_scrub_at_its_rate_waits_after_each_chunk_and_resumes_from_its_cursor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = create(dir.path(), 2);
    let (mirror, volumes) = open(&paths[0]);
    // 1024 blocks: four scan chunks.
    write_blocks(&mirror, 1024, 1);
    let cursor = mirror::scrub::cursor_in(&paths[0]);
    let slow = vouch_engine::scrub::ScrubOptions {
        rate_bytes_per_second: Some(4 << 10),
        foreground: None,
    };
    let control = JobControl::default();
    let cancelled = std::thread::scope(|scope| {
        let job =
            scope.spawn(|| mirror::scrub::scrub_from(&mirror, &slow, &control, Some(&cursor)));
        // A hang guard, not a bound on the scrub's speed.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while control.progress().0 == 0 && !job.is_finished() {
            assert!(
                std::time::Instant::now() < deadline,
                "the scrub never stepped"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        control.cancel();
        job.join().expect("scrub thread")
    });
    let error = cancelled.expect_err("cancelled");
    assert!(matches!(error, Error::Cancelled(_)), "{error}");
    let at = cursor.load().expect("load").expect("saved when cancelled");
    assert_eq!(at, 256, "one chunk");
    assert_eq!(control.read_blocks(), 256);
    assert_eq!(control.paced_waits(), 1, "one wait, after the chunk");

    let control = JobControl::default();
    let scrub = |control: &JobControl| {
        mirror::scrub::scrub_from(&mirror, &Default::default(), control, Some(&cursor))
            .expect("scrub")
    };
    let resumed = scrub(&control);
    assert_eq!(resumed.blocks_checked, 1024 - at, "{resumed:?}");
    assert_eq!(control.progress(), (1024, 1024));
    assert_eq!(control.read_blocks(), 1024 - at);
    assert_eq!(
        cursor.load().expect("load"),
        None,
        "forgotten when finished"
    );
    let whole = scrub(&JobControl::default());
    assert_eq!(whole.blocks_checked, 1024, "{whole:?}");
    close(mirror, volumes);
}

/// Issue 28 on a mirror: a packed row that a 1 MiB chunk boundary splits
/// (row 8, LBAs 248-278, across LBA 256) with an older copy restored on
/// leg 1. Leg 1 alone checks each of the row's 31 blocks as lost, once;
/// the mirror scrub finds and repairs the row whole from leg 0. Every
/// row's newest block is its last, so a chunk holding only the start of a
/// row would read the row again whole to judge it: a clean scrub reads
/// each leg, and a scan of the mirror (the control API's verify) reads
/// the legs together, exactly as much as a `check` of one leg alone.
#[test]
fn a_packed_row_across_a_chunk_boundary_is_repaired_whole_and_read_once_per_leg() {
    use std::sync::atomic::Ordering;
    const ROW: u64 = 31;
    const ROWS: u64 = 17;
    // A packed row's records (4 KiB + its 32-byte context each) in 128 KiB.
    const ROW_BYTES: u64 = 128 << 10;
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = legs(dir.path(), 2);
    let mut create = CreateOptions::new(4 << 20);
    create.layout = vouch_engine::LayoutKind::Packed;
    create_mirror(&paths, &create)
        .expect("create")
        .close()
        .expect("close");
    let (mirror, volumes) = open(&paths[0]);
    write_blocks(&mirror, ROWS * ROW, 1);
    close(mirror, volumes);
    let older = std::fs::read(paths[1].join("data.00000")).expect("read data");
    // Each row's last block written again: the row's newest generation.
    let (mirror, volumes) = open(&paths[0]);
    for row in 0..ROWS {
        let lba = row * ROW + ROW - 1;
        mirror
            .write(lba * BLOCK, &pattern(lba, 2), false)
            .expect("write");
    }
    mirror.flush().expect("flush");
    close(mirror, volumes);
    let row = 8;
    let at = (row * ROW_BYTES) as usize;
    std::fs::OpenOptions::new()
        .write(true)
        .open(paths[1].join("data.00000"))
        .expect("open data")
        .write_all_at(&older[at..at + ROW_BYTES as usize], at as u64)
        .expect("restore the older row");

    let lost: Vec<u64> = (row * ROW..(row + 1) * ROW).collect();
    let leg_alone = |path: &Path| {
        let volume = open_volume(path, &options()).expect("open leg");
        let read = || volume.stats().backing_bytes_read.load(Ordering::Relaxed);
        let before = read();
        let report = volume.check(|_, _| {}).expect("check");
        let bytes = read() - before;
        volume.close().expect("close");
        (report, bytes)
    };
    let (report, _) = leg_alone(&paths[1]);
    let found: Vec<u64> = report.faults.iter().map(|fault| fault.lba).collect();
    assert_eq!(found, lost, "leg 1 alone: the row's blocks, each once");
    assert!(report
        .faults
        .iter()
        .all(|fault| fault.kind == FaultKind::MetadataLost));
    let (report, one_leg) = leg_alone(&paths[0]);
    assert!(report.faults.is_empty(), "{:?}", report.faults);

    let scrub = |mirror: &Mirror| {
        mirror::scrub::scrub(
            mirror,
            &vouch_engine::scrub::ScrubOptions::default(),
            &JobControl::default(),
        )
        .expect("scrub")
    };
    let (mirror, volumes) = open(&paths[0]);
    let report = scrub(&mirror);
    assert_eq!(
        (report.found, report.repaired, report.left),
        (ROW, ROW, 0),
        "{report:?}"
    );
    for (finding, &lba) in report.findings.iter().zip(&lost) {
        assert_eq!(
            (finding.lba, finding.leg, finding.kind, finding.repaired),
            (lba, 1, "metadata_lost", true)
        );
    }
    close(mirror, volumes);

    // Freshly opened, so that no row is known current yet and each is
    // judged by the first read of it.
    let read_by = |job: &dyn Fn(&Mirror)| {
        let (mirror, volumes) = open(&paths[0]);
        let read = |volume: &Option<Arc<Volume>>| {
            let stats = volume.as_ref().expect("leg").stats();
            stats.backing_bytes_read.load(Ordering::Relaxed)
        };
        let before: Vec<u64> = volumes.iter().map(read).collect();
        job(&mirror);
        let bytes: Vec<u64> = volumes
            .iter()
            .zip(before)
            .map(|(volume, before)| read(volume) - before)
            .collect();
        close(mirror, volumes);
        bytes
    };
    let scrubbed = read_by(&|mirror| {
        let again = scrub(mirror);
        assert_eq!(again.found, 0, "{again:?}");
    });
    assert_eq!(
        scrubbed,
        vec![one_leg; 2],
        "a scrub reads each leg as a check of one leg does"
    );
    let scanned = read_by(&|mirror| {
        let checked = vouch_engine::check(mirror, |_, _| {}).expect("check the mirror");
        assert!(checked.faults.is_empty(), "{:?}", checked.faults);
    });
    assert_eq!(
        scanned.iter().sum::<u64>(),
        one_leg,
        "a scan of the mirror reads each row once"
    );
    for path in &paths {
        let (report, _) = leg_alone(path);
        assert!(
            report.faults.is_empty(),
            "{}: {:?}",
            path.display(),
            report.faults
        );
    }
    let (mirror, volumes) = open(&paths[0]);
    for lba in 0..ROWS * ROW {
        let tag = if lba % ROW == ROW - 1 { 2 } else { 1 };
        for read in read_all_legs(&mirror, lba) {
            assert_eq!(read.expect("read"), pattern(lba, tag), "LBA {lba}");
        }
    }
    close(mirror, volumes);
}
