//! The fuzz targets' bodies over seeded random inputs, on stable.

use std::sync::Arc;

use vouch_engine::read_superblock;
use vouch_engine::{CreateOptions, LayoutKind, SimStorage, Volume};
use vouch_format::journal::encode_record;
use vouch_format::{Context, JournalEntry};
use vouch_sim::fuzz;
use vouch_sim::rng::Rng;

const INPUTS: u64 = if !cfg!(sim_full) { 20_000 } else { 100_000 };

/// Random bytes, or a valid seed with a few random byte edits.
fn input(rng: &mut Rng, seeds: &[Vec<u8>], max: usize) -> Vec<u8> {
    if seeds.is_empty() || rng.chance(1, 4) {
        let len = rng.below(max as u64 + 1) as usize;
        return rng.bytes(len);
    }
    let mut data = seeds[rng.below(seeds.len() as u64) as usize].clone();
    for _ in 0..rng.range(0, 4) {
        if data.is_empty() {
            break;
        }
        let at = rng.below(data.len() as u64) as usize;
        match rng.below(3) {
            0 => data[at] ^= 1 << rng.below(8),
            1 => data[at] = rng.next_u64() as u8,
            _ => data.truncate(at),
        }
    }
    data
}

fn superblock_seed() -> Vec<u8> {
    let sim = SimStorage::new();
    let options = CreateOptions::new(64 * 4096);
    Volume::create(Arc::new(sim.clone()), &options)
        .and_then(Volume::close)
        .expect("create");
    read_superblock(&sim).expect("superblock").encode().to_vec()
}

#[test]
fn superblock_inputs() {
    let sb = superblock_seed();
    let seeds: Vec<Vec<u8>> = (0..8u8)
        .map(|mode| {
            let mut seed = vec![mode];
            seed.extend_from_slice(&sb);
            seed
        })
        .chain([sb.clone()])
        .collect();
    let mut rng = Rng::new(1);
    for _ in 0..INPUTS {
        fuzz::superblock(&input(&mut rng, &seeds, 300));
    }
}

#[test]
fn context_inputs() {
    let data = Context::Data {
        volume_tag: 7,
        ref_tag: 99,
        guard: 0xDEAD_BEEF,
        generation: 3,
    }
    .encode();
    let mut seeds = vec![data.to_vec(), [0u8; 33].to_vec()];
    seeds[0].push(17);
    let mut rng = Rng::new(2);
    for _ in 0..INPUTS {
        fuzz::context(&input(&mut rng, &seeds, 40));
    }
}

#[test]
fn unit_inputs() {
    let seeds: Vec<Vec<u8>> = fuzz::seed_corpus()
        .into_iter()
        .filter(|(target, _, _)| *target == "unit")
        .map(|(_, _, bytes)| bytes)
        .collect();
    let mut rng = Rng::new(4);
    // Each input builds and reads a volume: fewer than the decoders get.
    for _ in 0..INPUTS / 100 {
        fuzz::unit(&input(&mut rng, &seeds, 80));
    }
}

#[test]
fn journal_inputs() {
    let entries = [
        JournalEntry {
            lba: 3,
            count: 1,
            context: Context::Data {
                volume_tag: 1,
                ref_tag: 3,
                guard: 5,
                generation: 2,
            },
        },
        JournalEntry {
            lba: 4,
            count: 9,
            context: Context::Unwritten,
        },
    ];
    let record = encode_record(2, [1; 16], 1, &entries, None);
    let mut raw_entries = Vec::new();
    for entry in &entries {
        let mut out = [0u8; vouch_format::JOURNAL_ENTRY_BYTES];
        entry.encode_into(&mut out);
        raw_entries.extend_from_slice(&out);
    }
    let seeds: Vec<Vec<u8>> = vec![record]
        .into_iter()
        .chain((0..16u8).map(|mode| {
            let mut seed = vec![mode];
            seed.extend_from_slice(&raw_entries);
            seed
        }))
        .collect();
    let mut rng = Rng::new(3);
    // Replaying opens a volume: fewer inputs take that path.
    for index in 0..INPUTS {
        let mut data = input(&mut rng, &seeds, 200);
        if index % 50 != 0 {
            if let Some(first) = data.first_mut() {
                *first &= !4;
            }
        }
        fuzz::journal(&data);
    }
}

#[test]
fn engine_model_inputs() {
    let mut rng = Rng::new(4);
    let runs = if !cfg!(sim_full) { 300 } else { 3_000 };
    for _ in 0..runs {
        let len = rng.range(2, 120) as usize;
        let mut data = rng.bytes(len);
        // Half the runs fail a write early enough to matter.
        if rng.chance(1, 2) {
            data[1] = rng.below(24) as u8;
        }
        fuzz::engine_model(&data);
    }
    // The production scheduling ran: inline writes, background commits.
    let inline = fuzz::ENGINE_MODEL_INLINE_WRITES.load(std::sync::atomic::Ordering::Relaxed);
    let commits = fuzz::ENGINE_MODEL_BACKGROUND_COMMITS.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        inline > 0 && commits > 0,
        "inline writes {inline}, background commits {commits}"
    );
    eprintln!("engine model: inline writes {inline}, background commits {commits}");
    let _ = LayoutKind::Split;
}
