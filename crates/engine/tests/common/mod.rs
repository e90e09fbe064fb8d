//! Volumes in real directories for the verify and scrub tests, and ways
//! to damage them on disk while they are closed.

#![allow(dead_code)]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use vouch_engine::DeviceWrites;

use vouch_engine::{
    create_volume, open_volume, BlockDevice, CreateOptions, LayoutKind, OpenOptions, Volume, BLOCK,
};

/// Blocks in a test volume: 8 scan chunks of 256.
pub const BLOCKS: u64 = 2048;

/// A block's bytes: recognisably of `lba` and `tag`.
pub fn pattern(lba: u64, tag: u8) -> Vec<u8> {
    let mut block = vec![0u8; BLOCK as usize];
    for (index, byte) in block.iter_mut().enumerate() {
        *byte = (lba as u8)
            .wrapping_mul(31)
            .wrapping_add(tag)
            .wrapping_add((index / 7) as u8);
    }
    block
}

/// A closed volume of `BLOCKS` blocks in a temporary directory with
/// `pattern(lba, 1)` at every LBA of `written`.
pub fn volume_dir(
    layout: LayoutKind,
    written: &[std::ops::Range<u64>],
) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("volume");
    let mut options = CreateOptions::new(BLOCKS * BLOCK);
    options.layout = layout;
    let volume = create_volume(&path, &options).expect("create");
    for range in written {
        let data: Vec<u8> = range.clone().flat_map(|lba| pattern(lba, 1)).collect();
        volume
            .write(range.start * BLOCK, &data, false)
            .expect("write");
    }
    volume.close().expect("close");
    (dir, path)
}

pub fn open(path: &Path) -> Volume {
    open_volume(path, &OpenOptions::default()).expect("open")
}

/// Where block `lba`'s data starts in `data.00000`.
pub fn data_offset(path: &Path, lba: u64) -> u64 {
    let volume = open_volume(
        path,
        &OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        },
    )
    .expect("open");
    volume.geometry().locate(lba).data_offset
}

fn xor_file(file: &Path, offset: u64, mask: u8) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .expect("open a volume file");
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, offset).expect("read");
    byte[0] ^= mask;
    file.write_all_at(&byte, offset).expect("write");
    file.sync_all().expect("sync");
}

/// Flip a bit in block `lba`'s stored data (a guard mismatch).
pub fn corrupt_data(path: &Path, lba: u64) {
    let offset = data_offset(path, lba) + 100;
    xor_file(&path.join("data.00000"), offset, 0x10);
}

/// Flip a bit in block `lba`'s stored context (its CRC fails).
pub fn corrupt_context(path: &Path, layout: LayoutKind, lba: u64) {
    match layout {
        LayoutKind::Split => xor_file(&path.join("contexts"), lba * 32 + 3, 0x01),
        LayoutKind::Packed => {
            let offset = data_offset(path, lba) + BLOCK + 3;
            xor_file(&path.join("data.00000"), offset, 0x01)
        }
    }
}

/// Every block of `device` in `[first, first + count)`, read through
/// `BlockDevice::read`.
pub fn read_range(device: &dyn BlockDevice, first: u64, count: u64) -> Vec<u8> {
    let mut data = vec![0u8; (count * BLOCK) as usize];
    device.read(first * BLOCK, &mut data).expect("read");
    data
}

/// The reactor's inline write (`vouch_engine::Admission::MustNotWait`): whether it was done.
pub fn try_write<D: vouch_engine::BlockDevice + ?Sized>(
    device: &D,
    offset: u64,
    data: &[u8],
) -> vouch_engine::Result<bool> {
    device
        .submit_write(
            offset,
            &bytes::Bytes::copy_from_slice(data),
            false,
            vouch_engine::Admission::MustNotWait,
        )
        .map(|submitted| submitted.is_done())
}
