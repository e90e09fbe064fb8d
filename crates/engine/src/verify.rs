//! Verify offload: check every block's protection information in a range
//! without returning data, optionally proving the bytes were read with a
//! keyed digest; and NVMe Compare of two ranges.
//!
//! # Proof-of-work digest
//!
//! With a client-chosen 32-byte seed, `verify` returns a digest over the
//! range's bytes *as a client reading them would see them*: holes and
//! faulty blocks count as 4096 zero bytes each. The algorithm, exactly:
//!
//! 1. `secret` = the first 192 bytes of BLAKE3's extendable output in keyed
//!    mode with the seed as key
//!    (`blake3::Hasher::new_keyed(&seed).finalize_xof()`, nothing hashed).
//! 2. The range `[first, first + count)` is cut into segments at multiples
//!    of `SCAN_CHUNK_BLOCKS` (256 blocks, 1 MiB): a segment is
//!    `[max(first, k * 256), min(first + count, (k + 1) * 256))`.
//! 3. `segment digest` = XXH3-128 with `secret` (`XXH3_128bits_withSecret`;
//!    xxhash-rust's `xxh3_128_with_secret`) over the bytes
//!    `lba as u64 little-endian || the segment's bytes`, where `lba` is the
//!    segment's first LBA; the 128-bit result is written as 16 bytes
//!    big-endian (XXH128's canonical form).
//! 4. `digest` = XXH3-128 with the same `secret` over the concatenation of
//!    the 16-byte segment digests in LBA order, written the same way.
//!
//! A client checks a segment by reading its bytes over NBD and recomputing
//! step 3. The digest is not a MAC and keeps nothing secret: it proves that
//! the server had the bytes when it answered, given that it could not know
//! the seed in advance (the same argument as Ceph's `checksum` op). XXH3
//! is used because it costs a fraction of a verify's time where a
//! cryptographic hash of every byte would halve it. The engine computes it
//! with twox-hash, which picks AVX2 at run time (about twice the speed of
//! xxhash-rust's compile-time SSE2 path); the tests recompute it with
//! xxhash-rust, so two implementations agree.

use std::time::Instant;

use twox_hash::XxHash3_128;

use crate::buffer::PageBuffer;
use crate::device::BlockDevice;
use crate::error::{Error, Fault, Result};
use crate::jobs::{
    scan_prepared, JobControl, Pace, ScanEnd, ScanOptions, Visit, SCAN_CHUNK_BLOCKS,
};
use crate::state::BLOCK;

/// Bytes in a proof seed.
pub const PROOF_SEED_BYTES: usize = 32;

/// Bytes of the XXH3 secret derived from a seed.
const SECRET_BYTES: usize = 192;

/// A client-chosen key for the proof-of-work digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProofSeed(pub [u8; PROOF_SEED_BYTES]);

impl ProofSeed {
    /// 64 hex digits; anything else is `Error::InvalidArgument` saying the
    /// expected length.
    pub fn from_hex(text: &str) -> Result<ProofSeed> {
        let text = text.trim();
        let wrong = |why: String| {
            Error::InvalidArgument(format!(
                "a proof seed is {} hex digits ({PROOF_SEED_BYTES} bytes); {why}",
                PROOF_SEED_BYTES * 2
            ))
        };
        if text.len() != PROOF_SEED_BYTES * 2 {
            return Err(wrong(format!("got {} characters", text.chars().count())));
        }
        let mut seed = [0u8; PROOF_SEED_BYTES];
        for (index, pair) in text.as_bytes().chunks(2).enumerate() {
            let digits = std::str::from_utf8(pair).ok();
            seed[index] = digits
                .and_then(|digits| u8::from_str_radix(digits, 16).ok())
                .ok_or_else(|| {
                    wrong(format!(
                        "hex digits only: \"{}\" at offset {} is not a hex byte",
                        pair.escape_ascii(),
                        index * 2
                    ))
                })?;
        }
        Ok(ProofSeed(seed))
    }

    /// 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|byte| format!("{byte:02x}")).collect()
    }

    /// The XXH3 secret of step 1 (see the module documentation).
    fn secret(&self) -> [u8; SECRET_BYTES] {
        let mut secret = [0u8; SECRET_BYTES];
        blake3::Hasher::new_keyed(&self.0)
            .finalize_xof()
            .fill(&mut secret);
        secret
    }
}

/// What a verify computes besides the faults.
#[derive(Clone, Debug, Default)]
pub struct VerifyOptions {
    /// `None`: no digest.
    pub seed: Option<ProofSeed>,
    /// Also return one digest per segment.
    pub segments: bool,
    /// Bytes per second read at most (`None`: as fast as it goes).
    pub rate_bytes_per_second: Option<u64>,
}

/// Segment = the scan chunk (`jobs::SCAN_CHUNK_BLOCKS` blocks, aligned),
/// clipped to the range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentDigest {
    pub lba: u64,
    pub count: u64,
    pub digest: [u8; 16],
}

/// The result of a verify.
#[derive(Clone, Debug)]
pub struct VerifyReport {
    pub first: u64,
    pub count: u64,
    /// Blocks read and verified (holes are not read).
    pub blocks_read: u64,
    /// Every bad LBA with its kind, in LBA order.
    pub faults: Vec<Fault>,
    pub digest: Option<[u8; 16]>,
    /// One per segment, in LBA order, when `VerifyOptions::segments`.
    pub segments: Vec<SegmentDigest>,
    pub elapsed: std::time::Duration,
}

/// The digest of a verify as it goes: segments arrive in LBA order, holes
/// the scan skipped are digested as zeros.
struct Digester {
    secret: [u8; SECRET_BYTES],
    /// The next LBA to digest.
    next: u64,
    end: u64,
    /// Segment digests, concatenated.
    concatenated: Vec<u8>,
    keep: bool,
    segments: Vec<SegmentDigest>,
    zeros: Vec<u8>,
}

impl Digester {
    fn new(seed: &ProofSeed, first: u64, end: u64, keep: bool) -> Digester {
        Digester {
            secret: seed.secret(),
            next: first,
            end,
            concatenated: Vec::new(),
            keep,
            segments: Vec::new(),
            zeros: Vec::new(),
        }
    }

    fn segment(&mut self, lba: u64, count: u64, data: &[u8]) {
        let digest = segment_digest(&self.secret, lba, data);
        self.push(lba, count, digest);
    }

    /// A segment whose digest was computed already (by a scan reader).
    fn push(&mut self, lba: u64, count: u64, digest: [u8; 16]) {
        debug_assert_eq!(lba, self.next, "segments arrive in order");
        self.concatenated.extend_from_slice(&digest);
        if self.keep {
            self.segments.push(SegmentDigest { lba, count, digest });
        }
        self.next = lba + count;
    }

    /// Digest the blocks before `lba` that the scan skipped (holes).
    fn zeros_until(&mut self, lba: u64) {
        while self.next < lba {
            let count = (lba - self.next).min(SCAN_CHUNK_BLOCKS - self.next % SCAN_CHUNK_BLOCKS);
            let mut zeros = std::mem::take(&mut self.zeros);
            zeros.resize((count * BLOCK) as usize, 0);
            self.segment(self.next, count, &zeros);
            self.zeros = zeros;
        }
    }

    fn finish(mut self) -> ([u8; 16], Vec<SegmentDigest>) {
        self.zeros_until(self.end);
        let total = XxHash3_128::oneshot_with_secret(&self.secret, &self.concatenated)
            .expect("a 192-byte secret is long enough")
            .to_be_bytes();
        (total, self.segments)
    }
}

/// One segment's digest (step 2 of the module documentation).
fn segment_digest(secret: &[u8; SECRET_BYTES], lba: u64, data: &[u8]) -> [u8; 16] {
    let mut hasher =
        XxHash3_128::with_seed_and_secret(0, *secret).expect("a 192-byte secret is long enough");
    hasher.write(&lba.to_le_bytes());
    hasher.write(data);
    hasher.finish_128().to_be_bytes()
}

/// Blocks `[first, first + count)` must lie on `device`.
pub(crate) fn check_block_range(device: &dyn BlockDevice, first: u64, count: u64) -> Result<()> {
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

/// Verify every block of `[first, first + count)` without returning data:
/// a scan (`jobs::scan`: holes skipped, throttled, progress and cancel in
/// `control`) that keeps the faults and, with a seed, the proof-of-work
/// digest. A cancelled verify fails with `Error::Cancelled`.
pub fn verify(
    device: &dyn BlockDevice,
    first: u64,
    count: u64,
    options: &VerifyOptions,
    control: &JobControl,
) -> Result<VerifyReport> {
    check_block_range(device, first, count)?;
    let started = Instant::now();
    let end = first + count;
    let mut digester = options
        .seed
        .map(|seed| Digester::new(&seed, first, end, options.segments));
    let mut faults = Vec::new();
    let mut blocks_read = 0;
    // Segment digests are computed by the scan's reader threads, beside
    // the reading and verifying; the visitor only orders them.
    let secret = digester.as_ref().map(|digester| digester.secret);
    let scanned = scan_prepared(
        device,
        ScanOptions {
            start: first,
            end: Some(end),
            rate_bytes_per_second: options.rate_bytes_per_second,
            foreground: None,
            // Each chunk is a digest segment; without a digest, chunks
            // hold whole packed rows.
            fixed_chunks: digester.is_some(),
        },
        control,
        None,
        |chunk| {
            secret
                .as_ref()
                .map(|secret| segment_digest(secret, chunk.lba, chunk.data))
        },
        |chunk, digest| {
            faults.extend_from_slice(chunk.faults);
            blocks_read += chunk.count;
            if let (Some(digester), Some(digest)) = (digester.as_mut(), digest) {
                digester.zeros_until(chunk.lba);
                digester.push(chunk.lba, chunk.count, digest);
            }
            Ok(())
        },
    )?;
    if let ScanEnd::Cancelled { at } = scanned {
        return Err(Error::Cancelled(format!(
            "verify cancelled: every block before LBA {at} was checked"
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
        segments,
        elapsed: started.elapsed(),
    })
}

/// NVMe Compare of two ranges: `None` if equal, else the byte offset (from
/// the start of the ranges) of the first difference. Both sides are
/// verified in full, also after a difference: a faulty block in either
/// range fails the call naming its LBA. The ranges may be on one device
/// and may overlap. A cancelled compare fails with `Error::Cancelled`
/// (the LBA is of range `a`).
pub fn compare_ranges(
    a: &dyn BlockDevice,
    a_first: u64,
    b: &dyn BlockDevice,
    b_first: u64,
    count: u64,
    control: &JobControl,
) -> Result<Option<u64>> {
    check_block_range(a, a_first, count)?;
    check_block_range(b, b_first, count)?;
    // A `Visit` over the blocks compared, not a `scan`: two ranges are
    // read in step, holes too (a hole is equal to zeros on the other side).
    let mut run = Visit::begin(control, 0..count, Pace::Unlimited, None, None)?;
    let step = SCAN_CHUNK_BLOCKS;
    let mut a_buffer = PageBuffer::new((step.min(count) * BLOCK) as usize);
    let mut b_buffer = PageBuffer::new((step.min(count) * BLOCK) as usize);
    let mut difference = None;
    while run.at() < count {
        if run.cancelled()? {
            return Err(Error::Cancelled(format!(
                "compare cancelled: every block before LBA {} was compared",
                a_first + run.at()
            )));
        }
        let done = run.at();
        let n = (count - done).min(step);
        let bytes = (n * BLOCK) as usize;
        a.read((a_first + done) * BLOCK, &mut a_buffer[..bytes])?;
        b.read((b_first + done) * BLOCK, &mut b_buffer[..bytes])?;
        if difference.is_none() {
            difference = first_difference(&a_buffer[..bytes], &b_buffer[..bytes])
                .map(|at| done * BLOCK + at as u64);
        }
        run.step(done + n, 2 * n, 2 * n * BLOCK)?;
    }
    run.finish()?;
    Ok(difference)
}

/// The index of the first byte where `a` and `b` differ, comparing 8
/// bytes at a time.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    let words = a.len() / 8 * 8;
    let word = a[..words]
        .chunks_exact(8)
        .zip(b[..words].chunks_exact(8))
        .position(|(x, y)| x != y)
        .map(|index| index * 8)
        .unwrap_or(words);
    a[word..]
        .iter()
        .zip(&b[word..])
        .position(|(x, y)| x != y)
        .map(|index| word + index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_is_64_hex_digits() {
        let text = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";
        let seed = ProofSeed::from_hex(text).expect("valid");
        assert_eq!(seed.to_hex(), text.to_lowercase());
        for bad in [
            "",
            "0011",
            &text[..63],
            &format!("{text}00"),
            &format!("{}zz", &text[..62]),
            &format!("{}é", &text[..62]),
        ] {
            let error = ProofSeed::from_hex(bad).expect_err(bad);
            assert!(error.to_string().contains("64 hex digits"), "{error}");
        }
    }

    #[test]
    fn first_difference_finds_the_first_byte() {
        let a = vec![7u8; 100];
        for at in [0, 5, 8, 63, 96, 99] {
            let mut b = a.clone();
            b[at] = 1;
            b[99] = 2;
            assert_eq!(first_difference(&a, &b), Some(at));
        }
        assert_eq!(first_difference(&a, &a), None);
    }
}
