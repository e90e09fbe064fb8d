//! The written map in memory (`vouch_format::written` is its file): one bit
//! per metadata unit (a split context page, a packed row), set while the
//! unit holds protection information on disk. Resident (split: 256 KiB per
//! TiB; packed: about 1 MiB), read without a lock on the hot path.
//!
//! What a bit means, and the orderings that keep it true (every change
//! happens under the commit lock: commits, checkpoints, recovery):
//! - *set* ⇒ the unit's metadata on disk is not blank. So a unit whose bit
//!   is set and whose page or row reads as zeros (cut short, emptied,
//!   zeroed) has lost its metadata: its blocks are `metadata_lost` faults,
//!   never zeros.
//! - A bit is set only after the unit's metadata is written (split: when a
//!   checkpoint has written the page; packed: after a commit's home write
//!   of a record of the row), and cleared before the unit can become blank
//!   (split: before a checkpoint writes a blank page or punches it; packed:
//!   before a trim punches a row; a trim that leaves a row blank clears it
//!   while holding `change`, which a reader's judgement takes too).
//! - On disk the map is written at each checkpoint, after the contexts (or
//!   data) it describes are durable and before the superblock retires the
//!   journal. A crash before that leaves the previous copy: a bit it lacks
//!   only weakens detection until the next checkpoint; a bit it has for a
//!   unit made blank since is cleared again by recovery, which replays the
//!   trim that blanked it (split: every page a replayed trim touches;
//!   packed: the replayed punch clears it like the original did).
//! - Split pages also have an *expected generation*, written at the same
//!   checkpoint as the bits, in generations copies of their own `seq`
//!   that the checkpoint's superblock names (`generations_seq`: values
//!   only the named copy holds are believed, so a binary that zeroes the
//!   field leaves them not known, never stale) (the highest generation of
//!   a page's own contexts when a checkpoint last wrote it): a page found older is an older copy of `contexts`,
//!   lost as a whole (`judge_page`). Set after the page is written, so the
//!   map on disk is never newer than the page; recovery forgets it for
//!   every page a replayed entry touches (a checkpoint cut before the map
//!   may have made a page older: a trim, a copy keeping its source's
//!   generation).
//! - Packed rows have one too: a generation the row's newest own record
//!   is at least, raised by a commit after it writes records into the row
//!   (on disk with the next checkpoint's map, after their fsync) and
//!   forgotten before a write that may lower it (`forget_older`); after
//!   zeros it is raised to their commit's generation (zero contexts carry
//!   it), after a trim into part of it (markers carry none) it is read
//!   back from the row's slots (`fill_expected`), and a row a trim leaves
//!   holding nothing keeps the trim's under its clear bit, so a row last
//!   changed by a range is still judged. A row is
//!   judged once per open (`current`), at a read (`PackedLayout::
//!   judge_rows`) or before its first write (`settle_row`); recovery
//!   forgets the value of every row a replayed entry touches.
//! - Packed rows recovery redid records into under a clear bit are not
//!   read to make them whole at the open (`defer_bind`): bound before
//!   their next write or by the next checkpoint, before its map.

use std::collections::BTreeMap;
use std::ops::{Range, RangeInclusive};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;
use vouch_format::written::{
    bits_bytes, copy_bytes, copy_offset, decode_values_page, encode_values_page, generations_bytes,
    generations_offset, unit_blocks, GenerationsHeader, WrittenHeader, VALUES_PER_PAGE,
    WRITTEN_PAGE_BYTES,
};
use vouch_format::{
    crc32c, vacant_of, Context, ContextKind, FormatError, Geometry, LayoutKind, BLOCK_SIZE,
    CONTEXT_BYTES,
};

use crate::backing::Backing;
use crate::error::{Error, Result};
use crate::storage::{ObjectId, Storage};

pub(crate) struct WrittenMap {
    /// False for a volume made before the written map (opened read-only):
    /// no bit is ever set, so it reads as it always did.
    enabled: bool,
    unit_blocks: u64,
    units: u64,
    /// The volume's blocks: the last unit may reach past them, and its
    /// slots there belong to no LBA (`judge_slots` leaves them out).
    blocks: u64,
    uuid: [u8; 16],
    words: Vec<AtomicU64>,
    /// The expected generation of each unit (0: not known). Split: the
    /// highest generation among a page's own contexts when a checkpoint
    /// last wrote it; packed: a generation the row's newest own record is
    /// at least. A unit whose contexts are all older was restored from an
    /// older copy of the file (`judge_page`, `PackedLayout::judge_rows`).
    generations: Vec<AtomicU32>,
    /// A seqlock per stripe of units (unit `u` counts on stripe
    /// `u % WRITE_STRIPES`): odd while a checkpoint writes context pages
    /// and then sets their expected generations (every stripe), or a
    /// commit writes packed records or a range and moves their rows'
    /// (the stripes of those rows only): a unit a reader read from disk
    /// meanwhile may be the one before the write while the expected value
    /// is already the one after, so it is not judged older (`Seen`).
    /// Striped, not one counter: under a steady stream of commits
    /// elsewhere in the volume a reader of a row must still find its
    /// stripe even and conclude (a global counter was odd at nearly every
    /// read, and older rows read as current until their next write).
    page_writes: Box<[AtomicU64; WRITE_STRIPES]>,
    /// Packed: one bit per row found no older than its expected
    /// generation during this open (or whose expectation is not known),
    /// so each row is judged once, not at every read of one of its
    /// records. Memory only: an older copy is restored while the volume
    /// is closed.
    current: Vec<AtomicU64>,
    /// Packed: one bit per row found older than its expected generation
    /// this open, so its later reads fail without reading it again (and
    /// it is named once in the log). Cleared when the row is made current
    /// (`set_current`: a write marked its older slots lost).
    older: Vec<AtomicU64>,
    /// `crc32c(uuid)`: the volume tag of the markers this map judges.
    volume_tag: u32,
    /// The volume's units are whole (`INCOMPAT_BOUND_UNITS`): a written
    /// unit has no blank slot (vacant markers stand for never-written
    /// and trimmed blocks), so one blank slot in it is lost metadata.
    /// Set at open from the flag, or by `vouch upgrade` once it has
    /// written the markers.
    bound: AtomicBool,
    /// The bits changed since the copy on disk was written.
    dirty: AtomicBool,
    /// An expected generation changed since the generations copy on disk
    /// was written (a copy of its own `seq`: values move at most commits,
    /// bits rarely, so neither rewrites the other).
    values_dirty: AtomicBool,
    /// Per generations copy (0, 1), one bit per 4 KiB page of its values:
    /// the page changed since that copy was last written, so a map update
    /// encodes, checksums and writes only those pages of the copy it
    /// writes (each page has its own CRC), not the whole array (packed: 33
    /// MiB per TiB) at every checkpoint that moved one value. All set at
    /// open: the copy not loaded may be torn or of another `seq`.
    generation_pages: [Vec<AtomicU64>; 2],
    /// `seq` of the newest copy on disk (0: none yet).
    seq: AtomicU64,
    /// `seq` of the generations copy whose values these are (0: none:
    /// every value was not known when the map was loaded, and nothing has
    /// been written since). The superblock names it at each checkpoint
    /// (`Superblock::generations_seq`); only the copy it names is loaded.
    generations_seq: AtomicU64,
    /// Held while a unit may be blank with its bit set (a packed trim that
    /// blanks a row, before it clears the bit) and by a reader judging a
    /// unit lost, so the reader never sees that moment.
    pub change: Mutex<()>,
    /// Packed rows recovery wrote journaled records into while their bit
    /// was clear, not made whole yet (`defer_bind`): each with the mask
    /// of its slots the replay wrote. Memory only; emptied before any
    /// map that sets their bits reaches disk (a checkpoint binds them:
    /// `PackedLayout::bind_deferred`).
    unbound: Mutex<BTreeMap<u64, u32>>,
    /// `unbound` is not empty: the only thing a judgement of a blank slot
    /// looks at when no row waits (every open but a recovering one).
    any_unbound: AtomicBool,
}

/// What `WrittenMap::load` found in the `written` object.
pub(crate) enum Loaded {
    /// Boxed: the map is a few hundred bytes, the refusals a `String`.
    Map(Box<WrittenMap>),
    /// No valid copy: the reason, for the refusal.
    None(String),
    /// The generations copy the superblock names is not in the file (an
    /// older copy of `written` restored, or the copy damaged): what is
    /// wrong, for the refusal (`damage::load_written`).
    NotNamed(String),
}

impl WrittenMap {
    fn with(geometry: &Geometry, uuid: [u8; 16], enabled: bool) -> WrittenMap {
        let unit = u64::from(unit_blocks(geometry.layout));
        let units = geometry.blocks.div_ceil(unit);
        WrittenMap {
            enabled,
            unit_blocks: unit,
            units,
            blocks: geometry.blocks,
            uuid,
            volume_tag: crc32c(&uuid),
            bound: AtomicBool::new(false),
            words: (0..units.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            generations: (0..if enabled { units } else { 0 })
                .map(|_| AtomicU32::new(0))
                .collect(),
            page_writes: Box::new([const { AtomicU64::new(0) }; WRITE_STRIPES]),
            current: row_bits(enabled, geometry, units),
            older: row_bits(enabled, geometry, units),
            dirty: AtomicBool::new(false),
            values_dirty: AtomicBool::new(false),
            generation_pages: [0, 1].map(|_| {
                let pages = if enabled {
                    generations_bytes(units) / WRITTEN_PAGE_BYTES
                } else {
                    0
                };
                (0..pages.div_ceil(64))
                    .map(|word| {
                        let left = pages - word * 64;
                        AtomicU64::new(if left >= 64 {
                            u64::MAX
                        } else {
                            (1 << left) - 1
                        })
                    })
                    .collect()
            }),
            seq: AtomicU64::new(0),
            generations_seq: AtomicU64::new(0),
            change: Mutex::new(()),
            unbound: Mutex::new(BTreeMap::new()),
            any_unbound: AtomicBool::new(false),
        }
    }

    /// The map of a volume made before it: never set, never written. Its
    /// volume tag is the volume's (`uuid`): a page load compares a zero
    /// context's tags with it, and keeps one that names another volume as
    /// that volume's vacant marker (a fault), so a tag of no volume made
    /// every written-zeroes block of such a volume fail.
    pub fn disabled(geometry: &Geometry, uuid: [u8; 16]) -> WrittenMap {
        WrittenMap::with(geometry, uuid, false)
    }

    /// An empty map (a new volume, or one being built by an upgrade).
    pub fn empty(geometry: &Geometry, uuid: [u8; 16]) -> WrittenMap {
        let map = WrittenMap::with(geometry, uuid, true);
        map.dirty.store(true, Ordering::Release);
        map
    }

    /// The map a rebuild (`vouch upgrade`) starts from: the valid map on
    /// disk if there is one (a rebuild only adds bits, so a unit already
    /// known written and now blank stays lost, and its next write is the
    /// newest copy), else an empty one.
    pub fn to_rebuild(
        storage: &dyn Storage,
        geometry: &Geometry,
        (uuid, generations_seq): ([u8; 16], u64),
    ) -> Result<WrittenMap> {
        match WrittenMap::load(storage, geometry, (uuid, generations_seq))? {
            Loaded::Map(old) => {
                old.dirty.store(true, Ordering::Release);
                Ok(*old)
            }
            Loaded::None(_) => Ok(WrittenMap::empty(geometry, uuid)),
            // The operator accepts the files as they are: the bits of the
            // copy found, every expected generation filled in again from
            // the units as they are now (`damage::build_written`).
            Loaded::NotNamed(_) => match WrittenMap::load(storage, geometry, (uuid, 0))? {
                Loaded::Map(old) => {
                    old.dirty.store(true, Ordering::Release);
                    Ok(*old)
                }
                _ => Ok(WrittenMap::empty(geometry, uuid)),
            },
        }
    }

    /// Whether the volume's units are whole (`bound` above).
    pub fn bound(&self) -> bool {
        self.bound.load(Ordering::Acquire)
    }

    /// From now on, units are kept whole and judged so.
    pub fn set_bound(&self) {
        if self.enabled {
            self.bound.store(true, Ordering::Release);
        }
    }

    /// The vacant marker of `lba` (a never-written or trimmed slot of a
    /// whole unit).
    pub fn vacant(&self, lba: u64) -> [u8; CONTEXT_BYTES] {
        vouch_format::encode_vacant(self.volume_tag, lba)
    }

    /// The context of `lba` from its stored slot `raw`, judged against the
    /// map: a blank slot in a unit whose bit is set is lost
    /// (`MetadataLost`; a volume whose units are not whole leaves that to
    /// its layout, which then looks at the whole unit); its own vacant
    /// marker reads as never written; anything else as it decodes.
    pub fn judge_slot(&self, lba: u64, raw: &[u8]) -> Result<Context, FormatError> {
        if raw[..CONTEXT_BYTES].iter().all(|byte| *byte == 0) {
            return if self.is_set(self.unit_of(lba)) && !self.blank_until_bound(lba) {
                Err(FormatError::MetadataLost)
            } else {
                Ok(Context::Unwritten)
            };
        }
        if vacant_of(raw, self.volume_tag, lba) {
            return Ok(Context::Unwritten);
        }
        Context::decode(raw)
    }

    /// A unit's slots as they go to disk (`slots`: its metadata, slot `i`
    /// holding LBA `first_lba + i`, past the volume's `blocks` ignored): in
    /// a volume whose units are whole, every blank slot of a unit that is
    /// not blank (or, with `even_if_blank`, is about to hold a record)
    /// becomes its vacant marker. Returns whether any changed.
    /// `keep_blank`: a mask of slots left as they are (a deferred row's
    /// slots a replayed record wrote: one blank now has lost its record).
    pub fn bind_slots(
        &self,
        (first_lba, blocks): (u64, u64),
        slots: &mut [&mut [u8]],
        (even_if_blank, keep_blank): (bool, u32),
    ) -> bool {
        if !self.bound()
            || (!even_if_blank && slots.iter().all(|slot| slot.iter().all(|byte| *byte == 0)))
        {
            return false;
        }
        let mut changed = false;
        for (index, slot) in slots.iter_mut().enumerate() {
            let lba = first_lba + index as u64;
            let kept = index < 32 && keep_blank & (1 << index) != 0;
            if lba < blocks && !kept && slot.iter().all(|byte| *byte == 0) {
                slot.copy_from_slice(&self.vacant(lba));
                changed = true;
            }
        }
        changed
    }

    /// The lost marker of `lba` (a slot whose protection information, or
    /// whose data, is gone).
    pub fn lost(&self, lba: u64) -> [u8; CONTEXT_BYTES] {
        vouch_format::encode_lost(self.volume_tag, lba)
    }

    /// Recovery wrote the journaled record of `lba` into its packed row
    /// while the row's bit was clear (in the map on disk: it was written
    /// since the last checkpoint), or into a row already deferred, and
    /// sets the bit without making the row whole first (that costs a read
    /// of the whole row, 128 KiB, for each such row of the journal: 1,167
    /// rows and 150 MB after 20,000 random writes, most of a restart). The
    /// row is bound later, before its next record or range
    /// (`PackedLayout::bind_row`) or by the next checkpoint, before the
    /// map that sets its bit is written (`PackedLayout::bind_deferred`).
    /// Until then a blank slot of it is lost only where a replayed record
    /// lies (`blank_until_bound`): its other slots held nothing at the
    /// last checkpoint (the bit was clear) and nothing was journaled into
    /// them since, so blank there is what binding would have made a vacant
    /// marker, a never-written block. Detection is the same as binding at
    /// once: a slot the journal wrote that reads blank is lost.
    pub fn defer_bind(&self, lba: u64) {
        let unit = self.unit_of(lba);
        let slot = lba - unit * self.unit_blocks;
        if !self.enabled || unit >= self.units || slot >= 32 {
            return;
        }
        let mut unbound = self.unbound.lock();
        *unbound.entry(unit).or_insert(0) |= 1 << slot;
        self.any_unbound.store(true, Ordering::Release);
    }

    /// The mask of replayed slots of row `unit` if it waits to be bound
    /// (`defer_bind`).
    pub fn unbound(&self, unit: u64) -> Option<u32> {
        if !self.any_unbound.load(Ordering::Acquire) {
            return None;
        }
        self.unbound.lock().get(&unit).copied()
    }

    /// Row `unit` is whole (bound, replaced by a commit, or clear): it no
    /// longer waits.
    pub fn bound_now(&self, unit: u64) {
        if !self.any_unbound.load(Ordering::Acquire) {
            return;
        }
        let mut unbound = self.unbound.lock();
        unbound.remove(&unit);
        if unbound.is_empty() {
            self.any_unbound.store(false, Ordering::Release);
        }
    }

    /// The rows waiting to be bound, in order (a checkpoint binds them).
    pub fn unbound_rows(&self) -> Vec<(u64, u32)> {
        if !self.any_unbound.load(Ordering::Acquire) {
            return Vec::new();
        }
        self.unbound
            .lock()
            .iter()
            .map(|(unit, mask)| (*unit, *mask))
            .collect()
    }

    /// Whether a blank slot of `lba`, in a unit whose bit is set, is a
    /// never-written block of a row waiting to be bound (`defer_bind`).
    fn blank_until_bound(&self, lba: u64) -> bool {
        let unit = self.unit_of(lba);
        let slot = (lba - unit * self.unit_blocks) as u32;
        self.unbound(unit)
            .is_some_and(|mask| mask & 1u32.checked_shl(slot).unwrap_or(0) == 0)
    }

    pub fn unit_blocks(&self) -> u64 {
        self.unit_blocks
    }

    pub fn unit_of(&self, lba: u64) -> u64 {
        lba / self.unit_blocks
    }

    /// The LBAs of `unit` (the last unit may be short).
    pub fn lbas_of(&self, unit: u64, blocks: u64) -> Range<u64> {
        unit * self.unit_blocks..((unit + 1) * self.unit_blocks).min(blocks)
    }

    pub fn is_set(&self, unit: u64) -> bool {
        self.enabled
            && unit < self.units
            && self.words[(unit / 64) as usize].load(Ordering::Acquire) & (1 << (unit % 64)) != 0
    }

    pub fn set(&self, unit: u64) {
        if !self.enabled || unit >= self.units {
            return;
        }
        let bit = 1 << (unit % 64);
        let old = self.words[(unit / 64) as usize].fetch_or(bit, Ordering::AcqRel);
        if old & bit == 0 {
            self.dirty.store(true, Ordering::Release);
        }
    }

    pub fn clear(&self, unit: u64) {
        if !self.enabled || unit >= self.units {
            return;
        }
        // A clear row is bound again before its next record (`bind_row`).
        self.bound_now(unit);
        let bit = 1 << (unit % 64);
        let old = self.words[(unit / 64) as usize].fetch_and(!bit, Ordering::AcqRel);
        if old & bit != 0 {
            self.dirty.store(true, Ordering::Release);
        }
    }

    /// The writes begun and ended on the stripes of `units` (odd: one is
    /// running), to take before reading those units to judge them
    /// (`judge_page`, `PackedLayout::judge_rows`). Only their stripes are
    /// read (at most `WRITE_STRIPES`, so a long read costs no more); a
    /// unit outside `units` is never `settled` by it.
    pub fn page_writes(&self, units: RangeInclusive<u64>) -> Seen {
        let mut seen = Seen([1; WRITE_STRIPES]);
        for unit in units.take(WRITE_STRIPES) {
            let stripe = stripe_of(unit);
            seen.0[stripe] = self.page_writes[stripe].load(Ordering::Acquire);
        }
        seen
    }

    /// Whether no unit of `unit`'s stripe was written, nor its expected
    /// generation moved, since `seen` was taken: `unit` read from disk
    /// in between is judged against the expected value now.
    pub fn settled(&self, seen: &Seen, unit: u64) -> bool {
        let stripe = stripe_of(unit);
        seen.0[stripe].is_multiple_of(2)
            && self.page_writes[stripe].load(Ordering::Acquire) == seen.0[stripe]
    }

    /// A checkpoint starts writing context pages (then sets their
    /// expected generations), on every stripe; `end_page_writes` when
    /// both are done.
    pub fn begin_page_writes(&self) {
        self.bump_stripes(u64::MAX);
    }

    pub fn end_page_writes(&self) {
        self.bump_stripes(u64::MAX);
    }

    fn bump_stripes(&self, stripes: u64) {
        for (stripe, counter) in self.page_writes.iter().enumerate() {
            if stripes & (1 << stripe) != 0 {
                counter.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    /// A writer of packed rows `units` (a commit's records, a range's
    /// rows) holds this while it writes them and moves their expected
    /// generations: their stripes are odd meanwhile (`settled`). Taken
    /// under the commit lock, never nested.
    pub fn page_writes_guard(&self, units: impl Iterator<Item = u64>) -> PageWritesGuard<'_> {
        let mut stripes = 0u64;
        for unit in units {
            stripes |= 1 << stripe_of(unit);
            if stripes == u64::MAX {
                break;
            }
        }
        self.bump_stripes(stripes);
        PageWritesGuard(self, stripes)
    }

    /// Whether packed row `unit` is still to be judged against its
    /// expected generation this open: its expectation known, not yet found
    /// current. A row whose bit is clear counts too: one trimmed whole or
    /// left vacant keeps its trim's generation, and any record in it
    /// older than that is an older copy's. Only its records are judged
    /// (blank slots and markers are nothing there: `judge_slots`); a read
    /// whose slots hold only nothing reads no more, one whose slots hold
    /// an older record judges the row whole.
    pub fn to_judge(&self, unit: u64) -> bool {
        self.current.get((unit / 64) as usize).is_some_and(|word| {
            word.load(Ordering::Acquire) & (1 << (unit % 64)) == 0
                && self.expected_generation(unit) != 0
        })
    }

    /// Packed row `unit` is current for the rest of this open: a slot of
    /// it held a generation no older than expected, or it was judged, or
    /// its older slots were marked lost.
    pub fn set_current(&self, unit: u64) {
        if let Some(word) = self.current.get((unit / 64) as usize) {
            word.fetch_or(1 << (unit % 64), Ordering::AcqRel);
        }
        if let Some(word) = self.older.get((unit / 64) as usize) {
            word.fetch_and(!(1 << (unit % 64)), Ordering::AcqRel);
        }
    }

    /// Packed row `unit` was found older than expected this open; true
    /// the first time (to name it once).
    pub fn set_older(&self, unit: u64) -> bool {
        self.older.get((unit / 64) as usize).is_some_and(|word| {
            word.fetch_or(1 << (unit % 64), Ordering::AcqRel) & (1 << (unit % 64)) == 0
        })
    }

    /// Whether packed row `unit` was found older this open (and not made
    /// current since).
    pub fn is_older(&self, unit: u64) -> bool {
        self.older
            .get((unit / 64) as usize)
            .is_some_and(|word| word.load(Ordering::Acquire) & (1 << (unit % 64)) != 0)
    }

    /// A unit's expected generation after records of generations up to
    /// `newest` were written into it (and, before, `forget_older` for
    /// each). A unit whose expectation was forgotten or never known
    /// expects `newest` from now: those records are in it.
    pub fn raise_expected(&self, unit: u64, newest: u32) {
        let expected = self.expected_generation(unit);
        if newest != 0 && (expected == 0 || newer(newest, expected)) {
            self.set_expected_generation(unit, newest);
        }
    }

    /// Before a write into `unit` of a slot of generation `generation`
    /// (`None` or 0: a marker, or a zero context of a binary before zero
    /// contexts carried their commit's generation): one
    /// that is not newer than expected may replace the slot that held the
    /// unit's newest, so the expectation is forgotten before the write can
    /// lower it on disk (a copy keeps its source's generation; a trim
    /// leaves a marker).
    pub fn forget_older(&self, unit: u64, generation: Option<u32>) {
        let expected = self.expected_generation(unit);
        let older =
            generation.is_none_or(|generation| generation == 0 || newer(expected, generation));
        if expected != 0 && older {
            self.set_expected_generation(unit, 0);
        }
    }

    /// Learn the expected generation of `unit`, when it is not known,
    /// from its slots as they are on disk (`vouch upgrade`; a packed row
    /// after a range forgot it, `PackedLayout::fill_row_expected`): the newest
    /// generation among its own slots that are whole (as `judge_slots`
    /// checks them), so a damaged slot never sets an expectation no slot
    /// reaches. Any own slot's value will do: the unit then reaches it.
    pub fn fill_expected<'a>(
        &self,
        unit: u64,
        slots: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
    ) {
        if self.expected_generation(unit) != 0 {
            return;
        }
        let first_lba = unit * self.unit_blocks;
        let mut newest: Option<u32> = None;
        for (slot, (context, data)) in slots.enumerate() {
            if context.iter().all(|byte| *byte == 0) || !context_intact(context, data) {
                continue;
            }
            match self.own_generation(first_lba + slot as u64, context) {
                Some(generation)
                    if generation != 0 && newest.is_none_or(|newest| newer(generation, newest)) =>
                {
                    newest = Some(generation);
                }
                _ => {}
            }
        }
        if let Some(newest) = newest {
            self.set_expected_generation(unit, newest);
        }
    }

    /// The generation `unit` is expected to have on disk (0: not known).
    pub fn expected_generation(&self, unit: u64) -> u32 {
        self.generations
            .get(unit as usize)
            .map_or(0, |value| value.load(Ordering::Acquire))
    }

    /// Record the generation a checkpoint wrote `unit` with (0: forget).
    pub fn set_expected_generation(&self, unit: u64, generation: u32) {
        if let Some(value) = self.generations.get(unit as usize) {
            if value.swap(generation, Ordering::AcqRel) != generation {
                let page = unit / VALUES_PER_PAGE;
                for pages in &self.generation_pages {
                    pages[(page / 64) as usize].fetch_or(1 << (page % 64), Ordering::AcqRel);
                }
                self.values_dirty.store(true, Ordering::Release);
            }
        }
    }

    /// Forget the expected generation of every unit `[start, end)`
    /// touches (recovery: what the journal changes there may have reached
    /// disk after the map was written, lower as well as higher).
    pub fn forget_generations(&self, start: u64, end: u64) {
        if end > start {
            for unit in self.unit_of(start)..=self.unit_of(end - 1) {
                self.set_expected_generation(unit, 0);
            }
        }
    }

    /// A split context page's generation: the highest generation among
    /// its slots that are its own (a plain context naming this volume and
    /// its LBA; an encrypted one, whose tags are inside its AEAD), 0 if
    /// none is. Markers carry none.
    pub fn page_generation(&self, page_no: u64, page: &[u8]) -> u32 {
        self.slots_generation(page_no * self.unit_blocks, page.chunks(CONTEXT_BYTES))
    }

    /// The generation of consecutive slots, the first of LBA `first_lba`
    /// (a split page's, a packed row's contexts, or some of them): as
    /// `page_generation`.
    pub fn slots_generation<'a>(
        &self,
        first_lba: u64,
        slots: impl Iterator<Item = &'a [u8]>,
    ) -> u32 {
        self.own_newest(first_lba, slots).unwrap_or(0)
    }

    /// The newest generation among consecutive slots' own ones (as
    /// `slots_generation`), or `None` if no slot is the volume's own: a
    /// context naming this volume and its LBA (an encrypted one), or a
    /// vacant or lost marker naming them, which count as generation 0.
    /// For raising an expectation to a value one of the slots holds; a
    /// judgement asks `judge_slots`.
    pub fn own_newest<'a>(
        &self,
        first_lba: u64,
        slots: impl Iterator<Item = &'a [u8]>,
    ) -> Option<u32> {
        let mut highest = None;
        for (slot, context) in slots.enumerate() {
            let Some(generation) = self.own_generation(first_lba + slot as u64, context) else {
                continue;
            };
            if highest.is_none_or(|highest| newer(generation, highest)) {
                highest = Some(generation);
            }
        }
        highest
    }

    /// Whether a slot says "nothing here" in a clear unit: blank, or a
    /// vacant or lost marker (no generation). In a clear unit such a slot
    /// reads as zeros whatever the unit's verdict: only its slots holding
    /// a record (data, encrypted, zero context) are judged, and failed
    /// when the unit is older, so reads of it and `check` agree whatever
    /// order they read its slots in.
    pub fn holds_nothing(context: &[u8]) -> bool {
        matches!(
            context[0],
            vouch_format::KIND_VACANT | vouch_format::KIND_LOST
        ) || context.iter().all(|byte| *byte == 0)
    }

    /// A slot's generation if it is the volume's own (as `own_newest`),
    /// read as it lies: nothing checked but the tags.
    fn own_generation(&self, lba: u64, context: &[u8]) -> Option<u32> {
        match context[0] {
            1 | 2 | vouch_format::KIND_VACANT | vouch_format::KIND_LOST => {
                let tag = u32::from_le_bytes(context[4..8].try_into().expect("4 bytes"));
                let ref_tag = u64::from_le_bytes(context[8..16].try_into().expect("8 bytes"));
                if (tag, ref_tag) != (self.volume_tag, lba) {
                    return None;
                }
                Some(if matches!(context[0], 1 | 2) {
                    u32::from_le_bytes(context[24..28].try_into().expect("4 bytes"))
                } else {
                    0
                })
            }
            3 => Some(u32::from_le_bytes(
                context[1..5].try_into().expect("4 bytes"),
            )),
            _ => None,
        }
    }

    /// How consecutive slots (each a context, with its stored data when
    /// the caller has it: a packed record) stand against `expected`.
    /// Asked slot by slot: a unit reaches its expectation when one own
    /// slot carries a generation (not 0) that is not older than it. Not
    /// by folding a newest first: serial-number order (`newer`) is not
    /// transitive once a unit's generations spread over half the space,
    /// and a fold could then pick an older slot.
    ///
    /// A slot whose context is damaged may be the very one that held the
    /// unit's newest generation, so a unit with one is `Unsure`, never
    /// `Older`: a bit flipped in one context is that block's fault (found
    /// when it is read), not its 30 or 127 neighbours'. Checked: a plain
    /// context's or marker's CRC; an encrypted context's keyless guard
    /// when its data is given (without data, as in a split page, its
    /// generation is taken as it lies); a kind byte no context has. The
    /// same holds for a slot of another place or volume: damage that may
    /// have replaced the newest generation. A blank slot is skipped
    /// in a unit that is not whole (`bound`), where a never-written block
    /// has one, and in a whole unit too when its data is blank as well or
    /// not given (a copy from before the units were whole has such slots);
    /// a blank context over data that is not blank makes a whole unit
    /// `Unsure`. Only slots of LBAs inside the volume are judged: the last
    /// unit may reach past its end, and its slots there are blank in every
    /// copy (a read that judged a packed row as read whole, past the end
    /// too, and a `check` that judged the slots its chunk held found a
    /// different verdict for the same row).
    pub fn judge_slots<'a>(
        &self,
        first_lba: u64,
        slots: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
        expected: u32,
    ) -> SlotVerdict {
        let mut newest: Option<u32> = None;
        let mut unsure = false;
        // A clear unit holds nothing a trim left: its markers (vacant or
        // lost, no generation) say "nothing here", not "older" (as
        // `holds_nothing`). Only its slots that hold a record are judged;
        // a unit a trim left vacant (all markers) is `NoOwn` and reads as
        // zeros.
        let clear = self.enabled && !self.is_set(self.unit_of(first_lba));
        let slots = slots.take(self.blocks.saturating_sub(first_lba) as usize);
        for (slot, (context, data)) in slots.enumerate() {
            if context.iter().all(|byte| *byte == 0) {
                // A blank context over data that is not blank is damage (a
                // zeroed 4 KiB page of a packed file blanks one record's
                // context and leaves most of its data), and in a whole unit
                // it may have been the newest slot. Blank in context and
                // data alike, or without data (a split page), it may be a
                // never-written block in a copy taken before the volume's
                // units were whole (`vouch upgrade` writes vacant markers
                // only into the files it finds): that is skipped, as in a
                // unit that is not whole, so such an older copy is still
                // judged older by its other slots, not left unsure.
                unsure |=
                    self.bound() && data.is_some_and(|data| data.iter().any(|byte| *byte != 0));
                continue;
            }
            if !context_intact(context, data) {
                unsure = true;
                continue;
            }
            let Some(generation) = self.own_generation(first_lba + slot as u64, context) else {
                // Another place's or volume's slot (a misdirected write, a
                // page copied in) fails its own block's tags; like a blank
                // one it may have replaced the newest generation.
                unsure = true;
                continue;
            };
            if clear && Self::holds_nothing(context) {
                continue;
            }
            if generation != 0 && !newer(expected, generation) {
                return SlotVerdict::Reaches;
            }
            if newest.is_none_or(|newest| newer(generation, newest)) {
                newest = Some(generation);
            }
        }
        match (unsure, newest) {
            (true, _) => SlotVerdict::Unsure,
            (false, None) => SlotVerdict::NoOwn,
            (false, Some(found)) => SlotVerdict::Older(found),
        }
    }

    /// Whether split page `page_no` (as read from disk) is older than the
    /// checkpoint that last wrote it: `(its generation, the expected)`.
    /// A page with no own slot is left to its tags (a page of another
    /// place or volume fails them, named as such); one whose own slots are
    /// only markers and zero contexts of generation 0 is older than any
    /// expected value.
    pub fn stale_page(&self, page_no: u64, page: &[u8]) -> Option<(u32, u32)> {
        self.stale_unit(page_no, page.chunks(CONTEXT_BYTES))
    }

    /// `stale_page` for a page whose blocks' data can be read (`read`
    /// fills the page's blocks inside the volume, in LBA order; a block it
    /// cannot read left zeros), read only when the page would be judged
    /// older and holds encrypted contexts. A page load reads no data, so
    /// an encrypted context's generation is taken as it lies there, and a
    /// bit flipped in the generation of the page's newest context would
    /// make it look older than expected, its 127 neighbours with it. With
    /// the data: a context whose keyless guard fails as it lies and holds
    /// with the page's expected generation in place of its own, however
    /// many of its generation's bits differ
    /// (`encryption::generation_damaged_from`), is that damaged newest
    /// slot (a split page's expected generation is exactly the newest its
    /// checkpoint wrote, so that one generation is the only one tried),
    /// and the page is not judged (`Unsure`, as `judge_slots` says of a
    /// slot whose own check fails): the damaged block is its own fault.
    /// An older copy of the file keeps its verdict: its contexts over the
    /// current data hold their guards (blocks not rewritten since the copy)
    /// or fail them with the expected generation too (rewritten ones:
    /// another write's nonce and tag, once in 2^32 each).
    pub fn stale_page_read(
        &self,
        page_no: u64,
        page: &[u8],
        read: impl FnOnce(&mut [u8]),
    ) -> Option<(u32, u32)> {
        let (found, expected) = self.stale_page(page_no, page)?;
        let encrypted = ContextKind::Encrypted as u8;
        if !page.chunks(CONTEXT_BYTES).any(|slot| slot[0] == encrypted) {
            return Some((found, expected));
        }
        let first = page_no * self.unit_blocks;
        let blocks = self.unit_blocks.min(self.blocks.saturating_sub(first)) as usize;
        let mut data = vec![0u8; blocks * BLOCK_SIZE as usize];
        read(&mut data);
        let damaged_newest = page
            .chunks(CONTEXT_BYTES)
            .zip(data.chunks(BLOCK_SIZE as usize))
            .any(|(slot, stored)| {
                crate::encryption::generation_damaged_from(slot, stored, expected)
            });
        (!damaged_newest).then_some((found, expected))
    }

    /// `stale_page` for any unit, from its slots in LBA order.
    pub fn stale_unit<'a>(
        &self,
        unit: u64,
        slots: impl Iterator<Item = &'a [u8]>,
    ) -> Option<(u32, u32)> {
        self.stale_records(unit, slots.map(|context| (context, None)))
    }

    /// `stale_unit` for slots with their stored data (packed records).
    pub fn stale_records<'a>(
        &self,
        unit: u64,
        slots: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
    ) -> Option<(u32, u32)> {
        let expected = self.expected_generation(unit);
        // A clear unit's expectation is its trim's (a packed row trimmed
        // whole): an own slot older than it is an older copy's.
        if expected == 0 {
            return None;
        }
        match self.judge_slots(unit * self.unit_blocks, slots, expected) {
            SlotVerdict::Older(found) => Some((found, expected)),
            SlotVerdict::Reaches | SlotVerdict::NoOwn | SlotVerdict::Unsure => None,
        }
    }

    /// Clear every unit that `[start, end)` touches.
    pub fn clear_touched(&self, start: u64, end: u64) {
        if end > start {
            for unit in self.unit_of(start)..=self.unit_of(end - 1) {
                self.clear(unit);
            }
        }
    }

    /// The first LBA at or after `lba` in a unit whose bit is set.
    pub fn next_set_lba(&self, lba: u64) -> Option<u64> {
        if !self.enabled {
            return None;
        }
        let mut unit = self.unit_of(lba);
        while unit < self.units {
            let word = self.words[(unit / 64) as usize].load(Ordering::Acquire) >> (unit % 64);
            if word != 0 {
                let found = unit + u64::from(word.trailing_zeros());
                return (found < self.units).then(|| (found * self.unit_blocks).max(lba));
            }
            unit = (unit / 64 + 1) * 64;
        }
        None
    }

    /// Whether any unit touching `[start, end)` has its bit set.
    pub fn any_set(&self, start: u64, end: u64) -> bool {
        self.next_set_lba(start).is_some_and(|lba| lba < end)
    }

    /// A context page as read from disk, judged against the map: its own
    /// vacant markers become blank slots (never written, as the context
    /// cache keeps them); a blank slot of a page whose bit is set — any
    /// one when units are whole, else only a wholly blank page — has lost
    /// its metadata and becomes a lost marker, so its block reads as a
    /// `metadata_lost` fault and a checkpoint that rewrites the page keeps
    /// it so (`vouch_format::encode_lost`). Markers of another place or
    /// volume stay, and decode as `FormatError::Vacant`.
    ///
    /// `seen`: `page_writes(page_no..=page_no)` before the page was read. A checkpoint that
    /// wrote pages since (or was writing them) may have raised the
    /// expected generation past the bytes read, so the page is not judged
    /// older then (it is read again at its next load).
    ///
    /// `read`: the page's data, for `stale_page_read` (read only when the
    /// page would be judged older).
    pub fn judge_page(
        &self,
        page_no: u64,
        page: &mut [u8; 4096],
        seen: &Seen,
        read: impl FnOnce(&mut [u8]),
    ) {
        let set = self.is_set(page_no);
        let bound = self.bound();
        if !set && page.iter().all(|byte| *byte == 0) {
            return;
        }
        let settled = self.settled(seen, page_no);
        // Settled again after the verdict: judging an encrypted page reads
        // its data, and a checkpoint that wrote pages meanwhile may have
        // raised the expected value past the bytes read.
        if let Some((found, expected)) = settled
            .then(|| self.stale_page_read(page_no, page, read))
            .flatten()
            .filter(|_| self.settled(seen, page_no))
        {
            // An older copy of the page: which of its slots still hold
            // what the volume wrote last cannot be told, so none is
            // trusted (a mirror leg repairs them; a checkpoint that
            // rewrites the page keeps the markers).
            for (slot, context) in page.chunks_mut(CONTEXT_BYTES).enumerate() {
                let lba = page_no * self.unit_blocks + slot as u64;
                context.copy_from_slice(&vouch_format::encode_lost(self.volume_tag, lba));
            }
            tracing::warn!(
                page = page_no,
                first_lba = page_no * self.unit_blocks,
                found,
                expected,
                "contexts: a page is older than the volume expects (an older copy of the file?): its blocks have no valid protection information"
            );
            return;
        }
        if !bound && set && page.iter().all(|byte| *byte == 0) {
            // Not whole units: only a wholly blank page is known lost.
            for (slot, context) in page.chunks_mut(CONTEXT_BYTES).enumerate() {
                let lba = page_no * self.unit_blocks + slot as u64;
                context.copy_from_slice(&vouch_format::encode_lost(self.volume_tag, lba));
            }
            tracing::warn!(
                page = page_no,
                first_lba = page_no * self.unit_blocks,
                "contexts: a page the written map says was written reads as zeros: its blocks have no protection information"
            );
            return;
        }
        let mut lost = 0;
        for (slot, context) in page.chunks_mut(CONTEXT_BYTES).enumerate() {
            let lba = page_no * self.unit_blocks + slot as u64;
            if context.iter().all(|byte| *byte == 0) {
                // Slots past the end of the volume belong to no block:
                // blank in every copy (`bind_slots` leaves them), not lost.
                if set && bound && lba < self.blocks {
                    context.copy_from_slice(&vouch_format::encode_lost(self.volume_tag, lba));
                    lost += 1;
                }
            } else if context[0] == vouch_format::KIND_VACANT
                && vacant_of(context, self.volume_tag, lba)
            {
                context.fill(0);
            } else if context[0] != ContextKind::Zero as u8 {
                // Data, encrypted and lost slots are checked where they
                // are read: nothing to do here (no CRC per slot per page).
            } else if let Ok(Context::Zero {
                volume_tag,
                ref_tag,
                ..
            }) = Context::decode(context)
            {
                // A zero context reads as zeros without its tags being
                // looked at again: one of another place or volume is kept
                // as that place's vacant marker, which fails the read
                // with the tags it names (`FormatError::Vacant`).
                if (volume_tag, ref_tag) != (self.volume_tag, lba) {
                    context.copy_from_slice(&vouch_format::encode_vacant(volume_tag, ref_tag));
                }
            }
        }
        if lost > 0 {
            tracing::warn!(
                page = page_no,
                first_lba = page_no * self.unit_blocks,
                slots = lost,
                "contexts: a page the written map says was written has blank slots: their blocks have no protection information"
            );
        }
    }

    fn bits(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; bits_bytes(self.units) as usize];
        for (index, word) in self.words.iter().enumerate() {
            let at = index * 8;
            let word = word.load(Ordering::Acquire).to_le_bytes();
            let take = (bytes.len() - at).min(8);
            bytes[at..at + take].copy_from_slice(&word[..take]);
        }
        bytes
    }

    /// Read both copies of the map; the valid one with the higher `seq`
    /// wins. The expected generations are those of the copy the superblock
    /// names (`generations_seq`, 0: none is known).
    pub fn load(
        storage: &dyn Storage,
        geometry: &Geometry,
        (uuid, generations_seq): ([u8; 16], u64),
    ) -> Result<Loaded> {
        let map = WrittenMap::with(geometry, uuid, true);
        let mut best: Option<(WrittenHeader, Vec<u8>)> = None;
        let mut why = Vec::new();
        for copy in 0..2 {
            let offset = copy_offset(copy, map.units);
            let mut raw = vec![0u8; copy_bytes(map.units) as usize];
            match storage.read_at(ObjectId::Written, offset, &mut raw) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                    return Ok(Loaded::None("the file is missing".into()))
                }
                Err(error) => return Err(Error::io("read", ObjectId::Written, offset, error)),
            }
            let (header, bits) = raw.split_at(4096);
            let header = match WrittenHeader::decode(header) {
                Ok(header) => header,
                Err(error) => {
                    why.push(format!("copy {copy}: {error}"));
                    continue;
                }
            };
            if header.uuid != uuid
                || header.units != map.units
                || u64::from(header.unit_blocks) != map.unit_blocks
            {
                why.push(format!("copy {copy} is of another volume or geometry"));
                continue;
            }
            if !header.bits_match(bits) {
                why.push(format!("copy {copy}: its bits fail their checksum"));
                continue;
            }
            if best.as_ref().is_none_or(|(old, _)| header.seq > old.seq) {
                best = Some((header, bits.to_vec()));
            }
        }
        let Some((header, bits)) = best else {
            return Ok(Loaded::None(why.join("; ")));
        };
        for (index, word) in map.words.iter().enumerate() {
            let at = index * 8;
            let mut raw = [0u8; 8];
            let take = (bits.len() - at).min(8);
            raw[..take].copy_from_slice(&bits[at..at + take]);
            word.store(u64::from_le_bytes(raw), Ordering::Release);
        }
        map.seq.store(header.seq, Ordering::Release);
        if let Some(why) = map.load_generations(storage, generations_seq)? {
            return Ok(Loaded::NotNamed(why));
        }
        Ok(Loaded::Map(Box::new(map)))
    }

    /// The generations copy of `seq` (the one the superblock names). Not
    /// another copy: a superblock that names none (0) was written by a
    /// binary from before the field, which may have trimmed or rewritten
    /// units without recording it in the values, so they would be stale,
    /// and a stale expectation would read good units as older copies;
    /// every unit's is then not known (0). A copy written after the
    /// superblock (a checkpoint cut before its superblock) may hold values
    /// of units the journal is still to replay: the one named holds values
    /// as of the journal's start, and recovery forgets every unit the
    /// journal touches.
    ///
    /// The copy named is fsynced before any superblock names it, and no
    /// update writes it while it may be named (an update writes the other
    /// copy, and none is written after a superblock write failed:
    /// `persist`), so a crash never leaves it missing, torn, older or
    /// newer. Found so, the file is an older copy of `written` (restored
    /// with the data and contexts of its time, nothing else would tell
    /// them older: issue 28) or the copy is damaged: `Some(what is
    /// wrong)`, and the open refuses (absence is never emptiness: values
    /// not known would read every older unit as current).
    fn load_generations(&self, storage: &dyn Storage, seq: u64) -> Result<Option<String>> {
        if self.generations.is_empty() || seq == 0 {
            return Ok(None);
        }
        let offset = generations_offset(seq % 2, self.units);
        let mut raw = vec![0u8; (WRITTEN_PAGE_BYTES + generations_bytes(self.units)) as usize];
        match storage.read_at(ObjectId::Written, offset, &mut raw) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(Some(format!(
                    "the file ends before the generations copy the superblock names (seq {seq}, at byte {offset})"
                )))
            }
            Err(error) => return Err(Error::io("read", ObjectId::Written, offset, error)),
        }
        let (header, values) = raw.split_at(WRITTEN_PAGE_BYTES as usize);
        let header = match GenerationsHeader::decode(header) {
            Ok(header) => header,
            Err(error) => {
                return Ok(Some(format!(
                    "the generations copy the superblock names (seq {seq}, at byte {offset}) is not valid ({error})"
                )))
            }
        };
        if header.uuid != self.uuid || header.units != self.units {
            return Ok(Some(format!(
                "the generations copy the superblock names (seq {seq}, at byte {offset}) is of another volume or geometry"
            )));
        }
        if header.seq < seq {
            return Ok(Some(format!(
                "the generations copy the superblock names is seq {seq}, the file holds seq {} there: an older copy of the file",
                header.seq
            )));
        }
        if header.seq != seq {
            // No update writes the copy a superblock on disk may name
            // (`persist`), so no crash leaves a higher `seq` there either.
            return Ok(Some(format!(
                "the generations copy the superblock names is seq {seq}, the file holds seq {} there, which no update writes: the file is damaged",
                header.seq
            )));
        }
        // Page by page: a page that fails its CRC (damaged since) leaves
        // its units not known, and the rest hold.
        let mut damaged = 0;
        for (index, page) in values.chunks(WRITTEN_PAGE_BYTES as usize).enumerate() {
            let Some(page) = decode_values_page(&self.uuid, index as u64, page) else {
                damaged += 1;
                continue;
            };
            let first = index * VALUES_PER_PAGE as usize;
            for (value, stored) in self.generations.iter().skip(first).zip(page) {
                value.store(stored, Ordering::Release);
            }
        }
        if damaged > 0 {
            tracing::warn!(
                pages = damaged,
                "written: pages of expected generations fail their checksum: older copies of their units are not detected until the units are written again"
            );
        }
        self.generations_seq.store(seq, Ordering::Release);
        Ok(None)
    }

    /// The `seq` of the generations copy on disk that holds these values
    /// (as far as a checkpoint wrote them; 0: none), for the superblock
    /// to name (`Superblock::generations_seq`).
    pub fn generations_seq(&self) -> u64 {
        self.generations_seq.load(Ordering::Acquire)
    }

    /// Write what changed since the last update, then fsync: the bits to
    /// the older bits copy (`seq + 1`), and the expected generations'
    /// changed pages to the generations copy the superblock on disk does
    /// not name (`named + 1`, `named`: the `generations_seq` of the last
    /// superblock written and fsynced), each only if it changed. Called
    /// under the commit lock, at a checkpoint after what they describe is
    /// durable and before the superblock that retires the journal and
    /// names the generations copy (module comment).
    ///
    /// Never into the copy a superblock on disk may name: after a copy
    /// this process wrote that no superblock was confirmed to name (a
    /// superblock write that failed, whose bytes may still be on disk),
    /// either copy may be the named one, so values are not written at all
    /// (an error: the volume has failed stop already). A copy loaded as
    /// not known (`named` set, nothing written since) goes on from
    /// `named`, into the other slot.
    pub fn persist(&self, io: &Backing, named: u64) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let bits_dirty = self.dirty.swap(false, Ordering::AcqRel);
        let values_dirty =
            !self.generations.is_empty() && self.values_dirty.swap(false, Ordering::AcqRel);
        if !bits_dirty && !values_dirty {
            return Ok(());
        }
        let last = self.generations_seq.load(Ordering::Acquire);
        if values_dirty && last != 0 && last != named {
            if bits_dirty {
                self.dirty.store(true, Ordering::Release);
            }
            self.values_dirty.store(true, Ordering::Release);
            return Err(Error::FailStopped(format!(
                "written: generations copy {last} was written and no superblock was confirmed to name it (the superblock on disk names {named}): no copy is safe to update until the volume is reopened"
            )));
        }
        let seq = self.seq.load(Ordering::Acquire) + 1;
        let generations_seq = named + 1;
        // The generation pages this copy must be given, taken before the
        // values are read (a value moved meanwhile marks its page again).
        let pages = &self.generation_pages[(generations_seq % 2) as usize];
        let taken: Vec<u64> = if values_dirty {
            pages
                .iter()
                .map(|word| word.swap(0, Ordering::AcqRel))
                .collect()
        } else {
            Vec::new()
        };
        let result = (|| {
            if bits_dirty {
                let bits = self.bits();
                let header = WrittenHeader {
                    unit_blocks: self.unit_blocks as u32,
                    uuid: self.uuid,
                    seq,
                    units: self.units,
                    bits_crc: crc32c(&bits),
                };
                // The whole copy, its runs of zero pages punched rather
                // than written (a sparse map stays sparse: a new 16 TiB
                // volume's is 4 MiB of zeros). A torn update fails the
                // copy's CRCs and the other copy (the previous state) wins.
                let base = copy_offset(seq % 2, self.units);
                io.write_object(ObjectId::Written, base, &header.encode())?;
                write_sparse(io, base + WRITTEN_PAGE_BYTES, &bits)?;
            }
            if values_dirty {
                // Torn, this copy is not the one the superblock names (it
                // is named only after this fsync), so it is never loaded.
                let generations = GenerationsHeader {
                    uuid: self.uuid,
                    seq: generations_seq,
                    units: self.units,
                };
                let base = generations_offset(generations_seq % 2, self.units);
                io.write_object(ObjectId::Written, base, &generations.encode())?;
                // Only the pages changed since this copy was last written:
                // the others hold these values already.
                write_pages(io, base + WRITTEN_PAGE_BYTES, &taken, |index| {
                    self.values_page(index)
                })?;
            }
            io.sync_object(ObjectId::Written)?;
            if bits_dirty {
                self.seq.store(seq, Ordering::Release);
            }
            if values_dirty {
                self.generations_seq
                    .store(generations_seq, Ordering::Release);
            }
            Ok(())
        })();
        if result.is_err() {
            if bits_dirty {
                self.dirty.store(true, Ordering::Release);
            }
            if values_dirty {
                self.values_dirty.store(true, Ordering::Release);
                // The pages are written again at the next update.
                for (word, bits) in pages.iter().zip(&taken) {
                    word.fetch_or(*bits, Ordering::AcqRel);
                }
            }
        }
        result
    }

    /// `persist` of the bits alone, the values left for the next
    /// checkpoint: for a write of the map that no superblock follows (a
    /// writable open's, before recovery). A generations copy written there
    /// would be named by no superblock, and the next update, one `seq`
    /// on, would write into the copy the superblock still names, where a
    /// crash could leave its pages torn under that copy's header. Values
    /// not on disk yet only weaken detection (they are not known).
    pub fn persist_bits(&self, io: &Backing) -> Result<()> {
        let values_dirty = self.values_dirty.swap(false, Ordering::AcqRel);
        let result = self.persist(io, self.generations_seq());
        if values_dirty {
            self.values_dirty.store(true, Ordering::Release);
        }
        result
    }

    /// Values page `index` as it goes to disk (`encode_values_page`).
    fn values_page(&self, index: u64) -> Vec<u8> {
        let first = (index * VALUES_PER_PAGE) as usize;
        let values: Vec<u32> = self
            .generations
            .iter()
            .skip(first)
            .take(VALUES_PER_PAGE as usize)
            .map(|value| value.load(Ordering::Acquire))
            .collect();
        encode_values_page(&self.uuid, index, &values)
    }
}

/// A bit per packed row of the map, in memory (none for split).
fn row_bits(enabled: bool, geometry: &Geometry, units: u64) -> Vec<AtomicU64> {
    let words = if enabled && geometry.layout == LayoutKind::Packed {
        units.div_ceil(64)
    } else {
        0
    };
    (0..words).map(|_| AtomicU64::new(0)).collect()
}

/// `WrittenMap::page_writes_guard`: ends the writes on its stripes when
/// dropped, on every path out of the writer.
pub(crate) struct PageWritesGuard<'a>(&'a WrittenMap, u64);

impl Drop for PageWritesGuard<'_> {
    fn drop(&mut self) {
        self.0.bump_stripes(self.1);
    }
}

/// Stripes of the writers' seqlock (`WrittenMap::page_writes`): one bit
/// each in a guard's mask. Consecutive units fall on different stripes,
/// so a read of up to 64 rows sees its own.
const WRITE_STRIPES: usize = 64;

fn stripe_of(unit: u64) -> usize {
    (unit % WRITE_STRIPES as u64) as usize
}

/// A reader's snapshot of the stripes of the units it reads
/// (`WrittenMap::page_writes`); stripes it did not take read as odd.
pub(crate) struct Seen([u64; WRITE_STRIPES]);

/// Serial-number order of 32-bit generations (RFC 1982): whether `a` is
/// newer than `b`, across the wrap of the journal's sequence's low bits.
/// How a unit's slots stand against its expected generation
/// (`WrittenMap::judge_slots`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotVerdict {
    /// An own slot is at least as new as expected: current.
    Reaches,
    /// No slot holds anything (blank slots only): left to the tags.
    NoOwn,
    /// A slot is damaged, or another place's or volume's: nothing can be
    /// said of the unit.
    Unsure,
    /// Every own slot is older; the newest of them.
    Older(u32),
}

/// Whether a non-zero context is whole: a plain context's or a marker's
/// CRC holds; an encrypted one's keyless guard holds over `data` when it
/// is given (else it is taken as it lies); no other kind is.
fn context_intact(context: &[u8], data: Option<&[u8]>) -> bool {
    let stored = u32::from_le_bytes(context[28..32].try_into().expect("4 bytes"));
    match context[0] {
        1 | 2 | vouch_format::KIND_VACANT | vouch_format::KIND_LOST => {
            vouch_format::crc32c(&context[..28]) == stored
        }
        3 => data.is_none_or(|data| {
            let generation = u32::from_le_bytes(context[1..5].try_into().expect("4 bytes"));
            let nonce = context[5..12].try_into().expect("7 bytes");
            let tag = context[12..28].try_into().expect("16 bytes");
            vouch_format::context::encrypted_guard(generation, nonce, tag, data) == stored
        }),
        _ => false,
    }
}

pub(crate) fn newer(a: u32, b: u32) -> bool {
    a != b && (a.wrapping_sub(b) as i32) > 0
}

/// Write the 4 KiB pages whose bit is set in `pages` at `offset` of
/// `written`, page `i` as `encode(i)` gives it (zero pages punched), each
/// run of them in one call.
fn write_pages(
    io: &Backing,
    offset: u64,
    pages: &[u64],
    encode: impl Fn(u64) -> Vec<u8>,
) -> Result<()> {
    let page = WRITTEN_PAGE_BYTES as usize;
    let count = pages.len() * 64;
    let chosen = |index: usize| pages[index / 64] & (1 << (index % 64)) != 0;
    let mut index = 0;
    while index < count {
        if !chosen(index) {
            index += 1;
            continue;
        }
        let mut end = index + 1;
        while end < count && chosen(end) {
            end += 1;
        }
        let mut bytes = Vec::with_capacity((end - index) * page);
        for at in index..end {
            bytes.extend_from_slice(&encode(at as u64));
        }
        write_sparse(io, offset + (index * page) as u64, &bytes)?;
        index = end;
    }
    Ok(())
}

/// Write `bytes` at `offset` of `written`, its runs of zero pages punched
/// rather than written (a sparse map stays sparse: a new 16 TiB volume's
/// bits are 4 MiB of zeros).
fn write_sparse(io: &Backing, offset: u64, bytes: &[u8]) -> Result<()> {
    let page = WRITTEN_PAGE_BYTES as usize;
    let mut at = 0;
    while at < bytes.len() {
        let zero = bytes[at..at + page].iter().all(|byte| *byte == 0);
        let mut end = at + page;
        while end < bytes.len() && bytes[end..end + page].iter().all(|byte| *byte == 0) == zero {
            end += page;
        }
        let place = offset + at as u64;
        if zero {
            io.punch(ObjectId::Written, place, (end - at) as u64)?;
        } else {
            io.write_object(ObjectId::Written, place, &bytes[at..end])?;
        }
        at = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use vouch_format::LayoutKind;

    use super::*;
    use crate::storage::sim::SimStorage;

    /// A reader of unit 1 concludes while a writer holds units on other
    /// stripes, not while one holds a unit of its stripe (unit 1 itself,
    /// or unit 65), nor while a checkpoint writes pages (every stripe).
    /// With one counter for the volume, any writer left every reader
    /// unsettled.
    #[test]
    fn a_writer_leaves_only_its_own_stripes_unsettled() {
        let geometry =
            Geometry::new(LayoutKind::Packed, 200 * 31 * 4096, 31 * 64).expect("geometry");
        let map = WrittenMap::empty(&geometry, [7; 16]);
        let read = |writer: &dyn Fn()| {
            let seen = map.page_writes(1..=1);
            writer();
            map.settled(&seen, 1)
        };
        assert!(read(&|| {}));
        assert!(read(&|| drop(
            map.page_writes_guard([2, 3, 64, 130].into_iter())
        )));
        let elsewhere = map.page_writes_guard(2..=40);
        assert!(read(&|| {}), "a writer of rows 2-40 runs");
        drop(elsewhere);
        assert!(!read(&|| drop(map.page_writes_guard(std::iter::once(1)))));
        assert!(!read(&|| drop(map.page_writes_guard(std::iter::once(65)))));
        let same = map.page_writes_guard(std::iter::once(65));
        assert!(!read(&|| {}), "a writer of row 65 runs");
        drop(same);
        assert!(!read(&|| {
            map.begin_page_writes();
            map.end_page_writes();
        }));
        // A snapshot of units 0-2 does not settle unit 3.
        assert!(!map.settled(&map.page_writes(0..=2), 3));
    }

    /// A split volume of `bytes` on simulated storage with an empty map
    /// of uuid `[9; 16]`.
    fn split_map_on_sim(bytes: u64) -> (Geometry, SimStorage, Backing) {
        let geometry = Geometry::new(LayoutKind::Split, bytes, 1 << 28).expect("geometry");
        let storage = SimStorage::new();
        let io = Backing::new(
            Arc::new(storage.clone()),
            geometry,
            None,
            WrittenMap::empty(&geometry, [9; 16]),
        );
        (geometry, storage, io)
    }

    fn loaded(storage: &SimStorage, geometry: &Geometry, generations_seq: u64) -> WrittenMap {
        match WrittenMap::load(storage, geometry, ([9; 16], generations_seq)).expect("load") {
            Loaded::Map(map) => *map,
            Loaded::None(why) | Loaded::NotNamed(why) => panic!("no valid copy: {why}"),
        }
    }

    /// A map written with no superblock after it (a writable open's,
    /// before recovery) holds its bits but writes no generations copy:
    /// nothing would name it, and the next update would then write into
    /// the copy the superblock names. Its values go with the next update.
    #[test]
    fn a_map_written_at_open_writes_no_generations_copy() {
        let (geometry, storage, io) = split_map_on_sim(64 << 20);
        io.written.set(1);
        io.written.set_expected_generation(1, 7);
        io.written.persist_bits(&io).expect("persist the bits");
        assert_eq!(io.written.generations_seq(), 0, "no copy written");
        assert!(loaded(&storage, &geometry, 0).is_set(1));
        io.written
            .persist(&io, io.written.generations_seq())
            .expect("persist");
        assert_eq!(io.written.generations_seq(), 1);
        assert_eq!(loaded(&storage, &geometry, 1).expected_generation(1), 7);
    }

    /// An update writes only the generation pages changed since the copy
    /// it writes was last written (both copies whole at the first update
    /// after an open), each with its own CRC, and no bits copy when no bit
    /// changed; every value still loads right from the copy named, a page
    /// damaged since leaves only its own units not known.
    #[test]
    fn only_changed_generation_pages_are_written() {
        // 8 GiB split: 16,384 pages, 17 pages of values per copy.
        let (geometry, storage, io) = split_map_on_sim(8 << 30);
        let written = || io.stats.superblock_bytes_written.load(Ordering::Relaxed);
        let units = io.written.units;
        let copy = WRITTEN_PAGE_BYTES + bits_bytes(units);
        let header = WRITTEN_PAGE_BYTES;
        io.written.set(1);
        for unit in [1, 5000] {
            io.written.set_expected_generation(unit, 7);
        }
        let before = written();
        io.written
            .persist(&io, io.written.generations_seq())
            .expect("persist 1");
        // The bits copy, and generations copy 1 whole (pages 0 and 4 hold
        // values; the others are holes).
        assert_eq!(written() - before, copy + header + 2 * WRITTEN_PAGE_BYTES);
        io.written.set_expected_generation(1, 8);
        io.written
            .persist(&io, io.written.generations_seq())
            .expect("persist 2");
        // Copy 1 (seq 3) was last written at seq 1: unit 1's page 0
        // changed since, and unit 5000's page 4 now. No bit changed.
        let before = written();
        io.written.set_expected_generation(5000, 9);
        io.written
            .persist(&io, io.written.generations_seq())
            .expect("persist 3");
        assert_eq!(written() - before, header + 2 * WRITTEN_PAGE_BYTES);
        // Copy 0 (seq 4) was last written at seq 2: page 4 only.
        let before = written();
        io.written.set_expected_generation(5000, 10);
        io.written
            .persist(&io, io.written.generations_seq())
            .expect("persist 4");
        assert_eq!(written() - before, header + WRITTEN_PAGE_BYTES);
        assert_eq!(io.written.generations_seq(), 4);
        let back = loaded(&storage, &geometry, 4);
        assert_eq!(back.seq.load(Ordering::Acquire), 1, "bits written once");
        assert!(back.is_set(1));
        assert_eq!(
            (back.expected_generation(1), back.expected_generation(5000)),
            (8, 10)
        );
        // The copy before (seq 3) holds the values of seq 3.
        let back = loaded(&storage, &geometry, 3);
        assert_eq!(
            (back.expected_generation(1), back.expected_generation(5000)),
            (8, 9)
        );
        // A page of copy 0 damaged: its units are not known, the others hold.
        let values = generations_offset(0, units) + WRITTEN_PAGE_BYTES;
        storage.corrupt(
            ObjectId::Written,
            values + 4 * WRITTEN_PAGE_BYTES + 12,
            0x01,
        );
        let back = loaded(&storage, &geometry, 4);
        assert_eq!(
            (back.expected_generation(1), back.expected_generation(5000)),
            (8, 0)
        );
        // A superblock that names no copy (a binary from before the field
        // wrote it): no value is known.
        let back = loaded(&storage, &geometry, 0);
        assert_eq!(
            (back.expected_generation(1), back.expected_generation(5000)),
            (0, 0)
        );
        // One whose slot holds a lower `seq` (an older `written` restored,
        // issue 28), or a higher one (no update writes the copy named, so
        // only damage leaves one), is refused, never "not known".
        for (named, why) in [(5, "an older copy"), (2, "damaged")] {
            match WrittenMap::load(&storage, &geometry, ([9; 16], named)).expect("load") {
                Loaded::NotNamed(found) => assert!(found.contains(why), "{named}: {found}"),
                _ => {
                    panic!("{named}: a generations copy of another seq must not load as not known")
                }
            }
        }
    }

    /// A checkpoint whose superblock write fails after its map update
    /// leaves a generations copy no superblock names, and the bytes of
    /// that superblock may be on disk or not: either copy may be the one
    /// named after a crash. The next update (a reflink copy's checkpoint
    /// can run after the failure) writes neither, so the copy the
    /// superblock on disk names keeps its `seq` and values; before, it
    /// wrote `seq + 2` into the named copy, which then loaded as not
    /// known (or refused the open when a crash tore its header).
    #[test]
    fn no_update_writes_a_copy_a_superblock_may_name() {
        let (geometry, storage, io) = split_map_on_sim(64 << 20);
        io.written.set(1);
        io.written.set_expected_generation(1, 7);
        io.written.persist(&io, 0).expect("persist 1");
        // The superblock names copy 1 (seq 1).
        assert_eq!(io.written.generations_seq(), 1);
        io.written.set_expected_generation(1, 8);
        io.written.persist(&io, 1).expect("persist 2");
        // Its superblock write failed: the disk still names seq 1, and
        // may name seq 2.
        assert_eq!(io.written.generations_seq(), 2);
        io.written.set_expected_generation(1, 9);
        assert!(
            io.written.persist(&io, 1).is_err(),
            "no copy is safe to write"
        );
        assert_eq!(loaded(&storage, &geometry, 1).expected_generation(1), 7);
        assert_eq!(loaded(&storage, &geometry, 2).expected_generation(1), 8);
        // A copy loaded as not known (an upgrade's rebuild) goes on from
        // the copy named, into the other slot.
        let fresh = WrittenMap::empty(&geometry, [9; 16]);
        let io = Backing::new(Arc::new(storage.clone()), geometry, None, fresh);
        io.written.set(1);
        io.written.set_expected_generation(1, 10);
        io.written.persist(&io, 1).expect("persist from not known");
        assert_eq!(io.written.generations_seq(), 2);
        assert_eq!(loaded(&storage, &geometry, 1).expected_generation(1), 7);
        assert_eq!(loaded(&storage, &geometry, 2).expected_generation(1), 10);
    }

    /// The last packed row of a 256-block volume holds LBAs 248-255; its
    /// 23 slots past the end are blank in every copy and belong to no LBA.
    /// Judged from the row read whole (a read) or from the slots of its
    /// LBAs (a `check` whose chunk holds them), it is the same row: an
    /// older one is older both ways, never `Unsure` for the blank slots
    /// past the end in a whole unit.
    #[test]
    fn a_row_past_the_volume_end_is_judged_by_its_lbas_alone() {
        let geometry = Geometry::new(LayoutKind::Packed, 256 * 4096, 31 * 64).expect("geometry");
        let map = WrittenMap::empty(&geometry, [9; 16]);
        map.set_bound();
        let tag = map.volume_tag;
        let first = 8 * 31;
        let mut slots = vec![[0u8; CONTEXT_BYTES]; 31];
        for (slot, lba) in slots.iter_mut().zip(first..256) {
            *slot = vouch_format::Context::Data {
                volume_tag: tag,
                ref_tag: lba,
                guard: 1,
                generation: 5,
            }
            .encode();
        }
        let judge = |slots: &[[u8; CONTEXT_BYTES]]| {
            map.judge_slots(first, slots.iter().map(|slot| (&slot[..], None)), 6)
        };
        assert_eq!(judge(&slots), SlotVerdict::Older(5), "the row read whole");
        assert_eq!(judge(&slots[..8]), SlotVerdict::Older(5), "its LBAs' slots");
        // A blank context over its data, in one of its LBAs' slots, is
        // damage in a whole unit; blank in data too, it may be a
        // never-written block of a copy from before the units were whole,
        // and the row is judged by the rest.
        slots[3] = [0; CONTEXT_BYTES];
        let (data, blank) = ([0x5a_u8; 4096], [0u8; 4096]);
        let judge_with = |slots: &[[u8; CONTEXT_BYTES]], data: &[u8]| {
            map.judge_slots(first, slots.iter().map(|slot| (&slot[..], Some(data))), 6)
        };
        assert_eq!(judge_with(&slots, &data), SlotVerdict::Unsure);
        assert_eq!(judge_with(&slots, &blank), SlotVerdict::Older(5));
        assert_eq!(judge(&slots), SlotVerdict::Older(5), "without data");
    }

    /// A unit a trim left vacant (its bit clear, every slot a vacant
    /// marker) is trimmed space: its markers are "nothing here", not
    /// generation 0 against the trim's value, so it is `NoOwn` (read as
    /// zeros), while a record older than the value is still older. A set
    /// unit of markers is older than any value (its newest slot lost).
    /// A split volume whose size is not a whole number of context pages
    /// (a 1000 KiB import: 250 blocks) has slots past its end in its last
    /// page, blank in every copy: they are no written block's blank slots
    /// (`check` warned "a page the written map says was written has blank
    /// slots ... slots=6", with 0 faults), while a blank slot of an LBA
    /// inside the volume still is lost.
    #[test]
    fn slots_past_the_volume_end_are_not_lost() {
        let (geometry, _storage, io) = split_map_on_sim(1000 << 10);
        assert_eq!(geometry.blocks, 250);
        let map = &io.written;
        map.set_bound();
        map.set(1);
        let mut page = [0u8; 4096];
        for (slot, lba) in (128..250).enumerate() {
            let context = vouch_format::Context::Data {
                volume_tag: map.volume_tag,
                ref_tag: lba,
                guard: 1,
                generation: 5,
            }
            .encode();
            page[slot * CONTEXT_BYTES..(slot + 1) * CONTEXT_BYTES].copy_from_slice(&context);
        }
        page[5 * CONTEXT_BYTES..6 * CONTEXT_BYTES].fill(0);
        map.judge_page(1, &mut page, &map.page_writes(1..=1), |_| {});
        let slot = |index: usize| &page[index * CONTEXT_BYTES..(index + 1) * CONTEXT_BYTES];
        assert_eq!(slot(5), &map.lost(133)[..], "LBA 133's blank slot is lost");
        for (index, lba) in (122..128).zip(250..) {
            assert!(
                slot(index).iter().all(|byte| *byte == 0),
                "slot of LBA {lba}, past the end, is left blank"
            );
        }
    }

    #[test]
    fn a_clear_unit_of_markers_holds_nothing() {
        let geometry = Geometry::new(LayoutKind::Split, 64 << 20, 1 << 28).expect("geometry");
        let map = WrittenMap::empty(&geometry, [9; 16]);
        let markers: Vec<[u8; CONTEXT_BYTES]> = (0..3).map(|lba| map.vacant(lba)).collect();
        let judge = |slots: &[[u8; CONTEXT_BYTES]]| {
            map.judge_slots(0, slots.iter().map(|slot| (&slot[..], None)), 7)
        };
        assert_eq!(judge(&markers), SlotVerdict::NoOwn);
        let mut older = markers.clone();
        older[1] = vouch_format::Context::Data {
            volume_tag: map.volume_tag,
            ref_tag: 1,
            guard: 1,
            generation: 5,
        }
        .encode();
        assert_eq!(judge(&older), SlotVerdict::Older(5));
        map.set(0);
        assert_eq!(judge(&markers), SlotVerdict::Older(0));
    }

    /// A unit is judged slot by slot: it reaches its expectation through
    /// any own slot that does, whatever order serial-number comparison
    /// gives the others (not transitive across half the space); a slot
    /// whose context is damaged (its CRC, or an encrypted one's keyless
    /// guard over its data) makes it `Unsure`, never `Older`; only whole
    /// slots all older make it `Older`.
    #[test]
    fn a_unit_is_judged_by_whole_slots_one_by_one() {
        let geometry = Geometry::new(LayoutKind::Split, 64 << 20, 1 << 28).expect("geometry");
        let map = WrittenMap::empty(&geometry, [9; 16]);
        let tag = map.volume_tag;
        let plain = |lba: u64, generation: u32| {
            vouch_format::Context::Data {
                volume_tag: tag,
                ref_tag: lba,
                guard: 1,
                generation,
            }
            .encode()
        };
        let judge = |slots: &[[u8; CONTEXT_BYTES]], expected: u32| {
            map.judge_slots(0, slots.iter().map(|slot| (&slot[..], None)), expected)
        };
        // Generations a third of the space apart: a fold in LBA order
        // lands on 0x6000_0000; the newest, 0xC000_0000, is there.
        let spread = [plain(0, 0xC000_0000), plain(1, 0x10), plain(2, 0x6000_0000)];
        assert_eq!(judge(&spread, 0xC000_0000), SlotVerdict::Reaches);
        let older = [plain(0, 5), plain(1, 6), plain(2, 4)];
        assert_eq!(judge(&older, 7), SlotVerdict::Older(6));
        assert_eq!(judge(&older, 6), SlotVerdict::Reaches);
        // The newest slot's generation flipped lower: its CRC fails.
        let mut flipped = [plain(0, 5), plain(1, 7), plain(2, 4)];
        flipped[1][24] ^= 0x04;
        assert_eq!(judge(&flipped, 7), SlotVerdict::Unsure);
        // Another volume's slots are not its own.
        let foreign = [vouch_format::Context::Data {
            volume_tag: tag ^ 1,
            ref_tag: 0,
            guard: 1,
            generation: 3,
        }
        .encode()];
        assert_eq!(judge(&foreign, 7), SlotVerdict::Unsure);
        // The newest slot overwritten by another place's: what is left is
        // older, but the unit is not judged older by it (the damaged slot
        // is its own block's fault). Zeroed, with no data to tell it from
        // a never-written block (a split page; a copy from before the
        // units were whole has blank slots for those), it is judged by
        // what is left, in a whole unit too.
        let mut zeroed = [plain(0, 5), plain(1, 9), plain(2, 4)];
        zeroed[1] = [0; CONTEXT_BYTES];
        assert_eq!(judge(&zeroed, 9), SlotVerdict::Older(5));
        let misplaced = [plain(0, 5), plain(7, 9), plain(2, 4)];
        assert_eq!(judge(&misplaced, 9), SlotVerdict::Unsure);
        map.set_bound();
        assert_eq!(judge(&zeroed, 9), SlotVerdict::Older(5));
        assert_eq!(judge(&older, 7), SlotVerdict::Older(6));
        // Encrypted: checked by the keyless guard over its data.
        let data = [0x5a_u8; 4096];
        let encrypted = |generation: u32| {
            let (nonce, aead) = ([1u8; 7], [2u8; 16]);
            vouch_format::Context::Encrypted {
                generation,
                nonce,
                tag: aead,
                guard: vouch_format::context::encrypted_guard(generation, &nonce, &aead, &data),
            }
            .encode()
        };
        let judge_records = |slots: &[[u8; CONTEXT_BYTES]], expected: u32| {
            map.judge_slots(
                0,
                slots.iter().map(|slot| (&slot[..], Some(&data[..]))),
                expected,
            )
        };
        let whole = [encrypted(5), encrypted(7)];
        assert_eq!(judge_records(&whole, 7), SlotVerdict::Reaches);
        assert_eq!(judge_records(&whole, 8), SlotVerdict::Older(7));
        let mut flipped = whole;
        flipped[1][1] ^= 0x01; // generation 7 -> 6
        assert_eq!(judge_records(&flipped, 7), SlotVerdict::Unsure);
    }

    /// Bits round-trip through the file; a torn (corrupt) newest copy
    /// leaves the previous one; a map of another volume is not used.
    #[test]
    fn copies_alternate_and_a_damaged_one_leaves_the_other() {
        let (geometry, storage, io) = split_map_on_sim(64 << 20);
        assert_eq!(io.written.next_set_lba(0), None);
        io.written.set(3);
        io.written.set(70);
        io.written
            .persist(&io, io.written.generations_seq())
            .expect("persist 1");
        let first = loaded(&storage, &geometry, 0);
        assert!(first.is_set(3) && first.is_set(70) && !first.is_set(4));
        assert_eq!(first.next_set_lba(0), Some(3 * 128));
        assert_eq!(first.next_set_lba(3 * 128 + 5), Some(3 * 128 + 5));
        assert_eq!(first.next_set_lba(4 * 128), Some(70 * 128));
        assert!(!first.any_set(71 * 128, 16384));
        // Unchanged bits are not written again.
        io.written
            .persist(&io, io.written.generations_seq())
            .expect("persist, nothing changed");
        assert_eq!(
            loaded(&storage, &geometry, 0).seq.load(Ordering::Acquire),
            1
        );
        io.written.clear(3);
        io.written
            .persist(&io, io.written.generations_seq())
            .expect("persist 2");
        let second = loaded(&storage, &geometry, 0);
        assert!(!second.is_set(3) && second.is_set(70));
        // Damage the newest copy (seq 2, copy 0): the previous one wins.
        storage.corrupt(
            ObjectId::Written,
            copy_offset(0, second.units) + 4096 + 8,
            0x01,
        );
        let back = loaded(&storage, &geometry, 0);
        assert!(back.is_set(3) && back.is_set(70));
        match WrittenMap::load(&storage, &geometry, ([8; 16], 0)).expect("load") {
            Loaded::Map(_) => panic!("a map of another volume must not be used"),
            Loaded::None(why) | Loaded::NotNamed(why) => {
                assert!(why.contains("another volume"), "{why}")
            }
        }
    }
}
