//! The resync map of a stale leg (docs/FORMAT.md, "Resync map"): which
//! blocks may differ on it, kept in every surviving leg's directory
//! (through a `MapStore`: real files, or the simulator's).
//!
//! Crash ordering (docs/CRASH_MODEL.md): `mark` sets the block bits in
//! memory and, if the write's region is not marked on disk yet, writes and
//! fsyncs the region page *before* the write is issued to the legs (md's
//! order, at 16 MiB granularity so a new region costs one sync and a
//! region already marked none). `sync` writes the changed block pages with
//! one fsync (what a flush adds); after it every region bit is redundant
//! and is cleared on disk lazily (the next region write) or at once by
//! `sync_and_retire` (resync batches, clean close). At open, a region bit
//! found on disk means a write there may lack its block bit: every block
//! of the region counts as dirty.
//!
//! Clearing (the resync, `resync.rs`): a dirty block whose newest contents
//! reached the resyncing leg — copied there, or a client write that every
//! write target took, under the block's stripe lock — is *landed*
//! (`landed`). `begin_flush` then starts a new generation of landed
//! blocks, the resyncing leg is flushed, and `clear_landed` clears the
//! blocks of the generation before: each landed before that flush was
//! issued, so it is durable there. A `mark` takes its blocks out of both
//! generations (a write in flight is not known to have landed), so a block
//! written during the flush stays dirty. The cleared bits reach the disk
//! with the next sync, after the leg's flush returned: at every crash each
//! block that may differ on the leg has its block bit or its region bit on
//! disk.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use vouch_format::dirty::{
    decode_page, encode_page, DirtyHeader, DIRTY_PAGE_BYTES, PAGE_BITS, PAGE_BITS_BYTES,
    REGION_BLOCKS,
};

pub use crate::map_file::{FileMaps, MapFile, MapStore};
use vouch_engine::error::{Error, Result};

/// The map's file name in a surviving leg's directory for stale leg `leg`.
pub fn map_file_name(leg: usize) -> String {
    format!("mirror.dirty.{leg}")
}

/// A persistent per-block dirty map (see the module's documentation).
pub struct DirtyMap {
    header: DirtyHeader,
    store: Arc<dyn MapStore>,
    files: Vec<(PathBuf, Box<dyn MapFile>)>,
    inner: Mutex<Inner>,
}

struct Inner {
    /// Block bits, padded to whole pages.
    bits: Vec<u8>,
    /// Block pages changed since the last sync.
    changed: BTreeSet<u64>,
    /// Region bits that must stay set on disk (writes since the last sync).
    wanted: Vec<u8>,
    /// Region bits as on disk.
    on_disk: Vec<u8>,
    /// Dirty blocks landed on the resyncing leg and not marked since, in
    /// two generations: `landed[epoch % 2]` takes new ones.
    landed: [BTreeSet<u64>; 2],
    epoch: u64,
    /// Block bits set.
    count: u64,
}

impl Inner {
    fn has_landed(&self, lba: u64) -> bool {
        self.landed.iter().any(|slot| slot.contains(&lba))
    }
}

/// A flush of the resyncing leg in progress (`begin_flush`): what its
/// success lets `clear_landed` clear.
#[derive(Debug)]
pub struct LandedTicket {
    /// The generation that was current when the flush began.
    epoch: u64,
}

fn bit(bytes: &[u8], index: u64) -> bool {
    bytes[(index / 8) as usize] & (1 << (index % 8)) != 0
}

fn set_bit(bytes: &mut [u8], index: u64, on: bool) -> bool {
    let byte = &mut bytes[(index / 8) as usize];
    let mask = 1u8 << (index % 8);
    let was = *byte & mask != 0;
    if on {
        *byte |= mask;
    } else {
        *byte &= !mask;
    }
    was
}

fn io_error(action: &'static str, path: &Path, error: impl std::fmt::Display) -> Error {
    Error::Path {
        action,
        path: path.to_path_buf(),
        cause: error.to_string(),
    }
}

/// The region and block sections of a map file's `bytes`, or why they
/// cannot be trusted.
fn parse(bytes: &[u8], expect: &DirtyHeader) -> std::result::Result<(Vec<u8>, Vec<u8>), String> {
    let header = DirtyHeader::decode(bytes).map_err(|error| format!("header: {error}"))?;
    if header != *expect {
        return Err(format!(
            "it is for leg {} of a {}-block volume {}, not this one",
            header.leg,
            header.blocks,
            uuid_text(&header.uuid)
        ));
    }
    if bytes.len() as u64 != header.file_bytes() {
        return Err(format!(
            "{} bytes, not {}",
            bytes.len(),
            header.file_bytes()
        ));
    }
    let section = |first: u64, pages: u64| -> std::result::Result<Vec<u8>, String> {
        let mut out = Vec::with_capacity(pages as usize * PAGE_BITS_BYTES);
        for page in 0..pages {
            let number = first / DIRTY_PAGE_BYTES as u64 + page;
            let at = (number as usize) * DIRTY_PAGE_BYTES;
            let bits = decode_page(number, &bytes[at..at + DIRTY_PAGE_BYTES])
                .map_err(|error| format!("page {number}: {error}"))?;
            out.extend_from_slice(bits);
        }
        Ok(out)
    };
    let regions = section(header.region_page_offset(0), header.region_pages())?;
    let blocks = section(header.block_page_offset(0), header.block_pages())?;
    Ok((regions, blocks))
}

fn uuid_text(uuid: &[u8; 16]) -> String {
    uuid.iter().map(|b| format!("{b:02x}")).collect()
}

/// Read the map file at `path` without changing it: its header and the
/// blocks it counts as dirty (blocks of a region marked on disk
/// included), or why it cannot be trusted.
pub fn inspect(path: &Path) -> std::result::Result<(DirtyHeader, u64), String> {
    let bytes = std::fs::read(path).map_err(|error| error.to_string())?;
    let header = DirtyHeader::decode(&bytes).map_err(|error| format!("header: {error}"))?;
    let (regions, bits) = parse(&bytes, &header)?;
    let count = (0..header.blocks)
        .filter(|&lba| bit(&bits, lba) || bit(&regions, lba / u64::from(header.region_blocks)))
        .count() as u64;
    Ok((header, count))
}

impl DirtyMap {
    /// Open the map of stale leg `leg` from the directories of the
    /// surviving legs (`dirs`), or create it there. Valid copies are
    /// united; blocks of a region marked on disk count as dirty. Returns
    /// the map and, if no valid copy covers the leg's absence (missing or
    /// damaged: unknown history), why: then every block is dirty.
    /// With `create_clean`, a missing map starts empty (the leg is being
    /// marked stale now, so nothing was missed yet).
    pub fn open(
        dirs: &[PathBuf],
        leg: usize,
        uuid: [u8; 16],
        blocks: u64,
        create_clean: bool,
    ) -> Result<(DirtyMap, Option<String>)> {
        DirtyMap::open_marked(dirs, leg, uuid, blocks, create_clean, &[])
    }

    /// `open`, with the blocks of `marked` dirty too in what is written:
    /// each copy is complete (or absent) at every instant.
    pub fn open_marked(
        dirs: &[PathBuf],
        leg: usize,
        uuid: [u8; 16],
        blocks: u64,
        create_clean: bool,
        marked: &[std::ops::Range<u64>],
    ) -> Result<(DirtyMap, Option<String>)> {
        let header = DirtyHeader {
            leg: leg as u16,
            uuid,
            blocks,
            region_blocks: REGION_BLOCKS,
        };
        DirtyMap::open_in(Arc::new(FileMaps), dirs, header, create_clean, marked)
    }

    /// `open_marked` on the map files of `store` (the simulator's, or
    /// `FileMaps`) for the leg, volume and size `header` names.
    pub fn open_in(
        store: Arc<dyn MapStore>,
        dirs: &[PathBuf],
        header: DirtyHeader,
        create_clean: bool,
        marked: &[std::ops::Range<u64>],
    ) -> Result<(DirtyMap, Option<String>)> {
        let blocks = header.blocks;
        let paths: Vec<PathBuf> = dirs
            .iter()
            .map(|d| d.join(map_file_name(usize::from(header.leg))))
            .collect();
        let mut bits = vec![0u8; header.block_pages() as usize * PAGE_BITS_BYTES];
        let mut valid = 0;
        let mut problems = Vec::new();
        for path in &paths {
            let loaded = match store.read(path) {
                Ok(None) => continue,
                Ok(Some(bytes)) => parse(&bytes, &header),
                Err(error) => Err(error.to_string()),
            };
            match loaded {
                Ok((regions, blocks_bits)) => {
                    valid += 1;
                    for (into, from) in bits.iter_mut().zip(&blocks_bits) {
                        *into |= from;
                    }
                    for region in 0..header.regions() {
                        if bit(&regions, region) {
                            let first = region * u64::from(header.region_blocks);
                            for lba in first..(first + u64::from(header.region_blocks)).min(blocks)
                            {
                                set_bit(&mut bits, lba, true);
                            }
                        }
                    }
                }
                Err(why) => problems.push(format!("{}: {why}", path.display())),
            }
        }
        let unknown = if valid > 0 {
            None
        } else if problems.is_empty() {
            (!create_clean).then(|| "no resync map covers the leg's absence".to_string())
        } else {
            Some(format!("resync map unusable ({})", problems.join("; ")))
        };
        for lba in marked.iter().flat_map(|run| run.start..run.end.min(blocks)) {
            set_bit(&mut bits, lba, true);
        }
        if unknown.is_some() {
            for lba in 0..blocks {
                set_bit(&mut bits, lba, true);
            }
        }
        let count = (0..blocks).filter(|&lba| bit(&bits, lba)).count() as u64;
        let map = DirtyMap::write_new(store, header, &paths, bits, count)?;
        Ok((map, unknown))
    }

    /// Write every copy afresh (`MapStore::create`: complete or absent at
    /// every instant) with `bits` and no region marked, and open them.
    fn write_new(
        store: Arc<dyn MapStore>,
        header: DirtyHeader,
        paths: &[PathBuf],
        bits: Vec<u8>,
        count: u64,
    ) -> Result<DirtyMap> {
        let mut image = header.encode();
        for page in 0..header.region_pages() {
            let number = header.region_page_offset(page) / DIRTY_PAGE_BYTES as u64;
            image.extend(encode_page(number, &[0u8; PAGE_BITS_BYTES]));
        }
        for page in 0..header.block_pages() {
            let number = header.block_page_offset(page) / DIRTY_PAGE_BYTES as u64;
            let at = page as usize * PAGE_BITS_BYTES;
            image.extend(encode_page(number, &bits[at..at + PAGE_BITS_BYTES]));
        }
        let mut files = Vec::new();
        for path in paths {
            let file = store
                .create(path, &image)
                .map_err(|error| io_error("write", path, error))?;
            files.push((path.clone(), file));
        }
        let region_bytes = header.region_pages() as usize * PAGE_BITS_BYTES;
        Ok(DirtyMap {
            header,
            store,
            files,
            inner: Mutex::new(Inner {
                bits,
                changed: BTreeSet::new(),
                wanted: vec![0u8; region_bytes],
                on_disk: vec![0u8; region_bytes],
                landed: [BTreeSet::new(), BTreeSet::new()],
                epoch: 0,
                count,
            }),
        })
    }

    /// Blocks the map covers.
    pub fn blocks(&self) -> u64 {
        self.header.blocks
    }

    /// Blocks marked dirty.
    pub fn count(&self) -> u64 {
        self.inner.lock().count
    }

    /// Is block `lba` dirty?
    pub fn is_dirty(&self, lba: u64) -> bool {
        lba < self.header.blocks && bit(&self.inner.lock().bits, lba)
    }

    /// The dirty blocks in `[first, end)`.
    pub fn dirty_in(&self, first: u64, end: u64) -> Vec<u64> {
        let inner = self.inner.lock();
        (first..end.min(self.header.blocks))
            .filter(|&lba| bit(&inner.bits, lba))
            .collect()
    }

    /// The dirty blocks in `[first, end)` that have not landed (those a
    /// resync must copy).
    pub fn to_copy_in(&self, first: u64, end: u64) -> Vec<u64> {
        let inner = self.inner.lock();
        (first..end.min(self.header.blocks))
            .filter(|&lba| bit(&inner.bits, lba) && !inner.has_landed(lba))
            .collect()
    }

    /// The first dirty block at or after `lba`.
    pub fn next_dirty(&self, lba: u64) -> Option<u64> {
        self.next_where(lba, false)
    }

    /// The first dirty block at or after `lba` that has not landed.
    pub fn next_to_copy(&self, lba: u64) -> Option<u64> {
        self.next_where(lba, true)
    }

    fn next_where(&self, lba: u64, skip_landed: bool) -> Option<u64> {
        let inner = self.inner.lock();
        let mut at = lba;
        while at < self.header.blocks {
            if at.is_multiple_of(8) && inner.bits[(at / 8) as usize] == 0 {
                at += 8;
                continue;
            }
            if bit(&inner.bits, at) && !(skip_landed && inner.has_landed(at)) {
                return Some(at);
            }
            at += 1;
        }
        None
    }

    fn write_pages(&self, pages: impl Iterator<Item = (u64, Vec<u8>)> + Clone) -> Result<()> {
        for (path, file) in &self.files {
            for (offset, bytes) in pages.clone() {
                file.write_at(offset, &bytes)
                    .map_err(|error| io_error("write", path, error))?;
            }
        }
        Ok(())
    }

    fn sync_files(&self) -> Result<()> {
        for (path, file) in &self.files {
            file.sync().map_err(|error| io_error("sync", path, error))?;
        }
        Ok(())
    }

    fn region_page(&self, inner: &Inner, page: u64) -> (u64, Vec<u8>) {
        let offset = self.header.region_page_offset(page);
        let at = page as usize * PAGE_BITS_BYTES;
        let number = offset / DIRTY_PAGE_BYTES as u64;
        (
            offset,
            encode_page(number, &inner.wanted[at..at + PAGE_BITS_BYTES]),
        )
    }

    fn block_page(&self, inner: &Inner, page: u64) -> (u64, Vec<u8>) {
        let offset = self.header.block_page_offset(page);
        let at = page as usize * PAGE_BITS_BYTES;
        let number = offset / DIRTY_PAGE_BYTES as u64;
        (
            offset,
            encode_page(number, &inner.bits[at..at + PAGE_BITS_BYTES]),
        )
    }

    /// Mark blocks `[first, end)` dirty before a write to them is issued:
    /// returns once a crash cannot lose the mark (see the module's
    /// documentation).
    pub fn mark(&self, first: u64, end: u64) -> Result<()> {
        let end = end.min(self.header.blocks);
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        for lba in first..end {
            if !set_bit(&mut inner.bits, lba, true) {
                inner.count += 1;
                inner.changed.insert(lba / PAGE_BITS);
            }
        }
        // Written again: landed no more until this write lands too.
        for landed in &mut inner.landed {
            let again: Vec<u64> = landed.range(first..end).copied().collect();
            for lba in again {
                landed.remove(&lba);
            }
        }
        let mut pages = BTreeSet::new();
        let region_blocks = u64::from(self.header.region_blocks);
        for region in first / region_blocks..end.div_ceil(region_blocks) {
            set_bit(&mut inner.wanted, region, true);
            if !bit(&inner.on_disk, region) {
                pages.insert(region / PAGE_BITS);
            }
        }
        if pages.is_empty() {
            return Ok(());
        }
        let writes: Vec<(u64, Vec<u8>)> =
            pages.iter().map(|&p| self.region_page(inner, p)).collect();
        self.write_pages(writes.into_iter())?;
        self.sync_files()?;
        for page in pages {
            let at = page as usize * PAGE_BITS_BYTES;
            let wanted = inner.wanted[at..at + PAGE_BITS_BYTES].to_vec();
            inner.on_disk[at..at + PAGE_BITS_BYTES].copy_from_slice(&wanted);
        }
        Ok(())
    }

    /// Make every block bit durable (one fsync when any changed); region
    /// bits become redundant and are cleared on disk later.
    pub fn sync(&self) -> Result<()> {
        let mut inner = self.inner.lock();
        self.sync_locked(&mut inner)
    }

    fn sync_locked(&self, inner: &mut Inner) -> Result<()> {
        if !inner.changed.is_empty() {
            let writes: Vec<(u64, Vec<u8>)> = inner
                .changed
                .iter()
                .map(|&p| self.block_page(inner, p))
                .collect();
            self.write_pages(writes.into_iter())?;
            self.sync_files()?;
            inner.changed.clear();
        }
        inner.wanted.iter_mut().for_each(|b| *b = 0);
        Ok(())
    }

    /// `sync`, then clear every region bit on disk (a second fsync, only if
    /// a region bit was on disk).
    pub fn sync_and_retire(&self) -> Result<()> {
        let mut inner = self.inner.lock();
        self.sync_locked(&mut inner)?;
        let pages: Vec<u64> = (0..self.header.region_pages())
            .filter(|&page| {
                let at = page as usize * PAGE_BITS_BYTES;
                inner.on_disk[at..at + PAGE_BITS_BYTES]
                    .iter()
                    .any(|&b| b != 0)
            })
            .collect();
        if pages.is_empty() {
            return Ok(());
        }
        let writes: Vec<(u64, Vec<u8>)> =
            pages.iter().map(|&p| self.region_page(&inner, p)).collect();
        self.write_pages(writes.into_iter())?;
        self.sync_files()?;
        inner.on_disk.iter_mut().for_each(|b| *b = 0);
        Ok(())
    }

    /// `lbas` reached the resyncing leg — copied there, or written to
    /// every write target by a client write that succeeded — under their
    /// stripe lock: each still dirty is *landed*, clean once a flush of
    /// that leg issued after this returned has returned (`begin_flush`,
    /// `clear_landed`), unless a `mark` touches it first.
    pub fn landed(&self, lbas: impl IntoIterator<Item = u64>) {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let slot = (inner.epoch % 2) as usize;
        for lba in lbas {
            if lba < self.header.blocks && bit(&inner.bits, lba) {
                inner.landed[slot].insert(lba);
            }
        }
    }

    /// Whether any block has landed and awaits a flush.
    pub fn has_landed(&self) -> bool {
        self.inner.lock().landed.iter().any(|slot| !slot.is_empty())
    }

    /// A flush of the resyncing leg is about to be issued: what landed
    /// before now is what it makes durable; what lands from now on waits
    /// for the next one.
    pub fn begin_flush(&self) -> LandedTicket {
        let mut inner = self.inner.lock();
        inner.epoch += 1;
        LandedTicket {
            epoch: inner.epoch - 1,
        }
    }

    /// The flush of `ticket` returned: clear the blocks that landed before
    /// it began and were not marked since. Returns the blocks cleared;
    /// durable at the next `sync`.
    pub fn clear_landed(&self, ticket: LandedTicket) -> u64 {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        assert_eq!(
            inner.epoch,
            ticket.epoch + 1,
            "one flush of the resyncing leg at a time"
        );
        let done = std::mem::take(&mut inner.landed[(ticket.epoch % 2) as usize]);
        let mut cleared = 0;
        for lba in done {
            if set_bit(&mut inner.bits, lba, false) {
                inner.count -= 1;
                inner.changed.insert(lba / PAGE_BITS);
                cleared += 1;
            }
        }
        cleared
    }

    /// Delete every copy (the leg is in sync again), directories fsynced.
    pub fn remove(&self) -> Result<()> {
        for (path, _) in &self.files {
            self.store
                .remove(path)
                .map_err(|error| io_error("remove", path, error))?;
        }
        Ok(())
    }

    /// The files holding the map.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.files.iter().map(|(path, _)| path.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCKS: u64 = 3 * REGION_BLOCKS as u64 + 10;

    fn open(dir: &Path, create_clean: bool) -> (DirtyMap, Option<String>) {
        DirtyMap::open(&[dir.to_path_buf()], 1, [4; 16], BLOCKS, create_clean).expect("open")
    }

    #[test]
    fn a_clean_close_keeps_exactly_the_marked_blocks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (map, unknown) = open(dir.path(), true);
        assert!(unknown.is_none());
        map.mark(5, 7).expect("mark");
        map.mark(
            2 * u64::from(REGION_BLOCKS) + 1,
            2 * u64::from(REGION_BLOCKS) + 2,
        )
        .expect("mark");
        map.sync_and_retire().expect("close");
        drop(map);
        let (map, unknown) = open(dir.path(), false);
        assert!(unknown.is_none());
        assert_eq!(map.count(), 3);
        assert_eq!(map.dirty_in(0, 10), vec![5, 6]);
        let (_, count) = inspect(&dir.path().join(map_file_name(1))).expect("inspect");
        assert_eq!(count, 3);
    }

    #[test]
    fn a_crash_before_the_block_sync_counts_the_whole_region() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (map, _) = open(dir.path(), true);
        // The region bit is durable before `mark` returns; the block bit
        // only at the next sync, which never comes (a crash).
        map.mark(u64::from(REGION_BLOCKS) + 3, u64::from(REGION_BLOCKS) + 4)
            .expect("mark");
        drop(map);
        let (map, unknown) = open(dir.path(), false);
        assert!(unknown.is_none());
        assert_eq!(map.count(), u64::from(REGION_BLOCKS), "the whole region");
        assert_eq!(map.next_dirty(0), Some(u64::from(REGION_BLOCKS)));
        // After a sync the region bits go: a later crash keeps only blocks.
        map.sync_and_retire().expect("retire");
        let copied: Vec<u64> = (u64::from(REGION_BLOCKS)..2 * u64::from(REGION_BLOCKS))
            .filter(|&lba| lba != u64::from(REGION_BLOCKS) + 3)
            .collect();
        map.landed(copied.iter().copied());
        let ticket = map.begin_flush();
        assert_eq!(map.clear_landed(ticket), copied.len() as u64);
        map.sync_and_retire().expect("sync");
        drop(map);
        let (map, _) = open(dir.path(), false);
        assert_eq!(map.dirty_in(0, BLOCKS), vec![u64::from(REGION_BLOCKS) + 3]);
    }

    #[test]
    fn a_block_marked_after_it_landed_stays_dirty_and_its_neighbours_clear() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (map, _) = open(dir.path(), true);
        map.mark(0, 4).expect("mark");
        map.landed(0..4);
        assert!(map.to_copy_in(0, 8).is_empty(), "landed: not copied again");
        map.mark(2, 3).expect("written again after the copy");
        assert_eq!(map.to_copy_in(0, 8), vec![2]);
        assert_eq!(map.next_to_copy(0), Some(2));
        let ticket = map.begin_flush();
        assert_eq!(map.clear_landed(ticket), 3, "per block: 0, 1 and 3 clear");
        assert_eq!(map.dirty_in(0, 8), vec![2]);
    }

    #[test]
    fn only_what_landed_before_the_flush_began_is_cleared() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (map, _) = open(dir.path(), true);
        map.mark(0, 10).expect("mark");
        map.landed([1, 2]);
        let ticket = map.begin_flush();
        // Landed while the flush runs (a write that completed after it was
        // issued): the flush may not cover it.
        map.landed([5]);
        // Written during the flush after it landed before: not covered.
        map.mark(2, 3).expect("mark");
        assert_eq!(map.clear_landed(ticket), 1);
        assert_eq!(map.dirty_in(0, 10), vec![0, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert!(map.has_landed(), "block 5 waits for the next flush");
        let ticket = map.begin_flush();
        assert_eq!(map.clear_landed(ticket), 1);
        assert_eq!(map.dirty_in(0, 10), vec![0, 2, 3, 4, 6, 7, 8, 9]);
        assert!(!map.has_landed());
        // A block that is not dirty does not land (nothing to clear).
        map.landed([1]);
        assert!(!map.has_landed());
    }

    #[test]
    fn a_damaged_or_missing_map_is_unknown_history_and_full() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (map, unknown) = open(dir.path(), false);
        assert!(unknown.expect("no map").contains("no resync map"));
        assert_eq!(map.count(), BLOCKS);
        drop(map);
        let path = dir.path().join(map_file_name(1));
        let (map, _) = open(dir.path(), true);
        map.sync_and_retire().expect("sync");
        drop(map);
        let mut bytes = std::fs::read(&path).expect("read");
        let at = bytes.len() - 100;
        bytes[at] ^= 1;
        std::fs::write(&path, &bytes).expect("damage");
        assert!(inspect(&path).expect_err("damaged").contains("checksum"));
        let (map, unknown) = open(dir.path(), false);
        assert!(unknown.expect("damaged").contains("unusable"));
        assert_eq!(map.count(), BLOCKS, "every block");
    }
}
