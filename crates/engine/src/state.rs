//! What a volume holds in memory between the client and home storage, under
//! one reader-writer lock: the write-back buffer (blocks acknowledged, not
//! yet committed), the commit in flight, and the contexts not yet
//! checkpointed (`ContextStore`). Readers plan under the shared lock;
//! writers, commits and checkpoints take it exclusively.

use std::collections::BTreeMap;

use bytes::Bytes;

use vouch_format::{Context, BLOCK_SIZE};

use parking_lot::RwLock;

use crate::backing::Backing;
use crate::contexts::{ContextStore, Page};
use crate::error::Result;
use crate::protection::Seal;
use crate::storage::ObjectId;

pub type Block = [u8; BLOCK_SIZE as usize];
pub const BLOCK: u64 = BLOCK_SIZE as u64;

/// One block's bytes (exactly `BLOCK`), shared without copying: a block
/// of its own, or a 4 KiB window of a larger buffer kept whole — an NBD
/// WRITE's payload is buffered, journaled and written home from the
/// buffer it was received into, and a mirrored write hands the same bytes
/// to every leg. Immutable once made: a block is sealed (and, encrypted,
/// enciphered) before it becomes a `BlockData`.
#[derive(Clone, PartialEq, Eq)]
pub struct BlockData(Bytes);

/// The bytes of a never-written block, shared by every zero `BlockData`.
static ZERO_BLOCK: Block = [0u8; BLOCK_SIZE as usize];

impl BlockData {
    /// A block of its own holding a copy of `bytes` (one block long).
    pub fn copy_from(bytes: &[u8]) -> BlockData {
        BlockData::from_bytes(Bytes::copy_from_slice(bytes))
    }

    /// A block of zeros (no allocation).
    pub fn zeroed() -> BlockData {
        BlockData(Bytes::from_static(&ZERO_BLOCK))
    }

    /// Block `index` of `buffer`, sharing it (no copy).
    pub fn of_buffer(buffer: &Bytes, index: usize) -> BlockData {
        let start = index * BLOCK as usize;
        BlockData::from_bytes(buffer.slice(start..start + BLOCK as usize))
    }

    /// Take `bytes`, which must be exactly one block long.
    pub fn from_bytes(bytes: Bytes) -> BlockData {
        assert_eq!(bytes.len(), BLOCK as usize, "a block is {BLOCK} bytes");
        BlockData(bytes)
    }
}

impl std::ops::Deref for BlockData {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for BlockData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nonzero = self.0.iter().filter(|byte| **byte != 0).count();
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
}

pub(crate) struct VolumeState {
    pub active: BTreeMap<u64, DirtyBlock>,
    pub committing: BTreeMap<u64, DirtyBlock>,
    /// Blocks whose home extents a reflink copy is replacing right now
    /// (their new contexts are not yet published): a read of them waits
    /// until the range is clear (a clone of 16 MiB takes ~0.1 ms).
    pub cloning: Option<std::ops::Range<u64>>,
    pub contexts: ContextStore,
}

impl VolumeState {
    pub fn new(context_cache_pages: usize) -> VolumeState {
        VolumeState {
            active: BTreeMap::new(),
            committing: BTreeMap::new(),
            cloning: None,
            contexts: ContextStore::new(context_cache_pages),
        }
    }

    /// The newest buffered copy of a block, if any.
    pub fn buffered(&self, lba: u64) -> Option<&DirtyBlock> {
        self.active.get(&lba).or_else(|| self.committing.get(&lba))
    }

    /// Is any block of `[first, first + count)` being cloned?
    pub fn cloning(&self, first: u64, count: u64) -> bool {
        self.cloning
            .as_ref()
            .is_some_and(|range| range.start < first + count && first < range.end)
    }

    /// Drop buffered writes inside `[start, end)`: a range op supersedes them.
    pub fn drop_buffered(&mut self, start: u64, end: u64) {
        let stale: Vec<u64> = self.active.range(start..end).map(|(lba, _)| *lba).collect();
        for lba in stale {
            self.active.remove(&lba);
        }
    }

    /// Memory held by buffers and caches.
    pub fn resident_bytes(&self) -> u64 {
        (self.active.len() + self.committing.len()) as u64 * (BLOCK + 64)
            + self.contexts.resident_bytes()
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
    let epoch = state.read().contexts.epoch();
    let mut bytes = [0u8; 4096];
    io.read_object(ObjectId::Contexts, page_no * 4096, &mut bytes)?;
    let page = std::sync::Arc::new(bytes);
    state
        .write()
        .contexts
        .insert_page_from(page_no, page.clone(), epoch);
    Ok(page)
}
