//! Lost metadata, found and named: files shorter than the volume needs
//! (found at open, reported once per file), the written map at open
//! (`written.rs`), and the cause of a `metadata_lost` fault for messages
//! ("contexts: page 40 is zeroed: LBAs 5120-5247 have no protection
//! information"). Absence is never emptiness: a block whose metadata is
//! missing is a fault naming its LBA, never zeros or a hole.

pub(crate) mod short;

use std::ops::Range;

use vouch_format::{Geometry, Superblock, CONTEXT_BYTES, KIND_LOST, KIND_VACANT};

use crate::backing::Backing;
use crate::error::{Error, Result};
use crate::shared::Shared;
use crate::storage::{objects_of, ObjectId, Storage};
use crate::written::{Loaded, WrittenMap};

pub(crate) use short::short_objects;
pub use short::ShortObject;

/// A writable open of a split volume with short data segments: every
/// context of a block whose data is past a segment's end becomes a lost
/// marker on disk, fsynced before anything else is written (recovery
/// included). A later write past the end extends the file and leaves a
/// hole before it, so the file's length alone would not find these blocks
/// at the next open; the markers do, until each block is written again (a
/// client write, a repair from a mirror leg). A crash before the fsync
/// leaves the file as short as it was, and the next open stamps again.
///
/// The markers carry no generation, so a stamped page may be older than
/// the generation the map expects of it: the lower generation is written
/// with the map (fsynced), then a superblock naming that generations copy
/// (`superblock`, which the open goes on with; fsynced), before any page
/// is, so a crash in between leaves pages newer than the values the
/// superblock names, never older.
pub(crate) fn stamp_short_data_on_disk(io: &Backing, superblock: &mut Superblock) -> Result<()> {
    let mut stamped = Vec::new();
    for short in &io.short_data {
        let mut offset = short.lbas.start * CONTEXT_BYTES as u64;
        let end = short.lbas.end * CONTEXT_BYTES as u64;
        while let Some(at) = io
            .seek_data(ObjectId::Contexts, offset)?
            .filter(|at| *at < end)
        {
            let page_no = at / 4096;
            let mut page = [0u8; 4096];
            io.read_object(ObjectId::Contexts, page_no * 4096, &mut page)?;
            if crate::state::stale_page(io, page_no, &page).is_none()
                && io.stamp_short_data(page_no, &mut page)
            {
                stamped.push((page_no, page));
            }
            offset = (page_no + 1) * 4096;
        }
    }
    if stamped.is_empty() {
        return Ok(());
    }
    for (page_no, page) in &stamped {
        let generation = io.written.page_generation(*page_no, page);
        if io.written.expected_generation(*page_no) != 0 {
            io.written.set_expected_generation(*page_no, generation);
        }
    }
    io.written.persist(io, superblock.generations_seq)?;
    if superblock.generations_seq != io.written.generations_seq() {
        superblock.generation += 1;
        superblock.generations_seq = io.written.generations_seq();
        crate::superblock::write_superblock_copy(
            io.storage(),
            superblock,
            superblock.generation % 2,
        )?;
        io.sync_object(ObjectId::Superblock)?;
    }
    for (page_no, page) in &stamped {
        io.write_object(ObjectId::Contexts, page_no * 4096, page)?;
    }
    io.sync_object(ObjectId::Contexts)?;
    tracing::warn!(
        pages = stamped.len(),
        "data segments are shorter than the volume needs: the blocks past their ends are marked lost"
    );
    Ok(())
}

/// The written map of a volume that has one. No valid copy is refused
/// unless the volume holds nothing yet (a new volume or mirror leg, whose
/// first open writes its map): `never_opened` (its superblock is still the
/// one `create` wrote), or no data or contexts on disk. The first test
/// does not depend on the filesystem reporting holes (ramfs reports every
/// byte as data).
pub(crate) fn load_written(
    storage: &dyn Storage,
    geometry: &Geometry,
    (uuid, generations_seq): ([u8; 16], u64),
    never_opened: bool,
) -> Result<WrittenMap> {
    let why = match WrittenMap::load(storage, geometry, (uuid, generations_seq))? {
        Loaded::Map(map) => return Ok(*map),
        Loaded::None(why) => why,
        Loaded::NotNamed(why) => {
            // Never "not known": an older `written` restored with the data
            // and contexts of its time would read them all as current.
            return Err(Error::Corrupt(format!(
                "written: {why}; the expected generations that tell an older copy of `contexts` or the data from the current one are missing, so the volume is not opened (the written map, data and contexts may all be older than the superblock and journal): restore every file of the volume from one copy, or accept the files as they are now, older blocks included, and rebuild the map from them with `vouch upgrade PATH` (offline)"
            )));
        }
    };
    if never_opened {
        return Ok(WrittenMap::empty(geometry, uuid));
    }
    let mut holds_nothing = true;
    for object in objects_of(geometry) {
        if matches!(object, ObjectId::Contexts | ObjectId::Data(_)) {
            let next = storage
                .next_data(object, 0)
                .map_err(|error| Error::io("seek", object, 0, error))?;
            holds_nothing &= next.is_none();
        }
    }
    if holds_nothing {
        return Ok(WrittenMap::empty(geometry, uuid));
    }
    Err(Error::Corrupt(format!(
        "written: the written map is missing or damaged ({why}); without it lost metadata cannot be told from never-written blocks, so the volume is not opened: restore the file from a copy of the volume, or rebuild it from the metadata as it is now with `vouch upgrade PATH` (offline)"
    )))
}

/// Set the bit of every unit whose metadata on disk is not blank (an
/// upgrade, or a rebuild of a lost map), and fill in the expected
/// generation of each whose value is not known (a volume made before the
/// values, or whose superblock names none) from the unit as it is now, so
/// an older copy of it restored later is caught. A known value is kept: a
/// unit already older than it stays so.
pub(crate) fn build_written(shared: &Shared) -> Result<()> {
    let io = shared.io();
    let blocks = io.geometry.blocks;
    let mut lba = 0;
    while lba < blocks {
        let layout = shared.layouts().of(lba);
        let Some(next) = layout.next_data_on_disk(io, lba)? else {
            lba = shared.layouts().span_end(lba);
            continue;
        };
        let unit = io.written.unit_of(next);
        let place = layout.unit_place(unit);
        let mut bytes = vec![0u8; place.len];
        io.read_object(place.object, place.offset, &mut bytes)?;
        if layout
            .unit_metadata(&bytes)
            .iter()
            .any(|slot| *slot != [0u8; 32])
        {
            io.written.set(unit);
            io.written
                .fill_expected(unit, layout.unit_records(&bytes).into_iter());
        }
        lba = (unit + 1) * io.written.unit_blocks();
    }
    Ok(())
}

/// Make every unit whose bit is set whole (an upgrade to whole units):
/// each blank slot of it gets its vacant marker, written in place, then
/// every such file is fsynced — before the map that marks the units is
/// written and before the flag (`Engine::open`).
pub(crate) fn bind_written_units(shared: &Shared) -> Result<()> {
    let io = shared.io();
    let blocks = io.geometry.blocks;
    let mut touched = std::collections::BTreeSet::new();
    let mut lba = 0;
    while let Some(next) = io.written.next_set_lba(lba) {
        let unit = io.written.unit_of(next);
        let place = shared.layouts().of(next).unit_place(unit);
        let mut bytes = vec![0u8; place.len];
        io.read_object(place.object, place.offset, &mut bytes)?;
        let first = unit * io.written.unit_blocks();
        let changed = {
            let mut slots = shared.layouts().of(next).unit_slots(&mut bytes);
            io.written
                .bind_slots((first, blocks), &mut slots, (false, 0))
        };
        if changed {
            io.write_object(place.object, place.offset, &bytes)?;
            touched.insert(place.object);
        }
        lba = (unit + 1) * io.written.unit_blocks();
    }
    for object in touched {
        io.sync_object(object)?;
    }
    Ok(())
}

impl Shared {
    /// Why block `lba` has no protection information, for messages:
    /// "contexts: page 40 is zeroed: LBAs 5120-5247 have no protection
    /// information".
    pub fn metadata_cause(&self, lba: u64) -> String {
        let io = self.io();
        if let Some(short) = io.short_data.iter().find(|short| short.lbas.contains(&lba)) {
            return short.to_string();
        }
        let unit = io.written.unit_of(lba);
        let lbas = io.written.lbas_of(unit, io.geometry.blocks);
        let place = self.layouts().of(lba).unit_place(unit);
        let file = place.object.file_name();
        let len = io.storage().object_len(place.object).ok().flatten();
        let mut lost = lbas.clone();
        // The unit's LBAs whose slots (in the unit's bytes) `keep` picks.
        let lbas_where = |bytes: &[u8], keep: &dyn Fn(&[u8; CONTEXT_BYTES]) -> bool| -> Vec<u64> {
            self.layouts()
                .of(lba)
                .unit_metadata(bytes)
                .iter()
                .zip(lbas.clone())
                .filter(|(slot, _)| keep(slot))
                .map(|(_, lba)| lba)
                .collect()
        };
        let what = if len.is_some_and(|len| place.offset + place.len as u64 > len) {
            format!("is past the end of the file ({} bytes)", len.unwrap_or(0))
        } else {
            let mut bytes = vec![0u8; place.len];
            let read = io.read_object(place.object, place.offset, &mut bytes);
            let stale = read
                .is_ok()
                .then(|| match place.object {
                    ObjectId::Contexts => crate::state::stale_page(io, unit, &bytes),
                    // A packed row with its records' data, as the reads
                    // judge it (`judge_rows`): a blank context over data
                    // that is not blank, or an encrypted record whose
                    // keyless guard fails, makes the row unsure, not older.
                    _ => io.written.stale_records(
                        unit,
                        self.layouts().of(lba).unit_records(&bytes).into_iter(),
                    ),
                })
                .flatten();
            match read {
                Err(error) => format!("cannot be read ({error})"),
                Ok(()) if stale.is_some() => {
                    let (found, expected) = stale.unwrap_or_default();
                    if place.object != ObjectId::Contexts && !io.written.is_set(unit) {
                        // A clear row fails only its records: its slots
                        // holding nothing read as zeros (`judge_rows`).
                        let held = lbas_where(&bytes, &|slot| !WrittenMap::holds_nothing(slot));
                        if let (Some(first), Some(last)) = (held.first(), held.last()) {
                            lost = *first..*last + 1;
                        }
                    }
                    format!(
                        "is older than the volume expects (generation {found} < {expected}: an older copy of the file?)"
                    )
                }
                Ok(()) if bytes.iter().all(|byte| *byte == 0) => "is zeroed".to_string(),
                Ok(())
                    if self
                        .layouts()
                        .of(lba)
                        .unit_metadata(&bytes)
                        .iter()
                        .any(|slot| slot[0] == KIND_LOST) =>
                {
                    let marked = lbas_where(&bytes, &|slot| slot[0] == KIND_LOST);
                    if let (Some(first), Some(last)) = (marked.first(), marked.last()) {
                        lost = *first..*last + 1;
                    }
                    format!(
                        "has {} lost marker{} (found lost before)",
                        marked.len(),
                        if marked.len() == 1 { "" } else { "s" }
                    )
                }
                Ok(()) => {
                    // Whole units (`INCOMPAT_BOUND_UNITS`): some slots
                    // blank, the rest intact; name the blank ones.
                    let blank = lbas_where(&bytes, &|slot| *slot == [0u8; CONTEXT_BYTES]);
                    if let (Some(first), Some(last)) = (blank.first(), blank.last()) {
                        lost = *first..*last + 1;
                        format!(
                            "has {} blank slot{} (cut or zeroed in part)",
                            blank.len(),
                            if blank.len() == 1 { "" } else { "s" }
                        )
                    } else {
                        "has no contexts".to_string()
                    }
                }
            }
        };
        let (have, lbas_word) = if lost.end - lost.start == 1 {
            ("has", format!("LBA {}", lost.start))
        } else {
            ("have", format!("LBAs {}-{}", lost.start, lost.end - 1))
        };
        format!(
            "{file}: {} {what}: {lbas_word} {have} no protection information",
            place.name
        )
    }

    /// Why the blocks of `lba`'s unit fail their tags, when the unit as a
    /// whole was copied in from elsewhere (more than half of its slots
    /// that hold anything name another place or another volume), for
    /// messages: "contexts: page 3 belongs to another place (its slots
    /// name LBAs 640-767): LBAs 384-511 have no valid protection
    /// information". `None` for a unit that is mostly its own (a single
    /// misdirected write is reported per block).
    pub fn misplaced_cause(&self, lba: u64) -> Option<String> {
        let io = self.io();
        let unit = io.written.unit_of(lba);
        let lbas = io.written.lbas_of(unit, io.geometry.blocks);
        let layout = self.layouts().of(lba);
        let place = layout.unit_place(unit);
        let mut bytes = vec![0u8; place.len];
        io.read_object(place.object, place.offset, &mut bytes)
            .ok()?;
        let volume_tag = vouch_format::crc32c(&self.uuid());
        let (mut held, mut other_volume, mut misplaced) = (0usize, 0usize, 0usize);
        let mut named: Option<Range<u64>> = None;
        for (index, slot) in layout.unit_metadata(&bytes).iter().enumerate() {
            if *slot == [0u8; 32] {
                continue;
            }
            held += 1;
            // The kinds with tags: data, zero, lost and vacant markers.
            if !matches!(slot[0], 1 | 2 | KIND_LOST | KIND_VACANT) {
                continue;
            }
            let tag = u32::from_le_bytes(slot[4..8].try_into().expect("4 bytes"));
            let ref_tag = u64::from_le_bytes(slot[8..16].try_into().expect("8 bytes"));
            if tag != volume_tag {
                other_volume += 1;
            } else if ref_tag != lbas.start + index as u64 {
                misplaced += 1;
                let range = named.get_or_insert(ref_tag..ref_tag + 1);
                range.start = range.start.min(ref_tag);
                range.end = range.end.max(ref_tag + 1);
            }
        }
        let foreign = match named {
            _ if other_volume * 2 > held => "belongs to another volume".to_string(),
            Some(named) if misplaced * 2 > held => format!(
                "belongs to another place (its slots name LBAs {}-{})",
                named.start,
                named.end - 1
            ),
            _ => return None,
        };
        Some(format!(
            "{}: {} {foreign}: LBAs {}-{} have no valid protection information",
            place.object.file_name(),
            place.name,
            lbas.start,
            lbas.end - 1
        ))
    }
}
