//! The `Mirror` device: a thin composition of the parts that own the
//! mirror's state and the rules over it — its legs (`legs.rs`: membership,
//! judging a leg, the fault threshold, which leg a read goes to), the
//! stripe lock (`stripes.rs`), the written log (`written_log.rs`: the
//! blocks written since the last flush and the activity log) and its job
//! threads (`threads.rs`) — delegating to them, and the `BlockDevice`
//! implementation (reads that repair: `repair.rs`; a resync: `resync.rs`;
//! every write: `admit.rs`).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

use crate::activity::{ActivityLog, Entered};
use crate::legs::{is_request_error, LegStatus, Legs, MirrorLeg, PerLeg};
use crate::progress::ReconcileProgress;
use crate::stripes::Stripes;
use crate::threads::Threads;
use crate::written::Recording;
use crate::written_log::WrittenLog;
use crate::Membership;
use vouch_engine::device::{
    BlockDevice, SealedAdmission, SealedBlock, SealedDevice, Submitted, ZeroFlags,
};
use vouch_engine::error::{Error, Fault, Result};
use vouch_engine::Allocation;
use vouch_engine::BLOCK;

/// A `BlockDevice` over 2 or 3 legs (see the module's documentation).
pub struct Mirror {
    /// The legs and the rules that judge them (`legs.rs`).
    pub(super) legs: Legs,
    /// Shared so a write that completes on another thread can own its
    /// stripes (`try_lock_owned`, `complete.rs`).
    pub(super) stripes: Stripes,
    /// Blocks written since the last flush, and the activity log
    /// (`written_log.rs`).
    pub(super) written: WrittenLog,
    /// Running resyncs' and the reconciliation's threads, and the flag
    /// that stops them.
    pub(super) threads: Threads,
    read_only: bool,
    /// Client requests seen (reads and writes): resync backs off while it moves.
    pub(super) foreground: AtomicU64,
    /// The reconciliation after an unclean stop (`reconcile.rs`).
    pub(super) reconcile: Mutex<Option<ReconcileProgress>>,
    pub(super) reconciling: AtomicBool,
    /// A deliberate break of the write executor, for the crash
    /// simulator's self-test only (`Mirror::break_started_writes`).
    pub(super) unwaited: AtomicBool,
    /// The mirror itself, for the completion path: a write started there
    /// owns the mirror until its last leg answers (`complete.rs`), though
    /// `submit_write` is called on `&self`. Always upgradable while a
    /// caller holds the mirror (`Mirror::new` returns the `Arc`).
    me: std::sync::Weak<Mirror>,
}

/// The activity log, as the mirror uses it (the log itself: `activity.rs`;
/// the mirror's record of it: `written_log.rs`).
impl Mirror {
    /// Keep `log` from now on: every write, trim and zeroing enters it
    /// before any leg is written. Set once (at open, before serving).
    pub fn keep_activity_log(&self, log: Arc<ActivityLog>) -> Result<()> {
        self.written.keep_activity_log(log)
    }

    /// A clean close of the log, once no write is in flight or to come:
    /// flush every leg, then write a log that names only what is still to
    /// reconcile (ORDER: the flush returns before the log forgets an
    /// extent). Nothing to do without a log.
    pub fn close_activity_log(&self) -> Result<()> {
        let Some(log) = self.written.activity_log() else {
            return Ok(());
        };
        vouch_engine::device::BlockDevice::flush(self)?;
        log.close()
    }

    /// Reads go to the first active leg until the extents the log carried
    /// from the last run are reconciled (`begin_reconcile` then does it);
    /// for a set opened before its reconciliation starts.
    pub fn hold_reads_until_reconciled(&self) {
        if self
            .written
            .activity_log()
            .is_some_and(|log| !log.pinned().is_empty())
        {
            self.legs.hold_reads_on_one_leg();
        }
    }

    /// The activity log, if the set keeps one.
    pub fn activity_log(&self) -> Option<&Arc<ActivityLog>> {
        self.written.activity_log()
    }

    /// Enter blocks `[first, end)` in the activity log (the caller holds
    /// their stripes), flushing the mirror if that is what makes room
    /// (`WrittenLog::enter`). `None`: no log.
    pub(super) fn enter_log(&self, first: u64, end: u64) -> Result<Option<Entered>> {
        self.written.enter(first, end, || {
            vouch_engine::device::BlockDevice::flush(self)
        })
    }

    fn enter_log_bytes(&self, offset: u64, length: u64) -> Result<Option<Entered>> {
        self.enter_log(offset / BLOCK, (offset + length).div_ceil(BLOCK))
    }

    /// `enter_log` without I/O or waiting, for the inline paths: `None`
    /// (decline) when an extent is not logged yet; `Some(None)`: no log.
    pub(super) fn try_enter_log(&self, first: u64, end: u64) -> Option<Option<Entered>> {
        self.written.try_enter(first, end)
    }
}

impl Mirror {
    /// A mirror over `legs`; `membership` records state changes (faults).
    /// Every present leg must have the same size, and one must be active.
    pub fn new(
        legs: Vec<MirrorLeg>,
        membership: Option<Box<dyn Membership>>,
    ) -> Result<Arc<Mirror>> {
        let legs = Legs::new(legs, membership)?;
        let read_only = legs
            .iter()
            .filter_map(|leg| leg.device.get())
            .any(|device| device.is_read_only());
        let blocks = legs.size() / BLOCK;
        Ok(Arc::new_cyclic(|me| Mirror {
            legs,
            stripes: Stripes::new(),
            written: WrittenLog::new(blocks),
            threads: Threads::default(),
            read_only,
            foreground: AtomicU64::new(0),
            reconcile: Mutex::new(None),
            reconciling: AtomicBool::new(false),
            unwaited: AtomicBool::new(false),
            me: me.clone(),
        }))
    }

    /// Legs that are active and present, in order.
    pub fn active(&self) -> Vec<usize> {
        self.legs.active()
    }

    pub(super) fn device(&self, leg: usize) -> &dyn SealedDevice {
        self.legs.device(leg)
    }

    pub(super) fn is_write_target(&self, leg: usize) -> bool {
        self.legs.is_write_target(leg)
    }

    /// Mark blocks `[first, end)` in every stale leg's resync map before
    /// a write to them is issued (`Legs::mark`).
    pub(super) fn mark(&self, first: u64, end: u64) -> Result<()> {
        self.legs.mark(first, end)
    }

    /// Whether any leg has a resync map (writes must mark it first).
    pub(super) fn tracks_any_leg(&self) -> bool {
        self.legs.tracks_any_leg()
    }

    /// Take out every active leg that cannot be reached now, as the next
    /// write to it would (`Legs::take_out_unreachable`).
    pub fn take_out_unreachable(&self) {
        self.legs.take_out_unreachable(&self.written);
    }

    /// Each leg's state and counters. A leg is present when its device is
    /// open and reachable (a remote leg's connection is alive); an active
    /// leg that is not is taken out first (`take_out_unreachable`).
    pub fn status(&self) -> Vec<LegStatus> {
        self.take_out_unreachable();
        self.legs.status(self.reconciling.load(Ordering::Acquire))
    }

    /// After an unclean shutdown the legs may hold different (each valid)
    /// contents of blocks that were being written: round-robin reads could
    /// then return the new contents and later the old. Until a scrub makes
    /// the legs agree, every read goes to the first active leg (md reads
    /// one disk while it resyncs after a crash).
    /// The choice is recorded by the membership (a marker beside each
    /// leg's record), so a restart before the scrub keeps it.
    pub fn read_one_leg_until_scrubbed(&self) {
        self.legs.read_one_leg_until_scrubbed();
    }

    /// True while reads go to one leg only (see above).
    pub fn reads_one_leg(&self) -> bool {
        self.legs.reads_one_leg()
    }

    /// A leg's failed read, judged (`Legs::judge_read`): true when it is
    /// the request's error and the read ends.
    pub(super) fn judge_read(&self, leg: usize, error: &Error, first: u64, count: u64) -> bool {
        self.legs
            .judge_read(leg, error, first, count, &self.written)
    }

    /// Count a repair attempt on `leg` (`Legs::count_at`).
    pub(super) fn count_at(
        &self,
        leg: usize,
        kind: &'static str,
        repaired: bool,
        lba: Option<u64>,
    ) {
        self.legs.count_at(leg, kind, repaired, lba, &self.written);
    }

    /// Record a repair on `leg` in its counters by kind, without counting
    /// it against the leg: the legs differed because of what happened to
    /// the whole set (blocks written at an unclean shutdown), not because
    /// this leg got them wrong.
    pub(super) fn note_repair(&self, leg: usize, kind: &'static str, repaired: bool) {
        self.legs[leg].note_repair(kind, repaired);
    }

    /// Fault `leg` (no more I/O), unless it is the last active one.
    pub fn fault(&self, leg: usize, why: &str) {
        self.legs.fault(leg, why, &self.written);
    }

    /// Take `leg` out after `error` (`Legs::fail`).
    pub(super) fn fail(&self, leg: usize, why: &str, error: &Error) {
        self.legs.fail(leg, why, error, &self.written);
    }

    /// The mirror's generation clock: the highest of its active legs'
    /// (each leg's advances with its commits, so a later write of a block
    /// never gets a lower generation than an earlier one).
    pub fn generation_clock(&self) -> u64 {
        self.legs.generation_clock()
    }

    /// The blocks `[offset, offset + data.len())` covers, sealed once by the
    /// first active leg that can seal, with the mirror's generation; a
    /// partial block at either edge is read from a leg first (verified;
    /// the caller holds the stripe lock, so nothing changes it meanwhile).
    /// `None` when no leg can seal.
    pub(super) fn seal_write(&self, offset: u64, data: &Bytes) -> Result<Option<Vec<SealedBlock>>> {
        self.check_bytes(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(Some(Vec::new()));
        }
        let first = offset / BLOCK;
        let end = (offset + data.len() as u64).div_ceil(BLOCK);
        let aligned = offset.is_multiple_of(BLOCK) && (data.len() as u64).is_multiple_of(BLOCK);
        let blocks = if aligned {
            data.clone()
        } else {
            let mut buffer = vec![0u8; ((end - first) * BLOCK) as usize];
            for lba in [first, end - 1] {
                let at = ((lba - first) * BLOCK) as usize;
                self.read_edge(lba, &mut buffer[at..at + BLOCK as usize])?;
            }
            let skip = (offset - first * BLOCK) as usize;
            buffer[skip..skip + data.len()].copy_from_slice(data);
            Bytes::from(buffer)
        };
        let generation = self.generation_clock();
        for leg in self.active() {
            match self.device(leg).seal_blocks(first, &blocks, generation) {
                Ok(sealed) => return Ok(Some(sealed)),
                Err(Error::Unsupported(_)) => continue,
                Err(error) => return Err(error),
            }
        }
        Ok(None)
    }

    /// One block of a partial write, from the first active leg that reads
    /// it good (no repair here: the caller holds the stripe lock).
    fn read_edge(&self, lba: u64, block: &mut [u8]) -> Result<()> {
        let mut last = None;
        for leg in self.active() {
            match self.device(leg).read(lba * BLOCK, block) {
                Ok(_) => return Ok(()),
                Err(error) if is_request_error(&error) => return Err(error),
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| Error::FailStopped("no active mirror leg".into())))
    }

    /// Validate a byte range against the mirror: in bounds. Any byte
    /// offset and length is served (partial blocks: `seal_write`).
    fn check_bytes(&self, offset: u64, length: u64) -> Result<()> {
        let size = self.legs.size();
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(Error::OutOfRange {
                offset,
                length,
                size,
            });
        }
        Ok(())
    }

    /// The whole 512-byte sectors of a trim or zeroing of `[offset,
    /// offset + length)`, after the bytes outside them (less than a sector
    /// at either end, from a client that negotiated no block size) are
    /// written as zeros through the mirror's own read-modify-write
    /// (`write_admitted`: sealed once, the same bytes and generation on
    /// every leg), since legs take trims and zeroes in sectors (a remote
    /// leg's wire does). The caller holds the stripes, the record and the
    /// marks of the whole range. `None` when no whole sector is left.
    fn zero_sector_edges(&self, offset: u64, length: u64, fua: bool) -> Result<Option<Range<u64>>> {
        const SECTOR: u64 = vouch_format::SECTOR_SIZE as u64;
        self.check_bytes(offset, length)?;
        let end = offset + length;
        let sectors = offset.next_multiple_of(SECTOR)..end / SECTOR * SECTOR;
        if sectors.start >= sectors.end {
            let zeros = Bytes::from(vec![0u8; length as usize]);
            return self.write_admitted(offset, &zeros, fua).map(|()| None);
        }
        for edge in [offset..sectors.start, sectors.end..end] {
            if !edge.is_empty() {
                let zeros = Bytes::from(vec![0u8; (edge.end - edge.start) as usize]);
                self.write_admitted(edge.start, &zeros, fua)?;
            }
        }
        Ok(Some(sectors))
    }

    /// Run `op` on every write target, judged (`Legs::each_leg`).
    fn each_leg(&self, what: &str, op: impl Fn(&dyn SealedDevice) -> Result<()>) -> Result<()> {
        self.legs.each_leg(what, &self.written, op)
    }

    /// How a write's legs are judged, the one rule of every route
    /// (`Legs::judge`). Returns the resyncing legs that succeeded.
    pub(super) fn judge(
        &self,
        what: &str,
        outcomes: impl IntoIterator<Item = (usize, bool, Result<()>)>,
    ) -> Result<PerLeg<usize>> {
        self.legs.judge(what, outcomes, &self.written)
    }

    fn record_bytes(&self, offset: u64, length: u64) -> Recording {
        self.written.record_bytes(offset, length)
    }

    fn mark_bytes(&self, offset: u64, length: u64) -> Result<()> {
        self.mark(offset / BLOCK, (offset + length).div_ceil(BLOCK))
    }
}

impl BlockDevice for Mirror {
    fn size(&self) -> u64 {
        self.legs.size()
    }
    fn is_read_only(&self) -> bool {
        self.read_only
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        self.foreground.fetch_add(1, Ordering::Relaxed);
        let leg = self.legs.pick()?;
        // The leg's own read first (the fast path: it stops at a fault,
        // which it judged and counted); a request error ends it, anything
        // else goes to the repair route with the same order of legs, which
        // judges it. The fault it named is not read again on that leg.
        let judged = match self.device(leg).read(offset, buf) {
            Ok(holes) => return Ok(holes),
            Err(error) if is_request_error(&error) => return Err(error),
            Err(Error::Fault(fault)) => Some(fault),
            Err(_) => None,
        };
        self.repair().read_bytes_repairing(leg, offset, buf, judged)
    }
    /// The leg `read` would pick next, without taking its turn unless it
    /// answers: when it declines (cold data, or a block that fails
    /// verification), the blocking `read` goes to that same leg and
    /// repairs what it finds.
    fn try_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<Vec<Range<u64>>>> {
        // Client I/O, inline or not: a resync runs at its floor meanwhile.
        self.foreground.fetch_add(1, Ordering::Relaxed);
        let Some(leg) = self.legs.peek() else {
            return Ok(None);
        };
        match self.device(leg).try_read(offset, buf) {
            Ok(Some(holes)) => {
                self.legs.take_turn();
                Ok(Some(holes))
            }
            Ok(None) => Ok(None),
            Err(error) if is_request_error(&error) => Err(error),
            Err(_) => Ok(None),
        }
    }
    /// Crash ordering: each leg's write keeps the engine's own order
    /// (docs/CRASH_MODEL.md); between legs there is none. Power lost
    /// between leg 0's write and leg 1's leaves leg 0 with the new block and
    /// leg 1 with the old, each valid: the write was not acknowledged, so
    /// either is allowed, and the next open reads one leg until a scrub
    /// makes them agree (`read_one_leg_until_scrubbed`). With `fua` the
    /// write is acknowledged only after every active leg made it durable.
    /// The stripe lock is held across the legs' writes so a repair never
    /// moves a block between legs while they differ mid-write.
    /// A stale leg's resync map marks the blocks first (`mark`).
    ///
    /// The write is sealed once (`seal_write`) and every leg stores the same
    /// bytes and context, with one generation from the mirror's clock: so
    /// legs' generations are comparable and a scrub can tell a lost write
    /// from the newer copy. A remote leg's replica verifies the blocks
    /// before storing them (they crossed the wire); a local leg checks
    /// only each context's place (`SealedAdmission::Here`), since the guard
    /// was computed in this process from the same immutable bytes, as a
    /// single volume's write path does.
    ///
    /// A resyncing leg that took the sealed write holds the blocks as every
    /// active leg does: they *land* in its map (`DirtyMap::landed`, still
    /// under the stripe lock), to be cleared once a flush of that leg
    /// issued after this returned has returned (`resync.rs`).
    ///
    /// Every route of a mirrored write is admitted and run by the same
    /// code (`admit.rs`), differing only in whether it may wait:
    ///
    /// - `MayWait` (the worker's): any bytes, FUA; it waits for what it
    ///   needs and is never declined.
    /// - `MustNotWait` (the NBD reactor's inline path, like a volume's):
    ///   whole blocks only, no FUA, no larger than every write target seals
    ///   cheaply (`inline_seal_max_bytes`: encrypted legs take up to 128
    ///   KiB), when no stripe of the range is held and every target
    ///   reserves room in its write-back buffer (`reserve_room`); then
    ///   sealed once and buffered on every leg into that room
    ///   (`admit::Admission::Reserved`). Declined, with nothing written
    ///   and every reservation given back, when any of that fails first;
    ///   once every leg holds room, no leg can find its buffer full at its
    ///   turn, so none commits on the caller's thread.
    /// - `Callback` (the completion path, only for a mirror with remote
    ///   legs): started, and completed on the thread of the leg that
    ///   answers last (`complete.rs`).
    fn submit_write(
        &self,
        offset: u64,
        data: &Bytes,
        fua: bool,
        admission: vouch_engine::Admission,
    ) -> Result<Submitted> {
        use vouch_engine::Admission;
        match admission {
            Admission::MayWait => {
                self.write_waiting(offset, data, fua)?;
                Ok(Submitted::Done)
            }
            _ if fua => Ok(Submitted::Declined),
            Admission::MustNotWait => Ok(if self.write_reserved(offset, data)? {
                Submitted::Done
            } else {
                Submitted::Declined
            }),
            Admission::Callback => match self.me.upgrade() {
                Some(me) => Ok(me
                    .begin_write(offset, data)?
                    .map_or(Submitted::Declined, Submitted::Started)),
                None => Ok(Submitted::Declined),
            },
        }
    }

    /// The landing area of the first local leg written: it stores the
    /// sealed blocks as they lie in the payload, so its held log names
    /// them instead of copying them (the other legs copy as before).
    fn landing_buffer(&self, len: usize) -> Option<vouch_engine::LandingBuffer> {
        let leg = self
            .legs
            .write_targets()
            .into_iter()
            .find(|&leg| !self.legs[leg].remote)?;
        self.device(leg).landing_buffer(len)
    }

    /// The resync maps' block bits are made durable first (one sync).
    /// On success the blocks written before it started are forgotten by
    /// the record of what a lost leg may lack (`written.rs`).
    /// Its success lets the activity log forget extents whose writes all
    /// returned before it began (`ActivityLog::flush_begins`).
    fn flush(&self) -> Result<()> {
        self.foreground.fetch_add(1, Ordering::Relaxed);
        self.legs.flush(&self.written)
    }
    /// In pieces of at most half the activity log's extents, each entered
    /// in the log before its legs are trimmed (a whole-volume trim would
    /// not fit in it at once).
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.foreground.fetch_add(1, Ordering::Relaxed);
        let _locked = self.stripes.lock_bytes(offset, length);
        let _recorded = self.record_bytes(offset, length);
        self.mark_bytes(offset, length)?;
        self.check_bytes(offset, length)?;
        for piece in self.written.pieces(offset, length) {
            let _logged = self.enter_log_bytes(piece.start, piece.end - piece.start)?;
            let (offset, length) = (piece.start, piece.end - piece.start);
            let Some(sectors) = self.zero_sector_edges(offset, length, fua)? else {
                continue;
            };
            let (offset, length) = (sectors.start, sectors.end - sectors.start);
            self.each_leg("trim", |leg| leg.trim(offset, length, fua))?;
        }
        Ok(())
    }
    /// In pieces, as `trim`.
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()> {
        self.foreground.fetch_add(1, Ordering::Relaxed);
        let _locked = self.stripes.lock_bytes(offset, length);
        let _recorded = self.record_bytes(offset, length);
        self.mark_bytes(offset, length)?;
        self.check_bytes(offset, length)?;
        for piece in self.written.pieces(offset, length) {
            let _logged = self.enter_log_bytes(piece.start, piece.end - piece.start)?;
            let (offset, length) = (piece.start, piece.end - piece.start);
            let Some(sectors) = self.zero_sector_edges(offset, length, flags.fua)? else {
                continue;
            };
            let (offset, length) = (sectors.start, sectors.end - sectors.start);
            self.each_leg("write zeroes", |leg| {
                leg.write_zeroes(offset, length, flags)
            })?;
        }
        Ok(())
    }
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>> {
        self.device(self.legs.pick()?)
            .block_status(offset, length, max_blocks)
    }
    /// Faulty blocks are repaired from another leg; only blocks bad on
    /// every leg are listed (zero-filled).
    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        let leg = self.legs.pick()?;
        self.repair()
            .read_blocks_repairing(leg, first, count, out, None)
    }
    /// The unit covering every present leg's unit at `lba`. The legs of a
    /// set share leg 0's superblock (`set.rs`: one layout and geometry), so
    /// their local units agree; a remote leg cannot tell (one block), and
    /// the cover keeps the local legs' unit. Scans step on this grid
    /// (`jobs::scan`, the mirror's scrub), so each leg's packed row is read
    /// once per scan.
    fn metadata_unit(&self, lba: u64) -> Range<u64> {
        let mut cover = lba..lba + 1;
        for leg in 0..self.legs.len() {
            if let Some(device) = self.legs[leg].device.get() {
                let unit = device.metadata_unit(lba);
                cover = cover.start.min(unit.start)..cover.end.max(unit.end);
            }
        }
        cover
    }
    /// The first LBA at or after `lba` that may hold data on any leg.
    fn next_possible_data(&self, lba: u64) -> Result<u64> {
        let mut next = u64::MAX;
        for leg in self.active() {
            next = next.min(self.device(leg).next_possible_data(lba)?);
        }
        Ok(next.max(lba))
    }
}

/// A mirror's own sealed face: blocks read from the first active leg
/// that has them, stored on every active leg under the mirror's rules.
impl SealedDevice for Mirror {
    /// From the first active leg that answers; a leg that fails is
    /// judged as on every read (`judge_read`).
    fn read_sealed(&self, first: u64, count: u64) -> Result<Vec<SealedBlock>> {
        let Some(&leg) = self.active().first() else {
            return Err(Error::FailStopped("no active mirror leg".into()));
        };
        let mut last = None;
        for leg in self.legs.read_order(leg) {
            match self.device(leg).read_sealed(first, count) {
                Ok(blocks) => return Ok(blocks),
                Err(error) if self.judge_read(leg, &error, first, count) => return Err(error),
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| Error::FailStopped("no active mirror leg".into())))
    }
    /// The waiting admissions only, passed on to every write target
    /// under the mirror's stripes, log, record and marks; the others are
    /// declined (a mirror reserves no room of its own and answers no
    /// sealed write by callback).
    fn submit_sealed(
        &self,
        blocks: &[SealedBlock],
        fua: bool,
        admission: SealedAdmission,
    ) -> Result<Submitted> {
        match admission {
            SealedAdmission::MayWait | SealedAdmission::Here => {}
            SealedAdmission::Reserved => {
                return Err(Error::Unsupported("writes into reserved room".into()))
            }
            SealedAdmission::MustNotWait | SealedAdmission::Callback => {
                return Ok(Submitted::Declined)
            }
        }
        let first = blocks.iter().map(|b| b.lba).min().unwrap_or(0);
        let end = blocks.iter().map(|b| b.lba + 1).max().unwrap_or(0);
        let _locked = self.stripes.lock(first, end);
        let _logged = self.enter_log(first, end)?;
        let _recorded = self.written.record(first, end);
        for block in blocks {
            self.mark(block.lba, block.lba + 1)?;
        }
        self.each_leg("write", |leg| {
            leg.submit_sealed(blocks, fua, admission)
                .and_then(Submitted::wait)
        })?;
        Ok(Submitted::Done)
    }
}
