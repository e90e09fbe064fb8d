//! The `Export` trait: what the NBD server serves. The server knows nothing
//! of the storage engine; it validates every request (range, alignment,
//! flags, read-only) before calling an export, so an export may assert those
//! conditions instead of re-checking them as client errors.

use std::ops::Range;

use bytes::Bytes;

pub(crate) mod completion;
pub use completion::{ReadCompletion, WriteCompletion};

/// Error an export returns; the server maps `errno` onto the wire and sends `message`
/// in a structured error reply (NBD_REPLY_TYPE_ERROR / ERROR_OFFSET) when structured replies are negotiated.
#[derive(Debug, Clone)]
pub struct ExportError {
    pub errno: Errno,
    pub message: String,
    /// Absolute export offset of the failure (reported with ERROR_OFFSET on reads).
    pub offset: Option<u64>,
    /// Verification fault class, e.g. "guard_mismatch", "ref_tag_mismatch",
    /// "context_corrupt", "unreadable"; counted in metrics by kind.
    pub fault_kind: Option<&'static str>,
}

impl ExportError {
    pub fn new(errno: Errno, message: impl Into<String>) -> Self {
        ExportError {
            errno,
            message: message.into(),
            offset: None,
            fault_kind: None,
        }
    }

    /// A BLOCK_STATUS query for a metadata context the export does not
    /// offer (the server selects only offered ones: a context gone since).
    pub fn no_context(what: &str) -> Self {
        ExportError::new(Errno::Inval, format!("this export has no {what}"))
    }

    pub fn at_offset(mut self, offset: u64) -> Self {
        self.offset = Some(offset);
        self
    }

    pub fn with_fault_kind(mut self, kind: &'static str) -> Self {
        self.fault_kind = Some(kind);
        self
    }
}

impl std::fmt::Display for ExportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.errno, self.message)?;
        if let Some(offset) = self.offset {
            write!(f, " (offset {offset})")?;
        }
        Ok(())
    }
}

impl std::error::Error for ExportError {}

/// The NBD error values (the only ones allowed on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Errno {
    Perm,
    Io,
    NoMem,
    Inval,
    NoSpc,
    Overflow,
    NotSup,
    Shutdown,
}

impl Errno {
    pub const ALL: [Errno; 8] = [
        Errno::Perm,
        Errno::Io,
        Errno::NoMem,
        Errno::Inval,
        Errno::NoSpc,
        Errno::Overflow,
        Errno::NotSup,
        Errno::Shutdown,
    ];

    /// Wire value (NBD_EPERM 1, NBD_EIO 5, ...).
    pub fn wire_value(self) -> u32 {
        match self {
            Errno::Perm => 1,
            Errno::Io => 5,
            Errno::NoMem => 12,
            Errno::Inval => 22,
            Errno::NoSpc => 28,
            Errno::Overflow => 75,
            Errno::NotSup => 95,
            Errno::Shutdown => 108,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Errno::Perm => "EPERM",
            Errno::Io => "EIO",
            Errno::NoMem => "ENOMEM",
            Errno::Inval => "EINVAL",
            Errno::NoSpc => "ENOSPC",
            Errno::Overflow => "EOVERFLOW",
            Errno::NotSup => "ENOTSUP",
            Errno::Shutdown => "ESHUTDOWN",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Size constraints advertised with NBD_INFO_BLOCK_SIZE and enforced by the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    pub minimum: u32,
    pub preferred: u32,
    pub maximum: u32,
}

/// A run of the export for READ holes and BLOCK_STATUS base:allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    pub hole: bool,
    pub zero: bool,
}

/// A run of the export for BLOCK_STATUS `x-vouch:integrity`: what checking
/// its blocks just now found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntegrityExtent {
    pub length: u64,
    pub status: Integrity,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Integrity {
    /// Read and verified.
    Verified,
    /// Read and failed verification.
    Fault,
    /// Not stored: reads as zeros, nothing to verify.
    Hole,
}

/// The request flags that change what WRITE_ZEROES must do. A struct rather
/// than positional bools so call sites name what they ask for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// NBD_CMD_FLAG_FUA: durable before the reply.
    pub fua: bool,
    /// NBD_CMD_FLAG_NO_HOLE: the range must stay allocated (no punching).
    pub no_hole: bool,
    /// NBD_CMD_FLAG_FAST_ZERO: fail with NotSup rather than be slow.
    pub fast_zero: bool,
}

/// Something the NBD server can serve.
///
/// Methods are synchronous and may block; the server calls them from a pool
/// of worker threads, concurrently, never from the async reactor — except
/// `try_read` and `try_write`, which must not block.
///
/// Multi-conn: the server advertises NBD_FLAG_CAN_MULTI_CONN when
/// `can_multi_conn()` is true. That is only correct if `flush()` makes every
/// write completed on *any* connection durable (i.e. it flushes the whole
/// export, not per-connection state) and all connections see one shared cache.
/// A buffer an export lends for one WRITE payload (`Export::payload_buffer`).
pub trait PayloadBuffer: Send {
    /// Exactly the payload's length, to receive into (its bytes before
    /// are unspecified).
    fn as_mut_slice(&mut self) -> &mut [u8];
    /// Its length in bytes.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The received payload.
    fn freeze(self: Box<Self>) -> Bytes;
}

pub trait Export: Send + Sync + 'static {
    fn size(&self) -> u64;
    fn description(&self) -> Option<String> {
        None
    }
    fn read_only(&self) -> bool;
    fn block_sizes(&self) -> BlockSizes;
    fn can_trim(&self) -> bool {
        true
    }
    fn can_write_zeroes(&self) -> bool {
        true
    }
    fn can_fast_zero(&self) -> bool {
        true
    }
    fn can_fua(&self) -> bool {
        true
    }
    fn can_multi_conn(&self) -> bool {
        true
    }
    fn can_cache(&self) -> bool {
        true
    }
    /// Whether the export serves requests at any byte offset and length
    /// (reading, and read-modify-writing, the blocks they cover in part).
    /// Then a client that negotiates no block size may send any (the
    /// spec's default sizing: minimum block size 1); a client that asks
    /// for block sizes keeps `block_sizes().minimum`. The default is
    /// false: the advertised minimum binds every client.
    fn can_byte_granularity(&self) -> bool {
        false
    }
    /// Fill `buf` with the bytes at `offset`. Returns the sub-ranges (relative to `offset`, sorted, non-overlapping)
    /// that are known to be zero without data I/O (unwritten/trimmed), so READ can answer them with OFFSET_HOLE chunks.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>, ExportError>;
    /// `read`, but only if it can complete without blocking (every byte in
    /// memory or the page cache, no lock held for long): `None` when it
    /// would block, and the server then calls `read` on a worker. Unlike
    /// every other method this one runs on the async reactor, so it must
    /// never wait for I/O; declining must have no side effects. The
    /// default always would block.
    fn try_read(
        &self,
        offset: u64,
        buf: &mut [u8],
    ) -> Option<Result<Vec<Range<u64>>, ExportError>> {
        let _ = (offset, buf);
        None
    }
    /// A READ that `try_read` declined because it must wait for the
    /// device, started without waiting if the export can (its own ring of
    /// reads, reaped by `reap_reads`): the export takes `done` and calls
    /// `ReadCompletion::complete` once, from `reap_reads` (or at once),
    /// with the bytes, or `None` to have the read run on a worker after
    /// all. `Err(done)` when it cannot start it. Runs on the async reactor
    /// like `try_read`. The default always declines.
    fn try_start_read(
        &self,
        offset: u64,
        length: usize,
        done: ReadCompletion,
    ) -> Result<(), ReadCompletion> {
        let _ = (offset, length);
        Err(done)
    }
    /// The descriptor that becomes readable when reads started by
    /// `try_start_read` have completed (set up by this call; the server
    /// asks once, before serving). The server then calls `reap_reads` on
    /// its reactor. `None` (the default): this export starts no reads.
    /// The export must keep this descriptor open, and the same, for as
    /// long as it lives: the server watches it with epoll until the
    /// export is dropped.
    fn read_events(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    /// Complete the started reads whose I/O finished, until none is left:
    /// `Err(WouldBlock)` then.
    fn reap_reads(&self) -> std::io::Result<()> {
        Err(std::io::ErrorKind::WouldBlock.into())
    }
    /// Reads started by `try_start_read` not yet completed: the server
    /// keeps reaping until none is left before it stops.
    fn reads_in_flight(&self) -> usize {
        0
    }
    /// The client has (`true`) or no longer has (`false`) more requests
    /// already received behind the WRITE the server answers next: a deep
    /// client, which keeps the CPUs busy itself (vouch then skips its
    /// prompt commits; `false` after 8 writes in a row with nothing
    /// behind them). Sent by each connection when it changes, before
    /// that write, each `true` followed by one `false` (at the latest when
    /// the connection ends); `false` from the export when it could not
    /// take it now, and the connection sends it again with its next write.
    /// A hint: the default ignores it.
    fn writes_queued(&self, queued: bool) -> bool {
        let _ = queued;
        true
    }
    /// Memory the export offers to receive a WRITE payload of `length`
    /// bytes at `offset` into, before `write` / `try_write` get it (as the
    /// `Bytes` it freezes into): memory the export can keep without a copy
    /// where a copy would otherwise be made (vouch: the landing area its
    /// held log names instead of copying the blocks). The server asks only
    /// for large, block-aligned payloads. `None`, the default: the server
    /// receives into a buffer of its own.
    fn payload_buffer(&self, offset: u64, length: usize) -> Option<Box<dyn PayloadBuffer>> {
        let _ = (offset, length);
        None
    }
    /// Write `data` at `offset`. The export may keep `data` (a clone shares
    /// it) instead of copying it: the server received it into a buffer of
    /// its own, starting on a page boundary.
    fn write(&self, offset: u64, data: &Bytes, fua: bool) -> Result<(), ExportError>;
    /// `write` without FUA, only if it can complete without blocking (e.g.
    /// into a write-back buffer with room): `None` when it would block, with
    /// nothing written, and the server then calls `write` on a worker. Runs
    /// on the async reactor like `try_read`. The default always would block.
    fn try_write(&self, offset: u64, data: &Bytes) -> Option<Result<(), ExportError>> {
        let _ = (offset, data);
        None
    }
    /// Start a WRITE without FUA that completes later, if it can be
    /// started without blocking (a mirror whose remote legs answer on
    /// their connections' threads): the export takes `done` and calls
    /// `WriteCompletion::complete` once, from any thread, when the write
    /// is done (the reply is sent then; dropping it unanswered answers
    /// EIO). `Err(done)`, with nothing written, when it cannot; the server
    /// then calls `write` on a worker. Runs on the async reactor like
    /// `try_write`, after `try_write` declined. The default always
    /// declines.
    fn try_start_write(
        &self,
        offset: u64,
        data: &Bytes,
        done: WriteCompletion,
    ) -> Result<(), WriteCompletion> {
        let _ = (offset, data);
        Err(done)
    }
    fn flush(&self) -> Result<(), ExportError>;
    /// FLUSH through `done`, which the export completes once as soon as
    /// every write completed before it is durable, possibly before this
    /// returns (then the server replies while the export finishes what
    /// the flush does not wait for). Runs on a worker. The default
    /// completes it with `flush`.
    fn flush_then(&self, done: WriteCompletion) {
        done.complete(self.flush());
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), ExportError>;
    /// Zero `length` bytes at `offset`; see [`ZeroFlags`] for what each flag demands.
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<(), ExportError>;
    fn cache(&self, offset: u64, length: u64) -> Result<(), ExportError>;
    /// base:allocation extents covering at least [offset, offset+1) and at most `length` bytes.
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, ExportError>;
    /// The names of the `qemu:dirty-bitmap:NAME` contexts the export
    /// offers, asked at each LIST / SET_META_CONTEXT (so bitmaps made
    /// while serving appear on the next negotiation). The default: none.
    fn dirty_bitmaps(&self) -> Vec<String> {
        Vec::new()
    }
    /// `qemu:dirty-bitmap:NAME`: runs of `(bytes, dirty)` from `offset`,
    /// covering at least [offset, offset+1) and at most `length` bytes.
    fn dirty_status(
        &self,
        bitmap: &str,
        offset: u64,
        length: u64,
    ) -> Result<Vec<(u64, bool)>, ExportError> {
        let _ = (offset, length);
        Err(ExportError::no_context(&format!("dirty bitmap {bitmap:?}")))
    }
    /// Whether the export offers `qemu:allocation-depth` (asked at each
    /// LIST / SET_META_CONTEXT).
    fn can_allocation_depth(&self) -> bool {
        false
    }
    /// `qemu:allocation-depth`: runs of `(bytes, depth)` from `offset` (0
    /// never written, 1 written in this export, 2 from the layer below),
    /// covering at least [offset, offset+1) and at most `length` bytes.
    fn allocation_depth(&self, offset: u64, length: u64) -> Result<Vec<(u64, u32)>, ExportError> {
        let _ = (offset, length);
        Err(ExportError::no_context("qemu:allocation-depth"))
    }
    /// Whether the export offers the `x-vouch:integrity` metadata context.
    fn can_integrity_status(&self) -> bool {
        false
    }
    /// `x-vouch:integrity`: verify the blocks from `offset` now and say
    /// what was found, covering at least [offset, offset+1) and at most
    /// `length` bytes (an export may check less than asked, to bound the
    /// request's time; the client asks again for the rest).
    fn integrity_status(
        &self,
        offset: u64,
        length: u64,
    ) -> Result<Vec<IntegrityExtent>, ExportError> {
        let _ = (offset, length);
        Err(ExportError::new(
            Errno::NotSup,
            "this export has no integrity metadata context",
        ))
    }
}
