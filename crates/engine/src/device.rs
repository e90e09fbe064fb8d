//! The device traits every layer speaks: `BlockDevice`, the core a
//! `Volume` implements and the NBD adapter, the jobs and the offloads
//! consume, and `SealedDevice`, the sealed-block face of a device that
//! can be a mirror's leg or a replica's target. Layers that stack on a
//! device (fault injection today; mirrors, remote replicas and offloads
//! next) implement them too, wrapping another device, without the engine
//! knowing.
//!
//! **The core (`BlockDevice`, 24 methods).** What a client of a device
//! needs and nothing a leg alone needs: size and read-only; reads (`read`
//! and the reactor's `try_read`, the ring's `try_begin_read`,
//! `read_events`, `reap_reads`, `reads_in_flight`); one write submission
//! (`submit_write`, below) and the `landing_buffer` a payload is received
//! into; `flush` and `flush_then`; `trim`, `write_zeroes`,
//! `block_status`; `stored_contexts` (changed blocks, an export's
//! bitmaps); the scans (`read_blocks_collecting`, `metadata_unit`,
//! `next_possible_data`); the offloads `verify`, `copy` and `compare`,
//! with default implementations in terms of reads and writes, which a
//! device that can do better overrides; and `as_any` for the one fast
//! path on a concrete device (the reflink copy).
//!
//! **One write submission.** Every write of bytes to a device is one call,
//! `submit_write(offset, data: &Bytes, fua, admission)`, of bytes the
//! device may keep without copying them (an NBD WRITE's payload), and
//! `admission` says how the caller may be kept:
//!
//! ```text
//!   caller                 admission     answers                 route in a volume / a mirror
//!   worker, job, test      MayWait       Done | Err              write_shared / admit(MayWait)
//!   NBD reactor, inline    MustNotWait   Done | Declined | Err   try_write_shared / admit(Reserved)
//!   NBD reactor, callback  Callback      Started | Declined |    (declines) / admit(Callback),
//!                                        Done | Err              done on the last leg's thread
//! ```
//!
//! A declined write left nothing locked, written or counted; the caller
//! submits it again on a thread that may wait (the NBD server: reactor
//! inline, then callback, then a worker). A started one (`StartWrite`) is
//! finished through the one completion, `WriteDone`, called once on
//! whichever thread saw it finish; a write done inline allocates no
//! completion. The waiting conveniences (`DeviceWrites::write` of a
//! slice, `write_bytes`) are `MayWait` submissions in an extension trait
//! with a blanket implementation, so no device or layer can implement a
//! second route beside the submission.
//!
//! **The sealed face (`SealedDevice: BlockDevice`, 12 methods).** A
//! mirror's legs are `Arc<dyn SealedDevice>`, and so is what a replica
//! serves: moving a block *together with its context* (`read_sealed`, and
//! one sealed write submission, `submit_sealed`, below: PI travels with
//! the data and is checked at every hop); a repair's re-read that does
//! not judge again (`recheck_blocks`); what a mirror asks of a leg before
//! it admits a write that must not wait (`reserve_room` / `release_room`,
//! `inline_seal_max_bytes`, `answers_by_callback`); sealing for another
//! device (`seal_blocks`, `generation_clock`); and reaching a leg
//! (`reconnect`, `unreachable`).
//!
//! **One sealed submission.** Every sealed write is one call,
//! `submit_sealed(blocks, fua, admission)`, answered like the core's
//! (`Submitted`, the one completion `WriteDone`). The `SealedAdmission`
//! says both how the caller may be kept and how the blocks are checked,
//! since the two go together on every route a sealed write takes:
//!
//! ```text
//!   caller                           admission    answers                 volume          remote leg
//!   repair, resync, replica server   MayWait      Done | Started | Err    write, Full     Started (sent)
//!   replica server's connection task MustNotWait  Done | Declined | Err   try, Full       Declined
//!   mirror's worker route            Here         Done | Started | Err    write, Placement Started (sent)
//!   mirror's inline/completion path  Reserved     Done | Err              reserved room   (no room)
//!   mirror's completion path         Callback     Started | Declined      Declined        Started (by callback)
//! ```
//!
//! A travelling write answers `Started` even to a caller that may wait,
//! its requests already sent, so the mirror writes its local legs while
//! the round trip is under way and waits for it after (through the same
//! completion: `Submitted::wait`). The conveniences (`SealedWrites`:
//! `write_sealed`, `write_sealed_here`, `try_write_sealed`) are
//! submissions in an extension trait with a blanket implementation, as
//! the core's `DeviceWrites` are. Room (`reserve_room`) stays two methods
//! of its own: it is taken on every local leg before any leg is written,
//! so it cannot be part of one leg's submission.
//!
//! None of these is an NBD request, so the export never sees them and a
//! layer over an export (`--inject`) has nothing of them to forward.
//!
//! **Layers forward by default.** A layer (fault injection; like an
//! nbdkit filter) is a `BlockDevice` whose `below` names the device it
//! wraps: every provided method then passes the call on to that device
//! unchanged, fast paths included (inline `try_read`, ring reads,
//! `flush_then`, the landing buffer, the offloads), so a layer overrides
//! only the calls it changes, and a call it does not name keeps the route
//! the device below offers. `submit_write` is required of a layer too
//! (its rules apply to every write) and passes the admission on
//! unchanged, so the device below still chooses the route. A layer over a
//! leg is a `SealedDevice` too, whose `sealed_below` names the same
//! device: the room and the other provided sealed methods then forward
//! the same way, and `submit_sealed`, required like `submit_write`, passes
//! its admission on unchanged. A layer that
//! changes what a call does must override every route that call can take
//! (a layer that fails reads overrides `try_read`, `try_begin_read`,
//! `verify`, `copy` and `compare` as well as `read`). Only a device at
//! the bottom (`below` is `None`: a volume, a mirror over its legs, a
//! remote leg) gets the declining or read-and-write defaults each method
//! describes. The methods without a default stay required of a layer too
//! (three lines for `size`, `is_read_only` and `block_status`; two for
//! `read_sealed` and `submit_sealed`), so a device at the bottom cannot
//! forget one.
//!
//! Why the layer trait is this `below` hook rather than a separate `Layer`
//! trait with a blanket `impl<L: Layer> BlockDevice for L`: that would
//! restate every method twice (the layer's forwarding default, and the
//! blanket impl calling it), twice over now that there are two traits,
//! and a method added to `BlockDevice` but not to `Layer` would silently
//! decline again under every layer. Here each provided method states both
//! behaviours in one place.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

use vouch_format::Context;

use crate::buffer::PageBuffer;
use crate::error::{Error, Fault, Result};
use crate::layout::{Allocation, StoredContext};
use crate::state::{BlockData, BLOCK};

/// Blocks moved per step by the default `verify`, `copy` and `compare` (1 MiB).
pub const OFFLOAD_CHUNK_BLOCKS: u64 = 256;

/// One block as stored: its bytes and the context that protects them.
/// Not verified by the device that read it; the device that writes it
/// verifies it before it stores it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SealedBlock {
    pub lba: u64,
    /// Shared: a mirrored write hands the same bytes to every leg.
    pub data: BlockData,
    pub context: Context,
}

/// A flush's reply, called once (`Engine::flush_then`).
pub type FlushDone = Box<dyn FnOnce(Result<()>) + Send>;

/// How `write_zeroes` zeroes a range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// Durable when the call returns (NBD FUA).
    pub fua: bool,
    /// Record the blocks as written zeroes rather than holes (NBD NO_HOLE).
    /// Either way no data is written.
    pub allocate: bool,
}

/// The one completion of a write: called exactly once with the outcome of
/// a write that completes later (`Submitted::Started`),
/// on whichever thread saw it complete (a replica connection's reader
/// thread, or the caller's).
pub type WriteDone = Box<dyn FnOnce(Result<()>) + Send>;

/// A write `submit_write` made ready under `Admission::Callback` (range
/// locked, blocks sealed): call it with the `WriteDone` that takes the
/// outcome; it starts the write and returns without waiting for it.
pub type StartWrite = Box<dyn FnOnce(WriteDone) + Send>;

/// How a write submitted to `BlockDevice::submit_write` may keep its
/// caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// The caller's thread may block (a worker, a job): never declined;
    /// the answer is `Done` or an `Err`.
    MayWait,
    /// The caller must not wait and wants the outcome now (the NBD
    /// reactor's inline write): `Done`, or `Declined` where the write
    /// would wait (a full write-back buffer, a partial block, FUA,
    /// sealing too dear for the reactor).
    MustNotWait,
    /// The caller must not wait but takes the outcome later through a
    /// completion (the NBD reactor's completion path, a mirror with
    /// remote legs): `Started`, `Done` or `Declined`.
    Callback,
}

/// What `submit_write` did with a write.
#[must_use = "a declined write was not written, a started one needs its completion"]
pub enum Submitted {
    /// Written (durable too, with FUA) on the caller's thread.
    Done,
    /// Not taken, with nothing locked, written or counted: the admission
    /// forbade the wait it would need. Submit it again with a later one.
    Declined,
    /// Locked and prepared: call it with the `WriteDone` that takes the
    /// outcome; it starts the write and returns without waiting.
    Started(StartWrite),
}

impl Submitted {
    /// Whether the write was done on the caller's thread.
    pub fn is_done(&self) -> bool {
        matches!(self, Submitted::Done)
    }

    /// The outcome of a write submitted with an admission that may wait:
    /// `Done`, or `Started` (a sealed write that travels, sent already),
    /// waited for here through the one completion. A decline is an error:
    /// such a write is never declined.
    pub fn wait(self) -> Result<()> {
        match self {
            Submitted::Done => Ok(()),
            Submitted::Started(start) => {
                let (answer, outcome) = std::sync::mpsc::sync_channel(1);
                start(Box::new(move |result| {
                    let _ = answer.send(result);
                }));
                outcome.recv().unwrap_or_else(|_| {
                    Err(Error::FailStopped(
                        "a started write was dropped without its outcome".into(),
                    ))
                })
            }
            Submitted::Declined => Err(Error::Unsupported(
                "a write that may wait was declined (a device must do it)".into(),
            )),
        }
    }
}

/// How a sealed write submitted to `SealedDevice::submit_sealed` may keep
/// its caller, and how the device checks its blocks.
///
/// ```text
///   caller                          admission     check       answers
///   repair, resync, replica server  MayWait       full        Done | Started | Err
///   replica server, inline          MustNotWait   full        Done | Declined | Err
///   mirror, worker (sealed here)    Here          placement   Done | Started | Err
///   mirror, inline / completion     Reserved      placement   Done | Err
///   mirror, completion (remote leg) Callback      full        Started | Declined | Err
/// ```
///
/// `Started` from `MayWait` or `Here`: the write travels and is on its way
/// (a remote replica's requests are sent): the caller may write other legs
/// meanwhile, then call the `StartWrite` (or `Submitted::wait`), which may
/// wait for the answers. From `Callback`: the `StartWrite` sends it and
/// returns at once, and the completion is called later on another thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SealedAdmission {
    /// Blocks that came from another device: each guard recomputed and
    /// checked; the caller's thread may block. Never declined.
    MayWait,
    /// As `MayWait`, but the caller must not wait (a replica server's
    /// connection task): `Declined` where the write would (FUA, a full
    /// write-back buffer, a volume being replaced). Never started.
    MustNotWait,
    /// Blocks this process sealed (`seal_blocks`) from bytes that never
    /// left it: a mirror's write to its legs. No hop lies between the seal
    /// and the store (as none does on a single volume's write path), so a
    /// device may skip recomputing each guard and check only that each
    /// context belongs at its LBA here (`SealCheck::Placement`); one that
    /// cannot tell verifies in full. May wait; never declined.
    Here,
    /// `Here`, into room `reserve_room(blocks.len())` reserved, without
    /// waiting and without FUA: the reservation is used up whatever the
    /// outcome. Only for data blocks (a zero-reading one is refused). A
    /// device that reserves no room refuses it (`Unsupported`).
    Reserved,
    /// The caller must not wait and takes the outcome later through the
    /// completion (a mirror's completion path): `Started` by a device
    /// that `answers_by_callback`, within its request timeout; every other
    /// device declines.
    Callback,
}

/// The sealed writes every `SealedDevice` offers its callers (repair,
/// resync, the replica server, tools, tests): `submit_sealed` with the
/// admission each names, without FUA. A blanket implementation, so no
/// device has a second sealed route to get wrong.
pub trait SealedWrites {
    /// Store blocks moved with their contexts, each verified in full
    /// first (`SealedAdmission::MayWait`): a block that does not verify
    /// fails the call naming it, and none of the blocks is stored.
    fn write_sealed(&self, blocks: &[SealedBlock]) -> Result<()>;
    /// `write_sealed` of blocks sealed in this process
    /// (`SealedAdmission::Here`: each context's place checked).
    fn write_sealed_here(&self, blocks: &[SealedBlock]) -> Result<()>;
    /// `write_sealed` only if it completes without waiting
    /// (`SealedAdmission::MustNotWait`): `Ok(false)`, with nothing stored,
    /// where it would wait.
    fn try_write_sealed(&self, blocks: &[SealedBlock]) -> Result<bool>;
}

impl<D: SealedDevice + ?Sized> SealedWrites for D {
    fn write_sealed(&self, blocks: &[SealedBlock]) -> Result<()> {
        self.submit_sealed(blocks, false, SealedAdmission::MayWait)?
            .wait()
    }
    fn write_sealed_here(&self, blocks: &[SealedBlock]) -> Result<()> {
        self.submit_sealed(blocks, false, SealedAdmission::Here)?
            .wait()
    }
    fn try_write_sealed(&self, blocks: &[SealedBlock]) -> Result<bool> {
        match self.submit_sealed(blocks, false, SealedAdmission::MustNotWait)? {
            Submitted::Done => Ok(true),
            Submitted::Declined => Ok(false),
            Submitted::Started(_) => Err(Error::Unsupported(
                "a sealed write that must not wait was started (a device must answer it now)"
                    .into(),
            )),
        }
    }
}

impl std::fmt::Debug for Submitted {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            Submitted::Done => "Done",
            Submitted::Declined => "Declined",
            Submitted::Started(_) => "Started",
        })
    }
}

/// The waiting writes every `BlockDevice` offers its callers (jobs, tools,
/// tests): `submit_write` with `Admission::MayWait`. A blanket
/// implementation, so no device has a second write route to get wrong.
pub trait DeviceWrites {
    /// Write a copy of `data` at `offset` (see `BlockDevice::submit_write`).
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()>;
    /// Write `data` at `offset`, keeping the bytes without a copy.
    fn write_bytes(&self, offset: u64, data: &Bytes, fua: bool) -> Result<()>;
}

impl<D: BlockDevice + ?Sized> DeviceWrites for D {
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.write_bytes(offset, &Bytes::copy_from_slice(data), fua)
    }
    fn write_bytes(&self, offset: u64, data: &Bytes, fua: bool) -> Result<()> {
        match self.submit_write(offset, data, fua, Admission::MayWait)? {
            Submitted::Done => Ok(()),
            other => Err(Error::Unsupported(format!(
                "a write that may wait answered {other:?} (a device must do it)"
            ))),
        }
    }
}

/// Called exactly once with the outcome of a read started by
/// `try_begin_read`: the bytes, every block verified, or `None` when it
/// could not be finished that way (a block failed verification or was
/// written meanwhile, the device failed, the ring was full): then read it
/// with `read`, which rereads, judges and reports.
pub type ReadDone = Box<dyn FnOnce(Option<Vec<u8>>) + Send>;

/// A read that `try_begin_read` planned: call it with the `ReadDone` that
/// takes the outcome; it submits the read and returns without waiting.
pub type StartRead = Box<dyn FnOnce(ReadDone) + Send>;

pub trait BlockDevice: Send + Sync {
    /// The device this one is a layer over, which every provided method
    /// passes its call on to; `None` (the default) for a device at the
    /// bottom of a stack.
    fn below(&self) -> Option<&Arc<dyn BlockDevice>> {
        None
    }

    /// Size in bytes.
    fn size(&self) -> u64;

    fn is_read_only(&self) -> bool;

    /// Read `buf.len()` bytes at `offset` (any byte range), every block
    /// it touches verified; a fault fails the read naming its LBA. Returns the byte
    /// ranges of `buf` known to be zero without data I/O (holes).
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>>;

    /// `read` only if it can complete without waiting for a device (every
    /// block in memory or the page cache): `Ok(None)` when it would block,
    /// with nothing counted or logged; then call `read`. The NBD server
    /// calls it on its async reactor. The default always would block.
    fn try_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<Vec<Range<u64>>>> {
        match self.below() {
            Some(below) => below.try_read(offset, buf),
            None => Ok(None),
        }
    }

    /// A read `try_read` declined because it must wait for the device:
    /// if it can be started without waiting (its blocks at home,
    /// contiguous, their contexts in memory, and a reaper: `read_events`),
    /// plan it and return the `StartRead` that submits it; its `ReadDone`
    /// is called from `reap_reads`, or at once with `None` if the read
    /// could not be submitted. `None` when it cannot (then call `read`).
    /// Never blocks; the default declines.
    fn try_begin_read(&self, offset: u64, len: usize) -> Option<StartRead> {
        self.below()?.try_begin_read(offset, len)
    }

    /// Set up reads that complete later (`try_begin_read`) and return the
    /// descriptor that becomes readable when some have; the caller
    /// promises to call `reap_reads` then, until every read it started
    /// has finished. `None`: this device starts none (the default).
    fn read_events(&self) -> Option<std::os::fd::RawFd> {
        self.below()?.read_events()
    }

    /// Finish the reads that completed (their `ReadDone`s run here), until
    /// none is left: then `Err(WouldBlock)` (see `ReadRing::reap`).
    fn reap_reads(&self) -> std::io::Result<()> {
        match self.below() {
            Some(below) => below.reap_reads(),
            None => Err(std::io::ErrorKind::WouldBlock.into()),
        }
    }

    /// Reads started by `try_begin_read` whose `ReadDone` was not called
    /// yet (a server keeps reaping until none is left before it stops).
    fn reads_in_flight(&self) -> usize {
        self.below().map_or(0, |below| below.reads_in_flight())
    }

    /// The one write submission (see `Admission` and `Submitted`): write
    /// `data` at `offset` (any byte range: a block it covers only in part
    /// is read, verified, patched and written whole, under the block's
    /// stripe lock), durable when it completes with `fua`, otherwise after
    /// the next flush. `admission` says whether the caller may wait for
    /// it; the answer says whether it was done, declined (nothing locked,
    /// written or counted: submit it again on a thread that may wait), or
    /// started (call the `StartWrite` with the one completion). An `Err`
    /// is the write's outcome (a request error, a failed write).
    ///
    /// Required of every device, layers included: a layer passes it on to
    /// `below` after its own rules, whatever the admission, so no route a
    /// device below offers is lost under it (`--inject` keeps every fast
    /// path); a device at the bottom answers `MayWait` by writing and
    /// declines what it cannot do without waiting.
    fn submit_write(
        &self,
        offset: u64,
        data: &Bytes,
        fua: bool,
        admission: Admission,
    ) -> Result<Submitted>;

    /// Memory to receive a write's payload of `len` bytes into before it
    /// is passed to `submit_write` (frozen): a volume
    /// whose held log can name it instead of copying it (`landing.rs`).
    /// A layer lends the device below's; at the bottom, `None` (the
    /// default) receives into process memory. Only a hint: the write takes
    /// any `Bytes`.
    fn landing_buffer(&self, len: usize) -> Option<crate::LandingBuffer> {
        self.below()?.landing_buffer(len)
    }

    /// A hint from the NBD server: a connection's client has (`true`) or
    /// no longer has (`false`) requests waiting behind the write it sends
    /// next (a deep stream: no prompt commits, `Committer::prompt`). Sent
    /// when it changes, each `true` followed by one `false` (at the latest
    /// when the connection ends): the volume counts the deep connections.
    /// Returns `false` when the device could not take it now (a resize
    /// holds the volume), and the server sends it again with its next
    /// write. A layer passes it to the device below; at the bottom the
    /// default ignores it.
    fn writes_queued(&self, queued: bool) -> bool {
        match self.below() {
            Some(below) => below.writes_queued(queued),
            None => true,
        }
    }

    /// Make every write completed before this call durable.
    fn flush(&self) -> Result<()>;

    /// `flush`, answered through `done` (once) as soon as it is durable,
    /// possibly before this returns (a volume answers a small flush when
    /// its journal record is durable, before the blocks' home writes).
    /// The default answers when `flush` returns.
    fn flush_then(&self, done: FlushDone) {
        match self.below() {
            Some(below) => below.flush_then(done),
            None => done(self.flush()),
        }
    }

    /// Deallocate: the range reads as zeros afterwards.
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()>;

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()>;

    /// Allocation from the block holding `offset`, as runs of
    /// `(blocks, kind)`, covering at most `max_blocks` blocks.
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>>;

    /// Each block's protection information as it stands, without reading
    /// data (`Layout::stored_contexts`): changed blocks compare a volume's
    /// with its snapshot's. A device that cannot tell (a mirror) says so.
    fn stored_contexts(&self, first: u64, count: u64) -> Result<Vec<StoredContext>> {
        match self.below() {
            Some(below) => below.stored_contexts(first, count),
            None => {
                let _ = (first, count);
                Err(Error::Unsupported(
                    "this device keeps no contexts of its own to compare (a mirror: compare one of its legs)".into(),
                ))
            }
        }
    }

    /// Read whole blocks; faulty blocks are zero-filled and listed instead
    /// of failing the call (scans, `check`, `export --allow-faults`).
    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>>;

    /// The blocks whose protection information is kept with `lba`'s (one
    /// unit of metadata, lost or damaged together: a split context page, a
    /// packed row). A device that cannot tell returns `lba` alone.
    fn metadata_unit(&self, lba: u64) -> std::ops::Range<u64> {
        match self.below() {
            Some(below) => below.metadata_unit(lba),
            None => lba..lba + 1,
        }
    }

    /// The first LBA at or after `lba` that may hold data; scans skip to
    /// it. A device that cannot tell returns `lba`.
    fn next_possible_data(&self, lba: u64) -> Result<u64> {
        match self.below() {
            Some(below) => below.next_possible_data(lba),
            None => Ok(lba),
        }
    }

    /// This device as `Any`, for a caller with a fast path on one concrete
    /// device: `copy::copy` reflinks between two volumes (extents shared,
    /// only contexts written; `AsVolume`) and copies any other device (a
    /// mirror, a layer) with reads and writes. `None` for every device but
    /// `Volume` (and a remote replica's client, whose snapshot requests a
    /// mirror's snapshot sends); a layer does not forward it (its own
    /// rules must see the copy).
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// Verify every block of `[first, first + count)` without returning
    /// data; returns the faults found.
    fn verify(&self, first: u64, count: u64) -> Result<Vec<Fault>> {
        match self.below() {
            Some(below) => below.verify(first, count),
            None => verify_in_turn(self, first, count),
        }
    }

    /// Copy `count` blocks from `source` to `destination` (LBAs), with
    /// `memmove` semantics when the ranges overlap. Source blocks are
    /// verified on the way: a fault fails the copy naming the LBA. The
    /// destination is durable after the next flush, like any write.
    fn copy(&self, source: u64, destination: u64, count: u64) -> Result<()> {
        if let Some(below) = self.below() {
            return below.copy(source, destination, count);
        }
        let blocks = self.size() / BLOCK;
        for start in [source, destination] {
            if start.checked_add(count).is_none_or(|end| end > blocks) {
                return Err(Error::OutOfRange {
                    offset: start * BLOCK,
                    length: count * BLOCK,
                    size: self.size(),
                });
            }
        }
        let mut buffer = PageBuffer::new((OFFLOAD_CHUNK_BLOCKS * BLOCK) as usize);
        // Copy backwards when the destination overlaps the source's tail.
        let backwards = destination > source && destination < source + count;
        let mut done = 0;
        while done < count {
            let n = (count - done).min(OFFLOAD_CHUNK_BLOCKS);
            let at = if backwards { count - done - n } else { done };
            let chunk = &mut buffer[..(n * BLOCK) as usize];
            self.read((source + at) * BLOCK, chunk)?;
            self.write((destination + at) * BLOCK, chunk, false)?;
            done += n;
        }
        Ok(())
    }

    /// NVMe Compare: `None` when the bytes at `offset` equal `data`, else
    /// the offset (from `offset`) of the first byte that differs.
    fn compare(&self, offset: u64, data: &[u8]) -> Result<Option<u64>> {
        if let Some(below) = self.below() {
            return below.compare(offset, data);
        }
        let step = (OFFLOAD_CHUNK_BLOCKS * BLOCK) as usize;
        let mut buffer = PageBuffer::new(step.min(data.len()));
        let mut at = 0usize;
        while at < data.len() {
            let n = step.min(data.len() - at);
            self.read(offset + at as u64, &mut buffer[..n])?;
            if let Some(index) = buffer[..n]
                .iter()
                .zip(&data[at..at + n])
                .position(|(a, b)| a != b)
            {
                return Ok(Some((at + index) as u64));
            }
            at += n;
        }
        Ok(None)
    }
}

/// The sealed-block face of a device that can be a mirror's leg or a
/// replica's target: blocks moved *with their contexts* (PI travels with
/// the data and is checked at every hop), the write routes a mirror
/// admits a leg's share of a write by, sealing for another device, and
/// whether the device can be reached. A `Volume` and a remote leg are
/// sealed devices; the NBD export and the jobs need only `BlockDevice`.
pub trait SealedDevice: BlockDevice {
    /// The sealed device this one is a layer over (the same device as
    /// `below`), which every provided method passes its call on to; `None`
    /// (the default) at the bottom of a stack, where each provided method
    /// declines or falls back as it describes.
    fn sealed_below(&self) -> Option<&dyn SealedDevice> {
        None
    }

    /// Blocks `[first, first + count)` as stored, each with its context.
    fn read_sealed(&self, first: u64, count: u64) -> Result<Vec<SealedBlock>>;

    /// `read_blocks_collecting` for a mirror repair's own re-reads of
    /// blocks a read already judged bad (is it still bad? did the rewrite
    /// take?): the faults are listed but not judged again, nothing counted
    /// or logged, so a bad block is one fault per read. At the bottom of
    /// a stack the default is `read_blocks_collecting` (a device that
    /// judges nothing itself, a remote leg, loses nothing by it).
    fn recheck_blocks(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        match self.sealed_below() {
            Some(below) => below.recheck_blocks(first, count, out),
            None => self.read_blocks_collecting(first, count, out),
        }
    }

    /// The one sealed write submission (see `SealedAdmission`): store
    /// `blocks` (distinct LBAs, in any order) at their LBAs, each checked
    /// against its context as the admission says, durable when it
    /// completes with `fua`, otherwise after the next flush. A block that
    /// does not pass fails the call naming it, with none of the blocks
    /// stored. The answer says whether it was done, declined (nothing
    /// stored or counted; a reserved room is never declined) or started
    /// (call the `StartWrite` with the one completion; under `MayWait` and
    /// `Here` it may wait for it, under `Callback` it returns at once).
    ///
    /// Required of every sealed device, layers included: a layer passes
    /// it on to `sealed_below` after its own rules, whatever the
    /// admission, so the device below still chooses the route. The
    /// callers' conveniences are `SealedWrites`'.
    fn submit_sealed(
        &self,
        blocks: &[SealedBlock],
        fua: bool,
        admission: SealedAdmission,
    ) -> Result<Submitted>;

    /// Reserve room for `count` blocks that a `SealedAdmission::Reserved`
    /// submission will store without waiting (a mirror's inline path
    /// reserves on every leg before it writes any: the write is then
    /// never half done, nor finished by a blocking commit on the caller's
    /// thread). False, with nothing reserved, when there is none. The
    /// default: never.
    fn reserve_room(&self, count: usize) -> bool {
        self.sealed_below()
            .is_some_and(|below| below.reserve_room(count))
    }

    /// Give back room `reserve_room` reserved and no write used.
    fn release_room(&self, count: usize) {
        if let Some(below) = self.sealed_below() {
            below.release_room(count);
        }
    }

    /// The largest write this device seals cheaply enough for an inline
    /// (NBD reactor) path: one that encrypts caps it. The default: any.
    fn inline_seal_max_bytes(&self) -> usize {
        self.sealed_below()
            .map_or(usize::MAX, |below| below.inline_seal_max_bytes())
    }

    /// Whether a `SealedAdmission::Callback` submission is started here,
    /// its completion called on another thread without blocking the
    /// caller (a remote replica on a connection that answers on its own
    /// reader thread), rather than declined. A mirror asks before it
    /// takes anything for such a write. The default: no.
    fn answers_by_callback(&self) -> bool {
        self.sealed_below()
            .is_some_and(|below| below.answers_by_callback())
    }

    /// Seal whole blocks (`data`, from LBA `first`) as this device would
    /// store them, each with its context carrying `generation`, for
    /// a sealed write here or on another leg of one mirror: the mirror
    /// seals a write once and every leg stores the same bytes and context
    /// (PI computed once, verified at every leg). `Unsupported` when the
    /// device cannot seal (then the mirror has each leg seal for itself).
    fn seal_blocks(&self, first: u64, data: &Bytes, generation: u64) -> Result<Vec<SealedBlock>> {
        match self.sealed_below() {
            Some(below) => below.seal_blocks(first, data, generation),
            None => Err(Error::Unsupported(
                "sealing blocks for another device".into(),
            )),
        }
    }

    /// Reach the device again after it became unreachable (a remote
    /// leg whose connection died), checking it is still the same volume;
    /// nothing to do while it is reachable. `Unsupported` by default.
    fn reconnect(&self) -> Result<()> {
        match self.sealed_below() {
            Some(below) => below.reconnect(),
            None => Err(Error::Unsupported("reconnecting this device".into())),
        }
    }

    /// Why the device cannot be reached now (a remote leg whose
    /// connection died), without trying to reach it; `None` while it can
    /// be (always, for a local device).
    fn unreachable(&self) -> Option<String> {
        self.sealed_below()?.unreachable()
    }

    /// The generation a block sealed now would carry here (0 when the
    /// device has no such clock): a mirror stamps each write with the
    /// highest of its legs' clocks, so every leg stores one generation and
    /// a later write of a block always has a generation at least as high.
    fn generation_clock(&self) -> u64 {
        self.sealed_below()
            .map_or(0, |below| below.generation_clock())
    }
}

/// `BlockDevice::verify` on the calling thread, a chunk at a time.
pub fn verify_in_turn<D: BlockDevice + ?Sized>(
    device: &D,
    first: u64,
    count: u64,
) -> Result<Vec<Fault>> {
    let mut faults = Vec::new();
    let mut buffer = PageBuffer::new((OFFLOAD_CHUNK_BLOCKS.min(count) * BLOCK) as usize);
    let end = first + count;
    let mut lba = first;
    while lba < end {
        let n = (end - lba).min(OFFLOAD_CHUNK_BLOCKS);
        faults.extend(device.read_blocks_collecting(
            lba,
            n,
            &mut buffer[..(n * BLOCK) as usize],
        )?);
        lba += n;
    }
    Ok(faults)
}
