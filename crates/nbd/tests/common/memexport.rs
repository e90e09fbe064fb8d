//! In-memory test export: a `Vec<u8>` behind a lock plus per-4 KiB-block
//! allocation state, so READ holes and BLOCK_STATUS have something real to
//! report. Also counts flushes/FUA and can inject a verification fault.

#![allow(dead_code)]

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use vouch_nbd::{BlockSizes, Errno, Export, ExportError, Extent, ZeroFlags};

/// Allocation-tracking granularity.
pub const TRACK_BLOCK: u64 = 4096;
/// `fail_read_at` value meaning "no fault injected".
const NO_FAULT: u64 = u64::MAX;

pub struct MemExport {
    size: u64,
    read_only: bool,
    inner: RwLock<Inner>,
    pub flushes: AtomicU64,
    pub fua_writes: AtomicU64,
    pub writes: AtomicU64,
    pub caches: AtomicU64,
    /// Reads covering this byte fail with EIO / "guard_mismatch".
    pub fail_read_at: AtomicU64,
    /// Every `writes_queued` hint, in order.
    pub queued_hints: Mutex<Vec<bool>>,
}

struct Inner {
    data: Vec<u8>,
    /// `true` = allocated (data or explicit zeroes), `false` = hole.
    allocated: Vec<bool>,
}

impl MemExport {
    pub fn new(size: u64, read_only: bool) -> MemExport {
        let blocks = size.div_ceil(TRACK_BLOCK) as usize;
        MemExport {
            size,
            read_only,
            inner: RwLock::new(Inner {
                data: vec![0; size as usize],
                allocated: vec![false; blocks],
            }),
            flushes: AtomicU64::new(0),
            fua_writes: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            caches: AtomicU64::new(0),
            fail_read_at: AtomicU64::new(NO_FAULT),
            queued_hints: Mutex::new(Vec::new()),
        }
    }

    /// Fill the whole export with a byte pattern and mark it allocated.
    pub fn fill(&self, byte: u8) {
        let mut inner = self.inner.write();
        inner.data.fill(byte);
        inner.allocated.fill(true);
    }

    pub fn contents(&self, range: Range<u64>) -> Vec<u8> {
        self.inner.read().data[range.start as usize..range.end as usize].to_vec()
    }

    pub fn is_allocated(&self, offset: u64) -> bool {
        self.inner.read().allocated[(offset / TRACK_BLOCK) as usize]
    }

    fn blocks(offset: u64, length: u64) -> Range<usize> {
        (offset / TRACK_BLOCK) as usize..(offset + length).div_ceil(TRACK_BLOCK) as usize
    }

    /// Blocks entirely inside [offset, offset+length).
    fn full_blocks(offset: u64, length: u64) -> Range<usize> {
        let first = offset.div_ceil(TRACK_BLOCK) as usize;
        let last = ((offset + length) / TRACK_BLOCK) as usize;
        first..last.max(first)
    }

    fn check(&self, offset: u64, length: u64) {
        // The server validated the range; a violation is a server bug.
        assert!(
            offset
                .checked_add(length)
                .is_some_and(|end| end <= self.size),
            "range past end"
        );
    }
}

impl Export for MemExport {
    fn size(&self) -> u64 {
        self.size
    }
    fn description(&self) -> Option<String> {
        Some("in-memory test export".into())
    }
    fn writes_queued(&self, queued: bool) -> bool {
        self.queued_hints.lock().push(queued);
        true
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn block_sizes(&self) -> BlockSizes {
        BlockSizes {
            minimum: 512,
            preferred: 4096,
            maximum: 32 * 1024 * 1024,
        }
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>, ExportError> {
        let length = buf.len() as u64;
        self.check(offset, length);
        let fault = self.fail_read_at.load(Ordering::Relaxed);
        if fault >= offset && fault < offset + length {
            return Err(
                ExportError::new(Errno::Io, format!("guard mismatch at byte {fault}"))
                    .at_offset(fault)
                    .with_fault_kind("guard_mismatch"),
            );
        }
        let inner = self.inner.read();
        buf.copy_from_slice(&inner.data[offset as usize..(offset + length) as usize]);
        let mut holes: Vec<Range<u64>> = Vec::new();
        for block in Self::blocks(offset, length) {
            if inner.allocated[block] {
                continue;
            }
            let start = (block as u64 * TRACK_BLOCK).max(offset) - offset;
            let end = ((block as u64 + 1) * TRACK_BLOCK).min(offset + length) - offset;
            match holes.last_mut() {
                Some(last) if last.end == start => last.end = end,
                _ => holes.push(start..end),
            }
        }
        Ok(holes)
    }

    fn write(&self, offset: u64, data: &Bytes, fua: bool) -> Result<(), ExportError> {
        self.check(offset, data.len() as u64);
        let mut inner = self.inner.write();
        inner.data[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        for block in Self::blocks(offset, data.len() as u64) {
            inner.allocated[block] = true;
        }
        self.writes.fetch_add(1, Ordering::Relaxed);
        if fua {
            self.fua_writes.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), ExportError> {
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), ExportError> {
        // A trim is a zeroing that may punch holes.
        let flags = ZeroFlags {
            fua,
            ..ZeroFlags::default()
        };
        self.write_zeroes(offset, length, flags)
    }

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<(), ExportError> {
        self.check(offset, length);
        let mut inner = self.inner.write();
        inner.data[offset as usize..(offset + length) as usize].fill(0);
        for block in Self::blocks(offset, length) {
            inner.allocated[block] = true;
        }
        if !flags.no_hole {
            for block in Self::full_blocks(offset, length) {
                inner.allocated[block] = false;
            }
        }
        if flags.fua {
            self.fua_writes.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn cache(&self, offset: u64, length: u64) -> Result<(), ExportError> {
        self.check(offset, length);
        self.caches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, ExportError> {
        self.check(offset, length);
        let inner = self.inner.read();
        let mut extents: Vec<Extent> = Vec::new();
        for block in Self::blocks(offset, length) {
            let start = (block as u64 * TRACK_BLOCK).max(offset);
            let end = ((block as u64 + 1) * TRACK_BLOCK).min(offset + length);
            let hole = !inner.allocated[block];
            match extents.last_mut() {
                Some(last) if last.hole == hole => last.length += end - start,
                _ => extents.push(Extent {
                    length: end - start,
                    hole,
                    zero: hole,
                }),
            }
        }
        Ok(extents)
    }
}

impl MemExport {
    /// Write `byte` over a range directly (test setup), marking it allocated.
    pub fn fill_range(&self, offset: u64, length: u64, byte: u8) {
        self.write(offset, &Bytes::from(vec![byte; length as usize]), false)
            .unwrap();
    }
}
