//! Who runs the background committer, and where a commit yields.
//!
//! In production a volume's background committer is a thread
//! (`Volume::open`, `Committer::run`): writers request a commit when the
//! write-back buffer reaches its limit, the thread takes it, and while it
//! journals and writes the taken buffer home, writers fill the other
//! buffer and the other held-log slot. A simulator cannot replay a seed
//! over a thread it does not schedule, so a volume opened with a
//! `CommitSchedule` (`OpenOptions::schedule`) has no thread: the caller
//! runs each requested commit itself (`Volume::run_requested_commit`, the
//! thread's own loop body), and every commit, whoever runs it, calls the
//! schedule at its steps (`CommitStep`), where the caller may run the
//! writers that do not wait (the inline routes), crash, or go on. The
//! code is the production committer's; only who decides when it runs and
//! what runs between its steps changes (TigerBeetle's simulator runs its
//! replicas' own code under a seeded scheduler the same way).
//!
//! Cost: the writers' path has no hook at all (a write never calls the
//! schedule; `try_write_shared` and `reserve_room` read the same
//! `is_background` flag as before). A commit tests an `Option` at each of
//! its few steps, a handful of predictable branches per commit of up to
//! 16 MiB, and a ring read's plan one test of a flag that is always false
//! outside the simulator's self-tests (`OrderingBreaks`): nothing a
//! benchmark can see.

use std::fmt;

/// A step of a commit at which it yields to the schedule. At each the
/// committer holds the journal's lock only (not the held log's, not the
/// state's), so a writer that does not wait (`try_write_shared`,
/// `write_sealed_reserved`, the mirror's inline and completion paths) can
/// run, as it would on another thread in production.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitStep {
    /// The write-back buffer and its held-log slot were taken: writers now
    /// fill the other buffer and the other slot.
    Taken,
    /// A group's journal record is durable (ORDER POINT A, `commit.rs`).
    Journaled,
    /// A group's home writes returned (the last group's: the committing
    /// slot is emptied next).
    WrittenHome,
    /// The commit is done and a checkpoint starts.
    Checkpointing,
}

/// Orderings a simulator self-test breaks on purpose, to show that the
/// crash checks catch each one. Every field is false outside those tests
/// (`CommitSchedule::breaks`' default); a volume without a schedule never
/// has any.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OrderingBreaks {
    /// Empty the committing held-log slot as soon as the commit takes it,
    /// before its journal record and home writes: a process crash in
    /// between loses acknowledged writes.
    pub empty_before_home: bool,
    /// `HeldSlots::swap` keeps a slot that sat out a commit at its lower
    /// epoch instead of emptying it again: writers then fill a slot that
    /// replays before the committing one (the epoch bug serve_crash.rs
    /// found).
    pub keep_stale_epoch: bool,
    /// A ring read (`BlockDevice::try_begin_read`) plans a block the
    /// write-back buffer holds as at home, so it answers the older home
    /// value instead of the newest one (the route's rule is that every
    /// block it reads is at home when it is planned).
    pub ring_read_past_buffer: bool,
    /// The reactor's inline read (`BlockDevice::try_read`) plans a block
    /// the write-back buffer holds as at home, so it answers the older
    /// home value from the page cache instead of the buffer's newer one.
    pub inline_read_past_buffer: bool,
}

/// The caller's side of a volume whose commits it steps (module comment).
pub trait CommitSchedule: Send + Sync {
    /// A commit reached `step`; it goes on when this returns.
    fn reached(&self, step: CommitStep);

    /// Orderings to break (self-tests only).
    fn breaks(&self) -> OrderingBreaks {
        OrderingBreaks::default()
    }
}

impl fmt::Debug for dyn CommitSchedule {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("CommitSchedule")
    }
}
