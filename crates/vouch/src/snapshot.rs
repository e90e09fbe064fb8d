//! `vouch snapshot create|list|delete` and `vouch clone`: read-only
//! snapshots of a stopped volume and writable clones of them
//! (`vouch_engine::snapshot`; docs/FORMAT.md, "Snapshots").

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use clap::Subcommand;
use serde_json::json;
use vouch_engine::snapshot::{self, RealFs, SnapshotBreaks};
use vouch_engine::{FileStorage, OpenOptions};

use crate::key::Use;

#[derive(Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Take a read-only snapshot NAME of the volume at PATH (offline: no
    /// server may have it open), at its last flush: everything written
    /// before is in it, nothing after. It is PATH/snapshots/NAME, a
    /// complete volume that `check`, `verify`, `scrub`, `export` and
    /// `serve --snapshot NAME PATH` read; its files share every block
    /// with the volume's (FICLONE: instant on xfs and btrfs). A volume
    /// that was not closed cleanly is recovered first.
    Create {
        /// The volume's directory.
        path: PathBuf,
        /// The snapshot's name: letters, digits and . _ - + @ : (one
        /// directory entry, not starting with '.').
        name: String,
        /// Where the filesystem cannot share blocks (ext4), make a full
        /// copy of the volume's files instead (holes kept): slow, and as
        /// large as the data written.
        #[arg(long)]
        copy: bool,
        #[command(flatten)]
        key: crate::key::KeyFileArgs,
    },
    /// List the snapshots of the volume at PATH (and remove any a crash
    /// left half made or half deleted, when no server has it open).
    List {
        /// The volume's directory.
        path: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete snapshot NAME of the volume at PATH (offline). Clones made
    /// from it keep their blocks.
    Delete {
        /// The volume's directory.
        path: PathBuf,
        /// The snapshot's name.
        name: String,
    },
}

pub fn run(command: SnapshotCommand) -> Result<ExitCode> {
    match command {
        SnapshotCommand::Create {
            path, name, copy, ..
        } => create(&path, &name, copy),
        SnapshotCommand::List { path, json } => list(&path, json),
        SnapshotCommand::Delete { path, name } => delete(&path, &name),
    }
}

/// The volume at `path` stopped, recovered if it needs it, and held by
/// this process (the returned lock) so no server opens it meanwhile.
fn hold_offline(path: &Path) -> Result<std::fs::File> {
    crate::commands::volume_dir(path)?;
    if vouch_engine::volume_in_use(path)? {
        bail!(
            "{} is open in a running `vouch serve`: stop it, or take the snapshot of a stopped volume",
            path.display()
        );
    }
    // Refused before anything opens: recovering a mirror's leg alone (to
    // close it cleanly) would hide its unclean stop from the set, whose
    // next open reconciles the legs because of it.
    if vouch_mirror::is_mirrored(path) {
        bail!(
            "{} is a leg of a mirror: snapshots of mirrored volumes are not supported (take one of a single volume, e.g. after `vouch mirror remove`)",
            path.display()
        );
    }
    let superblock = vouch_engine::volume_superblock(path)?;
    let clean = superblock.state == vouch_format::superblock::STATE_CLEAN;
    if !clean || path.join("held").exists() {
        // A writable open puts back what a crashed process acknowledged
        // (its held log) and replays the journal; the close checkpoints.
        crate::key::open(path, OpenOptions::default(), Use::Data)
            .and_then(|volume| Ok(volume.close()?))
            .with_context(|| format!("recovering {} before its snapshot", path.display()))?;
    }
    FileStorage::lock_for_writing(path)
        .with_context(|| format!("holding {} for its snapshot", path.display()))
}

fn create(path: &Path, name: &str, copy: bool) -> Result<ExitCode> {
    snapshot::check_name(name)?;
    let _held = hold_offline(path)?;
    let started = Instant::now();
    let fs = RealFs { full_copy: copy };
    let method = if copy {
        "reflink, or a full copy where blocks cannot be shared"
    } else {
        "reflink"
    };
    let taken = snapshot::create(&fs, path, name, method, SnapshotBreaks::default())?;
    let elapsed = started.elapsed();
    println!(
        "snapshot {name} of {}: {} (checkpoint seq {}, {:.1} ms)",
        path.display(),
        taken.path.display(),
        taken.record.checkpoint_seq,
        elapsed.as_secs_f64() * 1e3
    );
    Ok(ExitCode::SUCCESS)
}

fn list(path: &Path, json_output: bool) -> Result<ExitCode> {
    crate::commands::volume_dir(path)?;
    let fs = RealFs::default();
    if !vouch_engine::volume_in_use(path)? {
        if let Ok(_held) = FileStorage::lock_for_writing(path) {
            for removed in snapshot::tidy(&fs, path)? {
                eprintln!(
                    "vouch: removed {removed}, left by an interrupted snapshot create or delete"
                );
            }
        }
    }
    let found = snapshot::list(&fs, path)?;
    let mut broken = false;
    if json_output {
        let items: Vec<_> = found
            .iter()
            .map(|entry| match entry {
                Ok(snap) => json!({
                    "name": snap.record.name,
                    "path": snap.path.display().to_string(),
                    "record": snap.record,
                }),
                Err(error) => json!({ "error": error.to_string() }),
            })
            .collect();
        broken = found.iter().any(Result::is_err);
        println!("{}", serde_json::to_string_pretty(&json!(items))?);
    } else {
        if found.is_empty() {
            println!("{}: no snapshots", path.display());
        }
        for entry in &found {
            match entry {
                Ok(snap) => println!(
                    "{}\tcreated {}\tcheckpoint seq {}\t{}\t{}",
                    snap.record.name,
                    snap.record.created_unix,
                    snap.record.checkpoint_seq,
                    snap.record.layout,
                    snap.path.display()
                ),
                Err(error) => {
                    broken = true;
                    println!("?\t{error}");
                }
            }
        }
    }
    Ok(if broken {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn delete(path: &Path, name: &str) -> Result<ExitCode> {
    snapshot::check_name(name)?;
    crate::commands::volume_dir(path)?;
    let _held = FileStorage::lock_for_writing(path)
        .with_context(|| format!("holding {} to delete its snapshot", path.display()))?;
    // A snapshot served, checked or cloned holds its own lock: deleting it
    // under that process would leave it reading a snapshot no name leads
    // to (and a new snapshot of the same name a different one).
    let snapshot_dir = path.join(snapshot::SNAPSHOTS_DIR).join(name);
    let _snapshot_held = match FileStorage::lock_for_writing(&snapshot_dir) {
        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => anyhow::bail!(
            "snapshot {name} of {} is open in another vouch process (a serve, check or clone): stop it first",
            path.display()
        ),
        // A missing snapshot is named by `delete` below.
        other => other.ok(),
    };
    let fs = RealFs::default();
    snapshot::tidy(&fs, path)?;
    snapshot::delete(&fs, path, name)?;
    println!("deleted snapshot {name} of {}", path.display());
    Ok(ExitCode::SUCCESS)
}

/// `vouch clone SNAPSHOT NEWPATH`.
pub fn clone(snapshot_dir: &Path, new_path: &Path, copy: bool) -> Result<ExitCode> {
    crate::commands::volume_dir(snapshot_dir)?;
    let started = Instant::now();
    // The origin names the snapshot by its absolute path, so a server of
    // the clone finds it from any directory (`qemu:allocation-depth`).
    let snapshot_dir = &snapshot_dir
        .canonicalize()
        .with_context(|| format!("finding {}", snapshot_dir.display()))?;
    snapshot::clone(&RealFs { full_copy: copy }, snapshot_dir, new_path)?;
    println!(
        "cloned {} to {} ({:.1} ms)",
        snapshot_dir.display(),
        new_path.display(),
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(ExitCode::SUCCESS)
}

/// `serve --snapshot NAME PATH`: the snapshot's directory, which must be
/// a snapshot (not a half-made one).
pub fn served_path(volume: &Path, name: &str) -> Result<PathBuf> {
    snapshot::check_name(name)?;
    let path = snapshot::snapshot_path(volume, name);
    if !path.is_dir() {
        bail!(
            "{} has no snapshot named {name:?} (`vouch snapshot list {}` lists them)",
            volume.display(),
            volume.display()
        );
    }
    Ok(path)
}
