//! A mirror set on disk: creating the legs (whole volumes with leg 0's
//! superblock, so they share uuid, tags and key), reading and replacing
//! each leg's `mirror` record (docs/FORMAT.md), and opening the set from
//! any one leg: the record with the highest epoch is the set's view, a
//! missing leg is reported by name and, when the set is opened for
//! writing, marked stale so it is never read again without a replace.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
pub use vouch_format::mirror::MirrorRecord;
use vouch_format::mirror::{LegState, MirrorMember, MAX_LEGS, MIN_LEGS};

use crate::dirty::{map_file_name, DirtyMap};
use crate::{Membership, Mirror, MirrorLeg};
use vouch_engine::device::{BlockDevice, SealedDevice};
use vouch_engine::error::{Error, Result};
use vouch_engine::options::CreateOptions;
use vouch_engine::replace::replace_file;
use vouch_engine::storage::FileStorage;
use vouch_engine::Volume;

/// The record's file name in each leg's directory.
pub const RECORD_FILE: &str = vouch_format::mirror::MIRROR_RECORD_FILE;

/// Present in a leg's directory while the legs may differ on some blocks
/// (an unclean shutdown, until a scrub finishes with nothing left): reads
/// then go to one leg, across restarts (docs/CRASH_MODEL.md).
pub const UNSYNCED_FILE: &str = "mirror.unsynced";

/// Does any member of `record` carry the `UNSYNCED_FILE` marker?
pub fn is_unsynced(record: &MirrorRecord) -> bool {
    record
        .members
        .iter()
        .any(|member| Path::new(&member.path).join(UNSYNCED_FILE).exists())
}

/// Create (`unsynced`) or remove the marker in every active leg's
/// directory, durably (file and directory fsynced).
pub(super) fn mark_unsynced(record: &MirrorRecord, unsynced: bool) -> Result<()> {
    for member in &record.members {
        let dir = Path::new(&member.path);
        if member.state != LegState::Active || !dir.is_dir() {
            continue;
        }
        let marker = dir.join(UNSYNCED_FILE);
        let change = || -> std::io::Result<()> {
            if unsynced {
                let mut file = std::fs::File::create(&marker)?;
                file.write_all(
                    b"legs may differ: reads go to one leg until a scrub makes them agree\n",
                )?;
                file.sync_all()?;
            } else {
                match std::fs::remove_file(&marker) {
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                    other => other?,
                }
            }
            std::fs::File::open(dir)?.sync_all()
        };
        change().map_err(|error| path_error("mark", &marker, error))?;
    }
    Ok(())
}

/// Is the volume directory at `path` a leg of a mirror?
pub fn is_mirrored(path: &Path) -> bool {
    path.join(RECORD_FILE).exists()
}

fn path_error(action: &'static str, path: &Path, cause: impl std::fmt::Display) -> Error {
    Error::Path {
        action,
        path: path.to_path_buf(),
        cause: cause.to_string(),
    }
}

/// The mirror record of the leg at `path`.
pub fn read_record(path: &Path) -> Result<MirrorRecord> {
    let file = path.join(RECORD_FILE);
    let bytes = std::fs::read(&file).map_err(|error| path_error("read", &file, error))?;
    MirrorRecord::decode(&bytes)
        .map_err(|error| Error::Corrupt(format!("mirror record {}: {error}", file.display())))
}

/// Replace the record of the leg at `path` atomically (temporary file,
/// fsync, rename, directory fsync).
pub fn write_record(path: &Path, record: &MirrorRecord) -> Result<()> {
    let bytes = record
        .encode()
        .map_err(|error| Error::InvalidArgument(format!("mirror record: {error}")))?;
    let temporary = path.join("mirror.tmp");
    let target = path.join(RECORD_FILE);
    replace_file(&temporary, &target, &bytes).map_err(|error| path_error("write", &target, error))
}

/// Create a mirrored volume: leg 0 at `paths[0]` like `create_volume`, then
/// each other leg with leg 0's superblock, then every leg's record. On
/// failure nothing is left behind.
pub fn create_mirror(paths: &[PathBuf], options: &CreateOptions) -> Result<Volume> {
    create_mirror_with(paths, options, &mut |url, _| {
        Err(Error::Unsupported(format!(
            "mirror member {url} is remote: this caller cannot reach remote replicas"
        )))
    })
}

/// `create_mirror` where members may be remote (`remote::is_remote_member`):
/// `create_remote(url, leg 0's path)` creates each from leg 0 after leg 0
/// exists (leg 0 must be local). A remote member that was created is not
/// removed on a later failure: the error names it.
pub fn create_mirror_with(
    paths: &[PathBuf],
    options: &CreateOptions,
    create_remote: &mut dyn FnMut(&str, &Path) -> Result<()>,
) -> Result<Volume> {
    if paths
        .first()
        .is_some_and(|first| crate::is_remote_member(&first.to_string_lossy()))
    {
        return Err(Error::InvalidArgument(
            "leg 0 of a mirror must be a local directory (it keeps the set's record)".into(),
        ));
    }
    if !(MIN_LEGS..=MAX_LEGS).contains(&paths.len()) {
        return Err(Error::InvalidArgument(format!(
            "a mirror has 2 or 3 legs, not {}",
            paths.len()
        )));
    }
    for (index, path) in paths.iter().enumerate() {
        if !is_remote(path) && path.exists() {
            return Err(path_error(
                "create",
                path,
                "already exists (a mirror leg must be a new directory)",
            ));
        }
        if paths[..index].contains(path) {
            return Err(path_error("create", path, "is given twice"));
        }
    }
    let result = create_legs(paths, options, create_remote);
    if result.is_err() {
        for path in paths.iter().filter(|path| !is_remote(path)) {
            let _ = std::fs::remove_dir_all(path);
        }
    }
    result
}

fn is_remote(path: &Path) -> bool {
    crate::is_remote_member(&path.to_string_lossy())
}

/// Create an empty leg at `target` with the superblock of the leg at
/// `source` (same uuid, geometry, tags and key), ready to be filled with
/// `write_sealed` (a new mirror, or `vouch mirror replace`).
pub fn create_leg_like(source: &Path, target: &Path) -> Result<()> {
    let superblock_file = source.join("superblock");
    let superblock = std::fs::read(&superblock_file)
        .map_err(|error| path_error("read", &superblock_file, error))?;
    let geometry = vouch_engine::volume_superblock(source)?
        .geometry()
        .map_err(|error| Error::Corrupt(format!("{}: superblock: {error}", source.display())))?;
    let journal = std::fs::metadata(source.join("journal"))
        .map_err(|error| path_error("read", source, error))?
        .len();
    drop(
        FileStorage::create(target, &geometry, journal)
            .map_err(|error| path_error("create", target, error))?,
    );
    let file = target.join("superblock");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .and_then(|mut out| {
            out.write_all(&superblock)?;
            out.sync_all()
        })
        .map_err(|error| path_error("write", &file, error))
}

fn create_legs(
    paths: &[PathBuf],
    options: &CreateOptions,
    create_remote: &mut dyn FnMut(&str, &Path) -> Result<()>,
) -> Result<Volume> {
    vouch_engine::create_volume(&paths[0], options)?.close()?;
    for path in &paths[1..] {
        if is_remote(path) {
            create_remote(&path.to_string_lossy(), &paths[0])?;
        } else {
            create_leg_like(&paths[0], path)?;
        }
    }
    let absolute: Vec<PathBuf> = paths
        .iter()
        .map(|path| {
            if is_remote(path) {
                return Ok(path.clone());
            }
            path.canonicalize()
                .map_err(|error| path_error("open", path, error))
        })
        .collect::<Result<_>>()?;
    let uuid = vouch_engine::volume_superblock(&paths[0])?.uuid;
    let mut record = MirrorRecord {
        leg: 0,
        uuid,
        epoch: 1,
        members: absolute
            .iter()
            .map(|path| MirrorMember {
                state: LegState::Active,
                path: path.to_string_lossy().into_owned(),
            })
            .collect(),
    };
    for (index, path) in paths.iter().enumerate() {
        if !is_remote(path) {
            record.leg = index as u16;
            write_record(path, &record)?;
        }
    }
    let open = vouch_engine::options::OpenOptions {
        key: options.encrypt.clone(),
        ..Default::default()
    };
    // Every leg must open as a volume; leg 0 is returned.
    for path in paths[1..].iter().filter(|path| !is_remote(path)) {
        vouch_engine::open_volume(path, &open)?.close()?;
    }
    vouch_engine::open_volume(&paths[0], &open)
}

/// The set's view from the leg at `path`: the record with the highest
/// epoch among the legs found, and for each member why it was not found
/// (`None`: found). Two different records at the same highest epoch are a
/// split brain, refused naming both legs.
pub fn view(path: &Path) -> Result<(MirrorRecord, Vec<Option<String>>)> {
    let given = read_record(path)?;
    refuse_a_copy(path, &given)?;
    let mut found: Vec<Option<MirrorRecord>> = Vec::new();
    let mut reasons: Vec<Option<String>> = Vec::new();
    for (index, member) in given.members.iter().enumerate() {
        if index == usize::from(given.leg) {
            found.push(Some(given.clone()));
            reasons.push(None);
            continue;
        }
        if crate::is_remote_member(&member.path) {
            // No record there: whoever opens the set reaches it.
            found.push(None);
            reasons.push(None);
            continue;
        }
        match read_record(Path::new(&member.path)) {
            Ok(record) if record.uuid != given.uuid => {
                found.push(None);
                reasons.push(Some("belongs to another volume (uuid differs)".into()));
            }
            Ok(record) if usize::from(record.leg) != index => {
                found.push(None);
                reasons.push(Some(format!(
                    "says it is leg {}, not leg {index}",
                    record.leg
                )));
            }
            Ok(record) => {
                found.push(Some(record));
                reasons.push(None);
            }
            Err(error) => {
                found.push(None);
                reasons.push(Some(error.to_string()));
            }
        }
    }
    let epoch = found.iter().flatten().map(|r| r.epoch).max().unwrap_or(0);
    let newest: Vec<(usize, &MirrorRecord)> = found
        .iter()
        .enumerate()
        .filter_map(|(index, record)| record.as_ref().map(|r| (index, r)))
        .filter(|(_, record)| record.epoch == epoch)
        .collect();
    let (first_index, view) = newest[0];
    if let Some((other, _)) = newest
        .iter()
        .find(|(_, record)| record.members != view.members)
    {
        return Err(Error::Corrupt(format!(
            "mirror legs {} and {} disagree at the same epoch {epoch} (each was opened without the other: split brain); replace one of them",
            given.members[first_index].path, given.members[*other].path
        )));
    }
    for (index, member) in given.members.iter().enumerate() {
        if found[index].is_some() && !crate::is_remote_member(&member.path) {
            same_instance(path, Path::new(&member.path))?;
        }
    }
    Ok((view.clone(), reasons))
}

/// The leg at `member` must be the same volume instance as the leg at
/// `leg` (`Superblock::instance`): a clone shares its origin's uuid and
/// tags, so nothing else tells it apart. Unknown (zero, a superblock
/// written before the field) matches only unknown. A superblock that
/// cannot be read is left to whoever opens the leg.
pub fn same_instance(leg: &Path, member: &Path) -> Result<()> {
    let (Ok(ours), Ok(theirs)) = (
        vouch_engine::volume_superblock(leg),
        vouch_engine::volume_superblock(member),
    ) else {
        return Ok(());
    };
    if ours.instance == theirs.instance {
        return Ok(());
    }
    Err(Error::InvalidArgument(instance_refusal(
        &member.display().to_string(),
        (theirs.instance, clone_origin(member)),
        &leg.display().to_string(),
        (ours.instance, clone_origin(leg)),
    )))
}

/// The snapshot a clone was made from (its `origin` record), if `dir` is
/// a clone.
pub fn clone_origin(dir: &Path) -> Option<String> {
    let bytes = std::fs::read(dir.join(vouch_engine::snapshot::ORIGIN_FILE)).ok()?;
    let origin: vouch_engine::snapshot::CloneOrigin = serde_json::from_slice(&bytes).ok()?;
    Some(origin.snapshot)
}

/// Why `member` (its instance, and the snapshot it was cloned from if it
/// is a clone) is refused beside `leg`, a member of the set.
pub fn instance_refusal(
    member: &str,
    (member_instance, member_origin): ([u8; 16], Option<String>),
    leg: &str,
    (leg_instance, leg_origin): ([u8; 16], Option<String>),
) -> String {
    const FRESH: &str =
        "a mirror's legs are copies of one volume; `vouch mirror add` a fresh volume instead";
    let hex = |instance: &[u8; 16]| -> String {
        if *instance == [0; 16] {
            "unknown (written by a vouch from before instance ids)".into()
        } else {
            instance.iter().map(|b| format!("{b:02x}")).collect()
        }
    };
    match (member_origin, leg_origin) {
        (Some(origin), _) => format!(
            "{member} is a clone of {origin}, not the volume of {leg}: {FRESH}; nothing was opened"
        ),
        (None, Some(origin)) => format!(
            "{leg} is a clone of {origin}, and {member} is not a leg of that clone: {FRESH}; nothing was opened"
        ),
        (None, None) => format!(
            "{member} has the uuid of {leg} but is another instance of it (instance {}, not {}: a clone, or a copy rewritten apart from the set): {FRESH}; nothing was opened",
            hex(&member_instance),
            hex(&leg_instance)
        ),
    }
}

/// A leg's record names every leg by its path, its own included, and the
/// set is opened from those paths. A directory holding a leg's record
/// that is not the directory the record names for that leg (a copy of
/// the leg, or a set moved elsewhere) would open the original legs, and
/// write them, in its name: it is refused before anything is opened.
fn refuse_a_copy(path: &Path, given: &MirrorRecord) -> Result<()> {
    let own = &given.members[usize::from(given.leg)].path;
    if crate::is_remote_member(own) || same_directory(path, Path::new(own)) {
        return Ok(());
    }
    let legs: Vec<String> = given
        .members
        .iter()
        .enumerate()
        .map(|(index, member)| format!("leg {index} {}", member.path))
        .collect();
    Err(Error::InvalidArgument(format!(
        "{} holds the record of leg {} of a mirror whose legs are {}, but it is not {own}: it is a copy of that leg, or the set was moved. \
         A mirror is opened from its legs' recorded paths, so using this directory would read and write the original legs; nothing was opened. \
         Give the original path; a moved set must be moved back",
        path.display(),
        given.leg,
        legs.join(", "),
    )))
}

/// Whether `a` and `b` name the same directory (same device and inode,
/// so symbolic links and relative paths agree); `false` when either is
/// missing.
fn same_directory(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// One member of an opened set.
pub struct OpenedLeg {
    pub path: PathBuf,
    /// The member's state in the set's view.
    pub state: LegState,
    /// The open volume: `None` if the leg is not active or could not be
    /// opened (`missing` says why).
    pub volume: Option<Volume>,
    /// A remote member, opened (`None`: local, not active or missing).
    pub remote: Option<Arc<dyn SealedDevice>>,
    pub missing: Option<String>,
}

/// A mirror set opened from one of its legs.
pub struct OpenedSet {
    /// The set's view (the record with the highest epoch).
    pub record: MirrorRecord,
    pub legs: Vec<OpenedLeg>,
    /// What an operator must hear about (missing legs, legs marked stale).
    pub warnings: Vec<String>,
}

/// A mirror and each leg's volume in leg order (`None`: not active or
/// missing), as `OpenedSet::into_mirror` returns them.
pub type MirrorAndLegs = (Arc<Mirror>, Vec<Option<Arc<Volume>>>);

impl OpenedSet {
    /// The `Mirror` over the opened legs and each leg's volume in leg order
    /// (`None`: not active or missing). With `record_changes`, the mirror
    /// records state changes in the legs' files (`FileMembership`).
    pub fn into_mirror(self, record_changes: bool) -> Result<MirrorAndLegs> {
        let mut volumes = Vec::with_capacity(self.legs.len());
        let mut legs = Vec::with_capacity(self.legs.len());
        for leg in self.legs {
            let volume = leg.volume.map(Arc::new);
            legs.push(MirrorLeg {
                name: leg.path.display().to_string(),
                device: volume
                    .clone()
                    .map(|v| v as Arc<dyn SealedDevice>)
                    .or(leg.remote),
                state: leg.state,
            });
            volumes.push(volume);
        }
        let membership = record_changes
            .then(|| Box::new(FileMembership::new(self.record)) as Box<dyn Membership>);
        Ok((Mirror::new(legs, membership)?, volumes))
    }
}

/// Open the mirror set the leg at `path` belongs to. `open_leg` opens one
/// leg's volume (with the caller's options and key). A leg that cannot be
/// found or opened is reported by name; with `writable`, a missing active
/// leg is marked stale in the other legs' records first (it would miss the
/// writes to come). Fails only if no active leg opens, or the legs' records
/// disagree at the same epoch (split brain).
pub fn open_mirror(
    path: &Path,
    writable: bool,
    open_leg: &mut dyn FnMut(&Path) -> Result<Volume>,
) -> Result<OpenedSet> {
    open_mirror_with(path, writable, open_leg, &mut |url, _| {
        Err(Error::Unsupported(format!(
            "{url} is remote: this caller cannot reach remote replicas"
        )))
    })
}

/// Opens a remote member of a set (its URL, the set's record).
pub type OpenRemote<'a> = dyn FnMut(&str, &MirrorRecord) -> Result<Arc<dyn SealedDevice>> + 'a;

/// `open_mirror` where members may be remote: `open_remote(url, record)`
/// connects to one and checks it belongs to the set (its uuid is
/// `record.uuid`); a remote member that fails is missing like a local one.
pub fn open_mirror_with(
    path: &Path,
    writable: bool,
    open_leg: &mut dyn FnMut(&Path) -> Result<Volume>,
    open_remote: &mut OpenRemote,
) -> Result<OpenedSet> {
    let (mut record, reasons) = view(path)?;
    refuse_apart(&record)?;
    let mut warnings = Vec::new();
    let mut legs = Vec::new();
    for (index, member) in record.members.iter().enumerate() {
        let leg_path = PathBuf::from(&member.path);
        let mut leg = OpenedLeg {
            path: leg_path.clone(),
            state: member.state,
            volume: None,
            remote: None,
            missing: reasons[index].clone(),
        };
        if member.state == LegState::Active {
            if leg.missing.is_none() && crate::is_remote_member(&member.path) {
                match open_remote(&member.path, &record) {
                    Ok(device) => leg.remote = Some(device),
                    Err(error) => leg.missing = Some(error.to_string()),
                }
            } else if leg.missing.is_none() {
                match open_leg(&leg_path) {
                    Ok(volume) => leg.volume = Some(volume),
                    Err(error) => leg.missing = Some(error.to_string()),
                }
            }
            if let Some(why) = &leg.missing {
                warnings.push(format!(
                    "mirror leg {index} ({}) is missing: {why}; serving degraded",
                    member.path
                ));
            }
        } else {
            // A stale leg (or one whose resync was interrupted) that is
            // back is opened for resync: written to, not read, until its
            // resync map is copied.
            let resumable = member.state == LegState::Stale || has_map(&record, index);
            if writable && resumable && leg.missing.is_none() {
                if crate::is_remote_member(&member.path) {
                    // Reached again (its uuid checked): a new connection.
                    match open_remote(&member.path, &record) {
                        Ok(device) => leg.remote = Some(device),
                        Err(error) => leg.missing = Some(error.to_string()),
                    }
                } else {
                    match open_leg(&leg_path) {
                        Ok(volume) => leg.volume = Some(volume),
                        Err(error) => leg.missing = Some(error.to_string()),
                    }
                }
            }
            let present = leg.volume.is_some() || leg.remote.is_some();
            warnings.push(format!(
                "mirror leg {index} ({}) is {}{}: not read until it is resynced (`vouch mirror resync`) or replaced",
                member.path,
                member.state.name(),
                if present { ", present" } else { "" }
            ));
        }
        legs.push(leg);
    }
    // Leg 0 (local) keeps the record: a set is never served from remote
    // members alone; a stale leg opened for resync does not count.
    if legs
        .iter()
        .all(|leg| leg.volume.is_none() || leg.state != LegState::Active)
    {
        return Err(Error::Corrupt(format!(
            "no active leg of the mirror could be opened: {}",
            warnings.join("; ")
        )));
    }
    let lost: Vec<usize> = legs
        .iter()
        .enumerate()
        .filter(|(_, leg)| {
            leg.state == LegState::Active && leg.volume.is_none() && leg.remote.is_none()
        })
        .map(|(index, _)| index)
        .collect();
    if writable && !lost.is_empty() {
        // Each lost leg's resync map exists (empty) before the record says
        // it is stale: from then on every write is marked in it.
        let mut after = record.clone();
        for &index in &lost {
            after.members[index].state = LegState::Stale;
        }
        let blocks = blocks_of(&legs)?;
        for &index in &lost {
            DirtyMap::open(&map_dirs(&after), index, after.uuid, blocks, true)?;
        }
        for &index in &lost {
            record.members[index].state = LegState::Stale;
            legs[index].state = LegState::Stale;
            warnings.push(format!(
                "mirror leg {index} ({}) marked stale: it will miss writes",
                record.members[index].path
            ));
        }
        record.epoch += 1;
        store_on_active_legs(&record)?;
    }
    Ok(OpenedSet {
        record,
        legs,
        warnings,
    })
}

/// The directories that hold resync maps: the active legs' that exist.
pub fn map_dirs(record: &MirrorRecord) -> Vec<PathBuf> {
    record
        .members
        .iter()
        .filter(|member| member.state == LegState::Active)
        .map(|member| PathBuf::from(&member.path))
        .filter(|dir| dir.is_dir())
        .collect()
}

/// Does an active leg's directory hold a resync map for leg `leg`?
pub fn has_map(record: &MirrorRecord, leg: usize) -> bool {
    map_dirs(record)
        .iter()
        .any(|dir| dir.join(map_file_name(leg)).exists())
}

fn blocks_of(legs: &[OpenedLeg]) -> Result<u64> {
    legs.iter()
        .find_map(|leg| leg.volume.as_ref())
        .map(|volume| BlockDevice::size(volume) / vouch_engine::BLOCK)
        .ok_or_else(|| Error::Corrupt("no leg of the mirror is open".into()))
}

/// Open (or create) the resync map of every leg that is not active and is
/// stale or has a map, and track writes for it in `mirror`. Returns each
/// such leg with why its history is unknown (`Some`: its map was missing
/// or damaged, so every block is dirty: a full verified resync).
pub fn track_stale_legs(
    mirror: &Mirror,
    record: &MirrorRecord,
) -> Result<Vec<(usize, Option<String>)>> {
    let active = mirror.active();
    let blocks = mirror.size() / vouch_engine::BLOCK;
    let mut tracked = Vec::new();
    for (index, member) in record.members.iter().enumerate() {
        if active.contains(&index) {
            // A map left by a resync that finished before its removal.
            for dir in map_dirs(record) {
                let _ = std::fs::remove_file(dir.join(map_file_name(index)));
            }
            continue;
        }
        if member.state != LegState::Stale && !has_map(record, index) {
            continue;
        }
        let (map, unknown) = DirtyMap::open(&map_dirs(record), index, record.uuid, blocks, false)?;
        mirror.track(index, Arc::new(map))?;
        tracked.push((index, unknown));
    }
    Ok(tracked)
}

/// Write `record` (each leg's own index filled in) to every active leg.
fn store_on_active_legs(record: &MirrorRecord) -> Result<()> {
    let mut copy = record.clone();
    for (index, member) in record.members.iter().enumerate() {
        if member.state == LegState::Active && !crate::is_remote_member(&member.path) {
            copy.leg = index as u16;
            write_record(Path::new(&member.path), &copy)?;
        }
    }
    Ok(())
}

/// Open the set's activity log (`mirror.active`) in every active local
/// leg's directory: what the last run may have left different, and the
/// log from now on (`Mirror::keep_activity_log`).
pub fn open_activity(
    record: &MirrorRecord,
    blocks: u64,
) -> Result<(crate::ActivityLog, crate::Recovered)> {
    crate::ActivityLog::open(
        Arc::new(crate::FileMaps),
        &map_dirs(record),
        crate::ActivityGeometry::of(record.uuid, blocks),
    )
}

/// What `open_activity` would find, read without writing anything: the
/// extents an unclean stop may have left different on the active legs.
pub fn peek_activity(record: &MirrorRecord, blocks: u64) -> Result<crate::Recovered> {
    crate::ActivityLog::peek(
        &crate::FileMaps,
        &map_dirs(record),
        crate::ActivityGeometry::of(record.uuid, blocks),
    )
}

/// Local legs whose superblocks say different sizes (a `vouch resize` cut
/// short between legs) are refused before any is opened: a writable open
/// would leave them not closed cleanly, and the set is never served at a
/// size a leg lacks. The resize run again gives every leg the size.
fn refuse_apart(record: &MirrorRecord) -> Result<()> {
    let sizes: Vec<(&str, u64)> = record
        .members
        .iter()
        .filter(|member| !crate::is_remote_member(&member.path))
        .filter_map(|member| {
            vouch_engine::volume_superblock(Path::new(&member.path))
                .ok()
                .map(|superblock| (member.path.as_str(), superblock.size_bytes))
        })
        .collect();
    if let Some(((first, size), (leg, other))) = sizes.first().and_then(|first| {
        sizes
            .iter()
            .find(|(_, other)| *other != first.1)
            .map(|other| (*first, *other))
    }) {
        return Err(Error::InvalidArgument(format!(
            "mirror leg {leg} is {other} bytes, leg {first} {size} bytes (a `vouch resize` cut short between legs: run it again to give every leg the size)"
        )));
    }
    Ok(())
}

/// `Membership` kept in the legs' `mirror` files.
pub struct FileMembership {
    record: Mutex<MirrorRecord>,
}

impl FileMembership {
    pub fn new(record: MirrorRecord) -> FileMembership {
        FileMembership {
            record: Mutex::new(record),
        }
    }
}

impl Membership for FileMembership {
    fn set_state(&self, leg: usize, state: LegState) -> Result<()> {
        let mut record = self.record.lock();
        if record.members[leg].state == state {
            return Ok(());
        }
        record.members[leg].state = state;
        record.epoch += 1;
        store_on_active_legs(&record)
    }

    fn set_unsynced(&self, unsynced: bool) -> Result<()> {
        mark_unsynced(&self.record.lock(), unsynced)
    }

    /// In the directories of the legs that stay active.
    fn create_map(
        &self,
        leg: usize,
        blocks: u64,
        marked: &[std::ops::Range<u64>],
    ) -> Result<DirtyMap> {
        let mut after = self.record.lock().clone();
        after.members[leg].state = LegState::Stale;
        let dirs = map_dirs(&after);
        if dirs.is_empty() {
            return Err(Error::Unsupported(
                "no active local leg to keep a resync map in".into(),
            ));
        }
        let (map, unknown) = DirtyMap::open_marked(&dirs, leg, after.uuid, blocks, true, marked)?;
        if let Some(why) = unknown {
            tracing::warn!(
                leg,
                why,
                "mirror: an earlier resync map was unusable: the new one marks every block"
            );
        }
        Ok(map)
    }
}
