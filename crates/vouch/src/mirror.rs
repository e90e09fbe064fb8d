//! Mirrored volumes in the CLI: `create --mirror`, opening a set for
//! `serve` (the `Mirror` device over every leg), `info`, `check` and
//! offline `scrub` of every leg, and `vouch mirror status|replace`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use clap::Subcommand;
use serde_json::json;
use vouch_engine::jobs::JobControl;
use vouch_engine::{BlockDevice, OpenOptions, SealedDevice, SealedWrites, Volume, BLOCK};
use vouch_mirror as mirror;
use vouch_mirror::{FileMembership, LegState, LegStatus, Membership, Mirror};

use crate::key::Use;

#[derive(Subcommand, Debug)]
pub enum MirrorCommand {
    /// Show every leg of the mirrored volume PATH (any leg): its path and
    /// state (active, faulted, stale, missing), as the newest mirror
    /// record says, and for a stale leg the blocks its resync map marks.
    /// When no process holds the set and its activity log names extents
    /// (an unclean stop), the active legs but the first are shown
    /// reconciling: they may differ there until the next open reconciles
    /// those regions. With --server, PATH is an export name and a running server answers:
    /// each leg's state (resyncing, or reconciling while the extents the
    /// activity log named after an unclean stop are checked, included), a
    /// resync's progress (blocks to copy, copied, left, rate, ETA) and a
    /// reconciliation's (regions and blocks left, copied, rate, ETA). A
    /// running server's
    /// repair counters are in its metrics (vouch_mirror_*). Exit 0 when
    /// every leg is active and present, 1 otherwise.
    Status {
        /// Any leg of the volume (offline), or the export name (--server).
        path: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        server: crate::offload::client::ServerArgs,
        #[command(flatten)]
        replica: crate::replica::ReplicaClientArgs,
    },
    /// Resync stale or faulted leg LEG: copy the blocks its resync map
    /// marks (written while it was away) from an active leg, each verified
    /// on arrival, then mark it active. A leg with unknown history (no
    /// usable map, a re-created directory) gets every block. With
    /// --server, PATH is an export name and the running server resyncs
    /// online (rate limited by its --resync-min/--resync-max; follow it
    /// with `mirror status --server`); without, the volume must not be
    /// served and this copies at --rate.
    Resync {
        /// Any leg of the volume (offline), or the export name (--server).
        path: String,
        /// The leg to resync (its index, see `status`).
        #[arg(long)]
        leg: usize,
        /// Offline copy rate in bytes per second (200M = 200 MiB/s; K, M,
        /// G = powers of 1024, KB, MB, GB = powers of 1000).
        #[arg(long, value_name = "RATE", value_parser = crate::sizes::parse_size, default_value = "200M")]
        rate: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        server: crate::offload::client::ServerArgs,
        #[command(flatten)]
        key: crate::key::KeyFileArgs,
        #[command(flatten)]
        replica: crate::replica::ReplicaClientArgs,
    },
    /// Replace leg LEG (its index, see `status`) offline: copy every
    /// block, with its context, from an active leg into it (if the leg's
    /// directory is missing, an empty leg is created there from an active
    /// leg's superblock first), verify it, then mark it active. Offline:
    /// the server must be stopped.
    Replace {
        /// Any active leg of the volume.
        path: PathBuf,
        /// The leg to replace (its index, see `status`).
        #[arg(long)]
        leg: usize,
        #[command(flatten)]
        key: crate::key::KeyFileArgs,
        #[command(flatten)]
        replica: crate::replica::ReplicaClientArgs,
    },
    /// Add a leg at NEW_LEG (a new directory) to the volume PATH, offline:
    /// a mirror with fewer than 3 legs, or a plain volume, which becomes a
    /// 2-leg mirror. The leg joins stale, is filled with every block and
    /// its context from an active leg, verified, then marked active (what
    /// `replace` does). Stop the server first.
    Add {
        /// The volume (any leg of a mirrored volume).
        path: PathBuf,
        /// Where the new leg is created (must not exist).
        new_leg: PathBuf,
        #[command(flatten)]
        key: crate::key::KeyFileArgs,
        #[command(flatten)]
        replica: crate::replica::ReplicaClientArgs,
    },
    /// Remove leg LEG (its index, see `status`) from the mirror PATH
    /// belongs to, offline. At least one active leg must remain; a mirror
    /// left with one leg becomes a plain volume. The removed leg's
    /// directory is left on disk as a plain volume (its data is older
    /// than the set's if it was not active). Stop the server first.
    Remove {
        /// The volume (any remaining leg).
        path: PathBuf,
        /// The leg to remove (its index, see `status`).
        #[arg(long)]
        leg: usize,
    },
}

/// A mirror set opened for serving or scrubbing.
pub struct OpenMirror {
    pub mirror: Arc<Mirror>,
    /// Each leg's volume, in leg order (`None`: not active or missing).
    pub volumes: Vec<Option<Arc<Volume>>>,
    /// The first open leg: its geometry, stats and uuid describe the set.
    pub primary: Arc<Volume>,
    /// The set's view when it was opened.
    pub record: mirror::set::MirrorRecord,
}

/// Open the set the leg at `path` belongs to; warnings go to stderr.
pub fn open(path: &Path, options: OpenOptions, purpose: Use) -> Result<OpenMirror> {
    let writable = !options.read_only;
    let set = mirror::open_mirror_with(
        path,
        writable,
        &mut |leg| {
            crate::key::open(leg, options.clone(), purpose)
                .map_err(|error| vouch_engine::Error::InvalidArgument(format!("{error:#}")))
        },
        &mut |url, record| crate::replica::open_member(url, record),
    )?;
    for warning in &set.warnings {
        eprintln!("vouch: WARNING: {warning}");
        tracing::warn!("{warning}");
    }
    let record = set.record.clone();
    let (mirror, volumes) = set.into_mirror(true)?;
    let active = mirror.active();
    let primary = active
        .first()
        .and_then(|&index| volumes[index].clone())
        .context("no leg open")?;
    let unclean: Vec<String> = volumes
        .iter()
        .zip(&record.members)
        .enumerate()
        .filter(|(index, _)| active.contains(index))
        .map(|(_, row)| row)
        .filter(|(volume, _)| {
            volume
                .as_ref()
                .is_some_and(|v| !v.recovery_report().was_clean)
        })
        .map(|(_, member)| member.path.clone())
        .collect();
    let marked = mirror::set::is_unsynced(&record);
    // The activity log names every extent the legs may differ in after an
    // unclean stop: those are reconciled (`serve` starts it), not the
    // whole volume. Without a usable log, or with a whole scrub still owed
    // (the marker), reads stay on one leg until a scrub.
    let recovered = if writable {
        let blocks = mirror.size() / BLOCK;
        let (log, recovered) = mirror::set::open_activity(&record, blocks)?;
        mirror.keep_activity_log(Arc::new(log))?;
        recovered
    } else {
        mirror::Recovered::Unknown("opened read-only".into())
    };
    let bounded = match &recovered {
        mirror::Recovered::Extents(extents) if !marked => Some(extents.len()),
        _ => None,
    };
    if let Some(extents) = bounded.filter(|&extents| extents > 0) {
        mirror.hold_reads_until_reconciled();
        let warning = format!(
            "mirror legs may differ in {extents} extents written at an unclean stop (the activity log names them): reads go to one leg until they are reconciled"
        );
        eprintln!("vouch: WARNING: {warning}");
        tracing::warn!("{warning}");
    } else if bounded.is_none() && (!unclean.is_empty() || marked) {
        if let mirror::Recovered::Unknown(why) = &recovered {
            tracing::warn!(why, "mirror: no usable activity log");
        }
        mirror.read_one_leg_until_scrubbed();
        let why = if unclean.is_empty() {
            "an earlier unclean shutdown has not been scrubbed yet".to_string()
        } else {
            format!("legs not shut down cleanly: {}", unclean.join(", "))
        };
        let warning = format!(
            "mirror legs may differ on blocks being written at a crash ({why}): every read goes to one leg until `vouch scrub` (or the control API's scrub) makes them agree"
        );
        eprintln!("vouch: WARNING: {warning}");
        tracing::warn!("{warning}");
    }
    Ok(OpenMirror {
        mirror,
        volumes,
        primary,
        record,
    })
}

impl OpenMirror {
    /// Close every leg cleanly (after every other holder of the mirror is gone).
    pub fn close(self) -> Result<()> {
        self.mirror.stop_resyncs()?;
        // After the last write: the log left names nothing to reconcile.
        self.mirror.close_activity_log()?;
        drop(self.mirror);
        drop(self.primary);
        for volume in self.volumes.into_iter().flatten() {
            match Arc::try_unwrap(volume) {
                Ok(volume) => volume.close()?,
                Err(volume) => volume.flush()?,
            }
        }
        Ok(())
    }
}

/// `vouch create PATH --mirror PATH2 ...`.
pub fn create(
    path: &Path,
    mirrors: &[PathBuf],
    size: u64,
    args: &crate::create::CreateArgs,
) -> Result<ExitCode> {
    let mut paths = vec![path.to_path_buf()];
    paths.extend(mirrors.iter().cloned());
    let options = crate::create::create_options(size, args)?;
    mirror::create_mirror_with(&paths, &options, &mut |url, leg0| {
        crate::replica::create_member(url, leg0)
    })?
    .close()?;
    let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    println!(
        "created a {}-way mirror ({size} bytes): {}",
        paths.len(),
        names.join(", ")
    );
    Ok(ExitCode::SUCCESS)
}

/// The legs as the set's view (the newest record found) and the disks
/// say: (index, path, state or "missing").
fn leg_rows(path: &Path) -> Result<Vec<(usize, String, &'static str)>> {
    let (record, mut missing) = mirror::set::view(path)?;
    // A remote member is reached to be counted present (and must hold the
    // set's volume).
    for (index, member) in record.members.iter().enumerate() {
        if mirror::is_remote_member(&member.path) && member.state == LegState::Active {
            if let Err(error) = crate::replica::probe_member(&member.path, &record) {
                eprintln!(
                    "vouch: WARNING: mirror leg {index} ({}): {error}",
                    member.path
                );
                missing[index] = Some(error.to_string());
            }
        }
    }
    Ok(record
        .members
        .iter()
        .enumerate()
        .map(|(index, member)| {
            let state = if missing[index].is_some() {
                "missing"
            } else {
                member.state.name()
            };
            (index, member.path.clone(), state)
        })
        .collect())
}

/// Lines (or JSON) `vouch info` adds for a mirrored volume.
pub fn info_json(path: &Path) -> Result<serde_json::Value> {
    let record = mirror::set::read_record(path)?;
    let legs: Vec<_> = leg_rows(path)?
        .into_iter()
        .map(|(index, leg, state)| json!({"leg": index, "path": leg, "state": state}))
        .collect();
    let (view, _) = mirror::set::view(path)?;
    let legs: Vec<_> = legs
        .into_iter()
        .map(|mut row| {
            let index = row["leg"].as_u64().unwrap_or(0) as usize;
            let (dirty, unknown) = crate::resync::offline_dirty(&view, index);
            row["dirty_blocks"] = json!(dirty);
            row["unknown_history"] = json!(unknown);
            row
        })
        .collect();
    Ok(json!({"leg": record.leg, "legs": legs, "epoch": record.epoch}))
}

pub fn print_info(path: &Path) -> Result<()> {
    let record = mirror::set::read_record(path)?;
    println!(
        "mirror:          leg {} of a {}-way mirror (record epoch {})",
        record.leg,
        record.members.len(),
        record.epoch
    );
    let (view, _) = mirror::set::view(path)?;
    for (index, leg, state) in leg_rows(path)? {
        let resync = match crate::resync::offline_dirty(&view, index) {
            (Some(dirty), _) => format!(", resync: {dirty} blocks to copy"),
            (None, Some(why)) => format!(", resync: full (unknown history: {why})"),
            (None, None) => String::new(),
        };
        println!("  leg {index}:         {leg} ({state}{resync})");
    }
    Ok(())
}

/// `vouch mirror status` of a running server's export `name`.
fn status_online(
    name: &str,
    json_output: bool,
    server: &crate::offload::client::ServerArgs,
) -> Result<ExitCode> {
    let client = crate::offload::client::Client::new(server)?;
    let answer = client.call(hyper::Method::GET, &format!("/v1/mirrors/{name}"), None)?;
    let legs = &answer["legs"];
    let healthy = legs.as_array().is_some_and(|legs| {
        legs.iter()
            .all(|leg| leg["state"] == "active" && leg["present"] == true)
    });
    if json_output {
        println!("{}", serde_json::to_string_pretty(&answer)?);
    } else {
        crate::resync::print_legs(legs);
        println!(
            "{}",
            if healthy {
                "every leg active"
            } else {
                "DEGRADED: not every leg is active"
            }
        );
    }
    Ok(if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `vouch mirror resync --server`: ask the running server.
fn resync_online(
    name: &str,
    leg: usize,
    json_output: bool,
    server: &crate::offload::client::ServerArgs,
) -> Result<ExitCode> {
    let client = crate::offload::client::Client::new(server)?;
    let answer = client.call(
        hyper::Method::POST,
        &format!("/v1/mirrors/{name}/resync"),
        Some(&json!({"leg": leg})),
    )?;
    if json_output {
        println!("{}", serde_json::to_string_pretty(&answer)?);
    } else {
        println!("{}", answer["message"].as_str().unwrap_or("resync started"));
    }
    Ok(ExitCode::SUCCESS)
}

/// `vouch mirror status`.
pub fn status(path: &Path, json_output: bool) -> Result<ExitCode> {
    let mut info = info_json(path)?;
    let pending = pending_reconcile(path)?;
    if let Some(extents) = &pending {
        mark_reconciling(&mut info["legs"], extents.len() as u64);
    }
    let healthy = info["legs"]
        .as_array()
        .is_some_and(|legs| legs.iter().all(|leg| leg["state"] == "active"));
    if json_output {
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        crate::resync::print_legs(&info["legs"]);
        if let Some(extents) = &pending {
            println!(
                "the legs may differ in {} regions (4 MiB) written at an unclean stop (the activity log names them): the next open reconciles them",
                extents.len()
            );
        }
        println!(
            "{}",
            if healthy {
                "every leg active"
            } else {
                "DEGRADED: not every leg is active (replace with `vouch mirror replace`)"
            }
        );
    }
    Ok(if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Offline: the extents the set's activity log names when no process
/// holds it, i.e. what an unclean stop may have left different on the
/// active legs (`None`: nothing, a log that is not usable, which the next
/// open judges by the legs' clean flags, or a running server's set).
fn pending_reconcile(path: &Path) -> Result<Option<Vec<u64>>> {
    if vouch_engine::volume_in_use(path)? {
        return Ok(None);
    }
    let record = mirror::set::read_record(path)?;
    let blocks = vouch_engine::peek_volume(path)?.size_bytes / BLOCK;
    Ok(match mirror::set::peek_activity(&record, blocks)? {
        mirror::Recovered::Extents(extents) if !extents.is_empty() => Some(extents),
        _ => None,
    })
}

/// Status rows (`info_json`'s) after an unclean stop that left `regions`
/// extents to reconcile: every active leg but the first (the one reads go
/// to until they are reconciled) is `reconciling`, nothing done yet.
fn mark_reconciling(legs: &mut serde_json::Value, regions: u64) {
    let Some(legs) = legs.as_array_mut() else {
        return;
    };
    let extent_blocks = mirror::EXTENT_BLOCKS;
    for leg in legs
        .iter_mut()
        .filter(|leg| leg["state"] == "active")
        .skip(1)
    {
        leg["state"] = json!("reconciling");
        leg["reconcile"] = json!({"state": "pending", "regions": regions,
            "regions_left": regions, "region_blocks": extent_blocks,
            "blocks_checked": 0, "blocks_left": regions * extent_blocks,
            "blocks_copied": 0, "blocks_unsettled": 0, "rate_bytes_per_second": 0,
            "eta_seconds": null, "elapsed_ms": 0, "error": null});
    }
}

/// `vouch check` of a mirrored volume: every present leg, each alone.
pub fn check(path: &Path, json_output: bool) -> Result<ExitCode> {
    let mut clean = true;
    let mut reports = Vec::new();
    for (index, leg, state) in leg_rows(path)? {
        if state == "missing" {
            clean = false;
            reports.push(json!({"leg": index, "path": leg, "state": state}));
            if !json_output {
                println!("leg {index}: {leg}: missing");
            }
            continue;
        }
        let report = if mirror::is_remote_member(&leg) {
            // Verified on the replica, next to its data.
            let record = mirror::set::read_record(path)?;
            match crate::replica::check_member(&leg, &record) {
                Ok((blocks_checked, faults)) => vouch_engine::CheckReport {
                    blocks_checked,
                    faults,
                },
                Err(error) => {
                    clean = false;
                    if !json_output {
                        println!("leg {index}: {leg} ({state}): not checked: {error}");
                    }
                    reports.push(json!({"leg": index, "path": leg, "state": state,
                        "error": error.to_string()}));
                    continue;
                }
            }
        } else {
            let volume = crate::key::open_read_only(Path::new(&leg), Use::Verify)?;
            volume.check(|_, _| {})?
        };
        clean &= report.faults.is_empty() && state == "active";
        let faults: Vec<_> = report
            .faults
            .iter()
            .map(|f| json!({"lba": f.lba, "kind": f.kind.name()}))
            .collect();
        if !json_output {
            for fault in &report.faults {
                println!(
                    "leg {index}: fault: LBA {} {}",
                    fault.lba,
                    fault.kind.name()
                );
            }
            println!(
                "leg {index}: {leg} ({state}): {} blocks checked, {} faults",
                report.blocks_checked,
                report.faults.len()
            );
        }
        reports.push(json!({"leg": index, "path": leg, "state": state,
            "blocks_checked": report.blocks_checked, "faults": faults}));
    }
    if json_output {
        let value = json!({"path": path.display().to_string(), "legs": reports, "clean": clean});
        println!("{}", serde_json::to_string_pretty(&value)?);
    }
    Ok(if clean {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Offline `vouch scrub` of a mirrored volume: check every active leg and
/// repair what can be repaired. Exit 0 when nothing was left unrepaired.
pub fn scrub(path: &Path, rate: Option<u64>, json_output: bool) -> Result<ExitCode> {
    let set = open(path, OpenOptions::default(), Use::Verify)?;
    let options = vouch_engine::scrub::ScrubOptions {
        rate_bytes_per_second: rate,
        foreground: None,
    };
    let control = JobControl::default();
    // A cancelled or interrupted scrub resumes from its cursor in `path`.
    let cursor = mirror::scrub::cursor_in(path);
    let report = mirror::scrub::scrub_from(&set.mirror, &options, &control, Some(&cursor));
    let status = set.mirror.status();
    set.close()?;
    let report = report?;
    if json_output {
        let value = json!({"path": path.display().to_string(), "report": report,
            "legs": status_json(&status), "paced_waits": control.paced_waits()});
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        for finding in &report.findings {
            println!(
                "LBA {} leg {}: {} {}",
                finding.lba,
                finding.leg,
                finding.kind,
                if finding.repaired { "repaired" } else { "LEFT" }
            );
        }
        println!(
            "{}: {} blocks checked on every leg: {} found, {} repaired, {} left",
            path.display(),
            report.blocks_checked,
            report.found,
            report.repaired,
            report.left
        );
    }
    Ok(if report.left == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Legs' states and repair counters as JSON.
pub fn status_json(status: &[LegStatus]) -> serde_json::Value {
    status
        .iter()
        .enumerate()
        .map(|(index, leg)| {
            json!({"leg": index, "name": leg.name, "state": leg.state.name(),
                "present": leg.present, "corrected": leg.corrected,
                "repairs": leg.repairs.iter().map(|r| json!({"kind": r.kind,
                    "repaired": r.repaired, "count": r.count})).collect::<Vec<_>>()})
        })
        .collect()
}

/// `vouch mirror replace`: copy every block from an active leg into leg
/// `leg` (created afresh if missing), then mark it active.
pub fn replace(path: &Path, leg: usize) -> Result<ExitCode> {
    let record = mirror::set::read_record(path)?;
    let target = PathBuf::from(
        &record
            .members
            .get(leg)
            .with_context(|| format!("the mirror has no leg {leg}"))?
            .path,
    );
    if mirror::is_remote_member(&target.to_string_lossy()) {
        bail!(
            "leg {leg} ({}) is a remote replica: replacing a remote leg is not supported yet (it comes with resync)",
            target.display()
        );
    }
    let set = open(path, OpenOptions::default(), Use::Data)?;
    if set.mirror.active().contains(&leg) {
        bail!(
            "leg {leg} ({}) is active: nothing to replace",
            target.display()
        );
    }
    let source = Arc::clone(&set.primary);
    if !target.exists() {
        let source_path = PathBuf::from(&set.record.members[set.mirror.active()[0]].path);
        mirror::set::create_leg_like(&source_path, &target)?;
        eprintln!("vouch: created an empty leg at {}", target.display());
    }
    // A stale leg that is present is open in the set already (for resync).
    let destination = match set.volumes.get(leg).cloned().flatten() {
        Some(volume) => volume,
        None => Arc::new(crate::key::open(
            &target,
            OpenOptions::default(),
            Use::Data,
        )?),
    };
    if destination.uuid_string() != source.uuid_string() || destination.size() != source.size() {
        bail!(
            "{} is not a leg of this volume (uuid or size differs)",
            target.display()
        );
    }
    let blocks = source.size() / BLOCK;
    let mut lba = 0;
    let mut moved = 0u64;
    while lba < blocks {
        let count = 256.min(blocks - lba);
        let sealed = source.read_sealed(lba, count)?;
        destination.write_sealed(&sealed)?;
        moved += count;
        lba += count;
    }
    destination.flush()?;
    let report = destination.check(|_, _| {})?;
    if !report.faults.is_empty() {
        bail!(
            "leg {leg} still has {} faults after the copy; left as it was marked",
            report.faults.len()
        );
    }
    if let Ok(volume) = Arc::try_unwrap(destination) {
        volume.close()?;
    }
    // The new leg's record is written with the others'; then its resync
    // map, if it had one, is gone (the leg holds every block now).
    FileMembership::new(set.record.clone()).set_state(leg, LegState::Active)?;
    for dir in mirror::set::map_dirs(&set.record) {
        let map = dir.join(mirror::dirty::map_file_name(leg));
        if let Err(error) = std::fs::remove_file(&map) {
            if error.kind() != std::io::ErrorKind::NotFound {
                return Err(error).with_context(|| format!("removing {}", map.display()));
            }
        }
    }
    set.close()?;
    println!(
        "leg {leg} ({}): {moved} blocks copied and verified; active",
        target.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// `vouch mirror add`: the leg joins stale, then `replace` fills it.
pub fn add(path: &Path, new_leg: &Path) -> Result<ExitCode> {
    let index = mirror::manage::add_member(path, new_leg)?;
    eprintln!(
        "vouch: leg {index} ({}) added (stale); copying every block into it",
        new_leg.display()
    );
    replace(path, index)
}

/// `vouch mirror remove`.
pub fn remove(path: &Path, leg: usize) -> Result<ExitCode> {
    let removed = mirror::manage::remove_member(path, leg)?;
    let left = match removed.remaining.as_slice() {
        [only] => format!("{} is a plain volume now", only.display()),
        legs => format!(
            "{} legs remain: {}",
            legs.len(),
            legs.iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    println!("leg {leg} ({}) removed; {left}", removed.path.display());
    if removed.state != LegState::Active {
        eprintln!(
            "vouch: warning: {} was {}: its data is older than the volume's; do not serve it",
            removed.path.display(),
            removed.state.name()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The leg of a mirror at `path`: a volume directory with a mirror record.
fn mirror_leg(path: &Path) -> Result<&Path> {
    crate::key::volume_dir(path)?;
    if !mirror::is_mirrored(path) {
        bail!(
            "{} is a plain volume, not a leg of a mirror (`vouch mirror add` makes it one)",
            path.display()
        );
    }
    Ok(path)
}

/// Run a `vouch mirror` command.
pub fn run(command: MirrorCommand) -> Result<ExitCode> {
    match command {
        MirrorCommand::Status {
            path, json, server, ..
        } => match server.server {
            Some(_) => status_online(&path, json, &server),
            None => status(mirror_leg(Path::new(&path))?, json),
        },
        MirrorCommand::Resync {
            path,
            leg,
            rate,
            json,
            server,
            ..
        } => match server.server {
            Some(_) => resync_online(&path, leg, json, &server),
            None => crate::resync::run_offline(
                mirror_leg(Path::new(&path))?,
                leg,
                mirror::ResyncRate {
                    min: rate.max(1),
                    max: rate.max(1),
                },
                json,
            ),
        },
        MirrorCommand::Replace { path, leg, .. } => replace(mirror_leg(&path)?, leg),
        MirrorCommand::Add { path, new_leg, .. } => {
            crate::key::volume_dir(&path)?;
            add(&path, &new_leg)
        }
        MirrorCommand::Remove { path, leg } => remove(mirror_leg(&path)?, leg),
    }
}

/// Mirror series, published at each scrape: repairs by leg, fault kind and
/// outcome; corrected errors and whether each leg is active.
pub fn publish_metrics(mirrors: &[(String, Arc<Mirror>)]) {
    let repairs = "vouch_mirror_repairs_total";
    metrics::describe_counter!(
        repairs,
        "Blocks found bad on a mirror leg, by fault kind and whether the leg was repaired"
    );
    // A gauge: the count the fault threshold judges halves every hour
    // and restarts after a full resync (the repairs counter keeps all).
    let corrected = "vouch_mirror_corrected_errors";
    metrics::describe_gauge!(
        corrected,
        "Corrected errors of a mirror leg's own that its fault threshold counts now (halving every hour)"
    );
    let active = "vouch_mirror_leg_active";
    metrics::describe_gauge!(
        active,
        "1 if the mirror leg is active, 0 if faulted, stale or missing"
    );
    for (name, mirror) in mirrors {
        for (index, leg) in mirror.status().iter().enumerate() {
            let leg_label = index.to_string();
            for repair in &leg.repairs {
                metrics::counter!(repairs, "volume" => name.clone(), "leg" => leg_label.clone(),
                    "kind" => repair.kind, "outcome" => if repair.repaired { "repaired" } else { "unrepaired" })
                .absolute(repair.count);
            }
            metrics::gauge!(corrected, "volume" => name.clone(), "leg" => leg_label.clone())
                .set(leg.corrected as f64);
            let is_active = leg.present && leg.state == LegState::Active;
            metrics::gauge!(active, "volume" => name.clone(), "leg" => leg_label)
                .set(if is_active { 1.0 } else { 0.0 });
        }
    }
}
