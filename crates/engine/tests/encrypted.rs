//! Encrypted volumes in real directories: data round-trips through both
//! layouts and reopens, no plaintext reaches the files, wrong and missing
//! keys are refused before anything is read or written, damage on disk is
//! found with and without the key, a key change rewraps, copies
//! re-encrypt and reflink refuses.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use vouch_engine::{DeviceWrites, SealedWrites};

use common::pattern;
use vouch_engine::copy::{copy, CopyMethod, CopyOptions};
use vouch_engine::jobs::JobControl;
use vouch_engine::{
    create_volume, open_volume, BlockDevice, CreateOptions, Error, FaultKind, LayoutKind,
    OpenOptions, SealedDevice, UserSecret, Volume, BLOCK,
};

const BLOCKS: u64 = 512;

fn key(byte: u8) -> UserSecret {
    UserSecret::key(&[byte; 32]).expect("32 bytes")
}

fn with_key(secret: UserSecret) -> OpenOptions {
    OpenOptions {
        key: Some(secret),
        ..OpenOptions::default()
    }
}

fn keyless() -> OpenOptions {
    OpenOptions {
        keyless: true,
        read_only: true,
        ..OpenOptions::default()
    }
}

/// A closed encrypted volume (key `key(1)`) with `pattern(lba, 1)` at
/// LBAs 0..64.
fn encrypted_dir(layout: LayoutKind) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("volume");
    let mut options = CreateOptions::new(BLOCKS * BLOCK);
    options.layout = layout;
    options.encrypt = Some(key(1));
    let volume = create_volume(&path, &options).expect("create");
    assert!(volume.encrypted());
    let data: Vec<u8> = (0..64).flat_map(|lba| pattern(lba, 1)).collect();
    volume.write(0, &data, false).expect("write");
    // Read back from the write-back buffer (ciphertext in memory).
    assert_eq!(read(&volume, 0, 64), data);
    volume.close().expect("close");
    (dir, path)
}

fn read(volume: &Volume, first: u64, count: u64) -> Vec<u8> {
    let mut data = vec![0u8; (count * BLOCK) as usize];
    volume.read(first * BLOCK, &mut data).expect("read");
    data
}

fn data_offset(path: &Path, lba: u64) -> u64 {
    let volume = open_volume(path, &keyless()).expect("keyless open");
    volume.geometry().locate(lba).data_offset
}

fn files_bytes(path: &Path) -> Vec<u8> {
    let mut all = Vec::new();
    for entry in std::fs::read_dir(path).expect("read dir") {
        all.extend(std::fs::read(entry.expect("entry").path()).expect("read file"));
    }
    all
}

fn xor(file: &Path, offset: u64, mask: u8) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .expect("open");
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, offset).expect("read");
    byte[0] ^= mask;
    file.write_all_at(&byte, offset).expect("write");
}

/// Byte offset of `lba`'s context: in `contexts` (split) or after its data
/// in `data.00000` (packed).
fn context_at(path: &Path, layout: LayoutKind, lba: u64) -> (PathBuf, u64) {
    match layout {
        LayoutKind::Split => (path.join("contexts"), lba * 32),
        LayoutKind::Packed => (path.join("data.00000"), data_offset(path, lba) + BLOCK),
    }
}

fn fault_of(path: &Path, lba: u64) -> FaultKind {
    let volume = open_volume(path, &with_key(key(1))).expect("open");
    let mut block = vec![0u8; BLOCK as usize];
    match volume.read(lba * BLOCK, &mut block) {
        Err(Error::Fault(fault)) => {
            assert_eq!(fault.lba, lba);
            fault.kind
        }
        other => panic!("LBA {lba} read as {other:?}"),
    }
}

#[test]
fn data_round_trips_and_no_plaintext_reaches_the_files() {
    for layout in [LayoutKind::Split, LayoutKind::Packed] {
        let (_dir, path) = encrypted_dir(layout);
        let volume = open_volume(&path, &with_key(key(1))).expect("open");
        let expected: Vec<u8> = (0..64).flat_map(|lba| pattern(lba, 1)).collect();
        assert_eq!(read(&volume, 0, 64), expected, "{layout:?}");
        assert!(volume.check(|_, _| {}).expect("check").faults.is_empty());
        volume.close().expect("close");
        let files = files_bytes(&path);
        for lba in [0u64, 17, 63] {
            let needle = &pattern(lba, 1)[..64];
            assert!(
                !files.windows(64).any(|window| window == needle),
                "{layout:?}: plaintext of LBA {lba} found on disk"
            );
        }
    }
}

#[test]
fn wrong_and_missing_keys_are_refused_and_nothing_changes() {
    let (_dir, path) = encrypted_dir(LayoutKind::Split);
    let before = files_bytes(&path);
    let wrong = open_volume(&path, &with_key(key(2)))
        .err()
        .expect("refused");
    assert!(wrong.to_string().contains("wrong key"), "{wrong}");
    let missing = open_volume(&path, &OpenOptions::default())
        .err()
        .expect("refused");
    assert!(missing.to_string().contains("--key-file"), "{missing}");
    assert_eq!(
        files_bytes(&path),
        before,
        "a refused open changed the volume"
    );
}

#[test]
fn keyless_verification_checks_without_decrypting() {
    let (_dir, path) = encrypted_dir(LayoutKind::Split);
    let volume = open_volume(&path, &keyless()).expect("keyless open");
    assert!(volume.is_read_only());
    assert!(volume.write(0, &[0u8; 4096], false).is_err());
    assert!(volume.check(|_, _| {}).expect("check").faults.is_empty());
    drop(volume);
    xor(&path.join("data.00000"), data_offset(&path, 5) + 9, 0x02);
    let volume = open_volume(&path, &keyless()).expect("keyless open");
    let faults = volume.check(|_, _| {}).expect("check").faults;
    assert_eq!(faults.len(), 1);
    assert_eq!(
        (faults[0].lba, faults[0].kind),
        (5, FaultKind::GuardMismatch)
    );
}

#[test]
fn damage_is_found_naming_the_lba() {
    for layout in [LayoutKind::Split, LayoutKind::Packed] {
        let (_dir, path) = encrypted_dir(layout);
        // Ciphertext bit.
        xor(&path.join("data.00000"), data_offset(&path, 3) + 4000, 0x01);
        assert_eq!(fault_of(&path, 3), FaultKind::GuardMismatch, "{layout:?}");
        // Tag bit (context bytes 12..28) and nonce bit (1..12).
        let (file, at) = context_at(&path, layout, 4);
        xor(&file, at + 20, 0x80);
        assert_eq!(fault_of(&path, 4), FaultKind::GuardMismatch, "{layout:?}");
        let (file, at) = context_at(&path, layout, 6);
        xor(&file, at + 5, 0x04);
        assert_eq!(fault_of(&path, 6), FaultKind::GuardMismatch, "{layout:?}");
        // Two blocks swapped with their contexts: each authenticates only
        // at its own LBA.
        swap_blocks(&path, layout, 10, 11);
        assert_eq!(fault_of(&path, 10), FaultKind::AuthFailed, "{layout:?}");
        assert_eq!(fault_of(&path, 11), FaultKind::AuthFailed, "{layout:?}");
        let volume = open_volume(&path, &with_key(key(1))).expect("open");
        let faults: Vec<(u64, FaultKind)> = volume
            .check(|_, _| {})
            .expect("check")
            .faults
            .iter()
            .map(|fault| (fault.lba, fault.kind))
            .collect();
        assert_eq!(
            faults,
            vec![
                (3, FaultKind::GuardMismatch),
                (4, FaultKind::GuardMismatch),
                (6, FaultKind::GuardMismatch),
                (10, FaultKind::AuthFailed),
                (11, FaultKind::AuthFailed),
            ],
            "{layout:?}"
        );
        // The other blocks still read.
        assert_eq!(read(&volume, 20, 1), pattern(20, 1));
    }
}

/// Swap blocks `a` and `b` on disk, data and context together.
fn swap_blocks(path: &Path, layout: LayoutKind, a: u64, b: u64) {
    let data = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path.join("data.00000"))
        .expect("open data");
    let record = match layout {
        LayoutKind::Split => BLOCK as usize,
        LayoutKind::Packed => BLOCK as usize + 32,
    };
    let (at_a, at_b) = (data_offset(path, a), data_offset(path, b));
    let mut block_a = vec![0u8; record];
    let mut block_b = vec![0u8; record];
    data.read_exact_at(&mut block_a, at_a).expect("read");
    data.read_exact_at(&mut block_b, at_b).expect("read");
    data.write_all_at(&block_b, at_a).expect("write");
    data.write_all_at(&block_a, at_b).expect("write");
    if layout == LayoutKind::Split {
        let contexts = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path.join("contexts"))
            .expect("open contexts");
        let mut context_a = [0u8; 32];
        let mut context_b = [0u8; 32];
        contexts
            .read_exact_at(&mut context_a, a * 32)
            .expect("read");
        contexts
            .read_exact_at(&mut context_b, b * 32)
            .expect("read");
        contexts.write_all_at(&context_b, a * 32).expect("write");
        contexts.write_all_at(&context_a, b * 32).expect("write");
    }
}

#[test]
fn a_key_change_rewraps_and_only_the_new_key_opens() {
    let (_dir, path) = encrypted_dir(LayoutKind::Packed);
    let volume = open_volume(&path, &with_key(key(1))).expect("open");
    volume.change_key(&key(7)).expect("change key");
    // Writes after the change, and the volume's clean close, keep the new wrap.
    volume
        .write(100 * BLOCK, &pattern(100, 2), false)
        .expect("write");
    volume.close().expect("close");
    let old = open_volume(&path, &with_key(key(1)))
        .err()
        .expect("refused");
    assert!(matches!(old, Error::Key(_)), "{old}");
    let volume = open_volume(&path, &with_key(key(7))).expect("new key opens");
    assert_eq!(read(&volume, 63, 1), pattern(63, 1));
    assert_eq!(read(&volume, 100, 1), pattern(100, 2));
    // Both superblock copies hold the new wrap: the old key is gone from disk.
    drop(volume);
    let superblock = std::fs::read(path.join("superblock")).expect("read");
    assert_eq!(superblock[164..212], superblock[4096 + 164..4096 + 212]);
    // A plain volume has no key to change.
    let dir = tempfile::tempdir().expect("tempdir");
    let plain =
        create_volume(&dir.path().join("p"), &CreateOptions::new(BLOCKS * BLOCK)).expect("create");
    assert!(matches!(plain.change_key(&key(3)), Err(Error::Key(_))));
}

#[test]
fn a_passphrase_volume_opens_with_its_passphrase() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("volume");
    let mut options = CreateOptions::new(BLOCKS * BLOCK);
    options.encrypt = Some(UserSecret::passphrase(b"open sesame").expect("passphrase"));
    let volume = create_volume(&path, &options).expect("create");
    assert_eq!(
        volume.info().expect("info").key_kind,
        Some("passphrase (Argon2id)")
    );
    volume.write(0, &pattern(0, 3), true).expect("write");
    volume.close().expect("close");
    let secret = UserSecret::passphrase(b"open sesame").expect("passphrase");
    let volume = open_volume(&path, &with_key(secret)).expect("open");
    assert_eq!(read(&volume, 0, 1), pattern(0, 3));
    drop(volume);
    let wrong = UserSecret::passphrase(b"open sesame!").expect("passphrase");
    assert!(open_volume(&path, &with_key(wrong)).is_err());
}

#[test]
fn copies_re_encrypt_and_reflink_refuses() {
    let (_dir, path) = encrypted_dir(LayoutKind::Split);
    let volume = open_volume(&path, &with_key(key(1))).expect("open");
    let options = CopyOptions::with(CopyMethod::Reflink);
    let refused = copy(
        &volume,
        0,
        &volume,
        200,
        16,
        &options,
        &JobControl::default(),
    )
    .expect_err("reflink refused");
    assert!(refused.to_string().contains("encrypted"), "{refused}");
    // The default (auto) copy falls back to the pipelined one.
    volume.copy(0, 200, 64).expect("copy");
    volume.flush().expect("flush");
    let expected: Vec<u8> = (0..64).flat_map(|lba| pattern(lba, 1)).collect();
    assert_eq!(read(&volume, 200, 64), expected);
    // Moved with their contexts to the same LBAs, blocks verify; to others
    // they do not.
    let sealed = volume.read_sealed(200, 2).expect("read sealed");
    volume.write_sealed(&sealed).expect("same LBAs");
    let mut moved = sealed.clone();
    moved[0].lba = 300;
    let error = volume.write_sealed(&moved).expect_err("refused");
    assert_eq!(
        error.fault().map(|fault| fault.kind),
        Some(FaultKind::AuthFailed)
    );
    volume.close().expect("close");
    let volume = open_volume(&path, &with_key(key(1))).expect("reopen");
    assert_eq!(read(&volume, 200, 64), expected);
    assert!(volume.check(|_, _| {}).expect("check").faults.is_empty());
}

/// The review of migrate33, L2: migrating an encrypted volume opened
/// without its key is refused before anything is made (an unencrypted
/// member would sit beside the encrypted home).
#[test]
fn migrating_an_encrypted_volume_without_its_key_makes_no_member() {
    use vouch_engine::regions::{self, MigrateBreaks};
    let (_dir, path) = encrypted_dir(LayoutKind::Split);
    let error = regions::migrate(
        &path,
        LayoutKind::Packed,
        &OpenOptions::default(),
        &MigrateBreaks::default(),
        |_, _| {},
    )
    .expect_err("no key: refused");
    assert!(error.to_string().contains("no key was given"), "{error}");
    let member = regions::member_path(&path, LayoutKind::Split);
    assert!(!member.exists(), "{} was made", member.display());
    assert!(!path.join(regions::REGIONS_FILE).exists());
    // The volume is as it was: it opens with its key, one layout.
    let volume = open_volume(&path, &with_key(key(1))).expect("reopen");
    assert_eq!(
        read(&volume, 0, 64),
        (0..64).flat_map(|lba| pattern(lba, 1)).collect::<Vec<u8>>()
    );
    volume.close().expect("close");
}
