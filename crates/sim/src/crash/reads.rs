//! The NBD reactor's ring reads in the crash workload
//! (`BlockDevice::try_begin_read`): a read of whole blocks whose contexts
//! are all planned from memory is started as one I/O through the
//! storage's ring, and its blocks are verified when it completes, against
//! the contexts planned at the start; a read that fails that (a block
//! written, committed home or trimmed meanwhile, or a fault) answers
//! `None`, and the reactor reads it again on a worker (`read`).
//!
//! Here the simulated storage takes those reads (`SimStorage::accept_reads`)
//! and completes them when the seed says, between operations, after
//! background commits and the inline writes at their steps have run, so
//! what a read finds at home may be newer than what it planned. Contract:
//! a completed ring read returns, for each block, its value when the read
//! started or one written since (NBD lets a read racing a write see
//! either); a declined one, reread on the worker's route, the block's
//! current value.
//!
//! Beside them, the reactor's inline reads (`BlockDevice::try_read`):
//! answered at once from memory — the write-back buffer, a context that
//! says "zero", or home bytes the simulated page cache holds
//! (`SimStorage::cache_pages`, which answers or declines as a seeded
//! stream says) — or declined (then a worker reads it, which the
//! workload's checks cover). Contract: an answered inline read gives each
//! block its value when the read started or a later one (within one
//! call nothing runs, so in practice the current value).

use std::sync::Arc;

use parking_lot::Mutex;
use vouch_engine::{BlockDevice, SimStorage, Volume};

use super::model::{Mark, Model};
use super::steps::World;
use crate::rng::Rng;
use crate::{fingerprint, BLOCK};

/// One read in flight: its blocks, the model when it started, and its
/// answer once the storage completed it.
struct InFlight {
    first: u64,
    count: u64,
    started: Mark,
    answer: Arc<Mutex<Option<Option<Vec<u8>>>>>,
}

/// The ring and inline reads of one seed's workload, each on an RNG
/// stream of its own (the workload's own draws, and the ring's, stay as
/// they were without inline reads).
pub(super) struct RingReads {
    rng: Rng,
    in_flight: Vec<InFlight>,
    /// Reads the ring answered, and those it declined (reread on a worker).
    pub(super) answered: u64,
    pub(super) declined: u64,
    /// The storage the reads run on (dropped with this: `Drop`).
    sim: SimStorage,
    /// The inline reads' own stream.
    inline_rng: Rng,
    /// Inline reads answered, and those declined.
    pub(super) inline_answered: u64,
    pub(super) inline_declined: u64,
}

impl RingReads {
    /// Ring and inline reads on `sim`, drawn from `seed`.
    pub(super) fn new(sim: &SimStorage, seed: u64) -> RingReads {
        sim.accept_reads();
        sim.cache_pages(seed ^ 0x7061_6765_6361_6368);
        RingReads {
            rng: Rng::new(seed ^ 0x7269_6e67_7265_6164),
            in_flight: Vec::new(),
            answered: 0,
            declined: 0,
            sim: sim.clone(),
            inline_rng: Rng::new(seed ^ 0x696e_6c69_6e65_7264),
            inline_answered: 0,
            inline_declined: 0,
        }
    }

    /// One time in three, an inline read of 1-4 blocks, checked at once
    /// (the world's lock is not held while the volume runs, as in
    /// `maybe_start`). A declined one goes to a worker in the reactor: a
    /// blocking read, which the workload's own reads already cover.
    pub(super) fn maybe_read_inline(
        &mut self,
        volume: &Volume,
        world: &Mutex<World>,
    ) -> Result<(), String> {
        if !self.inline_rng.chance(1, 3) {
            return Ok(());
        }
        let (blocks, started) = {
            let world = world.lock();
            (world.model.blocks(), world.model.newest())
        };
        let first = self.inline_rng.below(blocks);
        let count = self.inline_rng.range(1, 5).min(blocks - first);
        let mut buf = vec![0u8; (count * BLOCK as u64) as usize];
        let answer = volume
            .try_read(first * BLOCK as u64, &mut buf)
            .map_err(|error| format!("LBA {first}: inline read failed: {error}"))?;
        if answer.is_none() {
            self.inline_declined += 1;
            return Ok(());
        }
        self.inline_answered += 1;
        let read = InFlight {
            first,
            count,
            started,
            answer: Arc::default(),
        };
        check_answered("an inline read", &read, &buf, &world.lock().model)
    }

    /// One time in three, start a ring read of 1-4 blocks (the volume
    /// declines one it cannot plan from memory: the reactor then reads on
    /// a worker, which the workload's checks already cover). The world's
    /// lock is not held while the volume runs: its I/O reaches the crash
    /// hook, which takes it.
    pub(super) fn maybe_start(&mut self, volume: &Volume, world: &Mutex<World>) {
        if !self.rng.chance(1, 3) {
            return;
        }
        let (blocks, started) = {
            let world = world.lock();
            (world.model.blocks(), world.model.newest())
        };
        let first = self.rng.below(blocks);
        let count = self.rng.range(1, 5).min(blocks - first);
        let Some(start) =
            volume.try_begin_read(first * BLOCK as u64, (count * BLOCK as u64) as usize)
        else {
            return;
        };
        let answer = Arc::new(Mutex::new(None));
        let slot = Arc::clone(&answer);
        start(Box::new(move |bytes| *slot.lock() = Some(bytes)));
        self.in_flight.push(InFlight {
            first,
            count,
            started,
            answer,
        });
    }

    /// Complete the reads in flight the seed picks (`all`: every one) and
    /// check each answer against the world's model (its lock not held
    /// while the volume runs, as in `maybe_start`).
    pub(super) fn complete(
        &mut self,
        sim: &SimStorage,
        volume: &Volume,
        world: &Mutex<World>,
        all: bool,
    ) -> Result<(), String> {
        let rng = &mut self.rng;
        sim.complete_reads(|| all || rng.chance(1, 2));
        let mut still = Vec::new();
        for read in std::mem::take(&mut self.in_flight) {
            let answer = read.answer.lock().take();
            match answer {
                None => still.push(read),
                Some(Some(bytes)) => {
                    self.answered += 1;
                    check_answered("a ring read", &read, &bytes, &world.lock().model)?;
                }
                Some(None) => {
                    self.declined += 1;
                    let mut buf = vec![0u8; (read.count * BLOCK as u64) as usize];
                    volume
                        .read(read.first * BLOCK as u64, &mut buf)
                        .map_err(|error| {
                            format!(
                                "LBA {}: reread after a declined ring read: {error}",
                                read.first
                            )
                        })?;
                    let world = world.lock();
                    for (index, block) in buf.chunks(BLOCK).enumerate() {
                        let lba = read.first as usize + index;
                        if block != world.model.current[lba] {
                            return Err(format!(
                                "LBA {lba}: reread after a declined ring read differs from the model"
                            ));
                        }
                    }
                }
            }
        }
        self.in_flight = still;
        Ok(())
    }
}

/// The run ended: a seed that stopped early (a violation, a failed
/// operation) leaves ring reads the storage never completed, each holding
/// its volume's engine (its callback does) inside the storage the engine
/// holds. Dropping them frees the engine with the run; after a run that
/// completed every read there is nothing to drop.
impl Drop for RingReads {
    fn drop(&mut self) {
        self.sim.drop_reads();
    }
}

/// Each block of a (ring or inline: `what`) read's answer is its value
/// when the read started or a later one.
fn check_answered(what: &str, read: &InFlight, bytes: &[u8], model: &Model) -> Result<(), String> {
    if bytes.len() as u64 != read.count * BLOCK as u64 {
        return Err(format!(
            "{what} of LBA {}+{} answered {} bytes",
            read.first,
            read.count,
            bytes.len()
        ));
    }
    for (index, block) in bytes.chunks(BLOCK).enumerate() {
        let lba = read.first as usize + index;
        if !model
            .values_since(&read.started, lba)
            .contains(&fingerprint(block))
        {
            return Err(format!(
                "LBA {lba}: {what} answered a value it never held since the read started"
            ));
        }
    }
    Ok(())
}
