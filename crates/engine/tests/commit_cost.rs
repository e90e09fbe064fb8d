//! What commits cost a stream of small writes without flushes: the
//! commits, each a journal record and its fsync (a device cache flush),
//! per block written (issue 28's "every nbd.sh workload >= 0.97x of
//! a345690": 4 KiB random writes at QD32 made 10-30x a345690's commits,
//! ~1.5x its server CPU per `serve --direct` write).
//!
//! The NBD server tells the volume when a client has requests waiting
//! behind its writes (`BlockDevice::writes_queued`); such a deep client
//! gets no prompt commits (`Committer::prompt`) and is committed at the
//! dirty limit, and a client that waits for each reply gets its prompt
//! commits at its next write.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use common::*;
use vouch_engine::schedule::{CommitSchedule, CommitStep};
use vouch_engine::{
    BlockDevice, CreateOptions, LayoutKind, OpenOptions, SimStorage, Volume, BLOCK,
};

const VOLUME_BLOCKS: u64 = 4096;

/// Blocks written inline while a commit's journal record is being made
/// durable, as a deep client (QD32) keeps writing meanwhile.
const DURING_RECORD: u64 = 300;

/// The writer: an LBA and tag per write, the same sequence from the test's
/// loop and from inside a commit (`Stream::reached`).
struct Writer {
    next: u64,
    last: Vec<u8>,
}

impl Writer {
    /// Write the next block inline, if the volume takes it without waiting.
    fn write_inline(&mut self, volume: &Volume) -> bool {
        let lba = self.next * 2_654_435_761 % VOLUME_BLOCKS;
        let tag = (self.next / VOLUME_BLOCKS + 1) as u8;
        if !try_write(volume, lba * BLOCK, &pattern(lba, tag)).expect("try_write") {
            return false;
        }
        self.last[lba as usize] = tag;
        self.next += 1;
        true
    }
}

/// The schedule of a stepped volume: the test's thread runs each
/// requested commit, and at each journal record `DURING_RECORD` writes
/// arrive (while `during` is set), as they would on the reactor while the
/// committer's fsync runs.
struct Stream {
    volume: OnceLock<Weak<Volume>>,
    writer: Arc<Mutex<Writer>>,
    during: AtomicBool,
}

impl CommitSchedule for Stream {
    fn reached(&self, step: CommitStep) {
        if step != CommitStep::Journaled || !self.during.load(Ordering::Relaxed) {
            return;
        }
        let Some(volume) = self.volume.get().and_then(Weak::upgrade) else {
            return;
        };
        let mut writer = self.writer.lock().expect("writer");
        for _ in 0..DURING_RECORD {
            if !writer.write_inline(&volume) {
                break;
            }
        }
    }
}

/// Write until the writer has written `until` blocks, running each
/// commit the volume asks for: the commits that took.
fn stream(volume: &Volume, writer: &Mutex<Writer>, until: u64) -> u64 {
    let before = volume.stats().snapshot().commits;
    while writer.lock().expect("writer").next < until {
        let taken = writer.lock().expect("writer").write_inline(volume);
        let ran = volume.run_requested_commit();
        assert!(taken || ran, "a write that waits, and no commit");
    }
    volume.stats().snapshot().commits - before
}

/// 16,384 4 KiB writes answered inline (the NBD reactor's route, which
/// asks for prompt commits), 300 of them during each journal record. With
/// requests queued behind them (`writes_queued(true)`) they are committed
/// at the dirty limit (4,096 blocks): <= 12 commits, where a prompt commit
/// whenever the committer is idle made 55 (one per ~300 blocks). Without
/// (a client that waits for each reply) they keep their prompt commits
/// (>= 27); with two deep connections of which one turned shallow, the
/// other keeps them off (the volume counts the deep connections),
/// and a deep client that turns shallow gets them back at its next write,
/// with no flush between. Every block reads back, after a reopen too.
#[test]
fn writes_with_requests_queued_behind_commit_at_the_limit_not_per_prompt() {
    const WRITES: u64 = 16_384;
    const SHALLOW_AFTER: u64 = 1024;
    for layout in LayoutKind::ALL {
        for queued in [true, false] {
            let sim = SimStorage::new();
            let mut create = CreateOptions::new(VOLUME_BLOCKS * BLOCK);
            create.layout = layout;
            Volume::create(Arc::new(sim.clone()), &create)
                .and_then(Volume::close)
                .expect("create");
            let writer = Arc::new(Mutex::new(Writer {
                next: 0,
                last: vec![0u8; VOLUME_BLOCKS as usize],
            }));
            let schedule = Arc::new(Stream {
                volume: OnceLock::new(),
                writer: writer.clone(),
                during: AtomicBool::new(true),
            });
            let mut options = OpenOptions::default();
            assert!(options.tuning.prompt_commits);
            let limit = options.tuning.dirty_limit_blocks as u64;
            options.schedule = Some(schedule.clone());
            let volume = Arc::new(Volume::open(Arc::new(sim.clone()), &options).expect("open"));
            schedule
                .volume
                .set(Arc::downgrade(&volume))
                .expect("set once");
            if queued {
                // Two deep connections, one of which turns shallow: the
                // other still has requests queued behind its writes.
                for hint in [true, true, false] {
                    assert!(volume.writes_queued(hint), "{layout:?}: hint taken");
                }
            } else {
                // A `false` with no `true` before it counts nothing.
                assert!(volume.writes_queued(false), "{layout:?}: hint taken");
            }
            let commits = stream(&volume, &writer, WRITES);
            let at_limit = WRITES / limit;
            if queued {
                assert!(
                    commits <= 3 * at_limit,
                    "{layout:?}: {WRITES} writes with requests queued behind, \
                     {DURING_RECORD} during each record: {commits} commits \
                     (at the dirty limit: {at_limit})"
                );
            } else {
                // A prompt commit whenever the committer is idle: one
                // per ~300 blocks (55 when this was written).
                assert!(
                    commits >= WRITES / (2 * DURING_RECORD),
                    "{layout:?}: {WRITES} writes, nothing queued behind: {commits} commits \
                     (prompt commits follow a client that waits for each reply)"
                );
            }
            // The client turns shallow: nothing queued behind its writes,
            // none arriving during a record. Prompt commits at once.
            schedule.during.store(false, Ordering::Relaxed);
            assert!(volume.writes_queued(false), "{layout:?}: hint taken");
            let commits = stream(&volume, &writer, WRITES + SHALLOW_AFTER);
            assert!(
                commits >= SHALLOW_AFTER / 128,
                "{layout:?}: {SHALLOW_AFTER} shallow writes after a deep stream \
                 (queued {queued}), no flush: {commits} commits"
            );
            volume.flush().expect("flush");
            let last = writer.lock().expect("writer").last.clone();
            let check = |volume: &Volume| {
                for lba in 0..VOLUME_BLOCKS {
                    let tag = last[lba as usize];
                    let expected = if tag == 0 {
                        vec![0u8; BLOCK as usize]
                    } else {
                        pattern(lba, tag)
                    };
                    assert_eq!(
                        read_range(volume, lba, 1),
                        expected,
                        "{layout:?}: LBA {lba}"
                    );
                }
            };
            check(&volume);
            drop(schedule);
            Arc::try_unwrap(volume)
                .ok()
                .expect("one owner")
                .close()
                .expect("close");
            let volume = Volume::open(Arc::new(sim), &OpenOptions::default()).expect("reopen");
            check(&volume);
            volume.close().expect("close");
        }
    }
}
