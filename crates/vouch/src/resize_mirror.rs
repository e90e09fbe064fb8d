//! `vouch resize PATH SIZE` of a mirrored volume whose legs are all local
//! (docs/CRASH_MODEL.md, "Resize of a mirror"): every leg held, active and
//! closed cleanly, a shrink's tail unwritten on each, then each leg
//! resized in turn by the one-volume resize (`resize_mirror_leg`: its own
//! crash ordering). A crash between two legs leaves legs of different
//! sizes: the mirror's open refuses them, naming the leg and both sizes
//! (`Mirror::new`), and this command run again resizes the legs that lack
//! the size (a leg already at it is left as it is). The mirror's files
//! follow on the next writable open: its activity log is started again
//! for the new size (the legs closed cleanly: nothing to reconcile).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context as _, Result};
use vouch_engine::resize;
use vouch_engine::snapshot::RealFs;
use vouch_format::superblock::STATE_CLEAN;
use vouch_format::FeatureFlags;
use vouch_mirror::LegState;

pub fn offline(path: &Path, new_bytes: u64) -> Result<ExitCode> {
    let (record, problems) = vouch_mirror::set::view(path)?;
    if let Some((index, why)) = problems
        .iter()
        .enumerate()
        .find_map(|(index, why)| why.as_ref().map(|why| (index, why)))
    {
        bail!(
            "mirror leg {} {why}: the mirror is not resized",
            record.members[index].path
        );
    }
    let mut legs = Vec::new();
    for member in &record.members {
        if vouch_mirror::is_remote_member(&member.path) {
            bail!(
                "mirror leg {} is remote: a mirror with a remote leg is not resized (remove it with `vouch mirror remove`, resize, then add it again)",
                member.path
            );
        }
        if member.state != LegState::Active {
            bail!(
                "mirror leg {} is {}: every leg must be active to be resized (resync it by serving the mirror, or `vouch mirror replace` it, first)",
                member.path,
                member.state.name()
            );
        }
        legs.push(PathBuf::from(&member.path));
    }
    let before = superblocks(&legs)?;
    for (leg, superblock) in legs.iter().zip(&before) {
        if superblock.features.ro_compat & FeatureFlags::RO_COMPAT_SNAPSHOT != 0 {
            bail!("{} is a snapshot, which is read-only", leg.display());
        }
        if superblock.state != STATE_CLEAN || leg.join("held").exists() {
            bail!(
                "mirror leg {} was not closed cleanly: serve the mirror once (`vouch serve`, which recovers and reconciles its legs), stop it, then resize it",
                leg.display()
            );
        }
    }
    // A shrink: each leg's tail unwritten, over its own size (a resize cut
    // short may have left the legs apart), asked of each leg opened
    // read-only (which takes its own lock, so it is asked before ours are
    // taken). The superblocks are compared after, under our locks: an open
    // and close in between changes them; a writer still running holds its
    // leg's lock, so taking ours fails.
    for (leg, superblock) in legs.iter().zip(&before) {
        if new_bytes < superblock.size_bytes {
            crate::resize::refuse_written_tail(leg, new_bytes, superblock.size_bytes)?;
        }
    }
    let _held = legs
        .iter()
        .map(|leg| {
            vouch_engine::FileStorage::lock_for_writing(leg)
                .with_context(|| format!("holding mirror leg {}", leg.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    if superblocks(&legs)? != before {
        bail!(
            "a leg of {} was opened by another process while it was being resized: try again",
            path.display()
        );
    }
    let fs = RealFs::default();
    let mut done = Vec::new();
    for leg in &legs {
        let resized = resize::resize_mirror_leg(&fs, leg, new_bytes)
            .with_context(|| format!("resizing mirror leg {}", leg.display()))?;
        done.push(format!(
            "{} from {} to {} bytes",
            leg.display(),
            resized.old_bytes,
            resized.new_bytes
        ));
    }
    println!(
        "resized the mirror of {} ({} legs): {}",
        path.display(),
        legs.len(),
        done.join(", ")
    );
    Ok(ExitCode::SUCCESS)
}

fn superblocks(legs: &[PathBuf]) -> Result<Vec<vouch_format::Superblock>> {
    legs.iter()
        .map(|leg| {
            vouch_engine::volume_superblock(leg)
                .with_context(|| format!("mirror leg {}", leg.display()))
        })
        .collect()
}
