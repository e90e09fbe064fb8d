//! The `BlockDevice` calls the next layers build on: sealed blocks moved
//! between two copies of one volume (PI travels with the data and is
//! checked on arrival), and the default verify / copy / compare offloads.

use std::sync::Arc;
use vouch_engine::{DeviceWrites, SealedWrites};

use vouch_engine::{
    create_volume, open_volume, BlockDevice, CreateOptions, Error, FaultKind, LayoutKind, ObjectId,
    OpenOptions, SealedAdmission, SealedDevice, SimStorage, Submitted, Volume, ZeroFlags, BLOCK,
};

fn pattern(lba: u64, tag: u8) -> Vec<u8> {
    (0..BLOCK as usize)
        .map(|i| (i as u8).wrapping_mul(31) ^ (lba as u8) ^ tag)
        .collect()
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

fn read_block(device: &dyn BlockDevice, lba: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK as usize];
    device.read(lba * BLOCK, &mut buf).expect("read");
    buf
}

#[test]
fn sealed_blocks_move_between_copies_of_a_volume_and_are_checked_on_arrival() {
    for layout in LayoutKind::ALL {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a_path, b_path) = (dir.path().join("a"), dir.path().join("b"));
        let mut options = CreateOptions::new(1 << 20);
        options.layout = layout;
        let a = create_volume(&a_path, &options).expect("create");
        for lba in 0..8 {
            a.write(lba * BLOCK, &pattern(lba, 1), false)
                .expect("write");
        }
        a.close().expect("close");
        // A replica: the same volume (uuid, volume tag), copied while closed.
        copy_dir(&a_path, &b_path);
        let a = open_volume(&a_path, &OpenOptions::default()).expect("open a");
        let b = open_volume(&b_path, &OpenOptions::default()).expect("open b");
        for lba in 0..6 {
            a.write(lba * BLOCK, &pattern(lba, 2), false)
                .expect("write");
        }
        a.trim(6 * BLOCK, BLOCK, false).expect("trim");
        let zero = ZeroFlags {
            fua: false,
            allocate: true,
        };
        a.write_zeroes(7 * BLOCK, BLOCK, zero).expect("zeroes");
        a.flush().expect("flush");
        // Half from the home copy, and two still in the write-back buffer.
        a.write(2 * BLOCK, &pattern(2, 3), false).expect("write");
        a.write(3 * BLOCK, &pattern(3, 3), false).expect("write");

        let sealed = a.read_sealed(0, 8).expect("read_sealed");
        assert_eq!(sealed.len(), 8);
        assert!(sealed.iter().enumerate().all(|(i, s)| s.lba == i as u64));

        // Tampered on the way: refused naming the block, nothing stored.
        let mut bad = sealed.clone();
        let mut flipped = bad[4].data.to_vec();
        flipped[17] ^= 0x40;
        bad[4].data = vouch_engine::BlockData::copy_from(&flipped);
        let error = b.write_sealed(&bad).expect_err("a flipped bit is refused");
        assert!(
            matches!(&error, Error::Fault(f) if f.lba == 4 && f.kind == FaultKind::GuardMismatch),
            "{layout:?}: {error}"
        );
        // Delivered to the wrong LBA: the reference tag refuses it.
        let mut moved = vec![sealed[1].clone()];
        moved[0].lba = 5;
        let error = b
            .write_sealed(&moved)
            .expect_err("a misdirected block is refused");
        assert!(
            matches!(&error, Error::Fault(f) if f.lba == 5 && f.kind == FaultKind::RefTagMismatch),
            "{layout:?}: {error}"
        );
        // Blocks sealed here for a local leg (`write_sealed_here`): the
        // guard is not recomputed, but the place still is checked.
        let error = b
            .write_sealed_here(&moved)
            .expect_err("a misplaced block is refused here too");
        assert!(
            matches!(&error, Error::Fault(f) if f.lba == 5 && f.kind == FaultKind::RefTagMismatch),
            "{layout:?}: {error}"
        );
        let mut beyond = vec![sealed[1].clone()];
        beyond[0].lba = 1 << 40;
        assert!(matches!(
            b.write_sealed_here(&beyond),
            Err(Error::OutOfRange { .. })
        ));
        for lba in 0..8 {
            assert_eq!(read_block(&b, lba), pattern(lba, 1), "{layout:?} LBA {lba}");
        }

        b.write_sealed(&sealed).expect("write_sealed");
        b.flush().expect("flush");
        for lba in 0..8 {
            assert_eq!(
                read_block(&b, lba),
                read_block(&a, lba),
                "{layout:?} LBA {lba}"
            );
        }
        b.close().expect("close b");
        let b = open_volume(&b_path, &OpenOptions::default()).expect("reopen b");
        assert!(b.check(|_, _| {}).expect("check").faults.is_empty());
        assert_eq!(read_block(&b, 2), pattern(2, 3));
        assert_eq!(read_block(&b, 6), vec![0u8; BLOCK as usize]);
    }
}

/// The one sealed submission on a volume, by admission: `Callback` is
/// declined (a volume's writes do not travel), `MustNotWait` declines
/// FUA (it would wait for the flush), a FUA write into reserved room is
/// refused and gives the room back, and each admission that stores
/// stores exactly its blocks. Nothing declined or refused is stored.
#[test]
fn a_sealed_submission_answers_by_its_admission() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a_path, b_path) = (dir.path().join("a"), dir.path().join("b"));
    let a = create_volume(&a_path, &CreateOptions::new(4 << 20)).expect("create");
    for lba in 0..8 {
        a.write(lba * BLOCK, &pattern(lba, 1), false)
            .expect("write");
    }
    a.close().expect("close");
    copy_dir(&a_path, &b_path);
    let a = open_volume(&a_path, &OpenOptions::default()).expect("open a");
    let b = open_volume(&b_path, &OpenOptions::default()).expect("open b");
    for lba in 0..8 {
        a.write(lba * BLOCK, &pattern(lba, 2), false)
            .expect("write");
    }
    let sealed = a.read_sealed(0, 8).expect("read_sealed");
    let one = |lba: usize| &sealed[lba..lba + 1];

    assert!(matches!(
        b.submit_sealed(one(0), false, SealedAdmission::Callback),
        Ok(Submitted::Declined)
    ));
    assert!(matches!(
        b.submit_sealed(one(1), true, SealedAdmission::MustNotWait),
        Ok(Submitted::Declined)
    ));
    // All the room there is (below twice the dirty limit), before and
    // after a FUA write into reserved room is refused.
    let all_room = 2 * 4096 - 1;
    assert!(b.reserve_room(all_room), "the whole buffer is free");
    b.release_room(all_room);
    assert!(b.reserve_room(1));
    let refused = b.submit_sealed(one(2), true, SealedAdmission::Reserved);
    assert!(
        matches!(refused, Err(Error::InvalidArgument(_))),
        "{refused:?}"
    );
    assert!(b.reserve_room(all_room), "the refused write's room is back");
    b.release_room(all_room);
    for lba in 0..3 {
        assert_eq!(read_block(&b, lba), pattern(lba, 1), "LBA {lba} not stored");
    }

    assert!(b.reserve_room(1));
    assert!(b
        .submit_sealed(one(3), false, SealedAdmission::Reserved)
        .expect("reserved")
        .is_done());
    assert!(b
        .submit_sealed(one(4), false, SealedAdmission::MustNotWait)
        .expect("inline")
        .is_done());
    assert!(b
        .submit_sealed(one(5), true, SealedAdmission::MayWait)
        .expect("may wait")
        .is_done());
    assert!(b
        .submit_sealed(one(6), false, SealedAdmission::Here)
        .expect("here")
        .is_done());
    for lba in 3..7 {
        assert_eq!(read_block(&b, lba), pattern(lba, 2), "LBA {lba} stored");
    }
    assert_eq!(read_block(&b, 7), pattern(7, 1));
}

#[test]
fn sealed_blocks_apply_in_order_and_runs_of_holes_in_one_commit() {
    let (_storage, volume) = sim_volume(LayoutKind::Split);
    for lba in 0..6 {
        volume
            .write(lba * BLOCK, &pattern(lba, 5), false)
            .expect("write");
    }
    let data = volume.read_sealed(0, 6).expect("read_sealed");
    volume.trim(0, 6 * BLOCK, false).expect("trim");
    let holes = volume.read_sealed(0, 6).expect("read_sealed");
    // LBA 0: data, then its hole (the hole wins); LBA 1: hole, then data
    // (the data wins); LBAs 2..6: data, then one run of four holes.
    let batch = vec![
        data[0].clone(),
        holes[0].clone(),
        holes[1].clone(),
        data[1].clone(),
        data[2].clone(),
        data[3].clone(),
        holes[2].clone(),
        holes[3].clone(),
        holes[4].clone(),
        holes[5].clone(),
    ];
    let commits = volume.stats().snapshot().commits;
    volume.write_sealed(&batch).expect("write_sealed");
    let zero = vec![0u8; BLOCK as usize];
    assert_eq!(read_block(&volume, 0), zero);
    assert_eq!(read_block(&volume, 1), pattern(1, 5));
    for lba in 2..6 {
        assert_eq!(read_block(&volume, lba), zero, "LBA {lba}");
    }
    assert_eq!(
        volume.stats().snapshot().commits - commits,
        2,
        "one commit per run of holes"
    );
}

fn sim_volume(layout: LayoutKind) -> (Arc<SimStorage>, Volume) {
    let storage = Arc::new(SimStorage::new());
    let mut options = CreateOptions::new(256 * BLOCK);
    options.layout = layout;
    let volume = Volume::create(storage.clone(), &options).expect("create");
    (storage, volume)
}

#[test]
fn default_copy_has_memmove_semantics_and_compare_finds_the_first_difference() {
    for layout in LayoutKind::ALL {
        let (_storage, volume) = sim_volume(layout);
        for lba in 0..8 {
            volume
                .write(lba * BLOCK, &pattern(lba, 9), false)
                .expect("write");
        }
        // Overlapping forwards: 0..6 -> 2..8.
        volume.copy(0, 2, 6).expect("copy");
        for lba in 2..8 {
            assert_eq!(read_block(&volume, lba), pattern(lba - 2, 9), "{layout:?}");
        }
        // Overlapping backwards: 2..8 -> 1..7.
        volume.copy(2, 1, 6).expect("copy");
        for lba in 1..7 {
            assert_eq!(read_block(&volume, lba), pattern(lba - 1, 9), "{layout:?}");
        }
        assert!(matches!(
            volume.copy(250, 0, 10),
            Err(Error::OutOfRange { .. })
        ));
        let expected: Vec<u8> = (1..7).flat_map(|lba| pattern(lba - 1, 9)).collect();
        assert_eq!(volume.compare(BLOCK, &expected).expect("compare"), None);
        let mut different = expected.clone();
        different[3 * BLOCK as usize + 5] ^= 1;
        assert_eq!(
            volume.compare(BLOCK, &different).expect("compare"),
            Some(3 * BLOCK + 5)
        );
    }
}

#[test]
fn default_verify_names_the_corrupt_block_and_a_copy_refuses_to_propagate_it() {
    let (storage, volume) = sim_volume(LayoutKind::Split);
    for lba in 0..16 {
        volume
            .write(lba * BLOCK, &pattern(lba, 4), false)
            .expect("write");
    }
    volume.flush().expect("flush");
    storage.corrupt(ObjectId::Data(0), 9 * BLOCK + 100, 0x01);
    let faults = volume.verify(0, 16).expect("verify");
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(
        (faults[0].lba, faults[0].kind),
        (9, FaultKind::GuardMismatch)
    );
    let error = volume
        .copy(8, 100, 4)
        .expect_err("a corrupt source fails the copy");
    assert!(
        matches!(&error, Error::Fault(f) if f.lba == 9),
        "the copy names the corrupt source block: {error}"
    );
}
