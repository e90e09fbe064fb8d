//! Resync in the CLI and the server: `vouch mirror resync` (offline, or
//! on a running server through the control API), the server's automatic
//! resync of a stale leg that is present at open, `mirror status` rows
//! for a resync, and the `vouch_mirror_resync_*` metrics.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use vouch_engine::{BlockDevice, OpenOptions, SealedDevice, BLOCK};
use vouch_mirror as mirror;
use vouch_mirror::dirty::{inspect, map_file_name, DirtyMap};
use vouch_mirror::{LegState, Mirror, ReconcileProgress, ResyncProgress, ResyncRate};

use crate::key::Use;

/// Starts resyncs of one mirrored volume: it can open a leg that came
/// back (with the server's options and key) and attach it.
pub struct Resyncer {
    pub mirror: Arc<Mirror>,
    record: mirror::set::MirrorRecord,
    options: OpenOptions,
    rate: ResyncRate,
    lock: parking_lot::Mutex<()>,
    /// Legs opened here when they came back: closed cleanly at the end.
    attached: parking_lot::Mutex<Vec<Arc<vouch_engine::Volume>>>,
    /// Legs whose map was started full at open, and why.
    unknown: parking_lot::Mutex<std::collections::HashMap<usize, String>>,
}

impl Resyncer {
    pub fn new(
        set: &crate::mirror::OpenMirror,
        options: OpenOptions,
        rate: ResyncRate,
    ) -> Resyncer {
        Resyncer {
            mirror: Arc::clone(&set.mirror),
            record: set.record.clone(),
            options,
            rate,
            lock: parking_lot::Mutex::new(()),
            unknown: parking_lot::Mutex::new(std::collections::HashMap::new()),
            attached: parking_lot::Mutex::new(Vec::new()),
        }
    }

    /// The legs this opened (to close cleanly once the mirror is closed).
    pub fn take_attached(&self) -> Vec<Arc<vouch_engine::Volume>> {
        std::mem::take(&mut *self.attached.lock())
    }

    /// Track every stale leg's writes in its map (a full one for unknown
    /// history).
    pub fn track_all(&self) -> Result<Vec<(usize, Option<String>)>> {
        let tracked = mirror::set::track_stale_legs(&self.mirror, &self.record)?;
        for (leg, why) in &tracked {
            if let Some(why) = why {
                self.unknown.lock().insert(*leg, why.clone());
            }
        }
        Ok(tracked)
    }

    /// Track every stale leg's writes (its map, or a full one for unknown
    /// history) and resync each that is present. Returns what to tell the
    /// operator.
    pub fn start_at_open(&self) -> Result<Vec<String>> {
        let mut notes = Vec::new();
        for (leg, unknown) in self.track_all()? {
            let map = self.mirror.map_of(leg).context("tracked leg has a map")?;
            let path = &self.record.members[leg].path;
            if let Some(why) = &unknown {
                notes.push(format!(
                    "mirror leg {leg} ({path}) has unknown history ({why}): it gets a full verified resync"
                ));
            }
            if self.mirror.status()[leg].present {
                self.unknown.lock().remove(&leg);
                self.mirror
                    .start_resync(leg, self.rate, unknown.is_some())?;
                notes.push(format!(
                    "mirror leg {leg} ({path}) is back: resyncing {} blocks",
                    map.count()
                ));
            } else {
                notes.push(format!(
                    "mirror leg {leg} ({path}) is stale: {} blocks to copy when it is back",
                    map.count()
                ));
            }
        }
        Ok(notes)
    }

    /// Resync leg `leg`: open it if it came back (creating an empty leg
    /// where its directory is gone: unknown history), give it a map (a
    /// full one if its history is unknown) and start copying.
    pub fn resync(&self, leg: usize) -> Result<String> {
        let _one_at_a_time = self.lock.lock();
        let member = self.record.members.get(leg).with_context(|| {
            format!(
                "the mirror has no leg {leg} (legs 0..{})",
                self.record.members.len()
            )
        })?;
        let path = PathBuf::from(&member.path);
        if self.mirror.active().contains(&leg) {
            bail!(
                "mirror leg {leg} ({}) is active: nothing to resync",
                path.display()
            );
        }
        let status = &self.mirror.status()[leg];
        if status.resyncing {
            bail!("mirror leg {leg} ({}) is resyncing already", path.display());
        }
        let mut full = self.unknown.lock().remove(&leg);
        if !status.attached && mirror::is_remote_member(&member.path) {
            // Reached now (its uuid checked), or refused with the reason.
            let device = crate::replica::open_member(&member.path, &self.record)
                .with_context(|| format!("mirror leg {leg} ({}) cannot be reached", member.path))?;
            self.mirror.attach(leg, device)?;
        } else if mirror::is_remote_member(&member.path) {
            // Its connection died when it was taken out: a new one.
            self.mirror
                .reconnect(leg)
                .with_context(|| format!("mirror leg {leg} ({}) cannot be reached", member.path))?;
        } else if !status.attached {
            full = self.bring_back(leg, &path)?;
        }
        let dirs = self.map_dirs();
        let blocks = self.mirror.size() / BLOCK;
        let map = match self.mirror.map_of(leg) {
            Some(map) => map,
            None => {
                let (map, unknown) = DirtyMap::open(&dirs, leg, self.record.uuid, blocks, false)?;
                full = full.or(unknown);
                let map = Arc::new(map);
                self.mirror.track(leg, Arc::clone(&map))?;
                map
            }
        };
        if let Some(why) = &full {
            // Already full when it was started full at open; marking again is free.
            map.mark(0, blocks)?;
            map.sync()?;
            tracing::warn!(leg, why, "mirror: unknown history: full verified resync");
        }
        self.mirror.start_resync(leg, self.rate, full.is_some())?;
        Ok(match full {
            Some(why) => format!(
                "leg {leg} ({}): unknown history ({why}): full verified resync of {} blocks started",
                path.display(),
                map.count()
            ),
            None => format!(
                "leg {leg} ({}): resync of {} blocks started",
                path.display(),
                map.count()
            ),
        })
    }

    /// Open missing leg `leg` at `path` and attach it; `Some(why)` when
    /// its history is unknown (created afresh, or not this set's leg).
    fn bring_back(&self, leg: usize, path: &Path) -> Result<Option<String>> {
        let mut unknown = None;
        if !path.exists() {
            let source = self
                .mirror
                .active()
                .first()
                .map(|&index| PathBuf::from(&self.record.members[index].path))
                .context("no active leg")?;
            mirror::set::create_leg_like(&source, path)?;
            unknown = Some("its directory was gone: created an empty leg".to_string());
        } else {
            match mirror::set::read_record(path) {
                Ok(record) if record.uuid != self.record.uuid => bail!(
                    "{} belongs to another volume (uuid differs): not resyncing into it",
                    path.display()
                ),
                Ok(record) if usize::from(record.leg) != leg => bail!(
                    "{} says it is leg {}, not leg {leg}",
                    path.display(),
                    record.leg
                ),
                Ok(_) => {}
                Err(error) => unknown = Some(format!("its mirror record is unusable: {error}")),
            }
            // Same uuid is not enough: a clone shares its origin's.
            if let Some(&index) = self
                .mirror
                .active()
                .iter()
                .find(|&&index| !mirror::is_remote_member(&self.record.members[index].path))
            {
                mirror::set::same_instance(Path::new(&self.record.members[index].path), path)?;
            }
        }
        let volume = crate::key::open(path, self.options.clone(), Use::Data)
            .with_context(|| format!("opening mirror leg {leg} ({})", path.display()))?;
        if self.mirror.active().iter().any(|&index| {
            mirror::set::read_record(Path::new(&self.record.members[index].path))
                .is_ok_and(|record| record.uuid != self.record.uuid)
        }) {
            bail!("the active legs' records changed under the server");
        }
        let volume = Arc::new(volume);
        self.mirror
            .attach(leg, Arc::clone(&volume) as Arc<dyn SealedDevice>)?;
        self.attached.lock().push(volume);
        Ok(unknown)
    }

    fn map_dirs(&self) -> Vec<PathBuf> {
        self.mirror
            .active()
            .into_iter()
            .map(|index| PathBuf::from(&self.record.members[index].path))
            .collect()
    }

    /// Every leg's state and resync progress.
    pub fn status_json(&self) -> Value {
        legs_json(&self.mirror)
    }
}

/// A resync's progress as JSON.
pub fn progress_json(progress: &ResyncProgress) -> Value {
    json!({"state": progress.state, "blocks_to_copy": progress.total,
        "copied": progress.copied, "left": progress.left, "full": progress.full,
        "rate_bytes_per_second": progress.rate, "eta_seconds": progress.eta_seconds,
        "elapsed_ms": progress.elapsed_ms, "paced_waits": progress.paced_waits,
        "error": progress.error})
}

/// A reconciliation's progress as JSON.
pub fn reconcile_json(progress: &ReconcileProgress) -> Value {
    json!({"state": progress.state, "regions": progress.extents,
        "regions_left": progress.extents_left, "region_blocks": progress.extent_blocks,
        "blocks_checked": progress.blocks_checked, "blocks_left": progress.blocks_left,
        "blocks_copied": progress.blocks_copied,
        "blocks_unsettled": progress.blocks_left_unsettled,
        "rate_bytes_per_second": progress.rate, "eta_seconds": progress.eta_seconds,
        "elapsed_ms": progress.elapsed_ms, "paced_waits": progress.paced_waits,
        "error": progress.error})
}

/// Each leg of a running mirror: state, resync, and the reconciliation
/// after an unclean stop on the legs it checks (every active leg but the
/// one reads go to meanwhile).
pub fn legs_json(mirror: &Mirror) -> Value {
    // Legs first: a leg seen out of reconciliation was left only after the
    // reconciliation's final progress was stored (`end_reconcile`), so the
    // progress read next is never an earlier `running`.
    let status = mirror.status();
    let reconcile = mirror.reconcile_progress();
    let read_leg = status
        .iter()
        .position(|leg| leg.state == LegState::Active && leg.attached);
    status
        .iter()
        .enumerate()
        .map(|(index, leg)| {
            let reconciled = (leg.state == LegState::Active && Some(index) != read_leg)
                .then_some(reconcile.as_ref())
                .flatten();
            json!({"leg": index, "name": leg.name, "state": leg.state_name(),
                "present": leg.present, "dirty_blocks": leg.dirty,
                "resync": leg.resync.as_ref().map(progress_json),
                "reconcile": reconciled.map(reconcile_json)})
        })
        .collect()
}

/// One line per leg for `mirror status` from JSON rows.
pub fn print_legs(legs: &Value) {
    for leg in legs.as_array().into_iter().flatten() {
        let mut line = format!(
            "leg {}: {}: {}",
            leg["leg"],
            leg["name"].as_str().or(leg["path"].as_str()).unwrap_or("?"),
            leg["state"].as_str().unwrap_or("?")
        );
        if let Some(dirty) = leg["dirty_blocks"].as_u64() {
            line += &format!(", {dirty} blocks to copy");
        }
        if let Some(why) = leg["unknown_history"].as_str() {
            line += &format!(" (unknown history: {why}; full resync)");
        }
        println!("{line}");
        let reconcile = &leg["reconcile"];
        if reconcile.is_object() {
            let rate = reconcile["rate_bytes_per_second"].as_u64().unwrap_or(0);
            let eta = reconcile["eta_seconds"]
                .as_u64()
                .map_or("unknown".to_string(), |s| format!("{s}s"));
            println!(
                "  reconcile {}: {} of {} regions left ({} blocks left), {} blocks checked, {} copied, {:.1} MiB/s, ETA {eta}{}",
                reconcile["state"].as_str().unwrap_or("?"),
                reconcile["regions_left"].as_u64().unwrap_or(0),
                reconcile["regions"].as_u64().unwrap_or(0),
                reconcile["blocks_left"].as_u64().unwrap_or(0),
                reconcile["blocks_checked"].as_u64().unwrap_or(0),
                reconcile["blocks_copied"].as_u64().unwrap_or(0),
                rate as f64 / (1024.0 * 1024.0),
                reconcile["error"]
                    .as_str()
                    .map_or(String::new(), |e| format!(" ({e})"))
            );
        }
        let resync = &leg["resync"];
        if resync.is_object() {
            let to_copy = resync["blocks_to_copy"].as_u64().unwrap_or(0);
            let copied = resync["copied"].as_u64().unwrap_or(0);
            let rate = resync["rate_bytes_per_second"].as_u64().unwrap_or(0);
            let eta = resync["eta_seconds"]
                .as_u64()
                .map_or("unknown".to_string(), |s| format!("{s}s"));
            println!(
                "  resync {}{}: {copied} of {to_copy} blocks copied, {} left, {:.1} MiB/s, ETA {eta}{}",
                resync["state"].as_str().unwrap_or("?"),
                if resync["full"].as_bool() == Some(true) { " (full)" } else { "" },
                resync["left"].as_u64().unwrap_or(0),
                rate as f64 / (1024.0 * 1024.0),
                resync["error"]
                    .as_str()
                    .map_or(String::new(), |e| format!(" ({e})"))
            );
        }
    }
}

/// Offline: what the map files in `record`'s active legs say about leg
/// `leg` (blocks to copy, or why a full resync is due).
pub fn offline_dirty(
    record: &mirror::set::MirrorRecord,
    leg: usize,
) -> (Option<u64>, Option<String>) {
    let mut problems = Vec::new();
    let mut best: Option<u64> = None;
    for dir in mirror::set::map_dirs(record) {
        let path = dir.join(map_file_name(leg));
        if !path.exists() {
            continue;
        }
        match inspect(&path) {
            Ok((header, count)) if header.uuid == record.uuid && usize::from(header.leg) == leg => {
                best = Some(best.map_or(count, |b| b.max(count)));
            }
            Ok(_) => problems.push(format!("{}: not this leg's map", path.display())),
            Err(why) => problems.push(format!("{}: {why}", path.display())),
        }
    }
    if best.is_some() {
        return (best, None);
    }
    let state = record.members[leg].state;
    if state == LegState::Active {
        return (None, None);
    }
    let why = if problems.is_empty() {
        "no resync map".to_string()
    } else {
        problems.join("; ")
    };
    (None, Some(why))
}

/// Resync series, published at each scrape.
pub fn publish_metrics(mirrors: &[(String, Arc<Mirror>)]) {
    let names = [
        (
            "vouch_mirror_resync_blocks",
            "Blocks the leg's resync had to copy when it started",
        ),
        (
            "vouch_mirror_resync_copied_blocks",
            "Blocks the leg's resync has copied",
        ),
        (
            "vouch_mirror_resync_left_blocks",
            "Blocks the leg's resync map still marks",
        ),
        (
            "vouch_mirror_resync_rate_bytes",
            "The leg's resync rate so far, bytes per second",
        ),
        ("vouch_mirror_resync_running", "1 while the leg resyncs"),
    ];
    let reconcile_names = [
        (
            "vouch_mirror_reconcile_regions",
            "Regions (extents) the activity log named after an unclean stop",
        ),
        (
            "vouch_mirror_reconcile_regions_left",
            "Regions the reconciliation has still to check",
        ),
        (
            "vouch_mirror_reconcile_blocks_left",
            "Blocks the reconciliation has still to check",
        ),
        (
            "vouch_mirror_reconcile_copied_blocks",
            "Blocks the reconciliation copied to a leg that differed",
        ),
        (
            "vouch_mirror_reconcile_rate_bytes",
            "The reconciliation's rate so far, bytes checked per second",
        ),
        (
            "vouch_mirror_reconcile_eta_seconds",
            "Seconds the reconciliation has left at its rate",
        ),
        (
            "vouch_mirror_reconcile_running",
            "1 while the reconciliation runs",
        ),
    ];
    for (name, help) in reconcile_names {
        metrics::describe_gauge!(name, help);
    }
    for (name, help) in names {
        metrics::describe_gauge!(name, help);
    }
    for (volume, mirror) in mirrors {
        if let Some(progress) = mirror.reconcile_progress() {
            let labels = [("volume", volume.clone())];
            let values = [
                progress.extents as f64,
                progress.extents_left as f64,
                progress.blocks_left as f64,
                progress.blocks_copied as f64,
                progress.rate as f64,
                progress.eta_seconds.unwrap_or(0) as f64,
                if progress.state == "running" {
                    1.0
                } else {
                    0.0
                },
            ];
            for ((name, _), value) in reconcile_names.iter().zip(values) {
                metrics::gauge!(*name, &labels).set(value);
            }
        }
        for (index, leg) in mirror.status().iter().enumerate() {
            let labels = [("volume", volume.clone()), ("leg", index.to_string())];
            let (total, copied, rate) = leg
                .resync
                .as_ref()
                .map_or((0, 0, 0), |p| (p.total, p.copied, p.rate));
            let values = [
                total as f64,
                copied as f64,
                leg.dirty.unwrap_or(0) as f64,
                rate as f64,
                if leg.resyncing { 1.0 } else { 0.0 },
            ];
            for ((name, _), value) in names.iter().zip(values) {
                metrics::gauge!(*name, &labels).set(value);
            }
        }
    }
}

/// `vouch mirror resync PATH --leg N` offline: open the set, resync the
/// leg to the end at `rate`, close. Progress goes to stderr.
pub fn run_offline(
    path: &Path,
    leg: usize,
    rate: ResyncRate,
    json_output: bool,
) -> Result<std::process::ExitCode> {
    let options = OpenOptions::default();
    let set = crate::mirror::open(path, options.clone(), Use::Data)?;
    let resyncer = Resyncer::new(&set, options, rate);
    let started = resyncer.track_all().and_then(|_| resyncer.resync(leg));
    let outcome = started.map(|message| {
        eprintln!("vouch: {message}");
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let status = &set.mirror.status()[leg];
            if !status.resyncing {
                break status.resync.clone();
            }
        }
    });
    set.mirror.stop_resyncs()?;
    let legs = legs_json(&set.mirror);
    let attached = resyncer.take_attached();
    drop(resyncer);
    set.close()?;
    close_attached(attached)?;
    let progress = outcome?.context("the resync left no progress")?;
    if json_output {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"path": path.display().to_string(), "legs": legs})
            )?
        );
    } else {
        print_legs(&legs);
    }
    Ok(if progress.state == "done" {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::from(1)
    })
}

/// Close legs a `Resyncer` opened, once the mirror holding them is gone.
pub fn close_attached(volumes: Vec<Arc<vouch_engine::Volume>>) -> Result<()> {
    for volume in volumes {
        match Arc::try_unwrap(volume) {
            Ok(volume) => volume.close()?,
            Err(volume) => volume.flush()?,
        }
    }
    Ok(())
}
