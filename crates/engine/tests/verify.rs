//! The verify offload on real volume directories: it finds exactly the
//! blocks damaged on disk with their kinds, its proof-of-work digest
//! follows the data and the seed and can be recomputed by a client from
//! bytes it reads, and compare of two ranges follows NVMe Compare.

#![allow(clippy::single_range_in_vec_init)] // ranges of LBAs to write

mod common;

use std::os::unix::fs::FileExt;
use vouch_engine::DeviceWrites;

use common::*;
use vouch_engine::jobs::JobControl;
use vouch_engine::verify::{compare_ranges, verify, ProofSeed, VerifyOptions};
use vouch_engine::{BlockDevice, Error, Fault, FaultKind, LayoutKind, BLOCK};

const SEED_A: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
const SEED_B: &str = "ff0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

fn seeded(seed: &str, segments: bool) -> VerifyOptions {
    VerifyOptions {
        seed: Some(ProofSeed::from_hex(seed).expect("seed")),
        segments,
        rate_bytes_per_second: None,
    }
}

/// Give block `to` block `from`'s context (same data in both): a
/// misdirected write, which only the reference tag catches.
fn misdirect(path: &std::path::Path, layout: LayoutKind, from: u64, to: u64) {
    let (file, at_from, at_to) = match layout {
        LayoutKind::Split => (path.join("contexts"), from * 32, to * 32),
        LayoutKind::Packed => (
            path.join("data.00000"),
            data_offset(path, from) + BLOCK,
            data_offset(path, to) + BLOCK,
        ),
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .expect("open");
    let mut context = [0u8; 32];
    file.read_exact_at(&mut context, at_from).expect("read");
    file.write_all_at(&context, at_to).expect("write");
    file.sync_all().expect("sync");
}

#[test]
fn verify_finds_exactly_the_blocks_damaged_on_disk_with_their_kinds() {
    for layout in LayoutKind::ALL {
        // Data in chunks 0, 1 (partly), 3 and 5; the rest are holes.
        let (_dir, path) = volume_dir(layout, &[0..300, 768..1024, 1290..1300]);
        {
            let volume = open(&path);
            volume
                .write(520 * BLOCK, &pattern(7, 7), false)
                .expect("write");
            volume
                .write(521 * BLOCK, &pattern(7, 7), false)
                .expect("write");
            volume.close().expect("close");
        }
        corrupt_data(&path, 10);
        corrupt_context(&path, layout, 299);
        corrupt_data(&path, 1000);
        misdirect(&path, layout, 520, 521);
        let volume = open(&path);
        let control = JobControl::default();
        let report =
            verify(&volume, 0, BLOCKS, &VerifyOptions::default(), &control).expect("verify");
        let found: Vec<(u64, FaultKind)> = report.faults.iter().map(|f| (f.lba, f.kind)).collect();
        assert_eq!(
            found,
            vec![
                (10, FaultKind::GuardMismatch),
                (299, FaultKind::ContextCorrupt),
                (521, FaultKind::RefTagMismatch),
                (1000, FaultKind::GuardMismatch),
            ],
            "{layout:?}"
        );
        // Chunks 0, 1, 2, 3 and 5 are read; 6 and 7 are holes, and so is 4
        // in the split layout. Packed chunks end on its 31-block rows (the
        // multiples of 256 moved down to a row's start): the first six,
        // to LBA 1519 (49 rows), all hold data.
        let expected = match layout {
            LayoutKind::Split => 5 * 256,
            LayoutKind::Packed => 49 * 31,
        };
        assert_eq!(report.blocks_read, expected, "{layout:?}");
        assert_eq!(control.progress(), (BLOCKS, BLOCKS));
        assert_eq!(report.digest, None);
        // A range inside: only its faults.
        let report =
            verify(&volume, 200, 400, &VerifyOptions::default(), &control).expect("verify");
        assert_eq!(
            report.faults,
            vec![
                Fault {
                    lba: 299,
                    kind: FaultKind::ContextCorrupt
                },
                Fault {
                    lba: 521,
                    kind: FaultKind::RefTagMismatch
                },
            ]
        );
        // The volume's own `BlockDevice::verify` (the x-vouch:integrity
        // context's): a long range on the scan's threads, a short one on
        // this thread, the same faults either way.
        let whole = BlockDevice::verify(&volume, 0, BLOCKS).expect("verify");
        assert_eq!(whole, report_faults_whole(&volume), "{layout:?}");
        assert_eq!(
            BlockDevice::verify(&volume, 200, 400).expect("verify"),
            report.faults,
            "{layout:?}"
        );
        // Reads still refuse the damaged blocks; verify changed nothing.
        let mut block = vec![0u8; BLOCK as usize];
        assert!(matches!(
            volume.read(10 * BLOCK, &mut block),
            Err(Error::Fault(_))
        ));
    }
}

/// The faults of a whole-volume verify offload.
fn report_faults_whole(volume: &vouch_engine::Volume) -> Vec<Fault> {
    let report = verify(
        volume,
        0,
        BLOCKS,
        &VerifyOptions::default(),
        &JobControl::default(),
    )
    .expect("verify");
    assert_eq!(report.faults.len(), 4);
    report.faults
}

#[test]
fn verify_refuses_a_range_past_the_end_and_stops_when_cancelled() {
    let (_dir, path) = volume_dir(LayoutKind::Split, &[0..1024]);
    let volume = open(&path);
    let control = JobControl::default();
    for (first, count) in [(0, BLOCKS + 1), (BLOCKS, 1), (u64::MAX, 2)] {
        let error = verify(&volume, first, count, &VerifyOptions::default(), &control)
            .expect_err("past the end");
        assert!(matches!(error, Error::OutOfRange { .. }), "{error}");
    }
    control.cancel();
    let error =
        verify(&volume, 0, BLOCKS, &VerifyOptions::default(), &control).expect_err("cancelled");
    assert!(
        matches!(&error, Error::Cancelled(message) if message.contains("before LBA 0 ")),
        "{error}"
    );
}

/// Segment digest, recomputed from the algorithm in `verify`'s
/// documentation with nothing of vouch's but the bytes it serves.
fn independent_segment_digest(seed: &str, lba: u64, bytes: &[u8]) -> [u8; 16] {
    let seed = ProofSeed::from_hex(seed).expect("seed").0;
    let mut secret = [0u8; 192];
    blake3::Hasher::new_keyed(&seed)
        .finalize_xof()
        .fill(&mut secret);
    let mut input = lba.to_le_bytes().to_vec();
    input.extend_from_slice(bytes);
    xxhash_rust::xxh3::xxh3_128_with_secret(&input, &secret).to_be_bytes()
}

#[test]
fn the_proof_digest_can_be_recomputed_from_bytes_a_client_reads() {
    for layout in LayoutKind::ALL {
        let (_dir, path) = volume_dir(layout, &[0..300, 768..1024, 1290..1300]);
        let volume = open(&path);
        // An unaligned range: segments clipped at both ends, hole chunks
        // (2 and 4) in the middle, partial holes in chunks 1 and 5.
        let (first, count) = (100, 1300);
        let report = verify(
            &volume,
            first,
            count,
            &seeded(SEED_A, true),
            &JobControl::default(),
        )
        .expect("verify");
        let bounds: Vec<(u64, u64)> = report.segments.iter().map(|s| (s.lba, s.count)).collect();
        assert_eq!(
            bounds,
            vec![
                (100, 156),
                (256, 256),
                (512, 256),
                (768, 256),
                (1024, 256),
                (1280, 120)
            ]
        );
        let mut concatenated = Vec::new();
        for segment in &report.segments {
            let bytes = read_range(&volume, segment.lba, segment.count);
            assert_eq!(
                segment.digest,
                independent_segment_digest(SEED_A, segment.lba, &bytes),
                "{layout:?} segment at {}",
                segment.lba
            );
            concatenated.extend_from_slice(&segment.digest);
        }
        let seed = ProofSeed::from_hex(SEED_A).expect("seed").0;
        let mut secret = [0u8; 192];
        blake3::Hasher::new_keyed(&seed)
            .finalize_xof()
            .fill(&mut secret);
        assert_eq!(
            report.digest,
            Some(xxhash_rust::xxh3::xxh3_128_with_secret(&concatenated, &secret).to_be_bytes())
        );
        // Without `segments` only the digest, the same one.
        let plain = verify(
            &volume,
            first,
            count,
            &seeded(SEED_A, false),
            &JobControl::default(),
        )
        .expect("verify");
        assert!(plain.segments.is_empty());
        assert_eq!(plain.digest, report.digest);
    }
}

#[test]
fn the_proof_digest_changes_with_the_data_the_seed_and_damage() {
    let (_dir, path) = volume_dir(LayoutKind::Split, &[0..600]);
    let digest = |seed: &str| {
        let volume = open(&path);
        let report = verify(
            &volume,
            0,
            BLOCKS,
            &seeded(seed, true),
            &JobControl::default(),
        )
        .expect("verify");
        (
            report.digest.expect("digest"),
            report.segments,
            report.faults,
        )
    };
    let (first, segments, faults) = digest(SEED_A);
    assert!(faults.is_empty());
    assert_eq!(segments.len(), 8, "every chunk is a segment, holes too");
    assert_eq!(digest(SEED_A).0, first, "the same data, the same digest");
    assert_ne!(digest(SEED_B).0, first, "another seed, another digest");
    {
        let volume = open(&path);
        let mut block = pattern(300, 1);
        block[4000] ^= 1;
        volume.write(300 * BLOCK, &block, false).expect("write");
        volume.close().expect("close");
    }
    let (changed, changed_segments, _) = digest(SEED_A);
    assert_ne!(changed, first, "one byte written, another digest");
    let differing: Vec<u64> = segments
        .iter()
        .zip(&changed_segments)
        .filter(|(a, b)| a.digest != b.digest)
        .map(|(a, _)| a.lba)
        .collect();
    assert_eq!(differing, vec![256], "only the segment holding it changes");
    corrupt_data(&path, 5);
    let (damaged, _, faults) = digest(SEED_A);
    assert_eq!(
        faults,
        vec![Fault {
            lba: 5,
            kind: FaultKind::GuardMismatch
        }]
    );
    assert_ne!(damaged, changed, "a faulty block counts as zeros");
}

#[test]
fn compare_ranges_finds_equality_the_first_difference_and_damage() {
    for layout in LayoutKind::ALL {
        let (_dir, path) = volume_dir(layout, &[0..300]);
        let (_other_dir, other_path) = volume_dir(layout, &[]);
        {
            // The same bytes at 1000.. on the volume and at 10.. on another.
            let volume = open(&path);
            let other = open(&other_path);
            let data = read_range(&volume, 0, 300);
            volume.write(1000 * BLOCK, &data, false).expect("write");
            other.write(10 * BLOCK, &data, false).expect("write");
            volume.close().expect("close");
            other.close().expect("close");
        }
        let volume = open(&path);
        let other = open(&other_path);
        let control = JobControl::default();
        assert_eq!(
            compare_ranges(&volume, 0, &volume, 1000, 300, &control).expect("compare"),
            None
        );
        assert_eq!(control.progress(), (300, 300));
        assert_eq!(
            compare_ranges(&volume, 0, &other, 10, 300, &control).expect("compare"),
            None
        );
        assert_eq!(
            compare_ranges(&volume, 400, &other, 1500, 500, &control).expect("compare"),
            None,
            "holes equal holes"
        );
        assert_eq!(
            compare_ranges(&volume, 0, &volume, 0, 300, &control).expect("compare"),
            None
        );
        // Overlapping ranges on one device: blocks differ at once.
        assert_eq!(
            compare_ranges(&volume, 0, &volume, 1, 100, &control).expect("compare"),
            Some(0)
        );
        let mut block = pattern(290, 1);
        block[1234] ^= 0x80;
        volume.write(1290 * BLOCK, &block, false).expect("write");
        assert_eq!(
            compare_ranges(&volume, 0, &volume, 1000, 300, &control).expect("compare"),
            Some(290 * BLOCK + 1234)
        );
        assert_eq!(
            compare_ranges(&volume, 1000, &other, 10, 300, &control).expect("compare"),
            Some(290 * BLOCK + 1234)
        );
        let error = compare_ranges(&volume, 0, &other, BLOCKS - 10, 11, &control)
            .expect_err("past the end");
        assert!(matches!(error, Error::OutOfRange { .. }), "{error}");
        volume.close().expect("close");
        drop(other);
        // A damaged block on either side fails the compare naming it, even
        // after the first difference.
        corrupt_data(&other_path, 299);
        let volume = open(&path);
        let other = open(&other_path);
        let error = compare_ranges(&volume, 1000, &other, 10, 300, &control)
            .expect_err("a damaged side fails");
        assert!(matches!(&error, Error::Fault(f) if f.lba == 299), "{error}");
        assert!(error.to_string().contains("LBA 299"), "{error}");
        let error = compare_ranges(&other, 10, &volume, 0, 300, &control)
            .expect_err("a damaged side fails");
        assert!(matches!(&error, Error::Fault(f) if f.lba == 299), "{error}");
        control.cancel();
        let error =
            compare_ranges(&volume, 0, &volume, 1000, 300, &control).expect_err("cancelled");
        assert!(
            matches!(&error, Error::Cancelled(message) if message.contains("before LBA 0 ")),
            "{error}"
        );
    }
}

#[test]
fn a_seed_of_the_wrong_length_is_refused_naming_the_length() {
    for bad in [
        "",
        "abcd",
        &SEED_A[..62],
        &format!("{SEED_A}0"),
        &SEED_A.replace('a', "g"),
    ] {
        let error = ProofSeed::from_hex(bad).expect_err("a bad seed");
        assert!(matches!(error, Error::InvalidArgument(_)), "{error}");
        assert!(error.to_string().contains("64 hex digits"), "{error}");
    }
    assert_eq!(ProofSeed::from_hex(SEED_A).expect("seed").to_hex(), SEED_A);
}
