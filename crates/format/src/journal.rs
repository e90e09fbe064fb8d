//! The context journal: one record per commit.
//!
//! A record is 4 KiB-aligned: a 64-byte header, `entry_count` entries of
//! 48 bytes (first LBA, block count, new context), zero padding to the next
//! 4 KiB, then `data_blocks` 4 KiB data blocks: in the packed layout, one per
//! `Data` entry, in entry order (the journal is a redo log there). An entry
//! with a count above 1 is a range (trim / write-zeroes): its context is the
//! template of the first block; each block's own carries its own LBA. `payload_crc` covers everything after the header, so a
//! torn record is recognised and ignored (its commit never reached the data).

use crate::bytes::{get_u32, get_u64, put_u32, put_u64};
use crate::{crc32c, Context, Field, FormatError, BLOCK_SIZE, CONTEXT_BYTES};

pub const JOURNAL_MAGIC: [u8; 8] = *b"VOUCHJNL";
pub const JOURNAL_HEADER_BYTES: usize = 64;
pub const JOURNAL_ENTRY_BYTES: usize = 16 + CONTEXT_BYTES;
/// Records start and end on this boundary.
pub const JOURNAL_ALIGN: u64 = BLOCK_SIZE as u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JournalHeader {
    pub seq: u64,
    pub volume_uuid: [u8; 16],
    pub entry_count: u32,
    /// Length of the whole record in 4 KiB blocks.
    pub record_blocks: u32,
    pub flags: u32,
    /// 4 KiB data blocks after the entry area.
    pub data_blocks: u32,
    /// Every commit with seq <= this had its data made durable before this
    /// record was written: recovery need only verify commits after it.
    pub data_durable_seq: u64,
    pub payload_crc: u32,
}

impl JournalHeader {
    /// The record carries a copy of each entry's data block (packed layout).
    pub const FLAG_HAS_DATA: u32 = 1 << 0;

    pub const FIELDS: &'static [Field] = &[
        Field {
            name: "magic",
            offset: 0,
            size: 8,
        },
        Field {
            name: "seq",
            offset: 8,
            size: 8,
        },
        Field {
            name: "volume_uuid",
            offset: 16,
            size: 16,
        },
        Field {
            name: "entry_count",
            offset: 32,
            size: 4,
        },
        Field {
            name: "record_blocks",
            offset: 36,
            size: 4,
        },
        Field {
            name: "flags",
            offset: 40,
            size: 4,
        },
        Field {
            name: "data_blocks",
            offset: 44,
            size: 4,
        },
        Field {
            name: "data_durable_seq",
            offset: 48,
            size: 8,
        },
        Field {
            name: "payload_crc",
            offset: 56,
            size: 4,
        },
        Field {
            name: "header_crc",
            offset: 60,
            size: 4,
        },
    ];

    pub fn has_data(&self) -> bool {
        self.flags & Self::FLAG_HAS_DATA != 0
    }

    /// Bytes of the entry area, padded to the 4 KiB boundary.
    pub fn entries_area_bytes(entry_count: u32) -> u64 {
        let raw = JOURNAL_HEADER_BYTES as u64 + u64::from(entry_count) * JOURNAL_ENTRY_BYTES as u64;
        raw.div_ceil(JOURNAL_ALIGN) * JOURNAL_ALIGN
    }

    /// Total record length.
    pub fn record_bytes(entry_count: u32, data_blocks: u32) -> u64 {
        Self::entries_area_bytes(entry_count) + u64::from(data_blocks) * u64::from(BLOCK_SIZE)
    }

    pub fn encode(&self) -> [u8; JOURNAL_HEADER_BYTES] {
        let mut out = [0u8; JOURNAL_HEADER_BYTES];
        out[0..8].copy_from_slice(&JOURNAL_MAGIC);
        put_u64(&mut out, 8, self.seq);
        out[16..32].copy_from_slice(&self.volume_uuid);
        put_u32(&mut out, 32, self.entry_count);
        put_u32(&mut out, 36, self.record_blocks);
        put_u32(&mut out, 40, self.flags);
        put_u32(&mut out, 44, self.data_blocks);
        put_u64(&mut out, 48, self.data_durable_seq);
        put_u32(&mut out, 56, self.payload_crc);
        crate::seal(&mut out, 60);
        out
    }

    pub fn decode(raw: &[u8]) -> Result<JournalHeader, FormatError> {
        crate::check_sealed(raw, JOURNAL_HEADER_BYTES, &JOURNAL_MAGIC, 60)?;
        let mut volume_uuid = [0u8; 16];
        volume_uuid.copy_from_slice(&raw[16..32]);
        let header = JournalHeader {
            seq: get_u64(raw, 8),
            volume_uuid,
            entry_count: get_u32(raw, 32),
            record_blocks: get_u32(raw, 36),
            flags: get_u32(raw, 40),
            data_blocks: get_u32(raw, 44),
            data_durable_seq: get_u64(raw, 48),
            payload_crc: get_u32(raw, 56),
        };
        if header.data_blocks > header.entry_count || (header.data_blocks > 0 && !header.has_data())
        {
            return Err(FormatError::Geometry(
                "journal record has more data blocks than entries",
            ));
        }
        let expected = Self::record_bytes(header.entry_count, header.data_blocks);
        if u64::from(header.record_blocks) * JOURNAL_ALIGN != expected {
            return Err(FormatError::Geometry(
                "journal record length disagrees with its entry count",
            ));
        }
        Ok(header)
    }
}

/// One journal entry: the new context of `count` blocks from `lba` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JournalEntry {
    pub lba: u64,
    pub count: u32,
    pub context: Context,
}

impl JournalEntry {
    pub const FIELDS: &'static [Field] = &[
        Field {
            name: "lba",
            offset: 0,
            size: 8,
        },
        Field {
            name: "count",
            offset: 8,
            size: 4,
        },
        Field {
            name: "reserved",
            offset: 12,
            size: 4,
        },
        Field {
            name: "context",
            offset: 16,
            size: CONTEXT_BYTES,
        },
    ];

    pub fn encode_into(&self, out: &mut [u8]) {
        put_u64(out, 0, self.lba);
        put_u32(out, 8, self.count);
        put_u32(out, 12, 0);
        out[16..16 + CONTEXT_BYTES].copy_from_slice(&self.context.encode());
    }

    pub fn decode(raw: &[u8]) -> Result<JournalEntry, FormatError> {
        if raw.len() < JOURNAL_ENTRY_BYTES {
            return Err(FormatError::Truncated {
                need: JOURNAL_ENTRY_BYTES,
                have: raw.len(),
            });
        }
        let count = get_u32(raw, 8);
        let context = Context::decode(&raw[16..])?;
        if count == 0
            || (count > 1 && matches!(context, Context::Data { .. } | Context::Encrypted { .. }))
        {
            return Err(FormatError::Geometry(
                "journal entry count must be 1 for data blocks",
            ));
        }
        Ok(JournalEntry {
            lba: get_u64(raw, 0),
            count,
            context,
        })
    }
}

/// Build a complete record (header, entries, padding, optional data).
/// `data` holds one 4 KiB block per `Data` entry, in entry order.
pub fn encode_record(
    seq: u64,
    volume_uuid: [u8; 16],
    data_durable_seq: u64,
    entries: &[JournalEntry],
    data: Option<&[&[u8]]>,
) -> Vec<u8> {
    let mut record = encode_record_head(seq, volume_uuid, data_durable_seq, entries, data);
    record.reserve_exact(data.map_or(0, |blocks| blocks.len() * BLOCK_SIZE as usize));
    for block in data.into_iter().flatten() {
        record.extend_from_slice(block);
    }
    record
}

/// The record `encode_record` builds, up to its data: header, entries and
/// padding (`JournalHeader::entries_area_bytes`), with the payload CRC
/// already taken over `data` too. The record is this followed by `data`'s
/// blocks in order, so a writer can write them from where they are (one
/// vectored write) instead of copying a large record together first.
pub fn encode_record_head(
    seq: u64,
    volume_uuid: [u8; 16],
    data_durable_seq: u64,
    entries: &[JournalEntry],
    data: Option<&[&[u8]]>,
) -> Vec<u8> {
    let count = u32::try_from(entries.len()).expect("journal record entry count fits u32");
    let data_blocks = data.map_or(0, |blocks| blocks.len() as u32);
    let total = JournalHeader::record_bytes(count, data_blocks);
    let mut head = vec![0u8; JournalHeader::entries_area_bytes(count) as usize];
    for (index, entry) in entries.iter().enumerate() {
        let at = JOURNAL_HEADER_BYTES + index * JOURNAL_ENTRY_BYTES;
        entry.encode_into(&mut head[at..at + JOURNAL_ENTRY_BYTES]);
    }
    if let Some(blocks) = data {
        let data_entries = entries
            .iter()
            .filter(|entry| entry.context.carries_data())
            .count();
        assert_eq!(
            blocks.len(),
            data_entries,
            "one data block per Data journal entry"
        );
        assert!(
            blocks
                .iter()
                .all(|block| block.len() == BLOCK_SIZE as usize),
            "journal data is whole blocks"
        );
    }
    let payload_crc = crate::guard::crc32c_parts(
        std::iter::once(&head[JOURNAL_HEADER_BYTES..]).chain(data.into_iter().flatten().copied()),
    );
    let header = JournalHeader {
        seq,
        volume_uuid,
        entry_count: count,
        record_blocks: (total / JOURNAL_ALIGN) as u32,
        flags: if data.is_some() {
            JournalHeader::FLAG_HAS_DATA
        } else {
            0
        },
        data_blocks,
        data_durable_seq,
        payload_crc,
    };
    head[..JOURNAL_HEADER_BYTES].copy_from_slice(&header.encode());
    head
}

/// Decode a complete record's entries after checking its payload CRC.
pub fn decode_entries(
    header: &JournalHeader,
    record: &[u8],
) -> Result<Vec<JournalEntry>, FormatError> {
    let total = header.record_blocks as usize * JOURNAL_ALIGN as usize;
    if record.len() < total {
        return Err(FormatError::Truncated {
            need: total,
            have: record.len(),
        });
    }
    let stored = header.payload_crc;
    let computed = crc32c(&record[JOURNAL_HEADER_BYTES..total]);
    if stored != computed {
        return Err(FormatError::BadChecksum { stored, computed });
    }
    (0..header.entry_count as usize)
        .map(|index| {
            let at = JOURNAL_HEADER_BYTES + index * JOURNAL_ENTRY_BYTES;
            JournalEntry::decode(&record[at..at + JOURNAL_ENTRY_BYTES])
        })
        .collect()
}

/// The `index`-th data block inside a `HAS_DATA` record.
pub fn record_data<'a>(header: &JournalHeader, record: &'a [u8], index: usize) -> &'a [u8] {
    assert!(
        index < header.data_blocks as usize,
        "data block {index} past the record's {}",
        header.data_blocks
    );
    let at = JournalHeader::entries_area_bytes(header.entry_count) as usize
        + index * BLOCK_SIZE as usize;
    &record[at..at + BLOCK_SIZE as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_tile() {
        assert!(crate::fields_tile(
            JournalHeader::FIELDS,
            JOURNAL_HEADER_BYTES
        ));
        assert!(crate::fields_tile(
            JournalEntry::FIELDS,
            JOURNAL_ENTRY_BYTES
        ));
    }

    #[test]
    fn record_round_trip_with_and_without_data() {
        let entries: Vec<JournalEntry> = (0..150)
            .map(|lba| JournalEntry {
                lba,
                count: 1,
                context: Context::Data {
                    volume_tag: 5,
                    ref_tag: lba,
                    guard: lba * 3,
                    generation: 1,
                },
            })
            .collect();
        let block = vec![0x5Au8; 4096];
        let blocks: Vec<&[u8]> = entries.iter().map(|_| block.as_slice()).collect();
        for data in [None, Some(blocks.as_slice())] {
            let record = encode_record(42, [7; 16], 41, &entries, data);
            assert_eq!(record.len() % 4096, 0);
            let header = JournalHeader::decode(&record).unwrap();
            assert_eq!(header.seq, 42);
            assert_eq!(header.data_durable_seq, 41);
            assert_eq!(decode_entries(&header, &record).unwrap(), entries);
            if data.is_some() {
                assert_eq!(record_data(&header, &record, 149), block.as_slice());
            }
            let mut torn = record.clone();
            let last = torn.len() - 1;
            torn[last] ^= 1;
            assert!(decode_entries(&header, &torn).is_err());
        }
    }

    #[test]
    fn golden_header() {
        let record = encode_record(1, [0xAB; 16], 0, &[], None);
        assert_eq!(record.len(), 4096);
        assert_eq!(&record[0..8], b"VOUCHJNL");
        assert_eq!(
            get_u32(&record, 60),
            0xf3b1646d,
            "journal header encoding changed"
        );
    }
}
