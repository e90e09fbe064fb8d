//! Verify and scrub in the crash simulator (`crash.rs`): interleaved with
//! the random workload, and on every recovered image checked. A verify or
//! scrub must never report a fault on a block the model (or, after a crash,
//! a read of the block) says is valid, and the proof-of-work digest must be
//! the one recomputed here, independently of the engine, from the bytes
//! the model says the range holds.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use vouch_engine::jobs::JobControl;
use vouch_engine::scrub::{scrub, ScrubOptions, ScrubState};
use vouch_engine::verify::{verify, ProofSeed, VerifyOptions};
use vouch_engine::Volume;

use crate::rng::Rng;
use crate::BLOCK;

/// Blocks per proof segment (the engine's scan chunk).
const SEGMENT_BLOCKS: u64 = 256;

/// The digest of `bytes` (blocks from `first`), by the algorithm in
/// `vouch_engine::verify`'s documentation, with nothing of the engine's.
fn expected_digest(seed: &[u8; 32], first: u64, bytes: &[u8]) -> [u8; 16] {
    let mut secret = [0u8; 192];
    blake3::Hasher::new_keyed(seed)
        .finalize_xof()
        .fill(&mut secret);
    let count = (bytes.len() / BLOCK) as u64;
    let mut concatenated = Vec::new();
    let mut lba = first;
    while lba < first + count {
        let n = (first + count - lba).min(SEGMENT_BLOCKS - lba % SEGMENT_BLOCKS);
        let at = ((lba - first) as usize) * BLOCK;
        let mut input = lba.to_le_bytes().to_vec();
        input.extend_from_slice(&bytes[at..at + n as usize * BLOCK]);
        concatenated.extend_from_slice(
            &xxhash_rust::xxh3::xxh3_128_with_secret(&input, &secret).to_be_bytes(),
        );
        lba += n;
    }
    xxhash_rust::xxh3::xxh3_128_with_secret(&concatenated, &secret).to_be_bytes()
}

/// Verify `[first, first + count)` with a random seed: the faults must be
/// exactly `faulty` (within the range) and the digest that of `bytes` (the
/// whole volume as the model or the reads say it is, faulty blocks zero).
pub fn check_verify(
    volume: &Volume,
    bytes: &[u8],
    faulty: &[u64],
    first: u64,
    count: u64,
    rng: &mut Rng,
) -> Result<(), String> {
    let mut seed = [0u8; 32];
    seed.copy_from_slice(&rng.bytes(32));
    let options = VerifyOptions {
        seed: Some(ProofSeed(seed)),
        segments: false,
        rate_bytes_per_second: None,
    };
    let report = verify(volume, first, count, &options, &JobControl::default())
        .map_err(|error| format!("verify {first}+{count} failed: {error}"))?;
    let found: Vec<u64> = report.faults.iter().map(|fault| fault.lba).collect();
    let expected: Vec<u64> = faulty
        .iter()
        .copied()
        .filter(|lba| (first..first + count).contains(lba))
        .collect();
    if found != expected {
        return Err(format!(
            "verify {first}+{count} reported faults at {found:?}; the blocks that fail to read are {expected:?}"
        ));
    }
    let range = &bytes[first as usize * BLOCK..(first + count) as usize * BLOCK];
    if report.digest != Some(expected_digest(&seed, first, range)) {
        return Err(format!(
            "verify {first}+{count}: the proof digest is not that of the bytes the blocks hold"
        ));
    }
    Ok(())
}

/// A scrub of the whole volume, cancelled part-way at random and resumed:
/// it must finish with exactly `faulty` as its faults.
pub fn check_scrub(volume: &Volume, faulty: &[u64], rng: &mut Rng) -> Result<(), String> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = ScrubDir::new(NEXT.fetch_add(1, Ordering::Relaxed))?;
    let control = JobControl::default();
    if rng.chance(1, 2) {
        // Cancelled before it starts: a Cancelled record the next resumes.
        control.cancel();
        let record = scrub(volume, &dir.0, &ScrubOptions::default(), &control)
            .map_err(|error| format!("scrub failed: {error}"))?;
        if record.state != ScrubState::Cancelled {
            return Err(format!("a cancelled scrub ended {:?}", record.state));
        }
    }
    let record = scrub(
        volume,
        &dir.0,
        &ScrubOptions::default(),
        &JobControl::default(),
    )
    .map_err(|error| format!("scrub failed: {error}"))?;
    let found: Vec<u64> = record.faults.iter().map(|fault| fault.lba).collect();
    if record.state != ScrubState::Finished || found != faulty {
        return Err(format!(
            "scrub ended {:?} with faults at {found:?}; the blocks that fail to read are {faulty:?}",
            record.state
        ));
    }
    Ok(())
}

/// A directory for a scrub record, removed when dropped.
struct ScrubDir(PathBuf);

impl ScrubDir {
    fn new(unique: u64) -> Result<ScrubDir, String> {
        let path =
            std::env::temp_dir().join(format!("vouch-sim-scrub-{}-{unique}", std::process::id()));
        std::fs::create_dir_all(&path)
            .map_err(|error| format!("cannot create {}: {error}", path.display()))?;
        Ok(ScrubDir(path))
    }
}

impl Drop for ScrubDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use vouch_engine::{BlockDevice, CreateOptions, DeviceWrites, ObjectId, SimStorage};

    use super::*;

    /// The checks are not vacuous: wrong bytes, a missed fault and a
    /// fault where there is none are each caught.
    #[test]
    fn the_offload_checks_catch_a_wrong_digest_and_wrong_faults() {
        let storage = Arc::new(SimStorage::new());
        let volume = Volume::create(storage.clone(), &CreateOptions::new(300 * BLOCK as u64))
            .expect("create");
        let mut rng = Rng::new(7);
        let mut bytes = rng.bytes(300 * BLOCK);
        bytes[280 * BLOCK..].fill(0);
        volume
            .write(0, &bytes[..280 * BLOCK], false)
            .expect("write");
        volume.flush().expect("flush");
        check_verify(&volume, &bytes, &[], 0, 300, &mut rng).expect("the model's bytes");
        check_verify(&volume, &bytes, &[], 250, 40, &mut rng).expect("a range");
        check_scrub(&volume, &[], &mut rng).expect("scrub");
        let mut wrong = bytes.clone();
        wrong[260 * BLOCK + 9] ^= 1;
        let error = check_verify(&volume, &wrong, &[], 0, 300, &mut rng).expect_err("wrong bytes");
        assert!(error.contains("digest"), "{error}");
        let error =
            check_verify(&volume, &bytes, &[3], 0, 300, &mut rng).expect_err("a missed fault");
        assert!(error.contains("[3]"), "{error}");
        storage.corrupt(ObjectId::Data(0), 5 * BLOCK as u64 + 1, 0x40);
        bytes[5 * BLOCK..6 * BLOCK].fill(0);
        check_verify(&volume, &bytes, &[5], 0, 300, &mut rng).expect("the fault, as zeros");
        check_scrub(&volume, &[5], &mut rng).expect("scrub finds it");
        let error = check_scrub(&volume, &[], &mut rng).expect_err("an unexpected fault");
        assert!(error.contains("[5]"), "{error}");
    }
}
