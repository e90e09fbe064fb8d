//! The superblock on storage: two copies, the newest valid one wins; a
//! checkpoint writes the older copy, so a torn superblock write leaves the
//! other intact. Selection is written once, here, for both the file path
//! (`open_volume` learns the geometry before opening the other files) and
//! any `Storage`.

use vouch_format::superblock::{FORMAT_VERSION, STATE_CLEAN, SUPERBLOCK_SLOT_BYTES};
use vouch_format::{FeatureFlags, Geometry, GuardKind, KeyWrap, Superblock, BLOCK_SIZE};

use crate::error::{Error, Result};
use crate::options::CreateOptions;
use crate::state::BLOCK;
use crate::storage::{ObjectId, Storage};

/// Largest nominal volume: 1 PiB.
pub const MAX_VOLUME_BYTES: u64 = 1 << 50;

/// Pick the newest valid copy of two raw superblock slots (the two halves
/// of a volume's superblock file, or of a copy of it such as a mirror's
/// leg template): an error only when neither copy is valid.
pub fn select(first: &[u8], second: &[u8]) -> Result<Superblock> {
    let first = Superblock::decode(first);
    let second = Superblock::decode(second);
    if let (Err(a), Err(b)) = (&first, &second) {
        return Err(Error::Corrupt(format!(
            "not a usable vouch volume: both superblock copies are invalid (copy 0: {a}; copy 1: {b})"
        )));
    }
    if let Err(error) = &first {
        tracing::warn!(%error, "superblock copy 0 is invalid; using copy 1");
    }
    if let Err(error) = &second {
        tracing::warn!(%error, "superblock copy 1 is invalid; using copy 0");
    }
    Superblock::newest(first, second)
        .map_err(|error| Error::Corrupt(format!("corrupt superblock: {error}")))
}

/// Read both superblock copies and pick the newest valid one.
pub fn read_superblock(storage: &dyn Storage) -> Result<Superblock> {
    let slot = SUPERBLOCK_SLOT_BYTES as usize;
    let mut both = vec![0u8; 2 * slot];
    for (copy, bytes) in both.chunks_mut(slot).enumerate() {
        let offset = copy as u64 * SUPERBLOCK_SLOT_BYTES;
        storage
            .read_at(ObjectId::Superblock, offset, bytes)
            .map_err(|error| Error::io("read", ObjectId::Superblock, offset, error))?;
    }
    let (first, second) = both.split_at(slot);
    select(first, second)
}

pub(crate) fn write_superblock_copy(
    storage: &dyn Storage,
    superblock: &Superblock,
    copy: u64,
) -> Result<()> {
    let mut slot = vec![0u8; SUPERBLOCK_SLOT_BYTES as usize];
    slot[..vouch_format::SUPERBLOCK_BYTES].copy_from_slice(&superblock.encode());
    let offset = copy * SUPERBLOCK_SLOT_BYTES;
    storage
        .write_at(ObjectId::Superblock, offset, &slot)
        .map_err(|error| Error::io("write", ObjectId::Superblock, offset, error))
}

/// A volume size vouch can create: a positive multiple of 4096 bytes, at
/// most `MAX_VOLUME_BYTES`. Too large is reported first: a huge size is
/// rarely a multiple of 4096, and "too large" is the useful answer.
pub(crate) fn check_volume_size(size_bytes: u64) -> Result<()> {
    if size_bytes > MAX_VOLUME_BYTES {
        return Err(Error::InvalidArgument(format!(
            "size {size_bytes} is larger than the largest volume vouch supports ({MAX_VOLUME_BYTES} bytes, 1 PiB)"
        )));
    }
    if size_bytes == 0 || !size_bytes.is_multiple_of(BLOCK) {
        return Err(Error::InvalidArgument(format!(
            "size {size_bytes} is not a positive multiple of 4096 bytes"
        )));
    }
    Ok(())
}

/// A new volume instance id (`Superblock::instance`): random, never zero
/// (zero means *unknown*: a superblock written before the field).
pub fn new_instance() -> [u8; 16] {
    loop {
        let instance = *uuid::Uuid::new_v4().as_bytes();
        if instance != [0; 16] {
            return instance;
        }
    }
}

pub(crate) fn new_superblock(options: &CreateOptions) -> Result<Superblock> {
    check_volume_size(options.size_bytes)?;
    let journal_bytes = options.journal_bytes();
    if journal_bytes < 1 << 20 || !journal_bytes.is_multiple_of(BLOCK) {
        return Err(Error::InvalidArgument(
            "journal must be at least 1 MiB and a multiple of 4096".into(),
        ));
    }
    let segment_blocks = options.segment_blocks();
    Geometry::new(options.layout, options.size_bytes, segment_blocks)
        .map_err(|error| Error::InvalidArgument(format!("bad geometry: {error}")))?;
    let uuid = *uuid::Uuid::new_v4().as_bytes();
    let mut features = FeatureFlags::for_layout(options.layout);
    let mut key_wrap = KeyWrap::default();
    if let Some(secret) = &options.encrypt {
        if options.guard != GuardKind::Crc32c {
            return Err(Error::InvalidArgument(format!(
                "an encrypted volume's keyless guard is CRC-32C (with the AEAD tag); guard {} does not apply",
                options.guard.name()
            )));
        }
        features.incompat |= FeatureFlags::INCOMPAT_ENCRYPTED;
        key_wrap = secret.wrap(&uuid, &crate::keys::new_data_key())?;
    }
    Ok(Superblock {
        version: FORMAT_VERSION,
        features,
        uuid,
        block_size: BLOCK_SIZE,
        guard: options.guard,
        layout: options.layout,
        size_bytes: options.size_bytes,
        segment_blocks,
        journal_bytes,
        generation: 1,
        checkpoint_seq: 0,
        state: STATE_CLEAN,
        created_unix_secs: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs()),
        key_wrap,
        generations_seq: 0,
        regions_seq: 0,
        instance: new_instance(),
    })
}
