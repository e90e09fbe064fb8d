//! `Engine`: one open volume's parts, each owned by the path that uses it.
//!
//! - `shared` (`shared.rs`): what every path borrows — backing storage,
//!   protection, layouts, the in-memory state. Reads are methods on it.
//! - `committer` (`commit.rs`): the journal position and durability state,
//!   and the background committer's signal.
//! - the writers' stripe locks and tuning (`write.rs`).
//!
//! `Volume` (`volume.rs`) is the public handle; nothing outside the engine
//! sees these parts.

use std::sync::Arc;

use parking_lot::Mutex;
use vouch_format::{FeatureFlags, GuardKind, LayoutKind, Superblock};

use crate::backing::Backing;
use crate::commit::Committer;
use crate::encryption::EncryptedProtection;
use crate::error::{Error, Result};
use crate::held::HeldLog;
use crate::journal::Journal;
use crate::keys::{UserSecret, KEY_BYTES};
use crate::layout::LayoutMap;
use crate::options::{OpenOptions, Tuning};
use crate::protection::{GuardProtection, Protection};
use crate::recovery::{recover, RecoveryReport};
use crate::shared::Shared;
use crate::state::VolumeState;
use crate::storage::{ObjectId, Storage};
use crate::superblock::read_superblock;
use crate::written::WrittenMap;

/// What opening an encrypted volume without a key says.
pub const MISSING_KEY: &str = "the volume is encrypted and no key was given: give it with --key-file FILE (32 raw bytes), the VOUCH_KEY_FILE environment variable, or type its passphrase at the prompt on a terminal";

/// Writers to one block serialize on one of these (sub-block writes are
/// read-modify-write).
const STRIPES: usize = 64;

pub(crate) struct Engine {
    shared: Shared,
    committer: Committer,
    tuning: Tuning,
    stripes: Vec<Mutex<()>>,
    recovery: RecoveryReport,
    /// Fixed at creation; kept here so asking for it never waits for a
    /// commit (the superblock copy in `Journal` is behind the commit lock).
    guard: GuardKind,
    /// An encrypted volume's data key, when opened with its key (kept to
    /// rewrap it on a key change).
    data_key: Option<zeroize::Zeroizing<[u8; KEY_BYTES]>>,
    /// The volume is encrypted (fixed at creation).
    encrypted: bool,
    /// Files shorter than the volume needs, found at open (`damage.rs`).
    short_objects: Vec<crate::damage::ShortObject>,
}

impl Engine {
    /// Open a volume on `storage`, recovering from the journal if it was
    /// not closed cleanly.
    pub fn open(storage: Arc<dyn Storage>, options: &OpenOptions) -> Result<Engine> {
        Engine::open_counting(storage, options, None)
    }

    /// `open`, counting its I/O in `stats` when given (the counters of
    /// the engine an online resize replaces: `Volume::resize_online`).
    pub fn open_counting(
        storage: Arc<dyn Storage>,
        options: &OpenOptions,
        stats: Option<Arc<crate::stats::Stats>>,
    ) -> Result<Engine> {
        let mut superblock = read_superblock(&*storage)?;
        let unknown = superblock.features.unknown_incompat();
        if unknown != 0 {
            return Err(Error::Unsupported(format!(
                "volume uses incompatible features this vouch does not support (incompat bits {unknown:#x}); refusing to open"
            )));
        }
        if superblock.features.incompat & FeatureFlags::INCOMPAT_REGIONS != 0
            && !options.region_member
        {
            return Err(Error::Unsupported(format!(
                "it is a volume with regions (`vouch migrate` moved some of its regions out of its {home} layout): this vouch opens it with `vouch serve`, `info`, `check`, `verify`, `scrub`, `export`, `snapshot`, `clone`, `diff` and `migrate` only, and does not mirror, resize or rekey it yet; `vouch migrate PATH --layout {home}` moves every region back and makes it servable again (or `vouch export` it and `vouch import` the image into a new volume of the layout wanted); refusing to open",
                home = superblock.layout.name()
            )));
        }
        let mut read_only = options
            .read_only
            .then(|| " (opened with --read-only)".to_string());
        if superblock.features.ro_compat & FeatureFlags::RO_COMPAT_SNAPSHOT != 0 {
            read_only = Some(
                " (a snapshot: read-only; `vouch clone SNAPSHOT NEWPATH` makes a writable volume of it)"
                    .to_string(),
            );
        }
        let unknown_ro = superblock.features.unknown_ro_compat();
        if unknown_ro != 0 {
            read_only = Some(format!(
                " (unknown ro-compat features {unknown_ro:#x}: opened read-only)"
            ));
        }
        let geometry = superblock
            .geometry()
            .map_err(|error| Error::Corrupt(format!("corrupt superblock: {error}")))?;
        // The key is checked before anything else is read or written.
        let mut data_key = None;
        let encrypted = superblock.features.incompat & FeatureFlags::INCOMPAT_ENCRYPTED != 0;
        let protection: Box<dyn Protection> = if encrypted {
            let (uuid, tag) = (superblock.uuid, superblock.volume_tag());
            match (&options.key, options.keyless) {
                (Some(secret), _) => {
                    let key = secret.unwrap(&uuid, &superblock.key_wrap)?;
                    let protection = EncryptedProtection::new(&key[..], uuid, tag);
                    data_key = Some(key);
                    Box::new(protection)
                }
                (None, true) => {
                    read_only = Some(
                        " (encrypted volume opened without its key: keyless verification only)"
                            .to_string(),
                    );
                    Box::new(EncryptedProtection::keyless(uuid, tag))
                }
                (None, false) => return Err(Error::Key(MISSING_KEY.into())),
            }
        } else {
            Box::new(GuardProtection::new(
                superblock.guard,
                superblock.volume_tag(),
            ))
        };
        // Nothing vouch creates is larger, and what the open keeps in memory
        // grows with the size (the written map): a larger size is damage.
        if superblock.size_bytes > crate::MAX_VOLUME_BYTES {
            return Err(Error::Corrupt(format!(
                "superblock: size {} is larger than the largest volume vouch supports ({} bytes, 1 PiB); refusing to open",
                superblock.size_bytes,
                crate::MAX_VOLUME_BYTES
            )));
        }
        let has_map = superblock.features.incompat & FeatureFlags::INCOMPAT_WRITTEN_MAP != 0;
        let bound = superblock.features.incompat & FeatureFlags::INCOMPAT_BOUND_UNITS != 0;
        let rebuild = options.rebuild_written_map;
        if rebuild && read_only.is_some() {
            return Err(Error::InvalidArgument(format!(
                "building the written map needs a writable open{}",
                read_only.unwrap_or_default()
            )));
        }
        let short_objects = crate::damage::short_objects(&*storage, &geometry, &superblock)?;
        let written = if rebuild {
            WrittenMap::to_rebuild(
                &*storage,
                &geometry,
                (superblock.uuid, superblock.generations_seq),
            )?
        } else if has_map {
            // `create` writes generation 1 to both copies and the first
            // open (`mark_open`) moves past it.
            let never_opened = superblock.generation == 1 && superblock.checkpoint_seq == 0;
            crate::damage::load_written(
                &*storage,
                &geometry,
                (superblock.uuid, superblock.generations_seq),
                never_opened,
            )?
        } else {
            read_only = Some(
                " (made before the written map: `vouch upgrade PATH` builds it and makes the volume writable)"
                    .to_string(),
            );
            WrittenMap::disabled(&geometry, superblock.uuid)
        };
        if bound {
            written.set_bound();
        } else if has_map && !rebuild && read_only.is_none() {
            read_only = Some(
                " (made before whole metadata units: `vouch upgrade PATH` writes their vacant markers and makes the volume writable)"
                    .to_string(),
            );
        }
        let mut io = Backing::new(storage, geometry, read_only, written);
        if let Some(stats) = stats {
            io.stats = stats;
        }
        if geometry.layout == LayoutKind::Split {
            io.short_data = short_objects
                .iter()
                .filter(|short| matches!(short.object, ObjectId::Data(_)))
                .cloned()
                .collect();
            if !io.is_read_only() {
                crate::damage::stamp_short_data_on_disk(&io, &mut superblock)?;
            }
        }
        let (held, held_records) = HeldLog::open(&io, superblock.uuid)?;
        let shared = Shared::new(
            io,
            protection,
            LayoutMap::whole(geometry),
            VolumeState::new(options.tuning.context_cache_pages),
            held,
            superblock.uuid,
            superblock.checkpoint_seq + 1,
            options
                .schedule
                .as_ref()
                .map(|schedule| schedule.breaks())
                .unwrap_or_default(),
        );
        let committer = Committer::new(
            Journal::after_checkpoint(superblock),
            superblock.journal_bytes,
            options.tuning.overlay_limit,
            options.tuning.prompt_commits,
            options.schedule.clone(),
            shared.breaks(),
        );
        if rebuild {
            // Before recovery, from what is on disk; recovery then adjusts
            // it like any replay (`written.rs`).
            crate::damage::build_written(&shared)?;
            if !bound {
                // Every written unit made whole (durable) before anything
                // else is written: from here on units are kept whole.
                shared.io().written.set_bound();
                crate::damage::bind_written_units(&shared)?;
            }
        }
        if !shared.io().is_read_only() {
            // A new map (a new volume, or one rebuilt) is on disk before
            // anything it must describe is written. Its expected
            // generations (an upgrade's fill) go with the next checkpoint,
            // whose superblock names their copy (`persist_bits`).
            shared.io().written.persist_bits(shared.io())?;
        }
        let mut recovery = recover(&shared, &committer)?;
        // What the held log kept goes back into the write-back buffer after
        // the journal's recovery (it is newer than anything committed); a
        // writable open commits and flushes it before emptying the log, so
        // a crash meanwhile finds it again. A read-only open keeps it in
        // memory: reads and checks see what was acknowledged.
        recovery.held_blocks = crate::held::rebuffer(
            shared.io(),
            shared.protection(),
            shared.state(),
            held_records,
        )?;
        if recovery.held_blocks > 0 {
            tracing::info!(
                blocks = recovery.held_blocks,
                "put back the writes a crashed process had acknowledged, from the held log"
            );
        }
        if !shared.io().is_read_only() {
            if recovery.held_blocks > 0 {
                let mut journal = committer.lock();
                committer.commit(&shared, &mut journal, &[])?;
                committer.sync_data(&shared, &mut journal)?;
            }
            shared.held().empty_all(shared.io())?;
            // A protection that transforms what it seals (encryption)
            // seals a copy, never the received bytes in place: nothing
            // would land.
            if shared.protection().stores_plain() {
                shared.held().open_landing(shared.io());
            }
        }
        if rebuild && !(has_map && bound) {
            // The flags last: the map and the whole units they promise are
            // durable (above), and a checkpoint writes the map again with
            // recovery's changes first. An upgrade cut short before this
            // leaves markers in a volume without the flag: this binary
            // reads them (`WrittenMap::judge_slot`), and the upgrade is
            // finished by running it again.
            let mut journal = committer.lock();
            let mut superblock = journal.superblock();
            superblock.features.incompat |=
                FeatureFlags::INCOMPAT_WRITTEN_MAP | FeatureFlags::INCOMPAT_BOUND_UNITS;
            journal.set_superblock(superblock);
            committer.checkpoint(&shared, &mut journal, vouch_format::superblock::STATE_OPEN)?;
        }
        Ok(Engine {
            shared,
            committer,
            tuning: options.tuning,
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            recovery,
            guard: superblock.guard,
            data_key,
            encrypted,
            short_objects,
        })
    }

    /// Remove the held log's files if nothing is held: no live record in
    /// either slot and nothing buffered or committing (`Volume`'s drop).
    pub fn release_held_if_empty(&self) {
        let shared = &self.shared;
        if shared.io().is_read_only() {
            return;
        }
        let held = shared.held().lock();
        let state = shared.state().read();
        if held.is_empty() && state.nothing_buffered() {
            if let Err(error) = shared.io().storage().release_held() {
                tracing::debug!(%error, "cannot remove the held log's files");
            }
        }
    }

    /// What the open's recovery found and did.
    pub fn recovery(&self) -> &RecoveryReport {
        &self.recovery
    }

    /// The guard the volume was created with (never waits for a commit).
    pub fn guard(&self) -> GuardKind {
        self.guard
    }

    /// Files shorter than the volume needs, found at open.
    pub fn short_objects(&self) -> &[crate::damage::ShortObject] {
        &self.short_objects
    }

    /// Is the volume encrypted? (Fixed at creation; never waits for a commit.)
    pub fn encrypted(&self) -> bool {
        self.encrypted
    }

    pub fn stripe(&self, lba: u64) -> &Mutex<()> {
        &self.stripes[(lba % STRIPES as u64) as usize]
    }

    /// What every path borrows (`shared.rs`).
    pub fn shared(&self) -> &Shared {
        &self.shared
    }

    /// The journal and the committer (`commit.rs`): a change is journaled
    /// under its lock (`Committer::lock`).
    pub fn committer(&self) -> &Committer {
        &self.committer
    }

    /// The write-back limits and the other knobs it was opened with.
    pub fn tuning(&self) -> &Tuning {
        &self.tuning
    }

    /// Refuse a change to a volume opened read-only, or fail-stopped
    /// after a failed commit (`Backing::check_writable`): checked before a
    /// change begins, so none is half made.
    pub fn check_writable(&self) -> Result<()> {
        self.shared.io().check_writable()
    }

    pub fn superblock(&self) -> Superblock {
        self.committer.lock().superblock()
    }

    /// Rewrap an open encrypted volume's data key under `secret` (`vouch key
    /// change`). Crash-safe: the new superblock is written to the older copy
    /// and fsynced — from then on it is the newest valid copy, and only the
    /// new key opens the volume; before, the old copy is newest and only the
    /// old key does. Then it is written to the other copy too (generation + 2)
    /// and fsynced, so the old wrap does not stay on disk; a torn second write
    /// leaves the first. Never neither key (docs/CRASH_MODEL.md).
    pub fn change_key(&self, secret: &UserSecret) -> Result<()> {
        let Some(data_key) = &self.data_key else {
            return Err(Error::Key(
                "the volume is not encrypted, or was opened without its key: there is no key to change"
                    .into(),
            ));
        };
        self.shared.io().check_writable()?;
        let key_wrap = secret.wrap(&self.shared.uuid(), data_key)?;
        self.update_superblock(|superblock| superblock.key_wrap = key_wrap)
    }

    /// Change fields of the superblock and write it (both copies, each
    /// fsynced, the newer last): a crash leaves the old or the new.
    pub fn update_superblock(&self, change: impl FnOnce(&mut Superblock)) -> Result<()> {
        let shared = &self.shared;
        shared.io().check_writable()?;
        let mut journal = self.committer.lock();
        let mut superblock = journal.superblock();
        change(&mut superblock);
        for _ in 0..2 {
            superblock.generation += 1;
            crate::commit::write_superblock(shared, &mut journal, superblock)?;
        }
        Ok(())
    }
}
