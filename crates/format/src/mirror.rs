//! The mirror record: the file `mirror` in the directory of each leg of a
//! mirrored volume. Every leg is a whole vouch volume (same superblock, so
//! the same uuid, volume tag and key); the record says which leg this
//! directory is, which legs the set has, and what state each is in.
//!
//! A 64-byte header followed by one member entry per leg (a 4-byte entry
//! header and the leg's path as UTF-8). A CRC-32C over the whole record
//! (its `crc` field taken as zero) detects a torn or damaged record; the
//! `epoch` grows by one at every change of membership or state, and the
//! record with the highest epoch among the legs found is the set's view.

use crate::bytes::{get_u32, get_u64, put_u32, put_u64};
use crate::{crc32c, Field, FormatError};

/// The file in each local leg's directory that holds its record.
pub const MIRROR_RECORD_FILE: &str = "mirror";
pub const MIRROR_MAGIC: [u8; 8] = *b"VOUCHMIR";
pub const MIRROR_VERSION: u32 = 1;
pub const MIRROR_HEADER_BYTES: usize = 64;
pub const MIRROR_ENTRY_HEADER_BYTES: usize = 4;
/// A set has 2 or 3 legs.
pub const MIN_LEGS: usize = 2;
pub const MAX_LEGS: usize = 3;
/// Longest leg path the record holds.
pub const MAX_PATH_BYTES: usize = 4096;
const CRC_AT: usize = 60;

/// What a leg is to the set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum LegState {
    /// In sync: read from and written to.
    Active = 0,
    /// Needed too many repairs, or failed a write or flush: no I/O until
    /// it is replaced (`vouch mirror replace`).
    Faulted = 1,
    /// Was missing while the set was opened for writing: it lacks writes,
    /// so it is not read until it is replaced.
    Stale = 2,
}

impl LegState {
    pub fn name(self) -> &'static str {
        match self {
            LegState::Active => "active",
            LegState::Faulted => "faulted",
            LegState::Stale => "stale",
        }
    }

    fn from_byte(byte: u8) -> Result<LegState, FormatError> {
        match byte {
            0 => Ok(LegState::Active),
            1 => Ok(LegState::Faulted),
            2 => Ok(LegState::Stale),
            _ => Err(FormatError::Geometry("unknown mirror leg state")),
        }
    }
}

/// One leg of the set, as every record lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MirrorMember {
    pub state: LegState,
    /// The leg's volume directory (absolute).
    pub path: String,
}

/// A decoded mirror record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MirrorRecord {
    /// Which member this directory is (index into `members`).
    pub leg: u16,
    /// The volume's uuid (the superblock's): a leg of another volume is
    /// refused.
    pub uuid: [u8; 16],
    /// Grows by one at every change of membership or state.
    pub epoch: u64,
    pub members: Vec<MirrorMember>,
}

impl MirrorRecord {
    /// Byte table of the header.
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
            name: "legs",
            offset: 14,
            size: 2,
        },
        Field {
            name: "uuid",
            offset: 16,
            size: 16,
        },
        Field {
            name: "epoch",
            offset: 32,
            size: 8,
        },
        Field {
            name: "members_bytes",
            offset: 40,
            size: 4,
        },
        Field {
            name: "reserved",
            offset: 44,
            size: 16,
        },
        Field {
            name: "crc",
            offset: 60,
            size: 4,
        },
    ];

    /// Byte table of a member entry's header (its path follows it).
    pub const ENTRY_FIELDS: &'static [Field] = &[
        Field {
            name: "state",
            offset: 0,
            size: 1,
        },
        Field {
            name: "reserved",
            offset: 1,
            size: 1,
        },
        Field {
            name: "path_bytes",
            offset: 2,
            size: 2,
        },
    ];

    /// Check the record's own consistency (leg count, index, paths).
    pub fn validate(&self) -> Result<(), FormatError> {
        if !(MIN_LEGS..=MAX_LEGS).contains(&self.members.len()) {
            return Err(FormatError::Geometry("a mirror has 2 or 3 legs"));
        }
        if usize::from(self.leg) >= self.members.len() {
            return Err(FormatError::Geometry("mirror leg index out of range"));
        }
        for member in &self.members {
            if member.path.is_empty() || member.path.len() > MAX_PATH_BYTES {
                return Err(FormatError::Geometry("mirror leg path empty or too long"));
            }
        }
        Ok(())
    }

    pub fn encode(&self) -> Result<Vec<u8>, FormatError> {
        self.validate()?;
        let mut out = vec![0u8; MIRROR_HEADER_BYTES];
        for member in &self.members {
            out.push(member.state as u8);
            out.push(0);
            out.extend_from_slice(&(member.path.len() as u16).to_le_bytes());
            out.extend_from_slice(member.path.as_bytes());
        }
        let members_bytes = (out.len() - MIRROR_HEADER_BYTES) as u32;
        out[0..8].copy_from_slice(&MIRROR_MAGIC);
        put_u32(&mut out, 8, MIRROR_VERSION);
        out[12..14].copy_from_slice(&self.leg.to_le_bytes());
        out[14..16].copy_from_slice(&(self.members.len() as u16).to_le_bytes());
        out[16..32].copy_from_slice(&self.uuid);
        put_u64(&mut out, 32, self.epoch);
        put_u32(&mut out, 40, members_bytes);
        let crc = crc32c(&out);
        put_u32(&mut out, CRC_AT, crc);
        Ok(out)
    }

    pub fn decode(bytes: &[u8]) -> Result<MirrorRecord, FormatError> {
        if bytes.len() < MIRROR_HEADER_BYTES {
            return Err(FormatError::Truncated {
                need: MIRROR_HEADER_BYTES,
                have: bytes.len(),
            });
        }
        if bytes[0..8] != MIRROR_MAGIC {
            return Err(FormatError::BadMagic);
        }
        let version = get_u32(bytes, 8);
        if version != MIRROR_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        let members_bytes = get_u32(bytes, 40) as usize;
        let total = MIRROR_HEADER_BYTES + members_bytes;
        if bytes.len() != total {
            return Err(FormatError::Truncated {
                need: total,
                have: bytes.len(),
            });
        }
        let stored = get_u32(bytes, CRC_AT);
        let mut zeroed = bytes.to_vec();
        put_u32(&mut zeroed, CRC_AT, 0);
        let computed = crc32c(&zeroed);
        if stored != computed {
            return Err(FormatError::BadChecksum { stored, computed });
        }
        let leg = u16::from_le_bytes([bytes[12], bytes[13]]);
        let legs = usize::from(u16::from_le_bytes([bytes[14], bytes[15]]));
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&bytes[16..32]);
        let epoch = get_u64(bytes, 32);
        let mut members = Vec::with_capacity(legs.min(MAX_LEGS));
        let mut at = MIRROR_HEADER_BYTES;
        for _ in 0..legs.min(MAX_LEGS + 1) {
            if at + MIRROR_ENTRY_HEADER_BYTES > total {
                return Err(FormatError::Geometry("mirror member entries truncated"));
            }
            let state = LegState::from_byte(bytes[at])?;
            let length = usize::from(u16::from_le_bytes([bytes[at + 2], bytes[at + 3]]));
            let start = at + MIRROR_ENTRY_HEADER_BYTES;
            if start + length > total {
                return Err(FormatError::Geometry("mirror member path truncated"));
            }
            let path = std::str::from_utf8(&bytes[start..start + length])
                .map_err(|_| FormatError::Geometry("mirror member path is not UTF-8"))?
                .to_string();
            members.push(MirrorMember { state, path });
            at = start + length;
        }
        if at != total {
            return Err(FormatError::Geometry(
                "mirror member entries do not fill the record",
            ));
        }
        let record = MirrorRecord {
            leg,
            uuid,
            epoch,
            members,
        };
        record.validate()?;
        Ok(record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> MirrorRecord {
        MirrorRecord {
            leg: 1,
            uuid: [7; 16],
            epoch: 3,
            members: vec![
                MirrorMember {
                    state: LegState::Active,
                    path: "/a/vol".into(),
                },
                MirrorMember {
                    state: LegState::Faulted,
                    path: "/b/vol".into(),
                },
            ],
        }
    }

    #[test]
    fn a_record_round_trips_and_its_bytes_are_fixed() {
        let bytes = record().encode().expect("encode");
        assert_eq!(bytes.len(), 64 + 4 + 6 + 4 + 6);
        assert_eq!(&bytes[0..8], b"VOUCHMIR");
        assert_eq!(bytes[64], 0);
        assert_eq!(bytes[74], 1, "the second member is faulted");
        assert_eq!(MirrorRecord::decode(&bytes).expect("decode"), record());
    }

    #[test]
    fn damage_is_refused_by_name() {
        let bytes = record().encode().expect("encode");
        let mut flipped = bytes.clone();
        flipped[70] ^= 1;
        assert!(matches!(
            MirrorRecord::decode(&flipped),
            Err(FormatError::BadChecksum { .. })
        ));
        assert!(matches!(
            MirrorRecord::decode(&bytes[..bytes.len() - 1]),
            Err(FormatError::Truncated { .. })
        ));
        let mut version = bytes.clone();
        version[8] = 9;
        assert_eq!(
            MirrorRecord::decode(&version),
            Err(FormatError::UnsupportedVersion(9))
        );
        let mut one = record();
        one.members.pop();
        assert!(one.encode().is_err(), "a one-leg mirror is refused");
    }
}
