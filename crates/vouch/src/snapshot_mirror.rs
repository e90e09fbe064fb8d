//! Snapshots of a mirrored volume (`vouch snapshot create|list|delete`
//! given any leg, offline or `--server`; docs/FORMAT.md, "Snapshots of a
//! mirror"): each active leg gets its own copy, `LEG/snapshots/NAME`, all
//! taken at one flush point (`vouch_engine::snapshot::create_legs`;
//! online the mirror held still while every leg's flush point is entered,
//! `Mirror::with_legs_still`), so a snapshot survives the loss of a leg as
//! the volume does. A stale or faulted leg gets none. A remote leg's copy
//! is its replica's snapshot, taken inside the same flush point through
//! the replica protocol (`snapshot_remote.rs`). Served
//! (`serve --snapshot NAME LEG`, or `serve LEG/snapshots/NAME`), the
//! copies are the legs of a read-only mirror: a block bad in one copy is
//! read from another.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use serde_json::json;
use vouch_engine::snapshot::{self, FlushPoint, LegsFlushPoint, RealFs, Snapshot, StoppedLegs};
use vouch_engine::{FileStorage, OpenOptions, Volume};
use vouch_mirror::set::MirrorRecord;
use vouch_mirror::{LegState, Mirror, MirrorLeg};

use crate::key::Use;
use crate::snapshot_remote::{self as remote, RemoteCopyLeg};

/// Each remote leg's copies (`snapshot_remote::list`), or why they could
/// not be listed.
type RemoteListed = Vec<(usize, std::result::Result<Vec<Snapshot>, String>)>;

/// A member of the set: its index, directory (or URL), and state.
struct Member {
    leg: usize,
    path: String,
    state: String,
    remote: bool,
}

fn members_of(record: &MirrorRecord) -> Vec<Member> {
    record
        .members
        .iter()
        .enumerate()
        .map(|(leg, member)| Member {
            leg,
            path: member.path.clone(),
            state: member.state.name().to_string(),
            remote: vouch_mirror::is_remote_member(&member.path),
        })
        .collect()
}

/// The legs of a served mirror as its status says (their paths are the
/// record's).
fn members_served(mirror: &Mirror) -> Vec<Member> {
    mirror
        .status()
        .into_iter()
        .enumerate()
        .map(|(leg, status)| Member {
            leg,
            remote: vouch_mirror::is_remote_member(&status.name),
            state: if status.present || status.state != LegState::Active {
                status.state_name().to_string()
            } else {
                "missing".to_string()
            },
            path: status.name,
        })
        .collect()
}

/// The remote legs opened (each holding its replica), and those that
/// could not be, with why.
type OpenedRemotes = (Vec<(usize, vouch_replica::RemoteLeg)>, Vec<(usize, String)>);

/// Every active remote leg of the stopped set opened (held until
/// dropped): an offline create needs each reachable, or it is refused
/// naming the leg; `list` and `delete` (`required` false) name one that is
/// not and go on.
fn open_remotes(
    record: &MirrorRecord,
    members: &[Member],
    required: bool,
) -> Result<OpenedRemotes> {
    let mut opened = Vec::new();
    let mut away = Vec::new();
    for member in members.iter().filter(|member| member.remote) {
        match remote::open_offline(&member.path, record) {
            Ok(replica) => opened.push((member.leg, replica)),
            Err(error) if required && member.state == "active" => bail!(
                "mirror leg {} ({}) cannot be reached: {error}; a snapshot of the mirror needs every active leg's copy: start its replica server, or take the snapshot with --server while the mirror is served",
                member.leg,
                member.path
            ),
            Err(error) => away.push((member.leg, error.to_string())),
        }
    }
    Ok((opened, away))
}

fn copy_legs(opened: &[(usize, vouch_replica::RemoteLeg)]) -> Vec<RemoteCopyLeg<'_>> {
    opened
        .iter()
        .map(|(leg, replica)| RemoteCopyLeg { leg: *leg, replica })
        .collect()
}

/// The served mirror's present remote legs.
fn served_remotes<'a>(mirror: &'a Mirror, members: &[Member]) -> Vec<RemoteCopyLeg<'a>> {
    members
        .iter()
        .filter(|member| member.remote)
        .filter_map(|member| {
            let replica = remote::remote_of(mirror.present_device(member.leg)?)?;
            Some(RemoteCopyLeg {
                leg: member.leg,
                replica,
            })
        })
        .collect()
}

/// A remote leg listed (`remote::list`) as a leg away: its error is
/// named only for an active leg (a stale one that cannot be reached
/// shows as a leg without a copy, as a local leg away does).
fn listed_remotes(
    members: &[Member],
    legs: &[RemoteCopyLeg],
    away: &[(usize, String)],
) -> RemoteListed {
    let mut listed = remote::list(legs);
    listed.extend(away.iter().map(|(leg, error)| (*leg, Err(error.clone()))));
    listed.retain(|(leg, result)| result.is_ok() || members[*leg].state == "active");
    listed
}

/// The one id of the copies of snapshot `name`: copies of different
/// snapshots under one name (one left on a leg that was away when it was
/// deleted, and another taken since) are refused, not served.
fn one_id(name: &str, found: &Found) -> Result<Option<String>> {
    let mut ids: Vec<(usize, &str)> = found
        .copies
        .iter()
        .filter_map(|(leg, copy)| {
            copy.as_ref()
                .ok()
                .map(|snap| (*leg, snap.record.id.as_str()))
        })
        .collect();
    if let Some((_, first)) = ids.first().copied() {
        ids.retain(|(_, id)| *id != first);
        if let Some((leg, _)) = ids.first() {
            bail!(
                "the legs' copies of snapshot {name} are of different snapshots (leg {leg}'s is not the first leg's): the legs disagree; `vouch snapshot list` shows them and `vouch snapshot delete` removes every copy"
            );
        }
        return Ok(Some(first.to_string()));
    }
    Ok(None)
}

/// Snapshot `name` of `legs` at `point` (the record says "copy" where
/// the files were copied, `RealFs`).
fn take(
    fs: &RealFs,
    legs: &[PathBuf],
    name: &str,
    point: &dyn LegsFlushPoint,
    id: &str,
) -> Result<Vec<Snapshot>> {
    Ok(snapshot::create_legs_with_id(fs, legs, point, name, id)?)
}

/// The stopped legs' flush point with each remote leg's copy taken
/// inside it (`Remotes::taken`), after the local legs' are entered and
/// before they are cloned.
struct StoppedWithRemotes<'a> {
    local: StoppedLegs<'a>,
    remotes: Remotes<'a>,
}

impl LegsFlushPoint for StoppedWithRemotes<'_> {
    fn at_flush_point(
        &self,
        clone: &mut dyn FnMut(&snapshot::HeldLegs) -> vouch_engine::Result<()>,
    ) -> vouch_engine::Result<()> {
        self.local.at_flush_point(&mut |held| {
            self.remotes.take(&self.remotes.legs)?;
            clone(held)
        })
    }
    fn online(&self) -> bool {
        false
    }
}

/// The remote legs' side of a create: the snapshot asked for, and the
/// copies made (to delete them when the local copies fail).
struct Remotes<'a> {
    legs: Vec<RemoteCopyLeg<'a>>,
    name: &'a str,
    id: String,
    copy: bool,
    made: std::cell::RefCell<Vec<Snapshot>>,
}

impl<'a> Remotes<'a> {
    /// Refused, naming the leg, when a replica's server takes no
    /// snapshots: before anything is made or held.
    fn new(legs: Vec<RemoteCopyLeg<'a>>, name: &'a str, copy: bool) -> Result<Remotes<'a>> {
        for remote in &legs {
            remote
                .replica
                .snapshots_supported()
                .with_context(|| format!("mirror leg {} ({})", remote.leg, remote.replica.url()))?;
        }
        Ok(Remotes {
            legs,
            name,
            id: snapshot::new_id(),
            copy,
            made: std::cell::RefCell::new(Vec::new()),
        })
    }

    /// Take the copies of `legs` (at the flush point).
    fn take(&self, legs: &[RemoteCopyLeg]) -> vouch_engine::Result<()> {
        let made = remote::create(legs, self.name, &self.id, self.copy)
            .map_err(|error| vouch_engine::Error::Unsupported(error.to_string()))?;
        self.made.borrow_mut().extend(made);
        Ok(())
    }

    /// The local copies failed: delete the remote ones made (a copy left
    /// is named by `list`).
    fn take_back(&self, legs: &[RemoteCopyLeg]) {
        if !self.made.borrow().is_empty() {
            let (_, failed) = remote::delete(legs, self.name);
            for why in failed {
                eprintln!("vouch: WARNING: {why}");
            }
        }
    }

    /// Every copy: the local ones, then the remote ones.
    fn all(&self, mut local: Vec<Snapshot>) -> Vec<Snapshot> {
        local.extend(self.made.borrow_mut().drain(..));
        local
    }
}

/// `vouch snapshot create LEG NAME` of a stopped mirror: every leg held
/// (no server may have any open), each active one closed cleanly with the
/// legs agreeing (no extents left to reconcile, no scrub owed).
pub fn create(path: &Path, name: &str, copy: bool) -> Result<ExitCode> {
    snapshot::check_name(name)?;
    let (record, reasons) = vouch_mirror::set::view(path)?;
    let members = members_of(&record);
    let _held = hold_legs(&members, "take the snapshot")?;
    let (opened, _) = open_remotes(&record, &members, true)?;
    let mut legs = Vec::new();
    for (member, reason) in members.iter().zip(&reasons) {
        if record.members[member.leg].state != LegState::Active || member.remote {
            continue;
        }
        if let Some(why) = reason {
            bail!(
                "mirror leg {} ({}) is missing: {why}; serve the mirror once (the leg is then marked stale) or replace it, then take the snapshot",
                member.leg,
                member.path
            );
        }
        legs.push(PathBuf::from(&member.path));
    }
    refuse_unsettled(&record, &legs)?;
    let active_remotes: Vec<RemoteCopyLeg> = copy_legs(&opened)
        .into_iter()
        .filter(|remote| members[remote.leg].state == "active")
        .collect();
    refuse_taken(
        &members,
        name,
        &listed_remotes(&members, &copy_legs(&opened), &[]),
    )?;
    let started = Instant::now();
    let fs = RealFs::new(copy);
    let point = StoppedWithRemotes {
        local: StoppedLegs {
            fs: &fs,
            legs: &legs,
        },
        remotes: Remotes::new(active_remotes, name, copy)?,
    };
    let taken = take(&fs, &legs, name, &point, &point.remotes.id)
        .inspect_err(|_| point.remotes.take_back(&point.remotes.legs))?;
    let taken = point.remotes.all(taken);
    print_taken(name, path, &taken, &members, started.elapsed());
    Ok(ExitCode::SUCCESS)
}

fn print_taken(name: &str, path: &Path, taken: &[Snapshot], members: &[Member], elapsed: Duration) {
    println!(
        "snapshot {name} of mirror {}: {} copies (checkpoint seq {}, {:.1} ms)",
        path.display(),
        taken.len(),
        taken.first().map_or(0, |snap| snap.record.checkpoint_seq),
        elapsed.as_secs_f64() * 1e3
    );
    for snap in taken {
        println!("  {}", snap.path.display());
    }
    for member in members.iter().filter(|member| member.state != "active") {
        println!(
            "  leg {} ({}) is {}: no copy",
            member.leg, member.path, member.state
        );
    }
}

/// A name some leg holds a copy of (an active leg: it exists; a stale or
/// faulted one: an older snapshot of that name, left there while the leg
/// was away when it was deleted) is not taken again.
fn refuse_taken(members: &[Member], name: &str, remotes: &RemoteListed) -> Result<()> {
    for (leg, listed) in remotes {
        match listed {
            Ok(copies) if copies.iter().any(|copy| copy.record.name == name) => bail!(
                "a snapshot named {name:?} already exists on leg {leg} ({}): choose another name or delete it first (`vouch snapshot delete` removes every leg's copy)",
                members[*leg].path
            ),
            Ok(_) => {}
            Err(error) => bail!(
                "the snapshots of leg {leg} ({}) cannot be listed: {error}",
                members[*leg].path
            ),
        }
    }
    for member in members.iter().filter(|member| !member.remote) {
        let copy = snapshot::snapshot_path(Path::new(&member.path), name);
        if copy.symlink_metadata().is_ok() {
            bail!(
                "a snapshot named {name:?} already exists on leg {} ({}, {}): choose another name or delete it first (`vouch snapshot delete` removes every leg's copy)",
                member.leg,
                copy.display(),
                member.state
            );
        }
    }
    Ok(())
}

/// Every local leg that exists held by this process (its lock), none
/// open in a server. `purpose` ends the message.
fn hold_legs(members: &[Member], purpose: &str) -> Result<Vec<std::fs::File>> {
    let mut held = Vec::new();
    for member in members.iter().filter(|member| !member.remote) {
        let dir = Path::new(&member.path);
        if !dir.join("superblock").exists() {
            continue;
        }
        if vouch_engine::volume_in_use(dir)? {
            bail!(
                "{} (leg {} of the mirror) is open in a running `vouch serve`: stop it, then {purpose} (or use --server)",
                dir.display(),
                member.leg
            );
        }
        held.push(
            FileStorage::lock_for_writing(dir)
                .with_context(|| format!("holding {}", dir.display()))?,
        );
    }
    Ok(held)
}

/// A stopped mirror whose active legs may differ (an unclean stop whose
/// extents were not reconciled, or a scrub owed) takes no snapshot: each
/// copy must hold what the others do.
fn refuse_unsettled(record: &MirrorRecord, legs: &[PathBuf]) -> Result<()> {
    let serve_first = |why: String| -> anyhow::Error {
        anyhow::anyhow!(
            "{why}: serve the mirror (`vouch serve {}`) until `vouch mirror status --server` shows every leg active (and scrub it if a scrub is owed), stop it, then take the snapshot",
            legs[0].display()
        )
    };
    for leg in legs {
        let superblock = vouch_engine::volume_superblock(leg)?;
        if superblock.state != vouch_format::superblock::STATE_CLEAN || leg.join("held").exists() {
            return Err(serve_first(format!(
                "mirror leg {} was not closed cleanly",
                leg.display()
            )));
        }
    }
    if vouch_mirror::set::is_unsynced(record) {
        return Err(serve_first(
            "the mirror's legs may differ (a scrub is owed after an unclean stop)".into(),
        ));
    }
    let blocks = vouch_engine::peek_volume(&legs[0])?.size_bytes / vouch_engine::BLOCK;
    if let vouch_mirror::Recovered::Extents(extents) =
        vouch_mirror::set::peek_activity(record, blocks)?
    {
        if !extents.is_empty() {
            return Err(serve_first(format!(
                "the mirror's legs may differ in {} extents its activity log names (an unclean stop not yet reconciled)",
                extents.len()
            )));
        }
    }
    Ok(())
}

/// One snapshot as the legs hold it.
struct Found {
    /// Per leg (index): its copy's record, or why it has none.
    copies: Vec<(usize, std::result::Result<Snapshot, String>)>,
}

/// The snapshots of the set's legs, by name (the remote legs' as
/// `remotes` lists them).
fn gather(members: &[Member], remotes: &RemoteListed) -> BTreeMap<String, Found> {
    let fs = RealFs::default();
    let mut found: BTreeMap<String, Found> = BTreeMap::new();
    let mut unreadable = Vec::new();
    for member in members.iter().filter(|member| !member.remote) {
        let listed = match snapshot::list(&fs, Path::new(&member.path)) {
            Ok(listed) => listed,
            Err(error) => {
                // A leg that is away has no `snapshots/` to read; any
                // other failure is named, not taken for "no copy".
                if Path::new(&member.path).is_dir() {
                    unreadable.push((member.leg, error.to_string()));
                }
                continue;
            }
        };
        for entry in listed {
            match entry {
                Ok(snap) => found
                    .entry(snap.record.name.clone())
                    .or_insert_with(|| Found { copies: Vec::new() })
                    .copies
                    .push((member.leg, Ok(snap))),
                Err(error) => unreadable.push((member.leg, error.to_string())),
            }
        }
    }
    for (leg, listed) in remotes {
        match listed {
            Ok(copies) => {
                for snap in copies {
                    found
                        .entry(snap.record.name.clone())
                        .or_insert_with(|| Found { copies: Vec::new() })
                        .copies
                        .push((*leg, Ok(snap.clone())));
                }
            }
            Err(error) => unreadable.push((*leg, error.clone())),
        }
    }
    for found in found.values_mut() {
        found.copies.sort_by_key(|(leg, _)| *leg);
    }
    for (leg, error) in unreadable {
        found
            .entry(format!("?{leg}"))
            .or_insert_with(|| Found { copies: Vec::new() })
            .copies
            .push((leg, Err(error)));
    }
    found
}

/// The snapshots of the set as JSON: each with its copies (leg, path,
/// state of the leg now) and, where the legs disagree (an active leg
/// without a copy, copies of different snapshots under one name: a create
/// or delete interrupted), `disagree` saying how.
fn listing(members: &[Member], remotes: &RemoteListed) -> Vec<serde_json::Value> {
    gather(members, remotes)
        .into_iter()
        .map(|(name, found)| {
            let errors: Vec<String> = found
                .copies
                .iter()
                .filter_map(|(leg, copy)| copy.as_ref().err().map(|e| format!("leg {leg}: {e}")))
                .collect();
            if !errors.is_empty() {
                return json!({ "error": errors.join("; ") });
            }
            let copies: Vec<(usize, &Snapshot)> = found
                .copies
                .iter()
                .filter_map(|(leg, copy)| copy.as_ref().ok().map(|snap| (*leg, snap)))
                .collect();
            let first = copies[0].1;
            let mut disagree = Vec::new();
            if copies.iter().any(|(_, snap)| snap.record.id != first.record.id) {
                disagree.push("its copies are of different snapshots (different ids)".to_string());
            }
            let mut legs = Vec::new();
            for member in members {
                let copy = copies.iter().find(|(leg, _)| *leg == member.leg);
                if copy.is_none() && member.state == "active" {
                    disagree.push(format!("active leg {} has no copy", member.leg));
                }
                legs.push(json!({
                    "leg": member.leg,
                    "state": member.state,
                    "copy": copy.map(|(_, snap)| snap.path.display().to_string()),
                }));
            }
            let mut item = json!({
                "name": name,
                "path": first.path.display().to_string(),
                "record": first.record,
                "legs": legs,
            });
            if !disagree.is_empty() {
                item["disagree"] = json!(format!(
                    "the legs disagree: {} (a create or delete was interrupted): `vouch snapshot delete` removes every copy",
                    disagree.join("; ")
                ));
            }
            item
        })
        .collect()
}

/// Print `items` (`listing`) as `snapshot list` does; whether any is
/// broken or disagrees (exit 1).
pub fn print_listing(items: &[serde_json::Value], what: &str, json_output: bool) -> Result<bool> {
    let bad = items
        .iter()
        .any(|item| item.get("error").is_some() || item.get("disagree").is_some());
    if json_output {
        println!("{}", serde_json::to_string_pretty(items)?);
        return Ok(bad);
    }
    if items.is_empty() {
        println!("{what}: no snapshots");
    }
    for item in items {
        if let Some(error) = item["error"].as_str() {
            println!("?\t{error}");
            continue;
        }
        let record = &item["record"];
        let copies: Vec<String> = item["legs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|leg| match leg["copy"].as_str() {
                Some(_) => format!("leg {}", leg["leg"]),
                None => format!(
                    "leg {} ({}): no copy",
                    leg["leg"],
                    leg["state"].as_str().unwrap_or("?")
                ),
            })
            .collect();
        println!(
            "{}\tcreated {}\tcheckpoint seq {}\t{}\t{}\tcopies: {}",
            item["name"].as_str().unwrap_or("?"),
            record["created_unix"],
            record["checkpoint_seq"],
            record["layout"].as_str().unwrap_or("?"),
            item["path"].as_str().unwrap_or("?"),
            copies.join(", ")
        );
        if let Some(disagree) = item["disagree"].as_str() {
            println!("\tWARNING: {disagree}");
        }
    }
    Ok(bad)
}

/// `vouch snapshot list LEG` of a mirror (offline: what a crash left
/// half made in any leg removed first, when no server holds the set).
pub fn list(path: &Path, json_output: bool) -> Result<ExitCode> {
    let (record, _) = vouch_mirror::set::view(path)?;
    let members = members_of(&record);
    let (opened, away) = open_remotes(&record, &members, false)?;
    let remotes = listed_remotes(&members, &copy_legs(&opened), &away);
    if let Ok(_held) = hold_legs(&members, "list") {
        let fs = RealFs::default();
        for member in members.iter().filter(|member| !member.remote) {
            let dir = Path::new(&member.path);
            if !dir.is_dir() {
                continue;
            }
            for removed in snapshot::tidy(&fs, dir)? {
                eprintln!(
                    "vouch: removed {removed} of leg {}, left by an interrupted snapshot create or delete",
                    member.leg
                );
            }
        }
    }
    let items = listing(&members, &remotes);
    let bad = print_listing(&items, &format!("mirror {}", path.display()), json_output)?;
    Ok(if bad {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The snapshots of a served mirror (the control API's list).
pub fn list_served(mirror: &Mirror) -> Vec<serde_json::Value> {
    let _one = crate::snapshot_held::ONLINE
        .lock()
        .unwrap_or_else(|poison| poison.into_inner());
    let members = members_served(mirror);
    let remotes = listed_remotes(&members, &served_remotes(mirror, &members), &[]);
    listing(&members, &remotes)
}

/// Remove every leg's copy of snapshot `name` (each held first: a copy
/// in use by another process is not deleted; a remote leg's through its
/// replica, `remotes`); the legs that had one.
fn delete_copies(members: &[Member], name: &str, remotes: &[RemoteCopyLeg]) -> Result<Vec<usize>> {
    snapshot::check_name(name)?;
    let fs = RealFs::default();
    let mut held = Vec::new();
    let mut legs = Vec::new();
    for member in members.iter().filter(|member| !member.remote) {
        let dir = Path::new(&member.path);
        if !dir.is_dir() {
            eprintln!(
                "vouch: WARNING: leg {} ({}) is missing: a copy of snapshot {name} it may hold is not deleted; when it is back, `vouch snapshot list` names it and `vouch snapshot delete` removes it",
                member.leg, member.path
            );
            continue;
        }
        let copy = snapshot::snapshot_path(dir, name);
        if !copy.is_dir() {
            continue;
        }
        crate::changed::release(&copy);
        held.push(crate::snapshot_held::hold_snapshot(dir, name, &copy)?);
        legs.push(member.leg);
    }
    for member in members.iter().filter(|member| member.remote) {
        if !remotes.iter().any(|remote| remote.leg == member.leg) {
            eprintln!(
                "vouch: WARNING: leg {} ({}) cannot be reached: a copy of snapshot {name} it may hold is not deleted; when it is back, `vouch snapshot list` names it and `vouch snapshot delete` removes it",
                member.leg, member.path
            );
        }
    }
    for member in members.iter().filter(|member| legs.contains(&member.leg)) {
        let dir = Path::new(&member.path);
        snapshot::tidy(&fs, dir)?;
        snapshot::delete(&fs, dir, name)?;
    }
    let (deleted, failed) = remote::delete(remotes, name);
    legs.extend(deleted);
    if !failed.is_empty() {
        bail!("{} (the other copies are deleted)", failed.join("; "));
    }
    if legs.is_empty() {
        bail!("the mirror has no snapshot named {name:?} on any leg (`vouch snapshot list` lists them)");
    }
    Ok(legs)
}

/// `vouch snapshot delete LEG NAME` of a stopped mirror: every leg's copy.
pub fn delete(path: &Path, name: &str) -> Result<ExitCode> {
    let (record, _) = vouch_mirror::set::view(path)?;
    let members = members_of(&record);
    let _held = hold_legs(&members, "delete the snapshot")?;
    let (opened, _) = open_remotes(&record, &members, false)?;
    let legs = delete_copies(&members, name, &copy_legs(&opened))?;
    println!(
        "deleted snapshot {name} of mirror {} (the copies of legs {})",
        path.display(),
        shown(&legs)
    );
    Ok(ExitCode::SUCCESS)
}

fn shown(legs: &[usize]) -> String {
    legs.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Delete every leg's copy of snapshot `name` of a served mirror.
pub fn delete_online(mirror: &Mirror, name: &str) -> Result<()> {
    let _one = crate::snapshot_held::ONLINE
        .lock()
        .unwrap_or_else(|poison| poison.into_inner());
    let members = members_served(mirror);
    delete_copies(&members, name, &served_remotes(mirror, &members)).map(drop)
}

/// Take snapshot `name` of a served mirror: every active leg's copy at
/// one flush point (`Mirror::with_legs_still`, each leg's
/// `Volume::at_flush_point` nested inside, the mirror released once all
/// are entered). Times as for a single volume.
pub fn create_online(
    mirror: &Mirror,
    name: &str,
    copy: bool,
) -> Result<(Vec<Snapshot>, crate::snapshot_held::Times)> {
    let _one = crate::snapshot_held::ONLINE
        .lock()
        .unwrap_or_else(|poison| poison.into_inner());
    snapshot::check_name(name)?;
    let members = members_served(mirror);
    let remotes = served_remotes(mirror, &members);
    if copy && !remotes.is_empty() {
        bail!(
            "--copy with a remote leg: its replica copies the whole volume while the mirror's writes are held (they are released only once every leg's copy is taken), past the request timeout for a large one; take it on filesystems that share blocks (xfs, btrfs) without --copy, or offline"
        );
    }
    refuse_taken(&members, name, &listed_remotes(&members, &remotes, &[]))?;
    let started = Instant::now();
    let legs: Vec<PathBuf> = mirror
        .active()
        .into_iter()
        .filter(|&leg| !members[leg].remote)
        .map(|leg| PathBuf::from(&members[leg].path))
        .collect();
    let fs = RealFs::new(copy);
    let point = Still {
        mirror,
        times: Cell::new((Duration::ZERO, Duration::ZERO)),
        remotes: Remotes::new(remotes, name, copy)?,
    };
    let taken = take(&fs, &legs, name, &point, &point.remotes.id)
        .inspect_err(|_| point.remotes.take_back(&point.remotes.legs))?;
    let taken = point.remotes.all(taken);
    let (flush, held) = point.times.get();
    Ok((
        taken,
        crate::snapshot_held::Times {
            held,
            flush,
            total: started.elapsed(),
        },
    ))
}

/// A served mirror's flush point: each leg checkpointed first (most of
/// the flush, without holding anything), then the mirror held still
/// while every active local leg's flush point is entered and every
/// active remote leg's replica takes its copy (its own flush point, one
/// round trip), and released; timed from the hold to the clones' start
/// (`times.0`) and end (`times.1`).
struct Still<'a> {
    mirror: &'a Mirror,
    times: Cell<(Duration, Duration)>,
    remotes: Remotes<'a>,
}

impl LegsFlushPoint for Still<'_> {
    fn at_flush_point(
        &self,
        clone: &mut dyn FnMut(&snapshot::HeldLegs) -> vouch_engine::Result<()>,
    ) -> vouch_engine::Result<()> {
        self.mirror.with_legs_still(|legs, remotes, release| {
            release();
            // A replica's commit ahead too (FLUSH): its flush point inside
            // the window then has little left to commit.
            for remote in remotes {
                remote.device.flush()?;
            }
            legs.iter().try_for_each(|leg| leg.volume.checkpoint_now())
        })?;
        let started = Instant::now();
        let mut flushed = Duration::ZERO;
        let result = self.mirror.with_legs_still(|legs, still_remotes, release| {
            // The remote legs active now: those the create was asked of
            // (a leg taken out since has no copy, as a stale local one).
            let active: Vec<RemoteCopyLeg> = self
                .remotes
                .legs
                .iter()
                .filter(|remote| still_remotes.iter().any(|still| still.leg == remote.leg))
                .map(|remote| RemoteCopyLeg {
                    leg: remote.leg,
                    replica: remote.replica,
                })
                .collect();
            let points: Vec<(&Path, &dyn FlushPoint)> = legs
                .iter()
                .map(|leg| (Path::new(leg.name), leg.volume as &dyn FlushPoint))
                .collect();
            snapshot::hold_legs(&points, &mut |held| {
                // Every leg holds what was acknowledged, and no write is
                // in flight: each replica takes its copy now (synced and
                // named on its host when it answers), then clients'
                // writes go on into the buffers.
                self.remotes.take(&active)?;
                release();
                flushed = started.elapsed();
                clone(held)
            })
        });
        self.times.set((flushed, started.elapsed()));
        result
    }
    fn online(&self) -> bool {
        true
    }
}

/// `LEG/snapshots/NAME` where LEG is a leg of a mirror: the leg and NAME.
pub fn of_snapshot_dir(path: &Path) -> Option<(PathBuf, String)> {
    let name = path.file_name()?.to_str()?.to_string();
    let parent = path.parent()?;
    if parent.file_name()?.to_str()? != snapshot::SNAPSHOTS_DIR {
        return None;
    }
    let leg = match parent.parent() {
        Some(leg) if !leg.as_os_str().is_empty() => leg.to_path_buf(),
        _ => PathBuf::from("."),
    };
    vouch_mirror::is_mirrored(&leg).then_some((leg, name))
}

/// Does some leg of the mirror `leg` belongs to hold snapshot `name`?
pub fn has_snapshot(leg: &Path, name: &str) -> bool {
    vouch_mirror::set::view(leg).is_ok_and(|(record, _)| {
        record
            .members
            .iter()
            .any(|member| snapshot::snapshot_path(Path::new(&member.path), name).is_dir())
    })
}

/// A mirror's snapshot opened to be served (`serve` keeps it as a set).
pub struct ServedCopies {
    pub mirror: Arc<Mirror>,
    /// Each leg's copy, in leg order (`None`: the leg has none).
    pub volumes: Vec<Option<Arc<Volume>>>,
    /// The first copy opened.
    pub primary: Arc<Volume>,
    /// The set's record.
    pub record: MirrorRecord,
}

/// Snapshot `name` of the mirror `leg` belongs to, opened to be served:
/// a read-only mirror over the legs' copies (those of the snapshot the
/// first copy is; a leg without one is missing), so that a block bad in
/// one copy is read from another.
pub fn open_served(leg: &Path, name: &str, options: OpenOptions) -> Result<ServedCopies> {
    snapshot::check_name(name)?;
    let (record, _) = vouch_mirror::set::view(leg)?;
    let members = members_of(&record);
    // The remote copies are opened, not listed: listing needs the replica,
    // which the mirror's own `serve` holds.
    let opened = open_remote_copies(&record, &members, name)?;
    let remotes: RemoteListed = opened
        .iter()
        .map(|(leg, replica)| (*leg, Ok(vec![remote_copy(replica, name)])))
        .collect();
    let found = gather(&members, &remotes);
    let Some(copies) = found.get(name) else {
        bail!(
            "the mirror of {} has no snapshot named {name:?} (`vouch snapshot list {}` lists them)",
            leg.display(),
            leg.display()
        );
    };
    let id = one_id(name, copies)?;
    let options = OpenOptions {
        read_only: true,
        ..options
    };
    let mut legs = Vec::new();
    let mut volumes = Vec::new();
    let mut opened: BTreeMap<usize, vouch_replica::RemoteLeg> = opened.into_iter().collect();
    for member in &members {
        let copy = copies.copies.iter().find_map(|(leg, copy)| match copy {
            Ok(snap) if *leg == member.leg && Some(&snap.record.id) == id.as_ref() => Some(snap),
            _ => None,
        });
        if let (Some(snap), Some(replica)) = (copy, opened.remove(&member.leg)) {
            // A remote copy: read through the replica protocol, read-only
            // (OPEN_SNAPSHOT); named by its URL, so reads prefer the
            // local copies and a bad block is read from one.
            legs.push(MirrorLeg {
                name: member.path.clone(),
                device: Some(Arc::new(replica) as Arc<dyn vouch_engine::SealedDevice>),
                state: LegState::Active,
            });
            eprintln!(
                "vouch: snapshot {name}: leg {}'s copy is {} (read through its replica server)",
                member.leg,
                snap.path.display()
            );
            volumes.push(None);
            continue;
        }
        let volume = match copy {
            Some(snap) => Some(Arc::new(
                crate::key::open(&snap.path, options.clone(), Use::Data)
                    .with_context(|| format!("opening {}", snap.path.display()))?,
            )),
            None => {
                eprintln!(
                    "vouch: snapshot {name}: leg {} ({}) has no copy of it",
                    member.leg, member.path
                );
                None
            }
        };
        legs.push(MirrorLeg {
            name: copy.map_or_else(
                || member.path.clone(),
                |snap| snap.path.display().to_string(),
            ),
            device: volume
                .clone()
                .map(|v| v as Arc<dyn vouch_engine::SealedDevice>),
            state: if volume.is_some() {
                LegState::Active
            } else {
                LegState::Stale
            },
        });
        volumes.push(volume);
    }
    let mirror = Mirror::new(legs, None)?;
    let primary = volumes
        .iter()
        .flatten()
        .next()
        .cloned()
        .context("no copy of the snapshot opened")?;
    Ok(ServedCopies {
        mirror,
        volumes,
        primary,
        record,
    })
}

/// Each remote member's copy of snapshot `name`, opened read-only
/// (`RemoteLeg::open_snapshot`); a member without one, or whose replica
/// cannot be reached, is left out (warned of: the snapshot is served
/// from the other copies).
fn open_remote_copies(
    record: &MirrorRecord,
    members: &[Member],
    name: &str,
) -> Result<Vec<(usize, vouch_replica::RemoteLeg)>> {
    let mut opened = Vec::new();
    for member in members.iter().filter(|member| member.remote) {
        let url = vouch_replica::ReplicaUrl::parse(&member.path).map_err(|e| anyhow::anyhow!(e))?;
        let options = crate::replica::client_options()?;
        match vouch_replica::RemoteLeg::open_snapshot(&url, name, &options) {
            Ok(replica) if replica.info().uuid != record.uuid => bail!(
                "leg {} ({}): its snapshot {name} is of another volume (uuid {})",
                member.leg,
                member.path,
                replica.uuid_string()
            ),
            Ok(replica) => opened.push((member.leg, replica)),
            Err(error) => eprintln!(
                "vouch: snapshot {name}: leg {} ({}): no copy read: {error}",
                member.leg, member.path
            ),
        }
    }
    Ok(opened)
}

/// An opened remote copy as `gather` takes it (its id the replica's).
fn remote_copy(replica: &vouch_replica::RemoteLeg, name: &str) -> Snapshot {
    let (_, id) = replica.snapshot().expect("opened as a snapshot");
    let entry = vouch_replica::wire::SnapshotEntry {
        name: name.to_string(),
        id: id.to_string(),
        checkpoint_seq: 0,
        created_unix: 0,
    };
    remote::as_snapshot(replica, entry)
}

/// A copy of a mirror's snapshot `check` reports: a local leg's
/// directory, or a remote leg's replica and the snapshot's name.
pub enum CheckedCopy {
    Local(PathBuf),
    Remote { url: String, name: String },
}

/// `LEG/snapshots/NAME` of a mirror: every leg's copy of snapshot NAME
/// that is there (a remote leg's: every remote leg, its replica says
/// whether it has one), with its leg (`check` reports each).
pub fn copies(path: &Path) -> Option<Vec<(usize, CheckedCopy)>> {
    let (leg, name) = of_snapshot_dir(path)?;
    let (record, _) = vouch_mirror::set::view(&leg).ok()?;
    // Copies of different snapshots under one name: each is checked
    // all the same, and `list` names the disagreement.
    let copies: Vec<(usize, CheckedCopy)> = members_of(&record)
        .into_iter()
        .filter_map(|member| {
            if member.remote {
                let url = member.path;
                let name = name.clone();
                return Some((member.leg, CheckedCopy::Remote { url, name }));
            }
            let copy = snapshot::snapshot_path(Path::new(&member.path), &name);
            copy.is_dir()
                .then_some((member.leg, CheckedCopy::Local(copy)))
        })
        .collect();
    copies
        .iter()
        .any(|(_, copy)| matches!(copy, CheckedCopy::Local(_)))
        .then_some(copies)
}
