//! What the crash simulator shares between its workload, the I/O hook and
//! the stepped committer (`crate::stepper`), and what runs at a commit's
//! steps: crashes, and the writes that do not wait (`try_write_shared`,
//! the reactor's inline route) filling the other write-back buffer and
//! held-log slot while the commit runs, as they would on another thread.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use bytes::Bytes;
use parking_lot::Mutex;
use vouch_engine::{BlockDevice, CommitStep, SimStorage, Volume};

use super::model::Model;
use super::{receive, Checker, Counters};
use crate::recorder::{crash_image, Recorder, STRATEGIES};
use crate::rng::Rng;
use crate::stepper::AtStep;
use crate::BLOCK;

/// Shared between the workload, the I/O hook and the commit steps.
pub(super) struct World {
    pub(super) rng: Rng,
    pub(super) model: Model,
    /// LBAs the workload's operation in flight touches (reads or writes):
    /// the writes run at commit steps stay off them, since two writes to
    /// one block at once have no order a model could check.
    pub(super) busy: Range<u64>,
    /// Blocks written since the last commit took the write-back buffer,
    /// and those the commit in flight took then (about what it holds).
    pub(super) since_taken: Vec<u64>,
    taken: Vec<u64>,
    /// No inline writes at commit steps now (the other clients are idle).
    idle: bool,
    pub(super) violation: Option<String>,
    pub(super) doing: String,
}

impl World {
    pub(super) fn new(rng: Rng, model: Model) -> World {
        World {
            rng,
            model,
            busy: 0..0,
            since_taken: Vec::new(),
            taken: Vec::new(),
            idle: false,
            violation: None,
            doing: "open".into(),
        }
    }

    /// `blocks` were written (acknowledged).
    pub(super) fn wrote(&mut self, blocks: &[usize]) {
        self.model.make_acked(blocks.iter().copied());
        self.since_taken
            .extend(blocks.iter().map(|&lba| lba as u64));
    }

    /// The workload starts `doing`, touching `busy`; with `idle`, no
    /// inline writes run at the steps of its commits.
    pub(super) fn start(&mut self, doing: &str, busy: Range<u64>, idle: bool) {
        self.doing = doing.to_string();
        self.busy = busy;
        self.idle = idle;
    }
}

/// How a crash cuts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cut {
    /// The process dies; the kernel keeps every write that returned.
    Process,
    /// The power fails; only synced writes (and any subset of the rest).
    Power,
}

/// Take a crash image of `sim` now and check it against the model; the
/// first violation is kept in `world`.
pub(super) fn crash_now(
    checker: &Checker,
    world: &mut World,
    (sim, order): (&SimStorage, &[vouch_engine::ObjectId]),
    cut: Cut,
    counters: &Arc<Counters>,
    at: &str,
) {
    if world.violation.is_some() {
        return;
    }
    let power = world.model.allowed();
    let failed = match cut {
        Cut::Process => {
            let process = world.model.allowed_process();
            let image = sim.duplicate();
            checker
                .verify_process(image, (&process, &power), &mut world.rng, 0, counters)
                .err()
                .map(|error| format!("process crash {at} {}: {error}", world.doing))
        }
        Cut::Power => {
            let strategy = STRATEGIES[world.rng.below(STRATEGIES.len() as u64) as usize];
            let image = crash_image(sim, order, strategy, checker.unit, &mut world.rng);
            checker
                .verify(image, &power, &mut world.rng, 0, counters)
                .err()
                .map(|error| format!("crash {at} {} (image {strategy:?}): {error}", world.doing))
        }
    };
    if let Some(message) = failed {
        world.violation = Some(format!("{message} ({} pending ops)", order.len()));
    }
}

/// What a stepped commit runs at each of its steps: up to three inline
/// writes (`try_write_shared`) into the buffer and slot writers now fill,
/// then, at random, a crash right there (process or power).
/// With `sabotage_inline`, the inline writes' held-log appends keep
/// nothing (self-test: an inline route that acknowledged before it).
pub(super) fn at_step(
    world: Arc<Mutex<World>>,
    volume: Weak<Volume>,
    (checker, recorder, counters): (Checker, Arc<Recorder>, Arc<Counters>),
    sabotage_inline: bool,
) -> AtStep {
    Box::new(move |step: CommitStep| {
        let Some(volume) = volume.upgrade() else {
            return;
        };
        counters.commit_steps.fetch_add(1, Ordering::Relaxed);
        let writes = {
            let mut world = world.lock();
            if world.violation.is_some() {
                return;
            }
            if step == CommitStep::Taken {
                world.taken = std::mem::take(&mut world.since_taken);
            }
            if world.idle {
                0
            } else {
                world.rng.below(4)
            }
        };
        let mut written = false;
        for _ in 0..writes {
            match inline_write(&volume, &world, &recorder, sabotage_inline, &counters) {
                Ok(wrote) => written |= wrote,
                Err(error) => {
                    world.lock().violation.get_or_insert(error);
                    return;
                }
            }
        }
        // A crash here one time in four, one in two after writes filled
        // the other slot (two in three of those a process crash: the held
        // log's two slots are what it then replays).
        let mut world = world.lock();
        let (crash, process) = if written {
            ((1, 2), (2, 3))
        } else {
            ((1, 4), (1, 2))
        };
        if world.rng.chance(crash.0, crash.1) {
            let cut = if world.rng.chance(process.0, process.1) {
                Cut::Process
            } else {
                Cut::Power
            };
            let order = recorder.order();
            let at = format!("at commit step {step:?}, inside");
            crash_now(
                &checker,
                &mut world,
                (&recorder.sim, &order),
                cut,
                &counters,
                &at,
            );
        }
    })
}

/// One write through the inline route (`try_write_shared`: whole blocks,
/// never waiting) of 1-8 blocks off the busy ones: modelled before
/// it starts, acknowledged when it returns true, taken back when it
/// declines (nothing written). Returns whether it wrote.
pub(super) fn inline_write(
    volume: &Volume,
    world: &Mutex<World>,
    recorder: &Recorder,
    sabotage: bool,
    counters: &Counters,
) -> Result<bool, String> {
    let (offset, data, touched, before) = {
        let mut guard = world.lock();
        let world = &mut *guard;
        let blocks = world.model.blocks();
        let count = world.rng.range(1, 8).min(blocks);
        // Half of them rewrite a block the commit running took: the case
        // where the order of the two held-log slots decides which value a
        // crash keeps.
        let first = if !world.taken.is_empty() && world.rng.chance(1, 2) {
            let at = world.rng.below(world.taken.len() as u64) as usize;
            let lba = world.taken[at];
            lba.min(blocks - count)
        } else {
            world.rng.below(blocks - count + 1)
        };
        if world.busy.start < first + count && first < world.busy.end {
            return Ok(false);
        }
        let data = world.rng.bytes(count as usize * BLOCK);
        let before = world.model.current[first as usize..(first + count) as usize].to_vec();
        let offset = first * BLOCK as u64;
        let touched = world.model.apply(offset, count * BLOCK as u64, Some(&data));
        // Half of them received into the landing area, as a large NBD
        // payload is: regions freed by the commit running may be reused
        // here, while its slot still names them until it is emptied.
        let land = world.rng.chance(1, 2);
        (
            offset,
            receive(volume, data, land, counters),
            touched,
            before,
        )
    };
    let written = try_inline(volume, offset, &data, recorder, sabotage);
    let mut world = world.lock();
    match written {
        Ok(true) => {
            counters.inline_writes.fetch_add(1, Ordering::Relaxed);
            world.wrote(&touched);
            Ok(true)
        }
        Ok(false) => {
            counters.inline_declined.fetch_add(1, Ordering::Relaxed);
            world.model.undo(&touched, before);
            Ok(false)
        }
        Err(error) => Err(format!(
            "an inline write at a commit step of {} failed: {error}",
            world.doing
        )),
    }
}

/// The inline route (`submit_write` with `MustNotWait`), its held-log appends keeping nothing with `sabotage`.
pub(super) fn try_inline(
    volume: &Volume,
    offset: u64,
    data: &Bytes,
    recorder: &Recorder,
    sabotage: bool,
) -> vouch_engine::Result<bool> {
    if sabotage {
        recorder.sabotage_held.store(true, Ordering::Relaxed);
    }
    let written = volume
        .submit_write(offset, data, false, vouch_engine::Admission::MustNotWait)
        .map(|submitted| submitted.is_done());
    if sabotage {
        recorder.sabotage_held.store(false, Ordering::Relaxed);
    }
    written
}
