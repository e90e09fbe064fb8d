//! The bridge between the engine and the NBD server: any `BlockDevice` (a
//! `Volume`, or a layer stacked on one) as an NBD `Export`. The server
//! validated ranges and flags already; the engine checks them again (both
//! ends).

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use vouch_engine::{Admission, BlockDevice, Submitted, ZeroFlags};
use vouch_engine::{Allocation, Error, BLOCK};
use vouch_nbd::{
    BlockSizes, Errno, Export, ExportError, Extent, Integrity, IntegrityExtent, PayloadBuffer,
    ReadCompletion, WriteCompletion,
};

/// Largest request the server accepts (payload), advertised in BLOCK_SIZE.
pub const MAX_REQUEST_BYTES: u32 = 32 << 20;
/// Blocks one BLOCK_STATUS reply describes at most (256 MiB).
const BLOCK_STATUS_MAX_BLOCKS: u64 = 65536;
/// Blocks one `x-vouch:integrity` query verifies at most (32 MiB, the
/// largest read): a query is a read the client does not receive, so it is
/// bounded like one. The reply covers what was checked; the client asks
/// again from there (the spec lets a reply cover less than asked).
const INTEGRITY_MAX_BLOCKS: u64 = MAX_REQUEST_BYTES as u64 / BLOCK;

pub struct VolumeExport {
    volume: Arc<dyn BlockDevice>,
    description: String,
    /// Its snapshots' dirty bitmaps and, for a clone, its allocation depth
    /// (`with_changes`); `None`: neither is offered.
    changes: Option<crate::changed::Changes>,
}

impl VolumeExport {
    pub fn new(volume: Arc<dyn BlockDevice>, description: String) -> VolumeExport {
        VolumeExport {
            volume,
            description,
            changes: None,
        }
    }

    /// Offer `qemu:dirty-bitmap:NAME` for each snapshot of the volume at
    /// `path` (and `qemu:allocation-depth` when it is a clone).
    pub fn with_changes(mut self, changes: crate::changed::Changes) -> VolumeExport {
        self.changes = Some(changes);
        self
    }
}

/// Map an engine error onto an NBD errno and a message naming the fault.
pub fn to_export_error(error: Error) -> ExportError {
    match &error {
        Error::Fault(fault) => ExportError::new(Errno::Io, error.to_string())
            .at_offset(fault.lba * BLOCK)
            .with_fault_kind(fault.kind.name()),
        Error::OutOfRange { .. } | Error::Misaligned { .. } | Error::InvalidArgument(_) => {
            ExportError::new(Errno::Inval, error.to_string())
        }
        Error::ReadOnly(_) => ExportError::new(Errno::Perm, error.to_string()),
        Error::NoSpace { .. } | Error::StoppedFull(_) => {
            ExportError::new(Errno::NoSpc, error.to_string())
        }
        // A full held log (tmpfs) is a full disk to the client: ENOSPC.
        Error::HeldLog { cause, .. } if cause.raw_os_error() == Some(libc::ENOSPC) => {
            ExportError::new(Errno::NoSpc, error.to_string())
        }
        Error::FailStopped(_)
        | Error::Io { .. }
        | Error::HeldLog { .. }
        | Error::Corrupt(_)
        | Error::Unsupported(_)
        | Error::Key(_)
        | Error::Path { .. }
        | Error::Cancelled(_)
        | Error::Unreachable(_)
        | Error::InVolume { .. } => ExportError::new(Errno::Io, error.to_string()),
    }
}

/// A landing region lent to the NBD server for one payload.
struct Landed(vouch_engine::LandingBuffer);

impl PayloadBuffer for Landed {
    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn freeze(self: Box<Self>) -> Bytes {
        self.0.freeze()
    }
}

impl Export for VolumeExport {
    fn size(&self) -> u64 {
        self.volume.size()
    }
    fn description(&self) -> Option<String> {
        Some(self.description.clone())
    }
    fn read_only(&self) -> bool {
        self.volume.is_read_only()
    }
    fn block_sizes(&self) -> BlockSizes {
        BlockSizes {
            minimum: 512,
            preferred: BLOCK as u32,
            maximum: MAX_REQUEST_BYTES,
        }
    }
    /// Every `BlockDevice` serves any byte range: reads copy the bytes out
    /// of verified blocks, writes and zeroes read-modify-write a block they
    /// cover in part under its stripe lock (engine `write_partial`, the
    /// mirror's `seal_write`).
    fn can_byte_granularity(&self) -> bool {
        true
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>, ExportError> {
        self.volume.read(offset, buf).map_err(to_export_error)
    }
    fn try_read(
        &self,
        offset: u64,
        buf: &mut [u8],
    ) -> Option<Result<Vec<Range<u64>>, ExportError>> {
        self.volume
            .try_read(offset, buf)
            .map_err(to_export_error)
            .transpose()
    }
    /// The device's ring (`BlockDevice::try_begin_read`): the bytes come
    /// back verified, or `None` sends the read to a worker.
    fn try_start_read(
        &self,
        offset: u64,
        length: usize,
        done: ReadCompletion,
    ) -> Result<(), ReadCompletion> {
        let Some(start) = self.volume.try_begin_read(offset, length) else {
            return Err(done);
        };
        start(Box::new(move |bytes| done.complete(bytes)));
        Ok(())
    }
    fn read_events(&self) -> Option<std::os::fd::RawFd> {
        self.volume.read_events()
    }
    fn reap_reads(&self) -> std::io::Result<()> {
        self.volume.reap_reads()
    }
    fn reads_in_flight(&self) -> usize {
        self.volume.reads_in_flight()
    }
    /// The volume's landing area (engine `landing.rs`): its held log then
    /// names where the payload is instead of copying it.
    fn payload_buffer(&self, offset: u64, length: usize) -> Option<Box<dyn PayloadBuffer>> {
        let _ = offset;
        let buffer = self.volume.landing_buffer(length)?;
        Some(Box::new(Landed(buffer)))
    }
    /// The three NBD write routes are the device's one submission
    /// (`BlockDevice::submit_write`), each with its admission: the
    /// worker's `MayWait`, the reactor's inline `MustNotWait`, and the
    /// reactor's `Callback` (a mirror with remote legs finishes it on the
    /// thread of the leg that answers last, which completes `done`).
    fn write(&self, offset: u64, data: &Bytes, fua: bool) -> Result<(), ExportError> {
        match self
            .volume
            .submit_write(offset, data, fua, Admission::MayWait)
        {
            Ok(Submitted::Done) => Ok(()),
            Ok(other) => Err(to_export_error(Error::Unsupported(format!(
                "a write that may wait answered {other:?}"
            )))),
            Err(error) => Err(to_export_error(error)),
        }
    }
    fn writes_queued(&self, queued: bool) -> bool {
        self.volume.writes_queued(queued)
    }
    fn try_write(&self, offset: u64, data: &Bytes) -> Option<Result<(), ExportError>> {
        match self
            .volume
            .submit_write(offset, data, false, Admission::MustNotWait)
        {
            Ok(Submitted::Done) => Some(Ok(())),
            Ok(Submitted::Declined) => None,
            Ok(Submitted::Started(_)) => Some(Err(to_export_error(Error::Unsupported(
                "a write that must finish now was started to finish later".into(),
            )))),
            Err(error) => Some(Err(to_export_error(error))),
        }
    }
    fn try_start_write(
        &self,
        offset: u64,
        data: &Bytes,
        done: WriteCompletion,
    ) -> Result<(), WriteCompletion> {
        match self
            .volume
            .submit_write(offset, data, false, Admission::Callback)
        {
            Ok(Submitted::Declined) => Err(done),
            Ok(Submitted::Started(start)) => {
                start(Box::new(move |outcome| {
                    done.complete(outcome.map_err(to_export_error));
                }));
                Ok(())
            }
            Ok(Submitted::Done) => {
                done.complete(Ok(()));
                Ok(())
            }
            Err(error) => {
                done.complete(Err(to_export_error(error)));
                Ok(())
            }
        }
    }
    fn flush(&self) -> Result<(), ExportError> {
        self.volume.flush().map_err(to_export_error)
    }
    fn flush_then(&self, done: WriteCompletion) {
        self.volume.flush_then(Box::new(move |flushed| {
            done.complete(flushed.map_err(to_export_error));
        }));
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), ExportError> {
        self.volume
            .trim(offset, length, fua)
            .map_err(to_export_error)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        flags: vouch_nbd::ZeroFlags,
    ) -> Result<(), ExportError> {
        // Zeroing never writes data blocks (only contexts), so it is always fast.
        self.volume
            .write_zeroes(
                offset,
                length,
                ZeroFlags {
                    fua: flags.fua,
                    allocate: flags.no_hole,
                },
            )
            .map_err(to_export_error)
    }
    fn cache(&self, offset: u64, length: u64) -> Result<(), ExportError> {
        // Prefetch = read and verify, discarding the bytes.
        let mut buf = vec![0u8; length.min(u64::from(MAX_REQUEST_BYTES)) as usize];
        let mut at = offset;
        while at < offset + length {
            let n = (offset + length - at).min(buf.len() as u64) as usize;
            self.volume
                .read(at, &mut buf[..n])
                .map_err(to_export_error)?;
            at += n as u64;
        }
        Ok(())
    }
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, ExportError> {
        let runs = self
            .volume
            .block_status(offset, length, BLOCK_STATUS_MAX_BLOCKS)
            .map_err(to_export_error)?;
        let extents = crate::changed::in_bytes(offset, length, runs, |allocation| {
            let (hole, zero) = match allocation {
                Allocation::Hole => (true, true),
                Allocation::Zero => (false, true),
                Allocation::Data => (false, false),
            };
            (hole, zero)
        });
        Ok(extents
            .into_iter()
            .map(|(length, (hole, zero))| Extent { length, hole, zero })
            .collect())
    }

    fn dirty_bitmaps(&self) -> Vec<String> {
        self.changes
            .as_ref()
            .map(crate::changed::Changes::snapshots)
            .unwrap_or_default()
    }
    fn dirty_status(
        &self,
        bitmap: &str,
        offset: u64,
        length: u64,
    ) -> Result<Vec<(u64, bool)>, ExportError> {
        let Some(changes) = &self.changes else {
            return Err(ExportError::no_context(&format!("dirty bitmap {bitmap:?}")));
        };
        changes.dirty_status(
            self.volume.as_ref(),
            bitmap,
            (offset, length, BLOCK_STATUS_MAX_BLOCKS),
        )
    }
    fn can_allocation_depth(&self) -> bool {
        self.changes
            .as_ref()
            .is_some_and(crate::changed::Changes::is_clone)
    }
    fn allocation_depth(&self, offset: u64, length: u64) -> Result<Vec<(u64, u32)>, ExportError> {
        let Some(changes) = &self.changes else {
            return Err(ExportError::no_context("qemu:allocation-depth"));
        };
        changes.allocation_depth(
            self.volume.as_ref(),
            (offset, length, BLOCK_STATUS_MAX_BLOCKS),
        )
    }
    fn can_integrity_status(&self) -> bool {
        true
    }

    fn integrity_status(
        &self,
        offset: u64,
        length: u64,
    ) -> Result<Vec<IntegrityExtent>, ExportError> {
        let first = offset / BLOCK;
        let end = offset
            .saturating_add(length)
            .div_ceil(BLOCK)
            .min(first + INTEGRITY_MAX_BLOCKS);
        let runs = self
            .volume
            .block_status(first * BLOCK, (end - first) * BLOCK, end - first)
            .map_err(to_export_error)?;
        // Per block: holes have nothing to verify; stored blocks are read
        // and verified now, faults (and their LBAs) from the verify.
        let mut statuses: Vec<(u64, Integrity)> = Vec::new();
        let mut lba = first;
        for (blocks, allocation) in runs {
            let blocks = blocks.min(end - lba);
            if blocks == 0 {
                break;
            }
            if allocation == Allocation::Hole {
                statuses.push((blocks, Integrity::Hole));
            } else {
                let faults = self.volume.verify(lba, blocks).map_err(to_export_error)?;
                let mut at = lba;
                for fault in faults {
                    if fault.lba > at {
                        statuses.push((fault.lba - at, Integrity::Verified));
                    }
                    statuses.push((1, Integrity::Fault));
                    at = fault.lba + 1;
                }
                if lba + blocks > at {
                    statuses.push((lba + blocks - at, Integrity::Verified));
                }
            }
            lba += blocks;
        }
        // In bytes, the first run trimmed to `offset`, neighbours merged.
        let mut extents: Vec<IntegrityExtent> = Vec::with_capacity(statuses.len());
        let mut skip = offset % BLOCK;
        for (blocks, status) in statuses {
            let length = blocks * BLOCK - skip;
            skip = 0;
            match extents.last_mut() {
                Some(last) if last.status == status => last.length += length,
                _ => extents.push(IntegrityExtent { length, status }),
            }
        }
        Ok(extents)
    }
}
