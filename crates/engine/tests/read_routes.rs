//! The read pipeline's three routes in the engine (docs/ARCHITECTURE.md,
//! "Routes"): inline (`try_read`), ring (`try_begin_read`) and worker
//! (`read`) execute one plan, so the same read answers the same bytes and
//! holes, and is counted the same, whichever route answers it.

#![allow(clippy::single_range_in_vec_init)] // ranges of LBAs to write

mod common;

use std::sync::mpsc;

use common::{open, volume_dir};
use vouch_engine::{BlockDevice, LayoutKind, StatsSnapshot, Volume, BLOCK};

/// What one read answered and what it added to the volume's counters.
#[derive(PartialEq)]
struct Answer {
    bytes: Vec<u8>,
    holes: Vec<std::ops::Range<u64>>,
    client_bytes_read: u64,
    backing_bytes_read: u64,
}

impl std::fmt::Debug for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sum = self
            .bytes
            .iter()
            .fold(0u64, |sum, &b| sum.rotate_left(5) ^ b as u64);
        f.debug_struct("Answer")
            .field(
                "bytes",
                &format_args!("{} bytes, sum {sum:#x}", self.bytes.len()),
            )
            .field("holes", &self.holes)
            .field("client_bytes_read", &self.client_bytes_read)
            .field("backing_bytes_read", &self.backing_bytes_read)
            .finish()
    }
}

fn answer(
    volume: &Volume,
    before: StatsSnapshot,
    bytes: Vec<u8>,
    holes: Vec<std::ops::Range<u64>>,
) -> Answer {
    let after = volume.stats().snapshot();
    Answer {
        bytes,
        holes,
        client_bytes_read: after.client_bytes_read - before.client_bytes_read,
        backing_bytes_read: after.backing_bytes_read - before.backing_bytes_read,
    }
}

fn worker(volume: &Volume, first: u64, count: u64) -> Answer {
    let before = volume.stats().snapshot();
    let mut bytes = vec![0u8; (count * BLOCK) as usize];
    let holes = volume.read(first * BLOCK, &mut bytes).expect("read");
    answer(volume, before, bytes, holes)
}

fn inline(volume: &Volume, first: u64, count: u64) -> Option<Answer> {
    let before = volume.stats().snapshot();
    let mut bytes = vec![0u8; (count * BLOCK) as usize];
    let holes = volume
        .try_read(first * BLOCK, &mut bytes)
        .expect("try_read")?;
    Some(answer(volume, before, bytes, holes))
}

/// A ring read started and reaped here as the NBD reactor does (poll the
/// volume's read eventfd, then `reap_reads`); `None` if it declined.
fn ring(volume: &Volume, first: u64, count: u64) -> Option<Answer> {
    let events = volume.read_events().expect("io_uring reads");
    let before = volume.stats().snapshot();
    let start = volume.try_begin_read(first * BLOCK, (count * BLOCK) as usize)?;
    let (send, got) = mpsc::channel();
    start(Box::new(move |read| send.send(read).expect("send")));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let read = loop {
        if let Ok(read) = got.try_recv() {
            break read;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the ring read never completed"
        );
        let mut poll = libc::pollfd {
            fd: events,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut poll, 1, 100) };
        let _ = volume.reap_reads();
    };
    // A ring read reads only blocks at home: no holes.
    Some(answer(volume, before, read?, Vec::new()))
}

/// Blocks `[first, first + count)` of a volume of `layout` with blocks
/// 0..64 written, read by every route: the worker's answer (its second:
/// a first read loads the context page (split) or judges the row
/// (packed), which other routes never do, and warms the blocks), the
/// inline route's (which must answer) and the ring's (`None`: declined).
fn read_by_every_route(
    layout: LayoutKind,
    first: u64,
    count: u64,
) -> (Answer, Answer, Option<Answer>) {
    let (_dir, path) = volume_dir(layout, &[0..64]);
    let volume = open(&path);
    worker(&volume, first, count);
    let blocking = worker(&volume, first, count);
    let inline = inline(&volume, first, count).expect("warm blocks answered inline");
    let ring = ring(&volume, first, count);
    volume.close().expect("close");
    (blocking, inline, ring)
}

/// Blocks at home (written, committed) answer the same bytes through
/// every route, each counting the client's bytes and the blocks' bytes
/// read from home once. Before the pipeline was one, a ring read of a
/// packed volume counted its I/O's span (records with their contexts,
/// rounded to the read alignment) as backing bytes read, more than the
/// inline and worker routes count for the same read.
#[test]
fn every_route_answers_and_counts_a_home_read_alike() {
    let count = 4;
    for layout in [LayoutKind::Split, LayoutKind::Packed] {
        let (blocking, inline, ring) = read_by_every_route(layout, 8, count);
        assert_eq!(blocking.client_bytes_read, count * BLOCK, "{layout:?}");
        assert_eq!(blocking.backing_bytes_read, count * BLOCK, "{layout:?}");
        assert!(blocking.holes.is_empty(), "{layout:?}");
        assert_eq!(inline, blocking, "{layout:?}: inline as the worker");
        let ring = ring.expect("a home run read through the ring");
        assert_eq!(ring, blocking, "{layout:?}: ring as the worker");
    }
}

/// Never-written blocks read as zeros alike on every route. Split plans
/// them as holes (no data I/O), inline as on a worker, and the ring (which
/// reads only home runs) declines them; packed reads their records (a
/// row's never-written slots are judged like its written ones), on the
/// ring too.
#[test]
fn never_written_blocks_answer_alike_on_every_route() {
    let count = 4;
    for layout in [LayoutKind::Split, LayoutKind::Packed] {
        let (blocking, inline, ring) = read_by_every_route(layout, 1000, count);
        assert!(blocking.bytes.iter().all(|&b| b == 0), "{layout:?}");
        assert_eq!(inline, blocking, "{layout:?}: inline as the worker");
        match layout {
            LayoutKind::Split => {
                assert_eq!(blocking.holes, vec![0..count * BLOCK]);
                assert_eq!(blocking.backing_bytes_read, 0);
                assert!(ring.is_none(), "no home run to read");
            }
            LayoutKind::Packed => {
                assert!(blocking.holes.is_empty());
                assert_eq!(blocking.backing_bytes_read, count * BLOCK);
                assert_eq!(ring, Some(blocking), "ring as the worker");
            }
        }
    }
}

/// A home block that fails verification: the inline and ring routes
/// decline the read with nothing counted (the plan's failure rule
/// `Decline`), and the worker re-reads it, judges it and names its LBA.
#[test]
fn a_corrupt_home_block_is_declined_inline_and_by_the_ring_and_judged_by_the_worker() {
    for layout in [LayoutKind::Split, LayoutKind::Packed] {
        let (_dir, path) = volume_dir(layout, &[0..64]);
        common::corrupt_data(&path, 9);
        let volume = open(&path);
        // Loads the context page (split) or judges the row (packed).
        worker(&volume, 0, 8);
        let before = volume.stats().snapshot();
        assert!(
            inline(&volume, 8, 4).is_none(),
            "{layout:?}: inline declines"
        );
        assert!(
            ring(&volume, 8, 4).is_none(),
            "{layout:?}: the ring declines"
        );
        assert_eq!(
            volume.stats().snapshot(),
            before,
            "{layout:?}: declining counts nothing"
        );
        let mut bytes = vec![0u8; (4 * BLOCK) as usize];
        match volume.read(8 * BLOCK, &mut bytes) {
            Err(vouch_engine::Error::Fault(fault)) => assert_eq!(fault.lba, 9, "{layout:?}"),
            other => panic!("{layout:?}: the worker names the corrupt block: {other:?}"),
        }
        let faults = |stats: StatsSnapshot| stats.faults.iter().sum::<u64>();
        assert_eq!(
            faults(volume.stats().snapshot()) - faults(before),
            1,
            "{layout:?}: judged once"
        );
        volume.close().expect("close");
    }
}
