//! `vouch resize PATH SIZE`: a stopped volume made larger, or smaller when
//! its tail holds nothing (docs/FORMAT.md, "Resize"; docs/CRASH_MODEL.md,
//! "Resize").
//!
//! What a size is made of: the superblock's `size_bytes`, the files'
//! nominal lengths (`contexts`, each data segment, new segments), and the
//! written map, whose file layout follows its unit count (`written`: the
//! offsets of both copies and of the generations copies move with it).
//!
//! Crash ordering. The superblock's size is the switch; everything the new
//! size needs is durable before it:
//! 1. grow: every file to the new size's nominal length (cut first to the
//!    old one, so the new tail is zeros, sparse, whatever a cut-short run
//!    left there), the vacant markers of the slots the unit that straddled
//!    the old end gains (a unit whose bit is set is whole: a blank slot in
//!    it would read as lost metadata), each file fsynced, then the
//!    directory;
//! 2. the map of the new size in `written.resize` (the bits and the
//!    expected generations as they are, each copy with the `seq` the
//!    superblock and the map already have), fsynced, and the directory;
//! 3. the superblock with the new size, one copy then the other, each
//!    fsynced (the first fsync is the switch);
//! 4. `written.resize` renamed over `written`, the directory fsynced;
//! 5. shrink: the files cut to the new lengths, segments past the end
//!    removed (after the switch: until then the old size needs them).
//!
//! A crash between 2 and 4 leaves `written.resize`: the next open
//! (`finish`) keeps it when it is the map of the size the superblock
//! says (the switch happened), and removes it otherwise. Steps 1 and 5
//! leave files longer than the size needs, which nothing reads (a later
//! grow cuts them back first).
//!
//! A shrink is refused unless every block of the tail is unwritten: the
//! caller asks the opened volume (`first_written`), whose block status
//! counts lost metadata (a unit the map says written that reads blank,
//! a lost marker) as written: absence is never emptiness.
//!
//! The file operations go through `SnapshotFs`, so `vouch-sim resize`
//! crashes this very code at each of them.

use std::path::{Path, PathBuf};

use vouch_format::superblock::{STATE_CLEAN, SUPERBLOCK_SLOT_BYTES};
use vouch_format::written::{
    bits_bytes, copy_bytes, copy_offset, decode_values_page, encode_values_page, generations_bytes,
    generations_offset, unit_blocks, GenerationsHeader, WrittenHeader, WRITTEN_PAGE_BYTES,
};
use vouch_format::{crc32c, FeatureFlags, Geometry, LayoutKind, Superblock};

use crate::device::BlockDevice;
use crate::error::{Error, Result};
use crate::layout::Allocation;
use crate::snapshot::{io_error, is_snapshot, superblock_of, SnapshotFs};
use crate::storage::ObjectId;

/// The map of the new size, until the superblock switch is followed by
/// its rename over `written` (defined with the volume's file names, so
/// the snapshot code can see a resize cut short without importing this).
pub use crate::storage::RESIZE_MAP_FILE;

/// Orderings `resize` can be told to break, to show the crash simulator
/// catches them. Production passes the default (none).
#[derive(Clone, Copy, Debug, Default)]
pub struct ResizeBreaks {
    /// Write the new size into the superblock before the files and the
    /// map of the new size are made (and synced after it).
    pub switch_first: bool,
    /// A volume with regions: stop (an error) once the other member is
    /// resized, before the record and the home (what a crash there
    /// leaves, for tests of the next open's finish).
    pub stop_after_member: bool,
    /// A volume with regions whose count changes: stop once the record of
    /// the new count is durable in `regions.resize`, before the home.
    pub stop_after_record: bool,
    /// A volume with regions whose count changes: stop once the home has
    /// its new size, before `regions.resize` is renamed over `regions`.
    pub stop_after_home: bool,
    /// An online resize of a volume with regions
    /// (`RegionVolume::resize_online_driven`): the files resized with the
    /// other member's engine left open, not closed first (the simulator's
    /// self-test of the online order: it must be caught).
    pub other_left_open: bool,
}

/// What a resize did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resized {
    pub old_bytes: u64,
    pub new_bytes: u64,
}

fn invalid(message: String) -> Error {
    Error::InvalidArgument(message)
}

/// The first LBA of `[first, end)` that holds anything (data, written
/// zeroes, or metadata that is lost), or `None` when every block there is
/// unwritten. Holes on disk with no unit set in the written map are
/// skipped without reading them.
pub fn first_written(device: &dyn BlockDevice, first: u64, end: u64) -> Result<Option<u64>> {
    first_written_by(
        &|lba| device.next_possible_data(lba),
        &|lba, count| device.block_status(lba * crate::BLOCK, count * crate::BLOCK, count),
        first,
        end,
    )
}

/// `first_written` over an engine's own calls (an online shrink asks the
/// engine it holds, not the `Volume` it is resizing).
pub(crate) fn first_written_by(
    next_possible_data: &dyn Fn(u64) -> Result<u64>,
    block_status: &dyn Fn(u64, u64) -> Result<Vec<(u64, Allocation)>>,
    first: u64,
    end: u64,
) -> Result<Option<u64>> {
    const CHUNK: u64 = 4096;
    let mut lba = first;
    while lba < end {
        lba = next_possible_data(lba)?.max(lba);
        if lba >= end {
            break;
        }
        let count = (end - lba).min(CHUNK);
        let runs = block_status(lba, count)?;
        let mut at = lba;
        for (blocks, kind) in runs {
            if kind != Allocation::Hole {
                return Ok(Some(at));
            }
            at += blocks;
        }
        lba = at.max(lba + 1);
    }
    Ok(None)
}

/// Finish or undo what a resize cut short left (`written.resize`): kept
/// as `written` when it is the map of the size the superblock says, else
/// removed. Returns what it did, if anything. Needs the volume's lock.
pub fn finish(fs: &dyn SnapshotFs, volume: &Path) -> Result<Option<String>> {
    let pending = volume.join(RESIZE_MAP_FILE);
    if !fs.exists(&pending) {
        return Ok(None);
    }
    let superblock = superblock_of(fs, volume)?;
    let geometry = geometry_of(&superblock)?;
    let bytes = fs
        .read(&pending)
        .map_err(|e| io_error("read", &pending, e))?;
    let done = if map_fits(&bytes, &superblock, &geometry) {
        let written = volume.join(ObjectId::Written.file_name());
        fs.rename(&pending, &written)
            .map_err(|e| io_error("rename", &pending, e))?;
        format!(
            "finished an interrupted resize to {} bytes",
            superblock.size_bytes
        )
    } else {
        fs.remove_file(&pending)
            .map_err(|e| io_error("remove", &pending, e))?;
        format!(
            "undid an interrupted resize (the volume keeps its {} bytes)",
            superblock.size_bytes
        )
    };
    fs.sync_dir(volume)
        .map_err(|e| io_error("sync", volume, e))?;
    Ok(Some(done))
}

fn geometry_of(superblock: &Superblock) -> Result<Geometry> {
    superblock
        .geometry()
        .map_err(|error| Error::Corrupt(format!("corrupt superblock: {error}")))
}

fn units_of(geometry: &Geometry) -> u64 {
    geometry
        .blocks
        .div_ceil(u64::from(unit_blocks(geometry.layout)))
}

/// The valid bits copy of a map file for `superblock`'s volume with
/// `units` units: its header and bits (the higher `seq` of the valid ones).
fn valid_copy(bytes: &[u8], uuid: [u8; 16], units: u64) -> Option<(WrittenHeader, Vec<u8>)> {
    let mut best: Option<(WrittenHeader, Vec<u8>)> = None;
    for copy in 0..2 {
        let at = copy_offset(copy, units) as usize;
        let len = copy_bytes(units) as usize;
        let mut raw = bytes.get(at..).unwrap_or_default().to_vec();
        raw.resize(len, 0);
        raw.truncate(len);
        let (header, bits) = raw.split_at(WRITTEN_PAGE_BYTES as usize);
        let Ok(header) = WrittenHeader::decode(header) else {
            continue;
        };
        if header.uuid != uuid || header.units != units || !header.bits_match(bits) {
            continue;
        }
        if best.as_ref().is_none_or(|(old, _)| header.seq > old.seq) {
            best = Some((header, bits.to_vec()));
        }
    }
    best
}

/// Whether `bytes` (a `written.resize`) is the map of `geometry`.
/// Both its bits copy and the generations copy the superblock names
/// must be there: a map kept without the latter would be refused at
/// open as an older copy of `written`, so one cut before its generations
/// copy was written is removed (the switch had not happened).
fn map_fits(bytes: &[u8], superblock: &Superblock, geometry: &Geometry) -> bool {
    let units = units_of(geometry);
    valid_copy(bytes, superblock.uuid, units)
        .is_some_and(|(header, _)| u64::from(header.unit_blocks) == units_blocks(geometry))
        && generations_fit(bytes, superblock, units)
}

/// Whether `bytes` holds the generations copy `superblock` names (its
/// header: this volume, these units, that `seq`: another is refused at
/// open, `WrittenMap::load`).
fn generations_fit(bytes: &[u8], superblock: &Superblock, units: u64) -> bool {
    let seq = superblock.generations_seq;
    if seq == 0 {
        return true;
    }
    let at = generations_offset(seq % 2, units) as usize;
    bytes
        .get(at..at + WRITTEN_PAGE_BYTES as usize)
        .and_then(|page| GenerationsHeader::decode(page).ok())
        .is_some_and(|header| {
            header.uuid == superblock.uuid && header.units == units && header.seq == seq
        })
}

fn units_blocks(geometry: &Geometry) -> u64 {
    u64::from(unit_blocks(geometry.layout))
}

/// The pages of the map of `new` (runs of bytes at their offsets, zero
/// pages left out: the file is made sparse at its length), from the map
/// file `old_bytes` of the volume at `old`: the same bits and expected
/// generations for the units both sizes have, nothing for the others.
fn resized_map(
    old_bytes: &[u8],
    superblock: &Superblock,
    old: &Geometry,
    new: &Geometry,
) -> Result<(u64, Vec<Page>)> {
    let uuid = superblock.uuid;
    let (old_units, new_units) = (units_of(old), units_of(new));
    let Some((header, bits)) = valid_copy(old_bytes, uuid, old_units) else {
        return Err(invalid(
            "the written map has no valid copy: open the volume once (`vouch check`), or rebuild it with `vouch upgrade PATH`, then resize".into(),
        ));
    };
    let mut new_bits = vec![0u8; bits_bytes(new_units) as usize];
    let keep = new_units.min(old_units);
    for unit in 0..keep {
        let (byte, bit) = ((unit / 8) as usize, unit % 8);
        if bits[byte] & (1 << bit) != 0 {
            new_bits[byte] |= 1 << bit;
        }
    }
    let new_header = WrittenHeader {
        unit_blocks: header.unit_blocks,
        uuid,
        seq: header.seq,
        units: new_units,
        bits_crc: crc32c(&new_bits),
    };
    let mut runs = Vec::new();
    let base = copy_offset(header.seq % 2, new_units);
    runs.push((base, new_header.encode()));
    push_pages(&mut runs, base + WRITTEN_PAGE_BYTES, &new_bits);

    // The generations copy the superblock names, with the same `seq` at
    // the same copy index of the new layout: the superblock keeps naming it.
    let seq = superblock.generations_seq;
    if seq != 0 {
        let at = generations_offset(seq % 2, old_units) as usize;
        let len = (WRITTEN_PAGE_BYTES + generations_bytes(old_units)) as usize;
        let mut raw = old_bytes.get(at..).unwrap_or_default().to_vec();
        raw.resize(len, 0);
        raw.truncate(len);
        let (head, values) = raw.split_at(WRITTEN_PAGE_BYTES as usize);
        let named = GenerationsHeader::decode(head)
            .ok()
            .filter(|head| head.uuid == uuid && head.units == old_units && head.seq == seq);
        if named.is_some() {
            let base = generations_offset(seq % 2, new_units);
            runs.push((
                base,
                GenerationsHeader {
                    uuid,
                    seq,
                    units: new_units,
                }
                .encode(),
            ));
            let page = WRITTEN_PAGE_BYTES as usize;
            let new_pages = (generations_bytes(new_units) / WRITTEN_PAGE_BYTES) as usize;
            let per_page = vouch_format::written::VALUES_PER_PAGE;
            for (index, stored) in values.chunks(page).enumerate().take(new_pages) {
                let index = index as u64;
                let encoded = match decode_values_page(&uuid, index, stored) {
                    Some(mut decoded) => {
                        // Units past the new end hold nothing any more.
                        let first = index * per_page;
                        for (at, value) in decoded.iter_mut().enumerate() {
                            if first + at as u64 >= new_units {
                                *value = 0;
                            }
                        }
                        encode_values_page(&uuid, index, &decoded)
                    }
                    // A damaged page stays damaged (its units not known).
                    None => stored.to_vec(),
                };
                push_pages(
                    &mut runs,
                    base + WRITTEN_PAGE_BYTES + index * WRITTEN_PAGE_BYTES,
                    &encoded,
                );
            }
        }
    }
    let len = generations_offset(2, new_units);
    Ok((len, runs))
}

/// Bytes to write at a file offset.
type Page = (u64, Vec<u8>);

/// The non-zero 4 KiB pages of `bytes`, at `base` on.
fn push_pages(runs: &mut Vec<Page>, base: u64, bytes: &[u8]) {
    for (index, page) in bytes.chunks(WRITTEN_PAGE_BYTES as usize).enumerate() {
        if page.iter().any(|byte| *byte != 0) {
            runs.push((base + index as u64 * WRITTEN_PAGE_BYTES, page.to_vec()));
        }
    }
}

/// The files whose length follows the size, with their nominal lengths.
fn sized_files(geometry: &Geometry) -> Vec<(ObjectId, u64)> {
    let mut files = Vec::new();
    if geometry.has_context_table() {
        files.push((ObjectId::Contexts, geometry.contexts_len()));
    }
    for segment in 0..geometry.segments() {
        files.push((ObjectId::Data(segment), geometry.segment_len(segment)));
    }
    files
}

/// Resize the volume directory `volume`, which must be closed cleanly and
/// held (`FileStorage::lock_for_writing`) by the caller, to `new_bytes`.
/// A shrink must have been checked by the caller (`first_written` over
/// the tail, on the volume opened): this checks what the files say.
pub fn resize(
    fs: &dyn SnapshotFs,
    volume: &Path,
    new_bytes: u64,
    breaks: ResizeBreaks,
) -> Result<Resized> {
    crate::superblock::check_volume_size(new_bytes)?;
    crate::snapshot::fenced::refuse_while_materialising(fs, volume, "resize it")?;
    if let Some(done) = finish(fs, volume)? {
        tracing::info!(volume = %volume.display(), "{done}");
    }
    if crate::regions::has_regions(&superblock_of(fs, volume)?) {
        return crate::regions::resize::resize(fs, volume, new_bytes, breaks);
    }
    resize_volume(fs, volume, new_bytes, breaks, Allowed::default())
}

/// `resize` of one leg of a mirror (`vouch resize` of a mirror with local
/// legs resizes each in turn): every leg held, active and closed cleanly
/// by the caller, which checked a shrink's tail on each. Its mirror
/// record is not refused; a volume with regions is.
pub fn resize_mirror_leg(fs: &dyn SnapshotFs, leg: &Path, new_bytes: u64) -> Result<Resized> {
    crate::superblock::check_volume_size(new_bytes)?;
    resize_volume(
        fs,
        leg,
        new_bytes,
        ResizeBreaks::default(),
        Allowed {
            mirror_leg: true,
            ..Allowed::default()
        },
    )
}

/// What a resize of one directory takes that `resize` refuses: a member
/// of a volume with regions (`regions::resize` resizes each), a mirror's
/// leg (`resize_mirror_leg`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Allowed {
    pub(crate) regions: bool,
    pub(crate) mirror_leg: bool,
}

impl Allowed {
    pub(crate) const MEMBER: Allowed = Allowed {
        regions: true,
        mirror_leg: false,
    };
}

/// `resize` of the one volume (directory) `volume`, taking what `allowed`
/// says.
pub(crate) fn resize_volume(
    fs: &dyn SnapshotFs,
    volume: &Path,
    new_bytes: u64,
    breaks: ResizeBreaks,
    allowed: Allowed,
) -> Result<Resized> {
    if let Some(done) = finish(fs, volume)? {
        tracing::info!(volume = %volume.display(), "{done}");
    }
    let superblock = superblock_of(fs, volume)?;
    refuse(fs, volume, &superblock, allowed)?;
    let old = geometry_of(&superblock)?;
    let new = Geometry::new(old.layout, new_bytes, old.segment_blocks)
        .map_err(|error| invalid(format!("size {new_bytes}: {error}")))?;
    let resized = Resized {
        old_bytes: old.size_bytes,
        new_bytes,
    };
    if new.blocks == old.blocks {
        return Ok(resized);
    }
    let written = volume.join(ObjectId::Written.file_name());
    let map_bytes = fs
        .read(&written)
        .map_err(|e| io_error("read", &written, e))?;
    let (map_len, map_runs) = resized_map(&map_bytes, &superblock, &old, &new)?;
    let straddle_set = straddle_unit(&old, &new).is_some_and(|unit| {
        valid_copy(&map_bytes, superblock.uuid, units_of(&old))
            .is_some_and(|(_, bits)| bits[(unit / 8) as usize] & (1 << (unit % 8)) != 0)
    });
    let mut switched = superblock;
    switched.size_bytes = new_bytes;
    if breaks.switch_first {
        switch(fs, volume, &switched)?;
    }
    let grown = if new.blocks > old.blocks {
        grow_files(fs, volume, &superblock, (&old, &new), straddle_set)?
    } else {
        Vec::new()
    };
    let pending = volume.join(RESIZE_MAP_FILE);
    fs.set_len(&pending, map_len)
        .map_err(|e| io_error("create", &pending, e))?;
    for (offset, bytes) in &map_runs {
        fs.write_at(&pending, *offset, bytes)
            .map_err(|e| io_error("write", &pending, e))?;
    }
    for file in grown.iter().chain([&pending]) {
        fs.sync_file(file).map_err(|e| io_error("sync", file, e))?;
    }
    fs.sync_dir(volume)
        .map_err(|e| io_error("sync", volume, e))?;
    if !breaks.switch_first {
        switch(fs, volume, &switched)?;
    }
    fs.rename(&pending, &written)
        .map_err(|e| io_error("rename", &pending, e))?;
    fs.sync_dir(volume)
        .map_err(|e| io_error("sync", volume, e))?;
    if new.blocks < old.blocks {
        shrink_files(fs, volume, &old, &new)?;
    }
    Ok(resized)
}

/// What no resize touches: a snapshot (read-only), a volume not closed
/// cleanly, a mirror's leg, a volume this binary opens read-only or
/// without the written map; but what `allowed` says.
pub(crate) fn refuse(
    fs: &dyn SnapshotFs,
    volume: &Path,
    superblock: &Superblock,
    allowed: Allowed,
) -> Result<()> {
    let shown = volume.display();
    if superblock.state != STATE_CLEAN {
        return Err(invalid(format!(
            "{shown} was not closed cleanly: open it (vouch check, or serve) so it recovers, then resize it"
        )));
    }
    if !allowed.mirror_leg && fs.exists(&volume.join(vouch_format::mirror::MIRROR_RECORD_FILE)) {
        return Err(invalid(format!(
            "{shown} is a leg of a mirror: `vouch resize` of its path resizes every leg in turn"
        )));
    }
    refuse_kind_of(&shown.to_string(), superblock, allowed.regions)
}

/// What no resize touches, by the superblock alone (an online resize asks
/// before it closes the engine): a snapshot, unknown features, regions, a
/// volume without the written map and whole units.
pub(crate) fn refuse_kind(shown: &str, superblock: &Superblock) -> Result<()> {
    refuse_kind_of(shown, superblock, false)
}

/// `refuse_kind`; `member`: the REGIONS flag allowed (`regions::resize`
/// resizes each member in turn).
pub(crate) fn refuse_kind_of(shown: &str, superblock: &Superblock, member: bool) -> Result<()> {
    if is_snapshot(superblock) {
        return Err(invalid(format!(
            "{shown} is a snapshot, which is read-only: resize the volume, or a `vouch clone` of the snapshot"
        )));
    }
    let features = superblock.features;
    if features.unknown_ro_compat() != 0 {
        return Err(invalid(format!(
            "{shown} has features this vouch does not know (ro_compat {:#x}): it opens read-only and is not resized",
            features.unknown_ro_compat()
        )));
    }
    if features.unknown_incompat() != 0 {
        return Err(invalid(format!(
            "{shown} has features this vouch does not know (incompat {:#x}): a newer vouch made it; resize it with that version",
            features.unknown_incompat()
        )));
    }
    if features.incompat & FeatureFlags::INCOMPAT_REGIONS != 0 && !member {
        return Err(invalid(format!(
            "{shown} has a layout per region (`vouch migrate` moved some of its regions): it is resized as a whole (`vouch resize PATH SIZE` offline, or `vouch resize --server` of the export serving it)"
        )));
    }
    let needed = FeatureFlags::INCOMPAT_WRITTEN_MAP | FeatureFlags::INCOMPAT_BOUND_UNITS;
    if features.incompat & needed != needed {
        return Err(invalid(format!(
            "{shown} was made before the written map and whole units: `vouch upgrade {shown}` makes it writable, then resize it"
        )));
    }
    Ok(())
}

/// The written-map unit that straddles the old end and gains slots, if
/// there is one.
fn straddle_unit(old: &Geometry, new: &Geometry) -> Option<u64> {
    let per = units_blocks(old);
    (new.blocks > old.blocks && !old.blocks.is_multiple_of(per)).then_some(old.blocks / per)
}

/// Step 1 of a grow: every sized file at its new length, its new tail
/// zeros; the straddling unit's new slots vacant when its bit is set.
/// Returns the files to sync.
fn grow_files(
    fs: &dyn SnapshotFs,
    volume: &Path,
    superblock: &Superblock,
    (old, new): (&Geometry, &Geometry),
    straddle_set: bool,
) -> Result<Vec<PathBuf>> {
    let old_lengths: std::collections::BTreeMap<ObjectId, u64> =
        sized_files(old).into_iter().collect();
    let mut files = Vec::new();
    for (object, len) in sized_files(new) {
        let old_len = old_lengths.get(&object).copied().unwrap_or(0);
        if old_len == len {
            continue;
        }
        let path = volume.join(object.file_name());
        // Cut to the old length first: whatever a run cut short left past
        // it is gone, and the new tail reads as zeros.
        fs.set_len(&path, old_len)
            .and_then(|()| fs.set_len(&path, len))
            .map_err(|e| io_error("extend", &path, e))?;
        files.push(path);
    }
    if let Some(unit) = straddle_unit(old, new).filter(|_| straddle_set) {
        let per = units_blocks(old);
        let end = ((unit + 1) * per).min(new.blocks);
        let tag = superblock.volume_tag();
        for lba in old.blocks..end {
            let marker = vouch_format::encode_vacant(tag, lba);
            let (object, offset) = match new.layout {
                LayoutKind::Split => (ObjectId::Contexts, new.context_offset(lba)),
                LayoutKind::Packed => {
                    let place = new.locate(lba);
                    (
                        ObjectId::Data(place.segment),
                        place.data_offset + u64::from(vouch_format::BLOCK_SIZE),
                    )
                }
            };
            let path = volume.join(object.file_name());
            fs.write_at(&path, offset, &marker)
                .map_err(|e| io_error("write", &path, e))?;
            if !files.contains(&path) {
                files.push(path);
            }
        }
    }
    Ok(files)
}

/// Step 5 of a shrink: the files cut to the new lengths, segments past
/// the new end removed.
fn shrink_files(fs: &dyn SnapshotFs, volume: &Path, old: &Geometry, new: &Geometry) -> Result<()> {
    for (object, len) in sized_files(new) {
        let old_len = sized_files(old)
            .into_iter()
            .find(|(o, _)| *o == object)
            .map_or(0, |(_, l)| l);
        if old_len == len {
            continue;
        }
        let path = volume.join(object.file_name());
        fs.set_len(&path, len)
            .map_err(|e| io_error("truncate", &path, e))?;
        fs.sync_file(&path)
            .map_err(|e| io_error("sync", &path, e))?;
    }
    for segment in new.segments()..old.segments() {
        let path = volume.join(ObjectId::Data(segment).file_name());
        if fs.exists(&path) {
            fs.remove_file(&path)
                .map_err(|e| io_error("remove", &path, e))?;
        }
    }
    fs.sync_dir(volume).map_err(|e| io_error("sync", volume, e))
}

/// Step 3: the superblock with the new size, one copy then the other (the
/// copy a checkpoint would write next first), each fsynced: after the
/// first fsync the volume has its new size.
fn switch(fs: &dyn SnapshotFs, volume: &Path, superblock: &Superblock) -> Result<()> {
    let path = volume.join(ObjectId::Superblock.file_name());
    let mut next = *superblock;
    for _ in 0..2 {
        next.generation += 1;
        let mut slot = vec![0u8; SUPERBLOCK_SLOT_BYTES as usize];
        slot[..vouch_format::SUPERBLOCK_BYTES].copy_from_slice(&next.encode());
        fs.write_at(&path, (next.generation % 2) * SUPERBLOCK_SLOT_BYTES, &slot)
            .map_err(|e| io_error("write", &path, e))?;
        fs.sync_file(&path)
            .map_err(|e| io_error("sync", &path, e))?;
    }
    Ok(())
}

/// Resize the volume at `path`, open and served in this process as
/// `volume` (`Volume::resize_online`: closed, resized by `resize` on its
/// files, opened again on them under the same lock).
pub fn resize_open(
    volume: &crate::Volume,
    path: &Path,
    new_bytes: u64,
) -> Result<crate::volume::OnlineResized> {
    let fs = crate::snapshot::RealFs::default();
    volume.resize_online(
        new_bytes,
        crate::volume::ResizeSteps {
            files: &mut |bytes| resize(&fs, path, bytes, ResizeBreaks::default()).map(drop),
            reopen: &mut |storage, geometry| {
                storage.reopen(geometry).map_err(|error| Error::Path {
                    action: "open",
                    path: path.to_path_buf(),
                    cause: error.to_string(),
                })
            },
        },
    )
}
