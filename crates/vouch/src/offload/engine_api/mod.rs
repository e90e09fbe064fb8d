//! ADAPTER — the engine offload API of issue 10 (`/work/OFFLOAD-CONTRACT.md`)
//! with the contract's exact signatures, implemented here with what the
//! engine already has (`jobs::scan`, `BlockDevice` reads and writes). Every
//! call the control API and the CLI make to the engine goes through this
//! module and nothing else, so that once `vouch_engine::{copy, verify,
//! scrub}` exist, this module (`engine_api/mod.rs` and `scrub.rs`) becomes
//! these `pub use` lines:
//!
//! ```text
//! pub use vouch_engine::copy::{copy, CopyMethod, CopyOptions, CopyReport};
//! pub use vouch_engine::verify::{compare_ranges, verify, ProofSeed, SegmentDigest,
//!     VerifyOptions, VerifyReport, PROOF_SEED_BYTES};
//! pub use vouch_engine::scrub::{last_scrub, scrub, ScrubOptions, ScrubRecord, ScrubState};
//! ```
//!
//! What differs from the engine versions: `copy` here is a plain
//! read-verify-write loop (reports `Pipelined`, refuses a forced
//! `Reflink`); the scrub record is `scrub.json` written by this module.

use std::time::{Duration, Instant};

use vouch_engine::jobs::{scan, JobControl, ScanEnd, ScanOptions, SCAN_CHUNK_BLOCKS};
use vouch_engine::{BlockDevice, Error, Fault, Result, Volume, ZeroFlags, BLOCK};
use xxhash_rust::xxh3::Xxh3;

mod scrub;

/// Bytes in a proof-of-work seed.
pub const PROOF_SEED_BYTES: usize = 32;
/// Bytes of XXH3 secret derived from a seed.
const SECRET_BYTES: usize = 192;

/// A client-chosen key for the proof-of-work digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProofSeed(pub [u8; PROOF_SEED_BYTES]);

impl ProofSeed {
    /// 64 hex digits; anything else is `InvalidArgument` saying the expected length.
    pub fn from_hex(text: &str) -> Result<ProofSeed> {
        let wrong = || {
            Error::InvalidArgument(format!(
                "a seed is {} hex digits ({PROOF_SEED_BYTES} bytes); got {} characters",
                PROOF_SEED_BYTES * 2,
                text.len()
            ))
        };
        if text.len() != PROOF_SEED_BYTES * 2 {
            return Err(wrong());
        }
        let mut bytes = [0u8; PROOF_SEED_BYTES];
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[index * 2..index * 2 + 2], 16).map_err(|_| {
                Error::InvalidArgument(format!("a seed is hex digits only; got {text:?}"))
            })?;
        }
        Ok(ProofSeed(bytes))
    }

    #[allow(clippy::wrong_self_convention)] // the contract's signature
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// The XXH3 secret: the first 192 bytes of the BLAKE3 XOF keyed with the seed.
    fn secret(&self) -> [u8; SECRET_BYTES] {
        let mut secret = [0u8; SECRET_BYTES];
        blake3::Hasher::new_keyed(&self.0)
            .finalize_xof()
            .fill(&mut secret);
        secret
    }
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[derive(Clone, Debug, Default)]
pub struct VerifyOptions {
    pub seed: Option<ProofSeed>,
    pub segments: bool,
    pub rate_bytes_per_second: Option<u64>,
}

/// One segment's digest: `SCAN_CHUNK_BLOCKS` aligned blocks, clipped to the range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentDigest {
    pub lba: u64,
    pub count: u64,
    pub digest: [u8; 16],
}

#[derive(Clone, Debug)]
pub struct VerifyReport {
    pub first: u64,
    pub count: u64,
    pub blocks_read: u64,
    pub faults: Vec<Fault>,
    pub digest: Option<[u8; 16]>,
    pub segments: Vec<SegmentDigest>,
    pub elapsed: Duration,
}

/// Digests segments as a scan delivers chunks; blocks the scan skipped
/// (holes) are fed as zeros.
struct Digester {
    secret: [u8; SECRET_BYTES],
    end: u64,
    /// Next LBA to feed, and the open segment's hasher and first LBA.
    next: u64,
    open: Option<(u64, Xxh3)>,
    segments: Vec<SegmentDigest>,
}

impl Digester {
    fn feed(&mut self, lba: u64, data: &[u8]) {
        let zeros = [0u8; BLOCK as usize];
        while self.next < lba {
            let n = (lba - self.next).min(SCAN_CHUNK_BLOCKS - self.next % SCAN_CHUNK_BLOCKS);
            self.feed_blocks(self.next, n, &zeros);
        }
        let count = data.len() as u64 / BLOCK;
        let mut at = 0;
        while at < count {
            let n = (count - at).min(SCAN_CHUNK_BLOCKS - (lba + at) % SCAN_CHUNK_BLOCKS);
            let bytes = &data[(at * BLOCK) as usize..((at + n) * BLOCK) as usize];
            self.feed_blocks(lba + at, n, bytes);
            at += n;
        }
    }

    /// Feed `n` blocks of one segment starting at `lba` (`bytes` holds `n`
    /// blocks, or one block repeated when it is the zero block).
    fn feed_blocks(&mut self, lba: u64, n: u64, bytes: &[u8]) {
        if self.open.is_none() {
            let mut hasher = Xxh3::with_secret(self.secret);
            hasher.update(&lba.to_le_bytes());
            self.open = Some((lba, hasher));
        }
        let (_, hasher) = self.open.as_mut().expect("open segment");
        if bytes.len() as u64 == n * BLOCK {
            hasher.update(bytes);
        } else {
            for _ in 0..n {
                hasher.update(bytes);
            }
        }
        self.next = lba + n;
        if self.next.is_multiple_of(SCAN_CHUNK_BLOCKS) || self.next == self.end {
            let (first, hasher) = self.open.take().expect("open segment");
            self.segments.push(SegmentDigest {
                lba: first,
                count: self.next - first,
                digest: hasher.digest128().to_be_bytes(),
            });
        }
    }

    fn finish(mut self) -> ([u8; 16], Vec<SegmentDigest>) {
        let zeros = [0u8; BLOCK as usize];
        while self.next < self.end {
            let n = (self.end - self.next).min(SCAN_CHUNK_BLOCKS - self.next % SCAN_CHUNK_BLOCKS);
            self.feed_blocks(self.next, n, &zeros);
        }
        let mut total = Xxh3::with_secret(self.secret);
        for segment in &self.segments {
            total.update(&segment.digest);
        }
        (total.digest128().to_be_bytes(), self.segments)
    }
}

fn check_range(device: &dyn BlockDevice, first: u64, count: u64) -> Result<()> {
    let blocks = device.size() / BLOCK;
    if first.checked_add(count).is_none_or(|end| end > blocks) {
        return Err(Error::OutOfRange {
            offset: first.saturating_mul(BLOCK),
            length: count.saturating_mul(BLOCK),
            size: device.size(),
        });
    }
    Ok(())
}

/// Verify `[first, first + count)`: every fault, and with a seed the proof digest.
pub fn verify(
    device: &dyn BlockDevice,
    first: u64,
    count: u64,
    options: &VerifyOptions,
    control: &JobControl,
) -> Result<VerifyReport> {
    check_range(device, first, count)?;
    let started = Instant::now();
    let mut faults = Vec::new();
    let mut digester = options.seed.map(|seed| Digester {
        secret: seed.secret(),
        end: first + count,
        next: first,
        open: None,
        segments: Vec::new(),
    });
    let scan_options = ScanOptions {
        start: first,
        end: Some(first + count),
        rate_bytes_per_second: options.rate_bytes_per_second,
    };
    let mut blocks_read = 0;
    let end = scan(device, scan_options, control, None, |chunk| {
        faults.extend_from_slice(chunk.faults);
        blocks_read += chunk.count;
        if let Some(digester) = digester.as_mut() {
            digester.feed(chunk.lba, chunk.data);
        }
        Ok(())
    })?;
    if let ScanEnd::Cancelled { at } = end {
        return Err(Error::InvalidArgument(format!(
            "verify cancelled at LBA {at} ({} of {count} blocks done)",
            at - first
        )));
    }
    let (digest, segments) = match digester {
        Some(digester) => {
            let (digest, segments) = digester.finish();
            (Some(digest), segments)
        }
        None => (None, Vec::new()),
    };
    Ok(VerifyReport {
        first,
        count,
        blocks_read,
        faults,
        digest,
        segments: if options.segments {
            segments
        } else {
            Vec::new()
        },
        elapsed: started.elapsed(),
    })
}

/// NVMe Compare of two ranges: `None` if equal, else the byte offset of
/// the first difference. A fault on either side fails naming its LBA.
pub fn compare_ranges(
    a: &dyn BlockDevice,
    a_first: u64,
    b: &dyn BlockDevice,
    b_first: u64,
    count: u64,
    control: &JobControl,
) -> Result<Option<u64>> {
    check_range(a, a_first, count)?;
    check_range(b, b_first, count)?;
    let mut left = vec![0u8; (SCAN_CHUNK_BLOCKS * BLOCK) as usize];
    let mut right = vec![0u8; (SCAN_CHUNK_BLOCKS * BLOCK) as usize];
    let mut done = 0;
    while done < count {
        if control.is_cancelled() {
            return Err(Error::InvalidArgument(format!(
                "compare cancelled after {done} of {count} blocks"
            )));
        }
        let n = (count - done).min(SCAN_CHUNK_BLOCKS);
        let bytes = (n * BLOCK) as usize;
        a.read((a_first + done) * BLOCK, &mut left[..bytes])?;
        b.read((b_first + done) * BLOCK, &mut right[..bytes])?;
        if let Some(index) = left[..bytes]
            .iter()
            .zip(&right[..bytes])
            .position(|(x, y)| x != y)
        {
            return Ok(Some(done * BLOCK + index as u64));
        }
        done += n;
    }
    Ok(None)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMethod {
    Auto,
    Reflink,
    Pipelined,
}

impl CopyMethod {
    pub fn name(self) -> &'static str {
        match self {
            CopyMethod::Auto => "auto",
            CopyMethod::Reflink => "reflink",
            CopyMethod::Pipelined => "pipelined",
        }
    }

    pub fn parse(text: &str) -> Result<CopyMethod> {
        match text {
            "auto" => Ok(CopyMethod::Auto),
            "reflink" => Ok(CopyMethod::Reflink),
            "pipelined" => Ok(CopyMethod::Pipelined),
            other => Err(Error::InvalidArgument(format!(
                "unknown copy method {other:?} (auto, reflink or pipelined)"
            ))),
        }
    }
}

#[derive(Clone, Debug)]
pub struct CopyOptions {
    pub method: CopyMethod,
}

#[derive(Clone, Debug)]
pub struct CopyReport {
    pub method: CopyMethod,
    pub blocks: u64,
    pub elapsed: Duration,
}

/// Copy `count` blocks, source verified on the way (a fault fails the copy
/// naming its LBA before anything of its chunk is written).
pub fn copy(
    source: &Volume,
    source_first: u64,
    destination: &Volume,
    destination_first: u64,
    count: u64,
    options: &CopyOptions,
    control: &JobControl,
) -> Result<CopyReport> {
    if options.method == CopyMethod::Reflink {
        return Err(Error::Unsupported(
            "reflink copy is not available in this build; use auto or pipelined".into(),
        ));
    }
    check_range(source, source_first, count)?;
    check_range(destination, destination_first, count)?;
    if destination.is_read_only() {
        return Err(Error::ReadOnly(String::new()));
    }
    let started = Instant::now();
    let same = std::ptr::eq(source, destination);
    let overlaps_forward =
        same && destination_first > source_first && destination_first < source_first + count;
    if overlaps_forward {
        // memmove: the default copy goes backwards (no progress, no cancel).
        source.copy(source_first, destination_first, count)?;
    } else {
        let shift = |lba: u64| destination_first + (lba - source_first);
        let mut next = source_first;
        let scan_options = ScanOptions {
            start: source_first,
            end: Some(source_first + count),
            rate_bytes_per_second: None,
        };
        let zero = ZeroFlags {
            fua: false,
            allocate: false,
        };
        let end = scan(source, scan_options, control, None, |chunk| {
            if let Some(fault) = chunk.faults.first() {
                return Err(Error::Fault(fault.clone()));
            }
            if chunk.lba > next {
                destination.write_zeroes(shift(next) * BLOCK, (chunk.lba - next) * BLOCK, zero)?;
            }
            destination.write(shift(chunk.lba) * BLOCK, chunk.data, false)?;
            next = chunk.lba + chunk.count;
            Ok(())
        })?;
        if let ScanEnd::Cancelled { at } = end {
            return Err(Error::InvalidArgument(format!(
                "copy cancelled at source LBA {at}: {} of {count} blocks copied, none after",
                at - source_first
            )));
        }
        let end = source_first + count;
        if next < end {
            destination.write_zeroes(shift(next) * BLOCK, (end - next) * BLOCK, zero)?;
        }
    }
    Ok(CopyReport {
        method: CopyMethod::Pipelined,
        blocks: count,
        elapsed: started.elapsed(),
    })
}

pub use scrub::{last_scrub, scrub, ScrubOptions, ScrubRecord, ScrubState};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_segment_digests_match_the_one_shot_definition() {
        let seed = ProofSeed([7u8; PROOF_SEED_BYTES]);
        let secret = seed.secret();
        let mut digester = Digester {
            secret,
            end: 300,
            next: 0,
            open: None,
            segments: Vec::new(),
        };
        let data: Vec<u8> = (0..(10 * BLOCK)).map(|i| (i % 251) as u8).collect();
        digester.feed(260, &data);
        let (total, segments) = digester.finish();
        assert_eq!(segments.len(), 2);
        let mut first = 0u64.to_le_bytes().to_vec();
        first.resize(8 + (256 * BLOCK) as usize, 0);
        let mut second = 256u64.to_le_bytes().to_vec();
        second.resize(8 + (4 * BLOCK) as usize, 0);
        second.extend_from_slice(&data);
        second.resize(8 + (44 * BLOCK) as usize, 0);
        let expect = [
            xxhash_rust::xxh3::xxh3_128_with_secret(&first, &secret).to_be_bytes(),
            xxhash_rust::xxh3::xxh3_128_with_secret(&second, &secret).to_be_bytes(),
        ];
        assert_eq!(segments[0].digest, expect[0]);
        assert_eq!((segments[1].lba, segments[1].count), (256, 44));
        assert_eq!(segments[1].digest, expect[1]);
        let both = [expect[0], expect[1]].concat();
        assert_eq!(
            total,
            xxhash_rust::xxh3::xxh3_128_with_secret(&both, &secret).to_be_bytes()
        );
    }

    #[test]
    fn seeds_are_64_hex_digits() {
        let text = "ab".repeat(32);
        assert_eq!(ProofSeed::from_hex(&text).expect("valid").to_hex(), text);
        let short = ProofSeed::from_hex("abcd").expect_err("short");
        assert!(short.to_string().contains("64 hex digits"), "{short}");
        assert!(ProofSeed::from_hex(&"zz".repeat(32)).is_err());
    }
}
