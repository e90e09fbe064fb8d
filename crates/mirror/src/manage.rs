//! Changing a set's membership offline (`vouch mirror add|remove`): a new
//! leg joins as *stale* (the caller fills it, `vouch mirror replace`'s
//! copy, and marks it active); a leg leaves the set, and a set left with
//! one leg becomes a plain volume. Each change is one new record (the
//! epoch grows by one) written to the legs it concerns, in an order a
//! crash cannot turn into a wrong view (see each function). The server
//! must be stopped: the legs' volume locks are taken while the records
//! change.

use std::path::{Path, PathBuf};

use vouch_format::mirror::{LegState, MirrorMember, MirrorRecord, MAX_LEGS, MIN_LEGS};

use crate::dirty::map_file_name;
use crate::remote::is_remote_member;
use crate::set::{
    create_leg_like, is_mirrored, mark_unsynced, read_record, view, write_record, RECORD_FILE,
    UNSYNCED_FILE,
};
use vouch_engine::error::{Error, Result};
use vouch_engine::storage::{FileOpen, FileStorage};

fn path_error(action: &'static str, path: &Path, cause: impl std::fmt::Display) -> Error {
    Error::Path {
        action,
        path: path.to_path_buf(),
        cause: cause.to_string(),
    }
}

fn canonical(path: &Path) -> Result<String> {
    Ok(path
        .canonicalize()
        .map_err(|error| path_error("open", path, error))?
        .to_string_lossy()
        .into_owned())
}

/// Hold every present leg's volume lock (exclusively) while membership
/// changes: a running server, or another `vouch` on a leg, is refused.
fn lock_legs(paths: &[PathBuf]) -> Result<Vec<FileStorage>> {
    paths
        .iter()
        .filter(|path| {
            !is_remote_member(&path.to_string_lossy()) && path.join("superblock").exists()
        })
        .map(|path| {
            let geometry = vouch_engine::volume_superblock(path)?
                .geometry()
                .map_err(|error| {
                    Error::Corrupt(format!("{}: superblock: {error}", path.display()))
                })?;
            FileStorage::open_objects(path, &geometry, FileOpen::WRITABLE)
                .map_err(|error| path_error("lock", path, error))
        })
        .collect()
}

/// Add an empty leg at `target` (a new directory) to the volume at `path`:
/// a leg of a mirror with fewer than 3 legs, or a plain volume, which
/// becomes a 2-leg mirror. The new leg has the volume's superblock (uuid,
/// tags, key) and joins as *stale*: never read until it is filled and
/// marked active. Returns its index.
///
/// Order: the new leg's directory and its record first, then the existing
/// legs' records. A crash before the last step leaves the set as it was
/// (its records do not name the new leg) and an orphan directory, which a
/// retry refuses by name (remove it and run `add` again).
pub fn add_member(path: &Path, target: &Path) -> Result<usize> {
    // A snapshot is read-only as taken: a leg added to it would write a
    // record into it and make it a set.
    let flags = vouch_engine::volume_superblock(path)?.features.ro_compat;
    if flags & vouch_format::superblock::FeatureFlags::RO_COMPAT_SNAPSHOT != 0 {
        return Err(Error::InvalidArgument(format!(
            "{} is a snapshot, read-only: `vouch clone` it and add the leg to the clone",
            path.display()
        )));
    }
    if is_remote_member(&target.to_string_lossy()) {
        return Err(Error::InvalidArgument(format!(
            "{}: adding a remote leg to an existing volume is not supported yet (create the volume with --mirror vouch://...)",
            target.display()
        )));
    }
    if target.exists() {
        return Err(path_error(
            "add",
            target,
            "already exists (a new mirror leg must be a new directory)",
        ));
    }
    let mut record = if is_mirrored(path) {
        view(path)?.0
    } else {
        let superblock = vouch_engine::volume_superblock(path)?;
        MirrorRecord {
            leg: 0,
            uuid: superblock.uuid,
            epoch: 0,
            members: vec![MirrorMember {
                state: LegState::Active,
                path: canonical(path)?,
            }],
        }
    };
    if record.members.len() >= MAX_LEGS {
        return Err(Error::InvalidArgument(format!(
            "the mirror already has {MAX_LEGS} legs; remove one first"
        )));
    }
    let source = record
        .members
        .iter()
        .find(|member| member.state == LegState::Active && !is_remote_member(&member.path))
        .map(|member| PathBuf::from(&member.path))
        .ok_or_else(|| Error::Corrupt("no active local leg to copy the superblock from".into()))?;
    let legs = member_paths(&record);
    let _locks = lock_legs(&legs)?;
    create_leg_like(&source, target)?;
    let index = record.members.len();
    // No map may name the new leg: it is filled whole.
    for member in &record.members {
        if !is_remote_member(&member.path) && Path::new(&member.path).is_dir() {
            remove_maps_from(Path::new(&member.path), index)?;
        }
    }
    record.members.push(MirrorMember {
        state: LegState::Stale,
        path: canonical(target)?,
    });
    record.epoch += 1;
    record.leg = index as u16;
    write_record(target, &record)?;
    for (leg, member) in record.members.iter().enumerate().take(index) {
        // Remote members keep no record: the set's records live on its
        // local legs.
        if is_remote_member(&member.path) {
            continue;
        }
        if member.state == LegState::Active || Path::new(&member.path).join(RECORD_FILE).exists() {
            let mut copy = record.clone();
            copy.leg = leg as u16;
            write_record(Path::new(&member.path), &copy)?;
        }
    }
    Ok(index)
}

/// What `remove_member` did.
#[derive(Debug)]
pub struct Removed {
    /// The removed leg's directory (left on disk as a plain volume).
    pub path: PathBuf,
    /// The removed leg's state before: anything but active means its data
    /// is older than the set's.
    pub state: LegState,
    /// The legs left; one means the set is a plain volume now.
    pub remaining: Vec<PathBuf>,
}

/// Remove leg `leg` from the set the leg at `path` belongs to. At least one
/// active leg must remain. The removed leg's directory is left as it is,
/// without its record: a plain volume holding the data as of when it was
/// last in the set (older than the set's if it was not active).
///
/// Order: the remaining legs' records first (a new epoch without the leg;
/// when one leg remains, its record is removed instead and it is a plain
/// volume), then the removed leg's record. A crash in between leaves the
/// removed leg with an old record no newer view names, and the set without
/// it.
pub fn remove_member(path: &Path, leg: usize) -> Result<Removed> {
    let (record, _) = view(path)?;
    let member = record.members.get(leg).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "the mirror has no leg {leg} (legs 0..{})",
            record.members.len()
        ))
    })?;
    let removed = PathBuf::from(&member.path);
    let state = member.state;
    let mut next = record.clone();
    next.members.remove(leg);
    next.epoch += 1;
    if !next
        .members
        .iter()
        .any(|member| !is_remote_member(&member.path))
    {
        return Err(Error::InvalidArgument(format!(
            "leg {leg} is the last local leg: the set's records live on local legs"
        )));
    }
    if !next
        .members
        .iter()
        .any(|member| member.state == LegState::Active)
    {
        return Err(Error::InvalidArgument(format!(
            "leg {leg} is the only active leg: removing it would leave no good copy"
        )));
    }
    let legs = member_paths(&record);
    let _locks = lock_legs(&legs)?;
    let remaining = member_paths(&next);
    // Resync maps are named by leg index (`mirror.dirty.N`): the removed
    // leg's map goes, and the maps of legs after it would now name the
    // wrong leg, so they go too (those legs then have unknown history: a
    // full, verified resync, never a wrong partial one). Before the new
    // records: once they exist, a later leg would take the removed leg's
    // index, and its map with it.
    for dir in &legs {
        if !is_remote_member(&member_path(dir)) {
            remove_maps_from(dir, leg)?;
        }
    }
    if next.members.len() >= MIN_LEGS {
        for (index, member) in next.members.iter().enumerate() {
            let dir = Path::new(&member.path);
            if is_remote_member(&member.path) {
                continue;
            }
            if member.state == LegState::Active || dir.join(RECORD_FILE).exists() {
                let mut copy = next.clone();
                copy.leg = index as u16;
                write_record(dir, &copy)?;
            }
        }
    } else {
        // One leg left: a plain volume. Forget whether legs differed.
        mark_unsynced(&record, false)?;
        remove_record(&remaining[0])?;
    }
    if !is_remote_member(&member_path(&removed)) && removed.exists() {
        remove_record(&removed)?;
        let marker = removed.join(UNSYNCED_FILE);
        if marker.exists() {
            std::fs::remove_file(&marker).map_err(|error| path_error("remove", &marker, error))?;
        }
    }
    Ok(Removed {
        path: removed,
        state,
        remaining,
    })
}

fn member_paths(record: &MirrorRecord) -> Vec<PathBuf> {
    record
        .members
        .iter()
        .map(|member| PathBuf::from(&member.path))
        .collect()
}

/// Remove the resync maps of legs `first` and after from `dir`, durably
/// (the directory is fsynced when one went): the caller writes records that
/// renumber legs next, and a map surviving a crash would then name the
/// wrong leg.
fn remove_maps_from(dir: &Path, first: usize) -> Result<()> {
    let mut removed = false;
    for leg in first..MAX_LEGS {
        let map = dir.join(map_file_name(leg));
        match std::fs::remove_file(&map) {
            Ok(()) => removed = true,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(path_error("remove", &map, error)),
        }
    }
    if removed {
        std::fs::File::open(dir)
            .and_then(|handle| handle.sync_all())
            .map_err(|error| path_error("sync", dir, error))?;
    }
    Ok(())
}

fn member_path(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// Remove a leg's record durably (file, then directory fsync).
fn remove_record(dir: &Path) -> Result<()> {
    let file = dir.join(RECORD_FILE);
    if let Err(error) = std::fs::remove_file(&file) {
        if error.kind() != std::io::ErrorKind::NotFound {
            return Err(path_error("remove", &file, error));
        }
    }
    std::fs::File::open(dir)
        .and_then(|handle| handle.sync_all())
        .map_err(|error| path_error("sync", dir, error))?;
    // Reading it back must fail now: a plain volume has no record.
    match read_record(dir) {
        Err(_) => Ok(()),
        Ok(_) => Err(path_error("remove", &file, "the record is still there")),
    }
}
