//! What commits cost a stream of small writes without flushes: the
//! commits, each a journal record and its fsync (a device cache flush),
//! per block written (issue 28's "every nbd.sh workload >= 0.97x of
//! a345690": split 4 KiB random writes at QD32 fell round by round while
//! making ~10x a345690's fsyncs).

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
/// durable: a device whose fsync is slow next to the stream (a busy page
/// cache writing back), as a deep client (QD32) keeps writing meanwhile.
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
        if !volume
            .try_write(lba * BLOCK, &pattern(lba, tag))
            .expect("try_write")
        {
            return false;
        }
        self.last[lba as usize] = tag;
        self.next += 1;
        true
    }
}

/// The schedule of a stepped volume: the test's thread runs each
/// requested commit, and at each journal record `DURING_RECORD` writes
/// arrive, as they would on the reactor while the committer's fsync runs.
struct Stream {
    volume: OnceLock<Weak<Volume>>,
    writer: Arc<Mutex<Writer>>,
    /// Writes arrive during records only while set.
    deep: AtomicBool,
}

impl CommitSchedule for Stream {
    fn reached(&self, step: CommitStep) {
        if step != CommitStep::Journaled || !self.deep.load(Ordering::Relaxed) {
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

/// A deep stream of 4 KiB writes answered inline (the NBD reactor's route,
/// which asks for prompt commits) is committed at the dirty limit (4096
/// blocks), not once per prompt commit: a prompt commit that ends with
/// 256 or more blocks buffered meanwhile turns them off for the next 4
/// background commits, after which a prompt commit measures again. 16,384
/// writes, 300 of them during each journal record: 55 commits with a
/// prompt commit whenever the committer is idle (one per ~300 blocks),
/// <= 12 here. A shallow stream (nothing arriving during a record) keeps
/// its prompt commits, and gets them back right after a flush when it
/// follows a deep one. Every block reads back, after a reopen too.
#[test]
fn a_deep_stream_of_small_writes_commits_at_the_limit_not_per_prompt() {
    const WRITES: u64 = 16_384;
    for layout in LayoutKind::ALL {
        for deep in [true, false] {
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
            let stream = Arc::new(Stream {
                volume: OnceLock::new(),
                writer: writer.clone(),
                deep: AtomicBool::new(true),
            });
            let mut options = OpenOptions::default();
            assert!(options.tuning.prompt_commits);
            let limit = options.tuning.dirty_limit_blocks as u64;
            if deep {
                options.schedule = Some(stream.clone());
            } else {
                options.schedule = Some(Arc::new(Stream {
                    volume: OnceLock::new(),
                    writer: writer.clone(),
                    deep: AtomicBool::new(false),
                }));
            }
            let volume = Arc::new(Volume::open(Arc::new(sim.clone()), &options).expect("open"));
            stream
                .volume
                .set(Arc::downgrade(&volume))
                .expect("set once");
            let before = volume.stats().snapshot().commits;
            loop {
                if writer.lock().expect("writer").next >= WRITES {
                    break;
                }
                let taken = writer.lock().expect("writer").write_inline(&volume);
                let ran = volume.run_requested_commit();
                assert!(
                    taken || ran,
                    "{layout:?}: a write that waits, and no commit"
                );
            }
            let commits = volume.stats().snapshot().commits - before;
            let at_limit = WRITES / limit;
            if deep {
                assert!(
                    commits <= 3 * at_limit,
                    "{layout:?}: {WRITES} writes, {DURING_RECORD} during each record: \
                     {commits} commits (at the dirty limit: {at_limit})"
                );
            } else {
                assert!(
                    commits >= WRITES / 128,
                    "{layout:?}: {WRITES} writes, none during a record: {commits} commits \
                     (prompt commits follow a shallow stream)"
                );
            }
            volume.flush().expect("flush");
            if deep {
                // The stream turns shallow after a flush: its prompt
                // commits are back at once (a flush lets the next prompt
                // commit measure again), not after 4 limit-sized commits.
                stream.deep.store(false, Ordering::Relaxed);
                let before = volume.stats().snapshot().commits;
                for _ in 0..1024 {
                    assert!(writer.lock().expect("writer").write_inline(&volume));
                    volume.run_requested_commit();
                }
                let commits = volume.stats().snapshot().commits - before;
                assert!(
                    commits >= 1024 / 128,
                    "{layout:?}: 1,024 shallow writes after a flush: {commits} commits"
                );
                volume.flush().expect("flush");
            }
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
            drop(stream);
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
