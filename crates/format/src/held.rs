//! The held log (`<runtime dir>/vouch-<dev>-<ino>.held0` and `.held1`, in
//! memory that outlives the process: tmpfs): every write a volume
//! acknowledges before its commit, as the bytes and context it will be
//! stored with, so a crash of the vouch process (the kernel stays up)
//! loses nothing it acknowledged. Two slots, one per write-back buffer:
//! the buffer being filled logs into one while the other's commit runs.
//!
//! A slot is a 4096-byte header page, then records back to back. Its
//! `epoch` grows each time the slot is emptied (after its buffer's
//! commit); a record counts only if it carries its slot's epoch, so the
//! records of an emptied slot are dead without being erased. A record's
//! header is written first, when its place is taken (headers are back to
//! back, one writer at a time); its body is copied after, by its writer
//! alone and beside other writers' copies, and its `done` word is set
//! last, before the write is acknowledged. After a process crash a slot
//! holds a run of headers, each record whole and done or skipped (never
//! acknowledged), ended by one that is not there. `boot_id` ties the slot to
//! the running kernel: a slot from an earlier boot is not read at all (a
//! power cut keeps only what was flushed, and a flush commits).
//!
//! A record: a 64-byte header, `count` entries of 40 bytes (an LBA and the
//! 32-byte context the block is sealed with), then `count` blocks of 4096
//! bytes (as stored: ciphertext on an encrypted volume). Each block is
//! verified against its context when the log is replayed. A *landed*
//! record (flags 2) has no blocks of its own: they are where the write's
//! payload was received, `count` blocks at byte `first` of the landing
//! file (`PREFIX.landing`, beside the slots, the same kind of memory). A *drop* record
//! (`count` 0, flags 1) says the blocks `[first, first + blocks)` logged
//! before it were superseded (a reflink copy landed over them).

use crate::bytes::{get_u32, get_u64, put_u32, put_u64};
use crate::{check_sealed, crc32c, Field, FormatError, CONTEXT_BYTES};

pub const HELD_MAGIC: [u8; 8] = *b"VOUCHHLD";
pub const RECORD_MAGIC: [u8; 8] = *b"VOUCHHRC";
pub const HELD_VERSION: u32 = 3;
/// Version 2 had no landed records (`FLAG_LANDED`); otherwise the same.
/// Still read. (An older binary refuses a version 3 slot, and with it the
/// open, rather than misread a landed record.)
pub const HELD_VERSION_NOT_LANDED: u32 = 2;
/// Version 1 wrote each body before its header and had no `done` word: a
/// record whose header is there is whole. Still read, so a crash of an
/// older binary loses nothing to the newer one that opens its slots.
pub const HELD_VERSION_BODY_FIRST: u32 = 1;
/// The slot header's page; records start after it.
pub const HELD_HEADER_BYTES: u64 = 4096;
pub const RECORD_HEADER_BYTES: usize = 64;
/// An entry: LBA (8) + context (32).
pub const ENTRY_BYTES: usize = 8 + CONTEXT_BYTES;
const CRC_AT: usize = 60;
const USED: usize = 64;

/// A record that marks earlier blocks of a range superseded.
pub const FLAG_DROP: u32 = 1;
/// A record whose blocks are in the landing file at byte `first`.
pub const FLAG_LANDED: u32 = 2;
/// Where a record header's `done` word is: 8-byte aligned (records are
/// multiples of 8 bytes after a 4096-byte page), outside the CRC, so it is
/// set by one aligned store after the body is in place.
pub const DONE_AT: usize = 48;

/// The `done` word of a finished record of `epoch`: bound to the epoch, so
/// a word a dead record of an earlier epoch left at the same place never
/// passes for it.
pub fn done_word(epoch: u64) -> u64 {
    epoch ^ 0x444f_4e45_5643_4844 // "DONEVCHD"
}

/// Where a slot's header page keeps the slot file's length as it stood
/// after the slot last grew (`SizedWord`): bytes 64-79, outside the
/// header's CRC (rewritten on its own when the slot grows). A slot file
/// shorter than that was cut, wherever the cut fell, even exactly at the
/// end of a record, where its records alone cannot tell.
pub const SIZED_AT: usize = 64;
pub const SIZED_BYTES: usize = 16;
const SIZED_KEY: u64 = 0x5349_5a45_4456_4348; // "SIZEDVCH"

/// A slot file's length as recorded in its header page: `length` then
/// `length XOR 0x5349_5A45_4456_4348`, so zeros or stray bytes read as no
/// record at all (never as a length that would refuse the open).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizedWord {
    pub length: u64,
}

impl SizedWord {
    pub const FIELDS: &'static [Field] = &[
        Field {
            name: "sized",
            offset: 0,
            size: 8,
        },
        Field {
            name: "sized_check",
            offset: 8,
            size: 8,
        },
    ];

    pub fn encode(&self) -> [u8; SIZED_BYTES] {
        let mut out = [0u8; SIZED_BYTES];
        put_u64(&mut out, 0, self.length);
        put_u64(&mut out, 8, self.length ^ SIZED_KEY);
        out
    }

    /// The recorded length, if `raw` (at least `SIZED_BYTES`) holds one.
    pub fn decode(raw: &[u8]) -> Option<SizedWord> {
        if raw.len() < SIZED_BYTES {
            return None;
        }
        let length = get_u64(raw, 0);
        (get_u64(raw, 8) == length ^ SIZED_KEY).then_some(SizedWord { length })
    }
}

/// A slot's header (the first 64 bytes of its page; the rest is zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldHeader {
    /// Which slot (0 or 1) this file is.
    pub slot: u32,
    /// The volume's uuid.
    pub uuid: [u8; 16],
    /// The kernel boot the slot was written under (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: [u8; 16],
    /// Records with this epoch are live; it grows at every emptying.
    pub epoch: u64,
    /// `HELD_VERSION`, or `HELD_VERSION_BODY_FIRST` for a slot an older
    /// binary wrote (decode only; `encode` writes `HELD_VERSION`).
    pub version: u32,
}

impl HeldHeader {
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
            name: "slot",
            offset: 12,
            size: 4,
        },
        Field {
            name: "uuid",
            offset: 16,
            size: 16,
        },
        Field {
            name: "boot_id",
            offset: 32,
            size: 16,
        },
        Field {
            name: "epoch",
            offset: 48,
            size: 8,
        },
        Field {
            name: "reserved",
            offset: 56,
            size: 4,
        },
        Field {
            name: "crc",
            offset: 60,
            size: 4,
        },
    ];

    /// The header page.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; HELD_HEADER_BYTES as usize];
        out[0..8].copy_from_slice(&HELD_MAGIC);
        put_u32(&mut out, 8, HELD_VERSION);
        debug_assert_eq!(
            self.version, HELD_VERSION,
            "only the current version is written"
        );
        put_u32(&mut out, 12, self.slot);
        out[16..32].copy_from_slice(&self.uuid);
        out[32..48].copy_from_slice(&self.boot_id);
        put_u64(&mut out, 48, self.epoch);
        crate::seal(&mut out, CRC_AT);
        out
    }

    pub fn decode(raw: &[u8]) -> Result<HeldHeader, FormatError> {
        check_sealed(raw, USED, &HELD_MAGIC, CRC_AT)?;
        let version = get_u32(raw, 8);
        if !matches!(
            version,
            HELD_VERSION | HELD_VERSION_NOT_LANDED | HELD_VERSION_BODY_FIRST
        ) {
            return Err(FormatError::UnsupportedVersion(version));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&raw[16..32]);
        let mut boot_id = [0u8; 16];
        boot_id.copy_from_slice(&raw[32..48]);
        Ok(HeldHeader {
            slot: get_u32(raw, 12),
            uuid,
            boot_id,
            epoch: get_u64(raw, 48),
            version,
        })
    }
}

/// A record's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    /// The slot's epoch when the record was written.
    pub epoch: u64,
    /// Blocks in the record (0 for a drop record).
    pub count: u32,
    /// `FLAG_DROP`, `FLAG_LANDED`, or 0.
    pub flags: u32,
    /// CRC-32C of the entries.
    pub entries_crc: u32,
    /// Drop records: the first LBA and the number of blocks dropped.
    /// Landed records: the blocks' byte offset in the landing file.
    pub first: u64,
    pub blocks: u64,
}

impl RecordHeader {
    pub const FIELDS: &'static [Field] = &[
        Field {
            name: "magic",
            offset: 0,
            size: 8,
        },
        Field {
            name: "epoch",
            offset: 8,
            size: 8,
        },
        Field {
            name: "count",
            offset: 16,
            size: 4,
        },
        Field {
            name: "flags",
            offset: 20,
            size: 4,
        },
        Field {
            name: "entries_crc",
            offset: 24,
            size: 4,
        },
        Field {
            name: "reserved",
            offset: 28,
            size: 4,
        },
        Field {
            name: "first",
            offset: 32,
            size: 8,
        },
        Field {
            name: "blocks",
            offset: 40,
            size: 8,
        },
        Field {
            name: "done",
            offset: 48,
            size: 8,
        },
        Field {
            name: "reserved2",
            offset: 56,
            size: 4,
        },
        Field {
            name: "crc",
            offset: 60,
            size: 4,
        },
    ];

    pub fn encode(&self) -> [u8; RECORD_HEADER_BYTES] {
        let mut out = [0u8; RECORD_HEADER_BYTES];
        out[0..8].copy_from_slice(&RECORD_MAGIC);
        put_u64(&mut out, 8, self.epoch);
        put_u32(&mut out, 16, self.count);
        put_u32(&mut out, 20, self.flags);
        put_u32(&mut out, 24, self.entries_crc);
        put_u64(&mut out, 32, self.first);
        put_u64(&mut out, 40, self.blocks);
        crate::seal(&mut out, CRC_AT);
        out
    }

    /// The header as written when its place is taken, `done` 0 (the CRC
    /// reads `done` as 0 whatever it holds).
    pub fn decode(raw: &[u8]) -> Result<RecordHeader, FormatError> {
        if raw.len() < RECORD_HEADER_BYTES {
            return Err(FormatError::Truncated {
                need: RECORD_HEADER_BYTES,
                have: raw.len(),
            });
        }
        let mut copy: [u8; RECORD_HEADER_BYTES] = raw[..RECORD_HEADER_BYTES]
            .try_into()
            .expect("the length was checked");
        copy[DONE_AT..DONE_AT + 8].fill(0);
        check_sealed(&copy, RECORD_HEADER_BYTES, &RECORD_MAGIC, CRC_AT)?;
        Ok(RecordHeader {
            epoch: get_u64(raw, 8),
            count: get_u32(raw, 16),
            flags: get_u32(raw, 20),
            entries_crc: get_u32(raw, 24),
            first: get_u64(raw, 32),
            blocks: get_u64(raw, 40),
        })
    }

    /// Whether the record whose raw header is `raw` was finished (its
    /// `done` word set for its epoch).
    pub fn is_done(&self, raw: &[u8]) -> bool {
        get_u64(raw, DONE_AT) == done_word(self.epoch)
    }

    /// Bytes the record takes, header included.
    pub fn record_bytes(&self) -> u64 {
        let block_bytes = if self.flags & FLAG_LANDED != 0 {
            0
        } else {
            4096
        };
        RECORD_HEADER_BYTES as u64 + self.count as u64 * (ENTRY_BYTES as u64 + block_bytes)
    }
}

/// Encode one entry (an LBA and its raw context) into `out`, which is
/// `ENTRY_BYTES` long.
pub fn encode_entry(out: &mut [u8], lba: u64, context: &[u8; CONTEXT_BYTES]) {
    out[..8].copy_from_slice(&lba.to_le_bytes());
    out[8..ENTRY_BYTES].copy_from_slice(context);
}

/// The LBA and raw context of entry `index` of `entries`.
pub fn decode_entry(entries: &[u8], index: usize) -> (u64, &[u8]) {
    let at = index * ENTRY_BYTES;
    (get_u64(entries, at), &entries[at + 8..at + ENTRY_BYTES])
}

/// CRC-32C of a record's entries.
pub fn entries_crc(entries: &[u8]) -> u32 {
    crc32c(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_tile_their_structures() {
        assert!(crate::fields_tile(HeldHeader::FIELDS, USED));
        assert!(crate::fields_tile(SizedWord::FIELDS, SIZED_BYTES));
        assert!(crate::fields_tile(
            RecordHeader::FIELDS,
            RECORD_HEADER_BYTES
        ));
    }

    #[test]
    fn a_sized_word_round_trips_and_zeros_are_none() {
        let word = SizedWord { length: 8 << 20 };
        assert_eq!(SizedWord::decode(&word.encode()), Some(word));
        assert_eq!(SizedWord::decode(&[0u8; SIZED_BYTES]), None);
        let mut raw = word.encode();
        raw[3] ^= 1;
        assert_eq!(SizedWord::decode(&raw), None, "a changed length");
        assert_eq!(SizedWord::decode(&raw[..8]), None, "too short");
    }

    #[test]
    fn headers_round_trip_and_refuse_damage() {
        let header = HeldHeader {
            slot: 1,
            uuid: [7; 16],
            boot_id: [9; 16],
            epoch: 42,
            version: HELD_VERSION,
        };
        let mut raw = header.encode();
        assert_eq!(HeldHeader::decode(&raw), Ok(header));
        raw[50] ^= 1;
        assert!(matches!(
            HeldHeader::decode(&raw),
            Err(FormatError::BadChecksum { .. })
        ));
        let record = RecordHeader {
            epoch: 3,
            count: 2,
            flags: 0,
            entries_crc: 99,
            first: 0,
            blocks: 0,
        };
        let mut raw = record.encode();
        assert_eq!(RecordHeader::decode(&raw), Ok(record));
        assert!(!record.is_done(&raw));
        raw[DONE_AT..DONE_AT + 8].copy_from_slice(&done_word(3).to_le_bytes());
        assert_eq!(
            RecordHeader::decode(&raw),
            Ok(record),
            "done is outside the CRC"
        );
        assert!(record.is_done(&raw));
        raw[DONE_AT..DONE_AT + 8].copy_from_slice(&done_word(2).to_le_bytes());
        assert!(!record.is_done(&raw), "an earlier epoch's done word");
        assert_eq!(record.record_bytes(), 64 + 2 * (40 + 4096));
        raw[0] = b'X';
        assert_eq!(RecordHeader::decode(&raw), Err(FormatError::BadMagic));
        assert!(RecordHeader::decode(&[0u8; 10]).is_err());
    }
}
