//! Files of a volume shorter than it needs, found at open: which they
//! are and which LBAs lie past their ends. A leaf: `Backing` keeps the
//! short data segments it finds, and `damage.rs` names them in messages.

use std::ops::Range;

use vouch_format::layout::{PACKED_RECORDS_PER_ROW, PACKED_RECORD_BYTES, PACKED_ROW_BYTES};
use vouch_format::{Geometry, LayoutKind, Superblock};

use crate::error::{Error, Result};
use crate::storage::{objects_of, ObjectId, Storage};

/// A file of the volume shorter than its nominal length, and the LBAs
/// whose data or metadata lies past its end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShortObject {
    pub object: ObjectId,
    pub len: u64,
    pub expected: u64,
    pub lbas: Range<u64>,
}

impl std::fmt::Display for ShortObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.object {
            ObjectId::Contexts => "have no protection information",
            _ => "are missing",
        };
        write!(
            f,
            "{} is {}, the volume needs {}: LBAs {}-{} {what}",
            self.object.file_name(),
            size(self.len),
            size(self.expected),
            self.lbas.start,
            self.lbas.end - 1
        )
    }
}

/// A byte count as qemu-img writes sizes (powers of 1024).
fn size(bytes: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} bytes")
}

/// The files shorter than the geometry needs. A short journal refuses the
/// open: the commits it held cannot be told from none.
pub(crate) fn short_objects(
    storage: &dyn Storage,
    geometry: &Geometry,
    superblock: &Superblock,
) -> Result<Vec<ShortObject>> {
    let mut short = Vec::new();
    for object in objects_of(geometry) {
        let expected = match object {
            ObjectId::Journal => superblock.journal_bytes,
            ObjectId::Contexts => geometry.contexts_len(),
            ObjectId::Data(segment) => geometry.segment_len(segment),
            ObjectId::Superblock | ObjectId::Written | ObjectId::Held(_) => continue,
        };
        let len = storage
            .object_len(object)
            .map_err(|error| Error::io("stat", object, 0, error))?;
        let Some(len) = len.filter(|len| *len < expected) else {
            continue;
        };
        let lbas = match object {
            ObjectId::Journal => {
                return Err(Error::Corrupt(format!(
                    "journal is {}, the volume needs {}: the commits it holds may be lost; restore it from a copy of the volume; refusing to open",
                    size(len),
                    size(superblock.journal_bytes)
                )))
            }
            ObjectId::Contexts => len / 32..geometry.blocks,
            ObjectId::Data(segment) => {
                let base = u64::from(segment) * geometry.segment_blocks;
                let whole = match geometry.layout {
                    LayoutKind::Split => len / 4096,
                    LayoutKind::Packed => {
                        (len / PACKED_ROW_BYTES) * PACKED_RECORDS_PER_ROW
                            + ((len % PACKED_ROW_BYTES) / PACKED_RECORD_BYTES)
                                .min(PACKED_RECORDS_PER_ROW)
                    }
                };
                let end = (base + geometry.segment_blocks).min(geometry.blocks);
                (base + whole).min(end)..end
            }
            ObjectId::Superblock | ObjectId::Written | ObjectId::Held(_) => continue,
        };
        if !lbas.is_empty() {
            short.push(ShortObject {
                object,
                len,
                expected,
                lbas,
            });
        }
    }
    Ok(short)
}
