//! The written map (`written`, volumes with the WRITTEN_MAP incompat
//! flag): one bit per *metadata unit* — a context page of the split layout
//! (128 blocks), a row of the packed layout (31 blocks) — set when the unit
//! holds protection information on disk. It is what lets a reader tell a
//! unit that was never written (bit clear: zeros, no I/O) from one whose
//! metadata was lost (bit set, yet its page or row reads as zeros: a
//! `metadata_lost` fault for its blocks, never zeros).
//!
//! The file holds two copies, each a 4096-byte header page followed by the
//! bits (bit `i` is bit `i % 8` of byte `i / 8`) padded to whole 4096-byte
//! pages. The valid copy (magic, CRC of its header, CRC of its bits, this
//! volume's uuid and geometry) with the higher `seq` wins; an update writes
//! the other copy with `seq + 1` and fsyncs it, so a torn update always
//! leaves the previous copy.

use crate::bytes::{get_u32, get_u64, put_u32, put_u64};
use crate::layout::{LayoutKind, PACKED_RECORDS_PER_ROW};
use crate::{crc32c, Field, FormatError, CONTEXT_BYTES};

pub const WRITTEN_MAGIC: [u8; 8] = *b"VOUCHWRT";
pub const WRITTEN_VERSION: u32 = 1;
/// Header page and bit-page size.
pub const WRITTEN_PAGE_BYTES: u64 = 4096;
const CRC_AT: usize = 60;
const HEADER_USED: usize = 64;

/// Blocks per metadata unit: the blocks whose protection information one
/// 4 KiB context page (split) or one 128 KiB row (packed) holds.
pub fn unit_blocks(layout: LayoutKind) -> u32 {
    match layout {
        LayoutKind::Split => (4096 / CONTEXT_BYTES) as u32,
        LayoutKind::Packed => PACKED_RECORDS_PER_ROW as u32,
    }
}

/// Bytes of a copy's bits, padded to whole pages.
pub fn bits_bytes(units: u64) -> u64 {
    units
        .div_ceil(8)
        .next_multiple_of(WRITTEN_PAGE_BYTES)
        .max(WRITTEN_PAGE_BYTES)
}

/// Bytes of one copy (header page and bits).
pub fn copy_bytes(units: u64) -> u64 {
    WRITTEN_PAGE_BYTES + bits_bytes(units)
}

/// File offset of copy `copy` (0 or 1).
pub fn copy_offset(copy: u64, units: u64) -> u64 {
    copy * copy_bytes(units)
}

/// A decoded written-map copy header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrittenHeader {
    /// Blocks per unit (`unit_blocks` of the volume's layout).
    pub unit_blocks: u32,
    /// The volume's uuid (a map of another volume is refused).
    pub uuid: [u8; 16],
    /// Grows by one at every update; the valid copy with the higher wins.
    pub seq: u64,
    /// Bits in the map (units of the volume).
    pub units: u64,
    /// CRC-32C of the copy's bits (all `bits_bytes(units)` of them).
    pub bits_crc: u32,
}

impl WrittenHeader {
    /// Byte table of the header's first 64 bytes (the rest of the page is zero).
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
            name: "unit_blocks",
            offset: 12,
            size: 4,
        },
        Field {
            name: "uuid",
            offset: 16,
            size: 16,
        },
        Field {
            name: "seq",
            offset: 32,
            size: 8,
        },
        Field {
            name: "units",
            offset: 40,
            size: 8,
        },
        Field {
            name: "bits_crc",
            offset: 48,
            size: 4,
        },
        Field {
            name: "reserved",
            offset: 52,
            size: 8,
        },
        Field {
            name: "crc",
            offset: 60,
            size: 4,
        },
    ];

    /// The header page.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; WRITTEN_PAGE_BYTES as usize];
        out[0..8].copy_from_slice(&WRITTEN_MAGIC);
        put_u32(&mut out, 8, WRITTEN_VERSION);
        put_u32(&mut out, 12, self.unit_blocks);
        out[16..32].copy_from_slice(&self.uuid);
        put_u64(&mut out, 32, self.seq);
        put_u64(&mut out, 40, self.units);
        put_u32(&mut out, 48, self.bits_crc);
        crate::seal(&mut out, CRC_AT);
        out
    }

    pub fn decode(raw: &[u8]) -> Result<WrittenHeader, FormatError> {
        crate::check_sealed(raw, HEADER_USED, &WRITTEN_MAGIC, CRC_AT)?;
        let version = get_u32(raw, 8);
        if version != WRITTEN_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        Ok(WrittenHeader {
            unit_blocks: get_u32(raw, 12),
            uuid: raw[16..32].try_into().expect("16 bytes"),
            seq: get_u64(raw, 32),
            units: get_u64(raw, 40),
            bits_crc: get_u32(raw, 48),
        })
    }

    /// Check a copy's bits against this header.
    pub fn bits_match(&self, bits: &[u8]) -> bool {
        bits.len() as u64 == bits_bytes(self.units) && crc32c(bits) == self.bits_crc
    }
}

/// Magic of a generations copy (the area after both copies of the bits).
pub const GENERATIONS_MAGIC: [u8; 8] = *b"VOUCHGEN";
/// 2: a CRC per values page (1 had one CRC over all values, in the header).
pub const GENERATIONS_VERSION: u32 = 2;

/// Values in one 4 KiB page of a generations copy: the page's last 4
/// bytes are its CRC (`values_page_crc`), so an update writes and checks
/// only the pages it changes.
pub const VALUES_PER_PAGE: u64 = (WRITTEN_PAGE_BYTES - 4) / 4;

/// Bytes of a generations copy's values: `VALUES_PER_PAGE` per page.
pub fn generations_bytes(units: u64) -> u64 {
    units.div_ceil(VALUES_PER_PAGE).max(1) * WRITTEN_PAGE_BYTES
}

/// The CRC of values page `index` of volume `uuid`: CRC-32C of the
/// page's first 4092 bytes, then the uuid, then the index (u64 LE), so a
/// page of another place or volume fails it.
pub fn values_page_crc(uuid: &[u8; 16], index: u64, page: &[u8]) -> u32 {
    let mut bytes = Vec::with_capacity(WRITTEN_PAGE_BYTES as usize + 24);
    bytes.extend_from_slice(&page[..WRITTEN_PAGE_BYTES as usize - 4]);
    bytes.extend_from_slice(uuid);
    bytes.extend_from_slice(&index.to_le_bytes());
    crc32c(&bytes)
}

/// Values page `index` of `values` (`VALUES_PER_PAGE` at most, 0 past
/// them): all zero when every value is 0 (written as a hole), else the
/// values and their CRC.
pub fn encode_values_page(uuid: &[u8; 16], index: u64, values: &[u32]) -> Vec<u8> {
    let mut page = vec![0u8; WRITTEN_PAGE_BYTES as usize];
    if values.iter().all(|value| *value == 0) {
        return page;
    }
    for (slot, value) in values.iter().enumerate() {
        put_u32(&mut page, slot * 4, *value);
    }
    let crc = values_page_crc(uuid, index, &page);
    put_u32(&mut page, WRITTEN_PAGE_BYTES as usize - 4, crc);
    page
}

/// The values of page `index` as read: `None` if it fails its CRC (its
/// values are then not known); an all-zero page holds only 0.
pub fn decode_values_page(uuid: &[u8; 16], index: u64, page: &[u8]) -> Option<Vec<u32>> {
    let values = || {
        (0..VALUES_PER_PAGE as usize)
            .map(|slot| get_u32(page, slot * 4))
            .collect()
    };
    if page.iter().all(|byte| *byte == 0) {
        return Some(values());
    }
    let stored = get_u32(page, WRITTEN_PAGE_BYTES as usize - 4);
    (values_page_crc(uuid, index, page) == stored).then(values)
}

/// File offset of generations copy `copy` (0 or 1): after both copies of
/// the bits, each a header page and the values. A binary from before the
/// area reads and writes only the bits' copies, so it never touches it.
pub fn generations_offset(copy: u64, units: u64) -> u64 {
    2 * copy_bytes(units) + copy * (WRITTEN_PAGE_BYTES + generations_bytes(units))
}

/// A decoded generations copy header: the expected generation of every
/// unit (split: the highest generation of the contexts of its page, as the
/// checkpoint that wrote the map last wrote the page; 0: not known), valid
/// only when the superblock's `generations_seq` names its `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GenerationsHeader {
    /// The volume's uuid.
    pub uuid: [u8; 16],
    /// Grows by one at every update of either copy; the superblock
    /// names the one that holds (`generations_seq`).
    pub seq: u64,
    /// Values that follow (units of the volume).
    pub units: u64,
}

impl GenerationsHeader {
    /// Byte table of the header's first 64 bytes (the rest of the page is zero).
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
            name: "reserved0",
            offset: 12,
            size: 4,
        },
        Field {
            name: "uuid",
            offset: 16,
            size: 16,
        },
        Field {
            name: "seq",
            offset: 32,
            size: 8,
        },
        Field {
            name: "units",
            offset: 40,
            size: 8,
        },
        Field {
            name: "reserved1",
            offset: 48,
            size: 12,
        },
        Field {
            name: "crc",
            offset: 60,
            size: 4,
        },
    ];

    /// The header page.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; WRITTEN_PAGE_BYTES as usize];
        out[0..8].copy_from_slice(&GENERATIONS_MAGIC);
        put_u32(&mut out, 8, GENERATIONS_VERSION);
        out[16..32].copy_from_slice(&self.uuid);
        put_u64(&mut out, 32, self.seq);
        put_u64(&mut out, 40, self.units);
        crate::seal(&mut out, CRC_AT);
        out
    }

    pub fn decode(raw: &[u8]) -> Result<GenerationsHeader, FormatError> {
        crate::check_sealed(raw, HEADER_USED, &GENERATIONS_MAGIC, CRC_AT)?;
        let version = get_u32(raw, 8);
        if version != GENERATIONS_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        Ok(GenerationsHeader {
            uuid: raw[16..32].try_into().expect("16 bytes"),
            seq: get_u64(raw, 32),
            units: get_u64(raw, 40),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> WrittenHeader {
        WrittenHeader {
            unit_blocks: 128,
            uuid: [0x22; 16],
            seq: 7,
            units: 1000,
            bits_crc: crc32c(&[0u8; 4096]),
        }
    }

    #[test]
    fn table_tiles_the_header() {
        assert!(crate::fields_tile(WrittenHeader::FIELDS, HEADER_USED));
    }

    #[test]
    fn round_trip_and_golden_crc() {
        let header = sample();
        let bytes = header.encode();
        assert_eq!(WrittenHeader::decode(&bytes).unwrap(), header);
        // Golden: a change here is a format change (new flag or version).
        assert_eq!(
            get_u32(&bytes, 60),
            0x79a9_8479,
            "written map header encoding changed"
        );
        assert!(header.bits_match(&[0u8; 4096]));
        assert!(!header.bits_match(&[1u8; 4096]));
        let mut bad = bytes.clone();
        bad[33] ^= 1;
        assert!(WrittenHeader::decode(&bad).is_err());
        assert!(WrittenHeader::decode(&[0u8; 4096]).is_err());
    }

    #[test]
    fn generations_round_trip_and_golden_crc() {
        assert!(crate::fields_tile(GenerationsHeader::FIELDS, HEADER_USED));
        let header = GenerationsHeader {
            uuid: [0x22; 16],
            seq: 7,
            units: 1000,
        };
        let bytes = header.encode();
        assert_eq!(GenerationsHeader::decode(&bytes).unwrap(), header);
        // Golden: a change here is a format change (new version).
        assert_eq!(
            get_u32(&bytes, 60),
            0x74ef_56f3,
            "generations header encoding changed"
        );
        let values: Vec<u32> = (1..=VALUES_PER_PAGE as u32).collect();
        let page = encode_values_page(&[0x22; 16], 3, &values);
        assert_eq!(decode_values_page(&[0x22; 16], 3, &page), Some(values));
        assert_eq!(
            decode_values_page(&[0x22; 16], 4, &page),
            None,
            "another place"
        );
        assert_eq!(
            decode_values_page(&[0x23; 16], 3, &page),
            None,
            "another volume"
        );
        let mut flipped = page.clone();
        flipped[100] ^= 1;
        assert_eq!(decode_values_page(&[0x22; 16], 3, &flipped), None);
        let zeros = encode_values_page(&[0x22; 16], 3, &[0; 5]);
        assert!(zeros.iter().all(|byte| *byte == 0), "a hole");
        assert_eq!(
            decode_values_page(&[0x22; 16], 3, &zeros),
            Some(vec![0; VALUES_PER_PAGE as usize])
        );
        let mut bad = bytes.clone();
        bad[41] ^= 1;
        assert!(GenerationsHeader::decode(&bad).is_err());
        assert!(GenerationsHeader::decode(&[0u8; 4096]).is_err());
        assert_eq!(generations_offset(0, 1000), 2 * 8192);
        assert_eq!(generations_offset(1, 1000), 2 * 8192 + 8192);
        assert_eq!(generations_bytes(1023), 4096);
        assert_eq!(generations_bytes(1024), 8192);
    }

    #[test]
    fn geometry_of_the_copies() {
        assert_eq!(unit_blocks(LayoutKind::Split), 128);
        assert_eq!(unit_blocks(LayoutKind::Packed), 31);
        assert_eq!(bits_bytes(1), 4096);
        assert_eq!(bits_bytes(4096 * 8 + 1), 8192);
        assert_eq!(copy_offset(1, 1000), 8192);
    }
}
