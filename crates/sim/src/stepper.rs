//! The simulator's side of a volume whose background commits it steps
//! (`vouch_engine::schedule`): the production committer's code, with its
//! scheduling decided by a seeded RNG instead of a thread. The simulator
//! runs a requested commit when its RNG says so
//! (`Volume::run_requested_commit`), and at every step where a commit
//! yields (`CommitStep`: buffer taken, record durable, home writes done,
//! checkpoint) the closure set here runs: writers that do not wait (the
//! inline routes) fill the other buffer and the other held-log slot, and
//! crashes are taken, as another thread would in production.

use std::sync::Arc;

use parking_lot::Mutex;
use vouch_engine::{CommitSchedule, CommitStep, OpenOptions, OrderingBreaks, Tuning};

/// What runs at a commit's steps.
pub type AtStep = Box<dyn FnMut(CommitStep) + Send>;

/// A `CommitSchedule` that calls a closure at each step.
pub struct Stepper {
    at_step: Mutex<Option<AtStep>>,
    breaks: OrderingBreaks,
}

impl Stepper {
    /// A stepper with nothing to run yet (`set`), breaking `breaks`.
    pub fn new(breaks: OrderingBreaks) -> Arc<Stepper> {
        Arc::new(Stepper {
            at_step: Mutex::new(None),
            breaks,
        })
    }

    /// Run `at_step` at each step from now on (`None`: nothing; set it
    /// before a volume is closed, whose last commit takes no writers).
    pub fn set(&self, at_step: Option<AtStep>) {
        *self.at_step.lock() = at_step;
    }

    /// Open options for a volume stepped by this: `tuning` with the
    /// background committer on, run by the simulator.
    pub fn options(self: &Arc<Self>, mut tuning: Tuning) -> OpenOptions {
        tuning.background_commit = true;
        OpenOptions {
            tuning,
            schedule: Some(Arc::clone(self) as Arc<dyn CommitSchedule>),
            ..OpenOptions::default()
        }
    }
}

impl CommitSchedule for Stepper {
    fn reached(&self, step: CommitStep) {
        // Taken out while it runs: a commit started from inside it (a
        // writer it runs that commits) finds nothing to run, instead of
        // waiting for this lock.
        let Some(mut at_step) = self.at_step.lock().take() else {
            return;
        };
        at_step(step);
        let mut slot = self.at_step.lock();
        if slot.is_none() {
            *slot = Some(at_step);
        }
    }

    fn breaks(&self) -> OrderingBreaks {
        self.breaks
    }
}

/// Open options for a simulated volume (or leg) on the production
/// scheduling with nothing run at its commits' steps: the background
/// committer on and stepped by the simulator (`step_commits`), and a small
/// write-back buffer (2-11 blocks, from `rng`) so writers request commits
/// and the inline routes meet a full buffer.
pub fn stepped_options(rng: &mut crate::rng::Rng) -> OpenOptions {
    Stepper::new(OrderingBreaks::default()).options(stepped_tuning(rng))
}

/// `Tuning::default()` with a write-back buffer of 2-11 blocks.
pub fn stepped_tuning(rng: &mut crate::rng::Rng) -> Tuning {
    Tuning {
        dirty_limit_blocks: rng.range(2, 12) as usize,
        ..Tuning::default()
    }
}

/// Run each volume's requested commit one time in two, as its background
/// committer would have by now. Returns how many ran.
pub fn step_commits<'a>(
    volumes: impl IntoIterator<Item = &'a vouch_engine::Volume>,
    rng: &mut crate::rng::Rng,
) -> u64 {
    volumes
        .into_iter()
        .filter(|volume| rng.chance(1, 2) && volume.run_requested_commit())
        .count() as u64
}

/// A write of whole blocks as the NBD reactor takes it: the inline route
/// (`submit_write` with `MustNotWait`) when `inline` and it needs no
/// wait, else the worker's (`MayWait`). Returns whether the inline route
/// took it.
pub fn write_as_served(
    device: &dyn vouch_engine::BlockDevice,
    offset: u64,
    data: &bytes::Bytes,
    fua: bool,
    inline: bool,
) -> vouch_engine::Result<bool> {
    use vouch_engine::{Admission, DeviceWrites};
    if inline
        && !fua
        && device
            .submit_write(offset, data, false, Admission::MustNotWait)?
            .is_done()
    {
        return Ok(true);
    }
    device.write_bytes(offset, data, fua).map(|()| false)
}
