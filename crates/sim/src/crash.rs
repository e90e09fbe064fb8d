//! The crash simulator (`vouch-sim crash`).
//!
//! For each seed: a random workload on a small volume with tiny tuning
//! limits (so commits, checkpoints and cache evictions all happen). The model
//! keeps, per block, every value written to it and a *floor*: the index of
//! the value as of the last completed flush (or FUA write of that block).
//! After a crash a block must read one of `versions[floor..]` in full — the
//! floor value or any later write (the engine may make writes durable before
//! the flush, and the split layout may revert a block to any older write
//! since the floor). An operation in flight has its new values appended
//! before it starts and its floor raised only after it returns.
//!
//! Two kinds of crash (docs/CRASH_MODEL.md, "Two failures"). A *power
//! cut* keeps what was synced plus any subset of the rest (the floor
//! above). A *crash of the process alone* keeps every write that returned
//! and the held log, and must keep every acknowledged write: after it a
//! block reads its last acknowledged value or a later one in flight
//! (`Model::allowed_process`); a power cut during or after that recovery
//! is checked against the power-cut floor.
//!
//! Scheduling as in production (`crate::stepper`): the volume has a
//! background committer, stepped by the seed instead of run on a thread.
//! Writes of whole blocks take the NBD reactor's inline route
//! (`try_write_shared`) half the time, falling back to the worker's
//! (`write_shared`) when it declines; a commit a writer requested runs
//! when the seed says so, between operations; and at every step of every
//! commit (`CommitStep`) inline writes may fill the other write-back
//! buffer and held-log slot while the commit goes on, and a crash may be
//! taken (`steps.rs`). A write run there stays off the blocks of the
//! operation in flight; a flush makes durable what was written before it
//! started (`Model::durable_from`). The reactor's ring reads run too
//! (`reads.rs`): started through `try_begin_read` before operations and
//! completed by the simulated storage at seeded points after them.
//!
//! Crash points: right before every write, punch and sync the engine issues
//! (sampled; a third of them process crashes), at a third of the commit
//! steps (process or power, one time in two each), and after every
//! operation (every flush / FUA point gets one image per strategy and a
//! process crash; other operations a process crash one time in two). Each
//! image is recovered with `Volume::open` (foreground commits), every
//! block is read, `check()` must list exactly the blocks that read as
//! faults, a verify of a random range (`offload.rs`) must report exactly
//! the blocks that failed to read and the proof digest of the bytes read
//! (a scrub too, on a sample), and on a sample of images a second crash is
//! taken *during* recovery (at its I/O) and *after* it (before close).
//! Verify and scrub also run between the workload's operations, where they
//! must report no fault and the digest of the model's bytes.

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use vouch_engine::DeviceWrites;

use bytes::Bytes;
use parking_lot::Mutex;
use vouch_engine::copy::{copy, CopyMethod, CopyOptions};
use vouch_engine::jobs::JobControl;
use vouch_engine::BlockDevice;
use vouch_engine::ZeroFlags;
use vouch_engine::{
    CreateOptions, Error, GuardKind, LayoutKind, OpenOptions, OrderingBreaks, SimStorage, Storage,
    Tuning, Volume,
};

use crate::recorder::{crash_image, Recorder, Strategy, STRATEGIES};
use crate::rng::Rng;
use crate::stepper::Stepper;
use crate::{fingerprint, BLOCK};

mod model;
mod reads;
mod steps;

use model::Model;
use steps::{at_step, crash_now, try_inline, Cut, World};

/// Per block: the fingerprints a post-crash read may return.
pub type Allowed = Vec<Vec<u64>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tearing {
    /// 4 KiB-atomic media: writes tear only at 4 KiB boundaries.
    None,
    /// 512e media: writes tear at 512-byte sectors.
    Sector,
}

impl Tearing {
    pub fn name(self) -> &'static str {
        match self {
            Tearing::None => "none",
            Tearing::Sector => "sector",
        }
    }
    pub fn from_name(name: &str) -> Option<Tearing> {
        match name {
            "none" => Some(Tearing::None),
            "sector" => Some(Tearing::Sector),
            _ => None,
        }
    }
    fn unit(self) -> u64 {
        match self {
            Tearing::None => 4096,
            Tearing::Sector => 512,
        }
    }
}

#[derive(Clone, Debug)]
pub struct CrashConfig {
    pub layout: LayoutKind,
    pub guard: GuardKind,
    pub tearing: Tearing,
    pub seeds: u64,
    pub seed: u64,
    pub threads: usize,
    /// Probability (per mille) of an image at each engine I/O crash point.
    pub io_permille: u64,
    /// Probability (per mille) that an image also gets a crash during its recovery.
    pub nested_permille: u64,
    /// Probability (per mille) that an image also gets a crash after its recovery.
    pub after_permille: u64,
    /// Self-test only: the workload's storage ignores syncs after the
    /// volume is opened, so flushed data is lost in crash images. Every
    /// seed must then report a violation.
    pub sabotage_sync: bool,
    /// Self-test only: the workload's held log is never written, as if
    /// writes were acknowledged before it; process-crash images must then
    /// find acknowledged writes lost.
    pub sabotage_held: bool,
    /// Self-test only: the held log keeps nothing of the writes that take
    /// the inline route (`try_write_shared`), as if that route
    /// acknowledged before its append.
    pub sabotage_inline_held: bool,
    /// Self-test: the landing area is memory the process takes with it
    /// (`Recorder::sabotage_landing`).
    pub sabotage_landing: bool,
    /// Self-test only: orderings the engine breaks on purpose
    /// (`OrderingBreaks`); process-crash images must catch each.
    pub breaks: OrderingBreaks,
    /// Encrypted volumes (AES-256-GCM-SIV; the guard must be crc32c).
    pub encrypted: bool,
}

impl CrashConfig {
    pub fn new(layout: LayoutKind, guard: GuardKind, tearing: Tearing) -> CrashConfig {
        CrashConfig {
            layout,
            guard,
            tearing,
            seeds: 100,
            seed: 1,
            threads: 2,
            io_permille: 350,
            nested_permille: 40,
            after_permille: 40,
            sabotage_sync: false,
            sabotage_held: false,
            sabotage_inline_held: false,
            sabotage_landing: false,
            breaks: OrderingBreaks::default(),
            encrypted: false,
        }
    }

    /// The command that replays one seed.
    pub fn replay_command(&self, seed: u64) -> String {
        format!(
            "cargo run --release -p vouch-sim -- crash --layout {} --guard {} --tearing {} --seed {seed} --seeds 1{}",
            self.layout.name(),
            self.guard.name(),
            self.tearing.name(),
            if self.encrypted { " --encrypted" } else { "" }
        )
    }
}

#[derive(Default, Debug)]
pub struct Counters {
    /// Every post-crash image recovered and checked (all kinds below).
    pub images: AtomicU64,
    /// Images taken by a second crash during recovery.
    pub during_recovery: AtomicU64,
    /// Images taken by a second crash after recovery, before close.
    pub after_recovery: AtomicU64,
    /// Images of a crash of the process alone (kernel state kept).
    pub process: AtomicU64,
    /// Blocks that read as a fault because the media tore them (sector tearing only).
    pub torn_faults: AtomicU64,
    pub ops: AtomicU64,
    /// Writes that took the inline route (`try_write_shared`), and those
    /// it declined (then written on the worker's route, or not at all at
    /// a commit step).
    pub inline_writes: AtomicU64,
    pub inline_declined: AtomicU64,
    /// Writes whose payload was received into the volume's landing area
    /// (`BlockDevice::landing_buffer`, as the NBD reader does for large
    /// ones), so the held log named it instead of copying it.
    pub landed_writes: AtomicU64,
    /// Requested commits the simulator ran as the background committer.
    pub background_commits: AtomicU64,
    /// Steps at which a commit yielded to the simulator (`CommitStep`).
    pub commit_steps: AtomicU64,
    /// Ring reads (`try_begin_read`) the storage completed and the volume
    /// answered, and those it declined (reread on the worker's route).
    pub ring_reads: AtomicU64,
    pub ring_declined: AtomicU64,
    /// Inline reads (`try_read`) the volume answered from memory, and
    /// those it declined (a worker would read them).
    pub inline_reads: AtomicU64,
    pub inline_reads_declined: AtomicU64,
}

#[derive(Debug)]
pub struct CrashReport {
    pub images: u64,
    pub during_recovery: u64,
    pub after_recovery: u64,
    pub process: u64,
    pub torn_faults: u64,
    pub ops: u64,
    pub inline_writes: u64,
    pub landed_writes: u64,
    pub background_commits: u64,
    pub commit_steps: u64,
    pub ring_reads: u64,
    pub ring_declined: u64,
    pub inline_reads: u64,
    pub inline_reads_declined: u64,
    pub seeds: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl CrashReport {
    pub fn summary(&self, config: &CrashConfig) -> String {
        format!(
            "crash: layout={}{} guard={} tearing={} seeds={} ops={} inline-writes={} landed-writes={} background-commits={} commit-steps={} ring-reads={} (declined {}) inline-reads={} (declined {}) images={} (process={} during-recovery={} after-recovery={}) torn-faults={} violations={} time={:.1}s",
            config.layout.name(),
            if config.encrypted { " encrypted" } else { "" },
            config.guard.name(),
            config.tearing.name(),
            self.seeds,
            self.ops,
            self.inline_writes,
            self.landed_writes,
            self.background_commits,
            self.commit_steps,
            self.ring_reads,
            self.ring_declined,
            self.inline_reads,
            self.inline_reads_declined,
            self.images,
            self.process,
            self.during_recovery,
            self.after_recovery,
            self.torn_faults,
            self.violations.len(),
            self.seconds
        )
    }
}

/// Run `config.seeds` seeds from `config.seed` on `config.threads` threads.
pub fn run(config: &CrashConfig) -> CrashReport {
    let started = Instant::now();
    let counters = Arc::new(Counters::default());
    let violations = Mutex::new(Vec::new());
    let threads = config.threads.max(1) as u64;
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let counters = &counters;
            let violations = &violations;
            scope.spawn(move || {
                let mut index = thread;
                while index < config.seeds {
                    let seed = config.seed + index;
                    if let Err(message) = run_seed(config, seed, counters) {
                        violations.lock().push(format!(
                            "VIOLATION seed={seed}: {message}\n  replay: {}",
                            config.replay_command(seed)
                        ));
                    }
                    index += threads;
                }
            });
        }
    });
    let mut violations = violations.into_inner();
    violations.sort();
    CrashReport {
        images: counters.images.load(Ordering::Relaxed),
        during_recovery: counters.during_recovery.load(Ordering::Relaxed),
        after_recovery: counters.after_recovery.load(Ordering::Relaxed),
        process: counters.process.load(Ordering::Relaxed),
        torn_faults: counters.torn_faults.load(Ordering::Relaxed),
        ops: counters.ops.load(Ordering::Relaxed),
        inline_writes: counters.inline_writes.load(Ordering::Relaxed),
        landed_writes: counters.landed_writes.load(Ordering::Relaxed),
        background_commits: counters.background_commits.load(Ordering::Relaxed),
        commit_steps: counters.commit_steps.load(Ordering::Relaxed),
        ring_reads: counters.ring_reads.load(Ordering::Relaxed),
        ring_declined: counters.ring_declined.load(Ordering::Relaxed),
        inline_reads: counters.inline_reads.load(Ordering::Relaxed),
        inline_reads_declined: counters.inline_reads_declined.load(Ordering::Relaxed),
        seeds: config.seeds,
        violations,
        seconds: started.elapsed().as_secs_f64(),
    }
}

/// What a check needs besides the image.
#[derive(Clone)]
struct Checker {
    blocks: u64,
    unit: u64,
    sector_tearing: bool,
    open: OpenOptions,
    nested_permille: u64,
    after_permille: u64,
}

/// The outcome of reading one block after recovery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Read {
    Value(u64),
    Fault,
}

impl Checker {
    /// Recover `image` (a power cut's) and check the contract on every block.
    fn verify(
        &self,
        image: SimStorage,
        allowed: &Arc<Allowed>,
        rng: &mut Rng,
        depth: u32,
        counters: &Arc<Counters>,
    ) -> Result<(), String> {
        self.verify_image(image, (allowed, allowed), rng, depth, counters)
    }

    /// Recover the image of a crash of the process alone (`process_image`):
    /// every block must read what `process` allows (its last acknowledged
    /// value or a later one); a power cut during or after that recovery
    /// may still lose what `power` allows it to.
    fn verify_process(
        &self,
        image: SimStorage,
        (process, power): (&Arc<Allowed>, &Arc<Allowed>),
        rng: &mut Rng,
        depth: u32,
        counters: &Arc<Counters>,
    ) -> Result<(), String> {
        counters.process.fetch_add(1, Ordering::Relaxed);
        self.verify_image(image, (process, power), rng, depth, counters)
    }

    /// Recover `image`; its reads must be in `allowed`, and a second
    /// crash taken during recovery (a power cut) in `crash_allowed`.
    fn verify_image(
        &self,
        image: SimStorage,
        (allowed, crash_allowed): (&Arc<Allowed>, &Arc<Allowed>),
        rng: &mut Rng,
        depth: u32,
        counters: &Arc<Counters>,
    ) -> Result<(), String> {
        counters.images.fetch_add(1, Ordering::Relaxed);
        let recorder = Arc::new(Recorder::new(image));
        let nested: Arc<Mutex<Vec<String>>> = Arc::default();
        if depth == 0 && rng.below(1000) < self.nested_permille {
            // A second power loss at an I/O of the recovery itself.
            let checker = self.clone();
            let allowed = crash_allowed.clone();
            let nested = nested.clone();
            let mut hook_rng = rng.fork();
            let mut taken = 0u32;
            let counters_ptr = counters.clone();
            recorder.set_hook(Some(Box::new(move |sim, order| {
                // At most two crashes per recovery, at random I/Os of it.
                if !nested.lock().is_empty() || taken >= 2 || !hook_rng.chance(1, 6) {
                    return;
                }
                taken += 1;
                let strategy = STRATEGIES[hook_rng.below(4) as usize];
                let image = crash_image(sim, order, strategy, checker.unit, &mut hook_rng);
                counters_ptr.during_recovery.fetch_add(1, Ordering::Relaxed);
                if let Err(error) = checker.verify(image, &allowed, &mut hook_rng, 1, &counters_ptr)
                {
                    nested.lock().push(format!(
                        "second crash during recovery ({strategy:?}): {error}"
                    ));
                }
            })));
        }
        let opened = Volume::open(recorder.clone() as Arc<dyn Storage>, &self.open);
        recorder.set_hook(None);
        if let Some(error) = nested.lock().first() {
            return Err(error.clone());
        }
        let volume = opened.map_err(|error| format!("recovery failed: {error}"))?;
        let reads = self.read_all(&volume, allowed, counters)?;
        let faulty: BTreeSet<u64> = reads
            .iter()
            .enumerate()
            .filter(|(_, read)| **read == Read::Fault)
            .map(|(lba, _)| lba as u64)
            .collect();
        let report = volume
            .check(|_, _| {})
            .map_err(|error| format!("check failed: {error}"))?;
        let listed: BTreeSet<u64> = report.faults.iter().map(|fault| fault.lba).collect();
        if listed != faulty {
            return Err(format!(
                "check() lists faults at {listed:?} but reads failed at {faulty:?}"
            ));
        }
        self.check_offloads(&volume, &reads, rng)?;
        if depth == 0 && rng.below(1000) < self.after_permille {
            // A second power loss after recovery, before the volume is closed:
            // recovery made its result durable, so every block reads the same.
            counters.images.fetch_add(1, Ordering::Relaxed);
            counters.after_recovery.fetch_add(1, Ordering::Relaxed);
            let strategy = STRATEGIES[rng.below(4) as usize];
            let again = crash_image(&recorder.sim, &recorder.order(), strategy, self.unit, rng);
            drop(volume);
            let volume = Volume::open(Arc::new(again) as Arc<dyn Storage>, &self.open)
                .map_err(|error| format!("recovery after recovery failed: {error}"))?;
            let second = self
                .read_all(&volume, allowed, counters)
                .map_err(|error| format!("after a crash after recovery ({strategy:?}): {error}"))?;
            if let Some(lba) = (0..reads.len()).find(|lba| reads[*lba] != second[*lba]) {
                return Err(format!(
                    "crash after recovery ({strategy:?}) changed LBA {lba}: {:?} then {:?}",
                    reads[lba], second[lba]
                ));
            }
        }
        Ok(())
    }

    /// Verify a random range (the whole volume one time in four) and, on a
    /// sample, scrub: they must report exactly the blocks whose reads
    /// failed, and the digest of the bytes the reads returned.
    fn check_offloads(&self, volume: &Volume, reads: &[Read], rng: &mut Rng) -> Result<(), String> {
        let faulty: Vec<u64> = (0..self.blocks)
            .filter(|lba| reads[*lba as usize] == Read::Fault)
            .collect();
        let mut bytes = vec![0u8; self.blocks as usize * BLOCK];
        for (lba, block) in bytes.chunks_exact_mut(BLOCK).enumerate() {
            if reads[lba] != Read::Fault {
                volume
                    .read(lba as u64 * BLOCK as u64, block)
                    .map_err(|error| format!("LBA {lba} unreadable on a second read: {error}"))?;
            }
        }
        let (first, count) = if rng.chance(1, 4) {
            (0, self.blocks)
        } else {
            let first = rng.below(self.blocks);
            (first, rng.range(1, self.blocks - first))
        };
        crate::offload::check_verify(volume, &bytes, &faulty, first, count, rng)
            .map_err(|error| format!("after recovery: {error}"))?;
        if rng.chance(1, 8) {
            crate::offload::check_scrub(volume, &faulty, rng)
                .map_err(|error| format!("after recovery: {error}"))?;
        }
        Ok(())
    }

    fn read_all(
        &self,
        volume: &Volume,
        allowed: &Allowed,
        counters: &Counters,
    ) -> Result<Vec<Read>, String> {
        let mut reads = Vec::with_capacity(self.blocks as usize);
        let mut buf = vec![0u8; BLOCK];
        for lba in 0..self.blocks {
            match volume.read(lba * BLOCK as u64, &mut buf) {
                Ok(_) => {
                    let value = fingerprint(&buf);
                    let ok = &allowed[lba as usize];
                    if !ok.contains(&value) {
                        return Err(format!(
                            "LBA {lba} read wrong data {value:016x}; allowed (floor first): {}",
                            ok.iter()
                                .map(|v| format!("{v:016x}"))
                                .collect::<Vec<_>>()
                                .join(" ")
                        ));
                    }
                    reads.push(Read::Value(value));
                }
                Err(Error::Fault(fault)) if self.sector_tearing && fault.lba == lba => {
                    counters.torn_faults.fetch_add(1, Ordering::Relaxed);
                    reads.push(Read::Fault);
                }
                Err(error) => {
                    return Err(format!("LBA {lba} unreadable after a crash: {error}"));
                }
            }
        }
        Ok(reads)
    }
}

#[derive(Clone, Debug)]
enum Op {
    Write {
        offset: u64,
        len: u64,
        fua: bool,
    },
    Trim {
        offset: u64,
        len: u64,
        fua: bool,
    },
    Zeroes {
        offset: u64,
        len: u64,
        fua: bool,
        allocate: bool,
    },
    /// `copy::copy` within the volume (memmove on overlap).
    Copy {
        from: u64,
        to: u64,
        count: u64,
        method: CopyMethod,
    },
    Flush,
    /// `offload::check_verify` of blocks `[first, first + count)`.
    Verify {
        first: u64,
        count: u64,
    },
    /// `offload::check_scrub`.
    Scrub,
}

fn random_range(rng: &mut Rng, size: u64) -> (u64, u64) {
    let sectors_total = size / 512;
    let (start, len) = if rng.chance(1, 2) {
        // 4 KiB aligned, 1..16 blocks.
        let blocks = size / BLOCK as u64;
        let len = rng.range(1, 16).min(blocks);
        let start = rng.below(blocks - len + 1);
        (start * 8, len * 8)
    } else if rng.chance(1, 3) {
        // Any byte range (an NBD client that negotiated no block size):
        // partial blocks at either end, read-modify-written.
        let len = rng.range(1, 3 * BLOCK as u64).min(size);
        return (rng.below(size - len + 1), len);
    } else {
        let len = rng.range(1, 128).min(sectors_total);
        let start = rng.below(sectors_total - len + 1);
        (start, len)
    };
    (start * 512, len * 512)
}

/// A trim's or zero's range over one whole unit (a packed row, a split
/// context page; the last may be short) of `unit_blocks`, in bytes: the
/// unit whole (punched), or its first piece with the rest queued as the
/// next operation, so two partial ranges leave the unit vacant (as
/// `blkdiscard` in pieces not aligned to units does).
fn unit_range(rng: &mut Rng, blocks: u64, unit_blocks: u64) -> ((u64, u64), Option<(u64, u64)>) {
    let unit = rng.below(blocks.div_ceil(unit_blocks));
    let (start, end) = (unit * unit_blocks, ((unit + 1) * unit_blocks).min(blocks));
    let bytes = |first: u64, last: u64| (first * BLOCK as u64, (last - first) * BLOCK as u64);
    if end - start < 2 || rng.chance(1, 3) {
        return (bytes(start, end), None);
    }
    let cut = rng.range(start + 1, end - 1);
    (bytes(start, cut), Some(bytes(cut, end)))
}

/// A random operation; `reflink`: forced reflink copies are possible
/// (split, plain volumes). A trim or zero covers a whole unit of
/// `unit_blocks` half the time, in one range or two (the second
/// pushed to `queued`, the next operation).
fn random_op(
    rng: &mut Rng,
    size: u64,
    reflink: bool,
    unit_blocks: u64,
    queued: &mut Vec<Op>,
) -> Op {
    let roll = rng.below(100);
    if roll < 12 {
        return Op::Flush;
    }
    if roll < 16 {
        let blocks = size / BLOCK as u64;
        let first = rng.below(blocks);
        let count = rng.range(1, blocks - first);
        return Op::Verify { first, count };
    }
    if roll < 18 {
        return Op::Scrub;
    }
    if roll >= 92 {
        let blocks = size / BLOCK as u64;
        // A quarter of the copies are long enough to span several of the
        // reflink copy's steps (16 pieces of 2-16 blocks), so step k + 1 is
        // verified while step k lands.
        let count = if rng.chance(1, 4) {
            rng.range(24, 96)
        } else {
            rng.range(1, 24)
        }
        .min(blocks);
        let from = rng.below(blocks - count + 1);
        // Half the copies overlap their source (memmove), forwards or back.
        let to = if rng.chance(1, 2) {
            let low = from.saturating_sub(count - 1);
            let high = (from + count - 1).min(blocks - count);
            rng.range(low, high)
        } else {
            rng.below(blocks - count + 1)
        };
        let mut methods = vec![CopyMethod::Auto, CopyMethod::Pipelined];
        if reflink {
            methods.push(CopyMethod::Reflink);
        }
        let method = methods[rng.below(methods.len() as u64) as usize];
        return Op::Copy {
            from,
            to,
            count,
            method,
        };
    }
    let fua = rng.chance(1, 8);
    if roll < 78 {
        let (offset, len) = random_range(rng, size);
        return Op::Write { offset, len, fua };
    }
    let ((offset, len), rest) = if rng.chance(1, 2) {
        unit_range(rng, size / BLOCK as u64, unit_blocks)
    } else {
        (random_range(rng, size), None)
    };
    let op = |(offset, len): (u64, u64), rng: &mut Rng| {
        if roll < 88 {
            Op::Trim { offset, len, fua }
        } else {
            Op::Zeroes {
                offset,
                len,
                fua,
                allocate: rng.chance(1, 2),
            }
        }
    };
    if let Some(rest) = rest {
        let second = op(rest, rng);
        queued.push(second);
    }
    op((offset, len), rng)
}

/// The key of seed `seed`'s encrypted volume.
pub fn seed_key(seed: u64) -> vouch_engine::UserSecret {
    let mut key = [0x5au8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    vouch_engine::UserSecret::key(&key).expect("32 bytes")
}

/// The blocks an operation touches (reads or writes), for `World::busy`.
fn busy_of(op: &Op, blocks: u64) -> Range<u64> {
    let bytes =
        |offset: u64, len: u64| offset / BLOCK as u64..(offset + len).div_ceil(BLOCK as u64);
    match *op {
        Op::Write { offset, len, .. }
        | Op::Trim { offset, len, .. }
        | Op::Zeroes { offset, len, .. } => bytes(offset, len),
        Op::Copy {
            from, to, count, ..
        } => from.min(to)..from.max(to) + count,
        Op::Flush => 0..0,
        Op::Verify { .. } | Op::Scrub => 0..blocks,
    }
}

/// Run one seed; `Err` carries a description of the first violation.
pub fn run_seed(config: &CrashConfig, seed: u64, counters: &Arc<Counters>) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let blocks = rng.range(64, 192);
    let size = blocks * BLOCK as u64;
    let segment_blocks = match config.layout {
        LayoutKind::Split => [16, 64, 256][rng.below(3) as usize],
        LayoutKind::Packed => [31, 62, 124][rng.below(3) as usize],
    };
    let tuning = Tuning {
        dirty_limit_blocks: rng.range(2, 16) as usize,
        context_cache_pages: rng.range(1, 2) as usize,
        overlay_limit: rng.range(4, 48) as usize,
        background_commit: false,
        prompt_commits: true,
    };
    let key = config.encrypted.then(|| seed_key(seed));
    // The workload's volume: its background commits stepped by the seed
    // (`stepper.rs`). Crash images are recovered in the foreground, so a
    // check's own opens run no writer.
    let stepper = Stepper::new(config.breaks);
    let open = OpenOptions {
        key: key.clone(),
        ..stepper.options(tuning)
    };
    let checked_open = OpenOptions {
        tuning,
        key,
        ..OpenOptions::default()
    };
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(size);
    options.layout = config.layout;
    options.guard = config.guard;
    options.encrypt = open.key.clone();
    options.journal_bytes = Some(1 << 20);
    options.segment_blocks = Some(segment_blocks);
    Volume::create(Arc::new(sim.clone()), &options)
        .and_then(Volume::close)
        .map_err(|error| format!("create failed: {error}"))?;
    let checker = Checker {
        blocks,
        unit: config.tearing.unit(),
        sector_tearing: config.tearing == Tearing::Sector,
        open: checked_open.clone(),
        nested_permille: config.nested_permille,
        after_permille: config.after_permille,
    };
    let recorder = Arc::new(Recorder::new(sim));
    let world = Arc::new(Mutex::new(World::new(rng.fork(), Model::new(blocks))));
    {
        let world = world.clone();
        let checker = checker.clone();
        let counters = counters.clone();
        let io_permille = config.io_permille;
        recorder.set_hook(Some(Box::new(move |sim, order| {
            let mut world = world.lock();
            if world.violation.is_some() || world.rng.below(1000) >= io_permille {
                return;
            }
            // A third are the process dying here, before this I/O.
            let cut = if world.rng.chance(1, 3) {
                Cut::Process
            } else {
                Cut::Power
            };
            crash_now(&checker, &mut world, (sim, order), cut, &counters, "inside");
        })));
    }
    if config.sabotage_landing {
        recorder.sabotage_landing.store(true, Ordering::Relaxed);
    }
    let volume = Arc::new(
        Volume::open(recorder.clone() as Arc<dyn Storage>, &open)
            .map_err(|error| format!("open failed: {error}"))?,
    );
    stepper.set(Some(at_step(
        world.clone(),
        Arc::downgrade(&volume),
        (checker.clone(), recorder.clone(), counters.clone()),
        config.sabotage_inline_held,
    )));
    if config.sabotage_sync {
        recorder.sabotage_sync.store(true, Ordering::Relaxed);
    }
    if config.sabotage_held {
        recorder.sabotage_held.store(true, Ordering::Relaxed);
    }
    // The reactor's ring reads, completed at points of their own seed.
    let mut ring = reads::RingReads::new(&recorder.sim, seed);
    let ops = rng.range(30, 90);
    let mut flushed_last = false;
    // A unit: a packed row, a split context page (trims and zeros over
    // them whole take the punch paths).
    let unit_blocks = u64::from(vouch_format::written::unit_blocks(config.layout));
    let mut queued = Vec::new();
    for index in 0..ops {
        ring.maybe_start(&volume, &world);
        ring.maybe_read_inline(&volume, &world)
            .map_err(|error| format!("{error} (before op {index})"))?;
        let reflink = config.layout == LayoutKind::Split && !config.encrypted;
        // A client flushing again with nothing new (a commit with an empty
        // buffer: the held log's slots swap without one being emptied).
        let op = if let Some(op) = queued.pop() {
            op
        } else if flushed_last && rng.chance(1, 3) {
            Op::Flush
        } else {
            random_op(&mut rng, size, reflink, unit_blocks, &mut queued)
        };
        flushed_last = matches!(op, Op::Flush);
        counters.ops.fetch_add(1, Ordering::Relaxed);
        let doing = format!("op {index} {op:?}");
        // The other clients are idle during a third of the operations: no
        // inline writes at the steps of its commits.
        let idle = rng.chance(1, 3);
        world.lock().start(&doing, busy_of(&op, blocks), idle);
        let (touched, result, flushed) = run_op(
            &op,
            (&volume, &recorder),
            &world,
            &mut rng,
            (config, counters),
        )?;
        let violation = world.lock().violation.take();
        if let Some(violation) = violation {
            return Err(violation);
        }
        result.map_err(|error| format!("{doing} failed: {error}"))?;
        let fua = matches!(
            op,
            Op::Write { fua: true, .. } | Op::Trim { fua: true, .. } | Op::Zeroes { fua: true, .. }
        );
        {
            let mut world = world.lock();
            world.wrote(&touched);
            if fua {
                world.model.make_durable(touched.into_iter());
            }
            world.start(&format!("after {doing}"), 0..0, false);
        }
        // The background committer takes the commit a writer requested,
        // when the seed says so: writes run at its steps (`at_step`).
        if rng.chance(1, 2) {
            world.lock().doing = format!("the background commit after {doing}");
            if volume.run_requested_commit() {
                counters.background_commits.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(violation) = world.lock().violation.take() {
                return Err(violation);
            }
            world.lock().doing = format!("after {doing}");
        }
        ring.complete(&recorder.sim, &volume, &world, false)
            .map_err(|error| format!("{error} (after {doing})"))?;
        crash_between_ops(&checker, &world, &recorder, flushed || fua, counters)
            .map_err(|error| format!("{error} (after {doing})"))?;
    }
    ring.complete(&recorder.sim, &volume, &world, true)
        .map_err(|error| format!("{error} (at the end)"))?;
    for (counter, count) in [
        (&counters.ring_reads, ring.answered),
        (&counters.ring_declined, ring.declined),
        (&counters.inline_reads, ring.inline_answered),
        (&counters.inline_reads_declined, ring.inline_declined),
    ] {
        counter.fetch_add(count, Ordering::Relaxed);
    }
    recorder.set_hook(None);
    // Closing takes no more writers at its commit.
    stepper.set(None);
    let volume = Arc::try_unwrap(volume).map_err(|_| "the volume is still shared".to_string())?;
    // A clean close and reopen reads exactly the latest values.
    volume
        .close()
        .map_err(|error| format!("close failed: {error}"))?;
    let volume = Volume::open(recorder.clone() as Arc<dyn Storage>, &checked_open)
        .map_err(|error| format!("reopen failed: {error}"))?;
    let mut buf = vec![0u8; BLOCK];
    let current = std::mem::take(&mut world.lock().model.current);
    for (lba, expected) in current.iter().enumerate() {
        volume
            .read(lba as u64 * BLOCK as u64, &mut buf)
            .map_err(|error| format!("read after clean reopen failed: {error}"))?;
        if buf != *expected {
            return Err(format!(
                "LBA {lba} differs from the model after a clean close"
            ));
        }
    }
    Ok(())
}

/// A write's payload as the NBD reader receives it: with `land`, into the
/// volume's landing area if it has room (as large payloads are: any size
/// here, the simulator's volumes are small), so the held log names it
/// instead of copying it; else into memory of its own.
pub(crate) fn receive(volume: &Volume, bytes: Vec<u8>, land: bool, counters: &Counters) -> Bytes {
    match land.then(|| volume.landing_buffer(bytes.len())).flatten() {
        Some(mut buffer) => {
            buffer.as_mut_slice().copy_from_slice(&bytes);
            counters.landed_writes.fetch_add(1, Ordering::Relaxed);
            buffer.freeze()
        }
        None => Bytes::from(bytes),
    }
}

/// Run one operation of the workload: the blocks it wrote, its outcome,
/// and whether it was a flush (every block durable as of its start).
fn run_op(
    op: &Op,
    (volume, recorder): (&Arc<Volume>, &Arc<Recorder>),
    world: &Arc<Mutex<World>>,
    rng: &mut Rng,
    (config, counters): (&CrashConfig, &Arc<Counters>),
) -> Result<(Vec<usize>, vouch_engine::Result<()>, bool), String> {
    let apply =
        |offset: u64, len: u64, data: Option<&[u8]>| world.lock().model.apply(offset, len, data);
    Ok(match *op {
        Op::Write { offset, len, fua } => {
            let whole = offset % BLOCK as u64 == 0 && len % BLOCK as u64 == 0;
            let bytes = rng.bytes(len as usize);
            let land = whole && rng.chance(1, 2);
            let data = receive(volume, bytes, land, counters);
            let touched = apply(offset, len, Some(&data));
            // Whole blocks without FUA take the NBD reactor's route half
            // the time: inline if that needs no wait, else on a worker.
            let written = if whole && !fua && rng.chance(1, 2) {
                let sabotage = config.sabotage_inline_held;
                match try_inline(volume, offset, &data, recorder, sabotage) {
                    Ok(true) => {
                        counters.inline_writes.fetch_add(1, Ordering::Relaxed);
                        Ok(())
                    }
                    Ok(false) => volume.write_bytes(offset, &data, false),
                    Err(error) => Err(error),
                }
            } else {
                volume.write_bytes(offset, &data, fua)
            };
            (touched, written, false)
        }
        Op::Trim { offset, len, fua } => {
            let touched = apply(offset, len, None);
            (touched, volume.trim(offset, len, fua), false)
        }
        Op::Zeroes {
            offset,
            len,
            fua,
            allocate,
        } => {
            let touched = apply(offset, len, None);
            let flags = ZeroFlags { fua, allocate };
            (touched, volume.write_zeroes(offset, len, flags), false)
        }
        Op::Copy {
            from,
            to,
            count,
            method,
        } => {
            let touched = world.lock().model.copy(from, to, count);
            let options = CopyOptions::with(method);
            let control = JobControl::default();
            let copied = copy(&**volume, from, &**volume, to, count, &options, &control);
            (touched, copied.map(|_| ()), false)
        }
        Op::Flush => {
            // A small flush is answered as soon as its redo record is
            // durable, before its home writes: from the answer on, a
            // crash at any I/O must keep every block's value from when
            // the flush started (writes run at its commit's steps since
            // are not its).
            let mark = world.lock().model.newest();
            let hook_world = Arc::clone(world);
            let outcome = Arc::new(Mutex::new(None));
            let slot = Arc::clone(&outcome);
            volume.flush_then(Box::new(move |flushed| {
                if flushed.is_ok() {
                    let mut world = hook_world.lock();
                    world.model.durable_from(&mark);
                    world.doing = format!("{}, after its answer", world.doing);
                }
                *slot.lock() = Some(flushed);
            }));
            let flushed = outcome
                .lock()
                .take()
                .ok_or_else(|| "a flush returned unanswered".to_string())?;
            (Vec::new(), flushed, true)
        }
        Op::Verify { first, count } => {
            let bytes = world.lock().model.current.concat();
            crate::offload::check_verify(volume, &bytes, &[], first, count, rng)
                .map_err(|error| format!("{op:?}: {error}"))?;
            (Vec::new(), Ok(()), false)
        }
        Op::Scrub => {
            crate::offload::check_scrub(volume, &[], rng)
                .map_err(|error| format!("{op:?}: {error}"))?;
            (Vec::new(), Ok(()), false)
        }
    })
}

/// Crash points between operations: after a flush or FUA point every
/// power-cut strategy and a process crash; otherwise a process crash one
/// time in two and one power cut one time in two.
fn crash_between_ops(
    checker: &Checker,
    world: &Mutex<World>,
    recorder: &Recorder,
    point: bool,
    counters: &Arc<Counters>,
) -> Result<(), String> {
    let mut world = world.lock();
    let world = &mut *world;
    let order = recorder.order();
    if point || world.rng.chance(1, 2) {
        // Every acknowledged write must read back, flushed or not.
        crash_now(
            checker,
            world,
            (&recorder.sim, &order),
            Cut::Process,
            counters,
            "between operations,",
        );
    }
    let strategies: Vec<Strategy> = if point {
        STRATEGIES.to_vec()
    } else if world.rng.chance(1, 2) {
        vec![STRATEGIES[world.rng.below(4) as usize]]
    } else {
        Vec::new()
    };
    let power = world.model.allowed();
    for strategy in strategies {
        let image = crash_image(
            &recorder.sim,
            &order,
            strategy,
            checker.unit,
            &mut world.rng,
        );
        checker
            .verify(image, &power, &mut world.rng, 0, counters)
            .map_err(|error| format!("crash between operations (image {strategy:?}): {error}"))?;
    }
    match world.violation.take() {
        Some(violation) => Err(violation),
        None => Ok(()),
    }
}
