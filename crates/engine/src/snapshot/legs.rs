//! A snapshot of a mirror's legs (docs/FORMAT.md, "Snapshots of a
//! mirror"): every leg given gets its own copy of snapshot NAME,
//! `LEG/snapshots/NAME`, a snapshot of that leg as any volume's, all
//! cloned at one flush point held across the legs (`LegsFlushPoint`), so
//! each copy is exactly what its leg held there and the copies hold the
//! same data. A copy is made and published as a single volume's snapshot
//! is (`.NAME.partial`, synced, renamed): a crash leaves each leg with its
//! copy whole or absent. Every leg's copy is synced before the first is
//! named, so a crash leaves the legs disagreeing (some named, some not)
//! only between the renames; the caller's `list` reports that, and its
//! `delete` removes the copies that were named.
//!
//! The engine knows nothing of mirrors: the legs are volume directories,
//! and which of them to snapshot (the active ones) the caller decides.

use std::path::{Path, PathBuf};

use vouch_format::Superblock;

use super::{
    check_name, clone_at, name_it, new_id, partial_path, prepare, seal, snapshot_path, take_back,
    tidy, warm_up, Asked, FlushPoint, Point, Snapshot, SnapshotBreaks, SnapshotFs, Stopped,
};
use crate::error::{Error, Result};

/// The legs held at a flush point: each leg's directory and superblock,
/// in leg order.
pub type HeldLegs = [(PathBuf, Superblock)];

/// Where the legs' copies come from: every leg at one flush point.
pub trait LegsFlushPoint {
    /// Run `clone` with every leg's files at one flush point (each holding
    /// every write acknowledged before this was called, and the same
    /// ones), given each leg's directory and superblock in leg order, and
    /// held there until it returns.
    fn at_flush_point(&self, clone: &mut dyn FnMut(&HeldLegs) -> Result<()>) -> Result<()>;
    /// Were the legs served (an online snapshot)?
    fn online(&self) -> bool;
}

/// Run `clone` inside the flush point of every one of `points` (a leg's
/// directory and its flush point), nested in their order: the first is
/// entered first and left last.
pub fn hold_legs(
    points: &[(&Path, &dyn FlushPoint)],
    clone: &mut dyn FnMut(&HeldLegs) -> Result<()>,
) -> Result<()> {
    fn nest(
        points: &[(&Path, &dyn FlushPoint)],
        held: &mut Vec<(PathBuf, Superblock)>,
        clone: &mut dyn FnMut(&HeldLegs) -> Result<()>,
    ) -> Result<()> {
        let Some(((dir, first), rest)) = points.split_first() else {
            return clone(held);
        };
        first.at_flush_point(&mut |superblock| {
            held.push((dir.to_path_buf(), *superblock));
            let result = nest(rest, held, clone);
            held.pop();
            result
        })
    }
    nest(points, &mut Vec::new(), clone)
}

/// Stopped legs, each closed cleanly and held by the caller.
pub struct StoppedLegs<'a> {
    pub fs: &'a dyn SnapshotFs,
    pub legs: &'a [PathBuf],
}

impl LegsFlushPoint for StoppedLegs<'_> {
    fn at_flush_point(&self, clone: &mut dyn FnMut(&HeldLegs) -> Result<()>) -> Result<()> {
        let stopped: Vec<Stopped> = self
            .legs
            .iter()
            .map(|leg| Stopped {
                fs: self.fs,
                volume: leg,
            })
            .collect();
        let points: Vec<(&Path, &dyn FlushPoint)> = self
            .legs
            .iter()
            .zip(&stopped)
            .map(|(leg, point)| (leg.as_path(), point as &dyn FlushPoint))
            .collect();
        hold_legs(&points, clone)
    }
    fn online(&self) -> bool {
        false
    }
}

/// Take snapshot `name` of each leg directory of `legs` at `point`, one
/// copy per leg (one `id` for all). Callers serialize creates and deletes
/// of the set (every leg's lock offline; the server's lock online).
pub fn create_legs(
    fs: &dyn SnapshotFs,
    legs: &[PathBuf],
    name: &str,
    method: &str,
    breaks: SnapshotBreaks,
    point: &dyn LegsFlushPoint,
) -> Result<Vec<Snapshot>> {
    let asked = Asked {
        name,
        method,
        breaks,
    };
    create_legs_asked(fs, legs, &asked, point, &new_id())
}

/// `create_legs` (method "reflink", no breaks) with the snapshot's id
/// given: the caller gives the same id to copies it makes elsewhere (a
/// remote replica's, inside `point`).
pub fn create_legs_with_id(
    fs: &dyn SnapshotFs,
    legs: &[PathBuf],
    point: &dyn LegsFlushPoint,
    name: &str,
    id: &str,
) -> Result<Vec<Snapshot>> {
    let asked = Asked {
        name,
        method: "reflink",
        breaks: SnapshotBreaks::default(),
    };
    create_legs_asked(fs, legs, &asked, point, id)
}

fn create_legs_asked(
    fs: &dyn SnapshotFs,
    legs: &[PathBuf],
    asked: &Asked,
    point: &dyn LegsFlushPoint,
    id: &str,
) -> Result<Vec<Snapshot>> {
    let name = asked.name;
    check_name(name)?;
    if legs.is_empty() {
        return Err(Error::InvalidArgument(
            "a snapshot of a mirror needs an active leg".into(),
        ));
    }
    let mut made = Vec::new();
    for leg in legs {
        match prepare(fs, leg, name) {
            Ok(made_dir) => made.push(made_dir),
            Err(error) => {
                for (leg, &made_dir) in legs.iter().zip(&made) {
                    take_back(fs, leg, made_dir);
                }
                return Err(error);
            }
        }
    }
    let result = publish_legs(fs, legs, asked, point, id);
    if result.is_err() {
        for (leg, &made_dir) in legs.iter().zip(&made) {
            let _ = fs.remove_all(&partial_path(leg, name));
            take_back(fs, leg, made_dir);
        }
    }
    result
}

/// `publish` for several legs: each leg's warm copies, then every leg's
/// clone at the one flush point, then every copy sealed, then each named.
fn publish_legs(
    fs: &dyn SnapshotFs,
    legs: &[PathBuf],
    asked: &Asked,
    point: &dyn LegsFlushPoint,
    id: &str,
) -> Result<Vec<Snapshot>> {
    for leg in legs {
        tidy(fs, leg)?;
    }
    let warm: Vec<Vec<PathBuf>> = legs
        .iter()
        .map(|leg| warm_up(fs, leg, asked.name, point.online()))
        .collect();
    let mut taken = Vec::new();
    point.at_flush_point(&mut |held| {
        let dirs: Vec<&PathBuf> = held.iter().map(|(dir, _)| dir).collect();
        if dirs.len() != legs.len() || dirs.iter().zip(legs).any(|(a, b)| *a != b) {
            return Err(Error::InvalidArgument(format!(
                "the mirror's active legs changed while its snapshot was taken (now {}, before {}): nothing was made; take it again",
                shown(dirs.iter().map(|dir| dir.as_path())),
                shown(legs.iter().map(PathBuf::as_path))
            )));
        }
        for ((leg, superblock), warm) in held.iter().zip(&warm) {
            let at = Point {
                online: point.online(),
                // A mirror's legs have one layout each (`vouch migrate`
                // refuses a mirror): a leg with regions is refused.
                covers_regions: false,
                warm: !warm.is_empty(),
            };
            taken.push(clone_at(fs, leg, superblock, asked, id, at)?);
        }
        Ok(())
    })?;
    // ORDER POINT: every leg's copy durable before any is named, so a
    // crash leaves copies named on some legs only between the renames.
    for ((leg, warm), (_, files)) in legs.iter().zip(&warm).zip(&taken) {
        seal(fs, leg, asked, warm, files)?;
    }
    let mut snapshots: Vec<Snapshot> = Vec::new();
    for (leg, (record, files)) in legs.iter().zip(taken) {
        if let Err(error) = name_it(fs, leg, asked, &files) {
            if snapshots.is_empty() {
                return Err(error);
            }
            // The legs now disagree: say which copies have their name.
            return Err(Error::InvalidArgument(format!(
                "{error}; the copies of {} have their name: `vouch snapshot delete` removes them",
                shown(snapshots.iter().map(|snap| snap.path.as_path()))
            )));
        }
        snapshots.push(Snapshot {
            path: snapshot_path(leg, asked.name),
            record,
            materialising: false,
            failed: None,
        });
    }
    Ok(snapshots)
}

fn shown<'a>(dirs: impl Iterator<Item = &'a Path>) -> String {
    dirs.map(|dir| dir.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
