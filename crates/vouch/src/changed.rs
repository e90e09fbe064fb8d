//! Changed blocks of a served volume over NBD: `qemu:dirty-bitmap:NAME`
//! for each snapshot NAME of the volume (bit 0: changed since it), and,
//! for a clone, `qemu:allocation-depth` (1 written in the clone since it
//! was made, 2 from its snapshot, 0 never written). Both compare contexts
//! (`vouch_engine::changed`), never data. A layer beside the export: a
//! volume without snapshots has none of this on its request path, and a
//! snapshot is opened (read-only, keyless: contexts need no key) at the
//! first BLOCK_STATUS request that asks about it and kept open for the
//! next (one at a time per served volume; reopened when its record
//! changes).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vouch_engine::changed::{compare_serving_runs, Change, Serving};
use vouch_engine::regions::RegionVolume;
use vouch_engine::snapshot::{self, CloneOrigin, RealFs, SnapshotRecord};
use vouch_engine::{BlockDevice, OpenOptions, Volume, BLOCK};
use vouch_nbd::{Errno, ExportError};

use crate::export::to_export_error;

/// Where a served volume's snapshots, and a clone's origin, are found.
pub struct Changes {
    /// The volume's directory.
    volume: PathBuf,
    /// The volume's uuid: a snapshot of another volume is refused.
    uuid: String,
    /// The served volume with regions, whose members' contexts are
    /// compared region by region (`with_regions`).
    regions: Option<Arc<RegionVolume>>,
    /// A served mirror and its legs' volumes (`with_mirror`): a snapshot
    /// is compared with the live contexts of an active leg holding a copy.
    mirror: Option<MirrorLegs>,
}

/// A served mirror and each leg's volume (`None`: not open).
type MirrorLegs = (
    Arc<vouch_mirror::Mirror>,
    Vec<Option<std::sync::Weak<Volume>>>,
);

/// The snapshot each served volume opened last (its directory, as given
/// and canonical, and its record), kept open for the next request: a
/// client reading a bitmap extent by extent (qemu's nbd driver) would
/// otherwise open it once per extent. It is reopened when its record
/// changes (a snapshot deleted and taken again under the same name). One
/// table for the process, so that an online delete (`release`) can close
/// it: an open snapshot holds its lock, which a delete must take.
type Opened = (PathBuf, PathBuf, SnapshotRecord, Arc<Contexts>);
static OPENED: parking_lot::Mutex<Vec<(PathBuf, Opened)>> = parking_lot::Mutex::new(Vec::new());

/// Close the snapshot at `snapshot_dir` if a served volume holds it open
/// for its changed blocks (before an online delete takes its lock).
pub fn release(snapshot_dir: &Path) {
    let canonical = snapshot_dir.canonicalize().ok();
    OPENED
        .lock()
        .retain(|(_, (path, real, _, _))| path != snapshot_dir && canonical.as_ref() != Some(real));
}

fn invalid(message: String) -> ExportError {
    ExportError::new(Errno::Inval, message)
}

/// A snapshot or volume opened to read its contexts: of one layout, or
/// with regions (both members and the record).
pub enum Contexts {
    One(Volume),
    Regions(RegionVolume),
}

impl Contexts {
    /// Its blocks as changed blocks compare them, region by region.
    pub fn serving(&self) -> Serving<'_> {
        match self {
            Contexts::One(volume) => Serving::one(volume),
            Contexts::Regions(volume) => Serving::regions(volume),
        }
    }

    /// Its home member (the volume itself when it has one layout).
    fn home(&self) -> &Volume {
        match self {
            Contexts::One(volume) => volume,
            Contexts::Regions(volume) => volume.home(),
        }
    }

    /// Closed cleanly: every member.
    fn clean(&self) -> vouch_engine::Result<bool> {
        Ok(match self {
            Contexts::One(volume) => volume.info()?.clean,
            Contexts::Regions(volume) => {
                volume.home().info()?.clean
                    && volume
                        .member(vouch_engine::regions::other_layout(volume.home_layout()))
                        .info()?
                        .clean
            }
        })
    }
}

/// Open the snapshot (or any volume) at `path` to read its contexts.
pub fn open_contexts(path: &Path) -> vouch_engine::Result<Contexts> {
    let options = OpenOptions {
        read_only: true,
        keyless: true,
        ..OpenOptions::default()
    };
    if crate::migrate::has_regions(path) {
        return Ok(Contexts::Regions(RegionVolume::open(path, &options)?));
    }
    Ok(Contexts::One(vouch_engine::open_volume(path, &options)?))
}

/// A snapshot's record, read from its directory.
pub fn read_record(dir: &Path) -> anyhow::Result<SnapshotRecord> {
    let file = dir.join(snapshot::RECORD_FILE);
    let bytes = std::fs::read(&file)
        .map_err(|error| anyhow::anyhow!("{} is no snapshot: {error}", file.display()))?;
    serde_json::from_slice(&bytes)
        .map_err(|error| anyhow::anyhow!("{}: not a snapshot record: {error}", file.display()))
}

impl Changes {
    pub fn new(volume: &Path, uuid: String) -> Changes {
        Changes {
            volume: volume.to_path_buf(),
            uuid,
            regions: None,
            mirror: None,
        }
    }

    /// The served volume is a mirror: its snapshot's copy on an active leg
    /// is compared with that leg (`changes_leg`).
    pub fn with_mirror(
        mut self,
        mirror: Arc<vouch_mirror::Mirror>,
        volumes: &[Option<Arc<Volume>>],
    ) -> Changes {
        // Weak: the legs are closed cleanly at the end, by their last holder.
        let volumes = volumes
            .iter()
            .map(|volume| volume.as_ref().map(Arc::downgrade))
            .collect();
        self.mirror = Some((mirror, volumes));
        self
    }

    /// The served volume has regions: compare through its members.
    pub fn with_regions(mut self, volume: Arc<RegionVolume>) -> Changes {
        self.regions = Some(volume);
        self
    }

    /// The live volume as changed blocks compare it: through its members
    /// when it has regions. A volume whose superblock says it has regions
    /// served as a device of one layout is refused: its home member's
    /// contexts are not the served blocks'.
    fn live<'a>(&'a self, live: &'a dyn BlockDevice) -> Result<Serving<'a>, ExportError> {
        match &self.regions {
            Some(volume) => Ok(Serving::regions(volume)),
            None if crate::migrate::has_regions(&self.volume) => Err(ExportError::new(
                Errno::Io,
                format!(
                    "{} has regions now and is served as a volume of one layout: its changed blocks cannot be told; serve it again",
                    self.volume.display()
                ),
            )),
            None => Ok(Serving::one(live)),
        }
    }

    /// The snapshot at `dir` (whose record is `record`) opened to read its
    /// contexts, from the cache when it is the one opened last.
    fn opened(&self, dir: &Path, record: &SnapshotRecord) -> Result<Arc<Contexts>, ExportError> {
        let mut opened = OPENED.lock();
        let mine = opened.iter().position(|(volume, _)| *volume == self.volume);
        if let Some((_, (path, _, held, volume))) = mine.map(|at| &opened[at]) {
            if path == dir && held == record {
                return Ok(Arc::clone(volume));
            }
        }
        // The one held before is closed first: one snapshot open at a time.
        if let Some(at) = mine {
            opened.swap_remove(at);
        }
        let volume = Arc::new(open_contexts(dir).map_err(to_export_error)?);
        let real = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        let held = (dir.to_path_buf(), real, record.clone(), Arc::clone(&volume));
        opened.push((self.volume.clone(), held));
        Ok(volume)
    }

    /// The names of the volume's snapshots now (their directories' names,
    /// which `dirty_status` finds them by), read at every LIST and SET
    /// option so a snapshot made while serving is offered to the next.
    pub fn snapshots(&self) -> Vec<String> {
        let dirs: Vec<PathBuf> = match &self.mirror {
            Some((mirror, _)) => {
                let status = mirror.status();
                mirror
                    .active()
                    .into_iter()
                    .map(|leg| PathBuf::from(&status[leg].name))
                    .collect()
            }
            None => vec![self.volume.clone()],
        };
        let mut names: Vec<String> = dirs
            .iter()
            .flat_map(|dir| snapshot::list(&RealFs::default(), dir).unwrap_or_default())
            .filter_map(|entry| entry.ok())
            .filter(|snap| snap.failed.is_none() && snap.record.uuid == self.uuid)
            .filter_map(|snap| Some(snap.path.file_name()?.to_str()?.to_string()))
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// The snapshot this volume (a clone) was made from, when it is still
    /// there and is the one the clone's `origin` names.
    fn origin(&self) -> Option<PathBuf> {
        let bytes = std::fs::read(self.volume.join(snapshot::ORIGIN_FILE)).ok()?;
        let origin: CloneOrigin = serde_json::from_slice(&bytes).ok()?;
        let path = PathBuf::from(&origin.snapshot);
        (read_record(&path).ok()? == origin.record).then_some(path)
    }

    pub fn is_clone(&self) -> bool {
        // A mirror answers changed blocks only (`with_mirror`).
        self.mirror.is_none() && self.origin().is_some()
    }

    /// `qemu:dirty-bitmap:NAME` of `live` from `offset`.
    pub fn dirty_status(
        &self,
        live: &dyn BlockDevice,
        name: &str,
        (offset, length, max_blocks): (u64, u64, u64),
    ) -> Result<Vec<(u64, bool)>, ExportError> {
        snapshot::check_name(name).map_err(to_export_error)?;
        // A mirror: an active leg's copy, compared with that leg.
        let leg = match &self.mirror {
            Some((mirror, volumes)) => {
                Some(changes_leg(mirror, volumes, name).ok_or_else(|| {
                    invalid(format!(
                        "no active leg of the mirror {} holds a copy of snapshot {name:?}",
                        self.volume.display()
                    ))
                })?)
            }
            None => None,
        };
        let dir = match &leg {
            Some((leg_dir, _)) => snapshot::snapshot_path(leg_dir, name),
            None => snapshot::snapshot_path(&self.volume, name),
        };
        let record = read_record(&dir).map_err(|error| {
            // A deleted snapshot is not held open any longer (its space).
            release(&dir);
            invalid(format!(
                "{} has no snapshot named {name:?} now ({error})",
                self.volume.display()
            ))
        })?;
        if record.uuid != self.uuid {
            return Err(invalid(format!(
                "snapshot {name:?} is of volume {}, not of this one ({})",
                record.uuid, self.uuid
            )));
        }
        let snap = self.opened(&dir, &record)?;
        let now = match &leg {
            Some((_, volume)) => Serving::one(&**volume),
            None => self.live(live)?,
        };
        let runs = runs_from(&snap.serving(), &now, offset, length, max_blocks)?;
        Ok(in_bytes(offset, length, runs, |change| {
            change == Change::Changed
        }))
    }

    /// `qemu:allocation-depth` of `live` (a clone) from `offset`.
    pub fn allocation_depth(
        &self,
        live: &dyn BlockDevice,
        (offset, length, max_blocks): (u64, u64, u64),
    ) -> Result<Vec<(u64, u32)>, ExportError> {
        let Some(origin) = self.origin() else {
            return Err(invalid(format!(
                "{} is not a clone of a snapshot that is still there",
                self.volume.display()
            )));
        };
        let record = read_record(&origin).map_err(|error| invalid(error.to_string()))?;
        let snap = self.opened(&origin, &record)?;
        let runs = runs_from(
            &snap.serving(),
            &self.live(live)?,
            offset,
            length,
            max_blocks,
        )?;
        Ok(in_bytes(offset, length, runs, |change| match change {
            Change::NeverWritten => 0,
            Change::Changed => 1,
            Change::Same => 2,
        }))
    }
}

/// `compare_runs` over the blocks a BLOCK_STATUS request covers.
fn runs_from(
    then: &Serving,
    now: &Serving,
    offset: u64,
    length: u64,
    max_blocks: u64,
) -> Result<Vec<(u64, Change)>, ExportError> {
    let first = offset / BLOCK;
    let end = offset
        .saturating_add(length)
        .div_ceil(BLOCK)
        .min(first + max_blocks.max(1))
        .min(now.size() / BLOCK);
    // Compared in growing steps, stopping once one whole extent is known:
    // a reply may cover less than asked, and qemu's client asks for one
    // extent at a time (REQ_ONE), from that extent's end. Without this a
    // request compared up to `max_blocks` blocks on each side to answer
    // with the first run.
    let mut runs: Vec<(u64, Change)> = Vec::new();
    let mut lba = first;
    let mut step = FIRST_STEP_BLOCKS;
    while lba < end && runs.len() < 2 {
        let stop = end.min(lba + step);
        for (blocks, change) in
            compare_serving_runs(then, now, lba, stop - lba).map_err(to_export_error)?
        {
            match runs.last_mut() {
                Some((count, last)) if *last == change => *count += blocks,
                _ => runs.push((blocks, change)),
            }
        }
        lba = stop;
        step = step.saturating_mul(2);
    }
    Ok(runs)
}

/// Blocks compared by a BLOCK_STATUS request's first step (doubling).
const FIRST_STEP_BLOCKS: u64 = 256;

/// Runs of whole blocks, the first holding `offset`, as runs of bytes from
/// `offset`, at most `length` of them, each run's status by `status`.
pub fn in_bytes<T, S>(
    offset: u64,
    length: u64,
    runs: impl IntoIterator<Item = (u64, T)>,
    status: impl Fn(T) -> S,
) -> Vec<(u64, S)> {
    let mut out = Vec::new();
    let mut skip = offset % BLOCK;
    let mut remaining = length;
    for (blocks, kind) in runs {
        if remaining == 0 {
            break;
        }
        let bytes = (blocks * BLOCK - skip).min(remaining);
        skip = 0;
        remaining -= bytes;
        out.push((bytes, status(kind)));
    }
    out
}

/// The volume a snapshot directory (`PATH/snapshots/NAME`) belongs to.
fn volume_of(snapshot_dir: &Path) -> anyhow::Result<PathBuf> {
    let parent = snapshot_dir.parent().filter(|parent| {
        parent.file_name().and_then(|name| name.to_str()) == Some(snapshot::SNAPSHOTS_DIR)
    });
    let Some(parent) = parent else {
        anyhow::bail!(
            "{} is not a snapshot's directory (PATH/snapshots/NAME; `vouch snapshot list PATH` lists them)",
            snapshot_dir.display()
        );
    };
    Ok(match parent.parent() {
        Some(volume) if !volume.as_os_str().is_empty() => volume.to_path_buf(),
        _ => PathBuf::from("."),
    })
}

/// `vouch diff SNAP [SNAP2]`: the ranges changed in the volume SNAP was
/// taken of (or in snapshot SNAP2 of it) since SNAP.
pub fn diff(
    from: &Path,
    to: Option<&Path>,
    json_output: bool,
) -> anyhow::Result<std::process::ExitCode> {
    use anyhow::Context as _;
    let volume = volume_of(from)?;
    if !from.is_dir() {
        anyhow::bail!(
            "{} has no snapshot named {:?} (`vouch snapshot list {}` lists them)",
            volume.display(),
            from.file_name().unwrap_or_default().to_string_lossy(),
            volume.display()
        );
    }
    let from_record = read_record(from)?;
    refuse_inactive_leg(&volume)?;
    // SNAP2: a directory, or the name of another snapshot of the volume.
    let to_path = to.map(|to| {
        if to.components().count() == 1 && !to.is_dir() {
            snapshot::snapshot_path(&volume, &to.to_string_lossy())
        } else {
            to.to_path_buf()
        }
    });
    let now_path = to_path.clone().unwrap_or_else(|| volume.clone());
    if let Some(to_path) = &to_path {
        read_record(to_path)?;
        // A clone keeps its origin's uuid and commits from the same
        // sequence: a block rewritten in each may carry equal contexts
        // over different data. Only snapshots of one volume compare.
        let same = |path: &Path| std::fs::canonicalize(path).ok();
        let to_volume = volume_of(to_path)?;
        if same(&to_volume).is_none() || same(&to_volume) != same(&volume) {
            anyhow::bail!(
                "{} is a snapshot of {}, and {} of {}: only snapshots of the same volume (PATH/snapshots/NAME, one PATH) can be compared; a clone's blocks are compared with its origin by `qemu:allocation-depth`",
                from.display(),
                volume.display(),
                to_path.display(),
                to_volume.display()
            );
        }
    } else if vouch_engine::volume_in_use(&volume)? {
        anyhow::bail!(
            "{} is open in a running `vouch serve`: ask it with `nbdinfo --map=qemu:dirty-bitmap:{} URI`, or stop it",
            volume.display(),
            from_record.name
        );
    }
    let then = open_contexts(from).with_context(|| format!("opening {}", from.display()))?;
    let now =
        open_contexts(&now_path).with_context(|| format!("opening {}", now_path.display()))?;
    // A volume left unclean (killed, power lost) opens read-only without
    // recovery: what only its journal holds (a trim or zero whose home
    // write was not yet durable) is not in the metadata compared.
    if !now.clean()? {
        anyhow::bail!(
            "{} was not closed cleanly (its journal holds changes its metadata may not): serve it once (`vouch serve {}` recovers it at open, then stop it), then run `vouch diff` again",
            now_path.display(),
            now_path.display()
        );
    }
    let (then_uuid, now_uuid) = (then.home().uuid_string(), now.home().uuid_string());
    if then_uuid != now_uuid {
        anyhow::bail!(
            "{} is a snapshot of volume {}, and {} is of volume {}: blocks of different volumes cannot be compared",
            from.display(),
            then_uuid,
            now_path.display(),
            now_uuid
        );
    }
    let (then_serving, now_serving) = (then.serving(), now.serving());
    let ranges = vouch_engine::changed::changed_serving_ranges(&then_serving, &now_serving)?;
    let size = now_serving.size();
    let changed: u64 = ranges.iter().map(|(_, length)| length).sum();
    let against = match &to_path {
        Some(path) => path.display().to_string(),
        None => volume.display().to_string(),
    };
    if json_output {
        let items: Vec<_> = ranges
            .iter()
            .map(|(offset, length)| serde_json::json!({ "offset": offset, "length": length }))
            .collect();
        let report = serde_json::json!({
            "from": from.display().to_string(),
            "to": against,
            "size": size,
            "block_size": BLOCK,
            "changed_bytes": changed,
            "ranges": items,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{against} since {}: {changed} bytes changed in {} ranges, of {size} ({:.2} %); offset and length of each:",
            from.display(),
            ranges.len(),
            changed as f64 * 100.0 / size.max(1) as f64
        );
        for (offset, length) in &ranges {
            println!("{offset}\t{length}");
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// The leg of a served mirror whose changed blocks since snapshot `name`
/// are told: an active leg holding a copy (its own snapshot and its own
/// live contexts are compared; the legs store the same contexts).
fn changes_leg(
    mirror: &vouch_mirror::Mirror,
    volumes: &[Option<std::sync::Weak<Volume>>],
    name: &str,
) -> Option<(PathBuf, Arc<Volume>)> {
    let status = mirror.status();
    mirror.active().into_iter().find_map(|leg| {
        let dir = PathBuf::from(&status[leg].name);
        let volume = volumes.get(leg)?.as_ref()?.upgrade()?;
        snapshot::snapshot_path(&dir, name)
            .is_dir()
            .then_some((dir, volume))
    })
}

/// `vouch diff` of a mirror leg's copy compares it with that leg: a leg
/// that is not active now lacks writes the mirror acknowledged, so its
/// changed blocks would be too few. Refused, naming an active leg.
fn refuse_inactive_leg(volume: &Path) -> anyhow::Result<()> {
    if !vouch_mirror::is_mirrored(volume) {
        return Ok(());
    }
    let (record, _) = vouch_mirror::set::view(volume)?;
    let own = vouch_mirror::set::read_record(volume)?.leg;
    let member = &record.members[usize::from(own)];
    if member.state != vouch_mirror::LegState::Active {
        let active = record
            .members
            .iter()
            .find(|member| member.state == vouch_mirror::LegState::Active)
            .map_or("none".to_string(), |member| member.path.clone());
        anyhow::bail!(
            "{} is a {} leg of its mirror: it lacks writes the mirror took, so its changed blocks would be too few; diff the copy of an active leg ({active})",
            volume.display(),
            member.state.name()
        );
    }
    Ok(())
}
