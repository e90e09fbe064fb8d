//! Crash points of a key change (`Volume::change_key`, docs/CRASH_MODEL.md):
//! an encrypted volume with flushed data is opened with key A on the
//! recording storage, and at every write and sync the key change issues,
//! crash images are built with every strategy (nothing since the last
//! sync, everything, random subsets with torn writes, prefixes in issue
//! order). Each image must open with exactly one of A and B — never
//! neither, never both — and read the flushed data. Images of the crash
//! point before the first superblock write must open with A only; once
//! `change_key` has returned, with B only.
//!
//! The volume that changes its key runs the production scheduling
//! (`crate::stepper`): a background committer the seed steps and a small
//! write-back buffer. Before the change it takes writes that are never
//! flushed, through the inline route (`try_write_shared`) where the
//! reactor would take it, so the change meets buffered writes and a
//! requested commit; in every image those blocks read zeros or their new
//! data (a power cut drops the held log).

use std::sync::Arc;
use std::time::Instant;
use vouch_engine::DeviceWrites;

use parking_lot::Mutex;
use vouch_engine::{
    BlockDevice, CreateOptions, Error, LayoutKind, OpenOptions, SimStorage, Storage, UserSecret,
    Volume,
};

use crate::recorder::{crash_image, Recorder, STRATEGIES};
use crate::rng::Rng;
use crate::BLOCK;

/// Blocks written (and flushed) before the key change.
const WRITTEN: u64 = 24;
/// Blocks written after them and never flushed.
const UNFLUSHED: u64 = 8;

/// What a key-change run found.
#[derive(Debug, Default)]
pub struct KeyChangeReport {
    pub seeds: u64,
    /// Crash images checked.
    pub images: u64,
    /// Images that opened with the old key, and with the new one.
    pub old_key: u64,
    pub new_key: u64,
    /// Unflushed writes the inline route took, and requested commits the
    /// simulator ran as the background committer.
    pub inline_writes: u64,
    pub background_commits: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl KeyChangeReport {
    pub fn summary(&self) -> String {
        format!(
            "keychange: seeds={} images={} (old key {} / new key {}) inline writes={} background commits={} violations={} time={:.1}s",
            self.seeds,
            self.images,
            self.old_key,
            self.new_key,
            self.inline_writes,
            self.background_commits,
            self.violations.len(),
            self.seconds
        )
    }
}

fn key(byte: u8, seed: u64) -> UserSecret {
    let mut key = [byte; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    UserSecret::key(&key).expect("32 bytes")
}

/// Open options for checking an image (commits only when the caller
/// does: the check writes nothing).
fn with_key(secret: &UserSecret) -> OpenOptions {
    OpenOptions {
        key: Some(secret.clone()),
        tuning: vouch_engine::Tuning {
            background_commit: false,
            ..vouch_engine::Tuning::default()
        },
        ..OpenOptions::default()
    }
}

fn block(seed: u64, lba: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ (lba << 32) ^ 0x6b65_7963);
    rng.bytes(BLOCK)
}

/// Which keys open `image` (old, new), checking the data of whichever
/// does: the flushed blocks read their data, the unflushed ones zeros or
/// theirs.
fn keys_that_open(
    image: &SimStorage,
    old: &UserSecret,
    new: &UserSecret,
    seed: u64,
) -> Result<(bool, bool), String> {
    let mut opened = [false; 2];
    for (index, secret) in [old, new].into_iter().enumerate() {
        let storage = Arc::new(image.clone()) as Arc<dyn Storage>;
        match Volume::open(storage, &with_key(secret)) {
            Ok(volume) => {
                opened[index] = true;
                for lba in 0..WRITTEN {
                    let mut data = vec![0u8; BLOCK];
                    volume
                        .read(lba * BLOCK as u64, &mut data)
                        .map_err(|error| format!("LBA {lba} unreadable: {error}"))?;
                    if data != block(seed, lba) {
                        return Err(format!("LBA {lba} reads wrong data"));
                    }
                }
                for lba in WRITTEN..WRITTEN + UNFLUSHED {
                    let mut data = vec![0u8; BLOCK];
                    volume
                        .read(lba * BLOCK as u64, &mut data)
                        .map_err(|error| format!("LBA {lba} unreadable: {error}"))?;
                    if data != block(seed, lba) && data.iter().any(|byte| *byte != 0) {
                        return Err(format!(
                            "unflushed LBA {lba} reads neither zeros nor its data"
                        ));
                    }
                }
            }
            Err(Error::Key(_)) => {}
            Err(error) => return Err(format!("open failed: {error}")),
        }
    }
    Ok((opened[0], opened[1]))
}

/// One seed on one layout.
fn run_one(seed: u64, layout: LayoutKind, report: &Mutex<KeyChangeReport>) -> Result<(), String> {
    let (old, new) = (key(0xA1, seed), key(0xB2, seed));
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(256 * BLOCK as u64);
    options.layout = layout;
    options.journal_bytes = Some(1 << 20);
    options.encrypt = Some(old.clone());
    let volume = Volume::create(Arc::new(sim.clone()), &options)
        .map_err(|error| format!("create: {error}"))?;
    for lba in 0..WRITTEN {
        volume
            .write(lba * BLOCK as u64, &block(seed, lba), false)
            .map_err(|error| format!("write: {error}"))?;
    }
    volume.flush().map_err(|error| format!("flush: {error}"))?;
    // Half the seeds change the key of a cleanly closed volume, half of one
    // still open (its superblock marked open, its journal not checkpointed).
    if seed.is_multiple_of(2) {
        volume.close().map_err(|error| format!("close: {error}"))?;
    } else {
        drop(volume);
    }
    let recorder = Arc::new(Recorder::new(sim));
    let mut rng = Rng::new(seed ^ 0x7374_6570);
    let stepped = OpenOptions {
        key: Some(old.clone()),
        ..crate::stepper::stepped_options(&mut rng)
    };
    let volume = Volume::open(recorder.clone() as Arc<dyn Storage>, &stepped)
        .map_err(|error| format!("open with the old key: {error}"))?;
    // Unflushed writes on the production scheduling, as the NBD reactor
    // takes them; the last commit they requested may be left to run.
    let (mut inline_writes, mut background_commits) = (0, 0);
    for lba in WRITTEN..WRITTEN + UNFLUSHED {
        let data = bytes::Bytes::from(block(seed, lba));
        let inline = rng.chance(1, 2);
        if crate::stepper::write_as_served(&volume, lba * BLOCK as u64, &data, false, inline)
            .map_err(|error| format!("write: {error}"))?
        {
            inline_writes += 1;
        }
        background_commits += crate::stepper::step_commits([&volume], &mut rng);
    }
    let failure: Arc<Mutex<Option<String>>> = Arc::default();
    let first_point = Arc::new(Mutex::new(true));
    {
        let (hook_old, hook_new) = (old.clone(), new.clone());
        let failure = failure.clone();
        let rng = Mutex::new(Rng::new(seed));
        let counts: Arc<Mutex<KeyChangeReport>> = Arc::default();
        let hook_counts = counts.clone();
        let first_point = first_point.clone();
        recorder.set_hook(Some(Box::new(move |sim, order| {
            let mut rng = rng.lock();
            let before_any_write = std::mem::replace(&mut *first_point.lock(), false);
            for strategy in STRATEGIES {
                let image = crash_image(sim, order, strategy, 4096, &mut rng);
                let mut counts = hook_counts.lock();
                counts.images += 1;
                let result = keys_that_open(&image, &hook_old, &hook_new, seed);
                let problem = match result {
                    Err(error) => Some(error),
                    Ok((true, true)) => Some("both keys open it".to_string()),
                    Ok((false, false)) => Some("neither key opens it".to_string()),
                    Ok((true, false)) => {
                        counts.old_key += 1;
                        None
                    }
                    Ok((false, true)) if before_any_write => {
                        Some("the new key opens it before the key change wrote".into())
                    }
                    Ok((false, true)) => {
                        counts.new_key += 1;
                        None
                    }
                };
                if let Some(problem) = problem {
                    failure.lock().get_or_insert(format!(
                        "seed {seed} {}: crash image ({strategy:?}) during the key change: {problem}",
                        layout.name()
                    ));
                }
            }
        })));
        volume
            .change_key(&new)
            .map_err(|error| format!("change key: {error}"))?;
        recorder.set_hook(None);
        let counts = counts.lock();
        let mut report = report.lock();
        report.images += counts.images;
        report.old_key += counts.old_key;
        report.new_key += counts.new_key;
        report.inline_writes += inline_writes;
        report.background_commits += background_commits;
    }
    if let Some(failure) = failure.lock().take() {
        return Err(failure);
    }
    // Returned: durable. Even if nothing unsynced survives, only B opens it.
    let image = recorder.sim.crash_image(|_, _, _| 0);
    match keys_that_open(&image, &old, &new, seed)? {
        (false, true) => {}
        other => {
            return Err(format!(
                "seed {seed} {}: after the key change returned, (old, new) open = {other:?}",
                layout.name()
            ))
        }
    }
    volume.close().map_err(|error| format!("close: {error}"))?;
    Ok(())
}

/// Seeds `seed..seed + seeds`, each on both layouts.
pub fn run(seed: u64, seeds: u64) -> KeyChangeReport {
    let started = Instant::now();
    let report = Mutex::new(KeyChangeReport::default());
    let mut violations = Vec::new();
    for seed in seed..seed + seeds {
        for layout in [LayoutKind::Split, LayoutKind::Packed] {
            if let Err(violation) = run_one(seed, layout, &report) {
                violations.push(violation);
            }
        }
    }
    let mut report = report.into_inner();
    report.seeds = seeds;
    report.violations = violations;
    report.seconds = started.elapsed().as_secs_f64();
    report
}
