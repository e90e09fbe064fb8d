//! The `Storage` trait under the engine, and its backends.
//!
//! A volume is a directory of objects (files): the superblock, the journal,
//! the context table (split layout) and data segments. The engine only ever
//! uses positioned reads and writes, syncs, hole punching and (for reflink
//! copies) extent sharing, so the same
//! trait is served by real files (`file.rs`, with O_DIRECT and io_uring in
//! `direct.rs`) and by the simulated backend in `sim.rs` that the crash and
//! fault tests use.

use std::io;

use vouch_format::Geometry;

pub mod before;
pub mod direct;
pub mod imaged;
pub mod nowait;
pub mod overlay;
pub mod ring_read;
pub mod sim;

pub use nowait::Wait;
pub use ring_read::ReadLater;

/// Most iovecs one pwritev takes (Linux UIO_MAXIOV).
pub(crate) const IOV_MAX: usize = 1024;

/// A resize's map of the new size (`resize.rs`), until the superblock
/// switch is followed by its rename over `written`.
pub const RESIZE_MAP_FILE: &str = "written.resize";

/// One object (file) of a volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ObjectId {
    Superblock,
    Journal,
    Contexts,
    Data(u32),
    /// The written map (volumes with the WRITTEN_MAP flag).
    Written,
    /// A slot (0 or 1) of the held log (`held.rs`): kept in memory that
    /// outlives the process, not in the volume directory, and lost with
    /// the machine (a power cut).
    Held(u8),
}

impl ObjectId {
    pub fn file_name(self) -> String {
        match self {
            ObjectId::Superblock => "superblock".to_string(),
            ObjectId::Journal => "journal".to_string(),
            ObjectId::Contexts => "contexts".to_string(),
            ObjectId::Data(segment) => Geometry::segment_name(segment),
            ObjectId::Written => "written".to_string(),
            ObjectId::Held(slot) => format!("held{slot}"),
        }
    }
}

/// Positioned I/O over a volume's objects. Implementations are shared by
/// many threads; every method is safe to call concurrently.
pub trait Storage: Send + Sync {
    /// Read exactly `buf.len()` bytes at `offset`. Bytes past the end of the
    /// object, and holes, read as zero.
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// `read_at` without waiting for the device: `ErrorKind::WouldBlock`
    /// when some byte is not in memory (the page cache). The default, for
    /// storage that cannot tell, always would block.
    fn read_at_nowait(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let _ = (object, offset, buf);
        Err(nowait::would_block())
    }
    /// Start reading `len` bytes (whole 4 KiB pages) of a data object at
    /// `offset` without waiting for them (`ring_read`): `done` is called
    /// from `reap_reads`. `Err(done)`, with nothing started, when this
    /// storage cannot, or nobody called `read_events` (nobody would reap).
    /// The default cannot.
    fn start_read(
        &self,
        object: ObjectId,
        offset: u64,
        len: usize,
        done: ReadLater,
    ) -> Result<(), ReadLater> {
        let _ = (object, offset, len);
        Err(done)
    }
    /// Set up reads that complete later and return the descriptor that
    /// becomes readable when some have: the caller promises to call
    /// `reap_reads` then. `None` when this storage has none (the default).
    fn read_events(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    /// Call the callbacks of the reads that completed, on this thread;
    /// `Err(WouldBlock)` once there are no more (see `ReadRing::reap`).
    fn reap_reads(&self) -> io::Result<()> {
        Err(nowait::would_block())
    }
    /// Whether `start_read` can start reads now (`read_events` set them
    /// up and io_uring is there): callers check before planning one.
    fn reads_ready(&self) -> bool {
        false
    }
    /// Reads started and not yet handed to their callbacks.
    fn reads_in_flight(&self) -> usize {
        0
    }
    /// Write all of `data` at `offset`.
    fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Write the concatenation of `parts` at `offset`: one I/O for a run of
    /// blocks without copying them together first. The default concatenates.
    fn write_vectored_at(&self, object: ObjectId, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        self.write_at(object, offset, &parts.concat())
    }
    /// Write several non-overlapping runs to one object. They may reach the
    /// storage in any order and concurrently (callers order dependent writes
    /// with `sync`). The default writes them one after the other.
    /// A failure names the run it hit (`RunError::offset`).
    fn write_runs(&self, object: ObjectId, runs: &[Run<'_>]) -> Result<(), RunError> {
        write_runs_in_turn(self, object, runs)
    }
    /// Make every completed write to `object` durable.
    fn sync(&self, object: ObjectId) -> io::Result<()>;
    /// `sync` of each of `objects`, all done when it returns; the first
    /// failure names its object. The default syncs them in turn (the
    /// simulator's order stays the one its crash points count); files sync
    /// them at once, so their device cache flushes overlap.
    fn sync_each(&self, objects: &[ObjectId]) -> Result<(), (ObjectId, io::Error)> {
        for &object in objects {
            self.sync(object).map_err(|error| (object, error))?;
        }
        Ok(())
    }
    /// Deallocate a range; it reads as zero afterwards. Like a write, it is
    /// durable only after `sync`.
    fn punch_hole(&self, object: ObjectId, offset: u64, len: u64) -> io::Result<()>;
    /// The first offset at or after `offset` that may hold data (SEEK_DATA),
    /// or `None` when only holes follow. Used to skip sparse regions.
    fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>>;
    /// Bytes of real storage allocated to `object` (for `info`).
    fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64>;

    /// The length of `object` when this storage keeps one that can fall
    /// short of what the volume needs (a file cut short or emptied);
    /// `None` when it cannot tell (the default: objects grow as written).
    fn object_len(&self, object: ObjectId) -> io::Result<Option<u64>> {
        let _ = object;
        Ok(None)
    }

    /// Make `len` bytes of `object` at `offset` share the bytes of
    /// `source`'s `source_object` at `source_offset` (reflink,
    /// `FICLONERANGE`), without copying them. Offsets and `len` are
    /// multiples of 4 KiB; within one object the ranges do not overlap.
    /// Like a write, the result is durable only after `sync(object)`.
    /// Storage that cannot share extents (or not with this source) fails
    /// with `ErrorKind::Unsupported` ("reflink not supported here").
    fn clone_range(&self, clone: CloneRange<'_>) -> io::Result<()> {
        let _ = clone;
        Err(reflink_unsupported("this storage cannot share extents"))
    }

    /// Check, changing no object, that `clone_range` from `source`'s
    /// `source_object` into this storage can work: `Unsupported` if not.
    fn probe_clone(&self, source: &dyn Storage, source_object: ObjectId) -> io::Result<()> {
        let _ = (source, source_object);
        Err(reflink_unsupported("this storage cannot share extents"))
    }

    /// Time the two ways a copy can land `len` bytes of `source`'s
    /// `source_object` (from offset 0) here, on scratch space that no
    /// object uses: written, and cloned, each made durable. `Unsupported`
    /// when this storage cannot share extents with `source` (or cannot
    /// measure). Called once per volume pair by the copy's `Auto` method.
    fn measure_clone(
        &self,
        source: &dyn Storage,
        source_object: ObjectId,
        len: u64,
    ) -> io::Result<CloneTiming> {
        let _ = (source, source_object, len);
        Err(reflink_unsupported("this storage cannot measure a clone"))
    }

    /// A read-only view of `len` bytes of `object` at `offset` (a multiple
    /// of 4 KiB), mapped instead of copied, for a check that reads a range
    /// once and keeps nothing (a reflink copy's verify): `None` when this
    /// storage cannot map (the default; O_DIRECT files, which bypass the
    /// page cache) or the range reaches past the end of the object. Its
    /// bytes are reached through `Mapped::bytes`, which brings them into
    /// memory first and says `None` for a range that cannot be read: the
    /// caller then uses `read_at`, which reports it as an error.
    fn map_for_check(&self, object: ObjectId, offset: u64, len: u64) -> Option<Mapped> {
        let _ = (object, offset, len);
        None
    }

    /// Advise that `len` bytes of `object` at `offset` will be replaced
    /// without being read (a reflink clone onto them): their clean cached
    /// pages may be dropped now, by the caller's thread, rather than by
    /// the clone. Only a hint: nothing changes what the range reads. The
    /// default does nothing.
    fn drop_cached(&self, object: ObjectId, offset: u64, len: u64) {
        let _ = (object, offset, len);
    }

    /// Whether this storage keeps the held log's slots (`ObjectId::Held`):
    /// memory that survives the process but not the machine. The default
    /// has none, and a volume on it keeps acknowledged writes only in its
    /// write-back buffer until they commit.
    fn has_held(&self) -> bool {
        false
    }

    /// The running kernel's boot (`/proc/sys/kernel/random/boot_id`): the
    /// held log's slots are believed only within the boot that wrote them.
    fn boot_id(&self) -> [u8; 16] {
        current_boot_id()
    }

    /// Make the held log's slots if this storage keeps them where a new
    /// process can find them (a writable open, before anything is
    /// appended), each starting with its header page from `headers`, and
    /// only then say where they are: a slot a new process is pointed at
    /// always has a header. The default has nothing to make.
    fn prepare_held(&self, headers: [&[u8]; 2]) -> io::Result<()> {
        let _ = headers;
        Ok(())
    }

    /// Whether the held log's slots were found where a process of this
    /// boot said it held writes (a slot then has its header: one that does
    /// not is damage, not emptiness). The default never says so.
    fn held_named(&self) -> bool {
        false
    }

    /// Make held slot `slot` able to take bytes `[from, end)` (everything
    /// before `from` already can) without a later `write_held` failing
    /// for room: memory allocated now, so a full tmpfs is an error here,
    /// before anything of the write is visible. The default grows as
    /// written.
    fn grow_held(&self, slot: u8, from: u64, end: u64) -> io::Result<()> {
        let _ = (slot, from, end);
        Ok(())
    }

    /// Copy `parts` into held slot `slot` at `at`. Several threads call
    /// this at once for disjoint ranges (each record's body is copied by
    /// its writer alone), within what `grow_held` made room for.
    fn write_held(&self, slot: u8, at: u64, parts: &[&[u8]]) -> io::Result<()> {
        self.write_vectored_at(ObjectId::Held(slot), at, parts)
    }

    /// Store the little-endian `word` at `at` (8-byte aligned) of held
    /// slot `slot` once everything this thread wrote to it before is
    /// there: a record's `done` mark, set after its body.
    fn publish_held(&self, slot: u8, at: u64, word: u64) -> io::Result<()> {
        self.write_at(ObjectId::Held(slot), at, &word.to_le_bytes())
    }

    /// Replace the 16 bytes at `at` (16-byte aligned) of held slot `slot`
    /// with `bytes` so that a crash of the process leaves either the old
    /// 16 or the new, never a mix: an emptied slot's new `epoch` and its
    /// header's CRC (`HeldLog::empty`). The default writes them with one
    /// `pwrite`, which a crash of the process does not cut.
    fn store_held_pair(&self, slot: u8, at: u64, bytes: [u8; 16]) -> io::Result<()> {
        self.write_at(ObjectId::Held(slot), at, &bytes)
    }

    /// The landing area (`landing.rs`): memory of the held log's kind,
    /// mapped, that a large write's payload is received straight into, so
    /// the held log records where it is instead of copying it. Its base
    /// and length in bytes; `None` where there is none (the default).
    fn landing_window(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        None
    }

    /// Make the landing area's bytes `[from, end)` able to take stores
    /// (allocated, so a full tmpfs is an error here and never a fault on
    /// the store).
    fn grow_landing(&self, from: u64, end: u64) -> io::Result<()> {
        let _ = (from, end);
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this storage has no landing area",
        ))
    }

    /// Read `buf.len()` bytes of the landing area at `at` (a landed
    /// record's blocks, at replay).
    fn read_landing(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
        let _ = (at, buf);
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            "this storage has no landing area",
        ))
    }

    /// The volume was closed cleanly: the held log's slots (empty now)
    /// and whatever points at them may go. The default does nothing.
    fn release_held(&self) -> io::Result<()> {
        Ok(())
    }

    /// The same volume opened again for `geometry` (after an online
    /// resize changed its files), under the lock this storage holds. The
    /// default cannot.
    fn reopen(&self, geometry: &vouch_format::Geometry) -> io::Result<std::sync::Arc<dyn Storage>> {
        let _ = geometry;
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this storage cannot be opened again at another size",
        ))
    }

    /// The open file behind `object`, when this storage is backed by files
    /// (a reflink from another volume's storage needs its descriptor).
    fn file_of(&self, object: ObjectId) -> Option<&std::fs::File> {
        let _ = object;
        None
    }

    /// The before-image layer (`before.rs`) when this storage is one: a
    /// fenced snapshot arms it. The default is none.
    fn before_images(&self) -> Option<&before::BeforeImages> {
        None
    }
}

/// Bytes of an object mapped read-only by `Storage::map_for_check`; they
/// stay mapped until this is dropped.
pub struct Mapped(pub(crate) memmap2::Mmap);

impl Mapped {
    /// `len` bytes of the view at `offset`, every page of them faulted in
    /// first (MADV_POPULATE_READ): `None` when some page cannot be read —
    /// where touching it unpopulated would stop the process (SIGBUS). A
    /// page reclaimed between this and the caller's read is read again
    /// then; only a device error in that window would stop the process,
    /// and it stops: it never reads wrong bytes.
    pub fn bytes(&self, offset: usize, len: usize) -> Option<&[u8]> {
        let end = offset.checked_add(len).filter(|end| *end <= self.0.len())?;
        self.0
            .advise_range(memmap2::Advice::PopulateRead, offset, len)
            .ok()?;
        Some(&self.0[offset..end])
    }
}

/// One `Storage::clone_range` request: `len` bytes of `source`'s
/// `source_object` at `source_offset` shared into `object` at `offset`.
pub struct CloneRange<'a> {
    pub object: ObjectId,
    pub offset: u64,
    pub source: &'a dyn Storage,
    pub source_object: ObjectId,
    pub source_offset: u64,
    pub len: u64,
}

/// What `Storage::measure_clone` measured: `bytes` written (and synced),
/// and the same bytes cloned (and synced).
#[derive(Clone, Copy, Debug)]
pub struct CloneTiming {
    pub bytes: u64,
    pub write: std::time::Duration,
    pub clone: std::time::Duration,
}

/// The error of a reflink the storage cannot do (`ErrorKind::Unsupported`).
pub fn reflink_unsupported(why: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("reflink not supported here: {why}"),
    )
}

/// `Storage::write_runs` one run after the other.
pub(crate) fn write_runs_in_turn<S: Storage + ?Sized>(
    storage: &S,
    object: ObjectId,
    runs: &[Run<'_>],
) -> Result<(), RunError> {
    for run in runs {
        storage
            .write_vectored_at(object, run.offset, run.parts)
            .map_err(|error| RunError {
                offset: run.offset,
                error,
            })?;
    }
    Ok(())
}

/// A batch write (`Storage::write_runs`) that failed: the offset of the run
/// whose write failed (not the batch's first), and the cause.
#[derive(Debug)]
pub struct RunError {
    pub offset: u64,
    pub error: io::Error,
}

/// One run of bytes to write at `offset`: the concatenation of `parts`.
pub struct Run<'a> {
    pub offset: u64,
    pub parts: &'a [&'a [u8]],
}

impl Run<'_> {
    pub fn len(&self) -> u64 {
        self.parts.iter().map(|part| part.len() as u64).sum()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The running kernel's boot id (zero if the kernel does not say).
pub fn current_boot_id() -> [u8; 16] {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .and_then(|text| uuid::Uuid::parse_str(text.trim()).ok())
        .map(|id| *id.as_bytes())
        .unwrap_or([0; 16])
}

/// The objects a volume of this geometry has.
pub fn objects_of(geometry: &Geometry) -> Vec<ObjectId> {
    let mut objects = vec![ObjectId::Superblock, ObjectId::Journal];
    if geometry.has_context_table() {
        objects.push(ObjectId::Contexts);
    }
    objects.extend((0..geometry.segments()).map(ObjectId::Data));
    objects.push(ObjectId::Written);
    objects
}

mod file;
pub(crate) use file::{allocate, ficlone, ficlonerange};
pub use file::{FileOpen, FileStorage, HELD_POINTER};
