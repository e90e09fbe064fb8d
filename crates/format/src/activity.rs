//! The activity log (`mirror.active`, in the directory of each active
//! local leg of a mirror): the extents of the volume that may be written
//! now, durable before a write to them reaches any leg (DRBD's activity
//! log, md's write-intent bitmap). After an unclean stop the legs may
//! differ only inside the logged extents, so only those are reconciled.
//!
//! The file holds two copies of `ACTIVITY_COPY_BYTES`: a 64-byte header,
//! then `count` extent numbers (u64 LE), then zeros. An update writes
//! copy `seq % 2` with `seq` one higher than the last and fsyncs it, so a
//! torn update leaves the previous copy; the valid copy (magic, version,
//! header CRC, extents CRC, this volume's uuid and size) with the higher
//! `seq` is the log.

use crate::bytes::{get_u32, get_u64, put_u32, put_u64};
use crate::{crc32c, Field, FormatError};

pub const ACTIVITY_MAGIC: [u8; 8] = *b"VOUCHACT";
pub const ACTIVITY_VERSION: u32 = 1;
/// Bytes of one copy (two copies make the file).
pub const ACTIVITY_COPY_BYTES: usize = 16384;
/// Extents one copy can name.
pub const ACTIVITY_MAX_EXTENTS: usize = (ACTIVITY_COPY_BYTES - HEADER_USED) / 8;
const CRC_AT: usize = 60;
const HEADER_USED: usize = 64;

/// One decoded copy of the activity log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActivityLog {
    /// The volume's uuid (a log of another volume is refused).
    pub uuid: [u8; 16],
    /// Grows by one at every update; the valid copy with the higher wins.
    pub seq: u64,
    /// Blocks of the volume.
    pub blocks: u64,
    /// Blocks per extent.
    pub extent_blocks: u32,
    /// The extents that may hold writes not known to be on every leg.
    pub extents: Vec<u64>,
}

impl ActivityLog {
    /// Byte table of a copy's first 64 bytes (the extents follow).
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
            name: "count",
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
            name: "blocks",
            offset: 40,
            size: 8,
        },
        Field {
            name: "extent_blocks",
            offset: 48,
            size: 4,
        },
        Field {
            name: "extents_crc",
            offset: 52,
            size: 4,
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

    /// File offset of the copy that holds `seq`.
    pub fn copy_offset(seq: u64) -> u64 {
        (seq % 2) * ACTIVITY_COPY_BYTES as u64
    }

    /// Bytes of a copy naming `count` extents that an update must write:
    /// the header and the extents, in whole 4096-byte pages (what follows
    /// in the copy's place is never read).
    pub fn used_bytes(count: usize) -> usize {
        (HEADER_USED + count * 8).next_multiple_of(4096)
    }

    /// One copy's bytes. Fails if it names more than `ACTIVITY_MAX_EXTENTS`.
    pub fn encode(&self) -> Result<Vec<u8>, FormatError> {
        if self.extents.len() > ACTIVITY_MAX_EXTENTS {
            return Err(FormatError::Truncated {
                need: HEADER_USED + self.extents.len() * 8,
                have: ACTIVITY_COPY_BYTES,
            });
        }
        let mut out = vec![0u8; ACTIVITY_COPY_BYTES];
        out[0..8].copy_from_slice(&ACTIVITY_MAGIC);
        put_u32(&mut out, 8, ACTIVITY_VERSION);
        put_u32(&mut out, 12, self.extents.len() as u32);
        out[16..32].copy_from_slice(&self.uuid);
        put_u64(&mut out, 32, self.seq);
        put_u64(&mut out, 40, self.blocks);
        put_u32(&mut out, 48, self.extent_blocks);
        for (at, extent) in self.extents.iter().enumerate() {
            put_u64(&mut out, HEADER_USED + at * 8, *extent);
        }
        let extents_crc = crc32c(&out[HEADER_USED..HEADER_USED + self.extents.len() * 8]);
        put_u32(&mut out, 52, extents_crc);
        crate::seal(&mut out, CRC_AT);
        Ok(out)
    }

    /// Decode one copy (`ACTIVITY_COPY_BYTES`), checking both CRCs.
    pub fn decode(raw: &[u8]) -> Result<ActivityLog, FormatError> {
        crate::check_sealed(raw, HEADER_USED, &ACTIVITY_MAGIC, CRC_AT)?;
        let version = get_u32(raw, 8);
        if version != ACTIVITY_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        let count = get_u32(raw, 12) as usize;
        if count > ACTIVITY_MAX_EXTENTS {
            return Err(FormatError::Geometry("activity log names too many extents"));
        }
        let end = HEADER_USED + count * 8;
        if raw.len() < end {
            return Err(FormatError::Truncated {
                need: end,
                have: raw.len(),
            });
        }
        let stored = get_u32(raw, 52);
        let computed = crc32c(&raw[HEADER_USED..end]);
        if stored != computed {
            return Err(FormatError::BadChecksum { stored, computed });
        }
        let extent_blocks = get_u32(raw, 48);
        if extent_blocks == 0 {
            return Err(FormatError::Geometry("activity log extents of 0 blocks"));
        }
        Ok(ActivityLog {
            uuid: raw[16..32].try_into().expect("16 bytes"),
            seq: get_u64(raw, 32),
            blocks: get_u64(raw, 40),
            extent_blocks,
            extents: (0..count)
                .map(|at| get_u64(raw, HEADER_USED + at * 8))
                .collect(),
        })
    }

    /// The newest valid copy of a whole file (`None`: neither is valid).
    pub fn decode_file(raw: &[u8]) -> Option<ActivityLog> {
        (0..2)
            .filter_map(|copy| {
                let at = copy * ACTIVITY_COPY_BYTES;
                let log = ActivityLog::decode(raw.get(at..at + ACTIVITY_COPY_BYTES)?).ok()?;
                // A copy in the other's place was not written by an update.
                (ActivityLog::copy_offset(log.seq) == at as u64).then_some(log)
            })
            .max_by_key(|log| log.seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ActivityLog {
        ActivityLog {
            uuid: [0x33; 16],
            seq: 5,
            blocks: 262_144,
            extent_blocks: 1024,
            extents: vec![3, 200, 17],
        }
    }

    #[test]
    fn table_tiles_the_header() {
        assert!(crate::fields_tile(ActivityLog::FIELDS, HEADER_USED));
        assert_eq!(ACTIVITY_MAX_EXTENTS, 2040);
    }

    #[test]
    fn round_trip_and_golden_crc() {
        let log = sample();
        let bytes = log.encode().unwrap();
        assert_eq!(bytes.len(), ACTIVITY_COPY_BYTES);
        assert_eq!(ActivityLog::decode(&bytes).unwrap(), log);
        // Golden: a change here is a format change (new version).
        assert_eq!(
            (get_u32(&bytes, 52), get_u32(&bytes, 60)),
            (0xe2c1_613d, 0x16b2_108e),
            "activity log encoding changed"
        );
        let mut bad = bytes.clone();
        bad[64 + 8] ^= 1;
        assert!(matches!(
            ActivityLog::decode(&bad),
            Err(FormatError::BadChecksum { .. })
        ));
        let mut bad = bytes.clone();
        bad[33] ^= 1;
        assert!(ActivityLog::decode(&bad).is_err());
        assert!(ActivityLog::decode(&[0u8; ACTIVITY_COPY_BYTES]).is_err());
        let too_many = ActivityLog {
            extents: (0..ACTIVITY_MAX_EXTENTS as u64 + 1).collect(),
            ..sample()
        };
        assert!(too_many.encode().is_err());
    }

    #[test]
    fn the_newest_valid_copy_wins_and_a_torn_one_is_passed_over() {
        let older = sample();
        let newer = ActivityLog {
            seq: 6,
            extents: vec![9],
            ..sample()
        };
        let mut file = vec![0u8; 2 * ACTIVITY_COPY_BYTES];
        for log in [&older, &newer] {
            let at = ActivityLog::copy_offset(log.seq) as usize;
            file[at..at + ACTIVITY_COPY_BYTES].copy_from_slice(&log.encode().unwrap());
        }
        assert_eq!(ActivityLog::decode_file(&file), Some(newer.clone()));
        // The newer copy torn: the older one is the log.
        let at = ActivityLog::copy_offset(newer.seq) as usize;
        file[at + 100] ^= 0xff;
        file[at + 64] ^= 0xff;
        assert_eq!(ActivityLog::decode_file(&file), Some(older));
        assert_eq!(ActivityLog::decode_file(&[0u8; 100]), None);
    }
}
