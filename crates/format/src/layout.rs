//! Where blocks and contexts live inside a volume directory.
//!
//! A volume is a directory of files (see `docs/FORMAT.md` for why):
//! `superblock`, `journal`, `contexts` (split layout only) and data segments
//! `data.00000`, `data.00001`, ... each holding `segment_blocks` blocks.
//!
//! - `split`: segment byte offset of a block = slot * 4096; its context is at
//!   LBA * 32 in `contexts`, apart from the data (DIX-style).
//! - `packed`: a segment is made of 128 KiB rows; each row holds 31 records of
//!   4096 data bytes followed by their 32-byte context (4128 bytes), then
//!   3104 bytes of padding, so a record never straddles a row and one read
//!   returns data and context together (Crucible RFD 490).

use crate::{FormatError, BLOCK_SIZE, CONTEXT_BYTES};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum LayoutKind {
    Split = 0,
    Packed = 1,
}

impl LayoutKind {
    pub const ALL: [LayoutKind; 2] = [LayoutKind::Split, LayoutKind::Packed];

    pub fn from_byte(byte: u8) -> Result<LayoutKind, FormatError> {
        match byte {
            0 => Ok(LayoutKind::Split),
            1 => Ok(LayoutKind::Packed),
            other => Err(FormatError::UnknownLayout(other)),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            LayoutKind::Split => "split",
            LayoutKind::Packed => "packed",
        }
    }
    pub fn from_name(name: &str) -> Option<LayoutKind> {
        LayoutKind::ALL
            .into_iter()
            .find(|layout| layout.name() == name)
    }
}

/// Bytes in one packed row (a ZFS default recordsize: one record never
/// crosses it).
pub const PACKED_ROW_BYTES: u64 = 128 * 1024;
/// Bytes of one packed record: data then context.
pub const PACKED_RECORD_BYTES: u64 = BLOCK_SIZE as u64 + CONTEXT_BYTES as u64;
/// Records in one packed row.
pub const PACKED_RECORDS_PER_ROW: u64 = PACKED_ROW_BYTES / PACKED_RECORD_BYTES;

/// Default blocks per data segment: 1 TiB of split data (2^28 blocks), or the
/// largest whole number of packed rows within 1 TiB of file.
pub fn default_segment_blocks(layout: LayoutKind) -> u64 {
    match layout {
        LayoutKind::Split => 1 << 28,
        LayoutKind::Packed => ((1u64 << 40) / PACKED_ROW_BYTES) * PACKED_RECORDS_PER_ROW,
    }
}

/// Where a block's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockLocation {
    pub segment: u32,
    /// Byte offset of the block's data inside its segment file.
    pub data_offset: u64,
}

/// The volume's shape, derived from the superblock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub layout: LayoutKind,
    pub size_bytes: u64,
    pub blocks: u64,
    pub segment_blocks: u64,
}

impl Geometry {
    pub fn new(
        layout: LayoutKind,
        size_bytes: u64,
        segment_blocks: u64,
    ) -> Result<Geometry, FormatError> {
        let block = u64::from(BLOCK_SIZE);
        if size_bytes == 0 || !size_bytes.is_multiple_of(block) {
            return Err(FormatError::Geometry(
                "size must be a non-zero multiple of 4096",
            ));
        }
        if segment_blocks == 0 {
            return Err(FormatError::Geometry("segment_blocks must be non-zero"));
        }
        if layout == LayoutKind::Packed && !segment_blocks.is_multiple_of(PACKED_RECORDS_PER_ROW) {
            return Err(FormatError::Geometry(
                "packed segment_blocks must be whole rows",
            ));
        }
        let blocks = size_bytes / block;
        if blocks.div_ceil(segment_blocks) > u64::from(u32::MAX) {
            return Err(FormatError::Geometry("too many segments"));
        }
        Ok(Geometry {
            layout,
            size_bytes,
            blocks,
            segment_blocks,
        })
    }

    pub fn segments(&self) -> u32 {
        self.blocks.div_ceil(self.segment_blocks) as u32
    }

    pub fn locate(&self, lba: u64) -> BlockLocation {
        assert!(
            lba < self.blocks,
            "LBA {lba} past the volume's {} blocks",
            self.blocks
        );
        let segment = (lba / self.segment_blocks) as u32;
        let slot = lba % self.segment_blocks;
        let data_offset = match self.layout {
            LayoutKind::Split => slot * u64::from(BLOCK_SIZE),
            LayoutKind::Packed => {
                (slot / PACKED_RECORDS_PER_ROW) * PACKED_ROW_BYTES
                    + (slot % PACKED_RECORDS_PER_ROW) * PACKED_RECORD_BYTES
            }
        };
        BlockLocation {
            segment,
            data_offset,
        }
    }

    /// Byte offset of a block's context in the `contexts` file (split only).
    pub fn context_offset(&self, lba: u64) -> u64 {
        lba * CONTEXT_BYTES as u64
    }

    /// Nominal byte length of a segment file (sparse).
    pub fn segment_len(&self, segment: u32) -> u64 {
        let first = u64::from(segment) * self.segment_blocks;
        let blocks = (self.blocks - first).min(self.segment_blocks);
        match self.layout {
            LayoutKind::Split => blocks * u64::from(BLOCK_SIZE),
            LayoutKind::Packed => blocks.div_ceil(PACKED_RECORDS_PER_ROW) * PACKED_ROW_BYTES,
        }
    }

    /// Does this layout keep contexts in a separate context table object
    /// (split), rather than beside each block (packed)?
    pub fn has_context_table(&self) -> bool {
        self.layout == LayoutKind::Split
    }

    pub fn contexts_len(&self) -> u64 {
        self.blocks * CONTEXT_BYTES as u64
    }

    /// True when LBA `next` directly follows `lba` on disk in one segment
    /// (so both can be moved by one positioned I/O).
    pub fn contiguous(&self, lba: u64, next: u64) -> bool {
        next == lba + 1 && lba / self.segment_blocks == next / self.segment_blocks
    }

    /// File name of a data segment.
    pub fn segment_name(segment: u32) -> String {
        format!("data.{segment:05}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_rows_hold_31_records() {
        assert_eq!(PACKED_RECORDS_PER_ROW, 31);
        assert_eq!(
            PACKED_ROW_BYTES - PACKED_RECORDS_PER_ROW * PACKED_RECORD_BYTES,
            3104
        );
    }

    #[test]
    fn locations() {
        let split = Geometry::new(
            LayoutKind::Split,
            16 << 40,
            default_segment_blocks(LayoutKind::Split),
        )
        .unwrap();
        assert_eq!(split.segments(), 16);
        assert_eq!(
            split.locate(5),
            BlockLocation {
                segment: 0,
                data_offset: 5 * 4096
            }
        );
        assert_eq!(
            split.locate((1 << 28) + 1),
            BlockLocation {
                segment: 1,
                data_offset: 4096
            }
        );
        let packed = Geometry::new(LayoutKind::Packed, 1 << 30, 31 * 4).unwrap();
        assert_eq!(
            packed.locate(32),
            BlockLocation {
                segment: 0,
                data_offset: 131072 + 4128
            }
        );
        assert_eq!(
            packed.locate(124),
            BlockLocation {
                segment: 1,
                data_offset: 0
            }
        );
        assert_eq!(packed.segment_len(0), 4 * 131072);
        assert!(packed.contiguous(0, 1));
        assert!(!packed.contiguous(123, 124));
        assert!(Geometry::new(LayoutKind::Packed, 1 << 30, 100).is_err());
        assert!(Geometry::new(LayoutKind::Split, 1000, 100).is_err());
    }
}
