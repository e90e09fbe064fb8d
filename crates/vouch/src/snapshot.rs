//! `vouch snapshot create|list|delete` and `vouch clone`: read-only
//! snapshots of a stopped volume and writable clones of them
//! (`vouch_engine::snapshot`; docs/FORMAT.md, "Snapshots").

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use clap::Subcommand;
use serde_json::json;
use vouch_engine::snapshot::{self, fenced, RealFs, SnapshotBreaks};
use vouch_engine::{FileStorage, OpenOptions};

use crate::key::Use;
use crate::offload::client::{Client, ServerArgs};

#[derive(Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Take a read-only snapshot NAME of the volume at PATH, at its last
    /// flush: everything written before is in it, nothing after. It is
    /// PATH/snapshots/NAME, a complete volume that `check`, `verify`,
    /// `scrub`, `export` and `serve --snapshot NAME PATH` read; its files
    /// (mode 0444) share every block with the volume's (FICLONE: instant
    /// on xfs and btrfs). Where the filesystem cannot clone (ext4), it is
    /// an overlay instead: a fence and a log of each block's bytes before
    /// its first write since, appended before that write (nothing copied;
    /// its space is the log, `snapshot list` shows it), one per volume;
    /// resize and migrate wait for its delete. Offline, no server may have the volume open, and
    /// one that was not closed cleanly is recovered first. Online
    /// (`--server ADDR [EXPORT] NAME`), the server commits what clients
    /// wrote and checkpoints, then clones the files while no commit runs:
    /// writes acknowledged before the call are in the snapshot, none
    /// issued after it returned; clients' flushes wait for the clones,
    /// their writes meanwhile go to the write-back buffer. Of a mirror
    /// (PATH any leg), each active leg gets its copy, LEG/snapshots/NAME,
    /// all at one flush point (online: the mirror's writes held while
    /// every leg's flush point is entered, no longer); a stale or faulted
    /// leg gets none. A remote leg's copy is its replica's snapshot
    /// (DIR/NAME/snapshots/SNAP on the replica's host), taken through the
    /// replica protocol inside the same flush point: every active remote
    /// leg must be reachable, and a replica server too old for snapshots
    /// is refused by name; online, --copy with a remote leg is refused
    /// (the mirror's writes would be held for the replica's whole copy).
    Create {
        /// The volume's directory; with --server, the export (optional
        /// when the server has one).
        path: String,
        /// The snapshot's name: letters, digits and . _ - + @ : (one
        /// directory entry, not starting with '.').
        name: Option<String>,
        /// Where the filesystem cannot share blocks (ext4), make a full
        /// copy of the volume's files instead of an overlay (holes kept):
        /// slow, and as large as the data written (online: the volume's
        /// flushes wait for the whole copy).
        #[arg(long)]
        copy: bool,
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        key: crate::key::KeyFileArgs,
    },
    /// List the snapshots of the volume at PATH (and remove any a crash
    /// left half made or half deleted, when no server has it open). Of a
    /// mirror, each snapshot's copies by leg, and a warning (exit 1)
    /// where the legs disagree (a create or delete was interrupted).
    List {
        /// The volume's directory; with --server, the export (optional
        /// when the server has one).
        path: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Delete snapshot NAME of the volume at PATH (offline, or online with
    /// --server ADDR [EXPORT] NAME). Clones made from it keep their
    /// blocks. A snapshot some vouch process has open (served, checked,
    /// cloned) is not deleted. Of a mirror, every leg's copy.
    Delete {
        /// The volume's directory; with --server, the export (optional
        /// when the server has one).
        path: String,
        /// The snapshot's name.
        name: Option<String>,
        #[command(flatten)]
        server: ServerArgs,
    },
}

pub fn run(command: SnapshotCommand) -> Result<ExitCode> {
    match command {
        SnapshotCommand::Create {
            path,
            name,
            copy,
            server,
            ..
        } => {
            if server.server.is_some() {
                return create_through(&server, &path, name.as_deref(), copy);
            }
            let name = name.context("missing NAME: vouch snapshot create PATH NAME")?;
            create(Path::new(&path), &name, copy)
        }
        SnapshotCommand::List { path, json, server } => {
            if server.server.is_some() {
                return list_through(&server, path.as_deref(), json);
            }
            let path = path.context("missing PATH: vouch snapshot list PATH")?;
            list(Path::new(&path), json)
        }
        SnapshotCommand::Delete { path, name, server } => {
            if server.server.is_some() {
                return delete_through(&server, &path, name.as_deref());
            }
            let name = name.context("missing NAME: vouch snapshot delete PATH NAME")?;
            delete(Path::new(&path), &name)
        }
    }
}

/// `[EXPORT] NAME` on the command line: the export, named or the server's
/// only one, and the snapshot's name.
pub(crate) fn export_and_name(
    client: &Client,
    first: Option<&str>,
    second: Option<&str>,
) -> Result<(String, Option<String>)> {
    if let (Some(export), Some(name)) = (first, second) {
        return Ok((export.to_string(), Some(name.to_string())));
    }
    let listed = client.call(hyper::Method::GET, "/v1/exports", None)?;
    let names: Vec<String> = listed["exports"]
        .as_array()
        .map(|exports| {
            exports
                .iter()
                .filter_map(|export| export["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    match names.as_slice() {
        [only] => Ok((only.clone(), first.map(str::to_string))),
        _ => bail!(
            "the server has {} exports ({}): name one, --server ADDR EXPORT NAME",
            names.len(),
            names.join(", ")
        ),
    }
}

/// An export's snapshots' route.
fn snapshots_route(export: &str) -> String {
    format!("/v1/exports/{}/snapshots", percent(export))
}

/// `text` percent-encoded for one path segment.
pub(crate) fn percent(text: &str) -> String {
    text.bytes()
        .map(|byte| {
            if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
                (byte as char).to_string()
            } else {
                format!("%{byte:02X}")
            }
        })
        .collect()
}

fn create_through(
    server: &ServerArgs,
    first: &str,
    second: Option<&str>,
    copy: bool,
) -> Result<ExitCode> {
    let client = Client::new(server)?;
    let (export, name) = export_and_name(&client, Some(first), second)?;
    let name = name.context("missing NAME: vouch snapshot create --server ADDR [EXPORT] NAME")?;
    snapshot::check_name(&name)?;
    let answer = client.call(
        hyper::Method::POST,
        &snapshots_route(&export),
        Some(&json!({"name": name, "copy": copy})),
    )?;
    println!(
        "snapshot {name} of export {export}: {} (checkpoint seq {}, held at the flush point {:.1} ms, of which flush {:.1} ms, {:.1} ms in all)",
        answer["path"].as_str().unwrap_or("?"),
        answer["record"]["checkpoint_seq"],
        answer["held_ms"].as_f64().unwrap_or(f64::NAN),
        answer["flush_ms"].as_f64().unwrap_or(f64::NAN),
        answer["total_ms"].as_f64().unwrap_or(f64::NAN),
    );
    for copy in answer["copies"].as_array().into_iter().flatten() {
        println!("  {}", copy.as_str().unwrap_or("?"));
    }
    Ok(ExitCode::SUCCESS)
}

fn list_through(server: &ServerArgs, export: Option<&str>, json_output: bool) -> Result<ExitCode> {
    let client = Client::new(server)?;
    let (export, _) = match export {
        Some(export) => (export.to_string(), None),
        None => export_and_name(&client, None, None)?,
    };
    let answer = client.call(hyper::Method::GET, &snapshots_route(&export), None)?;
    let items = answer["snapshots"].as_array().cloned().unwrap_or_default();
    if items.iter().any(|item| item.get("legs").is_some()) {
        let bad = crate::snapshot_mirror::print_listing(
            &items,
            &format!("export {export} (a mirror)"),
            json_output,
        )?;
        return Ok(if bad {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        });
    }
    if json_output {
        println!("{}", serde_json::to_string_pretty(&items)?);
    } else if items.is_empty() {
        println!("export {export}: no snapshots");
    }
    let mut broken = false;
    for item in &items {
        if let Some(error) = item["error"].as_str() {
            broken = true;
            if !json_output {
                println!("?\t{error}");
            }
        } else if !json_output {
            let record = &item["record"];
            println!(
                "{}\tcreated {}\tcheckpoint seq {}\t{}\t{}{}{}",
                item["name"].as_str().unwrap_or("?"),
                record["created_unix"],
                record["checkpoint_seq"],
                record["layout"].as_str().unwrap_or("?"),
                item["path"].as_str().unwrap_or("?"),
                match (item["materialising"] == true, item["failed"].as_str()) {
                    (_, Some(cause)) => format!("\tfailed: {cause}"),
                    (true, None) => "\tmaterialising".to_string(),
                    (false, None) => String::new(),
                },
                kind_column(&item["kind"]),
            );
        }
    }
    Ok(if broken {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn delete_through(server: &ServerArgs, first: &str, second: Option<&str>) -> Result<ExitCode> {
    let client = Client::new(server)?;
    let (export, name) = export_and_name(&client, Some(first), second)?;
    let name = name.context("missing NAME: vouch snapshot delete --server ADDR [EXPORT] NAME")?;
    snapshot::check_name(&name)?;
    client.call(
        hyper::Method::DELETE,
        &format!("{}/{}", snapshots_route(&export), percent(&name)),
        None,
    )?;
    println!("deleted snapshot {name} of export {export}");
    Ok(ExitCode::SUCCESS)
}

/// The volume at `path` stopped, recovered if it needs it, and held by
/// this process (the returned lock) so no server opens it meanwhile.
/// `purpose` ends the messages: "take the snapshot", "resize it".
pub(crate) fn hold_offline(path: &Path, purpose: &str) -> Result<std::fs::File> {
    crate::key::volume_dir(path)?;
    if vouch_engine::volume_in_use(path)? {
        bail!(
            "{} is open in a running `vouch serve`: stop it, then {purpose}",
            path.display()
        );
    }
    // Refused before anything opens: recovering a mirror's leg alone (to
    // close it cleanly) would hide its unclean stop from the set, whose
    // next open reconciles the legs because of it.
    if vouch_mirror::is_mirrored(path) {
        bail!(
            "{} is a leg of a mirror: a mirrored volume is not supported here (remove its other legs with `vouch mirror remove`, then {purpose})",
            path.display()
        );
    }
    if crate::migrate::has_regions(path) {
        recover_regions(path)?;
        return FileStorage::lock_for_writing(path)
            .with_context(|| format!("holding {}", path.display()));
    }
    let superblock = vouch_engine::volume_superblock(path)?;
    let clean = superblock.state == vouch_format::superblock::STATE_CLEAN;
    if !clean || path.join("held").exists() {
        // A writable open puts back what a crashed process acknowledged
        // (its held log) and replays the journal; the close checkpoints.
        crate::key::open(path, OpenOptions::default(), Use::Data)
            .and_then(|volume| Ok(volume.close()?))
            .with_context(|| format!("recovering {} first", path.display()))?;
    }
    FileStorage::lock_for_writing(path).with_context(|| format!("holding {}", path.display()))
}

/// A volume with regions not closed cleanly (either member, or a held
/// log in either), or whose resize was cut short, opened writable through
/// its region layer, each member recovering (and the resize finished),
/// and closed.
fn recover_regions(path: &Path) -> Result<()> {
    let home = vouch_engine::volume_superblock(path)?;
    let member = vouch_engine::regions::member_path(path, home.layout);
    let unclean = |dir: &Path| {
        dir.join("held").exists()
            || vouch_engine::volume_superblock(dir)
                .is_ok_and(|superblock| superblock.state != vouch_format::superblock::STATE_CLEAN)
    };
    // A resize cut short is finished by the open too (`around`), before
    // anything copies or resizes the members' files.
    let resizing = vouch_engine::regions::resize::pending(&RealFs::default(), path);
    if unclean(path) || unclean(&member) || resizing {
        let options = crate::key::open_options(path, OpenOptions::default(), Use::Data)?;
        vouch_engine::regions::RegionVolume::open(path, &options)
            .and_then(vouch_engine::regions::RegionVolume::close)
            .with_context(|| format!("recovering {} first", path.display()))?;
    }
    Ok(())
}

fn create(path: &Path, name: &str, copy: bool) -> Result<ExitCode> {
    snapshot::check_name(name)?;
    if vouch_mirror::is_mirrored(path) {
        return crate::snapshot_mirror::create(path, name, copy);
    }
    let _held = hold_offline(path, "take the snapshot")?;
    let started = Instant::now();
    let fs = RealFs::new(copy);
    // Where the filesystem cannot clone, an overlay (its log kept for the
    // snapshot's life) unless a full copy is asked for.
    let taken = if !copy && snapshot::overlay::wanted(path) {
        snapshot::overlay::create_offline(&fs, path, name, &snapshot::new_id())?
    } else {
        // The record says "copy" where the files were copied (`RealFs`).
        snapshot::create(&fs, path, name, "reflink", SnapshotBreaks::default())?
    };
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
    crate::key::volume_dir(path)?;
    if vouch_mirror::is_mirrored(path) {
        return crate::snapshot_mirror::list(path, json_output);
    }
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
        let items = list_json(path)?;
        broken = found.iter().any(Result::is_err);
        println!("{}", serde_json::to_string_pretty(&json!(items))?);
    } else {
        if found.is_empty() {
            println!("{}: no snapshots", path.display());
        }
        for entry in &found {
            match entry {
                Ok(snap) => println!(
                    "{}\tcreated {}\tcheckpoint seq {}\t{}\t{}{}{}",
                    snap.record.name,
                    snap.record.created_unix,
                    snap.record.checkpoint_seq,
                    snap.record.layout,
                    snap.path.display(),
                    match (&snap.failed, snap.materialising) {
                        (Some(cause), _) => format!("\tfailed: {cause}"),
                        (None, true) => "\tmaterialising".to_string(),
                        (None, false) => String::new(),
                    },
                    kind_column(&kind_of(snap)),
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
    crate::key::volume_dir(path)?;
    if vouch_mirror::is_mirrored(path) {
        return crate::snapshot_mirror::delete(path, name);
    }
    let _held = FileStorage::lock_for_writing(path)
        .with_context(|| format!("holding {} to delete its snapshot", path.display()))?;
    let snapshot_dir = path.join(snapshot::SNAPSHOTS_DIR).join(name);
    let _snapshot_held = crate::snapshot_held::hold_snapshot(path, name, &snapshot_dir)?;
    let fs = RealFs::default();
    snapshot::tidy(&fs, path)?;
    // An overlay's OVERLAID flag goes with it.
    snapshot::overlay::delete_offline(&fs, path, name)?;
    println!("deleted snapshot {name} of {}", path.display());
    Ok(ExitCode::SUCCESS)
}

/// `vouch clone SNAPSHOT NEWPATH`.
pub fn clone(snapshot_dir: &Path, new_path: &Path, copy: bool) -> Result<ExitCode> {
    crate::key::volume_dir(snapshot_dir)?;
    let started = Instant::now();
    // The origin names the snapshot by its absolute path, so a server of
    // the clone finds it from any directory (`qemu:allocation-depth`).
    let snapshot_dir = &snapshot_dir
        .canonicalize()
        .with_context(|| format!("finding {}", snapshot_dir.display()))?;
    snapshot::clone(&RealFs::new(copy), snapshot_dir, new_path)?;
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
    // A mirror's snapshot is served from every leg's copy
    // (`snapshot_mirror::open_served`), this leg's or not.
    if !path.is_dir() && !crate::snapshot_mirror::has_snapshot(volume, name) {
        bail!(
            "{} has no snapshot named {name:?} (`vouch snapshot list {}` lists them)",
            volume.display(),
            volume.display()
        );
    }
    Ok(path)
}

/// What an online create did, for the control API's answer.
pub struct OnlineSnapshot {
    pub snapshot: snapshot::Snapshot,
    pub times: crate::snapshot_held::Times,
}

/// What an online snapshot is taken of: a served volume, or a served
/// volume with regions (both members and the record at one flush point).
#[derive(Clone, Copy)]
pub enum Served<'a> {
    One(&'a Arc<vouch_engine::Volume>),
    Regions(&'a vouch_engine::regions::RegionVolume),
}

impl Served<'_> {
    fn point(&self) -> &dyn snapshot::FlushPoint {
        match *self {
            Served::One(volume) => &**volume,
            Served::Regions(volume) => volume,
        }
    }
    fn checkpoint_now(&self) -> vouch_engine::Result<()> {
        match *self {
            Served::One(volume) => volume.checkpoint_now(),
            Served::Regions(volume) => volume.checkpoint_now(),
        }
    }
}

/// Take snapshot `name` of the served volume `volume` (directory `dir`,
/// held by this server) at a flush point (`Volume::at_flush_point`; for a
/// volume with regions both members', its switches paused).
///
/// On xfs and btrfs a single volume's snapshot is fenced
/// (`vouch_engine::snapshot::fenced`): the flush point writes only the
/// fence and arms the before-image layer, and the files are cloned after,
/// beside the served volume. `wait`: answer once it is published (else at
/// the fence, the snapshot listed as materialising until it is).
pub fn create_online(
    dir: &Path,
    volume: Served<'_>,
    name: &str,
    copy: bool,
    wait: bool,
) -> Result<OnlineSnapshot> {
    let one = crate::snapshot_held::ONLINE
        .lock()
        .unwrap_or_else(|poison| poison.into_inner());
    let started = Instant::now();
    if let Served::One(served) = volume {
        if !copy && fenced::can_fence(dir, served).is_ok() {
            drop(one);
            return create_fenced(dir, served, name, wait, started);
        }
        if !copy && snapshot::overlay::wanted(dir) {
            served.checkpoint_now()?;
            let fencing = Instant::now();
            let taken = snapshot::overlay::create_online(dir, served, name, &snapshot::new_id())?;
            let held = fencing.elapsed();
            return Ok(OnlineSnapshot {
                snapshot: taken,
                times: crate::snapshot_held::Times {
                    held,
                    flush: held,
                    total: started.elapsed(),
                },
            });
        }
    }
    let _one = one;
    let fs = RealFs::new(copy);
    let point = Timed {
        volume,
        times: Cell::new((Duration::ZERO, Duration::ZERO)),
    };
    let taken =
        snapshot::create_from(&fs, dir, name, "reflink", SnapshotBreaks::default(), &point)?;
    let (flush, held) = point.times.get();
    Ok(OnlineSnapshot {
        snapshot: taken,
        times: crate::snapshot_held::Times {
            held,
            flush,
            total: started.elapsed(),
        },
    })
}

/// `create_online` by a fence: answered at the fence, or (`wait`) once
/// the materialisation (run on its own thread, under the online lock)
/// published the snapshot.
fn create_fenced(
    dir: &Path,
    volume: &Arc<vouch_engine::Volume>,
    name: &str,
    wait: bool,
    started: Instant,
) -> Result<OnlineSnapshot> {
    let (record, held) = {
        let _one = crate::snapshot_held::ONLINE
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        volume.checkpoint_now()?;
        let fencing = Instant::now();
        let record = fenced::create_fenced(dir, volume, name, &snapshot::new_id())?;
        (record, fencing.elapsed())
    };
    let storage = volume.storage();
    let served = Arc::clone(volume);
    let (volume_dir, snapshot_name) = (dir.to_path_buf(), name.to_string());
    let materialised = std::thread::Builder::new()
        .name("vouch-snapshot".to_string())
        .spawn(move || {
            let _one = crate::snapshot_held::ONLINE
                .lock()
                .unwrap_or_else(|poison| poison.into_inner());
            if let Some(marker) = std::env::var_os(HOLD_MATERIALISE) {
                hold_materialise(Path::new(&marker));
            }
            let done = fenced::materialise(&volume_dir, &snapshot_name, &*storage);
            match &done {
                Err(error) if storage.before_images().is_some_and(|layer| layer.is_armed()) => {
                    tracing::error!(volume = %volume_dir.display(), "snapshot {snapshot_name}: materialising failed ({error}); the next open of the volume finishes it");
                }
                Err(error) => {
                    // Marked failed (`vouch snapshot list` says why), the
                    // layer disarmed: the volume runs on without it.
                    tracing::error!(volume = %volume_dir.display(), "{error}");
                }
                Ok(_) => {}
            }
            if !storage.before_images().is_some_and(|layer| layer.is_armed()) {
                // Published or failed: no fence needs the flag.
                if let Err(error) = served.set_fenced(false) {
                    tracing::error!(volume = %volume_dir.display(), "snapshot {snapshot_name}: clearing the FENCED flag failed ({error}); the next open clears it");
                }
            }
            done
        })?;
    let snapshot = if wait {
        materialised
            .join()
            .map_err(|_| anyhow::anyhow!("materialising snapshot {name} panicked"))??
    } else {
        snapshot::Snapshot {
            path: fenced::materialising_path(dir, name),
            record,
            materialising: true,
            failed: None,
        }
    };
    Ok(OnlineSnapshot {
        snapshot,
        times: crate::snapshot_held::Times {
            held,
            flush: held,
            total: started.elapsed(),
        },
    })
}

/// A served volume's flush point, timed from before the commit lock is
/// taken (for a volume with regions, the region switches paused first)
/// to the clones' start (`times.0`) and to their end (`times.1`).
struct Timed<'a> {
    volume: Served<'a>,
    times: Cell<(Duration, Duration)>,
}

impl snapshot::FlushPoint for Timed<'_> {
    fn at_flush_point(
        &self,
        clone: &mut dyn FnMut(&vouch_format::Superblock) -> vouch_engine::Result<()>,
    ) -> vouch_engine::Result<()> {
        // Most of the flush first, without holding writers' flushes.
        self.volume.checkpoint_now()?;
        let started = Instant::now();
        let mut flushed = Duration::ZERO;
        let result = self.volume.point().at_flush_point(&mut |superblock| {
            flushed = started.elapsed();
            clone(superblock)
        });
        self.times.set((flushed, started.elapsed()));
        result
    }
    fn online(&self) -> bool {
        true
    }
    fn covers_regions(&self) -> bool {
        self.volume.point().covers_regions()
    }
}

/// Delete snapshot `name` of the served volume at `dir` (held by this
/// server); refused while another process (or another export of this
/// one) holds the snapshot.
pub fn delete_online(dir: &Path, served: Option<&vouch_engine::Volume>, name: &str) -> Result<()> {
    let _one = crate::snapshot_held::ONLINE
        .lock()
        .unwrap_or_else(|poison| poison.into_inner());
    snapshot::check_name(name)?;
    let snapshot_dir = dir.join(snapshot::SNAPSHOTS_DIR).join(name);
    // This server may hold it open for a client's changed blocks.
    crate::changed::release(&snapshot_dir);
    let _snapshot_held = crate::snapshot_held::hold_snapshot(dir, name, &snapshot_dir)?;
    let fs = RealFs::default();
    snapshot::tidy(&fs, dir)?;
    // An overlay's log goes with it, and the layer is disarmed.
    snapshot::overlay::delete_served(dir, served, name)?;
    Ok(())
}

/// The snapshots of the volume at `dir` as JSON (entries that cannot be
/// read carry an error).
pub fn list_json(dir: &Path) -> Result<Vec<serde_json::Value>> {
    Ok(snapshot::list(&RealFs::default(), dir)?
        .iter()
        .map(|entry| match entry {
            Ok(snap) => json!({
                "name": snap.record.name,
                "path": snap.path.display().to_string(),
                "record": snap.record,
                "materialising": snap.materialising,
                "failed": snap.failed,
                "kind": kind_of(snap),
            }),
            Err(error) => json!({ "error": error.to_string() }),
        })
        .collect())
}

/// A snapshot's kind for `list`: how its blocks are kept ("overlay": the
/// volume's files read through its log, whose bytes are its space; else
/// its record's method, "reflink" or "copy").
fn kind_of(snap: &snapshot::Snapshot) -> serde_json::Value {
    if snap.record.method == snapshot::overlay::METHOD {
        json!({
            "kind": snapshot::overlay::METHOD,
            "space_bytes": snapshot::overlay::space(&snap.path),
        })
    } else {
        json!({ "kind": snap.record.method })
    }
}

/// `kind_of` as the text listing's last column.
fn kind_column(kind: &serde_json::Value) -> String {
    match (kind["kind"].as_str(), kind["space_bytes"].as_u64()) {
        (Some(name), Some(bytes)) => format!("\t{name}, {bytes} bytes in its log"),
        (Some(name), None) => format!("\t{name}"),
        _ => String::new(),
    }
}

/// For tests (`tests/snapshot_fenced.rs`): a file path; an online fenced
/// snapshot creates it once the fence is answered and waits a minute
/// before materialising, so a test can kill the server while the snapshot
/// is still fenced whatever the machine's speed.
const HOLD_MATERIALISE: &str = "VOUCH_TEST_HOLD_MATERIALISE";

fn hold_materialise(marker: &Path) {
    if std::fs::write(marker, b"").is_ok() {
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
}
