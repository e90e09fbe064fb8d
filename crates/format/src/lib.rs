//! The vouch on-disk format. No I/O happens here: this crate turns bytes into
//! typed structures and back, and says where things live.
//!
//! `docs/FORMAT.md` describes every structure as a byte table; the `FIELDS`
//! constant of each structure is the same table in code, and a test checks
//! the two against each other.

pub mod activity;
pub mod context;
pub mod dirty;
pub mod guard;
pub mod held;
pub mod journal;
pub mod layout;
pub mod mirror;
pub mod regions;
pub mod superblock;
pub mod written;

pub use context::{
    aead_nonce, encode_lost, encode_vacant, encrypted_guard, vacant_of, Context, ContextKind,
    CONTEXT_BYTES, KIND_LOST, KIND_VACANT,
};
pub use guard::{crc32c, GuardKind};
pub use journal::{JournalEntry, JournalHeader, JOURNAL_ENTRY_BYTES, JOURNAL_HEADER_BYTES};
pub use layout::{Geometry, LayoutKind};
pub use superblock::{FeatureFlags, KeyWrap, Superblock, SUPERBLOCK_BYTES};

/// The only block size this version writes. 512-byte blocks are a possible
/// later feature (it would be an incompat flag).
pub const BLOCK_SIZE: u32 = 4096;
/// Sector granularity: torn writes (512e media), and the unit in which the
/// replica protocol takes trims and zeroes. Reads and writes take any byte.
pub const SECTOR_SIZE: u32 = 512;

/// One named field of an on-disk structure: what `docs/FORMAT.md` tabulates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
}

/// Errors decoding on-disk bytes. Each says what was wrong, never just "bad".
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("bad magic (not a vouch structure)")]
    BadMagic,
    #[error("checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    BadChecksum { stored: u32, computed: u32 },
    #[error("unsupported format version {0}")]
    UnsupportedVersion(u32),
    #[error("unknown guard algorithm {0}")]
    UnknownGuard(u8),
    #[error("unknown context layout {0}")]
    UnknownLayout(u8),
    #[error("unknown context kind {0}")]
    UnknownContextKind(u8),
    #[error("unsupported block size {0}")]
    UnsupportedBlockSize(u32),
    #[error("inconsistent geometry: {0}")]
    Geometry(&'static str),
    /// The block was written but its protection information is gone (a
    /// lost marker, or a context page / packed row read as zeros where the
    /// written map says metadata was written).
    #[error("no protection information (its metadata is lost)")]
    MetadataLost,
    /// A vacant marker (a never-written slot of a written unit) read at a
    /// place it does not name: its unit was copied from another place or
    /// another volume.
    #[error("a vacant marker of LBA {ref_tag}, volume tag {volume_tag:#010x}, in another place")]
    Vacant { volume_tag: u32, ref_tag: u64 },
    #[error("truncated: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
}

/// Little-endian field access over a byte slice, used by every structure.
pub(crate) mod bytes {
    pub fn get_u32(buf: &[u8], at: usize) -> u32 {
        let mut raw = [0u8; 4];
        raw.copy_from_slice(&buf[at..at + 4]);
        u32::from_le_bytes(raw)
    }
    pub fn get_u64(buf: &[u8], at: usize) -> u64 {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(&buf[at..at + 8]);
        u64::from_le_bytes(raw)
    }
    pub fn put_u32(buf: &mut [u8], at: usize, value: u32) {
        buf[at..at + 4].copy_from_slice(&value.to_le_bytes());
    }
    pub fn put_u64(buf: &mut [u8], at: usize, value: u64) {
        buf[at..at + 8].copy_from_slice(&value.to_le_bytes());
    }
}

/// Write the CRC-32C of `out[..crc_at]` at `crc_at`: the last field of every
/// checksummed structure.
pub(crate) fn seal(out: &mut [u8], crc_at: usize) {
    let crc = crc32c(&out[..crc_at]);
    bytes::put_u32(out, crc_at, crc);
}

/// Check a structure of `size` bytes that starts with `magic` and ends with
/// the CRC-32C of everything before `crc_at`.
pub(crate) fn check_sealed(
    raw: &[u8],
    size: usize,
    magic: &[u8; 8],
    crc_at: usize,
) -> Result<(), FormatError> {
    if raw.len() < size {
        return Err(FormatError::Truncated {
            need: size,
            have: raw.len(),
        });
    }
    if raw[0..8] != *magic {
        return Err(FormatError::BadMagic);
    }
    let stored = bytes::get_u32(raw, crc_at);
    let computed = crc32c(&raw[..crc_at]);
    if stored != computed {
        return Err(FormatError::BadChecksum { stored, computed });
    }
    Ok(())
}

/// Checks that a `FIELDS` table tiles its structure with no gaps or overlaps.
pub fn fields_tile(fields: &[Field], total: usize) -> bool {
    let mut next = 0;
    for field in fields {
        if field.offset != next {
            return false;
        }
        next = field.offset + field.size;
    }
    next == total
}

#[cfg(test)]
mod tests {
    /// The suite's profile (`ci` in Cargo.toml) inherits release but turns
    /// overflow checks and debug assertions on for vouch's own crates: an
    /// overflow panics in a test instead of wrapping silently, as the
    /// superblock sequence overflow fuzzing found would have in release.
    #[test]
    fn the_suite_runs_with_overflow_checks_and_debug_assertions() {
        let debug = std::hint::black_box(cfg!(debug_assertions));
        assert!(debug, "debug assertions are off");
        let max = std::hint::black_box(u64::MAX);
        let sum = std::panic::catch_unwind(|| max + 1);
        assert!(sum.is_err(), "u64::MAX + 1 wrapped to {sum:?}");
    }
}
