//! The resync map: the file `mirror.dirty.N` in the directory of each
//! surviving leg while leg `N` is stale, one bit per block that may differ
//! on leg `N` (md's write-intent bitmap, DRBD's quick-sync bitmap).
//!
//! A 4096-byte header, then the *region* section (one bit per region of
//! `region_blocks` blocks: regions that may hold writes whose block bits
//! are not durable yet, persisted before such a write is issued), then the
//! *block* section (one bit per block, persisted at each flush). Both
//! sections are 4096-byte pages, each `PAGE_BITS_BYTES` bytes of bits
//! (bit `i` of the section is bit `i % 8` of byte `i / 8` of the page
//! `i / PAGE_BITS`) followed by a CRC-32C of the page's number (u64 LE)
//! and its bits, so a torn page is detected, not trusted.

use crate::bytes::{get_u32, get_u64, put_u32, put_u64};
use crate::{crc32c, Field, FormatError};

pub const DIRTY_MAGIC: [u8; 8] = *b"VOUCHDTY";
pub const DIRTY_VERSION: u32 = 1;
/// Header and page size.
pub const DIRTY_PAGE_BYTES: usize = 4096;
/// Bytes of bits in one page (the rest is its CRC).
pub const PAGE_BITS_BYTES: usize = DIRTY_PAGE_BYTES - 4;
/// Bits in one page.
pub const PAGE_BITS: u64 = (PAGE_BITS_BYTES * 8) as u64;
/// Blocks per region bit (16 MiB of 4 KiB blocks).
pub const REGION_BLOCKS: u32 = 4096;
const CRC_AT: usize = 60;
const HEADER_USED: usize = 64;

/// A decoded resync map header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirtyHeader {
    /// The stale leg this map covers.
    pub leg: u16,
    /// The volume's uuid.
    pub uuid: [u8; 16],
    /// Blocks the volume has (bits in the block section).
    pub blocks: u64,
    /// Blocks per region bit.
    pub region_blocks: u32,
}

impl DirtyHeader {
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
            name: "leg",
            offset: 12,
            size: 2,
        },
        Field {
            name: "reserved0",
            offset: 14,
            size: 2,
        },
        Field {
            name: "uuid",
            offset: 16,
            size: 16,
        },
        Field {
            name: "blocks",
            offset: 32,
            size: 8,
        },
        Field {
            name: "region_blocks",
            offset: 40,
            size: 4,
        },
        Field {
            name: "reserved1",
            offset: 44,
            size: 16,
        },
        Field {
            name: "crc",
            offset: 60,
            size: 4,
        },
    ];

    /// Regions the volume has (bits in the region section).
    pub fn regions(&self) -> u64 {
        self.blocks.div_ceil(u64::from(self.region_blocks))
    }

    /// Pages of the region section.
    pub fn region_pages(&self) -> u64 {
        self.regions().div_ceil(PAGE_BITS).max(1)
    }

    /// Pages of the block section.
    pub fn block_pages(&self) -> u64 {
        self.blocks.div_ceil(PAGE_BITS).max(1)
    }

    /// File offset of page `page` of the region section.
    pub fn region_page_offset(&self, page: u64) -> u64 {
        (1 + page) * DIRTY_PAGE_BYTES as u64
    }

    /// File offset of page `page` of the block section.
    pub fn block_page_offset(&self, page: u64) -> u64 {
        (1 + self.region_pages() + page) * DIRTY_PAGE_BYTES as u64
    }

    /// Bytes of the whole file.
    pub fn file_bytes(&self) -> u64 {
        self.block_page_offset(self.block_pages())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; DIRTY_PAGE_BYTES];
        out[0..8].copy_from_slice(&DIRTY_MAGIC);
        put_u32(&mut out, 8, DIRTY_VERSION);
        out[12..14].copy_from_slice(&self.leg.to_le_bytes());
        out[16..32].copy_from_slice(&self.uuid);
        put_u64(&mut out, 32, self.blocks);
        put_u32(&mut out, 40, self.region_blocks);
        let crc = crc32c(&out[..CRC_AT]);
        put_u32(&mut out, CRC_AT, crc);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<DirtyHeader, FormatError> {
        if bytes.len() < DIRTY_PAGE_BYTES {
            return Err(FormatError::Truncated {
                need: DIRTY_PAGE_BYTES,
                have: bytes.len(),
            });
        }
        if bytes[0..8] != DIRTY_MAGIC {
            return Err(FormatError::BadMagic);
        }
        let version = get_u32(bytes, 8);
        if version != DIRTY_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        let stored = get_u32(bytes, CRC_AT);
        let computed = crc32c(&bytes[..CRC_AT]);
        if stored != computed {
            return Err(FormatError::BadChecksum { stored, computed });
        }
        if bytes[HEADER_USED..DIRTY_PAGE_BYTES].iter().any(|&b| b != 0) {
            return Err(FormatError::Geometry(
                "resync map header padding is not zero",
            ));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&bytes[16..32]);
        let header = DirtyHeader {
            leg: u16::from_le_bytes([bytes[12], bytes[13]]),
            uuid,
            blocks: get_u64(bytes, 32),
            region_blocks: get_u32(bytes, 40),
        };
        if header.region_blocks == 0 {
            return Err(FormatError::Geometry("resync map region_blocks is zero"));
        }
        Ok(header)
    }
}

/// A page's CRC: CRC-32C of its number (u64 LE) followed by its bits.
fn page_crc(number: u64, bits: &[u8]) -> u32 {
    let mut buffer = Vec::with_capacity(8 + PAGE_BITS_BYTES);
    buffer.extend_from_slice(&number.to_le_bytes());
    buffer.extend_from_slice(bits);
    crc32c(&buffer)
}

/// Encode page `number` (counted from the file's start, header = 0) from
/// its `PAGE_BITS_BYTES` bytes of bits.
pub fn encode_page(number: u64, bits: &[u8]) -> Vec<u8> {
    assert_eq!(bits.len(), PAGE_BITS_BYTES, "a page holds PAGE_BITS_BYTES");
    let mut out = Vec::with_capacity(DIRTY_PAGE_BYTES);
    out.extend_from_slice(bits);
    out.extend_from_slice(&page_crc(number, bits).to_le_bytes());
    out
}

/// The bits of page `number`, if its CRC holds.
pub fn decode_page(number: u64, page: &[u8]) -> Result<&[u8], FormatError> {
    if page.len() != DIRTY_PAGE_BYTES {
        return Err(FormatError::Truncated {
            need: DIRTY_PAGE_BYTES,
            have: page.len(),
        });
    }
    let bits = &page[..PAGE_BITS_BYTES];
    let stored = get_u32(page, PAGE_BITS_BYTES);
    let computed = page_crc(number, bits);
    if stored != computed {
        return Err(FormatError::BadChecksum { stored, computed });
    }
    Ok(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> DirtyHeader {
        DirtyHeader {
            leg: 1,
            uuid: [9; 16],
            blocks: 100_000,
            region_blocks: REGION_BLOCKS,
        }
    }

    #[test]
    fn a_header_round_trips_and_its_bytes_are_fixed() {
        let bytes = header().encode();
        assert_eq!(bytes.len(), 4096);
        assert_eq!(&bytes[0..8], b"VOUCHDTY");
        assert_eq!(bytes[12], 1);
        assert_eq!(get_u64(&bytes, 32), 100_000);
        assert_eq!(get_u32(&bytes, 40), 4096);
        assert_eq!(DirtyHeader::decode(&bytes).expect("decode"), header());
        assert!(crate::fields_tile(DirtyHeader::FIELDS, 64));
        // 25 regions fit one page; 100,000 bits need 4 pages.
        assert_eq!(header().region_pages(), 1);
        assert_eq!(header().block_pages(), 4);
        assert_eq!(header().block_page_offset(0), 2 * 4096);
        assert_eq!(header().file_bytes(), 6 * 4096);
    }

    #[test]
    fn damage_is_refused_by_name() {
        let bytes = header().encode();
        let mut flipped = bytes.clone();
        flipped[33] ^= 1;
        assert!(matches!(
            DirtyHeader::decode(&flipped),
            Err(FormatError::BadChecksum { .. })
        ));
        assert!(matches!(
            DirtyHeader::decode(&bytes[..100]),
            Err(FormatError::Truncated { .. })
        ));
        let mut magic = bytes.clone();
        magic[0] = b'X';
        assert_eq!(DirtyHeader::decode(&magic), Err(FormatError::BadMagic));
        let bits = vec![0xA5u8; PAGE_BITS_BYTES];
        let page = encode_page(3, &bits);
        assert_eq!(decode_page(3, &page).expect("page"), &bits[..]);
        assert!(
            decode_page(4, &page).is_err(),
            "a page at the wrong place is refused"
        );
        let mut torn = page.clone();
        torn[10] ^= 0x10;
        assert!(matches!(
            decode_page(3, &torn),
            Err(FormatError::BadChecksum { .. })
        ));
    }
}
