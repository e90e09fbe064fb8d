//! Where the split layout keeps block contexts in memory: never the whole
//! table (8 GiB per TiB of volume), only
//! - `overlay`: contexts committed to the journal since the last checkpoint
//!   (bounded: a checkpoint drains it into the `contexts` file);
//! - `ranges`: trimmed / zeroed ranges committed since the last checkpoint
//!   (disjoint; one entry however large the range);
//! - `cache`: clean 4 KiB pages of the `contexts` file, FIFO-evicted.
//!
//! Lookup order is overlay, then ranges, then the page: a range insert
//! removes the overlay entries it supersedes, so the newest wins.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

use rustc_hash::FxHashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use vouch_format::{Context, FormatError, CONTEXT_BYTES};

pub const CONTEXTS_PER_PAGE: u64 = 4096 / CONTEXT_BYTES as u64;
// `OverlayHasher` keeps a block's slot in its page as the hash's low bits.
const _: () = assert!(CONTEXTS_PER_PAGE.is_power_of_two());
pub type Page = Arc<[u8; 4096]>;

pub struct ContextStore {
    pub overlay: Overlay,
    /// start -> (end exclusive, template context of kind Unwritten or Zero)
    pub ranges: BTreeMap<u64, (u64, Context)>,
    cache: FxHashMap<u64, Page>,
    fifo: VecDeque<u64>,
    cache_limit_pages: usize,
    /// Bumped by every checkpoint: a page read from disk before a checkpoint
    /// may be stale and must not enter the cache after it.
    epoch: u64,
}

/// Contexts by LBA, hashed by `OverlayHasher`.
pub type Overlay = std::collections::HashMap<u64, Context, BuildHasherDefault<OverlayHasher>>;

/// The overlay's hash of an LBA: its slot in its context page in the low
/// 7 bits, a multiplicative hash of the page number (FxHash's multiplier
/// and rotation) above them. The blocks of one page land in adjacent
/// buckets, so a run of blocks (a large write, a copy) fills the table in
/// cache-friendly order instead of one cache miss per block, while pages
/// spread over the table as any hash would spread them.
#[derive(Default)]
pub struct OverlayHasher(u64);

impl Hasher for OverlayHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Not used by `u64` keys; a plain FxHash-style mix for completeness.
        for byte in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(*byte)).wrapping_mul(PAGE_MIX);
        }
    }

    fn write_u64(&mut self, lba: u64) {
        let slot_bits = CONTEXTS_PER_PAGE - 1;
        let page = (lba / CONTEXTS_PER_PAGE)
            .wrapping_mul(PAGE_MIX)
            .rotate_left(26);
        self.0 = (page & !slot_bits) | (lba & slot_bits);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// FxHash's multiplier (rustc-hash 2).
const PAGE_MIX: u64 = 0xf135_7aea_2e62_a9c5;

/// A range's context for one of its blocks: the template with that block's LBA.
pub fn context_in_range(template: Context, lba: u64) -> Context {
    match template {
        Context::Zero {
            volume_tag,
            generation,
            ..
        } => Context::Zero {
            volume_tag,
            ref_tag: lba,
            generation,
        },
        other => other,
    }
}

pub enum Lookup {
    Found(Result<Context, FormatError>),
    /// The page holding this LBA's context must be read first.
    NeedPage(u64),
}

impl ContextStore {
    pub fn new(cache_limit_pages: usize) -> ContextStore {
        ContextStore {
            overlay: Overlay::default(),
            ranges: BTreeMap::new(),
            cache: FxHashMap::default(),
            fifo: VecDeque::new(),
            cache_limit_pages: cache_limit_pages.max(1),
            epoch: 0,
        }
    }

    pub fn page_of(lba: u64) -> u64 {
        lba / CONTEXTS_PER_PAGE
    }

    pub fn lookup(&self, lba: u64) -> Lookup {
        if let Some(context) = self.overlay.get(&lba) {
            return Lookup::Found(Ok(*context));
        }
        if let Some(template) = self.range_containing(lba) {
            return Lookup::Found(Ok(context_in_range(template, lba)));
        }
        match self.cache.get(&Self::page_of(lba)) {
            Some(page) => {
                let at = (lba % CONTEXTS_PER_PAGE) as usize * CONTEXT_BYTES;
                Lookup::Found(Context::decode(&page[at..at + CONTEXT_BYTES]))
            }
            None => Lookup::NeedPage(Self::page_of(lba)),
        }
    }

    fn range_containing(&self, lba: u64) -> Option<Context> {
        let (_, (end, template)) = self.ranges.range(..=lba).next_back()?;
        (lba < *end).then_some(*template)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Cache a page read from disk while the cache was at `epoch`, unless a
    /// checkpoint has rewritten pages since.
    pub fn insert_page_from(&mut self, page_no: u64, page: Page, epoch: u64) {
        if epoch == self.epoch {
            self.insert_page(page_no, page);
        }
    }

    pub fn insert_page(&mut self, page_no: u64, page: Page) {
        if self.cache.insert(page_no, page).is_none() {
            self.fifo.push_back(page_no);
            while self.cache.len() > self.cache_limit_pages {
                match self.fifo.pop_front() {
                    Some(old) => {
                        self.cache.remove(&old);
                    }
                    None => break,
                }
            }
        }
    }

    /// Pages the cache holds at most.
    pub fn cache_limit_pages(&self) -> usize {
        self.cache_limit_pages
    }

    pub fn cached_page(&self, page_no: u64) -> Option<Page> {
        self.cache.get(&page_no).cloned()
    }

    pub fn set(&mut self, lba: u64, context: Context) {
        self.overlay.insert(lba, context);
    }

    /// Room for `more` overlay entries (before setting a run of them).
    pub fn reserve(&mut self, more: usize) {
        self.overlay.reserve(more);
    }

    /// Record that `[start, end)` now has `template`'s kind. Overlay entries
    /// and older ranges inside it are superseded.
    pub fn set_range(&mut self, start: u64, end: u64, template: Context) {
        self.overlay.retain(|lba, _| !(start..end).contains(lba));
        // Clip an older range that starts before `start` and reaches into it.
        if let Some((&old_start, &(old_end, old_template))) = self.ranges.range(..start).next_back()
        {
            if old_end > start {
                self.ranges.insert(old_start, (start, old_template));
                if old_end > end {
                    self.ranges.insert(end, (old_end, old_template));
                }
            }
        }
        // Remove or clip older ranges that start inside [start, end).
        let inside: Vec<(u64, (u64, Context))> = self
            .ranges
            .range(start..end)
            .map(|(key, value)| (*key, *value))
            .collect();
        for (old_start, (old_end, old_template)) in inside {
            self.ranges.remove(&old_start);
            if old_end > end {
                self.ranges.insert(end, (old_end, old_template));
            }
        }
        self.ranges.insert(start, (end, template));
    }

    /// Memory held, for `info` and metrics.
    pub fn resident_bytes(&self) -> u64 {
        (self.cache.len() as u64) * 4096
            + (self.overlay.len() as u64) * 64
            + (self.ranges.len() as u64) * 64
    }

    pub fn pending(&self) -> usize {
        self.overlay.len() + self.ranges.len()
    }

    /// After a checkpoint wrote everything pending to disk.
    /// The smallest overlay LBA at or after `lba` (a scan: the overlay is
    /// only non-empty between checkpoints).
    pub fn next_overlay(&self, lba: u64) -> Option<u64> {
        self.overlay.keys().copied().filter(|key| *key >= lba).min()
    }

    /// After a checkpoint wrote everything pending to disk: each page it
    /// wrote is cached with its new content when given (`Some`), replacing
    /// any older copy a reader cached meanwhile (the overlay that served
    /// its contexts is cleared now, so without it the next read of each
    /// page would load it from disk again; the FIFO bounds the cache), or
    /// dropped when not (`None`: a copy a reader cached meanwhile may be
    /// older than what was written); punched pages are dropped, and the
    /// epoch moves so loads begun before now are not cached.
    pub fn clear_pending(
        &mut self,
        written: Vec<(u64, Option<Page>)>,
        punched_pages: &[Range<u64>],
    ) {
        self.overlay.clear();
        self.ranges.clear();
        self.epoch += 1;
        for (page_no, content) in written {
            match content {
                Some(page) => self.insert_page(page_no, page),
                None => {
                    self.cache.remove(&page_no);
                }
            }
        }
        if !punched_pages.is_empty() {
            self.cache
                .retain(|page_no, _| !punched_pages.iter().any(|range| range.contains(page_no)));
        }
        let cache = &self.cache;
        self.fifo.retain(|page_no| cache.contains_key(page_no));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zero(lba: u64) -> Context {
        Context::Zero {
            volume_tag: 1,
            ref_tag: lba,
            generation: 0,
        }
    }

    fn overlay_hash(lba: u64) -> u64 {
        let mut hasher = OverlayHasher::default();
        hasher.write_u64(lba);
        hasher.finish()
    }

    #[test]
    fn overlay_hash_keeps_a_page_adjacent_and_spreads_pages() {
        // One page's blocks: consecutive hashes.
        let base = overlay_hash(5 * CONTEXTS_PER_PAGE);
        for slot in 0..CONTEXTS_PER_PAGE {
            assert_eq!(overlay_hash(5 * CONTEXTS_PER_PAGE + slot), base + slot);
        }
        // Pages, even at a power-of-two stride, fill a table's buckets
        // (the low bits) and its control bytes (the top 7 bits).
        for stride in [1u64, 2, 1024, 1 << 20] {
            let buckets: std::collections::HashSet<u64> = (0..4096)
                .map(|page| (overlay_hash(page * stride * CONTEXTS_PER_PAGE) >> 7) & 4095)
                .collect();
            assert!(
                buckets.len() > 2048,
                "stride {stride}: {} of 4096 page buckets",
                buckets.len()
            );
            let tops: std::collections::HashSet<u64> = (0..4096)
                .map(|page| overlay_hash(page * stride * CONTEXTS_PER_PAGE) >> 57)
                .collect();
            assert!(
                tops.len() > 100,
                "stride {stride}: {} top-7-bit values",
                tops.len()
            );
        }
    }

    #[test]
    fn newest_wins_between_overlay_and_ranges() {
        let mut store = ContextStore::new(4);
        let data = Context::Data {
            volume_tag: 1,
            ref_tag: 5,
            guard: 9,
            generation: 1,
        };
        store.set(5, data);
        store.set_range(0, 10, Context::Unwritten);
        assert!(matches!(
            store.lookup(5),
            Lookup::Found(Ok(Context::Unwritten))
        ));
        store.set(5, data);
        assert!(matches!(store.lookup(5), Lookup::Found(Ok(found)) if found == data));
        store.set_range(3, 6, zero(3));
        assert!(matches!(store.lookup(4), Lookup::Found(Ok(found)) if found == zero(4)));
        assert!(matches!(
            store.lookup(2),
            Lookup::Found(Ok(Context::Unwritten))
        ));
        assert!(matches!(
            store.lookup(7),
            Lookup::Found(Ok(Context::Unwritten))
        ));
        assert!(matches!(store.lookup(10), Lookup::NeedPage(0)));
        assert_eq!(store.ranges.len(), 3);
    }
}
