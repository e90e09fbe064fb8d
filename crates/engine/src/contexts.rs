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
use std::sync::Arc;

use vouch_format::{Context, FormatError, CONTEXT_BYTES};

pub const CONTEXTS_PER_PAGE: u64 = 4096 / CONTEXT_BYTES as u64;
pub type Page = Arc<[u8; 4096]>;

pub struct ContextStore {
    pub overlay: FxHashMap<u64, Context>,
    /// start -> (end exclusive, template context of kind Unwritten or Zero)
    pub ranges: BTreeMap<u64, (u64, Context)>,
    cache: FxHashMap<u64, Page>,
    fifo: VecDeque<u64>,
    cache_limit_pages: usize,
    /// Bumped by every checkpoint: a page read from disk before a checkpoint
    /// may be stale and must not enter the cache after it.
    epoch: u64,
}

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
            overlay: FxHashMap::default(),
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

    pub fn cached_page(&self, page_no: u64) -> Option<Page> {
        self.cache.get(&page_no).cloned()
    }

    pub fn set(&mut self, lba: u64, context: Context) {
        self.overlay.insert(lba, context);
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

    /// After a checkpoint wrote everything pending to disk: every page it
    /// wrote is cached with its new content, replacing any older copy a
    /// reader cached meanwhile (the overlay that served its contexts is
    /// cleared now, so without it the next read of each page would load it
    /// from disk again; the FIFO bounds the cache), punched pages are
    /// dropped, and the epoch moves so loads begun before now are not
    /// cached.
    pub fn clear_pending(&mut self, written: Vec<(u64, Page)>, punched_pages: &[Range<u64>]) {
        self.overlay.clear();
        self.ranges.clear();
        self.epoch += 1;
        for (page_no, page) in written {
            self.insert_page(page_no, page);
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
