//! The production backend: a volume's objects as files in a directory.
//!
//! Page cache or not. By default data segments go through the host page
//! cache (like qemu's cache=writeback); `serve --direct` opens them
//! O_DIRECT (cache=none: `direct.rs` handles alignment, bounce buffers in
//! 2 MiB huge pages and a commit's home writes batched through io_uring).
//! O_DIRECT writes into a hole allocate as they are issued, and pipelined
//! commits issue a stream's writes a little out of file order, so a run of
//! `PREPARE_FROM` or more that continues a stream (within `PREPARE_STEP`
//! of where one of the last `STREAMS` long runs ended) first allocates its
//! chunk of the segment and the next one, once per process
//! (`prepare_ahead`: one `fallocate` each, inside the file's length,
//! reading as zeros until written); scattered writes allocate only what
//! they write.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use parking_lot::Mutex;
use vouch_format::Geometry;

use super::direct;
use super::ring_read::{ReadLater, ReadRing};
use super::{
    objects_of, reflink_unsupported, write_runs_in_turn, CloneRange, CloneTiming, Mapped, ObjectId,
    Run, RunError, Storage, IOV_MAX,
};

/// How `FileStorage::open_objects` opens a volume's files.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FileOpen {
    /// Read-write, under an exclusive lock (otherwise read-only, shared lock).
    pub writable: bool,
    /// Data segments bypass the page cache (O_DIRECT, like qemu's cache=none).
    pub direct: bool,
}

impl FileOpen {
    pub const WRITABLE: FileOpen = FileOpen {
        writable: true,
        direct: false,
    };
}

/// Objects as files in a directory: the production backend (pread/pwrite,
/// fdatasync, fallocate(PUNCH_HOLE), lseek(SEEK_DATA)). With `direct`, the
/// data segments are opened O_DIRECT and batched writes go through io_uring
/// (`direct.rs`); the superblock, journal and contexts stay buffered.
pub struct FileStorage {
    /// The volume directory (a reflink probe makes a nameless file in it).
    dir: PathBuf,
    /// Reads that complete later (`start_read`), set up by `read_events`;
    /// `Some(None)` when io_uring is unavailable. First, so that it is
    /// dropped (waiting for reads in flight) before the files close.
    /// Shared with the storage `reopen` makes (an online resize): the
    /// server watches this ring's descriptor for the volume's life. A
    /// storage is never dropped with its reads in flight in a shared ring:
    /// each read's completion holds the engine that owns the storage
    /// (`Volume::try_begin_read`).
    reads: OnceLock<Option<std::sync::Arc<ReadRing>>>,
    superblock: File,
    journal: File,
    contexts: Option<File>,
    data: Vec<File>,
    /// The written map; `None` in a volume made before it, opened read-only.
    written: Option<File>,
    /// The held log's slots (`HeldFiles`), outside the directory: those a
    /// previous process of this boot left, or made by `prepare_held`.
    held: OnceLock<HeldFiles>,
    /// Opened for writing (so it can make the held log).
    writable: bool,
    direct: bool,
    /// Direct writes: the ring and the envelope arena (writes to data are
    /// serialized by the engine's commit lock anyway).
    writer: Mutex<DirectWriter>,
    /// Direct writes: what `prepare_ahead` allocated and the streams it
    /// follows.
    ahead: Mutex<Ahead>,
}

/// `prepare_ahead`'s state.
#[derive(Default)]
struct Ahead {
    /// The `PREPARE_STEP` chunks allocated ahead by this process, by
    /// (segment, chunk).
    chunks: std::collections::HashSet<(u32, u64)>,
    /// Where the last long runs ended, (segment, offset), newest first:
    /// at most `STREAMS`.
    heads: std::collections::VecDeque<(u32, u64)>,
}

/// The sequential streams `prepare_ahead` follows at once (a guest
/// filling several files).
const STREAMS: usize = 8;

/// A direct write's run of at least this many bytes may be a stream's (a
/// large write, or a commit's merged sequential writes): if it continues
/// one, the chunks it lands in and the one after are allocated ahead
/// (`prepare_ahead`). Smaller runs allocate only what they write.
const PREPARE_FROM: u64 = 512 << 10;

/// The step `prepare_ahead` allocates a data segment in.
const PREPARE_STEP: u64 = 32 << 20;

#[derive(Default)]
struct DirectWriter {
    /// Created on first use; `Some(None)` once io_uring proved unavailable.
    ring: Option<Option<io_uring::IoUring>>,
    arena: Option<direct::AlignedBuf>,
}

impl FileStorage {
    /// Create the directory and every object, sparse, at its nominal length.
    /// Fails if `dir` exists and is not an empty directory.
    pub fn create(dir: &Path, geometry: &Geometry, journal_bytes: u64) -> io::Result<FileStorage> {
        match std::fs::read_dir(dir) {
            Ok(mut entries) => {
                if entries.next().is_some() {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!("{} already exists and is not empty", dir.display()),
                    ));
                }
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => std::fs::create_dir(dir)?,
            Err(error) if error.kind() == io::ErrorKind::NotADirectory => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} already exists and is not a directory", dir.display()),
                ))
            }
            Err(error) => return Err(error),
        }
        for object in objects_of(geometry) {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(dir.join(object.file_name()))?;
            let len = match object {
                ObjectId::Superblock => 2 * 4096,
                ObjectId::Journal => journal_bytes,
                ObjectId::Contexts => geometry.contexts_len(),
                ObjectId::Data(segment) => geometry.segment_len(segment),
                // Written by the volume's first open (it starts empty); the
                // held log is not in the directory (`HeldFiles`).
                ObjectId::Written | ObjectId::Held(_) => 0,
            };
            file.set_len(len)?;
            if object == ObjectId::Journal {
                // Reserve the journal's space now, so a full filesystem fails
                // here, cleanly, and never in the middle of a commit.
                if let Err(error) = allocate(&file, 0, len) {
                    if error.raw_os_error() != Some(libc::EOPNOTSUPP) {
                        return Err(error);
                    }
                }
            }
        }
        File::open(dir)?.sync_all()?;
        FileStorage::open_objects(dir, geometry, FileOpen::WRITABLE)
    }

    /// Open just the superblock file, to learn the geometry. A path that
    /// is not a volume directory is refused saying what it is instead.
    pub fn open_superblock(dir: &Path) -> io::Result<File> {
        let not_a_volume = |what: &str| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} is not a vouch volume ({what})", dir.display()),
            )
        };
        match std::fs::metadata(dir) {
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{} does not exist", dir.display()),
                ))
            }
            Err(error) => return Err(error),
            Ok(metadata) if !metadata.is_dir() => {
                return Err(not_a_volume("not a directory; a volume is a directory"))
            }
            Ok(_) => {}
        }
        match File::open(dir.join(ObjectId::Superblock.file_name())) {
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                let empty = std::fs::read_dir(dir)?.next().is_none();
                Err(not_a_volume(if empty {
                    "an empty directory"
                } else {
                    "a directory without a superblock file"
                }))
            }
            other => other,
        }
    }

    /// Does another process hold the volume at `dir` open for writing?
    /// Probed with the shared lock a reader takes (`lock_volume`), which
    /// is released at once: nothing is opened for writing.
    pub fn held_for_writing(dir: &Path) -> io::Result<bool> {
        let superblock = FileStorage::open_superblock(dir)?;
        match lock_volume(&superblock, dir, false) {
            Ok(()) => Ok(false),
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => Ok(true),
            Err(error) => Err(error),
        }
    }

    /// The volume at `dir`'s superblock file, under the exclusive lock a
    /// writable open takes: while it is held no other vouch process opens
    /// the volume (a snapshot's files are cloned under it).
    pub fn lock_for_writing(dir: &Path) -> io::Result<File> {
        let superblock = FileStorage::open_superblock(dir)?;
        lock_volume(&superblock, dir, true)?;
        Ok(superblock)
    }

    /// The superblock file of the read-only volume at `dir` (an overlay
    /// snapshot), under the shared lock a read-only open takes: a delete
    /// of it (`lock_for_writing`) is refused while it is held.
    pub fn lock_for_reading(dir: &Path) -> io::Result<File> {
        let superblock = FileStorage::open_superblock(dir)?;
        lock_volume(&superblock, dir, false)?;
        Ok(superblock)
    }

    /// Open every object of an existing volume (see `FileOpen`).
    pub fn open_objects(dir: &Path, geometry: &Geometry, how: FileOpen) -> io::Result<FileStorage> {
        FileStorage::open_locked(dir, geometry, how, None)
    }

    /// `open_objects`; with `superblock`, that open superblock file (a
    /// duplicate of a storage's that holds the volume's lock: the lock is
    /// the open file's, so it is shared, not taken again).
    fn open_locked(
        dir: &Path,
        geometry: &Geometry,
        how: FileOpen,
        superblock: Option<File>,
    ) -> io::Result<FileStorage> {
        let FileOpen { writable, direct } = how;
        let open = |object: ObjectId| -> io::Result<File> {
            let path = dir.join(object.file_name());
            let flags = if direct && matches!(object, ObjectId::Data(_)) {
                libc::O_DIRECT
            } else {
                0
            };
            OpenOptions::new()
                .read(true)
                .write(writable)
                .custom_flags(flags)
                .open(&path)
                .map_err(|error| {
                    let hint = if flags != 0 && error.raw_os_error() == Some(libc::EINVAL) {
                        " (this filesystem does not support O_DIRECT: open without --direct)"
                    } else {
                        ""
                    };
                    if error.kind() == io::ErrorKind::NotFound && object != ObjectId::Superblock {
                        // A missing file is never read as never-written blocks.
                        return io::Error::new(
                            error.kind(),
                            format!(
                                "{} is missing: every file of the volume is needed and its blocks cannot be read without it; restore it from a copy of the volume (or, on a mirror, replace this leg with `vouch mirror replace`)",
                                path.display()
                            ),
                        );
                    }
                    io::Error::new(error.kind(), format!("{}: {error}{hint}", path.display()))
                })
        };
        // Volumes made before the written map have no `written` file: a
        // writable open creates it (empty; `Engine::open` decides what an
        // empty map means), a read-only open goes without.
        let written_path = dir.join(ObjectId::Written.file_name());
        let written = match OpenOptions::new()
            .read(true)
            .write(writable)
            .create(writable)
            .open(&written_path)
        {
            Ok(file) => Some(file),
            Err(error) if error.kind() == io::ErrorKind::NotFound => None,
            Err(error) => {
                return Err(io::Error::new(
                    error.kind(),
                    format!("{}: {error}", written_path.display()),
                ))
            }
        };
        let superblock = match superblock {
            Some(file) => file,
            None => {
                let file = open(ObjectId::Superblock)?;
                lock_volume(&file, dir, writable)?;
                file
            }
        };
        let held = OnceLock::new();
        if let Some(files) = HeldFiles::find(dir, writable)? {
            let _ = held.set(files);
        }
        Ok(FileStorage {
            dir: dir.to_path_buf(),
            superblock,
            journal: open(ObjectId::Journal)?,
            contexts: if geometry.has_context_table() {
                Some(open(ObjectId::Contexts)?)
            } else {
                None
            },
            data: (0..geometry.segments())
                .map(|segment| open(ObjectId::Data(segment)))
                .collect::<io::Result<_>>()?,
            written,
            held,
            writable,
            direct,
            writer: Mutex::new(DirectWriter::default()),
            ahead: Mutex::new(Ahead::default()),
            reads: OnceLock::new(),
        })
    }

    /// Before a direct write: allocate the `PREPARE_STEP` chunks a long
    /// run that continues a stream lands in, and the chunk after, each
    /// once per process, in one `fallocate` apiece. O_DIRECT writes into a
    /// hole allocate as they are issued, and pipelined commits issue a
    /// stream's writes a little out of file order, so ext4 gave a 1 GiB
    /// packed data file filled by 1 MiB writes at QD8 75-90 extents (9-24
    /// before pipelining); a chunk allocated whole is allocated in one
    /// piece where free space allows.
    ///
    /// A run continues a stream when it starts within `PREPARE_STEP` of
    /// where one of the last `STREAMS` long runs ended (either side: the
    /// stream's writes come a little out of order). A long run anywhere
    /// else (a guest's scattered 1 MiB writebacks) only becomes a stream's
    /// head and allocates nothing ahead, nor does any run under
    /// `PREPARE_FROM`: a volume written at random stays sparse.
    ///
    /// What it allocates reads as zeros until written (unwritten extents),
    /// exactly as the hole did: a block's state is the written map's and
    /// its context's, never the extent's, and `SEEK_DATA` may call such a
    /// range data or hole alike (`next_data_on_disk` says "may"). Only
    /// inside the file's length, so the length every file is checked
    /// against (FORMAT.md, "Files shorter than the volume needs") never
    /// moves. Advisory: a failure (a full filesystem, no `fallocate`)
    /// leaves the write to allocate its own blocks as before. A trimmed
    /// hole in a chunk a stream prepares later is allocated again, still
    /// reading as zeros and still trimmed by the written map.
    fn prepare_ahead(&self, object: ObjectId, file: &File, runs: &[Run<'_>]) {
        let ObjectId::Data(segment) = object else {
            return;
        };
        if !runs.iter().any(|run| run.len() >= PREPARE_FROM) {
            return;
        }
        let mut ahead = self.ahead.lock();
        let Ahead { chunks, heads } = &mut *ahead;
        let mut file_len = None;
        for run in runs.iter().filter(|run| run.len() >= PREPARE_FROM) {
            let (start, end) = (run.offset, run.offset + run.len());
            let near = heads
                .iter()
                .position(|&(at, head)| at == segment && start.abs_diff(head) <= PREPARE_STEP);
            match near {
                Some(index) => {
                    heads.remove(index);
                }
                None => heads.truncate(STREAMS - 1),
            }
            heads.push_front((segment, end));
            if near.is_none() {
                continue;
            }
            for chunk in start / PREPARE_STEP..=(end - 1) / PREPARE_STEP + 1 {
                if !chunks.insert((segment, chunk)) {
                    continue;
                }
                let len = *file_len.get_or_insert_with(|| file.metadata().map_or(0, |m| m.len()));
                let from = chunk * PREPARE_STEP;
                if from < len {
                    let _ = allocate(file, from, PREPARE_STEP.min(len - from));
                }
            }
        }
    }

    fn is_direct(&self, object: ObjectId) -> bool {
        self.direct && matches!(object, ObjectId::Data(_))
    }

    fn file(&self, object: ObjectId) -> io::Result<&File> {
        match object {
            ObjectId::Superblock => Ok(&self.superblock),
            ObjectId::Journal => Ok(&self.journal),
            ObjectId::Contexts => self.contexts.as_ref().ok_or_else(|| no_object(object)),
            ObjectId::Data(segment) => self
                .data
                .get(segment as usize)
                .ok_or_else(|| no_object(object)),
            ObjectId::Written => self.written.as_ref().ok_or_else(|| no_object(object)),
            ObjectId::Held(slot) => self
                .held
                .get()
                .and_then(|held| held.files.get(slot as usize))
                .ok_or_else(|| no_object(object)),
        }
    }
}

/// The held log's two slot files (`ObjectId::Held`, `held.rs`). They live
/// in memory that outlives the process but not the machine: the first of
/// `$VOUCH_RUNTIME_DIR`, systemd's `$RUNTIME_DIRECTORY`, `/dev/shm`, the
/// temporary directory; named after the volume directory's device and
/// inode (`vouch-DEV-INO.held0`/`.held1`, mode 0600). The directory's
/// `held` file records where they are and under which boot
/// (`BOOT_ID PREFIX`), so a restart in the same boot finds them wherever
/// the previous process put them; after a reboot they are gone, as a
/// power cut takes what was not flushed.
///
/// A writable open maps each slot shared (`HELD_WINDOW` bytes of address
/// space; the file's pages are allocated by `grow_held` before they are
/// touched, so a full tmpfs is ENOSPC there and never a SIGBUS here):
/// records are copied in with `memcpy`, beside one another, instead of a
/// `pwritev` each. Stores to a shared mapping are in the file the moment
/// they are made, so a crash of the process keeps them as it keeps a
/// returned pwrite.
struct HeldFiles {
    files: [File; 2],
    paths: [PathBuf; 2],
    pointer: PathBuf,
    /// Found where the pointer said (a previous process of this boot).
    named: bool,
    maps: [Option<memmap2::MmapRaw>; 2],
    /// Where large write payloads are received (`Storage::landing_window`),
    /// beside the slots: `PREFIX.landing`.
    landing: Option<LandingFile>,
    /// The runtime directory's filesystem cannot allocate ahead
    /// (`fallocate` unsupported): a store into a page it has no room for
    /// would stop the process, so every write goes through `pwritev`.
    unmapped: std::sync::atomic::AtomicBool,
}

/// The landing file: a write's payload received straight into it is what
/// the held log's landed records point at (`engine/src/landing.rs`). At
/// most `GROW_LIMIT` of it (there) is ever allocated.
struct LandingFile {
    file: File,
    path: PathBuf,
    /// Mapped shared for a writable open (`LANDING_WINDOW` bytes).
    map: Option<memmap2::MmapRaw>,
}

/// Address space mapped for the landing file (the engine allocates in it
/// only as far as the most it ever has in use at once, at most its
/// `GROW_LIMIT`); a payload that finds no room is received into process
/// memory instead.
const LANDING_WINDOW: u64 = 1 << 30;

impl LandingFile {
    /// The landing file beside the slots `prefix` names: a new one
    /// (`fresh`), else the one a previous process left (none if it left
    /// none: slots an older vouch made; nothing is created). Landing is
    /// only a way to save a copy, so a file that cannot be made or mapped
    /// means none (payloads are received into process memory), never a
    /// refused open; replay then refuses only if a live record needs it.
    fn open(prefix: &Path, writable: bool, fresh: bool) -> Option<LandingFile> {
        let mut name = prefix.as_os_str().to_owned();
        name.push(".landing");
        let path = PathBuf::from(name);
        if !fresh && !path.exists() {
            return None;
        }
        let opened = open_slot(&path, writable, fresh).and_then(|file| {
            let map = match writable {
                true => Some(
                    memmap2::MmapOptions::new()
                        .len(LANDING_WINDOW as usize)
                        .map_raw(&file)?,
                ),
                false => None,
            };
            Ok(LandingFile {
                file,
                path: path.clone(),
                map,
            })
        });
        match opened {
            Ok(landing) => Some(landing),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "no landing file: write payloads are received into process memory");
                None
            }
        }
    }
}

/// Address space mapped per held slot. A slot holds at most about twice
/// the write-back limit (64 MiB by default) plus the writes in flight; a
/// record past the window is written with `pwritev` instead.
const HELD_WINDOW: u64 = 1 << 30;

/// Records of at least this many bytes are streamed into the held log
/// (`copy_into_held`).
const STREAM_FROM: usize = 64 << 10;

/// Copy `from` to `to`. The held log is written and not read again
/// (unless the process crashed), so a large record's parts are stored
/// around the cache (`stream`: non-temporal stores, SSE2, every x86-64
/// has it): a 1 MiB record then costs about 40 µs instead of 63 µs here,
/// and does not evict what the commit and the socket are working on. A
/// record under `STREAM_FROM` (a 4 KiB write, the common small one) is
/// copied plainly: into the cache it costs less, and the fence after
/// streamed stores waits for them to reach memory, which a small write
/// would pay on every request. Large payloads from NBD are landed and not
/// copied at all; a replica's and an encrypted volume's are streamed.
///
/// # Safety
/// `to` must be valid for `from.len()` bytes of writes, not overlapping
/// `from`.
unsafe fn copy_into_held(to: *mut u8, from: &[u8], stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if stream && from.len() >= 1024 {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let mut to = to;
        let mut from = from;
        let head = to.align_offset(16).min(from.len());
        // SAFETY: within the caller's range.
        unsafe {
            std::ptr::copy_nonoverlapping(from.as_ptr(), to, head);
            to = to.add(head);
        }
        from = &from[head..];
        let mut chunks = from.chunks_exact(16);
        for chunk in &mut chunks {
            // SAFETY: `to` is 16-byte aligned and within the caller's
            // range; the load is unaligned from a 16-byte chunk.
            unsafe {
                let value = _mm_loadu_si128(chunk.as_ptr().cast::<__m128i>());
                _mm_stream_si128(to.cast::<__m128i>(), value);
                to = to.add(16);
            }
        }
        let tail = chunks.remainder();
        // SAFETY: the rest of the caller's range.
        unsafe { std::ptr::copy_nonoverlapping(tail.as_ptr(), to, tail.len()) };
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = stream;
    // SAFETY: as the caller promises.
    unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), to, from.len()) };
}

/// Order the non-temporal stores `copy_into_held` made before later stores.
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE (every x86-64); a fence has no other effect.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

fn map_slot(file: &File, writable: bool) -> io::Result<Option<memmap2::MmapRaw>> {
    if !writable {
        return Ok(None);
    }
    memmap2::MmapOptions::new()
        .len(HELD_WINDOW as usize)
        .map_raw(file)
        .map(Some)
}

/// Allocate `len` bytes of `file` at `from` (`fallocate` mode 0: the
/// blocks, or tmpfs pages, are reserved and the file extended over them),
/// so a full filesystem fails here rather than at a later write or store.
pub(crate) fn allocate(file: &File, from: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on an open descriptor with plain integers.
    let result =
        unsafe { libc::fallocate(file.as_raw_fd(), 0, from as libc::off_t, len as libc::off_t) };
    match result {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// The file in a volume directory that says where its held log is.
pub const HELD_POINTER: &str = "held";

impl HeldFiles {
    /// The slots a process of this boot left (the directory's `held` file
    /// names them), if any. Nothing is created: a refused open leaves the
    /// volume as it was (`prepare_held` makes them).
    fn find(dir: &Path, writable: bool) -> io::Result<Option<HeldFiles>> {
        let pointer = dir.join(HELD_POINTER);
        let boot = boot_text();
        let prefix = match std::fs::read_to_string(&pointer) {
            Ok(text) => text
                .trim_end_matches('\n')
                .split_once(' ')
                .filter(|(recorded_boot, _)| *recorded_boot == boot)
                .map(|(_, prefix)| PathBuf::from(prefix)),
            Err(error) if error.kind() == io::ErrorKind::NotFound => None,
            Err(error) => {
                return Err(io::Error::new(
                    error.kind(),
                    format!("{}: {error}", pointer.display()),
                ))
            }
        };
        let Some(prefix) = prefix else {
            return Ok(None);
        };
        let paths = slot_paths(&prefix);
        if let Some(missing) = paths.iter().find(|path| !path.exists()) {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "{} is missing: {} says the writes a vouch process acknowledged and had not yet committed were held there (in memory, since this machine booted), and they cannot be recovered without it; to open the volume without them, remove {}",
                    missing.display(),
                    pointer.display(),
                    pointer.display()
                ),
            ));
        }
        let files = [
            open_slot(&paths[0], writable, false)?,
            open_slot(&paths[1], writable, false)?,
        ];
        let maps = [
            map_slot(&files[0], writable)?,
            map_slot(&files[1], writable)?,
        ];
        let landing = LandingFile::open(&prefix, writable, false);
        Ok(Some(HeldFiles {
            files,
            paths,
            pointer,
            named: true,
            maps,
            landing,
            unmapped: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// New slots for a writable open, each holding its header page from
    /// `headers`, and only then the directory's `held` file naming them
    /// (written whole, then renamed into place): a crash before the rename
    /// leaves slots nobody points at; after it, slots with headers.
    fn create(dir: &Path, headers: [&[u8]; 2]) -> io::Result<HeldFiles> {
        let prefix = held_prefix(dir)?;
        let paths = slot_paths(&prefix);
        let files = [
            open_slot(&paths[0], true, true)?,
            open_slot(&paths[1], true, true)?,
        ];
        for ((file, header), path) in files.iter().zip(headers).zip(&paths) {
            file.write_all_at(header, 0).map_err(|error| {
                io::Error::new(error.kind(), format!("{}: {error}", path.display()))
            })?;
        }
        let maps = [map_slot(&files[0], true)?, map_slot(&files[1], true)?];
        let landing = LandingFile::open(&prefix, true, true);
        let pointer = dir.join(HELD_POINTER);
        let text = format!("{} {}\n", boot_text(), prefix.display());
        let temporary = dir.join(format!("{HELD_POINTER}.new"));
        // Neither file nor directory is fsynced: the pointer names this
        // boot and is ignored after a reboot (the held slots it names do
        // not outlive one), and within a boot a rename is seen by every
        // later process whether or not it reached the disk.
        std::fs::write(&temporary, text)
            .and_then(|()| std::fs::rename(&temporary, &pointer))
            .map_err(|error| {
                io::Error::new(error.kind(), format!("{}: {error}", pointer.display()))
            })?;
        Ok(HeldFiles {
            files,
            paths,
            pointer,
            named: false,
            maps,
            landing,
            unmapped: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The mapping of `slot` if `[at, at + len)` lies inside it.
    fn mapped(&self, slot: u8, at: u64, len: usize) -> Option<*mut u8> {
        if self.unmapped.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let map = self.maps.get(slot as usize)?.as_ref()?;
        let end = at.checked_add(len as u64)?;
        // SAFETY: `at < end <= HELD_WINDOW`, the mapping's length.
        (end <= map.len() as u64).then(|| unsafe { map.as_mut_ptr().add(at as usize) })
    }

    /// After a clean close: the pointer first (a crash between leaves
    /// files nobody points at, emptied by the close's commit), then the
    /// slots.
    fn release(&self) -> io::Result<()> {
        let landing = self.landing.as_ref().map(|landing| &landing.path);
        for path in std::iter::once(&self.pointer)
            .chain(&self.paths)
            .chain(landing)
        {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => {
                    return Err(io::Error::new(
                        error.kind(),
                        format!("{}: {error}", path.display()),
                    ))
                }
            }
        }
        Ok(())
    }
}

fn boot_text() -> String {
    uuid::Uuid::from_bytes(super::current_boot_id())
        .hyphenated()
        .to_string()
}

fn slot_paths(prefix: &Path) -> [PathBuf; 2] {
    [0, 1].map(|slot| {
        let mut name = prefix.as_os_str().to_owned();
        name.push(format!(".held{slot}"));
        PathBuf::from(name)
    })
}

fn open_slot(path: &Path, writable: bool, fresh: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(writable)
        .create(fresh)
        .truncate(fresh)
        .mode(0o600)
        .open(path)
        .map_err(|error| io::Error::new(error.kind(), format!("{}: {error}", path.display())))
}

/// Where a volume directory's held log goes: see `HeldFiles`.
fn held_prefix(dir: &Path) -> io::Result<PathBuf> {
    use std::os::unix::fs::MetadataExt as _;
    let runtime = std::env::var_os("VOUCH_RUNTIME_DIR")
        .filter(|value| !value.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var("RUNTIME_DIRECTORY")
                .ok()
                .and_then(|value| value.split(':').next().map(PathBuf::from))
                .filter(|path| !path.as_os_str().is_empty())
        })
        .or_else(|| Some(PathBuf::from("/dev/shm")).filter(|path| path.is_dir()))
        .unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&runtime)
        .map_err(|error| io::Error::new(error.kind(), format!("{}: {error}", runtime.display())))?;
    let metadata = std::fs::metadata(dir)?;
    Ok(runtime.join(format!("vouch-{}-{}", metadata.dev(), metadata.ino())))
}

/// One writer or any number of readers per volume, across processes: an
/// advisory lock on the superblock file, held while the volume is open.
/// Two writers would each trust their own buffers and journal positions and
/// destroy each other's acknowledged data.
/// The first offset at or after `offset` of `file` that may hold data
/// (`SEEK_DATA`), or `None` when only holes follow.
pub(crate) fn next_data_of(file: &File, offset: u64) -> io::Result<Option<u64>> {
    // SAFETY: lseek on a valid, open file descriptor.
    let at = unsafe { libc::lseek(file.as_raw_fd(), offset as libc::off_t, libc::SEEK_DATA) };
    if at >= 0 {
        return Ok(Some(at as u64));
    }
    let error = io::Error::last_os_error();
    match error.raw_os_error() {
        Some(libc::ENXIO) => Ok(None),
        // No SEEK_DATA support: everything may hold data.
        Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => Ok(Some(offset)),
        _ => Err(error),
    }
}

fn lock_volume(superblock: &File, dir: &Path, writable: bool) -> io::Result<()> {
    let mode = if writable {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    };
    // A lock can outlive its holder's close by a moment: a process that
    // forks (any `Command` in it) shares the open file until the child
    // execs. So a refusal is retried for a short while before it counts.
    let mut attempts = 0;
    let error = loop {
        // SAFETY: flock on a valid, open file descriptor.
        let rc = unsafe { libc::flock(superblock.as_raw_fd(), mode | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        attempts += 1;
        if error.raw_os_error() != Some(libc::EWOULDBLOCK) || attempts == 20 {
            break error;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    if error.raw_os_error() == Some(libc::EWOULDBLOCK) {
        let holder = if writable {
            "another vouch process has it open"
        } else {
            "another vouch process has it open for writing"
        };
        return Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!("{} is in use: {holder}", dir.display()),
        ));
    }
    Err(error)
}

/// The most a buffered write hands the kernel in one call; longer writes
/// are cut at multiples of it in the file (a write no longer than it goes
/// whole, wherever it starts).
///
/// The page cache sizes the folios of a write by its length (ext4 and xfs
/// have large folios), and on a guest with free page reporting
/// (virtio-balloon, `page_reporting_order` 9: free 2 MiB blocks are handed
/// back to the host) the folios of long writes come back from the host
/// one fault at a time: the large folios are cut from the largest free
/// blocks, the ones that were reported. Measured on such a guest, 1 GiB
/// written into a new file from memory: 1.3-2.6 s of CPU in writes of
/// 1-32 MiB, 0.29-0.39 s in writes of 256-512 KiB, and 0.24-0.28 s either
/// way with reporting held (order 11). A commit's home writes are runs of
/// many MiB, so an import paid it on every block; qemu-nbd and nbdkit
/// write each NBD request (nbdcopy's 256 KiB) on its own and did not.
/// A write of at most 256 KiB is still one `pwritev`.
///
/// The folios stay that size for the writes that come after, and for a
/// later 4 KiB write they are the cheaper kind: ext4 walks every block of
/// the folio a write lands in (`ext4_block_write_begin`,
/// `block_commit_write`), 64 in a 256 KiB folio against 512 in a 2 MiB
/// one. Measured for 4 KiB random overwrites: 3.0 us per write in
/// `ext4_block_write_begin` at QD1 in 256 KiB folios against 4.7 in 2 MiB
/// ones (8.8 against 63 us with a flush every 8, under SCHED_FIFO); a
/// volume filled through the pieces whose data file was written again in
/// 2 MiB writes (2 MiB folios, the same extents) took 18.5-35 us of
/// server CPU per write against 15.8-25 for the same written again in
/// 256 KiB writes, pair by pair (a busy guest). On a quiet guest the same
/// writes run 1.4-2.7x slower after a fill through the pieces than after
/// one without, whichever binary serves (measured twice, on two guests);
/// the slower runs' server threads sleep between nearly every write, the
/// faster ones' on half of them, and a busy guest shows no gap. What the
/// pieces' fill leaves that costs a quiet guest those sleeps is not found:
/// not the extents, and not, by the pairs above, the folio size alone.
///
/// Crash ordering: none changes. The pieces are written in turn before
/// the call returns, as one `pwritev` would be, which the kernel also
/// copies folio by folio: a crash in the middle leaves a prefix either
/// way, and every caller orders its fsync after the whole call.
const PAGE_CACHE_PIECE: u64 = 256 << 10;

/// `pwritev` all of `parts` at `offset`, through short writes and EINTR.
fn pwritev_all(file: &File, parts: &[&[u8]], offset: u64) -> io::Result<()> {
    if let [data] = parts {
        // One slice (most random writes): a plain pwrite, no iovec array.
        return file.write_all_at(data, offset);
    }
    let fd = file.as_raw_fd();
    let mut iovecs: Vec<libc::iovec> = parts
        .iter()
        .map(|part| libc::iovec {
            iov_base: part.as_ptr() as *mut libc::c_void,
            iov_len: part.len(),
        })
        .collect();
    let mut first = 0usize;
    let mut at = offset;
    while first < iovecs.len() {
        let count = (iovecs.len() - first).min(IOV_MAX);
        // SAFETY: every iovec points into a live slice of `parts` (or a
        // suffix of one, adjusted below), none is written through.
        let written = unsafe {
            libc::pwritev(
                fd,
                iovecs[first..].as_ptr(),
                count as libc::c_int,
                at as libc::off_t,
            )
        };
        if written < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        if written == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev wrote nothing",
            ));
        }
        let mut left = written as usize;
        at += left as u64;
        // Skip fully written iovecs; trim a partly written one.
        while left > 0 {
            let iovec = &mut iovecs[first];
            if left >= iovec.iov_len {
                left -= iovec.iov_len;
                first += 1;
            } else {
                // SAFETY: advancing within the same slice by fewer bytes than its length.
                iovec.iov_base =
                    unsafe { (iovec.iov_base as *mut u8).add(left) } as *mut libc::c_void;
                iovec.iov_len -= left;
                left = 0;
            }
        }
    }
    Ok(())
}

fn no_object(object: ObjectId) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("volume has no object {object:?}"),
    )
}

impl Storage for FileStorage {
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let file = self.file(object)?;
        if self.is_direct(object) {
            return direct::read_direct(file, offset, buf);
        }
        // Past the end of file the rest reads as zero (sparse tail).
        direct::read_full(file, offset, buf)
    }

    fn read_at_nowait(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        // O_DIRECT reads never come from the page cache: decline them.
        if self.is_direct(object) {
            return Err(super::nowait::would_block());
        }
        super::nowait::read_full_nowait(self.file(object)?, offset, buf)
    }

    fn start_read(
        &self,
        object: ObjectId,
        offset: u64,
        len: usize,
        done: ReadLater,
    ) -> Result<(), ReadLater> {
        let Some(Some(ring)) = self.reads.get() else {
            return Err(done);
        };
        match (object, self.file(object)) {
            (ObjectId::Data(_), Ok(file)) => ring.start(file.as_raw_fd(), offset, len, done),
            _ => Err(done),
        }
    }

    fn read_events(&self) -> Option<RawFd> {
        let ring = self.reads.get_or_init(|| match ReadRing::new() {
            Ok(ring) => Some(std::sync::Arc::new(ring)),
            Err(error) => {
                tracing::warn!(%error, "io_uring unavailable: reads that wait go to a worker thread");
                None
            }
        });
        ring.as_ref().map(|ring| ring.events_fd())
    }

    fn reap_reads(&self) -> io::Result<()> {
        match self.reads.get() {
            Some(Some(ring)) => ring.reap(),
            _ => Err(super::nowait::would_block()),
        }
    }

    fn reads_ready(&self) -> bool {
        matches!(self.reads.get(), Some(Some(_)))
    }

    fn reads_in_flight(&self) -> usize {
        match self.reads.get() {
            Some(Some(ring)) => ring.in_flight(),
            _ => 0,
        }
    }

    fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
        self.write_vectored_at(object, offset, &[data])
    }

    fn write_runs(&self, object: ObjectId, runs: &[Run<'_>]) -> Result<(), RunError> {
        if !self.is_direct(object) {
            return write_runs_in_turn(self, object, runs);
        }
        let file = self.file(object).map_err(|error| RunError {
            offset: runs.first().map_or(0, |run| run.offset),
            error,
        })?;
        self.prepare_ahead(object, file, runs);
        let mut writer = self.writer.lock();
        let DirectWriter { ring, arena } = &mut *writer;
        let ring = ring.get_or_insert_with(direct::new_ring);
        direct::write_runs(file, ring.as_mut(), arena, runs)
    }

    fn write_vectored_at(&self, object: ObjectId, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        if self.is_direct(object) {
            // Synchronous, so no ring: one aligned write (or read-modify-write).
            let file = self.file(object)?;
            let runs = [Run { offset, parts }];
            self.prepare_ahead(object, file, &runs);
            let mut writer = self.writer.lock();
            return direct::write_runs(file, None, &mut writer.arena, &runs)
                .map_err(|failed| failed.error);
        }
        let file = self.file(object)?;
        let total: usize = parts.iter().map(|part| part.len()).sum();
        if total <= PAGE_CACHE_PIECE as usize {
            // No longer than a piece (every 4 KiB write, most small runs, a
            // journal record): as it is, one syscall, with no piece list
            // to build, even across a piece's boundary. The kernel sizes a
            // folio by what is left of the write and aligns it to its size,
            // so such a write makes no folio larger than a piece whether or
            // not it is cut there (cutting a journal record at the boundary
            // made a second `pwrite64` for 1 flush in 8: issue 29).
            return pwritev_all(file, parts, offset);
        }
        let mut piece: Vec<&[u8]> = Vec::new();
        let mut at = offset;
        let mut rest = parts.iter().copied().filter(|part| !part.is_empty());
        let mut part: &[u8] = &[];
        loop {
            // Gather up to the next PAGE_CACHE_PIECE boundary of the file.
            let room = (PAGE_CACHE_PIECE - at % PAGE_CACHE_PIECE) as usize;
            let mut filled = 0;
            piece.clear();
            while filled < room {
                if part.is_empty() {
                    match rest.next() {
                        Some(next) => part = next,
                        None => break,
                    }
                }
                let take = part.len().min(room - filled);
                piece.push(&part[..take]);
                part = &part[take..];
                filled += take;
            }
            if filled == 0 {
                return Ok(());
            }
            pwritev_all(file, &piece, at)?;
            at += filled as u64;
        }
    }

    fn sync(&self, object: ObjectId) -> io::Result<()> {
        self.file(object)?.sync_data()
    }

    fn sync_each(&self, objects: &[ObjectId]) -> Result<(), (ObjectId, io::Error)> {
        // A thread per object, at most SYNC_THREADS at a time: each
        // fdatasync waits for its own flush, and flushes issued together
        // are merged by the block layer (and by ext4's journal commit), so
        // a few objects cost about one flush. A thread that cannot be
        // started leaves its object to this thread, in turn.
        const SYNC_THREADS: usize = 16;
        let sync = |object: ObjectId| self.sync(object).map_err(|error| (object, error));
        if objects.len() < 2 {
            return objects.iter().try_for_each(|&object| sync(object));
        }
        for batch in objects.chunks(SYNC_THREADS) {
            std::thread::scope(|scope| {
                let started: Vec<_> = batch
                    .iter()
                    .map(|&object| {
                        let thread = std::thread::Builder::new()
                            .name("vouch-sync".into())
                            .spawn_scoped(scope, move || sync(object));
                        (object, thread)
                    })
                    .collect();
                let mut first = Ok(());
                for (object, thread) in started {
                    let done = match thread {
                        Ok(thread) => thread
                            .join()
                            .unwrap_or_else(|_| Err((object, io::Error::other("sync panicked")))),
                        Err(_) => sync(object),
                    };
                    if first.is_ok() {
                        first = done;
                    }
                }
                first
            })?;
        }
        Ok(())
    }

    fn punch_hole(&self, object: ObjectId, offset: u64, len: u64) -> io::Result<()> {
        let file = self.file(object)?;
        // SAFETY: fallocate on a valid, open file descriptor with plain integers.
        let rc = unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::EOPNOTSUPP) {
            // No hole punching here: write zeroes instead, same meaning.
            let zeros = vec![0u8; 1 << 20];
            let mut at = offset;
            while at < offset + len {
                let n = (offset + len - at).min(zeros.len() as u64) as usize;
                self.write_at(object, at, &zeros[..n])?;
                at += n as u64;
            }
            return Ok(());
        }
        Err(error)
    }

    fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>> {
        next_data_of(self.file(object)?, offset)
    }

    fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64> {
        use std::os::unix::fs::MetadataExt;
        Ok(self.file(object)?.metadata()?.blocks() * 512)
    }

    fn object_len(&self, object: ObjectId) -> io::Result<Option<u64>> {
        match self.file(object) {
            Ok(file) => Ok(Some(file.metadata()?.len())),
            // No such object (a volume made before the written map).
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(Some(0)),
            Err(error) => Err(error),
        }
    }

    fn has_held(&self) -> bool {
        self.writable || self.held.get().is_some()
    }

    fn prepare_held(&self, headers: [&[u8]; 2]) -> io::Result<()> {
        if self.held.get().is_some() {
            return Ok(());
        }
        let files = HeldFiles::create(&self.dir, headers)?;
        let _ = self.held.set(files);
        Ok(())
    }

    fn held_named(&self) -> bool {
        self.held.get().is_some_and(|held| held.named)
    }

    fn grow_held(&self, slot: u8, from: u64, end: u64) -> io::Result<()> {
        let file = self.file(ObjectId::Held(slot))?;
        if let Err(error) = allocate(file, from, end.saturating_sub(from)) {
            if error.raw_os_error() == Some(libc::EOPNOTSUPP) {
                if let Some(held) = self.held.get() {
                    held.unmapped
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                }
                return Ok(());
            }
            return Err(error);
        }
        Ok(())
    }

    fn write_held(&self, slot: u8, at: u64, parts: &[&[u8]]) -> io::Result<()> {
        let len = parts.iter().map(|part| part.len()).sum();
        let held = self
            .held
            .get()
            .ok_or_else(|| no_object(ObjectId::Held(slot)))?;
        let Some(mut to) = held.mapped(slot, at, len) else {
            return self.write_vectored_at(ObjectId::Held(slot), at, parts);
        };
        // A record's parts are its entries and one part per 4 KiB block:
        // whether to stream is the whole record's size, not a part's.
        let stream = len >= STREAM_FROM;
        for part in parts {
            // SAFETY: `mapped` checked `[at, at + len)` is inside the
            // mapping, and `grow_held` allocated it in the file (no
            // SIGBUS); the engine gives each writer a range of its own.
            unsafe {
                copy_into_held(to, part, stream);
                to = to.add(part.len());
            }
        }
        // Streamed stores are weakly ordered: fence them before the
        // record's `done` word (`publish_held`) can be stored. Plain
        // stores are ordered before it by the word's release store.
        if stream {
            store_fence();
        }
        Ok(())
    }

    fn publish_held(&self, slot: u8, at: u64, word: u64) -> io::Result<()> {
        let held = self
            .held
            .get()
            .ok_or_else(|| no_object(ObjectId::Held(slot)))?;
        let Some(to) = held
            .mapped(slot, at, 8)
            .filter(|to| (*to as usize).is_multiple_of(8))
        else {
            return self.write_at(ObjectId::Held(slot), at, &word.to_le_bytes());
        };
        // SAFETY: inside the mapping and allocated (as in `write_held`),
        // 8-byte aligned; only this writer touches this word. Release:
        // the body copied before is in the file before the word is.
        let word_at = unsafe { std::sync::atomic::AtomicU64::from_ptr(to.cast::<u64>()) };
        word_at.store(word.to_le(), std::sync::atomic::Ordering::Release);
        Ok(())
    }

    fn store_held_pair(&self, slot: u8, at: u64, bytes: [u8; 16]) -> io::Result<()> {
        let held = self
            .held
            .get()
            .ok_or_else(|| no_object(ObjectId::Held(slot)))?;
        #[cfg(target_arch = "x86_64")]
        if let Some(to) = held
            .mapped(slot, at, 16)
            .filter(|to| (*to as usize).is_multiple_of(16))
        {
            // One instruction stores the 16 bytes: a crash of the process
            // falls before it or after it, and a store that retired reaches
            // the file's page whatever becomes of the process (an inline
            // `movdqa`, so the compiler cannot cut it in two). No syscall:
            // the `pwrite` this replaces was one per commit.
            // SAFETY: inside the mapping, 16-byte aligned, and in a page
            // the file has (the engine stores here only into the header
            // page it wrote whole before: `HeldSlots::empty`); the caller
            // holds the log's lock and no copy into this slot is in flight.
            unsafe {
                let value = std::arch::x86_64::_mm_loadu_si128(
                    bytes.as_ptr().cast::<std::arch::x86_64::__m128i>(),
                );
                std::arch::asm!(
                    "movdqa xmmword ptr [{to}], {value}",
                    to = in(reg) to,
                    value = in(xmm_reg) value,
                    options(nostack, preserves_flags),
                );
            }
            return Ok(());
        }
        let _ = held;
        self.write_at(ObjectId::Held(slot), at, &bytes)
    }

    fn landing_window(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        let held = self.held.get()?;
        if held.unmapped.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let map = held.landing.as_ref()?.map.as_ref()?;
        std::ptr::NonNull::new(map.as_mut_ptr()).map(|base| (base, map.len()))
    }

    fn grow_landing(&self, from: u64, end: u64) -> io::Result<()> {
        let landing = self
            .held
            .get()
            .and_then(|held| held.landing.as_ref())
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no landing file"))?;
        // A store into the allocated range never meets a SIGBUS.
        // Unsupported (EOPNOTSUPP) is an error here: the caller receives
        // into process memory instead.
        allocate(&landing.file, from, end.saturating_sub(from))
    }

    fn read_landing(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
        let landing = self
            .held
            .get()
            .and_then(|held| held.landing.as_ref())
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, "the landing file is missing")
            })?;
        landing.file.read_exact_at(buf, at).map_err(|error| {
            io::Error::new(error.kind(), format!("{}: {error}", landing.path.display()))
        })
    }

    /// The files again, sharing this storage's lock (`Volume::resize_online`).
    fn reopen(&self, geometry: &Geometry) -> io::Result<std::sync::Arc<dyn Storage>> {
        let how = FileOpen {
            writable: self.writable,
            direct: self.direct,
        };
        let superblock = self.superblock.try_clone()?;
        let storage = FileStorage::open_locked(&self.dir, geometry, how, Some(superblock))?;
        // The same ring of reads: the server watches its descriptor (set
        // up once, `read_events`), so reads of the new engine use it too.
        if let Some(ring) = self.reads.get() {
            let _ = storage.reads.set(ring.clone());
        }
        Ok(std::sync::Arc::new(storage))
    }

    fn release_held(&self) -> io::Result<()> {
        match self.held.get() {
            Some(held) => held.release(),
            None => Ok(()),
        }
    }

    fn clone_range(&self, clone: CloneRange<'_>) -> io::Result<()> {
        let source = clone
            .source
            .file_of(clone.source_object)
            .ok_or_else(|| reflink_unsupported("the source volume is not stored in files"))?;
        ficlonerange(
            self.file(clone.object)?,
            clone.offset,
            source,
            clone.source_offset,
            clone.len,
        )
    }

    fn probe_clone(&self, source: &dyn Storage, source_object: ObjectId) -> io::Result<()> {
        let source = source
            .file_of(source_object)
            .ok_or_else(|| reflink_unsupported("the source volume is not stored in files"))?;
        // A nameless file in this volume's directory: the same filesystem
        // as the data segments, gone when it is closed.
        let scratch = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_TMPFILE)
            .open(&self.dir)?;
        ficlonerange(&scratch, 0, source, 0, 4096)
    }

    fn measure_clone(
        &self,
        source: &dyn Storage,
        source_object: ObjectId,
        len: u64,
    ) -> io::Result<CloneTiming> {
        let source = source
            .file_of(source_object)
            .ok_or_else(|| reflink_unsupported("the source volume is not stored in files"))?;
        // Whole 4 KiB pages, within the source file (a clone past its end
        // is refused).
        let len = (len.min(source.metadata()?.len()) / 4096) * 4096;
        if len == 0 {
            return Err(reflink_unsupported("the source segment is empty"));
        }
        let scratch = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_TMPFILE)
            .open(&self.dir)?;
        let mut bytes = crate::buffer::PageBuffer::new(len as usize);
        source.read_exact_at(&mut bytes, 0)?;
        let started = std::time::Instant::now();
        scratch.write_all_at(&bytes, 0)?;
        scratch.sync_data()?;
        let write = started.elapsed();
        let started = std::time::Instant::now();
        ficlonerange(&scratch, len, source, 0, len)?;
        scratch.sync_data()?;
        let clone = started.elapsed();
        Ok(CloneTiming {
            bytes: len,
            write,
            clone,
        })
    }

    fn map_for_check(&self, object: ObjectId, offset: u64, len: u64) -> Option<Mapped> {
        if self.is_direct(object) || len == 0 {
            return None;
        }
        let file = self.file(object).ok()?;
        if offset.checked_add(len)? > file.metadata().ok()?.len() {
            return None;
        }
        // SAFETY: a shared read-only mapping of a file this volume holds
        // open and locked (`lock_volume`); vouch never shrinks an open
        // volume's objects, and the range was checked to lie inside the
        // file. Another process truncating the file while it is mapped
        // would make a read of the view fault (SIGBUS) — outside the
        // volume's contract, like writing into its files.
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(offset)
                .len(usize::try_from(len).ok()?)
                .map(file)
        }
        .ok()?;
        Some(Mapped(map))
    }

    fn drop_cached(&self, object: ObjectId, offset: u64, len: u64) {
        if let Ok(file) = self.file(object) {
            // SAFETY: posix_fadvise on a valid, open file descriptor; a
            // hint, whose failure changes nothing.
            unsafe {
                libc::posix_fadvise(
                    file.as_raw_fd(),
                    offset as libc::off_t,
                    len as libc::off_t,
                    libc::POSIX_FADV_DONTNEED,
                )
            };
        }
    }

    fn file_of(&self, object: ObjectId) -> Option<&File> {
        self.file(object).ok()
    }
}

/// `ioctl(FICLONERANGE)`: `destination` at `offset` shares `len` bytes of
/// `source` at `source_offset`. The errors that mean "this filesystem (or
/// this pair of files) cannot share extents" become `Unsupported`.
pub(crate) fn ficlonerange(
    destination: &File,
    offset: u64,
    source: &File,
    source_offset: u64,
    len: u64,
) -> io::Result<()> {
    let range = libc::file_clone_range {
        src_fd: i64::from(source.as_raw_fd()),
        src_offset: source_offset,
        src_length: len,
        dest_offset: offset,
    };
    // SAFETY: FICLONERANGE reads one `file_clone_range` that lives for the
    // call; both descriptors are open files.
    let rc = unsafe { libc::ioctl(destination.as_raw_fd(), libc::FICLONERANGE, &range) };
    if rc == 0 {
        return Ok(());
    }
    Err(clone_error(io::Error::last_os_error()))
}

/// `ioctl(FICLONE)`: `destination` (empty) becomes the whole of `source`,
/// sharing every extent (a snapshot's files, `snapshot.rs`).
pub(crate) fn ficlone(destination: &File, source: &File) -> io::Result<()> {
    // SAFETY: FICLONE takes the source descriptor as its argument; both
    // descriptors are open files.
    let rc = unsafe { libc::ioctl(destination.as_raw_fd(), libc::FICLONE, source.as_raw_fd()) };
    if rc == 0 {
        return Ok(());
    }
    Err(clone_error(io::Error::last_os_error()))
}

/// A clone's error, those that mean "this filesystem (or this pair of
/// files) cannot share extents" as `Unsupported`.
fn clone_error(error: io::Error) -> io::Error {
    match error.raw_os_error() {
        Some(libc::EOPNOTSUPP | libc::ENOTTY | libc::ENOSYS) => {
            reflink_unsupported(format!("the filesystem cannot share extents ({error})"))
        }
        Some(libc::EXDEV) => reflink_unsupported(format!(
            "source and destination are on different filesystems ({error})"
        )),
        Some(libc::EINVAL) => {
            reflink_unsupported(format!("the filesystem refused the range ({error})"))
        }
        _ => error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An 8 MiB split volume's objects in `dir`.
    fn small_volume(dir: &Path) -> FileStorage {
        let geometry =
            Geometry::new(vouch_format::LayoutKind::Split, 8 << 20, 1 << 28).expect("geometry");
        FileStorage::create(&dir.join("v"), &geometry, 1 << 20).expect("create")
    }

    #[test]
    fn vectored_writes_of_more_than_iov_max_parts_land_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let storage = small_volume(dir.path());
        let blocks: Vec<Vec<u8>> = (0..1500u32)
            .map(|i| vec![(i % 251) as u8; 512 + (i as usize % 3)])
            .collect();
        let parts: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
        storage
            .write_vectored_at(ObjectId::Data(0), 4096, &parts)
            .expect("pwritev");
        let expected = parts.concat();
        let mut back = vec![0u8; expected.len()];
        storage
            .read_at(ObjectId::Data(0), 4096, &mut back)
            .expect("read");
        assert!(back == expected);
    }

    /// A buffered write longer than `PAGE_CACHE_PIECE` is cut into pieces
    /// at multiples of it in the file: parts larger than a piece, parts cut
    /// across a boundary, an empty part and an unaligned start all land
    /// where one write would have put them.
    #[test]
    fn a_long_buffered_write_lands_whole_in_pieces() {
        let dir = tempfile::tempdir().expect("tempdir");
        let storage = small_volume(dir.path());
        let piece = PAGE_CACHE_PIECE as usize;
        let sizes = [
            3 * piece + 4096,
            0,
            100 << 10,
            4096,
            piece - 1,
            1,
            2 * piece,
        ];
        let blocks: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &len)| (0..len).map(|at| (at * 7 + i * 13) as u8).collect())
            .collect();
        let parts: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
        let offset = piece as u64 - 8192 + 512;
        storage
            .write_vectored_at(ObjectId::Data(0), offset, &parts)
            .expect("pwritev");
        let single = offset + (4 << 20);
        storage
            .write_at(ObjectId::Data(0), single, parts[0])
            .expect("pwrite");
        let expected = parts.concat();
        let mut back = vec![0u8; expected.len()];
        storage
            .read_at(ObjectId::Data(0), offset, &mut back)
            .expect("read");
        assert!(back == expected, "the vectored write");
        let mut back = vec![0u8; parts[0].len()];
        storage
            .read_at(ObjectId::Data(0), single, &mut back)
            .expect("read");
        assert!(back == parts[0], "the single write");
    }

    /// A long direct write that continues a stream (starts near where a
    /// recent one ended, either side) allocates its chunk and the next
    /// ahead, in whole `PREPARE_STEP`s: a pipelined stream's writes,
    /// issued a little out of order, then land in one allocation instead
    /// of fragmenting the file. A lone long write (a scattered writeback)
    /// and a 4 KiB one allocate only themselves; nothing is allocated past
    /// the file's length, which never moves.
    #[test]
    fn a_long_direct_write_that_continues_a_stream_allocates_ahead() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let len = 8 * PREPARE_STEP;
        let geometry =
            Geometry::new(vouch_format::LayoutKind::Split, len, 1 << 30).expect("geometry");
        let volume = dir.path().join("v");
        drop(FileStorage::create(&volume, &geometry, 1 << 20).expect("create"));
        let direct = FileOpen {
            writable: true,
            direct: true,
        };
        let storage = FileStorage::open_objects(&volume, &geometry, direct).expect("open direct");
        let path = volume.join(ObjectId::Data(0).file_name());
        let allocated = || std::fs::metadata(&path).expect("stat").blocks() * 512;
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), len);
        assert!(allocated() < 1 << 20, "created sparse");

        let data = vec![7u8; 1 << 20];
        let parts: [&[u8]; 1] = [&data];
        let mib = 1u64 << 20;
        let write = |offset: u64, parts: &[&[u8]]| {
            storage
                .write_runs(ObjectId::Data(0), &[Run { offset, parts }])
                .expect("write");
        };
        // Lone long writes, far apart: each only itself.
        write(PREPARE_STEP / 2, &parts);
        write(4 * PREPARE_STEP, &parts);
        assert!(
            allocated() < 4 * mib,
            "two lone 1 MiB writes allocated {} bytes",
            allocated()
        );
        // The stream that began at PREPARE_STEP / 2, its next write
        // arriving ahead of the one before it: chunks 0 and 1.
        write(PREPARE_STEP / 2 + 2 * mib, &parts);
        assert!(
            allocated() >= 2 * PREPARE_STEP && allocated() < 3 * PREPARE_STEP,
            "a stream's 1 MiB write in chunk 0 allocated {} bytes, not chunks 0 and 1",
            allocated()
        );
        write(PREPARE_STEP / 2 + mib, &parts);
        let mut back = vec![1u8; 1 << 20];
        storage
            .read_at(ObjectId::Data(0), PREPARE_STEP + 4096, &mut back)
            .expect("read");
        assert!(
            back.iter().all(|&byte| byte == 0),
            "allocated ahead reads as zeros"
        );

        let before = allocated();
        let small: [&[u8]; 1] = [&data[..4096]];
        write(6 * PREPARE_STEP, &small);
        write(6 * PREPARE_STEP + 4096, &small);
        assert!(
            allocated() - before < mib,
            "4 KiB writes allocated nothing ahead"
        );

        write(len - 2 * mib, &parts);
        write(len - mib, &parts);
        assert_eq!(
            std::fs::metadata(&path).expect("stat").len(),
            len,
            "the length never moves"
        );
        assert!(
            allocated() < 4 * PREPARE_STEP,
            "the stream at the end allocated its last chunk only: {} bytes",
            allocated()
        );
    }
}
