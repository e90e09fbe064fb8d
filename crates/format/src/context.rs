//! The per-block protection context (32 bytes).
//!
//! A context is a tagged union on its first byte:
//! - all zero: the block was never written (reads as zeros, data untouched);
//! - `Data`: guard + reference tag + volume tag + write generation, self-checked
//!   by a CRC-32C of its first 28 bytes;
//! - `Zero`: trimmed or written as zeroes (reads as zeros, data untouched);
//! - `Encrypted`: reserved for AES-256-GCM-SIV volumes: a 12-byte nonce and a
//!   16-byte tag; the AEAD binds volume and LBA through associated data.

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
        nonce: [u8; 12],
        tag: [u8; 16],
    },
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
            name: "reserved",
            offset: 1,
            size: 3,
        },
        Field {
            name: "nonce",
            offset: 4,
            size: 12,
        },
        Field {
            name: "aead_tag",
            offset: 16,
            size: 16,
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
            Context::Encrypted { nonce, tag } => {
                out[0] = ContextKind::Encrypted as u8;
                out[4..16].copy_from_slice(&nonce);
                out[16..32].copy_from_slice(&tag);
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
            3 => {
                let mut nonce = [0u8; 12];
                let mut tag = [0u8; 16];
                nonce.copy_from_slice(&raw[4..16]);
                tag.copy_from_slice(&raw[16..32]);
                Ok(Context::Encrypted { nonce, tag })
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
        fn decode_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = Context::decode(&raw);
        }
    }
}
