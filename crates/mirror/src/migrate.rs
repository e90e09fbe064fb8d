//! Migrating a mirror between layouts offline (`vouch migrate LEG
//! --layout L`): each leg in turn is rebuilt whole in the target layout
//! beside itself and swapped into its place, while the other legs stay as
//! they are.
//!
//! Why a leg is rebuilt rather than migrated region by region: a sealed
//! block (4096 bytes and its 32-byte context, docs/FORMAT.md "Context")
//! names its volume (uuid), its LBA and its generation, never the layout
//! that stores it, so the legs of one set may differ in layout and a block
//! moves between them as it is. A leg rebuilt whole is a plain volume of
//! the target layout, which a mirror opens as it opens any leg; a leg
//! migrated region by region would be a volume with regions for the
//! length of the run (two members and a record), which a mirror does not
//! open.
//!
//! One leg, in this order (docs/CRASH_MODEL.md, "Migrating a mirror"):
//! 1. a new volume at `.NAME.migrating` beside the leg (same directory,
//!    so same filesystem): the leg's superblock with the target layout
//!    (same uuid, instance, tags, key, size, journal; its clock at the
//!    set's, so a later write never gets a lower generation than a block
//!    it holds);
//! 2. every written block read sealed from the leg and written sealed to
//!    the new volume, which verifies each against its context before it
//!    stores it (`SealCheck::Full`: the old protection is checked before
//!    the new copy exists). A block that fails (unreadable, corrupt, its
//!    metadata lost) is taken from another leg that holds it good, and
//!    that copy is verified the same way: mirrors repair first. A block no
//!    leg holds good stops the migration naming its LBA, every leg as it
//!    was;
//! 3. the new volume flushed, checked whole and closed; the leg's mirror
//!    files (record, activity log, markers, maps) copied into it, fsynced;
//! 4. the two directory entries exchanged in one step (`renameat2`
//!    `RENAME_EXCHANGE`) and the parent fsynced: the leg's path names the
//!    new volume, `.NAME.migrating` the old one, which is then removed.
//!
//! A crash before 4 leaves the leg untouched and a partial new volume
//! that nothing names; a crash after it, the new leg in place and the old
//! one under the staging name. Either way the set opens and serves (its
//! legs may differ in layout), and the next `migrate` removes what is
//! under the staging name and goes on with the legs not yet in the
//! target layout. Every leg's volume lock is held for the whole run, so
//! no server writes the set meanwhile.
//!
//! Its cost: room for one more copy of one leg (the leg being rebuilt),
//! and every written block read once and written once per leg moved,
//! then read once more by the new leg's check.
//!
//! Refused, with nothing changed: a remote leg (the replica protocol has
//! no migrate), a leg that is not active or cannot be opened (resync or
//! replace it first), a leg with regions, snapshots or a fence, legs of
//! different sizes, a filesystem that cannot exchange two directories.

use std::path::{Path, PathBuf};

use vouch_engine::device::{BlockDevice, SealedBlock, SealedDevice as _, SealedWrites as _};
use vouch_engine::error::{Error, Result};
use vouch_engine::replace::{exchange, sync_parent};
use vouch_engine::storage::FileStorage;
use vouch_engine::{Volume, BLOCK};
use vouch_format::mirror::LegState;
use vouch_format::superblock::SUPERBLOCK_SLOT_BYTES;
use vouch_format::{Context, FeatureFlags, LayoutKind};

use crate::set::view;

/// Blocks moved per read and write (1 MiB).
const CHUNK_BLOCKS: u64 = 256;

/// Where a moment of the run is, for `MigrateHooks::at` (a test's crash
/// point).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LegStage {
    /// The new volume is complete and closed, not yet in the leg's place.
    BeforeExchange,
    /// The new volume is in the leg's place; the old one under the
    /// staging name, not yet removed.
    AfterExchange,
    /// The leg is done (the old volume removed).
    Done,
}

/// What one leg went through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LegMigrated {
    pub index: usize,
    pub path: PathBuf,
    /// Its layout before (`None`: it was in the target layout already).
    pub from: Option<LayoutKind>,
    /// LBAs that failed on this leg and were taken from another leg.
    pub repaired: Vec<u64>,
    /// Blocks copied (written ones; never-written blocks stay holes).
    pub copied: u64,
}

/// What a mirror's migration did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MirrorMigrateReport {
    pub legs: Vec<LegMigrated>,
    /// Staging directories a run cut short left, removed first.
    pub leftovers: Vec<PathBuf>,
}

/// The caller's part: how a leg's volume is opened (writable, its key),
/// progress (bytes done, total), and a hook at each stage of each leg.
pub struct MigrateHooks<'a> {
    pub open_leg: &'a mut dyn FnMut(&Path) -> Result<Volume>,
    pub progress: &'a mut dyn FnMut(u64, u64),
    pub at: &'a mut dyn FnMut(usize, LegStage),
}

/// The staging directory beside the leg at `leg`: `.NAME.migrating`.
pub fn staging_path(leg: &Path) -> PathBuf {
    let name = leg
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| "leg".into());
    leg.with_file_name(format!(".{name}.migrating"))
}

fn path_error(action: &'static str, path: &Path, cause: impl std::fmt::Display) -> Error {
    Error::Path {
        action,
        path: path.to_path_buf(),
        cause: cause.to_string(),
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|handle| handle.sync_all())
        .map_err(|error| path_error("sync", dir, error))
}

/// Is `name` one of a volume's own files (not the mirror's)?
fn volume_file(name: &str) -> bool {
    // `held`: the pointer to this directory's held log (named by the
    // directory's inode: the new volume has its own).
    // `written.resize`: a resize's map cut short (the leg's open settled it).
    matches!(name, "superblock" | "journal" | "contexts")
        || name.starts_with("written")
        || name.starts_with("data.")
        || name == vouch_engine::storage::HELD_POINTER
        || name.starts_with(&format!("{}.", vouch_engine::storage::HELD_POINTER))
}

/// Why the leg at `path` (index `index`) cannot be rebuilt, if it cannot.
fn refusal(index: usize, path: &Path) -> Result<Option<String>> {
    let superblock = vouch_engine::volume_superblock(path)?;
    let flags = superblock.features;
    let why = if flags.incompat & FeatureFlags::INCOMPAT_REGIONS != 0 {
        Some("is a volume with regions")
    } else if flags.ro_compat & FeatureFlags::RO_COMPAT_SNAPSHOT != 0 {
        Some("is a snapshot")
    } else if flags.incompat
        & (FeatureFlags::INCOMPAT_FENCED
            | FeatureFlags::INCOMPAT_OVERLAY
            | FeatureFlags::INCOMPAT_OVERLAID)
        != 0
    {
        Some("has a fenced or overlay snapshot")
    } else if std::fs::read_dir(path.join("snapshots"))
        .is_ok_and(|mut entries| entries.next().is_some())
    {
        Some("has snapshots (they are kept in the leg's layout and would not move with it)")
    } else {
        None
    };
    Ok(why.map(|why| format!("mirror leg {index} ({}) {why}", path.display())))
}

/// Migrate the mirror the leg at `path` belongs to: every leg not in
/// `target` rebuilt in it, in leg order (module comment).
pub fn migrate_mirror(
    path: &Path,
    target: LayoutKind,
    hooks: MigrateHooks<'_>,
) -> Result<MirrorMigrateReport> {
    let MigrateHooks {
        open_leg,
        progress,
        at,
    } = hooks;
    let (record, reasons) = view(path)?;
    let unchanged = "; the mirror is left as it is, every leg unchanged";
    for (index, member) in record.members.iter().enumerate() {
        if crate::is_remote_member(&member.path) {
            return Err(Error::Unsupported(format!(
                "mirror leg {index} ({}) is a remote replica: the replica protocol has no migrate, so a mirror with a remote leg is not migrated{unchanged}",
                member.path
            )));
        }
        if member.state != LegState::Active {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {index} ({}) is {}: resync or replace it first (`vouch mirror resync`), so that every leg holds every block{unchanged}",
                member.path,
                member.state.name()
            )));
        }
        if let Some(why) = &reasons[index] {
            return Err(Error::InvalidArgument(format!(
                "mirror leg {index} ({}) cannot be read: {why}{unchanged}",
                member.path
            )));
        }
    }
    let paths: Vec<PathBuf> = record
        .members
        .iter()
        .map(|member| PathBuf::from(&member.path))
        .collect();
    let mut sizes = Vec::new();
    for (index, leg) in paths.iter().enumerate() {
        if let Some(why) = refusal(index, leg)? {
            return Err(Error::InvalidArgument(format!("{why}{unchanged}")));
        }
        sizes.push(vouch_engine::volume_superblock(leg)?.size_bytes);
    }
    if sizes.iter().any(|size| *size != sizes[0]) {
        return Err(Error::InvalidArgument(format!(
            "the mirror's legs differ in size (a `vouch resize` cut short between legs: run it again first){unchanged}"
        )));
    }
    // Every leg open (its lock held) before anything is removed or made:
    // a server, or a second migrate, is refused from here on.
    let mut volumes: Vec<Option<Volume>> = Vec::with_capacity(paths.len());
    for leg in &paths {
        match open_leg(leg) {
            Ok(volume) => volumes.push(Some(volume)),
            Err(error) => {
                let _ = close_all(volumes);
                return Err(error);
            }
        }
    }
    let result = migrate_open(
        &paths,
        &mut volumes,
        target,
        MigrateHooks {
            open_leg,
            progress,
            at,
        },
    );
    let closed = close_all(volumes);
    let report = result?;
    closed?;
    Ok(report)
}

fn close_all(volumes: Vec<Option<Volume>>) -> Result<()> {
    let mut first = Ok(());
    for volume in volumes.into_iter().flatten() {
        if let Err(error) = volume.close() {
            if first.is_ok() {
                first = Err(error);
            }
        }
    }
    first
}

fn migrate_open(
    paths: &[PathBuf],
    volumes: &mut [Option<Volume>],
    target: LayoutKind,
    hooks: MigrateHooks<'_>,
) -> Result<MirrorMigrateReport> {
    let MigrateHooks {
        open_leg,
        progress,
        at,
    } = hooks;
    let mut report = MirrorMigrateReport::default();
    for leg in paths {
        let staging = staging_path(leg);
        // `can_exchange`'s probe, if a run died in it.
        let _ = std::fs::remove_dir(staging.with_extension("probe"));
        if staging.exists() {
            // Opened and closed first where it opens (a crash left it
            // open): a held log it left in memory is let go with it.
            if let Ok(left) = open_leg(&staging) {
                let _ = left.close();
            }
            std::fs::remove_dir_all(&staging)
                .map_err(|error| path_error("remove", &staging, error))?;
            sync_parent(&staging).map_err(|error| path_error("sync", &staging, error))?;
            report.leftovers.push(staging);
        }
    }
    let layouts: Vec<LayoutKind> = paths
        .iter()
        .map(|leg| Ok(vouch_engine::volume_superblock(leg)?.layout))
        .collect::<Result<_>>()?;
    let to_move: Vec<usize> = (0..paths.len())
        .filter(|index| layouts[*index] != target)
        .collect();
    for index in &to_move {
        can_exchange(&paths[*index])?;
    }
    let blocks = volumes[0]
        .as_ref()
        .map_or(0, |volume| BlockDevice::size(volume) / BLOCK);
    let total = blocks * BLOCK * to_move.len() as u64;
    let mut done = 0;
    progress(0, total);
    for index in 0..paths.len() {
        if !to_move.contains(&index) {
            report.legs.push(LegMigrated {
                index,
                path: paths[index].clone(),
                from: None,
                repaired: Vec::new(),
                copied: 0,
            });
            continue;
        }
        let mut advance = |bytes| {
            done += bytes;
            progress(done, total);
        };
        let moved = migrate_leg(
            paths,
            volumes,
            (index, target),
            &mut *open_leg,
            &mut advance,
            &mut *at,
        )?;
        report.legs.push(LegMigrated {
            from: Some(layouts[index]),
            ..moved
        });
    }
    Ok(report)
}

/// Can the filesystem holding `leg` exchange two directories? Tried on
/// two empty ones beside it before anything is copied.
fn can_exchange(leg: &Path) -> Result<()> {
    let staging = staging_path(leg);
    let probe = staging.with_extension("probe");
    let tried = (|| -> std::io::Result<()> {
        std::fs::create_dir(&staging)?;
        std::fs::create_dir(&probe)?;
        exchange(&staging, &probe)
    })();
    let _ = std::fs::remove_dir(&probe);
    let _ = std::fs::remove_dir(&staging);
    tried.map_err(|error| {
        Error::Unsupported(format!(
            "{}: its filesystem cannot exchange two directories in one step ({error}), which a mirror's migration needs to put each rebuilt leg in its place; the mirror is left as it is, every leg unchanged",
            leg.display()
        ))
    })
}

/// Rebuild leg `index` in `target` and put it in the leg's place (module
/// comment, steps 1-4); its volume in `volumes` is the new one after.
fn migrate_leg(
    paths: &[PathBuf],
    volumes: &mut [Option<Volume>],
    (index, target): (usize, LayoutKind),
    open_leg: &mut dyn FnMut(&Path) -> Result<Volume>,
    progress: &mut dyn FnMut(u64),
    at: &mut dyn FnMut(usize, LegStage),
) -> Result<LegMigrated> {
    let leg = &paths[index];
    let staging = staging_path(leg);
    // The set's clock: the new leg seals from it, so its later writes
    // never get a generation below one of the blocks it holds.
    let clock = volumes
        .iter()
        .flatten()
        .map(|volume| volume.generation_clock())
        .max()
        .unwrap_or(0);
    create_in_layout(leg, &staging, target, clock)?;
    let built = (|| -> Result<(Vec<u64>, u64)> {
        let new = open_leg(&staging)?;
        let copied = copy_leg(volumes, index, &new, progress);
        let checked = copied.and_then(|copied| {
            new.flush()?;
            let report = new.check(|_, _| {})?;
            if let Some(fault) = report.faults.first() {
                return Err(Error::Corrupt(format!(
                    "mirror leg {index} rebuilt in {} at {} has {} faults after the copy (first: LBA {} {}); the leg is left as it was",
                    target.name(),
                    staging.display(),
                    report.faults.len(),
                    fault.lba,
                    fault.kind.name()
                )));
            }
            Ok(copied)
        });
        let closed = new.close();
        let copied = checked?;
        closed?;
        carry_mirror_files(leg, &staging)?;
        Ok(copied)
    })();
    let (repaired, copied) = match built {
        Ok(built) => built,
        Err(error) => {
            // Nothing names the staging volume: it goes, the leg as it was.
            let _ = std::fs::remove_dir_all(&staging);
            let _ = sync_parent(&staging);
            return Err(error);
        }
    };
    at(index, LegStage::BeforeExchange);
    // The old volume closed before the exchange: its storage names files
    // by the leg's path (the `held` pointer), which is the new leg's after
    // it. The other legs' locks keep a server out meanwhile.
    if let Some(old) = volumes[index].take() {
        old.close()?;
    }
    exchange(&staging, leg).map_err(|error| path_error("exchange", leg, error))?;
    sync_parent(leg).map_err(|error| path_error("sync", leg, error))?;
    at(index, LegStage::AfterExchange);
    std::fs::remove_dir_all(&staging).map_err(|error| path_error("remove", &staging, error))?;
    sync_parent(&staging).map_err(|error| path_error("sync", &staging, error))?;
    // The new leg, open again: a source of repairs for the legs after it.
    volumes[index] = Some(open_leg(leg)?);
    at(index, LegStage::Done);
    Ok(LegMigrated {
        index,
        path: leg.clone(),
        from: None,
        repaired,
        copied,
    })
}

/// A new, empty volume at `staging` with the superblock of the leg at
/// `leg` in layout `target`: same uuid, instance, tags, key, guard, size
/// and journal capacity; its own geometry; sealing from after `clock`.
fn create_in_layout(leg: &Path, staging: &Path, target: LayoutKind, clock: u64) -> Result<()> {
    let mut superblock = vouch_engine::volume_superblock(leg)?;
    superblock.layout = target;
    superblock.segment_blocks = vouch_format::layout::default_segment_blocks(target);
    superblock.features.incompat &= !FeatureFlags::INCOMPAT_PACKED_LAYOUT;
    if target == LayoutKind::Packed {
        superblock.features.incompat |= FeatureFlags::INCOMPAT_PACKED_LAYOUT;
    }
    superblock.checkpoint_seq = superblock.checkpoint_seq.max(clock);
    // A fresh volume: no copy of generations in its (new) written map yet.
    superblock.generations_seq = 0;
    superblock.state = vouch_format::superblock::STATE_CLEAN;
    let geometry = superblock
        .geometry()
        .map_err(|error| Error::Corrupt(format!("{}: superblock: {error}", leg.display())))?;
    drop(
        FileStorage::create(staging, &geometry, superblock.journal_bytes)
            .map_err(|error| path_error("create", staging, error))?,
    );
    let encoded = superblock.encode();
    let mut bytes = vec![0u8; 2 * SUPERBLOCK_SLOT_BYTES as usize];
    bytes[..encoded.len()].copy_from_slice(&encoded);
    let second = SUPERBLOCK_SLOT_BYTES as usize;
    bytes[second..second + encoded.len()].copy_from_slice(&encoded);
    let file = staging.join("superblock");
    std::fs::write(&file, &bytes)
        .and_then(|()| std::fs::File::open(&file)?.sync_all())
        .map_err(|error| path_error("write", &file, error))?;
    sync_dir(staging)?;
    sync_parent(staging).map_err(|error| path_error("sync", staging, error))
}

/// Copy every written block of leg `index` into `new`, sealed, each
/// verified by `new` before it is stored; a block that fails is taken
/// from another leg (verified the same way). Returns the LBAs so
/// repaired and how many blocks were copied.
fn copy_leg(
    volumes: &[Option<Volume>],
    index: usize,
    new: &Volume,
    progress: &mut dyn FnMut(u64),
) -> Result<(Vec<u64>, u64)> {
    let old = volumes[index]
        .as_ref()
        .ok_or_else(|| Error::Corrupt(format!("mirror leg {index} is not open")))?;
    let blocks = BlockDevice::size(old) / BLOCK;
    let mut repaired = Vec::new();
    let mut copied = 0;
    let mut lba = 0;
    while lba < blocks {
        let count = CHUNK_BLOCKS.min(blocks - lba);
        let whole = old.read_sealed(lba, count).and_then(|sealed| {
            let written = written_only(sealed);
            new.write_sealed(&written)?;
            Ok(written.len() as u64)
        });
        match whole {
            Ok(written) => copied += written,
            // One block failed its verification (or its read): the chunk
            // again a block at a time, each failing one from another leg.
            Err(Error::Fault(_)) => {
                for at in lba..lba + count {
                    let own = old.read_sealed(at, 1).and_then(|sealed| {
                        let written = written_only(sealed);
                        new.write_sealed(&written)?;
                        Ok(written.len() as u64)
                    });
                    match own {
                        Ok(written) => copied += written,
                        Err(Error::Fault(fault)) => {
                            copied += repair_from_others(volumes, index, new, fault)?;
                            repaired.push(at);
                        }
                        Err(error) => return Err(error),
                    }
                }
            }
            Err(error) => return Err(error),
        }
        progress(count * BLOCK);
        lba += count;
    }
    Ok((repaired, copied))
}

/// Blocks never written (or trimmed) left out: the new volume holds
/// none, so they stay holes there.
fn written_only(sealed: Vec<SealedBlock>) -> Vec<SealedBlock> {
    sealed
        .into_iter()
        .filter(|block| block.context != Context::Unwritten)
        .collect()
}

/// The block `fault` names, from the first other leg that holds it good,
/// into `new` (verified as it is stored). None does: the migration stops
/// naming it.
fn repair_from_others(
    volumes: &[Option<Volume>],
    index: usize,
    new: &Volume,
    fault: vouch_engine::Fault,
) -> Result<u64> {
    let mut tried = Vec::new();
    for (other, volume) in volumes.iter().enumerate() {
        let Some(volume) = volume.as_ref().filter(|_| other != index) else {
            continue;
        };
        let taken = volume.read_sealed(fault.lba, 1).and_then(|sealed| {
            let written = written_only(sealed);
            new.write_sealed(&written)?;
            Ok(written.len() as u64)
        });
        match taken {
            Ok(written) => {
                tracing::warn!(
                    lba = fault.lba,
                    leg = index,
                    from = other,
                    kind = fault.kind.name(),
                    "mirror migrate: a block that failed on its leg was taken from another leg"
                );
                return Ok(written);
            }
            Err(Error::Fault(theirs)) => tried.push(format!("leg {other}: {}", theirs.kind.name())),
            Err(error) => return Err(error),
        }
    }
    Err(Error::Corrupt(format!(
        "migration stopped: LBA {} failed verification on mirror leg {index} ({}) and no other leg holds it good ({}); that leg is left as it was (restore the block, or write it again, and run the migration again)",
        fault.lba,
        fault.kind.name(),
        if tried.is_empty() { "no other leg".to_string() } else { tried.join(", ") }
    )))
}

/// The leg's mirror files (its record, the activity log, the unsynced
/// marker, resync maps, a scrub's record: everything in its directory that
/// is not one of the volume's own files) copied into `staging`, each
/// fsynced, then the directory: the new leg takes the old one's place in
/// the set as it is.
fn carry_mirror_files(leg: &Path, staging: &Path) -> Result<()> {
    let entries = std::fs::read_dir(leg).map_err(|error| path_error("read", leg, error))?;
    for entry in entries {
        let entry = entry.map_err(|error| path_error("read", leg, error))?;
        let name = entry.file_name();
        let is_file = entry.file_type().is_ok_and(|kind| kind.is_file());
        if !is_file || volume_file(&name.to_string_lossy()) {
            continue;
        }
        let to = staging.join(&name);
        std::fs::copy(entry.path(), &to)
            .and_then(|_| std::fs::File::open(&to)?.sync_all())
            .map_err(|error| path_error("copy", &to, error))?;
    }
    sync_dir(staging)
}
