//! `Volume`'s `BlockDevice`: each call handed to the engine's path for it,
//! and the offloads (`verify`, `copy`) run next to the data. Apart from
//! `volume.rs` because the offloads it runs (`copy`) take a `Volume`
//! themselves.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

use super::Volume;
use crate::device::{
    Admission, BlockDevice, FlushDone, ReadDone, SealedAdmission, SealedBlock, SealedDevice,
    StartRead, Submitted, ZeroFlags,
};
use crate::error::{Error, Fault, Result};
use crate::layout::{Allocation, StoredContext};
use crate::storage::ReadLater;
use crate::write::SealCheck;

/// A `verify` of this many blocks (4 MiB) or more runs on the scan's
/// reader threads.
const PARALLEL_VERIFY_BLOCKS: u64 = 4 * crate::jobs::SCAN_CHUNK_BLOCKS;

impl BlockDevice for Volume {
    fn size(&self) -> u64 {
        self.size.load(std::sync::atomic::Ordering::Acquire)
    }
    /// Fixed at open (a resize opens the engine again the same way).
    fn is_read_only(&self) -> bool {
        self.first.shared().io().is_read_only()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        self.current().shared().read(offset, buf)
    }
    fn try_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<Vec<Range<u64>>>> {
        match self.current_now() {
            Some(engine) => engine.shared().try_read(offset, buf),
            None => Ok(None),
        }
    }
    /// One I/O through the storage's ring; the blocks are verified on the
    /// reaping thread against the contexts planned before it started.
    /// The engine an online resize opens shares the first one's ring (the
    /// one the server watches: `Storage::reopen`); a storage without it
    /// (`reads_ready` false) sends its reads to the workers.
    fn try_begin_read(&self, offset: u64, len: usize) -> Option<StartRead> {
        let current = self.current_now()?;
        if !current.shared().io().reads_ready() {
            return None;
        }
        let read = current.shared().plan_ring_read(offset, len)?;
        let engine = Arc::clone(&current);
        Some(Box::new(move |done: ReadDone| {
            let span = read.span;
            let io = engine.shared().io();
            let answer = Arc::clone(&engine);
            let finish: ReadLater = Box::new(move |bytes| {
                done(
                    bytes
                        .ok()
                        .and_then(|bytes| answer.shared().finish_ring_read(&read, &bytes)),
                )
            });
            if let Err(finish) = io.start_read(span.object, span.offset, span.len, finish) {
                finish(Err(std::io::ErrorKind::WouldBlock.into()));
            }
        }))
    }
    fn read_events(&self) -> Option<std::os::fd::RawFd> {
        self.first.shared().io().read_events()
    }
    fn reap_reads(&self) -> std::io::Result<()> {
        self.first.shared().io().reap_reads()
    }
    fn reads_in_flight(&self) -> usize {
        self.first.shared().io().reads_in_flight()
    }
    /// The worker's route is the engine's `write_shared`; the reactor's
    /// (no FUA) its `try_write_shared`, which declines unless the blocks
    /// are whole, a background committer takes the commit and the
    /// write-back buffer has room. A volume finishes no write later.
    fn submit_write(
        &self,
        offset: u64,
        data: &Bytes,
        fua: bool,
        admission: Admission,
    ) -> Result<Submitted> {
        match admission {
            Admission::MayWait => {
                self.current().write_shared(offset, data, fua)?;
                Ok(Submitted::Done)
            }
            Admission::MustNotWait if !fua => match self.current_now() {
                Some(engine) if engine.try_write_shared(offset, data)? => Ok(Submitted::Done),
                _ => Ok(Submitted::Declined),
            },
            Admission::MustNotWait | Admission::Callback => Ok(Submitted::Declined),
        }
    }
    fn landing_buffer(&self, len: usize) -> Option<crate::LandingBuffer> {
        self.current_now()?.landing_buffer(len)
    }
    fn writes_queued(&self, queued: bool) -> bool {
        match self.current_now() {
            Some(engine) => {
                engine.committer().writes_queued(queued);
                true
            }
            None => false,
        }
    }
    fn flush(&self) -> Result<()> {
        self.current().flush()
    }
    fn flush_then(&self, done: FlushDone) {
        self.current().flush_then(done)
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.current().trim(offset, length, fua)
    }
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()> {
        self.current().write_zeroes(offset, length, flags)
    }
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>> {
        self.current()
            .shared()
            .block_status(offset, length, max_blocks)
    }
    fn stored_contexts(&self, first: u64, count: u64) -> Result<Vec<StoredContext>> {
        self.current().shared().stored_contexts(first, count)
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    /// Long ranges on the scan's reader threads (`verify::verify`), short
    /// ones on the calling thread (starting threads would cost more).
    fn verify(&self, first: u64, count: u64) -> Result<Vec<Fault>> {
        if count < PARALLEL_VERIFY_BLOCKS {
            return crate::device::verify_in_turn(self, first, count);
        }
        let report = crate::verify::verify(
            self,
            first,
            count,
            &crate::verify::VerifyOptions::default(),
            &crate::jobs::JobControl::default(),
        )?;
        Ok(report.faults)
    }
    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        self.current()
            .shared()
            .read_blocks_collecting(first, count, out)
    }
    fn next_possible_data(&self, lba: u64) -> Result<u64> {
        self.current().shared().next_possible_data(lba)
    }
    fn metadata_unit(&self, lba: u64) -> Range<u64> {
        Volume::metadata_unit(self, lba)
    }
    /// Copy within the volume next to the data (`copy::copy`, method
    /// `Auto`): reflink when the filesystem shares extents, else pipelined.
    fn copy(&self, source: u64, destination: u64, count: u64) -> Result<()> {
        let options = crate::copy::CopyOptions::default();
        let control = crate::jobs::JobControl::default();
        crate::copy::copy(self, source, self, destination, count, &options, &control).map(|_| ())
    }
}

/// The sealed face: a volume is a mirror's local leg and what a replica
/// serves.
impl SealedDevice for Volume {
    fn read_sealed(&self, first: u64, count: u64) -> Result<Vec<SealedBlock>> {
        let engine = self.current();
        let generation = engine.committer().lock().next_seq();
        engine.shared().read_sealed(first, count, generation)
    }
    fn recheck_blocks(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        self.current().shared().recheck_blocks(first, count, out)
    }
    /// Waiting admissions write here (`Engine::write_sealed`, then a flush
    /// for FUA); `MustNotWait` buffers only where that needs no wait;
    /// `Reserved` stores into the room reserved; a volume's writes do not
    /// travel, so `Callback` is declined.
    fn submit_sealed(
        &self,
        blocks: &[SealedBlock],
        fua: bool,
        admission: SealedAdmission,
    ) -> Result<Submitted> {
        let check = match admission {
            SealedAdmission::MayWait => SealCheck::Full,
            SealedAdmission::Here => SealCheck::Placement,
            SealedAdmission::MustNotWait => {
                let Some(engine) = self.current_now().filter(|_| !fua) else {
                    return Ok(Submitted::Declined);
                };
                return Ok(match engine.try_write_sealed(blocks, SealCheck::Full)? {
                    true => Submitted::Done,
                    false => Submitted::Declined,
                });
            }
            SealedAdmission::Reserved => {
                let engine = self.current();
                if fua {
                    // The reservation is used up whatever the outcome.
                    engine.release_room(blocks.len());
                    return Err(Error::InvalidArgument(
                        "a write into reserved room cannot be FUA (it never waits)".into(),
                    ));
                }
                engine.write_sealed_reserved(blocks, SealCheck::Placement)?;
                return Ok(Submitted::Done);
            }
            SealedAdmission::Callback => return Ok(Submitted::Declined),
        };
        let engine = self.current();
        engine.write_sealed(blocks, check)?;
        if fua {
            engine.flush()?;
        }
        Ok(Submitted::Done)
    }
    fn reserve_room(&self, count: usize) -> bool {
        self.current().reserve_room(count)
    }
    fn release_room(&self, count: usize) {
        self.current().release_room(count)
    }
    fn inline_seal_max_bytes(&self) -> usize {
        self.current().inline_seal_max_bytes()
    }
    fn seal_blocks(&self, first: u64, data: &Bytes, generation: u64) -> Result<Vec<SealedBlock>> {
        self.current().seal_for_transfer(first, data, generation)
    }
    fn generation_clock(&self) -> u64 {
        self.current().shared().sealing_generation()
    }
}
