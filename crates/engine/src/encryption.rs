//! `EncryptedProtection`: the `Protection` of an encrypted volume. Sealing
//! encrypts a block in place with AES-256-GCM-SIV under the data key, with
//! a nonce of the write's generation and fresh random bytes, and the volume
//! uuid, LBA and generation as associated data; the context (kind 3,
//! docs/FORMAT.md) carries the generation, the nonce, the tag and a keyless
//! guard (CRC-32C of the context and the ciphertext).
//!
//! Opened with the key, every read authenticates (a failure is the fault
//! `auth_failed`, naming the LBA) and decrypts in place before a byte
//! leaves the engine. Scans (check, verify, scrub) check the keyless guard
//! too, so they find whatever a keyless scrub would; a client read skips
//! it when authentication passes (`open_for_client`) and checks it to name
//! the fault when it does not. Opened without the key (keyless
//! verification, read-only), only the keyless guard is checked and the
//! data stays ciphertext.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce};
use rand::RngCore;
use vouch_format::context::ENCRYPTED_NONCE_RANDOM;
use vouch_format::{aead_nonce, encrypted_guard, Context, ContextKind, FormatError, BLOCK_SIZE};

use crate::error::FaultKind;
use crate::protection::{zero_template, Protection, Seal};

/// The AEAD nonce, the generation and the tag of a block that passed the
/// keyless check.
type Sealed<'a> = ([u8; 12], u32, &'a [u8; 16]);

/// The `Protection` of an encrypted volume (module docs).
pub struct EncryptedProtection {
    /// `None`: keyless (check the keyless guard only; never decrypt).
    cipher: Option<LessSafeKey>,
    uuid: [u8; 16],
    volume_tag: u32,
}

impl EncryptedProtection {
    /// With the volume's data key: seals, authenticates and decrypts.
    pub fn new(data_key: &[u8], uuid: [u8; 16], volume_tag: u32) -> EncryptedProtection {
        EncryptedProtection {
            cipher: Some(crate::keys::cipher(data_key)),
            uuid,
            volume_tag,
        }
    }

    /// Without the key: checks the keyless guard only (read-only volumes).
    pub fn keyless(uuid: [u8; 16], volume_tag: u32) -> EncryptedProtection {
        EncryptedProtection {
            cipher: None,
            uuid,
            volume_tag,
        }
    }

    /// Associated data: volume uuid || LBA || generation (little-endian).
    fn aad(&self, lba: u64, generation: u32) -> [u8; 28] {
        let mut aad = [0u8; 28];
        aad[..16].copy_from_slice(&self.uuid);
        aad[16..24].copy_from_slice(&lba.to_le_bytes());
        aad[24..].copy_from_slice(&generation.to_le_bytes());
        aad
    }

    /// Authenticate and decrypt `stored` in place (on failure its bytes
    /// are unspecified).
    fn decrypt_in_place(
        &self,
        cipher: &LessSafeKey,
        lba: u64,
        (nonce, generation, tag): Sealed<'_>,
        stored: &mut [u8],
    ) -> Result<(), FaultKind> {
        cipher
            .open_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(self.aad(lba, generation)),
                tag,
                stored,
            )
            .map(|_| ())
            .map_err(|_| FaultKind::AuthFailed)
    }

    /// The encrypted parts of a context, or the fault of one that is not
    /// a valid kind-3 context with a matching keyless guard.
    fn check_keyless<'a>(
        &self,
        lba: u64,
        context: &'a Result<Context, FormatError>,
        stored: &[u8],
    ) -> Result<Option<Sealed<'a>>, FaultKind> {
        match context {
            Err(FormatError::Vacant { volume_tag, .. }) if *volume_tag != self.volume_tag => {
                Err(FaultKind::VolumeTagMismatch)
            }
            Err(error) => Err(crate::protection::context_fault(error)),
            Ok(Context::Unwritten) => Ok(None),
            Ok(Context::Zero {
                volume_tag,
                ref_tag,
                ..
            }) => {
                if *volume_tag != self.volume_tag {
                    return Err(FaultKind::VolumeTagMismatch);
                }
                if *ref_tag != lba {
                    return Err(FaultKind::RefTagMismatch);
                }
                Ok(None)
            }
            // Plain data in an encrypted volume: never written by vouch.
            Ok(Context::Data { .. }) => Err(FaultKind::ContextCorrupt),
            Ok(Context::Encrypted {
                generation,
                nonce,
                tag,
                guard,
            }) => {
                if encrypted_guard(*generation, nonce, tag, stored) != *guard {
                    return Err(FaultKind::GuardMismatch);
                }
                Ok(Some((aead_nonce(*generation, nonce), *generation, tag)))
            }
        }
    }
}

impl Protection for EncryptedProtection {
    fn seal(&self, lba: u64, data: &mut [u8], generation: u64) -> Seal {
        let cipher = self
            .cipher
            .as_ref()
            .expect("a keyless encrypted volume is read-only: nothing is sealed");
        // The low 32 bits, as in a plain context's generation field.
        let generation = generation as u32;
        let mut nonce = [0u8; ENCRYPTED_NONCE_RANDOM];
        rand::thread_rng().fill_bytes(&mut nonce);
        let sealed = cipher
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(aead_nonce(generation, &nonce)),
                Aad::from(self.aad(lba, generation)),
                data,
            )
            .expect("AES-256-GCM-SIV seals a 4 KiB block");
        let mut tag = [0u8; 16];
        tag.copy_from_slice(sealed.as_ref());
        Seal {
            guard: u64::from(encrypted_guard(generation, &nonce, &tag, data)),
            generation,
            nonce,
            tag,
        }
    }

    fn context(&self, _lba: u64, seal: Seal, _generation: u64) -> Context {
        Context::Encrypted {
            generation: seal.generation,
            nonce: seal.nonce,
            tag: seal.tag,
            guard: seal.guard as u32,
        }
    }

    fn zero_template(&self, allocate: bool) -> Context {
        zero_template(self.volume_tag, allocate)
    }

    /// Check without changing `stored`: the keyless guard, then (with the
    /// key) authentication, decrypting into a scratch block.
    fn open(
        &self,
        lba: u64,
        context: &Result<Context, FormatError>,
        stored: &[u8],
    ) -> Result<(), FaultKind> {
        let Some((nonce, generation, tag)) = self.check_keyless(lba, context, stored)? else {
            return Ok(());
        };
        let Some(cipher) = &self.cipher else {
            return Ok(());
        };
        let mut scratch = [0u8; BLOCK_SIZE as usize];
        let scratch = &mut scratch[..stored.len()];
        cipher
            .open_separate_gather(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(self.aad(lba, generation)),
                stored,
                tag,
                scratch,
            )
            .map_err(|_| FaultKind::AuthFailed)
    }

    fn open_in_place(
        &self,
        lba: u64,
        context: &Result<Context, FormatError>,
        stored: &mut [u8],
    ) -> Result<(), FaultKind> {
        let Some((nonce, generation, tag)) = self.check_keyless(lba, context, stored)? else {
            return Ok(());
        };
        match &self.cipher {
            Some(cipher) => self.decrypt_in_place(cipher, lba, (nonce, generation, tag), stored),
            None => Ok(()),
        }
    }

    /// With the key, authentication alone: the AEAD covers the nonce (kind
    /// byte and generation), the tag, the ciphertext and the place, which
    /// is all the keyless guard covers but the guard's own four bytes. That
    /// CRC pass cost a third as much as decrypting (perf, 1 MiB reads); a
    /// failure is re-read and classified by `open_in_place`, and scans still
    /// check both, so a damaged guard alone is found by scrub and check.
    fn open_for_client(
        &self,
        lba: u64,
        context: &Result<Context, FormatError>,
        stored: &mut [u8],
    ) -> Result<(), FaultKind> {
        match (context, &self.cipher) {
            (
                Ok(Context::Encrypted {
                    generation,
                    nonce,
                    tag,
                    ..
                }),
                Some(cipher),
            ) => self.decrypt_in_place(
                cipher,
                lba,
                (aead_nonce(*generation, nonce), *generation, tag),
                stored,
            ),
            _ => self.open_in_place(lba, context, stored),
        }
    }

    fn reveal(&self, lba: u64, seal: &Seal, data: &mut [u8]) -> Result<(), FaultKind> {
        let context = Ok(self.context(lba, *seal, 0));
        self.open_in_place(lba, &context, data)
    }

    fn matches(&self, context: &Context, stored: &[u8]) -> bool {
        match context {
            Context::Encrypted {
                generation,
                nonce,
                tag,
                guard,
            } => encrypted_guard(*generation, nonce, tag, stored) == *guard,
            Context::Data { .. } => false,
            other => other.reads_as_zero(),
        }
    }

    fn seal_of(&self, context: &Context) -> Option<Seal> {
        match context {
            Context::Encrypted {
                generation,
                nonce,
                tag,
                guard,
            } => Some(Seal {
                guard: u64::from(*guard),
                generation: *generation,
                nonce: *nonce,
                tag: *tag,
            }),
            _ => None,
        }
    }
}

/// Whether an encrypted context (32 encoded bytes) is `expected`'s write
/// with only its stored generation damaged since: its keyless guard fails
/// over `stored` (a block's 4 KiB as stored) as the context lies and holds
/// with `expected` in place of its generation, whichever bits of the
/// generation differ (one flipped, two, a byte). `false` when the guard
/// holds as it lies, or fails with the expected generation too: a context
/// damaged elsewhere, or another write's context over this data (an older
/// copy of the `contexts` file over the current data file), whose nonce,
/// tag and guard are another write's, so it passes once in 2^32 (a 32-bit
/// CRC's chance for the one generation tried). The caller
/// (`WrittenMap::stale_page_read`) passes the page's expected generation,
/// which a split page's newest context holds exactly.
///
/// CRC-32C is affine: flipping bit `b` of the guarded bytes changes the
/// guard by a constant that depends only on `b` and the length, and
/// flipping several changes it by the xor of theirs, so one guard over
/// the data and the xor of at most 32 constants (computed once) answer
/// it, not a second guard.
pub(crate) fn generation_damaged_from(context: &[u8], stored: &[u8], expected: u32) -> bool {
    if context[0] != ContextKind::Encrypted as u8 || stored.len() != BLOCK_SIZE as usize {
        return false;
    }
    let generation = u32::from_le_bytes(context[1..5].try_into().expect("4 bytes"));
    let nonce = context[5..12].try_into().expect("7 bytes");
    let tag = context[12..28].try_into().expect("16 bytes");
    let stored_guard = u32::from_le_bytes(context[28..32].try_into().expect("4 bytes"));
    let off = encrypted_guard(generation, nonce, tag, stored) ^ stored_guard;
    let flipped = generation ^ expected;
    off != 0
        && flipped != 0
        && generation_bit_syndromes()
            .iter()
            .enumerate()
            .filter(|(bit, _)| flipped >> bit & 1 == 1)
            .fold(0, |sum, (_, syndrome)| sum ^ syndrome)
            == off
}

/// How flipping each bit of an encrypted context's generation changes its
/// keyless guard over a 4 KiB block: the CRC of that one bit set in the
/// guarded bytes, less the CRC of as many zeros (CRC-32C's init and final
/// xor cancel in the difference).
fn generation_bit_syndromes() -> &'static [u32; 32] {
    static SYNDROMES: std::sync::OnceLock<[u32; 32]> = std::sync::OnceLock::new();
    SYNDROMES.get_or_init(|| {
        let mut bytes = vec![0u8; 28 + BLOCK_SIZE as usize];
        let zeros = vouch_format::crc32c(&bytes);
        std::array::from_fn(|bit| {
            bytes[1 + bit / 8] ^= 1 << (bit % 8);
            let syndrome = vouch_format::crc32c(&bytes) ^ zeros;
            bytes[1 + bit / 8] ^= 1 << (bit % 8);
            syndrome
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(
        protection: &EncryptedProtection,
        lba: u64,
        plain: &[u8; 4096],
    ) -> ([u8; 4096], Context) {
        let mut data = *plain;
        let seal = protection.seal(lba, &mut data, 1);
        (data, protection.context(lba, seal, 1))
    }

    #[test]
    fn a_sealed_block_opens_only_at_its_lba_in_its_volume_with_its_key() {
        let protection = EncryptedProtection::new(&[9u8; 32], [1u8; 16], 5);
        let plain = [0x42u8; 4096];
        let (stored, context) = sealed(&protection, 7, &plain);
        assert!(
            stored.windows(8).all(|w| w != &plain[..8]),
            "ciphertext hides the data"
        );
        assert_eq!(protection.open(7, &Ok(context), &stored), Ok(()));
        let mut opened = stored;
        assert_eq!(
            protection.open_in_place(7, &Ok(context), &mut opened),
            Ok(())
        );
        assert_eq!(opened, plain);
        // Another LBA (a swap or misdirected write) fails authentication.
        let mut moved = stored;
        assert_eq!(
            protection.open_in_place(8, &Ok(context), &mut moved),
            Err(FaultKind::AuthFailed)
        );
        // Another volume, another key.
        let other_volume = EncryptedProtection::new(&[9u8; 32], [2u8; 16], 5);
        assert_eq!(
            other_volume.open(7, &Ok(context), &stored),
            Err(FaultKind::AuthFailed)
        );
        let other_key = EncryptedProtection::new(&[8u8; 32], [1u8; 16], 5);
        assert_eq!(
            other_key.open(7, &Ok(context), &stored),
            Err(FaultKind::AuthFailed)
        );
        // Two writes of the same data differ (fresh nonce).
        let (again, _) = sealed(&protection, 7, &plain);
        assert_ne!(again, stored);
    }

    #[test]
    fn flipped_bits_are_found_with_and_without_the_key() {
        let protection = EncryptedProtection::new(&[3u8; 32], [4u8; 16], 5);
        let keyless = EncryptedProtection::keyless([4u8; 16], 5);
        let (stored, context) = sealed(&protection, 11, &[7u8; 4096]);
        assert_eq!(keyless.open(11, &Ok(context), &stored), Ok(()));
        let mut flipped = stored;
        flipped[1000] ^= 4;
        for checker in [&protection, &keyless] {
            assert_eq!(
                checker.open(11, &Ok(context), &flipped),
                Err(FaultKind::GuardMismatch)
            );
        }
        let encoded = context.encode();
        for byte in [1usize, 11, 12, 27, 28, 31] {
            let mut bad = encoded;
            bad[byte] ^= 0x10;
            let bad = Context::decode(&bad);
            assert_eq!(
                protection.open(11, &bad, &stored),
                Err(FaultKind::GuardMismatch)
            );
            assert_eq!(
                keyless.open(11, &bad, &stored),
                Err(FaultKind::GuardMismatch)
            );
        }
        // A consistent forgery (guard recomputed) still fails authentication.
        let Context::Encrypted {
            generation,
            nonce,
            mut tag,
            ..
        } = context
        else {
            unreachable!("an encrypted context")
        };
        tag[0] ^= 1;
        let forged = Context::Encrypted {
            generation,
            nonce,
            tag,
            guard: encrypted_guard(generation, &nonce, &tag, &stored),
        };
        assert_eq!(keyless.open(11, &Ok(forged), &stored), Ok(()));
        assert_eq!(
            protection.open(11, &Ok(forged), &stored),
            Err(FaultKind::AuthFailed)
        );
        // So does a changed generation with its guard recomputed: the
        // generation is associated data (and part of the nonce).
        tag[0] ^= 1;
        let forged = Context::Encrypted {
            generation: generation + 1,
            nonce,
            tag,
            guard: encrypted_guard(generation + 1, &nonce, &tag, &stored),
        };
        assert_eq!(keyless.open(11, &Ok(forged), &stored), Ok(()));
        assert_eq!(
            protection.open(11, &Ok(forged), &stored),
            Err(FaultKind::AuthFailed)
        );
        assert!(protection.matches(&context, &stored));
        assert!(!protection.matches(&context, &flipped));
    }

    /// Generation bits flipped in a stored encrypted context are told from
    /// another write's context over the same LBA's current data: the first
    /// holds its guard with the expected generation back, the second not.
    #[test]
    fn flipped_generation_bits_hold_the_guard_with_the_expected_generation() {
        let protection = EncryptedProtection::new(&[5u8; 32], [6u8; 16], 5);
        let mut stored = [0x17u8; 4096];
        let old = protection.context(9, protection.seal(9, &mut stored.clone(), 40), 40);
        let expected: u32 = 0x8000_0041;
        let seal = protection.seal(9, &mut stored, u64::from(expected));
        let context = protection.context(9, seal, u64::from(expected)).encode();
        assert!(
            !generation_damaged_from(&context, &stored, expected),
            "whole"
        );
        let damaged = |flips: u32| {
            let mut damaged = context;
            let generation = u32::from_le_bytes(damaged[1..5].try_into().unwrap()) ^ flips;
            damaged[1..5].copy_from_slice(&generation.to_le_bytes());
            damaged
        };
        // One bit, every pair of bits, and a whole byte of the generation.
        let pairs = (0..32).flat_map(|a| (0..a).map(move |b| (1u32 << a) | (1 << b)));
        for flips in (0..32).map(|bit| 1u32 << bit).chain(pairs).chain([0xff00]) {
            let flipped = damaged(flips);
            // The brute-force answer: the guard of the repaired context.
            let Context::Encrypted {
                nonce, tag, guard, ..
            } = Context::decode(&flipped).unwrap()
            else {
                unreachable!("an encrypted context")
            };
            assert_eq!(encrypted_guard(expected, &nonce, &tag, &stored), guard);
            assert!(
                generation_damaged_from(&flipped, &stored, expected),
                "flips {flips:#x}"
            );
            // Repaired only to the generation it was written with.
            assert!(!generation_damaged_from(&flipped, &stored, expected ^ 4));
        }
        // Another write's context (an older copy of the page) over this
        // data, at its own generation and one bit from the expected one,
        // and a bit flipped elsewhere in the context (its generation is
        // whole: nothing to repair).
        assert!(!generation_damaged_from(&old.encode(), &stored, expected));
        assert!(!generation_damaged_from(&old.encode(), &stored, 40 ^ 1));
        let mut tag_flipped = context;
        tag_flipped[20] ^= 4;
        assert!(!generation_damaged_from(&tag_flipped, &stored, expected));
        let mut both = damaged(3);
        both[20] ^= 4;
        assert!(!generation_damaged_from(&both, &stored, expected));
    }
}
