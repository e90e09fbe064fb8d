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
