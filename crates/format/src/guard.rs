//! Guard algorithms: the checksum half of a block's protection information.
//!
//! Every guard is stored zero-extended in a 64-bit field of the context, so
//! the context layout does not change with the algorithm.

use crate::FormatError;
use crc_fast::{checksum, CrcAlgorithm};

/// The checksum that protects a block's data. The discriminant is the byte
/// stored in the superblock: never renumber.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum GuardKind {
    /// No checksum: the reference tag and context structure are still checked.
    None = 0,
    /// CRC-32C (Castagnoli), the default: hardware-accelerated everywhere.
    Crc32c = 1,
    /// CRC-64/NVME, the NVMe 64-bit protection-information guard.
    Crc64Nvme = 2,
    /// CRC-16/T10-DIF, the SCSI/NVMe 16-bit guard.
    Crc16T10Dif = 3,
    /// XXH3-64, a fast non-cryptographic hash.
    Xxh3 = 4,
}

impl GuardKind {
    pub const ALL: [GuardKind; 5] = [
        GuardKind::None,
        GuardKind::Crc32c,
        GuardKind::Crc64Nvme,
        GuardKind::Crc16T10Dif,
        GuardKind::Xxh3,
    ];

    pub fn from_byte(byte: u8) -> Result<GuardKind, FormatError> {
        GuardKind::ALL
            .into_iter()
            .find(|guard| *guard as u8 == byte)
            .ok_or(FormatError::UnknownGuard(byte))
    }

    /// The name used on the command line and in `info` output.
    pub fn name(self) -> &'static str {
        match self {
            GuardKind::None => "none",
            GuardKind::Crc32c => "crc32c",
            GuardKind::Crc64Nvme => "crc64nvme",
            GuardKind::Crc16T10Dif => "crc16t10dif",
            GuardKind::Xxh3 => "xxh3",
        }
    }

    pub fn from_name(name: &str) -> Option<GuardKind> {
        GuardKind::ALL
            .into_iter()
            .find(|guard| guard.name() == name)
    }

    /// Width of the guard in bits (0 for `None`).
    pub fn bits(self) -> u32 {
        match self {
            GuardKind::None => 0,
            GuardKind::Crc16T10Dif => 16,
            GuardKind::Crc32c => 32,
            GuardKind::Crc64Nvme | GuardKind::Xxh3 => 64,
        }
    }

    /// Compute the guard of `data`, zero-extended to 64 bits.
    #[inline]
    pub fn compute(self, data: &[u8]) -> u64 {
        match self {
            GuardKind::None => 0,
            GuardKind::Crc32c => u64::from(crc32c_block(data)),
            GuardKind::Crc64Nvme => checksum(CrcAlgorithm::Crc64Nvme, data),
            GuardKind::Crc16T10Dif => checksum(CrcAlgorithm::Crc16T10Dif, data),
            GuardKind::Xxh3 => xxhash_rust::xxh3::xxh3_64(data),
        }
    }
}

/// CRC-32C of a data block by the faster implementation for this CPU.
/// crc-fast folds with VPCLMULQDQ only when AVX-512 is present (~97 ns a
/// 4 KiB block, ../shared/design/CRATES.md); without it, it falls back to
/// an SSE path (420-460 ns here, on an EPYC that exposes AVX2 and
/// VPCLMULQDQ but not AVX-512), where the `crc32c` crate's three-stream
/// SSE4.2 loop takes 255 ns (docs/BENCHMARKS.md).
#[inline]
fn crc32c_block(data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("vpclmulqdq")
    {
        return checksum(CrcAlgorithm::Crc32Iscsi, data) as u32;
    }
    crc32c::crc32c(data)
}

/// CRC-32C of metadata structures (superblock, contexts, journal records).
/// Metadata always uses CRC-32C, whatever the data guard is. These inputs
/// are short (28-252 bytes), where crc-fast is the quicker of the two crates.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    checksum(CrcAlgorithm::Crc32Iscsi, data) as u32
}

/// `crc32c` of the concatenation of `parts`, without joining them (a
/// journal record's entries and its data blocks, where they lie).
pub fn crc32c_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    let mut digest = crc_fast::Digest::new(CrcAlgorithm::Crc32Iscsi);
    for part in parts {
        digest.update(part);
    }
    digest.finalize() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHECK: &[u8] = b"123456789";

    #[test]
    fn known_answers_over_123456789() {
        assert_eq!(GuardKind::Crc16T10Dif.compute(CHECK), 0xD0DB);
        assert_eq!(GuardKind::Crc32c.compute(CHECK), 0xE306_9283);
        assert_eq!(GuardKind::Crc64Nvme.compute(CHECK), 0xAE8B_1486_0A79_9888);
        assert_eq!(GuardKind::None.compute(CHECK), 0);
        assert_eq!(crc32c(CHECK), 0xE306_9283);
        assert_eq!(
            crc32c_parts([&CHECK[..4], &[][..], &CHECK[4..]]),
            0xE306_9283
        );
    }

    proptest::proptest! {
        /// The data guard (crate `crc32c`) and the metadata CRC (crate
        /// crc-fast) are one function, CRC-32C, from two implementations.
        #[test]
        fn both_crc32c_implementations_agree(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..9000)) {
            proptest::prop_assert_eq!(u64::from(::crc32c::crc32c(&data)), u64::from(crc32c(&data)));
            proptest::prop_assert_eq!(GuardKind::Crc32c.compute(&data), u64::from(crc32c(&data)));
        }
    }

    #[test]
    fn guard_bytes_and_names_round_trip() {
        for guard in GuardKind::ALL {
            assert_eq!(GuardKind::from_byte(guard as u8).unwrap(), guard);
            assert_eq!(GuardKind::from_name(guard.name()), Some(guard));
            let value = guard.compute(&[0xA5; 4096]);
            if guard.bits() < 64 {
                assert_eq!(
                    value >> guard.bits(),
                    0,
                    "{} must be zero-extended",
                    guard.name()
                );
            }
        }
        assert!(GuardKind::from_byte(9).is_err());
    }
}
