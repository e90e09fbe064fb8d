//! The region record: the file `regions` of a REGIONS volume, which layout
//! serves each region of `REGION_BLOCKS` blocks (docs/FORMAT.md,
//! "Regions").
//!
//! Two copies, copy `k` at byte `k * (4096 + T)`: a 4096-byte header page
//! (96 bytes used) then `T` bytes of table, one byte per region (its
//! `LayoutKind`), `T` the region count rounded up to 4096. The valid copy
//! with the higher `seq` wins; the superblock's `regions_seq` refuses a
//! copy older than the one it names.

use crate::bytes::{get_u32, get_u64, put_u32, put_u64};
use crate::{crc32c, Field, FormatError, LayoutKind};

pub const REGIONS_MAGIC: [u8; 8] = *b"VOUCHRGN";
pub const REGIONS_VERSION: u32 = 1;
/// Blocks per region: 62 MiB, 4 * lcm(128, 31), so every split context
/// page (128 blocks) and packed row (31 blocks) lies in one region.
pub const REGION_BLOCKS: u64 = 15_872;
const PAGE: usize = 4096;
const CRC_AT: usize = 92;
const HEADER_USED: usize = 96;

/// A decoded region record: one layout per region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionRecord {
    pub uuid: [u8; 16],
    /// The uuid of the other member (`layout.NAME/`): a member of another
    /// volume, or one made again, is refused.
    pub member_uuid: [u8; 16],
    pub seq: u64,
    pub region_blocks: u64,
    pub layouts: Vec<LayoutKind>,
}

/// Why no copy of a region record can be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegionsError {
    #[error("the region record is missing or damaged (copy 0: {first}; copy 1: {second})")]
    NoValidCopy { first: String, second: String },
    #[error("the region record (seq {found}) is older than the superblock's (seq {expected}): an older copy of `regions` was put back")]
    Older { found: u64, expected: u64 },
}

impl RegionRecord {
    /// Byte table of the header's first 64 bytes (the rest is zero).
    pub const FIELDS: &'static [Field] = &[
        Field {
            name: "magic",
            offset: 0,
            size: 8,
        },
        Field {
            name: "version",
            offset: 8,
            size: 4,
        },
        Field {
            name: "region_blocks",
            offset: 12,
            size: 4,
        },
        Field {
            name: "uuid",
            offset: 16,
            size: 16,
        },
        Field {
            name: "member_uuid",
            offset: 32,
            size: 16,
        },
        Field {
            name: "seq",
            offset: 48,
            size: 8,
        },
        Field {
            name: "regions",
            offset: 56,
            size: 8,
        },
        Field {
            name: "table_crc",
            offset: 64,
            size: 4,
        },
        Field {
            name: "reserved",
            offset: 68,
            size: 24,
        },
        Field {
            name: "crc",
            offset: 92,
            size: 4,
        },
    ];

    /// Every region of a volume of `blocks` blocks in `layout`, seq 1.
    pub fn uniform(
        uuid: [u8; 16],
        member_uuid: [u8; 16],
        blocks: u64,
        layout: LayoutKind,
    ) -> RegionRecord {
        RegionRecord {
            uuid,
            member_uuid,
            seq: 1,
            region_blocks: REGION_BLOCKS,
            layouts: vec![layout; regions_of(blocks) as usize],
        }
    }

    /// The region holding `lba`.
    pub fn region_of(&self, lba: u64) -> usize {
        (lba / self.region_blocks) as usize
    }

    /// The LBAs of region `index` in a volume of `blocks` blocks.
    pub fn lbas(&self, index: usize, blocks: u64) -> std::ops::Range<u64> {
        let start = index as u64 * self.region_blocks;
        start..(start + self.region_blocks).min(blocks)
    }

    /// How many regions each layout serves, split first.
    pub fn counts(&self) -> [u64; 2] {
        let packed = self
            .layouts
            .iter()
            .filter(|layout| **layout == LayoutKind::Packed)
            .count() as u64;
        [self.layouts.len() as u64 - packed, packed]
    }

    /// Bytes of one copy (header page and table).
    pub fn copy_bytes(regions: u64) -> u64 {
        (PAGE as u64) + table_bytes(regions)
    }

    /// File offset of copy `k` (0 or 1).
    pub fn copy_offset(regions: u64, k: u64) -> u64 {
        k * Self::copy_bytes(regions)
    }

    /// The copy written at this record's `seq` (copies alternate).
    pub fn copy_index(&self) -> u64 {
        self.seq % 2
    }

    pub fn encode(&self) -> Vec<u8> {
        let regions = self.layouts.len() as u64;
        let mut out = vec![0u8; Self::copy_bytes(regions) as usize];
        for (at, layout) in self.layouts.iter().enumerate() {
            out[PAGE + at] = *layout as u8;
        }
        let table_crc = crc32c(&out[PAGE..]);
        out[0..8].copy_from_slice(&REGIONS_MAGIC);
        put_u32(&mut out, 8, REGIONS_VERSION);
        put_u32(&mut out, 12, self.region_blocks as u32);
        out[16..32].copy_from_slice(&self.uuid);
        out[32..48].copy_from_slice(&self.member_uuid);
        put_u64(&mut out, 48, self.seq);
        put_u64(&mut out, 56, regions);
        put_u32(&mut out, 64, table_crc);
        crate::seal(&mut out, CRC_AT);
        out
    }

    /// Decode one copy of the record of a volume of `blocks` blocks with
    /// this uuid.
    pub fn decode(bytes: &[u8], uuid: [u8; 16], blocks: u64) -> Result<RegionRecord, FormatError> {
        crate::check_sealed(bytes, HEADER_USED, &REGIONS_MAGIC, CRC_AT)?;
        let version = get_u32(bytes, 8);
        if version != REGIONS_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        let region_blocks = u64::from(get_u32(bytes, 12));
        let regions = get_u64(bytes, 56);
        if region_blocks != REGION_BLOCKS || regions != regions_of(blocks) {
            return Err(FormatError::Geometry(
                "the region record's regions do not match the volume's size",
            ));
        }
        if bytes[16..32] != uuid {
            return Err(FormatError::Geometry(
                "the region record belongs to another volume",
            ));
        }
        let need = Self::copy_bytes(regions) as usize;
        if bytes.len() < need {
            return Err(FormatError::Truncated {
                need,
                have: bytes.len(),
            });
        }
        let table = &bytes[PAGE..need];
        let stored = get_u32(bytes, 64);
        let computed = crc32c(table);
        if stored != computed {
            return Err(FormatError::BadChecksum { stored, computed });
        }
        let layouts = table[..regions as usize]
            .iter()
            .map(|byte| LayoutKind::from_byte(*byte))
            .collect::<Result<Vec<_>, _>>()?;
        if table[regions as usize..].iter().any(|byte| *byte != 0) {
            return Err(FormatError::Geometry("the region table's tail is not zero"));
        }
        Ok(RegionRecord {
            uuid,
            member_uuid: bytes[32..48].try_into().expect("16 bytes"),
            seq: get_u64(bytes, 48),
            region_blocks,
            layouts,
        })
    }

    /// The record that holds in the bytes of the whole `regions` file:
    /// the valid copy with the higher seq, refused when older than
    /// `expected_seq` (the superblock's `regions_seq`).
    pub fn select(
        file: &[u8],
        uuid: [u8; 16],
        blocks: u64,
        expected_seq: u64,
    ) -> Result<RegionRecord, RegionsError> {
        let regions = regions_of(blocks);
        let copy = |k: u64| {
            let start = Self::copy_offset(regions, k) as usize;
            let bytes = file.get(start..).unwrap_or(&[]);
            let end = bytes.len().min(Self::copy_bytes(regions) as usize);
            RegionRecord::decode(&bytes[..end], uuid, blocks)
        };
        let best = match (copy(0), copy(1)) {
            (Ok(a), Ok(b)) => {
                if b.seq > a.seq {
                    b
                } else {
                    a
                }
            }
            (Ok(a), Err(_)) => a,
            (Err(_), Ok(b)) => b,
            (Err(a), Err(b)) => {
                return Err(RegionsError::NoValidCopy {
                    first: a.to_string(),
                    second: b.to_string(),
                })
            }
        };
        if best.seq < expected_seq {
            return Err(RegionsError::Older {
                found: best.seq,
                expected: expected_seq,
            });
        }
        Ok(best)
    }
}

/// Regions of a volume of `blocks` blocks.
pub fn regions_of(blocks: u64) -> u64 {
    blocks.div_ceil(REGION_BLOCKS)
}

fn table_bytes(regions: u64) -> u64 {
    regions.div_ceil(PAGE as u64).max(1) * PAGE as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCKS: u64 = REGION_BLOCKS * 5 + 7;

    fn record() -> RegionRecord {
        let mut record = RegionRecord::uniform([7; 16], [9; 16], BLOCKS, LayoutKind::Split);
        record.layouts[2] = LayoutKind::Packed;
        record.seq = 4;
        record
    }

    #[test]
    fn a_region_is_whole_units_of_both_layouts() {
        assert_eq!(REGION_BLOCKS % 128, 0);
        assert_eq!(REGION_BLOCKS % crate::layout::PACKED_RECORDS_PER_ROW, 0);
        assert!(crate::fields_tile(RegionRecord::FIELDS, HEADER_USED));
    }

    #[test]
    fn a_copy_round_trips_and_its_bytes_are_fixed() {
        let bytes = record().encode();
        assert_eq!(bytes.len(), 2 * 4096);
        assert_eq!(&bytes[0..8], b"VOUCHRGN");
        assert_eq!(get_u32(&bytes, 12), 15_872);
        assert_eq!(get_u64(&bytes, 56), 6);
        assert_eq!(&bytes[32..48], &[9u8; 16]);
        assert_eq!(&bytes[4096..4102], &[0, 0, 1, 0, 0, 0]);
        assert_eq!(
            RegionRecord::decode(&bytes, [7; 16], BLOCKS).expect("decode"),
            record()
        );
        assert_eq!(record().counts(), [5, 1]);
        assert_eq!(record().region_of(REGION_BLOCKS * 2), 2);
        assert_eq!(record().lbas(5, BLOCKS), REGION_BLOCKS * 5..BLOCKS);
        // Golden: a change here means the format changed.
        assert_eq!(
            get_u32(&bytes, 92),
            0xff33_def2,
            "region record encoding changed"
        );
        assert_eq!(get_u32(&bytes, 64), crc32c(&bytes[4096..]));
    }

    fn file(first: &RegionRecord, second: Option<&RegionRecord>) -> Vec<u8> {
        let mut out = first.encode();
        out.extend(second.map_or(vec![0; out.len()], RegionRecord::encode));
        out
    }

    #[test]
    fn the_newer_valid_copy_wins_and_a_torn_one_is_passed_over() {
        let old = record();
        let mut new = record();
        new.seq = 5;
        new.layouts[3] = LayoutKind::Packed;
        let both = file(&old, Some(&new));
        let chosen = RegionRecord::select(&both, [7; 16], BLOCKS, 4).expect("select");
        assert_eq!(chosen, new);
        let mut torn = both.clone();
        let at = RegionRecord::copy_offset(6, 1) as usize + 4096 + 3;
        torn[at] ^= 1;
        assert_eq!(
            RegionRecord::select(&torn, [7; 16], BLOCKS, 4).expect("select"),
            old,
            "a torn table leaves the previous copy"
        );
    }

    #[test]
    fn absence_and_older_copies_are_refused() {
        assert!(matches!(
            RegionRecord::select(&[], [7; 16], BLOCKS, 0),
            Err(RegionsError::NoValidCopy { .. })
        ));
        assert!(matches!(
            RegionRecord::select(&vec![0; 4 * 4096], [7; 16], BLOCKS, 0),
            Err(RegionsError::NoValidCopy { .. })
        ));
        let one = file(&record(), None);
        assert!(matches!(
            RegionRecord::select(&one, [7; 16], BLOCKS, 5),
            Err(RegionsError::Older {
                found: 4,
                expected: 5
            })
        ));
        assert!(
            RegionRecord::select(&one, [8; 16], BLOCKS, 0).is_err(),
            "another volume's record"
        );
        assert!(
            RegionRecord::select(&one, [7; 16], BLOCKS + REGION_BLOCKS, 0).is_err(),
            "another size's record"
        );
    }
}
