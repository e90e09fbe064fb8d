//! What a volume holds in memory between the client and home storage, under
//! one reader-writer lock: the write-back buffer (blocks acknowledged, not
//! yet committed), the commit in flight, and the contexts not yet
//! checkpointed (`ContextStore`). Readers plan under the shared lock;
//! writers, commits and checkpoints take it exclusively.

use std::collections::BTreeMap;
use std::ops::Range;

use bytes::Bytes;

use vouch_format::{Context, FormatError, BLOCK_SIZE, CONTEXT_BYTES};

use parking_lot::RwLock;

use crate::backing::Backing;
use crate::contexts::{ContextStore, Lookup, Page, CONTEXTS_PER_PAGE};
use crate::error::Result;
use crate::protection::Seal;
use crate::storage::ObjectId;

pub type Block = [u8; BLOCK_SIZE as usize];
pub const BLOCK: u64 = BLOCK_SIZE as u64;

/// One block's bytes (exactly `BLOCK`), shared without copying: a block
/// of its own, a 4 KiB window of a larger buffer kept whole, or the static
/// zero block. An NBD WRITE's payload is buffered, journaled and written
/// home from the buffer it was received into, and a mirrored write hands
/// the same bytes to every leg. Immutable once made: a block is sealed
/// (and, encrypted, enciphered) before it becomes a `BlockData`.
///
/// A window keeps its whole buffer alive: a buffered window whose
/// neighbours were overwritten holds more memory than its 4 KiB, which
/// the write-back buffer counts (`VolumeState::held_blocks`).
#[derive(Clone)]
pub struct BlockData {
    bytes: Bytes,
    /// A window of a buffer longer than one block.
    window: bool,
}

/// The bytes of a never-written block, shared by every zero `BlockData`.
static ZERO_BLOCK: Block = [0u8; BLOCK_SIZE as usize];

impl BlockData {
    /// A block of its own holding a copy of `bytes` (one block long).
    pub fn copy_from(bytes: &[u8]) -> BlockData {
        BlockData::from_bytes(Bytes::copy_from_slice(bytes))
    }

    /// A block of zeros (no allocation).
    pub fn zeroed() -> BlockData {
        BlockData::from_bytes(Bytes::from_static(&ZERO_BLOCK))
    }

    /// Block `index` of `buffer`, sharing it (no copy).
    pub fn of_buffer(buffer: &Bytes, index: usize) -> BlockData {
        let start = index * BLOCK as usize;
        BlockData {
            window: buffer.len() > BLOCK as usize,
            ..BlockData::from_bytes(buffer.slice(start..start + BLOCK as usize))
        }
    }

    /// The block at byte `start` of `buffer`, sharing it (no copy): a
    /// window of it when the buffer carries `blocks_in_buffer` > 1 blocks
    /// (a replica's WRITE_SEALED payload interleaves each block with its
    /// LBA and context, so its blocks start at no multiple of a block).
    pub fn in_buffer(buffer: &Bytes, start: usize, blocks_in_buffer: usize) -> BlockData {
        BlockData {
            window: blocks_in_buffer > 1,
            ..BlockData::from_bytes(buffer.slice(start..start + BLOCK as usize))
        }
    }

    /// Take `bytes`, one block split off a run of `run_blocks` blocks in
    /// one allocation (a window of it when the run is longer).
    pub(crate) fn part_of_run(bytes: Bytes, run_blocks: usize) -> BlockData {
        BlockData {
            window: run_blocks > 1,
            ..BlockData::from_bytes(bytes)
        }
    }

    /// Take `bytes`, which must be exactly one block long (and are then
    /// counted as a block of their own).
    pub fn from_bytes(bytes: Bytes) -> BlockData {
        assert_eq!(bytes.len(), BLOCK as usize, "a block is {BLOCK} bytes");
        BlockData {
            bytes,
            window: false,
        }
    }

    /// Whether these bytes are a window of a larger buffer (which they
    /// keep alive).
    pub fn is_window(&self) -> bool {
        self.window
    }
}

impl PartialEq for BlockData {
    fn eq(&self, other: &BlockData) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for BlockData {}

impl std::ops::Deref for BlockData {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl std::fmt::Debug for BlockData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nonzero = self.bytes.iter().filter(|byte| **byte != 0).count();
        write!(f, "BlockData({nonzero} non-zero bytes)")
    }
}

/// A block buffered in memory, acknowledged but not yet committed: its
/// bytes and the seal computed when it was buffered.
#[derive(Clone)]
pub(crate) struct DirtyBlock {
    pub data: BlockData,
    pub seal: Seal,
}

/// A trim or write-zeroes over whole blocks `[start, end)`.
#[derive(Clone, Copy, Debug)]
pub struct RangeOp {
    pub start: u64,
    pub end: u64,
    /// `Unwritten` (hole) or `Zero` (allocated zeroes); ref tag filled per block.
    pub template: Context,
    /// The generation of the commit that journals the range (0: not
    /// known: a copy's ranges, a replayed record). A packed row trimmed
    /// whole keeps it as its expectation (`PackedLayout`'s ranges).
    pub generation: u32,
}

impl RangeOp {
    /// A trim (`allocate` false) or written zeroes over `[start, end)`
    /// whose commit is not known yet (`stamped` gives it one).
    pub fn new(start: u64, end: u64, template: Context) -> RangeOp {
        RangeOp {
            start,
            end,
            template,
            generation: 0,
        }
    }

    /// This range as commit `seq` journals it: its zero contexts carry the
    /// commit's generation, as a data block's context does, so a unit whose
    /// newest slots are zero contexts has an expected generation its older
    /// copies fall short of.
    pub fn stamped(&self, seq: u64) -> RangeOp {
        let generation = seq as u32;
        let template = match self.template {
            Context::Zero {
                volume_tag,
                ref_tag,
                ..
            } => Context::Zero {
                volume_tag,
                ref_tag,
                generation,
            },
            other => other,
        };
        RangeOp {
            template,
            generation,
            ..*self
        }
    }

    /// The part of this range inside `[start, end)`.
    pub fn piece(&self, start: u64, end: u64) -> RangeOp {
        RangeOp {
            start,
            end,
            ..*self
        }
    }
}

/// Its fields change only through the operations below, each named for
/// the step of a write, commit, clone or replay it records.
pub(crate) struct VolumeState {
    /// The write-back buffer: blocks acknowledged, not yet taken by a
    /// commit.
    active: BTreeMap<u64, DirtyBlock>,
    /// The blocks the commit in flight took (`take_for_commit`): still
    /// read from here until their contexts are published.
    committing: BTreeMap<u64, DirtyBlock>,
    /// Windows of larger buffers overwritten or trimmed out of `active`
    /// since it was last swapped out: the buffers they belonged to may be
    /// kept alive by a neighbour still buffered (`held_blocks`).
    active_orphans: usize,
    /// `active_orphans` of the buffer now committing.
    committing_orphans: usize,
    /// Blocks appended to the held log's active slot since the buffer was
    /// last swapped out: overwrites of one block add to it while `active`
    /// stays the same size, and the slot is memory too (`held_blocks`).
    logged: usize,
    /// Blocks of room reserved for writes about to be buffered
    /// (`Engine::reserve_room`): counted as held, so no other writer that
    /// must not wait takes their room meanwhile. Changed only through
    /// `reserve` and `unreserve`.
    reserved: usize,
    /// Blocks whose home extents a reflink copy is replacing right now
    /// (their new contexts are not yet published): a read of them waits
    /// until the range is clear (a clone of 16 MiB takes ~0.1 ms).
    cloning: Option<std::ops::Range<u64>>,
    /// Every block's context: the checkpointed table's cached pages and
    /// the overlay of those committed since (`contexts.rs`).
    contexts: ContextStore,
}

impl VolumeState {
    pub fn new(context_cache_pages: usize) -> VolumeState {
        VolumeState {
            active: BTreeMap::new(),
            committing: BTreeMap::new(),
            active_orphans: 0,
            committing_orphans: 0,
            logged: 0,
            reserved: 0,
            cloning: None,
            contexts: ContextStore::new(context_cache_pages),
        }
    }

    /// The newest buffered copy of a block, if any.
    pub fn buffered(&self, lba: u64) -> Option<&DirtyBlock> {
        self.active.get(&lba).or_else(|| self.committing.get(&lba))
    }

    /// The first block at or after `lba` in the write-back buffer (not
    /// the commit in flight's).
    pub fn next_buffered(&self, lba: u64) -> Option<u64> {
        self.active.range(lba..).next().map(|(lba, _)| *lba)
    }

    /// Has the write-back buffer a block in `range`?
    pub fn buffers_any(&self, range: std::ops::Range<u64>) -> bool {
        self.active.range(range).next().is_some()
    }

    /// Blocks in the write-back buffer.
    pub fn buffered_blocks(&self) -> usize {
        self.active.len()
    }

    /// Nothing buffered and no commit in flight.
    pub fn nothing_buffered(&self) -> bool {
        self.active.is_empty() && self.committing.is_empty()
    }

    /// A commit takes the write-back buffer (with its held-log slot,
    /// `Committer::commit_as`): its blocks, in LBA order, stay readable
    /// from `committing` until `commit_done`, and new writes buffer anew.
    pub fn take_for_commit(&mut self) -> Vec<(u64, DirtyBlock)> {
        assert!(self.committing.is_empty(), "a commit is already in flight");
        self.committing = std::mem::take(&mut self.active);
        self.committing_orphans = std::mem::take(&mut self.active_orphans);
        self.logged = 0;
        self.committing
            .iter()
            .map(|(lba, dirty)| (*lba, dirty.clone()))
            .collect()
    }

    /// The commit in flight is home and its contexts published: its
    /// blocks leave memory. Returns the contexts not yet checkpointed
    /// (`pending_contexts`), which decide whether a checkpoint runs.
    pub fn commit_done(&mut self) -> usize {
        self.committing.clear();
        self.committing_orphans = 0;
        self.contexts.pending()
    }

    /// Contexts committed since the last checkpoint (the overlay's size):
    /// past the limit, the committer checkpoints (`Committer::committed`).
    pub fn pending_contexts(&self) -> usize {
        self.contexts.pending()
    }

    /// `count` blocks were appended to the held log's active slot
    /// (`held_blocks`).
    pub fn logged(&mut self, count: usize) {
        self.logged += count;
    }

    /// Every block's context (`ContextStore`).
    pub fn contexts(&self) -> &ContextStore {
        &self.contexts
    }

    /// Every block's context, to publish committed ones, set ranges or
    /// cache pages (the commit, replay, checkpoints and page loads).
    pub fn contexts_mut(&mut self) -> &mut ContextStore {
        &mut self.contexts
    }

    /// Is any block of `[first, first + count)` being cloned?
    pub fn cloning(&self, first: u64, count: u64) -> bool {
        self.cloning
            .as_ref()
            .is_some_and(|range| range.start < first + count && first < range.end)
    }

    /// A reflink copy starts replacing the home extents of `range`: reads
    /// of it wait until `publish_clone` (or `end_clone`).
    pub fn begin_clone(&mut self, range: std::ops::Range<u64>) {
        self.cloning = Some(range);
    }

    /// The clone failed (the volume fail-stops): reads of its range go on.
    pub fn end_clone(&mut self) {
        self.cloning = None;
    }

    /// A reflink piece of `contexts.len()` blocks from `first` is home: the
    /// buffered writes it replaces are dropped, its contexts published
    /// (`contexts[i]` for `first + i`; `None` where a zero range in
    /// `ranges` sets it) and reads of it go on. The caller holds the held
    /// log's lock and appended its drop record (`copy/reflink.rs`).
    pub fn publish_clone(&mut self, first: u64, contexts: &[Option<Context>], ranges: &[RangeOp]) {
        self.drop_buffered(first, first + contexts.len() as u64);
        self.contexts.reserve(contexts.len());
        for (index, context) in contexts.iter().enumerate() {
            if let Some(context) = context {
                self.contexts.set(first + index as u64, *context);
            }
        }
        for range in ranges {
            self.contexts
                .set_range(range.start, range.end, range.template);
        }
        self.cloning = None;
    }

    /// Drop buffered writes inside `[start, end)`: a range op supersedes them.
    pub fn drop_buffered(&mut self, start: u64, end: u64) {
        let stale: Vec<u64> = self.active.range(start..end).map(|(lba, _)| *lba).collect();
        for lba in stale {
            if let Some(old) = self.active.remove(&lba) {
                self.active_orphans += usize::from(old.data.is_window());
            }
        }
    }

    /// Buffer `dirty` for `lba` in `active`, replacing any older copy.
    pub fn buffer(&mut self, lba: u64, dirty: DirtyBlock) {
        if let Some(old) = self.active.insert(lba, dirty) {
            self.active_orphans += usize::from(old.data.is_window());
        }
    }

    /// Blocks of memory the active buffer may hold: its blocks, plus the
    /// windows that left it while their buffer may still be alive. Every
    /// block of a buffer kept alive is one or the other, so this bounds
    /// the memory whatever the clients overwrite (a 1 MiB write shifted by
    /// one block each time would otherwise keep a MiB alive per block
    /// counted), and the room reserved for writes about to be buffered.
    /// The held log's active slot holds every block logged since the swap
    /// (`logged`), overwritten or not: the larger of the two counts. The
    /// write-back limits count this, not `active.len()`.
    pub fn held_blocks(&self) -> usize {
        (self.active.len() + self.active_orphans).max(self.logged) + self.reserved
    }

    /// Set room for `count` blocks aside (`Engine::reserve_room`).
    pub fn reserve(&mut self, count: usize) {
        self.reserved += count;
    }

    /// Room for `count` blocks no longer set aside: given back, or taken
    /// by the write it was reserved for. More than was reserved is a bug
    /// of the caller's (`what` says which).
    pub fn unreserve(&mut self, count: usize, what: &str) {
        assert!(self.reserved >= count, "{what}");
        self.reserved -= count;
    }

    /// Memory held by buffers and caches.
    pub fn resident_bytes(&self) -> u64 {
        let held = self.held_blocks() + self.committing.len() + self.committing_orphans;
        held as u64 * (BLOCK + 64) + self.contexts.resident_bytes()
    }
}

/// Load one page of the context table into the cache, without holding the
/// lock during the read. A checkpoint that ran meanwhile may have rewritten
/// the page: then it is returned but not cached (the cache's epoch moved).
pub(crate) fn load_context_page(
    io: &Backing,
    state: &RwLock<VolumeState>,
    page_no: u64,
) -> Result<Page> {
    let page = load_context_pages(io, state, page_no..page_no + 1)?;
    Ok(page.into_iter().next().expect("one page read"))
}

/// `load_context_page` for adjacent pages `pages`, in one read (recovery
/// loads every page its replay needs so: `SplitLayout::replay`).
pub(crate) fn load_context_pages(
    io: &Backing,
    state: &RwLock<VolumeState>,
    pages: Range<u64>,
) -> Result<Vec<Page>> {
    let epoch = state.read().contexts.epoch();
    let read: Vec<Page> = read_context_pages(io, pages.clone())?
        .into_iter()
        .map(std::sync::Arc::new)
        .collect();
    let mut state = state.write();
    for (page_no, page) in pages.zip(&read) {
        state
            .contexts
            .insert_page_from(page_no, page.clone(), epoch);
    }
    Ok(read)
}

/// One page of the context table from disk, judged against the written
/// map (a lost page becomes lost markers: `WrittenMap::judge_page`).
pub(crate) fn read_context_page(io: &Backing, page_no: u64) -> Result<[u8; 4096]> {
    let page = read_context_pages(io, page_no..page_no + 1)?;
    Ok(page.into_iter().next().expect("one page read"))
}

/// `read_context_page` of adjacent pages `pages`, in one read (a run
/// that fails is read again page by page, so the error names its page).
fn read_context_pages(io: &Backing, pages: Range<u64>) -> Result<Vec<[u8; 4096]>> {
    let count = (pages.end - pages.start) as usize;
    let mut read = vec![[0u8; 4096]; count];
    let Some(last) = pages.end.checked_sub(1).filter(|last| *last >= pages.start) else {
        return Ok(read);
    };
    let seen = io.written.page_writes(pages.start..=last);
    if io
        .try_read(
            ObjectId::Contexts,
            pages.start * 4096,
            read.as_flattened_mut(),
        )
        .is_ok()
    {
        io.stats.add_read(count as u64 * 4096);
    } else {
        for (page_no, bytes) in pages.clone().zip(read.iter_mut()) {
            io.read_object(ObjectId::Contexts, page_no * 4096, bytes)?;
        }
    }
    for (page_no, bytes) in pages.zip(read.iter_mut()) {
        io.written.judge_page(page_no, bytes, &seen, |data| {
            read_page_data(io, page_no, data)
        });
        if io.is_read_only() {
            // A writable open stamped these on disk (`Engine::open`); a
            // read-only one cannot, and nothing it does can write the
            // blocks. After the judgement: the markers carry no
            // generation, so the page stamped would look older than it is.
            io.stamp_short_data(page_no, bytes);
        }
    }
    Ok(read)
}

/// Whether split page `page_no` (`page`, as read from disk) is older than
/// the volume expects, its blocks' data read when that decides it
/// (`WrittenMap::stale_page_read`).
pub(crate) fn stale_page(io: &Backing, page_no: u64, page: &[u8]) -> Option<(u32, u32)> {
    io.written
        .stale_page_read(page_no, page, |data| read_page_data(io, page_no, data))
}

/// The data of split page `page_no`'s blocks as stored, in LBA order, into
/// `out` (whole blocks from the page's first LBA). Only to judge a page
/// that looks older than expected, never on a read's path: a run that
/// fails is read again block by block, and a block that cannot be read (a
/// data segment cut short) is left zeros (no block vouch encrypted is all
/// zeros, so no context is one bit from a guard over them but by chance).
fn read_page_data(io: &Backing, page_no: u64, out: &mut [u8]) {
    let first = page_no * CONTEXTS_PER_PAGE;
    let mut done = 0;
    while done < out.len() {
        let lba = first + (done / BLOCK as usize) as u64;
        let location = io.geometry.locate(lba);
        let object = ObjectId::Data(location.segment);
        let in_segment = (io.geometry.segment_blocks - lba % io.geometry.segment_blocks) * BLOCK;
        let len = (out.len() - done).min(in_segment as usize);
        let run = &mut out[done..done + len];
        if io.try_read(object, location.data_offset, run).is_err() {
            for (index, block) in run.chunks_mut(BLOCK as usize).enumerate() {
                let offset = location.data_offset + index as u64 * BLOCK;
                if io.try_read(object, offset, block).is_err() {
                    block.fill(0);
                }
            }
        }
        done += len;
    }
}

/// The context of `lba` as stored in `page` (its page of the table).
pub(crate) fn context_in_page(page: &Page, lba: u64) -> std::result::Result<Context, FormatError> {
    let at = (lba % CONTEXTS_PER_PAGE) as usize * CONTEXT_BYTES;
    Context::decode(&page[at..at + CONTEXT_BYTES])
}

/// The published context of `lba`, loading its page of the table into the
/// cache when it is not there. The outer error is the page's read; the
/// inner one a stored context that does not decode.
pub(crate) fn lookup_loading(
    io: &Backing,
    state: &RwLock<VolumeState>,
    lba: u64,
) -> Result<std::result::Result<Context, FormatError>> {
    let lookup = state.read().contexts.lookup(lba);
    match lookup {
        Lookup::Found(found) => Ok(found),
        Lookup::NeedPage(page_no) => {
            let page = load_context_page(io, state, page_no)?;
            Ok(context_in_page(&page, lba))
        }
    }
}
