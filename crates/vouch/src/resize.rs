//! `vouch resize PATH SIZE`: grow a stopped volume, or shrink it when its
//! tail was never written (`vouch_engine::resize`; docs/FORMAT.md,
//! "Resize").

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Result};
use vouch_engine::resize::{self, ResizeBreaks};
use vouch_engine::snapshot::RealFs;
use vouch_engine::{OpenOptions, BLOCK};
use vouch_format::FeatureFlags;

pub fn run(path: &Path, new_bytes: u64) -> Result<ExitCode> {
    crate::commands::volume_dir(path)?;
    let superblock = vouch_engine::volume_superblock(path)?;
    if superblock.features.ro_compat & FeatureFlags::RO_COMPAT_SNAPSHOT != 0 {
        bail!(
            "{} is a snapshot, which is read-only: resize the volume, or a `vouch clone` of the snapshot",
            path.display()
        );
    }
    let mut held = crate::snapshot::hold_offline(path, "resize it")?;
    let before = vouch_engine::volume_superblock(path)?;
    if new_bytes < before.size_bytes {
        // The tail must hold nothing: asked of the volume opened (read-only,
        // without its key: block status needs only the contexts), which
        // takes its own lock, so the superblock is compared after, under
        // ours again: a writer's open in between changes it.
        drop(held);
        refuse_written_tail(path, new_bytes, before.size_bytes)?;
        held = vouch_engine::FileStorage::lock_for_writing(path)?;
        if vouch_engine::volume_superblock(path)? != before {
            bail!(
                "{} was opened by another process while it was being resized: try again",
                path.display()
            );
        }
    }
    let done = resize::resize(&RealFs::default(), path, new_bytes, ResizeBreaks::default())?;
    drop(held);
    println!(
        "resized {} from {} to {} bytes",
        path.display(),
        done.old_bytes,
        done.new_bytes
    );
    Ok(ExitCode::SUCCESS)
}

/// Refuse a shrink over anything written, naming its first LBA.
fn refuse_written_tail(path: &Path, new_bytes: u64, old_bytes: u64) -> Result<()> {
    let encrypted = vouch_engine::volume_superblock(path)?.features.incompat
        & FeatureFlags::INCOMPAT_ENCRYPTED
        != 0;
    let volume = vouch_engine::open_volume(
        path,
        &OpenOptions {
            read_only: true,
            keyless: encrypted,
            ..OpenOptions::default()
        },
    )?;
    let found = resize::first_written(&volume, new_bytes / BLOCK, old_bytes / BLOCK)?;
    volume.close()?;
    if let Some(lba) = found {
        bail!(
            "cannot shrink {} to {new_bytes} bytes: LBA {lba} (byte {}) is written; a shrink cuts only a tail that holds nothing (never written, or trimmed)",
            path.display(),
            lba * BLOCK
        );
    }
    Ok(())
}
