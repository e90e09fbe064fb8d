//! Online migration (issue 33): a region moved while clients read and
//! write the volume, and `--migrate-on-write` (a region moved on its first
//! write). Kept apart from the offline move in `regions.rs`.
//!
//! The order (docs/CRASH_MODEL.md, "Online migration"): every foreground
//! request holds its regions' locks shared while it computes which member
//! serves it and runs there. A move marks its region as moving (under the
//! region's lock, exclusive, for a moment), copies it without the lock
//! while writes go on to the old member, each write marking the 1 MiB
//! chunks it touched once it returned; the marks are taken (cleared)
//! before a chunk is copied again. Then, under the region's lock held
//! exclusive (no request in flight in it), the chunks marked since are
//! copied again, the new member is flushed, the record switched and the
//! home superblock's `regions_seq` written; only then is the lock
//! released and the old member's copy trimmed. A write acknowledged
//! before the switch is in the old member and, because it marked its
//! chunk before it was acknowledged, in the new one when the switch
//! happens; a write after the switch goes to the new member.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use vouch_format::regions::REGION_BLOCKS;
use vouch_format::LayoutKind;

use super::{write_record, MigrateBreaks, MigrateReport, RegionVolume, Steps, CHUNK_BLOCKS};
use crate::device::BlockDevice as _;
use crate::error::{Error, Result};
use crate::BLOCK;

/// No region is moving.
const NONE: usize = usize::MAX;
/// `on_write` when `--migrate-on-write` is off.
const OFF: u8 = u8::MAX;
/// Copies of the marked chunks made without the lock before the last
/// one under it: each is shorter than the one before while writes are
/// fewer than the copy's rate.
const UNLOCKED_PASSES: usize = 3;
/// The pace of a migration while clients' requests arrive (the floor):
/// at most this many bytes a second, or the asked rate when lower. Without
/// requests it runs at the asked rate (the ceiling; unlimited when none).
pub const YIELD_RATE: u64 = 16 << 20;

const _: () = assert!(REGION_BLOCKS.div_ceil(CHUNK_BLOCKS) <= 64);

/// Regions an open volume has locks for at least (256 GiB of 64 MiB
/// regions, 32 KiB of locks): an online grow goes up to the locks it has.
pub(crate) const ONLINE_REGIONS: usize = 4096;

/// Every region lock held exclusive and no move under way: no request
/// is in the region layer (`RegionVolume::hold_all`).
pub(crate) struct HeldAll<'a> {
    _mover: parking_lot::MutexGuard<'a, ()>,
    _switching: parking_lot::MutexGuard<'a, ()>,
    _guards: Vec<parking_lot::RwLockWriteGuard<'a, ()>>,
}

/// The online state of a RegionVolume.
pub(crate) struct Online {
    /// One per region: shared by each foreground request in it, exclusive
    /// while a move marks it moving and while it switches.
    locks: Vec<RwLock<()>>,
    /// The region being moved, or NONE.
    moving: AtomicUsize,
    /// Its chunks written since they were last copied (bit per 1 MiB).
    dirty: AtomicU64,
    /// One move at a time (a background migration and `--migrate-on-write`).
    mover: Mutex<()>,
    /// The layout a region moves to on its first write, as `LayoutKind as u8`.
    on_write: AtomicU8,
    /// Held by a move from before it locks its region for the switch
    /// until the switch is done, and by an online snapshot while both
    /// members are held at its flush point (`pause_switches`): the
    /// snapshot's record is the one in memory, its home superblock's
    /// `regions_seq` the record's, and no switch waits on a member held.
    switching: Mutex<()>,
    /// Foreground requests begun (`hold`): a migration that sees it rise
    /// yields to them (its floor pace, `YIELD_RATE`).
    requests: AtomicU64,
    /// Set when a switch failed writing the record (MED-1): why writes
    /// are refused until a restart reads the record that holds.
    fenced: OnceLock<String>,
}

impl Online {
    pub(crate) fn new(regions: usize) -> Online {
        Online {
            // Room for an online grow (`RegionVolume::resize_online`) up
            // to ONLINE_REGIONS regions without a restart.
            locks: (0..regions.max(ONLINE_REGIONS))
                .map(|_| RwLock::new(()))
                .collect(),
            moving: AtomicUsize::new(NONE),
            dirty: AtomicU64::new(0),
            mover: Mutex::new(()),
            on_write: AtomicU8::new(OFF),
            switching: Mutex::new(()),
            requests: AtomicU64::new(0),
            fenced: OnceLock::new(),
        }
    }
}

/// The region locks a foreground request holds (shared).
pub(crate) struct Held<'a> {
    _guards: Vec<RwLockReadGuard<'a, ()>>,
}

/// Deliberate breaks of the online move, for the crash simulator's
/// self-test (each must be caught).
#[derive(Clone, Copy, Debug, Default)]
pub struct OnlineBreaks {
    /// Never copy again the chunks written during the copy (the writes
    /// that arrive mid-move are left in the old member, then trimmed).
    pub skip_recopy: bool,
    /// A fault, for tests: the record's fsync reports an error after its
    /// bytes were written (EIO from the disk: the page cache may still
    /// write them back, so the record on disk may name either member).
    pub fail_record_sync: bool,
    /// A fault, for tests: the home superblock's `regions_seq` write fails
    /// after the record was written and synced.
    pub fail_regions_seq: bool,
}

/// What an online migration was asked: where to, how fast, when to stop.
pub struct OnlineMigrate<'a> {
    pub target: LayoutKind,
    /// Bytes per second at most (None: as fast as it goes).
    pub rate: Option<u64>,
    /// Set to stop between regions.
    pub stop: &'a AtomicBool,
}

impl RegionVolume {
    /// The regions `[offset, offset + len)` touches.
    fn regions_of(&self, offset: u64, len: u64) -> Range<usize> {
        let region_bytes = REGION_BLOCKS * BLOCK;
        let first = (offset / region_bytes) as usize;
        let last = (offset + len.max(1) - 1) / region_bytes;
        first..(last as usize + 1).min(self.online.locks.len())
    }

    /// Hold the locks of the regions `[offset, offset + len)` touches,
    /// shared, in ascending order (a move takes one lock only).
    pub(crate) fn hold(&self, offset: u64, len: u64) -> Held<'_> {
        self.online.requests.fetch_add(1, Ordering::Relaxed);
        Held {
            _guards: self
                .regions_of(offset, len)
                .map(|region| self.online.locks[region].read())
                .collect(),
        }
    }

    /// Hold the volume still for an online resize: no move (the mover's
    /// lock, then the switches'), then every region's lock exclusive in
    /// ascending order (requests take theirs in that order too).
    pub(crate) fn hold_all(&self) -> HeldAll<'_> {
        let mover = self.online.mover.lock();
        let switching = self.online.switching.lock();
        HeldAll {
            _mover: mover,
            _switching: switching,
            _guards: self.online.locks.iter().map(|lock| lock.write()).collect(),
        }
    }

    /// How many regions the volume has locks for (`ONLINE_REGIONS` at
    /// least): the most an online grow reaches.
    pub(crate) fn regions_held_for(&self) -> usize {
        self.online.locks.len()
    }

    /// Refuse writes from now on, saying why (the first reason stays).
    pub(crate) fn fence(&self, why: String) {
        let _ = self.online.fenced.set(why);
    }

    /// `hold` without waiting: `None` when a move holds one of the locks
    /// exclusive (a call that must not block then declines).
    pub(crate) fn try_hold(&self, offset: u64, len: u64) -> Option<Held<'_>> {
        self.online.requests.fetch_add(1, Ordering::Relaxed);
        let guards = self
            .regions_of(offset, len)
            .map(|region| self.online.locks[region].try_read())
            .collect::<Option<Vec<_>>>()?;
        Some(Held { _guards: guards })
    }

    /// Writes refused after a switch whose record write failed (MED-1 of
    /// the regions review): the record on disk may name either member of
    /// the region, and both hold the same blocks only while nothing is
    /// written; a restart reads the record that holds and serves from it.
    pub(crate) fn check_fence(&self) -> Result<()> {
        match self.online.fenced.get() {
            Some(why) => Err(Error::FailStopped(why.clone())),
            None => Ok(()),
        }
    }

    /// Why writes are refused (`check_fence`), if they are.
    pub fn fenced(&self) -> Option<&str> {
        self.online.fenced.get().map(String::as_str)
    }

    /// Foreground requests begun so far (counted before they wait for
    /// their regions' locks): a test's way to know a request it sent is
    /// past its checks and waiting.
    #[doc(hidden)]
    pub fn foreground_requests(&self) -> u64 {
        self.online.requests.load(Ordering::SeqCst)
    }

    /// A write, trim or zeroing of `[offset, offset + len)` returned (its
    /// locks still held): mark its chunks if its region is moving.
    pub(crate) fn written(&self, offset: u64, len: u64) {
        let moving = self.online.moving.load(Ordering::SeqCst);
        if moving == NONE || !self.regions_of(offset, len).contains(&moving) {
            return;
        }
        let region_start = moving as u64 * REGION_BLOCKS;
        let region_end = region_start + REGION_BLOCKS;
        let first = (offset / BLOCK).max(region_start);
        let end = (offset + len).div_ceil(BLOCK).min(region_end);
        let mut bits = 0u64;
        let mut chunk = (first - region_start) / CHUNK_BLOCKS;
        while region_start + chunk * CHUNK_BLOCKS < end {
            bits |= 1 << chunk;
            chunk += 1;
        }
        self.online.dirty.fetch_or(bits, Ordering::SeqCst);
    }

    /// `--migrate-on-write`: each region moves to `target` on its first
    /// write (None: off).
    pub fn set_migrate_on_write(&self, target: Option<LayoutKind>) {
        let value = target.map_or(OFF, |target| target as u8);
        self.online.on_write.store(value, Ordering::SeqCst);
    }

    /// No region switches members until the guard is dropped (a move
    /// copying goes on; one about to switch waits, without its region's
    /// lock). An online snapshot holds it across its flush point.
    pub fn pause_switches(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.online.switching.lock()
    }

    pub fn migrate_on_write(&self) -> Option<LayoutKind> {
        match self.online.on_write.load(Ordering::SeqCst) {
            0 => Some(LayoutKind::Split),
            1 => Some(LayoutKind::Packed),
            _ => None,
        }
    }

    /// Before a write-like request: with `--migrate-on-write`, move the
    /// regions it touches that are not in the target layout yet. A move
    /// that fails (a corrupt block) leaves the region where it is: the
    /// write goes there, and the failure is logged.
    pub(crate) fn move_for_write(&self, offset: u64, len: u64) {
        let Some(target) = self.migrate_on_write() else {
            return;
        };
        for region in self.regions_of(offset, len) {
            if self.layout_of(region as u64 * REGION_BLOCKS) == target {
                continue;
            }
            let steps = Steps::new(None);
            let moved = self.move_region_online(
                region,
                target,
                &steps,
                OnlineBreaks::default(),
                &mut |_| {},
            );
            if let Err(error) = moved {
                tracing::warn!(region, %error, "--migrate-on-write: the region stays where it is");
            }
        }
    }

    /// Move region `index` to `target` while requests go on (the order in
    /// this module's comment). `progress(bytes)` after each chunk copied
    /// (it may sleep: the pace). Returns false when it was there already.
    pub(crate) fn move_region_online(
        &self,
        index: usize,
        target: LayoutKind,
        steps: &Steps,
        breaks: OnlineBreaks,
        progress: &mut dyn FnMut(u64),
    ) -> Result<bool> {
        let _one = self.online.mover.lock();
        self.check_fence()?;
        let record = self.record();
        let from = record.layouts[index];
        if from == target {
            return Ok(false);
        }
        let lbas = record.lbas(index, self.blocks());
        let (old, new) = (self.member(from), self.member(target));
        let copy_breaks = MigrateBreaks::default();
        {
            let _exclusive = self.online.locks[index].write();
            self.online.dirty.store(0, Ordering::SeqCst);
            self.online.moving.store(index, Ordering::SeqCst);
        }
        let recopy = |dirty: u64| -> Result<()> {
            if breaks.skip_recopy {
                return Ok(());
            }
            for chunk in 0..64u64 {
                if dirty & (1 << chunk) == 0 {
                    continue;
                }
                let start = lbas.start + chunk * CHUNK_BLOCKS;
                let end = (start + CHUNK_BLOCKS).min(lbas.end);
                steps.step();
                new.trim(start * BLOCK, (end - start) * BLOCK, false)?;
                self.copy_range(
                    from,
                    target,
                    start..end,
                    &lbas,
                    &copy_breaks,
                    steps,
                    &mut |_| {},
                )?;
            }
            Ok(())
        };
        let moved = (|| -> Result<()> {
            self.copy_region(from, target, &lbas, &copy_breaks, steps, progress)?;
            for _ in 0..UNLOCKED_PASSES {
                let dirty = self.online.dirty.swap(0, Ordering::SeqCst);
                if dirty == 0 {
                    break;
                }
                recopy(dirty)?;
            }
            // Taken before the region's lock: a move waiting for an online
            // snapshot holds no request back meanwhile.
            let _switching = self.online.switching.lock();
            let _exclusive = self.online.locks[index].write();
            steps.set_locked(true);
            let switched = (|| -> Result<()> {
                recopy(self.online.dirty.swap(0, Ordering::SeqCst))?;
                steps.step();
                new.flush()?;
                let mut next = self.record();
                next.layouts[index] = target;
                next.seq += 1;
                let recorded = write_record(
                    &*self.fs,
                    &self.path,
                    &next,
                    steps,
                    &MigrateBreaks::default(),
                )
                .and_then(|()| {
                    if breaks.fail_record_sync {
                        return Err(injected("sync", &self.path));
                    }
                    Ok(())
                });
                if let Err(error) = recorded {
                    // The bytes may reach the disk yet (a failed fsync
                    // leaves them in the page cache), or not: the record a
                    // restart reads may name either member. Both hold the
                    // region's blocks now (the recopy, the flush, no write
                    // since: the lock is held); writes are refused from
                    // here on so that they stay the same, until a restart
                    // reads the record that holds. Reads go on.
                    let _ = self.online.fenced.set(format!(
                        "writing the region record failed while region {index} switched to the {} layout ({error}); the record on disk may name either member, so writes are refused until the server is restarted (its open serves each region from the member the record names)",
                        target.name()
                    ));
                    tracing::error!(region = index, %error, "the region record's write failed mid-switch: writes refused until a restart");
                    return Err(error);
                }
                // Durable: memory follows the record at once, whatever
                // comes next (a request after the unlock goes to the new
                // member, the one a restart serves the region from).
                *self.record.write() = next.clone();
                steps.step();
                if breaks.fail_regions_seq {
                    return Err(injected("write", &self.path));
                }
                // A failure here is caught up at the next open (the record
                // is newer than `regions_seq`: `around`).
                self.home().set_regions(next.seq)
            })();
            self.online.moving.store(NONE, Ordering::SeqCst);
            steps.set_locked(false);
            switched
        })();
        if let Err(error) = moved {
            let _exclusive = self.online.locks[index].write();
            self.online.moving.store(NONE, Ordering::SeqCst);
            return Err(error);
        }
        // The old member no longer serves the region: no request reaches
        // its copy any more.
        steps.step();
        old.trim(lbas.start * BLOCK, (lbas.end - lbas.start) * BLOCK, false)?;
        steps.step();
        old.flush()?;
        Ok(true)
    }

    /// Move every region not in `how.target` to it while the volume is
    /// served, in LBA order, at most `how.rate` bytes a second, stopping
    /// between regions when `how.stop` is set. `progress(done, total)` in
    /// bytes. The volume stays one with regions (the record and both
    /// members) even when every region is back home: the offline
    /// `vouch migrate` makes it a one-layout volume again.
    pub fn migrate_online(
        &self,
        how: &OnlineMigrate<'_>,
        progress: impl FnMut(u64, u64),
    ) -> Result<MigrateReport> {
        self.migrate_online_driven(how, &Steps::new(None), OnlineBreaks::default(), progress)
    }

    /// `migrate_online` with the crash simulator's steps (a crash point
    /// and a foreground request before each file operation) and breaks.
    pub fn migrate_online_driven(
        &self,
        how: &OnlineMigrate<'_>,
        steps: &Steps,
        breaks: OnlineBreaks,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<MigrateReport> {
        let record = self.record();
        let to_move: Vec<usize> = (0..record.layouts.len())
            .filter(|index| record.layouts[*index] != how.target)
            .collect();
        let total: u64 = to_move
            .iter()
            .map(|index| {
                let lbas = record.lbas(*index, self.blocks());
                (lbas.end - lbas.start) * BLOCK
            })
            .sum();
        let mut done = 0u64;
        let mut moved = 0;
        let mut pace = Pace::new(how.rate, self.online.requests.load(Ordering::Relaxed));
        progress(0, total);
        for index in to_move {
            if how.stop.load(Ordering::SeqCst) {
                return Err(Error::Cancelled(format!(
                    "migration stopped after {moved} regions moved to {}",
                    how.target.name()
                )));
            }
            let region_start = done;
            let mut paced = |bytes: u64| {
                done += bytes;
                progress(done, total);
                let requests = self.online.requests.load(Ordering::Relaxed);
                if let Some(wait) = pace.after(bytes, requests, Instant::now()) {
                    std::thread::sleep(wait);
                }
            };
            if self.move_region_online(index, how.target, steps, breaks, &mut paced)? {
                moved += 1;
            } else {
                // Moved meanwhile by a write (`--migrate-on-write`).
                let lbas = record.lbas(index, self.blocks());
                done = region_start + (lbas.end - lbas.start) * BLOCK;
                progress(done, total);
            }
        }
        Ok(MigrateReport {
            moved,
            already: record.layouts.len() as u64 - moved,
            ..MigrateReport::default()
        })
    }
}

/// A fault injected by a test (`OnlineBreaks`).
fn injected(action: &'static str, path: &std::path::Path) -> Error {
    Error::Path {
        action,
        path: path.join(super::REGIONS_FILE),
        cause: "an injected I/O error (a test)".into(),
    }
}

/// A migration's pace: after each chunk it sleeps so that it runs at most
/// at its ceiling (the asked rate; none: unlimited), and at its floor
/// (`YIELD_RATE`, or the ceiling when lower) after a chunk during which
/// foreground requests arrived: it yields the CPU and the disk to them.
/// No catching up: time the copy spent slower than its pace is not made
/// good later by a burst.
struct Pace {
    ceiling: Option<u64>,
    floor: u64,
    /// When the copy may go on.
    next: Option<Instant>,
    /// `Online::requests` at the last chunk.
    requests: u64,
}

impl Pace {
    fn new(rate: Option<u64>, requests: u64) -> Pace {
        let ceiling = rate.filter(|rate| *rate > 0);
        Pace {
            ceiling,
            floor: ceiling.map_or(YIELD_RATE, |rate| rate.min(YIELD_RATE)),
            next: None,
            requests,
        }
    }

    /// `bytes` copied at `now`, with `requests` begun so far: how long to
    /// wait before the next chunk.
    fn after(&mut self, bytes: u64, requests: u64, now: Instant) -> Option<Duration> {
        let busy = requests != self.requests;
        self.requests = requests;
        let rate = if busy { Some(self.floor) } else { self.ceiling };
        let Some(rate) = rate else {
            self.next = None;
            return None;
        };
        let from = self.next.filter(|next| *next > now).unwrap_or(now);
        let next = from + Duration::from_secs_f64(bytes as f64 / rate as f64);
        self.next = Some(next);
        next.checked_duration_since(now)
            .filter(|wait| !wait.is_zero())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pace_drops_to_its_floor_while_requests_arrive_and_never_catches_up() {
        let mib = 1u64 << 20;
        let now = Instant::now();
        let mut pace = Pace::new(Some(100 * mib), 0);
        // Idle: 1 MiB at 100 MiB/s is 10 ms.
        let wait = pace.after(mib, 0, now).expect("paced");
        assert!((wait.as_secs_f64() - 0.01).abs() < 1e-6, "{wait:?}");
        // Requests arrived: the floor, 16 MiB/s (62.5 ms a MiB).
        let later = now + wait;
        let wait = pace.after(mib, 5, later).expect("paced");
        assert!((wait.as_secs_f64() - 1.0 / 16.0).abs() < 1e-6, "{wait:?}");
        // A long stall is not made good by a burst.
        let much_later = later + Duration::from_secs(10);
        let wait = pace.after(mib, 5, much_later).expect("paced");
        assert!((wait.as_secs_f64() - 0.01).abs() < 1e-6, "{wait:?}");
        // No ceiling: unpaced while idle, the floor while requests arrive.
        let mut pace = Pace::new(None, 0);
        assert_eq!(pace.after(mib, 0, now), None);
        assert!(pace.after(mib, 1, now).is_some());
        // A ceiling under the floor stays the pace either way.
        let mut pace = Pace::new(Some(4 * mib), 0);
        let wait = pace.after(mib, 1, now).expect("paced");
        assert!((wait.as_secs_f64() - 0.25).abs() < 1e-6, "{wait:?}");
    }
}
