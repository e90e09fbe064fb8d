//! The per-block protection context (32 bytes).
//!
//! A context is a tagged union on its first byte:
//! - all zero: the block was never written (reads as zeros, data untouched);
//! - `Data`: guard + reference tag + volume tag + write generation, self-checked
//!   by a CRC-32C of its first 28 bytes;
//! - `Zero`: trimmed or written as zeroes (reads as zeros, data untouched);
//! - `Encrypted`: a block of an encrypted volume: the AES-256-GCM-SIV nonce
//!   (the kind byte, the write's generation and 7 random bytes), the 16-byte
//!   AEAD tag (volume uuid, LBA and generation are associated data) and a
//!   keyless guard, CRC-32C of the context's first 28 bytes and the stored
//!   (encrypted) data, which anyone can check without the key.

use crate::bytes::{get_u32, get_u64, put_u32, put_u64};
use crate::{crc32c, Field, FormatError};

pub const CONTEXT_BYTES: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ContextKind {
    Unwritten = 0,
    Data = 1,
    Zero = 2,
    Encrypted = 3,
}

/// A decoded context. `Unwritten` and `Zero` need no data I/O to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Context {
    Unwritten,
    Zero {
        volume_tag: u32,
        ref_tag: u64,
        generation: u32,
    },
    Data {
        volume_tag: u32,
        ref_tag: u64,
        guard: u64,
        generation: u32,
    },
    Encrypted {
        /// Bytes 1..5: the write's generation (the journal sequence open
        /// when the block was sealed); part of the AEAD nonce and of the
        /// associated data.
        generation: u32,
        /// Bytes 5..12: the random part of the AEAD nonce (see `aead_nonce`).
        nonce: [u8; ENCRYPTED_NONCE_RANDOM],
        /// The AES-256-GCM-SIV tag.
        tag: [u8; 16],
        /// Keyless guard: `encrypted_guard` of the context and stored data.
        guard: u32,
    },
}

/// Random bytes in an encrypted context's nonce (the 12-byte AEAD nonce is
/// the kind byte, the 4-byte generation, then these).
pub const ENCRYPTED_NONCE_RANDOM: usize = 7;

/// The 12-byte AEAD nonce of an encrypted context: its kind byte (3), its
/// generation (little-endian) and its 7 random bytes, i.e. bytes 0..12 of
/// the encoded context.
pub fn aead_nonce(generation: u32, random: &[u8; ENCRYPTED_NONCE_RANDOM]) -> [u8; 12] {
    let mut nonce = [0u8; 12];
    nonce[0] = ContextKind::Encrypted as u8;
    nonce[1..5].copy_from_slice(&generation.to_le_bytes());
    nonce[5..].copy_from_slice(random);
    nonce
}

/// The keyless guard of an encrypted block: CRC-32C of the context's first
/// 28 bytes (kind, generation, nonce, tag) followed by the 4096 stored bytes
/// (the ciphertext). A scrub or replica without the key checks this; it
/// catches a corrupt context byte as well as corrupt data.
pub fn encrypted_guard(
    generation: u32,
    nonce: &[u8; ENCRYPTED_NONCE_RANDOM],
    tag: &[u8; 16],
    stored: &[u8],
) -> u32 {
    let mut head = [0u8; 28];
    head[..12].copy_from_slice(&aead_nonce(generation, nonce));
    head[12..28].copy_from_slice(tag);
    let mut digest = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    digest.update(&head);
    digest.update(stored);
    digest.finalize() as u32
}

/// Kind byte of a *lost marker*: the slot of a block whose protection
/// information was found lost (its context page or packed row read as
/// zeros where the written map says metadata was written). A checkpoint
/// that rewrites such a page stamps the marker into every slot it does not
/// know, so the loss stays a fault (`FormatError::MetadataLost`) and is
/// never made a hole; a write or trim of the block replaces it.
pub const KIND_LOST: u8 = 4;

/// The 32 bytes of a lost marker for `lba` (kind 4, volume tag, ref tag,
/// zeros, CRC-32C of bytes 0..28).
pub fn encode_lost(volume_tag: u32, lba: u64) -> [u8; CONTEXT_BYTES] {
    encode_marker(KIND_LOST, volume_tag, lba)
}

/// Kind byte of a *vacant marker* (volumes with `INCOMPAT_BOUND_UNITS`):
/// the slot of a never-written or trimmed block inside a metadata unit
/// that holds protection information. A written unit then has no blank
/// slot, so a blank slot in it is lost metadata (a page cut short or
/// zeroed in part), and every slot is bound to its LBA and volume, so a
/// unit copied in from another place or another volume fails on every
/// block, the never-written ones included. The layout that reads the slot
/// knows its LBA: a marker of this LBA and volume reads as never written
/// (`vacant_of`); any other decodes as `FormatError::Vacant`.
pub const KIND_VACANT: u8 = 5;

/// The 32 bytes of a marker of `kind` (lost or vacant) for `lba`: the
/// kind, volume tag, ref tag, zeros, CRC-32C of bytes 0..28.
fn encode_marker(kind: u8, volume_tag: u32, lba: u64) -> [u8; CONTEXT_BYTES] {
    let mut out = [0u8; CONTEXT_BYTES];
    out[0] = kind;
    out[4..8].copy_from_slice(&volume_tag.to_le_bytes());
    out[8..16].copy_from_slice(&lba.to_le_bytes());
    let crc = crc32c(&out[..28]);
    out[28..32].copy_from_slice(&crc.to_le_bytes());
    out
}

/// The volume tag and ref tag of a well-formed marker (lost or vacant:
/// its CRC and zero fields check), else the checksum error.
fn decode_marker(raw: &[u8]) -> Result<(u32, u64), FormatError> {
    let stored = get_u32(raw, 28);
    let computed = crc32c(&raw[..28]);
    if stored != computed || raw[1..4] != [0, 0, 0] || raw[16..28].iter().any(|b| *b != 0) {
        return Err(FormatError::BadChecksum { stored, computed });
    }
    Ok((get_u32(raw, 4), get_u64(raw, 8)))
}

/// The 32 bytes of a vacant marker for `lba` in a volume with `volume_tag`.
pub fn encode_vacant(volume_tag: u32, lba: u64) -> [u8; CONTEXT_BYTES] {
    encode_marker(KIND_VACANT, volume_tag, lba)
}

/// Whether `raw` is the vacant marker of `lba` in the volume with
/// `volume_tag` (then the block reads as never written).
pub fn vacant_of(raw: &[u8], volume_tag: u32, lba: u64) -> bool {
    raw.len() >= CONTEXT_BYTES
        && raw[0] == KIND_VACANT
        && decode_marker(raw) == Ok((volume_tag, lba))
}

impl Context {
    /// Byte table of the plain (`Data`/`Zero`) variant.
    pub const FIELDS: &'static [Field] = &[
        Field {
            name: "kind",
            offset: 0,
            size: 1,
        },
        Field {
            name: "reserved",
            offset: 1,
            size: 3,
        },
        Field {
            name: "volume_tag",
            offset: 4,
            size: 4,
        },
        Field {
            name: "ref_tag",
            offset: 8,
            size: 8,
        },
        Field {
            name: "guard",
            offset: 16,
            size: 8,
        },
        Field {
            name: "generation",
            offset: 24,
            size: 4,
        },
        Field {
            name: "context_crc",
            offset: 28,
            size: 4,
        },
    ];
    /// Byte table of the encrypted variant.
    pub const ENCRYPTED_FIELDS: &'static [Field] = &[
        Field {
            name: "kind",
            offset: 0,
            size: 1,
        },
        Field {
            name: "generation",
            offset: 1,
            size: 4,
        },
        Field {
            name: "nonce",
            offset: 5,
            size: 7,
        },
        Field {
            name: "aead_tag",
            offset: 12,
            size: 16,
        },
        Field {
            name: "guard",
            offset: 28,
            size: 4,
        },
    ];

    pub fn kind(&self) -> ContextKind {
        match self {
            Context::Unwritten => ContextKind::Unwritten,
            Context::Zero { .. } => ContextKind::Zero,
            Context::Data { .. } => ContextKind::Data,
            Context::Encrypted { .. } => ContextKind::Encrypted,
        }
    }

    /// The generation of a written block (the journal sequence, low 32
    /// bits, that wrote a plain block or was open when an encrypted one was
    /// sealed): a later write of the same LBA never has a lower one. `None`
    /// for a block never written.
    pub fn generation(&self) -> Option<u32> {
        match *self {
            Context::Unwritten => None,
            Context::Zero { generation, .. }
            | Context::Data { generation, .. }
            | Context::Encrypted { generation, .. } => Some(generation),
        }
    }

    /// True when the context seals a stored data block (plain or encrypted).
    pub fn carries_data(&self) -> bool {
        matches!(self, Context::Data { .. } | Context::Encrypted { .. })
    }

    /// True when reading the block needs no data I/O (it reads as zeros).
    pub fn reads_as_zero(&self) -> bool {
        matches!(self, Context::Unwritten | Context::Zero { .. })
    }

    pub fn encode(&self) -> [u8; CONTEXT_BYTES] {
        let mut out = [0u8; CONTEXT_BYTES];
        match *self {
            Context::Unwritten => {}
            Context::Zero {
                volume_tag,
                ref_tag,
                generation,
            } => encode_plain(
                &mut out,
                ContextKind::Zero,
                volume_tag,
                ref_tag,
                0,
                generation,
            ),
            Context::Data {
                volume_tag,
                ref_tag,
                guard,
                generation,
            } => encode_plain(
                &mut out,
                ContextKind::Data,
                volume_tag,
                ref_tag,
                guard,
                generation,
            ),
            Context::Encrypted {
                generation,
                nonce,
                tag,
                guard,
            } => {
                out[..12].copy_from_slice(&aead_nonce(generation, &nonce));
                out[12..28].copy_from_slice(&tag);
                put_u32(&mut out, 28, guard);
            }
        }
        out
    }

    /// Decode a context. A corrupt context is an error, never a guess.
    pub fn decode(raw: &[u8]) -> Result<Context, FormatError> {
        if raw.len() < CONTEXT_BYTES {
            return Err(FormatError::Truncated {
                need: CONTEXT_BYTES,
                have: raw.len(),
            });
        }
        let raw = &raw[..CONTEXT_BYTES];
        match raw[0] {
            0 => {
                if raw.iter().all(|b| *b == 0) {
                    Ok(Context::Unwritten)
                } else {
                    Err(FormatError::BadChecksum {
                        stored: 0,
                        computed: crc32c(&raw[..28]),
                    })
                }
            }
            KIND_LOST => {
                decode_marker(raw)?;
                Err(FormatError::MetadataLost)
            }
            // A vacant marker that reaches here was not accepted at its
            // place (`vacant_of`): it names another LBA or volume.
            KIND_VACANT => {
                let (volume_tag, ref_tag) = decode_marker(raw)?;
                Err(FormatError::Vacant {
                    volume_tag,
                    ref_tag,
                })
            }
            kind @ (1 | 2) => {
                let stored = get_u32(raw, 28);
                let computed = crc32c(&raw[..28]);
                if stored != computed || raw[1..4] != [0, 0, 0] {
                    return Err(FormatError::BadChecksum { stored, computed });
                }
                let volume_tag = get_u32(raw, 4);
                let ref_tag = get_u64(raw, 8);
                let guard = get_u64(raw, 16);
                let generation = get_u32(raw, 24);
                if kind == 1 {
                    Ok(Context::Data {
                        volume_tag,
                        ref_tag,
                        guard,
                        generation,
                    })
                } else {
                    Ok(Context::Zero {
                        volume_tag,
                        ref_tag,
                        generation,
                    })
                }
            }
            // An encrypted context cannot check itself without its data:
            // its guard covers its bytes and the data together (checked by
            // whoever reads the block, with or without the key).
            3 => {
                let mut nonce = [0u8; ENCRYPTED_NONCE_RANDOM];
                let mut tag = [0u8; 16];
                nonce.copy_from_slice(&raw[5..12]);
                tag.copy_from_slice(&raw[12..28]);
                Ok(Context::Encrypted {
                    generation: get_u32(raw, 1),
                    nonce,
                    tag,
                    guard: get_u32(raw, 28),
                })
            }
            other => Err(FormatError::UnknownContextKind(other)),
        }
    }
}

fn encode_plain(
    out: &mut [u8; CONTEXT_BYTES],
    kind: ContextKind,
    volume_tag: u32,
    ref_tag: u64,
    guard: u64,
    generation: u32,
) {
    out[0] = kind as u8;
    put_u32(out, 4, volume_tag);
    put_u64(out, 8, ref_tag);
    put_u64(out, 16, guard);
    put_u32(out, 24, generation);
    crate::seal(out, 28);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tables_tile_the_context() {
        assert!(crate::fields_tile(Context::FIELDS, CONTEXT_BYTES));
        assert!(crate::fields_tile(Context::ENCRYPTED_FIELDS, CONTEXT_BYTES));
    }

    #[test]
    fn golden_bytes() {
        let ctx = Context::Data {
            volume_tag: 0x1122_3344,
            ref_tag: 0x0102_0304_0506_0708,
            guard: 0xE306_9283,
            generation: 7,
        };
        let bytes = ctx.encode();
        let expected: [u8; 32] = [
            0x01, 0, 0, 0, 0x44, 0x33, 0x22, 0x11, 0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,
            0x83, 0x92, 0x06, 0xE3, 0, 0, 0, 0, 0x07, 0, 0, 0, 0x9f, 0x9b, 0x79, 0x77,
        ];
        assert_eq!(
            bytes, expected,
            "context encoding changed: bump the format version"
        );
        assert_eq!(Context::decode(&bytes).unwrap(), ctx);
        assert_eq!(Context::Unwritten.encode(), [0u8; 32]);
    }

    #[test]
    fn vacant_golden_bytes() {
        let bytes = encode_vacant(0x1122_3344, 0x0102_0304_0506_0708);
        let expected: [u8; 32] = [
            0x05, 0, 0, 0, 0x44, 0x33, 0x22, 0x11, 0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(
            bytes[..28],
            expected[..28],
            "vacant marker encoding changed"
        );
        assert_eq!(get_u32(&bytes, 28), crc32c(&bytes[..28]));
    }

    #[test]
    fn any_single_bit_flip_is_detected() {
        let ctx = Context::Data {
            volume_tag: 9,
            ref_tag: 77,
            guard: 0xDEAD_BEEF,
            generation: 3,
        };
        let bytes = ctx.encode();
        for bit in 0..(CONTEXT_BYTES * 8) {
            let mut flipped = bytes;
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(Context::decode(&flipped).ok(), Some(ctx), "bit {bit}");
        }
    }

    #[test]
    fn encrypted_golden_bytes_and_keyless_guard() {
        let generation = 0x0A0B_0C0D;
        let nonce = [0xA5; ENCRYPTED_NONCE_RANDOM];
        let tag = [0x3C; 16];
        let data = [0x77u8; 4096];
        let guard = encrypted_guard(generation, &nonce, &tag, &data);
        let ctx = Context::Encrypted {
            generation,
            nonce,
            tag,
            guard,
        };
        let bytes = ctx.encode();
        assert_eq!(bytes[0], 3);
        assert_eq!(&bytes[1..5], &[0x0D, 0x0C, 0x0B, 0x0A]);
        assert_eq!(&bytes[5..12], &nonce);
        assert_eq!(&bytes[12..28], &tag);
        assert_eq!(get_u32(&bytes, 28), guard);
        assert_eq!(Context::decode(&bytes).unwrap(), ctx);
        assert_eq!(ctx.generation(), Some(generation));
        assert_eq!(&aead_nonce(generation, &nonce)[..], &bytes[..12]);
        // The guard is CRC-32C of the 28 context bytes then the data.
        let mut whole = bytes[..28].to_vec();
        whole.extend_from_slice(&data);
        assert_eq!(guard, crc32c(&whole));
        // Any flipped bit of context or data changes the keyless guard.
        for bit in 0..(28 * 8) {
            let mut flipped = bytes;
            flipped[bit / 8] ^= 1 << (bit % 8);
            // Otherwise it is no longer an encrypted context: corrupt or
            // another kind, whose own checks apply.
            if let Ok(Context::Encrypted {
                generation,
                nonce,
                tag,
                guard,
            }) = Context::decode(&flipped)
            {
                assert_ne!(
                    encrypted_guard(generation, &nonce, &tag, &data),
                    guard,
                    "bit {bit}"
                );
            }
        }
        let mut flipped = data;
        flipped[4095] ^= 0x80;
        assert_ne!(encrypted_guard(generation, &nonce, &tag, &flipped), guard);
    }

    proptest! {
        #[test]
        fn round_trip(volume_tag: u32, ref_tag: u64, guard: u64, generation: u32, zero: bool) {
            let ctx = if zero {
                Context::Zero { volume_tag, ref_tag, generation }
            } else {
                Context::Data { volume_tag, ref_tag, guard, generation }
            };
            prop_assert_eq!(Context::decode(&ctx.encode()).unwrap(), ctx);
        }

        #[test]
        fn lost_markers_decode_as_lost(lba in any::<u64>(), tag in any::<u32>()) {
            let marker = encode_lost(tag, lba);
            prop_assert_eq!(Context::decode(&marker), Err(FormatError::MetadataLost));
            let mut flipped = marker;
            flipped[9] ^= 1;
            let damaged = matches!(Context::decode(&flipped), Err(FormatError::BadChecksum { .. }));
            prop_assert!(damaged);
        }

        #[test]
        fn vacant_markers_bind_their_place(lba in any::<u64>(), tag in any::<u32>()) {
            let marker = encode_vacant(tag, lba);
            prop_assert!(vacant_of(&marker, tag, lba));
            prop_assert!(!vacant_of(&marker, tag, lba.wrapping_add(1)));
            prop_assert!(!vacant_of(&marker, tag ^ 1, lba));
            prop_assert!(!vacant_of(&[0u8; CONTEXT_BYTES], tag, lba));
            prop_assert!(!vacant_of(&encode_lost(tag, lba), tag, lba));
            prop_assert_eq!(
                Context::decode(&marker),
                Err(FormatError::Vacant { volume_tag: tag, ref_tag: lba })
            );
            let mut flipped = marker;
            flipped[9] ^= 1;
            prop_assert!(!vacant_of(&flipped, tag, lba));
            let damaged = matches!(Context::decode(&flipped), Err(FormatError::BadChecksum { .. }));
            prop_assert!(damaged);
        }

        #[test]
        fn decode_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = Context::decode(&raw);
        }
    }
}
