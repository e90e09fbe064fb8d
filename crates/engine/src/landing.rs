//! The landing area: where a large write's payload is received, so that
//! the held log (`held.rs`) records where its blocks are instead of
//! copying them.
//!
//! Without it a 1 MiB WRITE is copied three times before its commit: from
//! the socket into process memory, from there into the held log (so a
//! crash of the process keeps it), and at the commit into the page cache.
//! The area is memory of the held log's kind (tmpfs beside its slots:
//! `PREFIX.landing`, mapped; the simulator's storage has its own), so the
//! NBD reader receives the payload straight into it (`LandingBuffer`) and
//! the buffered blocks are windows of it (`Bytes` whose owner is the
//! region). When such a run is logged, its record carries only the
//! entries and the run's offset here (a *landed* record, FORMAT.md "Held
//! log"): the middle copy is gone. A crash of the process keeps the area
//! as it keeps the slots; replay reads a landed record's blocks from it.
//!
//! A region is reused only when nothing refers to it: every `Bytes` of it
//! (the write-back buffer's blocks, a read's reply, the caller's payload)
//! and the slot whose record names it (`HeldSlots` keeps one of those
//! `Bytes` until it empties the slot) must be gone. So a landed record's
//! blocks never change under it while it is live.
//!
//! ORDER: payload received into the region -> sealed from it -> record
//! placed (entries, offset) -> done -> acknowledged. A crash before the
//! record is placed leaves an unreferenced region and no acknowledgement.

use std::ptr::NonNull;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

use crate::storage::Storage;

/// The area is handed out in chunks of this many bytes (a payload is
/// rounded up to whole chunks).
pub const LANDING_CHUNK: usize = 64 * 1024;

/// Room is made in the area (allocated in its file) this much at a time.
const GROW_STEP: u64 = 8 << 20;

/// The most the area grows to (allocated in the runtime directory, which
/// the held log's slots share): about twice what is ever in use at once
/// (the buffered writes, up to twice the write-back limit, 64 MiB by
/// default, kept by their slots until emptied, and the payloads being
/// received). Regions are taken lowest first, so the file only grows as
/// far as the most that was in use; past this a payload is received into
/// process memory.
const GROW_LIMIT: u64 = 256 << 20;

/// The landing area of one volume.
pub(crate) struct LandingArea {
    /// Keeps the mapping (and the file behind it) alive while any region
    /// is: the storage owns both.
    storage: Arc<dyn Storage>,
    base: NonNull<u8>,
    chunks: usize,
    inner: Mutex<Chunks>,
}

// SAFETY: `base` points into a mapping the storage owns (kept alive by
// `storage`); each region of it is handed to one owner at a time
// (`Chunks`), and the area's own state is behind its mutex.
unsafe impl Send for LandingArea {}
// SAFETY: as above.
unsafe impl Sync for LandingArea {}

/// Which chunks are taken, behind the area's lock.
struct Chunks {
    /// Bit `i % 64` of word `i / 64`: chunk `i` is taken.
    taken: Vec<u64>,
    /// Bytes of the area allocated in its file.
    grown: u64,
    /// The storage refused to grow the area (a full or unsuitable runtime
    /// directory): nothing past `grown` is tried again.
    stuck: bool,
}

impl Chunks {
    fn is_taken(&self, chunk: usize) -> bool {
        self.taken[chunk / 64] & (1 << (chunk % 64)) != 0
    }

    fn set(&mut self, first: usize, count: usize, taken: bool) {
        for chunk in first..first + count {
            let bit = 1u64 << (chunk % 64);
            match taken {
                true => self.taken[chunk / 64] |= bit,
                false => self.taken[chunk / 64] &= !bit,
            }
        }
    }

    /// The first chunk of the lowest `count` free ones in a row among the
    /// first `chunks` (first fit: the file grows only as far as the most
    /// ever taken at once; next fit would walk, and allocate, all of it).
    fn find(&self, chunks: usize, count: usize) -> Option<usize> {
        let mut run = 0;
        let mut chunk = 0;
        while chunk < chunks {
            if run == 0 && chunk.is_multiple_of(64) && self.taken[chunk / 64] == u64::MAX {
                chunk += 64;
                continue;
            }
            if self.is_taken(chunk) {
                run = 0;
            } else {
                run += 1;
                if run == count {
                    return Some(chunk + 1 - count);
                }
            }
            chunk += 1;
        }
        None
    }
}

impl LandingArea {
    /// The storage's landing area, if it has one.
    pub fn new(storage: Arc<dyn Storage>) -> Option<Arc<LandingArea>> {
        let (base, len) = storage.landing_window()?;
        let chunks = len.min(GROW_LIMIT as usize) / LANDING_CHUNK;
        (chunks > 0).then(|| {
            Arc::new(LandingArea {
                storage,
                base,
                chunks,
                inner: Mutex::new(Chunks {
                    taken: vec![0; chunks.div_ceil(64)],
                    grown: 0,
                    stuck: false,
                }),
            })
        })
    }

    /// A region of at least `len` bytes, or `None` when the area has no
    /// room (the caller receives into process memory instead).
    pub fn take(self: &Arc<Self>, len: usize) -> Option<LandingBuffer> {
        if len == 0 {
            return None;
        }
        let count = len.div_ceil(LANDING_CHUNK);
        let mut chunks = self.inner.lock();
        // Once growing failed, only what was allocated is used.
        let searched = match chunks.stuck {
            true => chunks.grown as usize / LANDING_CHUNK,
            false => self.chunks,
        };
        let first = chunks.find(searched, count)?;
        let end = ((first + count) * LANDING_CHUNK) as u64;
        if end > chunks.grown {
            // A step at a time, or just what this payload needs when the
            // step does not fit (as the held log's slots grow).
            let step = end
                .div_ceil(GROW_STEP)
                .saturating_mul(GROW_STEP)
                .min((self.chunks * LANDING_CHUNK) as u64);
            let grown = chunks.grown;
            let to = match self.storage.grow_landing(grown, step) {
                Ok(()) => step,
                Err(_) => match self.storage.grow_landing(grown, end) {
                    Ok(()) => end,
                    Err(error) => {
                        tracing::debug!(%error, "the landing area cannot grow: larger payloads are received into process memory");
                        chunks.stuck = true;
                        return None;
                    }
                },
            };
            chunks.grown = to;
        }
        chunks.set(first, count, true);
        drop(chunks);
        Some(LandingBuffer {
            region: Region {
                area: Arc::clone(self),
                first,
                count,
                len,
            },
        })
    }

    /// The offset in the area of `len` bytes at `at`, if they lie in it.
    pub fn offset_of(&self, at: *const u8, len: usize) -> Option<u64> {
        let base = self.base.as_ptr() as usize;
        let at = at as usize;
        let end = at.checked_add(len)?;
        (at >= base && end <= base + self.chunks * LANDING_CHUNK).then(|| (at - base) as u64)
    }

    fn free(&self, first: usize, count: usize) {
        self.inner.lock().set(first, count, false);
    }

    /// Chunks taken now (tests).
    #[cfg(test)]
    fn taken(&self) -> usize {
        let chunks = self.inner.lock();
        (0..self.chunks).filter(|&c| chunks.is_taken(c)).count()
    }
}

/// A region of the landing area being filled by its one owner (the NBD
/// reader receiving a payload), then frozen into `Bytes`.
pub struct LandingBuffer {
    region: Region,
}

impl LandingBuffer {
    /// The region's bytes, to receive into. Their contents before are
    /// whatever an earlier payload left.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the region is inside the mapping (`take` checked the
        // window), allocated in the file (`grow_landing`: no SIGBUS), and
        // owned by this buffer alone until it is frozen.
        unsafe { std::slice::from_raw_parts_mut(self.region.start().as_ptr(), self.region.len) }
    }

    pub fn len(&self) -> usize {
        self.region.len
    }

    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    /// The filled region as `Bytes`; it is freed when the last of them
    /// (and of their slices) is dropped.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self.region)
    }
}

impl std::fmt::Debug for LandingBuffer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("LandingBuffer")
            .field("first_chunk", &self.region.first)
            .field("len", &self.region.len)
            .finish()
    }
}

/// Chunks `[first, first + count)` of an area, `len` bytes of them used;
/// freed when dropped.
struct Region {
    area: Arc<LandingArea>,
    first: usize,
    count: usize,
    len: usize,
}

impl Region {
    fn start(&self) -> NonNull<u8> {
        // SAFETY: `first * LANDING_CHUNK` is inside the mapping (`take`).
        unsafe { self.area.base.add(self.first * LANDING_CHUNK) }
    }
}

impl AsRef<[u8]> for Region {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: as in `LandingBuffer::as_mut_slice`; once frozen nothing
        // writes the region until it is freed (this value dropped).
        unsafe { std::slice::from_raw_parts(self.start().as_ptr(), self.len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.area.free(self.first, self.count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::sim::SimStorage;

    #[test]
    fn regions_are_disjoint_and_freed_with_their_last_bytes() {
        let area = LandingArea::new(Arc::new(SimStorage::new())).expect("the sim has an area");
        let mut a = area.take(1 << 20).expect("room");
        let mut b = area.take(100_000).expect("room");
        a.as_mut_slice().fill(0xaa);
        b.as_mut_slice().fill(0xbb);
        let (a, b) = (a.freeze(), b.freeze());
        assert!(a.iter().all(|&x| x == 0xaa) && b.iter().all(|&x| x == 0xbb));
        assert_eq!(area.taken(), 16 + 2);
        let offset = area.offset_of(b.as_ptr(), b.len()).expect("in the area");
        assert_eq!(offset, 16 * LANDING_CHUNK as u64);
        let window = b.slice(4096..8192);
        drop(b);
        assert_eq!(area.taken(), 18, "a slice keeps its region");
        drop(window);
        drop(a);
        assert_eq!(area.taken(), 0);
        assert_eq!(area.offset_of([0u8; 8].as_ptr(), 8), None);
    }

    /// Regions taken and freed in turn, two at a time, as commits free
    /// the payloads they took: the area stays as large as the most in use
    /// at once, never walks on through the window allocating as it goes.
    #[test]
    fn the_area_grows_only_as_far_as_the_most_in_use() {
        let area = LandingArea::new(Arc::new(SimStorage::new())).expect("the sim has an area");
        let mut live = std::collections::VecDeque::new();
        let mut highest = 0;
        for _ in 0..1000 {
            let taken = area.take(1 << 20).expect("room");
            highest = highest.max((taken.region.first + taken.region.count) * LANDING_CHUNK);
            live.push_back(taken);
            if live.len() > 2 {
                live.pop_front();
            }
        }
        assert!(
            highest <= 3 << 20,
            "used up to byte {highest} for 3 MiB in use at most"
        );
    }

    #[test]
    fn a_full_area_says_none_and_room_comes_back() {
        let area = LandingArea::new(Arc::new(SimStorage::new())).expect("the sim has an area");
        let all = area.chunks * LANDING_CHUNK;
        let whole = area.take(all).expect("the whole area");
        assert!(area.take(1).is_none(), "nothing left");
        drop(whole);
        let again = area.take(all / 2).expect("room again");
        let rest = area.take(all / 2).expect("the other half, wrapping");
        assert!(area.take(1).is_none());
        drop((again, rest));
    }
}
