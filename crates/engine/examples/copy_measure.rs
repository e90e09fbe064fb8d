//! A quick measurement of copy methods (not a test): in `DIR`, one split
//! volume of 2 x `MIB` MiB holding `MIB` MiB of data (flushed, in the page
//! cache), then `MIB` MiB copied to the other half by
//! - the `BlockDevice` default copy (1 MiB read + write in turn),
//! - `copy::copy` pipelined,
//! - `copy::copy` reflink (when `DIR` shares extents: btrfs, xfs),
//!
//! each followed by a flush (the default copy first and last, to show
//! what order costs), and the source verified alone (what reflink
//! pays for verifying). Usage:
//! `cargo run --release -p vouch-engine --example copy_measure -- DIR MIB`

use std::ops::Range;
use std::time::Instant;
use vouch_engine::DeviceWrites;

use vouch_engine::copy::{copy, CopyMethod, CopyOptions};
use vouch_engine::jobs::JobControl;
use vouch_engine::{
    create_volume, Admission, Allocation, BlockDevice, CreateOptions, Fault, LayoutKind, Result,
    Submitted, Volume, ZeroFlags, BLOCK,
};

/// A volume without its copy override: the trait's default copy.
struct Plain<'a>(&'a Volume);

impl BlockDevice for Plain<'_> {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn is_read_only(&self) -> bool {
        self.0.is_read_only()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        self.0.read(offset, buf)
    }
    fn submit_write(
        &self,
        offset: u64,
        data: &bytes::Bytes,
        fua: bool,
        admission: Admission,
    ) -> Result<Submitted> {
        self.0.submit_write(offset, data, fua, admission)
    }
    fn flush(&self) -> Result<()> {
        self.0.flush()
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.0.trim(offset, length, fua)
    }
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()> {
        self.0.write_zeroes(offset, length, flags)
    }
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>> {
        self.0.block_status(offset, length, max_blocks)
    }
    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        self.0.read_blocks_collecting(first, count, out)
    }
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(mib)) = (args.get(1), args.get(2)) else {
        return Err("usage: copy_measure DIR MIB".into());
    };
    let mib: u64 = mib.parse()?;
    let blocks = mib * 256;
    let path = std::path::Path::new(dir).join("copy-measure");
    let mut options = CreateOptions::new(2 * blocks * BLOCK);
    options.layout = LayoutKind::Split;
    let volume = create_volume(&path, &options)?;
    let chunk: Vec<u8> = (0..(1u64 << 20)).map(|i| (i * 131 % 251) as u8).collect();
    for at in 0..mib {
        let mut data = chunk.clone();
        data[..8].copy_from_slice(&at.to_le_bytes());
        volume.write(at << 20, &data, false)?;
    }
    volume.flush()?;
    let rate = |seconds: f64| (mib as f64 / 1024.0) / seconds;
    let started = Instant::now();
    let mut buffer = vec![0u8; 1 << 20];
    for at in 0..mib {
        volume.read(at << 20, &mut buffer)?;
    }
    let verify = started.elapsed().as_secs_f64();
    println!(
        "verified read of the source: {verify:.3} s ({:.2} GiB/s)",
        rate(verify)
    );
    let started = Instant::now();
    Plain(&volume).copy(0, blocks, blocks)?;
    volume.flush()?;
    let plain = started.elapsed().as_secs_f64();
    println!(
        "default trait copy + flush: {plain:.3} s ({:.2} GiB/s)",
        rate(plain)
    );
    for method in [CopyMethod::Reflink, CopyMethod::Pipelined] {
        let control = JobControl::default();
        let started = Instant::now();
        let options = CopyOptions::with(method);
        match copy(&volume, 0, &volume, blocks, blocks, &options, &control) {
            Ok(report) => {
                volume.flush()?;
                let seconds = started.elapsed().as_secs_f64();
                println!(
                    "{} copy + flush: {seconds:.3} s ({:.2} GiB/s; copy alone {:.3} s)",
                    report.method.name(),
                    rate(seconds),
                    report.elapsed.as_secs_f64()
                );
            }
            Err(error) => println!("{}: {error}", method.name()),
        }
    }
    let started = Instant::now();
    Plain(&volume).copy(0, blocks, blocks)?;
    volume.flush()?;
    let plain = started.elapsed().as_secs_f64();
    println!(
        "default trait copy + flush: {plain:.3} s ({:.2} GiB/s)",
        rate(plain)
    );
    let mut check = vec![0u8; 1 << 20];
    for at in [0, mib / 2, mib - 1] {
        volume.read((blocks * BLOCK) + (at << 20), &mut check)?;
        volume.read(at << 20, &mut buffer)?;
        assert!(check == buffer, "copy differs at MiB {at}");
    }
    volume.close()?;
    std::fs::remove_dir_all(&path)?;
    Ok(())
}
