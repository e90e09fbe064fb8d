//! The superblock: identity, geometry, algorithms, feature flags and the
//! journal checkpoint. Two copies (at byte 0 and 4096 of the `superblock`
//! file), each with its own CRC-32C; the valid copy with the higher
//! generation wins, so a torn superblock write always leaves the other.

use crate::bytes::{get_u32, get_u64, put_u32, put_u64};
use crate::layout::{Geometry, LayoutKind};
use crate::{crc32c, Field, FormatError, GuardKind, BLOCK_SIZE};

/// Meaningful bytes of a superblock copy; the rest of its 4 KiB is zero.
pub const SUPERBLOCK_BYTES: usize = 256;
/// Each copy occupies one 4 KiB block of the `superblock` file.
pub const SUPERBLOCK_SLOT_BYTES: u64 = 4096;
pub const SUPERBLOCK_COPIES: u64 = 2;
pub const MAGIC: [u8; 8] = *b"VOUCHVOL";
pub const FORMAT_VERSION: u32 = 1;
/// Sequence numbers and generations stay below this (2^62: centuries of
/// checkpoints at millions per second).
pub const MAX_SEQUENCE: u64 = 1 << 62;

/// Feature flags in the three ext4-style sets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FeatureFlags {
    /// An older binary may ignore unknown bits here.
    pub compat: u64,
    /// An older binary that does not know a bit here may only open read-only.
    pub ro_compat: u64,
    /// An older binary that does not know a bit here must refuse to open.
    pub incompat: u64,
}

impl FeatureFlags {
    /// Trim punches holes in data segments (informational).
    pub const COMPAT_HOLE_PUNCH: u64 = 1 << 0;
    /// Contexts are made crash-consistent by the context journal (v1: always).
    pub const INCOMPAT_CONTEXT_JOURNAL: u64 = 1 << 0;
    /// Data segments use the packed (record) layout.
    pub const INCOMPAT_PACKED_LAYOUT: u64 = 1 << 1;
    /// Blocks are encrypted (AES-256-GCM-SIV contexts, kind 3); the
    /// superblock's key fields hold the wrapped data key.
    pub const INCOMPAT_ENCRYPTED: u64 = 1 << 2;
    /// The volume keeps a written map (`written`: which metadata units
    /// hold protection information), so lost metadata reads as a fault,
    /// never as never-written blocks. Set on every new volume; older
    /// volumes open read-only until `vouch upgrade` builds the map.
    pub const INCOMPAT_WRITTEN_MAP: u64 = 1 << 3;
    /// Every metadata unit that holds protection information (a split
    /// context page, a packed row) is whole: its never-written and trimmed
    /// slots hold vacant markers bound to their LBA and volume (kind 5),
    /// so a blank slot in a written unit is lost metadata and a unit from
    /// another place or volume fails on every block. Set on every new
    /// volume; older volumes open read-only until `vouch upgrade` writes
    /// the markers.
    pub const INCOMPAT_BOUND_UNITS: u64 = 1 << 4;
    /// The layout is chosen per region (`regions`, `vouch migrate`): the
    /// volume is two members, itself and `layout.NAME/`, each serving the
    /// regions the region record gives it. Set in both members. The engine
    /// opens such a superblock only for the region layer (`Regions`).
    pub const INCOMPAT_REGIONS: u64 = 1 << 5;
    /// A fenced snapshot of the volume is being materialised
    /// (`snapshots/.NAME.partial/fence`): every home write must first have
    /// the old bytes it covers durable in the snapshot's before-image log.
    /// A binary that knows no fences would write home without them, so it
    /// must refuse the volume. Set before the fence is written, cleared
    /// once the snapshot is published or has failed (and by the next open
    /// that finds no fence).
    pub const INCOMPAT_FENCED: u64 = 1 << 6;
    /// The volume is an overlay snapshot (`snapshots/NAME/overlay`): its
    /// data segments, context table and written map are the volume's own
    /// files read through its before-image log (`before`). Set only with
    /// RO_COMPAT_SNAPSHOT; a binary from before overlays refuses it rather
    /// than find those files missing.
    pub const INCOMPAT_OVERLAY: u64 = 1 << 7;
    /// The volume has an overlay snapshot (`snapshots/NAME/overlay`):
    /// every home write to its data, contexts or written map must first
    /// image the old bytes into that snapshot's log, which this binary's
    /// writable open arms. A binary from before overlays refuses it rather
    /// than write home without images. Set before the snapshot is
    /// published, cleared after its delete is durable.
    pub const INCOMPAT_OVERLAID: u64 = 1 << 8;

    /// The volume is a read-only snapshot (`vouch snapshot create`): a
    /// copy of another volume's files at a flush point, never written.
    /// Ro-compat, so a binary from before snapshots opens it read-only
    /// too; this binary opens it read-only whatever it is asked
    /// (`vouch clone` makes a writable volume of it).
    pub const RO_COMPAT_SNAPSHOT: u64 = 1 << 0;

    pub const SUPPORTED_COMPAT: u64 = Self::COMPAT_HOLE_PUNCH;
    pub const SUPPORTED_RO_COMPAT: u64 = Self::RO_COMPAT_SNAPSHOT;
    pub const SUPPORTED_INCOMPAT: u64 = Self::INCOMPAT_CONTEXT_JOURNAL
        | Self::INCOMPAT_PACKED_LAYOUT
        | Self::INCOMPAT_ENCRYPTED
        | Self::INCOMPAT_WRITTEN_MAP
        | Self::INCOMPAT_BOUND_UNITS
        | Self::INCOMPAT_REGIONS
        | Self::INCOMPAT_FENCED
        | Self::INCOMPAT_OVERLAY
        | Self::INCOMPAT_OVERLAID;

    pub fn for_layout(layout: LayoutKind) -> FeatureFlags {
        let mut incompat = Self::INCOMPAT_CONTEXT_JOURNAL
            | Self::INCOMPAT_WRITTEN_MAP
            | Self::INCOMPAT_BOUND_UNITS;
        if layout == LayoutKind::Packed {
            incompat |= Self::INCOMPAT_PACKED_LAYOUT;
        }
        FeatureFlags {
            compat: Self::COMPAT_HOLE_PUNCH,
            ro_compat: 0,
            incompat,
        }
    }

    /// Incompat bits this binary does not understand (non-zero: refuse to open).
    pub fn unknown_incompat(&self) -> u64 {
        self.incompat & !Self::SUPPORTED_INCOMPAT
    }
    /// Ro-compat bits this binary does not understand (non-zero: read-only).
    pub fn unknown_ro_compat(&self) -> u64 {
        self.ro_compat & !Self::SUPPORTED_RO_COMPAT
    }
}

/// How the user's key of an encrypted volume was made (`KeyWrap::kdf`).
pub const KDF_RAW: u8 = 0;
/// The user's key is Argon2id(passphrase, `kdf_salt`, costs).
pub const KDF_ARGON2ID: u8 = 1;

/// An encrypted volume's key material in the superblock: the random data
/// key wrapped (AES-256-GCM-SIV) by the user's key, and how a passphrase
/// becomes the user's key. All zero in a plain volume. The wrap's tag is
/// the key-check value: a wrong user key fails to unwrap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyWrap {
    /// `KDF_RAW` (a 32-byte key given as is) or `KDF_ARGON2ID`.
    pub kdf: u8,
    /// Argon2id memory cost in KiB.
    pub kdf_m_cost_kib: u32,
    /// Argon2id passes.
    pub kdf_t_cost: u32,
    /// Argon2id lanes.
    pub kdf_parallelism: u32,
    pub kdf_salt: [u8; 16],
    pub wrap_nonce: [u8; 12],
    /// The data key, encrypted under the user's key.
    pub wrapped_key: [u8; 32],
    /// The wrap's AEAD tag: checks the user's key before anything is read.
    pub key_check: [u8; 16],
}

/// Clean-shutdown state recorded in the superblock.
pub const STATE_OPEN: u32 = 0;
pub const STATE_CLEAN: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub version: u32,
    pub features: FeatureFlags,
    pub uuid: [u8; 16],
    pub block_size: u32,
    pub guard: GuardKind,
    pub layout: LayoutKind,
    pub size_bytes: u64,
    pub segment_blocks: u64,
    pub journal_bytes: u64,
    /// Incremented on every superblock write; the higher valid copy wins.
    pub generation: u64,
    /// Every journal commit with a sequence number <= this is fully applied
    /// to its home locations; the journal restarts after it.
    pub checkpoint_seq: u64,
    pub state: u32,
    pub created_unix_secs: u64,
    /// Encrypted volumes only (all zero otherwise).
    pub key_wrap: KeyWrap,
    /// The `seq` of the written map's generations copy whose expected
    /// values hold as of this superblock (0: none does). Written by every
    /// checkpoint after the copy's fsync; a binary from before the field
    /// writes it as zero (reserved bytes), so the values it may have made
    /// stale (a trim or a rewrite it did not record in them) are not
    /// known after it, never believed.
    pub generations_seq: u64,
    /// REGIONS volumes (the home member): the `seq` of the region record
    /// copy (`regions`) that holds as of this superblock; a valid copy
    /// older than it is refused. 0 elsewhere.
    pub regions_seq: u64,
    /// This volume's instance: random at `create` and `import`, new in
    /// every clone, kept by a snapshot (the same volume, read-only) and
    /// by a mirror's legs (copies of one volume). The uuid (and so every
    /// tag and the encryption AD) is shared by a clone and its origin;
    /// the instance tells them apart, so a clone is never taken for a
    /// member of its origin's mirror. All zero: *unknown* (made by, or
    /// last rewritten by, a binary from before the field, which writes
    /// reserved bytes as zero): such a member is recognised by its uuid
    /// alone, as before, and only beside members that are unknown too.
    pub instance: [u8; 16],
}

impl Superblock {
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
            name: "header_bytes",
            offset: 12,
            size: 4,
        },
        Field {
            name: "compat",
            offset: 16,
            size: 8,
        },
        Field {
            name: "ro_compat",
            offset: 24,
            size: 8,
        },
        Field {
            name: "incompat",
            offset: 32,
            size: 8,
        },
        Field {
            name: "uuid",
            offset: 40,
            size: 16,
        },
        Field {
            name: "block_size",
            offset: 56,
            size: 4,
        },
        Field {
            name: "guard",
            offset: 60,
            size: 1,
        },
        Field {
            name: "layout",
            offset: 61,
            size: 1,
        },
        Field {
            name: "reserved0",
            offset: 62,
            size: 2,
        },
        Field {
            name: "size_bytes",
            offset: 64,
            size: 8,
        },
        Field {
            name: "segment_blocks",
            offset: 72,
            size: 8,
        },
        Field {
            name: "journal_bytes",
            offset: 80,
            size: 8,
        },
        Field {
            name: "generation",
            offset: 88,
            size: 8,
        },
        Field {
            name: "checkpoint_seq",
            offset: 96,
            size: 8,
        },
        Field {
            name: "state",
            offset: 104,
            size: 4,
        },
        Field {
            name: "reserved1",
            offset: 108,
            size: 4,
        },
        Field {
            name: "created_unix_secs",
            offset: 112,
            size: 8,
        },
        Field {
            name: "kdf",
            offset: 120,
            size: 1,
        },
        Field {
            name: "reserved2",
            offset: 121,
            size: 3,
        },
        Field {
            name: "kdf_m_cost_kib",
            offset: 124,
            size: 4,
        },
        Field {
            name: "kdf_t_cost",
            offset: 128,
            size: 4,
        },
        Field {
            name: "kdf_parallelism",
            offset: 132,
            size: 4,
        },
        Field {
            name: "kdf_salt",
            offset: 136,
            size: 16,
        },
        Field {
            name: "wrap_nonce",
            offset: 152,
            size: 12,
        },
        Field {
            name: "wrapped_key",
            offset: 164,
            size: 32,
        },
        Field {
            name: "key_check",
            offset: 196,
            size: 16,
        },
        Field {
            name: "generations_seq",
            offset: 212,
            size: 8,
        },
        Field {
            name: "instance",
            offset: 220,
            size: 16,
        },
        Field {
            name: "regions_seq",
            offset: 236,
            size: 8,
        },
        Field {
            name: "reserved4",
            offset: 244,
            size: 8,
        },
        Field {
            name: "crc",
            offset: 252,
            size: 4,
        },
    ];

    pub fn geometry(&self) -> Result<Geometry, FormatError> {
        Geometry::new(self.layout, self.size_bytes, self.segment_blocks)
    }

    /// The 32-bit tag of `instance` a replica reports (docs/PROTOCOL.md,
    /// INFO): 0 for an unknown instance, never 0 otherwise.
    pub fn instance_tag(&self) -> u32 {
        if self.instance == [0; 16] {
            0
        } else {
            crc32c(&self.instance).max(1)
        }
    }

    /// The 32-bit tag that binds contexts to this volume.
    pub fn volume_tag(&self) -> u32 {
        crc32c(&self.uuid)
    }

    pub fn encode(&self) -> [u8; SUPERBLOCK_BYTES] {
        let mut out = [0u8; SUPERBLOCK_BYTES];
        out[0..8].copy_from_slice(&MAGIC);
        put_u32(&mut out, 8, self.version);
        put_u32(&mut out, 12, SUPERBLOCK_BYTES as u32);
        put_u64(&mut out, 16, self.features.compat);
        put_u64(&mut out, 24, self.features.ro_compat);
        put_u64(&mut out, 32, self.features.incompat);
        out[40..56].copy_from_slice(&self.uuid);
        put_u32(&mut out, 56, self.block_size);
        out[60] = self.guard as u8;
        out[61] = self.layout as u8;
        put_u64(&mut out, 64, self.size_bytes);
        put_u64(&mut out, 72, self.segment_blocks);
        put_u64(&mut out, 80, self.journal_bytes);
        put_u64(&mut out, 88, self.generation);
        put_u64(&mut out, 96, self.checkpoint_seq);
        put_u32(&mut out, 104, self.state);
        put_u64(&mut out, 112, self.created_unix_secs);
        let wrap = &self.key_wrap;
        out[120] = wrap.kdf;
        put_u32(&mut out, 124, wrap.kdf_m_cost_kib);
        put_u32(&mut out, 128, wrap.kdf_t_cost);
        put_u32(&mut out, 132, wrap.kdf_parallelism);
        out[136..152].copy_from_slice(&wrap.kdf_salt);
        out[152..164].copy_from_slice(&wrap.wrap_nonce);
        out[164..196].copy_from_slice(&wrap.wrapped_key);
        out[196..212].copy_from_slice(&wrap.key_check);
        put_u64(&mut out, 212, self.generations_seq);
        put_u64(&mut out, 236, self.regions_seq);
        out[220..236].copy_from_slice(&self.instance);
        crate::seal(&mut out, 252);
        out
    }

    /// Decode one copy. Feature flags are *not* judged here (the engine
    /// decides between refusing, read-only and read-write).
    pub fn decode(raw: &[u8]) -> Result<Superblock, FormatError> {
        crate::check_sealed(raw, SUPERBLOCK_BYTES, &MAGIC, 252)?;
        let version = get_u32(raw, 8);
        if version != FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        let block_size = get_u32(raw, 56);
        if block_size != BLOCK_SIZE {
            return Err(FormatError::UnsupportedBlockSize(block_size));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&raw[40..56]);
        let superblock = Superblock {
            version,
            features: FeatureFlags {
                compat: get_u64(raw, 16),
                ro_compat: get_u64(raw, 24),
                incompat: get_u64(raw, 32),
            },
            uuid,
            block_size,
            guard: GuardKind::from_byte(raw[60])?,
            layout: LayoutKind::from_byte(raw[61])?,
            size_bytes: get_u64(raw, 64),
            segment_blocks: get_u64(raw, 72),
            journal_bytes: get_u64(raw, 80),
            generation: get_u64(raw, 88),
            checkpoint_seq: get_u64(raw, 96),
            state: get_u32(raw, 104),
            created_unix_secs: get_u64(raw, 112),
            key_wrap: KeyWrap {
                kdf: raw[120],
                kdf_m_cost_kib: get_u32(raw, 124),
                kdf_t_cost: get_u32(raw, 128),
                kdf_parallelism: get_u32(raw, 132),
                kdf_salt: raw[136..152].try_into().expect("16 bytes"),
                wrap_nonce: raw[152..164].try_into().expect("12 bytes"),
                wrapped_key: raw[164..196].try_into().expect("32 bytes"),
                key_check: raw[196..212].try_into().expect("16 bytes"),
            },
            generations_seq: get_u64(raw, 212),
            regions_seq: get_u64(raw, 236),
            instance: raw[220..236].try_into().expect("16 bytes"),
        };
        let encrypted = superblock.features.incompat & FeatureFlags::INCOMPAT_ENCRYPTED != 0;
        if !encrypted && superblock.key_wrap != KeyWrap::default() {
            return Err(FormatError::Geometry(
                "key fields are set but the volume is not encrypted",
            ));
        }
        if encrypted && superblock.key_wrap.kdf > KDF_ARGON2ID {
            return Err(FormatError::Geometry("unknown key derivation function"));
        }
        superblock.geometry()?;
        // Counters only ever grow by one per checkpoint: values near the top
        // of the range are corruption, and would overflow when incremented.
        if superblock.checkpoint_seq >= MAX_SEQUENCE || superblock.generation >= MAX_SEQUENCE {
            return Err(FormatError::Geometry(
                "checkpoint sequence or generation out of range",
            ));
        }
        if superblock.journal_bytes < 2 * 4096 || !superblock.journal_bytes.is_multiple_of(4096) {
            return Err(FormatError::Geometry(
                "journal_bytes must be a multiple of 4096, at least 8192",
            ));
        }
        let packed_flag = superblock.features.incompat & FeatureFlags::INCOMPAT_PACKED_LAYOUT != 0;
        if packed_flag != (superblock.layout == LayoutKind::Packed) {
            return Err(FormatError::Geometry(
                "layout field disagrees with the packed-layout flag",
            ));
        }
        Ok(superblock)
    }

    /// Pick the copy to trust from the two decoded copies.
    pub fn newest(
        first: Result<Superblock, FormatError>,
        second: Result<Superblock, FormatError>,
    ) -> Result<Superblock, FormatError> {
        match (first, second) {
            (Ok(a), Ok(b)) => Ok(if b.generation > a.generation { b } else { a }),
            (Ok(a), Err(_)) => Ok(a),
            (Err(_), Ok(b)) => Ok(b),
            (Err(a), Err(_)) => Err(a),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Superblock {
        Superblock {
            version: FORMAT_VERSION,
            features: FeatureFlags::for_layout(LayoutKind::Split),
            uuid: [0x11; 16],
            block_size: BLOCK_SIZE,
            guard: GuardKind::Crc32c,
            layout: LayoutKind::Split,
            size_bytes: 1 << 30,
            segment_blocks: 1 << 28,
            journal_bytes: 64 << 20,
            generation: 3,
            checkpoint_seq: 9,
            state: STATE_CLEAN,
            created_unix_secs: 1_700_000_000,
            key_wrap: KeyWrap::default(),
            generations_seq: 0,
            regions_seq: 0,
            // Unknown: the golden CRC below is of a superblock as a binary
            // from before the field wrote it, which this one reads alike.
            instance: [0; 16],
        }
    }

    #[test]
    fn key_wrap_round_trips_and_needs_the_flag() {
        let mut sb = sample();
        sb.features.incompat |= FeatureFlags::INCOMPAT_ENCRYPTED;
        sb.key_wrap = KeyWrap {
            kdf: KDF_ARGON2ID,
            kdf_m_cost_kib: 65536,
            kdf_t_cost: 3,
            kdf_parallelism: 1,
            kdf_salt: [1; 16],
            wrap_nonce: [2; 12],
            wrapped_key: [3; 32],
            key_check: [4; 16],
        };
        let bytes = sb.encode();
        assert_eq!(Superblock::decode(&bytes).unwrap(), sb);
        assert_eq!(&bytes[164..196], &[3u8; 32]);
        assert_eq!(&bytes[196..212], &[4u8; 16]);
        let mut plain = sb;
        plain.features.incompat &= !FeatureFlags::INCOMPAT_ENCRYPTED;
        assert!(Superblock::decode(&plain.encode()).is_err());
        let mut unknown_kdf = sb;
        unknown_kdf.key_wrap.kdf = 9;
        assert!(Superblock::decode(&unknown_kdf.encode()).is_err());
    }

    #[test]
    fn table_tiles_the_superblock() {
        assert!(crate::fields_tile(Superblock::FIELDS, SUPERBLOCK_BYTES));
    }

    #[test]
    fn round_trip_and_golden_crc() {
        let sb = sample();
        let bytes = sb.encode();
        assert_eq!(Superblock::decode(&bytes).unwrap(), sb);
        assert_eq!(&bytes[0..8], b"VOUCHVOL");
        // Golden: the whole encoding is pinned by its CRC. A change here means
        // the format changed: bump FORMAT_VERSION or add a feature flag.
        assert_eq!(
            get_u32(&bytes, 252),
            0x907d_f34c,
            "superblock encoding changed"
        );
        let mut with_instance = sb;
        with_instance.instance = [0x22; 16];
        let bytes = with_instance.encode();
        assert_eq!(&bytes[220..236], &[0x22; 16]);
        assert_eq!(Superblock::decode(&bytes).unwrap(), with_instance);
    }

    #[test]
    fn corruption_is_detected() {
        let bytes = sample().encode();
        for at in [0usize, 9, 40, 64, 100, 251, 252] {
            let mut bad = bytes;
            bad[at] ^= 0x40;
            assert!(Superblock::decode(&bad).is_err(), "byte {at}");
        }
        assert_eq!(
            Superblock::decode(&bytes[..100]),
            Err(FormatError::Truncated {
                need: 256,
                have: 100
            })
        );
    }

    /// Found by `cargo fuzz run superblock` (artifact kept in
    /// fuzz/corpus/superblock/): a well-checksummed superblock whose
    /// checkpoint sequence was u64::MAX overflowed when the volume opened.
    #[test]
    fn sequence_numbers_near_the_top_are_corruption() {
        for (checkpoint_seq, generation) in [(u64::MAX, 1), (1, u64::MAX), (MAX_SEQUENCE, 1)] {
            let mut sb = sample();
            sb.checkpoint_seq = checkpoint_seq;
            sb.generation = generation;
            assert!(matches!(
                Superblock::decode(&sb.encode()),
                Err(FormatError::Geometry(_))
            ));
        }
    }

    #[test]
    fn newest_copy_wins_and_survives_one_bad_copy() {
        let mut a = sample();
        let mut b = sample();
        a.generation = 4;
        b.generation = 5;
        assert_eq!(Superblock::newest(Ok(a), Ok(b)).unwrap().generation, 5);
        assert_eq!(
            Superblock::newest(Ok(a), Err(FormatError::BadMagic))
                .unwrap()
                .generation,
            4
        );
        assert!(
            Superblock::newest(Err(FormatError::BadMagic), Err(FormatError::BadMagic)).is_err()
        );
    }

    #[test]
    fn a_binary_from_before_fences_refuses_a_fenced_volume() {
        // What the binaries before the FENCED flag support (stop 41).
        let before = FeatureFlags::INCOMPAT_CONTEXT_JOURNAL
            | FeatureFlags::INCOMPAT_PACKED_LAYOUT
            | FeatureFlags::INCOMPAT_ENCRYPTED
            | FeatureFlags::INCOMPAT_WRITTEN_MAP
            | FeatureFlags::INCOMPAT_BOUND_UNITS
            | FeatureFlags::INCOMPAT_REGIONS;
        for layout in [LayoutKind::Split, LayoutKind::Packed] {
            let mut flags = FeatureFlags::for_layout(layout);
            assert_eq!(flags.incompat & !before, 0, "a new volume is not fenced");
            flags.incompat |= FeatureFlags::INCOMPAT_FENCED;
            assert_ne!(flags.incompat & !before, 0, "unknown to them: refused");
            assert_eq!(flags.unknown_incompat(), 0, "known to this binary");
        }
    }

    #[test]
    fn feature_masks() {
        let mut flags = FeatureFlags::for_layout(LayoutKind::Packed);
        assert_eq!(flags.unknown_incompat(), 0);
        flags.incompat |= 1 << 40;
        assert_eq!(flags.unknown_incompat(), 1 << 40);
        flags.ro_compat |= 1 << 3;
        assert_eq!(flags.unknown_ro_compat(), 1 << 3);
        flags.compat |= 1 << 9;
        assert_eq!(
            flags.unknown_incompat(),
            1 << 40,
            "unknown compat bits are ignored"
        );
        assert_eq!(
            flags.unknown_ro_compat(),
            1 << 3,
            "unknown compat bits are ignored"
        );
    }
}
