//! Protection information: the one place that seals a block (its bytes ->
//! the seal its context will carry) and opens it (stored bytes + context ->
//! the data, or the kind of fault). The write path seals, the read path,
//! recovery and `check` open or match through this trait, and nothing else
//! computes a guard or compares a tag.
//!
//! `GuardProtection` is the plain implementation: a guard checksum over the
//! data, a reference tag (the LBA) and a volume tag. `EncryptedProtection`
//! (`encryption.rs`) is the second: sealing encrypts the bytes in place
//! (AES-256-GCM-SIV, volume and LBA as associated data), opening for a
//! reader authenticates and decrypts them in place. Below this trait every
//! byte of an encrypted volume — buffered, journaled, at home — is
//! ciphertext.

use vouch_format::{Context, FormatError, GuardKind};

use crate::error::FaultKind;

/// What sealing one block produced, carried with the buffered block until
/// its commit knows the generation. Plain protection: the guard (nonce and
/// tag zero). Encrypted: the keyless guard, the nonce's random part and
/// the AEAD tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seal {
    pub guard: u64,
    /// The generation the seal was made under (encrypted: in the nonce and
    /// the associated data). Plain: 0 for a block this volume sealed (its
    /// commit's sequence becomes the generation), or the generation a
    /// block moved with its context (`seal_of`) or sealed for a mirror
    /// (`SealedDevice::seal_blocks`) already carries, which it keeps.
    pub generation: u32,
    pub nonce: [u8; vouch_format::context::ENCRYPTED_NONCE_RANDOM],
    pub tag: [u8; 16],
}

impl Seal {
    /// A plain seal: just the guard.
    pub fn guard(guard: u64) -> Seal {
        Seal {
            guard,
            generation: 0,
            nonce: [0; vouch_format::context::ENCRYPTED_NONCE_RANDOM],
            tag: [0; 16],
        }
    }
}

/// Seal and open blocks for one volume. Implementations are shared by every
/// reader and writer thread.
pub trait Protection: Send + Sync {
    /// Seal a block's bytes for `lba`, on the writer's thread. A protection
    /// that transforms data (encryption) replaces `data` with the bytes to
    /// store; the plain one leaves it as it is. `generation` is
    /// `Shared::sealing_generation()`: the encrypted protection binds the
    /// block to it; the plain one takes the commit's sequence later.
    fn seal(&self, lba: u64, data: &mut [u8], generation: u64) -> Seal;

    /// `seal` of bytes that must not change (a block shared with the
    /// buffer it was received into): `Some` for a protection that stores
    /// data as it is, `None` for one that transforms it (encryption), which
    /// the caller then seals in a copy with `seal`.
    fn seal_unchanged(&self, lba: u64, data: &[u8], generation: u64) -> Option<Seal> {
        let _ = (lba, data, generation);
        None
    }

    /// Whether blocks are stored as they are (`seal_unchanged` is `Some`):
    /// sealing then costs a checksum, not a transformation.
    fn stores_plain(&self) -> bool {
        false
    }

    /// The context a sealed block is stored with, once its commit's
    /// sequence number (the block's generation) is known.
    fn context(&self, lba: u64, seal: Seal, generation: u64) -> Context;

    /// The template context of a zeroed range: a hole (`allocate` false)
    /// or allocated zeroes; each block's reference tag is filled in by
    /// `contexts::context_in_range`.
    fn zero_template(&self, allocate: bool) -> Context;

    /// Check one block's stored bytes against its context, for `lba`.
    fn open(
        &self,
        lba: u64,
        context: &Result<Context, FormatError>,
        stored: &[u8],
    ) -> Result<(), FaultKind>;

    /// Open a block for a reader: check it like `open` and turn the stored
    /// bytes into the data in place (decrypt). The plain protection only
    /// checks.
    fn open_in_place(
        &self,
        lba: u64,
        context: &Result<Context, FormatError>,
        stored: &mut [u8],
    ) -> Result<(), FaultKind> {
        self.open(lba, context, stored)
    }

    /// Open a block for a client read: like `open_in_place`, except that a
    /// protection whose authentication covers everything its keyless check
    /// covers may skip that check when authentication passes. On any error
    /// `stored` may be garbage and the fault kind only provisional: the
    /// caller re-reads the block and opens it with `open_in_place`, which
    /// checks everything and names the fault. Scans (check, verify, scrub)
    /// always use `open_in_place`.
    fn open_for_client(
        &self,
        lba: u64,
        context: &Result<Context, FormatError>,
        stored: &mut [u8],
    ) -> Result<(), FaultKind> {
        self.open_in_place(lba, context, stored)
    }

    /// Turn a copy of a buffered block (sealed in memory with `seal`, not
    /// yet committed) into its data in place. Plain: nothing to do.
    fn reveal(&self, _lba: u64, _seal: &Seal, _data: &mut [u8]) -> Result<(), FaultKind> {
        Ok(())
    }

    /// Does `stored` hold the very bytes `context` sealed? Recovery asks
    /// this of each candidate context of a block whose write may not have
    /// reached home. Zero-reading contexts always match.
    fn matches(&self, context: &Context, stored: &[u8]) -> bool;

    /// The seal a context carries, for a block moved with its context
    /// (replicas, repair): `None` if it does not carry data.
    fn seal_of(&self, context: &Context) -> Option<Seal>;

    /// Whether `context` belongs at `lba` of this volume, judged without
    /// the block's bytes (for blocks this process sealed from bytes that
    /// never left it: `Engine::write_sealed_here`). `None` when the
    /// protection cannot tell without them (the encrypted one binds the
    /// place in the AEAD): the caller opens the block in full.
    fn check_place(&self, _lba: u64, _context: &Context) -> Option<Result<(), FaultKind>> {
        None
    }
}

/// The context template of a trimmed (`allocate` false: never written) or
/// written-zeroes range in a volume with `volume_tag`: the same for every
/// protection, since no data is stored for either.
pub(crate) fn zero_template(volume_tag: u32, allocate: bool) -> Context {
    if allocate {
        Context::Zero {
            volume_tag,
            ref_tag: 0,
            generation: 0,
        }
    } else {
        Context::Unwritten
    }
}

/// The fault of a block whose stored context does not decode: its
/// metadata lost (a lost marker, or a blank unit the written map says was
/// written), or corrupt.
pub(crate) fn context_fault(error: &FormatError) -> FaultKind {
    match error {
        FormatError::MetadataLost => FaultKind::MetadataLost,
        // A vacant marker of another place (`Protection::open` tells
        // another volume's apart by its volume tag).
        FormatError::Vacant { .. } => FaultKind::RefTagMismatch,
        _ => FaultKind::ContextCorrupt,
    }
}

/// Plain protection: guard + reference tag + volume tag.
pub struct GuardProtection {
    guard: GuardKind,
    volume_tag: u32,
}

impl GuardProtection {
    pub fn new(guard: GuardKind, volume_tag: u32) -> GuardProtection {
        GuardProtection { guard, volume_tag }
    }

    fn check_tags(&self, lba: u64, volume_tag: u32, ref_tag: u64) -> Result<(), FaultKind> {
        if volume_tag != self.volume_tag {
            return Err(FaultKind::VolumeTagMismatch);
        }
        if ref_tag != lba {
            return Err(FaultKind::RefTagMismatch);
        }
        Ok(())
    }
}

impl Protection for GuardProtection {
    fn seal(&self, _lba: u64, data: &mut [u8], _generation: u64) -> Seal {
        Seal::guard(self.guard.compute(data))
    }

    fn stores_plain(&self) -> bool {
        true
    }

    fn seal_unchanged(&self, _lba: u64, data: &[u8], _generation: u64) -> Option<Seal> {
        Some(Seal::guard(self.guard.compute(data)))
    }

    fn context(&self, lba: u64, seal: Seal, generation: u64) -> Context {
        Context::Data {
            volume_tag: self.volume_tag,
            ref_tag: lba,
            guard: seal.guard,
            // The generation field holds the low 32 bits of the sequence,
            // unless the seal already carries one (see `Seal::generation`).
            generation: if seal.generation != 0 {
                seal.generation
            } else {
                generation as u32
            },
        }
    }

    fn zero_template(&self, allocate: bool) -> Context {
        zero_template(self.volume_tag, allocate)
    }

    fn open(
        &self,
        lba: u64,
        context: &Result<Context, FormatError>,
        stored: &[u8],
    ) -> Result<(), FaultKind> {
        match context {
            Err(FormatError::Vacant {
                volume_tag,
                ref_tag,
            }) => Err(self
                .check_tags(lba, *volume_tag, *ref_tag)
                .err()
                .unwrap_or(FaultKind::ContextCorrupt)),
            Err(error) => Err(context_fault(error)),
            Ok(Context::Unwritten) => Ok(()),
            Ok(Context::Zero {
                volume_tag,
                ref_tag,
                ..
            }) => self.check_tags(lba, *volume_tag, *ref_tag),
            Ok(Context::Data {
                volume_tag,
                ref_tag,
                guard,
                ..
            }) => {
                self.check_tags(lba, *volume_tag, *ref_tag)?;
                if self.guard.compute(stored) != *guard {
                    return Err(FaultKind::GuardMismatch);
                }
                Ok(())
            }
            // Encrypted volumes are refused at open (incompat flag); a stray
            // encrypted context in a plain volume is corruption.
            Ok(Context::Encrypted { .. }) => Err(FaultKind::ContextCorrupt),
        }
    }

    fn matches(&self, context: &Context, stored: &[u8]) -> bool {
        match context {
            Context::Data { guard, .. } => self.guard.compute(stored) == *guard,
            other => other.reads_as_zero(),
        }
    }

    fn seal_of(&self, context: &Context) -> Option<Seal> {
        match context {
            Context::Data {
                guard, generation, ..
            } => Some(Seal {
                generation: *generation,
                ..Seal::guard(*guard)
            }),
            _ => None,
        }
    }

    fn check_place(&self, lba: u64, context: &Context) -> Option<Result<(), FaultKind>> {
        Some(match context {
            Context::Unwritten => Ok(()),
            Context::Zero {
                volume_tag,
                ref_tag,
                ..
            }
            | Context::Data {
                volume_tag,
                ref_tag,
                ..
            } => self.check_tags(lba, *volume_tag, *ref_tag),
            Context::Encrypted { .. } => Err(FaultKind::ContextCorrupt),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_block_opens_only_at_its_lba_in_its_volume() {
        let protection = GuardProtection::new(GuardKind::Crc32c, 7);
        let mut data = [0x5au8; 4096];
        let context = protection.context(9, protection.seal(9, &mut data, 3), 3);
        assert_eq!(
            data, [0x5au8; 4096],
            "plain sealing leaves the data as it is"
        );
        assert_eq!(protection.open(9, &Ok(context), &data), Ok(()));
        assert_eq!(
            protection.open(10, &Ok(context), &data),
            Err(FaultKind::RefTagMismatch)
        );
        let mut flipped = data;
        flipped[100] ^= 1;
        assert_eq!(
            protection.open(9, &Ok(context), &flipped),
            Err(FaultKind::GuardMismatch)
        );
        let other_volume = GuardProtection::new(GuardKind::Crc32c, 8);
        assert_eq!(
            other_volume.open(9, &Ok(context), &data),
            Err(FaultKind::VolumeTagMismatch)
        );
        assert!(protection.matches(&context, &data));
        assert!(!protection.matches(&context, &flipped));
        assert!(protection.matches(&Context::Unwritten, &flipped));
    }
}
