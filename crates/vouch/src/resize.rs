//! `vouch resize PATH SIZE`: grow a stopped volume, or shrink it when its
//! tail was never written (`vouch_engine::resize`; docs/FORMAT.md,
//! "Resize"); `vouch resize --server ADDR [EXPORT] SIZE` and the control
//! API's `POST /v1/exports/{export}/resize`: a served one
//! (`Volume::resize_online`; a volume with regions:
//! `RegionVolume::resize_online`; a mirror: `Mirror::resize_online`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use vouch_engine::resize::{self, ResizeBreaks};
use vouch_engine::snapshot::RealFs;
use vouch_engine::volume::OnlineResized;
use vouch_engine::{OpenOptions, Volume, BLOCK};
use vouch_format::FeatureFlags;

use crate::offload::client::{Client, ServerArgs};

/// `vouch resize`: `first` and `second` are PATH SIZE offline, [EXPORT]
/// SIZE with --server.
pub fn run(first: &str, second: Option<&str>, server: &ServerArgs) -> Result<ExitCode> {
    if server.server.is_some() {
        return resize_through(server, first, second);
    }
    let size = second.context("missing SIZE: vouch resize PATH SIZE")?;
    let new_bytes = crate::sizes::parse_volume_size(size).map_err(anyhow::Error::msg)?;
    offline(Path::new(first), new_bytes)
}

fn resize_through(server: &ServerArgs, first: &str, second: Option<&str>) -> Result<ExitCode> {
    let client = Client::new(server)?;
    let (export, size) = match second {
        Some(size) => (first.to_string(), size.to_string()),
        None => {
            let (export, _) = crate::snapshot::export_and_name(&client, None, None)?;
            (export, first.to_string())
        }
    };
    // Checked here too, for the CLI's own message.
    crate::sizes::parse_volume_size(&size).map_err(anyhow::Error::msg)?;
    let answer = client.call(
        hyper::Method::POST,
        &format!("/v1/exports/{}/resize", crate::snapshot::percent(&export)),
        Some(&json!({ "size": size })),
    )?;
    println!(
        "resized export {export} from {} to {} bytes (clients waited {:.1} ms for the engine, then {:.1} ms while it was resized); connections made from now on see the new size, those open keep theirs",
        answer["old_size"],
        answer["size"],
        answer["waited_ms"].as_f64().unwrap_or(f64::NAN),
        answer["held_ms"].as_f64().unwrap_or(f64::NAN),
    );
    Ok(ExitCode::SUCCESS)
}

/// An online resize under way: from, to, started (Unix seconds).
type Resizing = (u64, u64, u64);

/// Online resizes under way, by volume directory.
static RESIZING: Mutex<Option<HashMap<PathBuf, Resizing>>> = Mutex::new(None);

/// One online resize at a time per server.
static ONLINE: Mutex<()> = Mutex::new(());

/// The resize under way of the served volume at `dir`, for the control
/// API's export info (`null` when none).
pub fn in_progress(dir: &Path) -> Value {
    let resizing = RESIZING.lock().unwrap_or_else(|poison| poison.into_inner());
    match resizing.as_ref().and_then(|map| map.get(dir)) {
        Some((from, to, started)) => {
            json!({"from_size": from, "to_size": to, "started_unix": started})
        }
        None => Value::Null,
    }
}

/// Resize the served volume `volume` (directory `dir`) to `new_bytes`.
pub fn resize_online(dir: &Path, volume: &Volume, new_bytes: u64) -> Result<OnlineResized> {
    // Its files change outside the before-image layer: not under an
    // overlay snapshot, nor one materialising.
    vouch_engine::snapshot::refuse_while_materialising(
        &vouch_engine::snapshot::RealFs::default(),
        dir,
        "resize it",
    )?;
    let from = vouch_engine::BlockDevice::size(volume);
    marked(dir, from, new_bytes, || {
        Ok(resize::resize_open(volume, dir, new_bytes)?)
    })
}

/// Resize the served volume with regions of `migration` (directory
/// `dir`) to `new_bytes`, no migration running meanwhile
/// (`RegionVolume::resize_online`: both members in turn).
pub fn resize_online_regions(
    dir: &Path,
    migration: &crate::migrate_online::Migration,
    new_bytes: u64,
) -> Result<OnlineResized> {
    let volume = &migration.volume;
    let from = vouch_engine::BlockDevice::size(&**volume);
    marked(dir, from, new_bytes, || {
        migration
            .while_idle(|| vouch_engine::regions::resize::resize_open(volume, new_bytes))
            .map_err(anyhow::Error::msg)?
            .map_err(anyhow::Error::from)
    })
}

/// Resize the served mirror `mirror` (directory `dir`, one of its legs)
/// to `new_bytes` (`Mirror::resize_online`: every leg local and active,
/// each resized in turn by the offline leg resize while every leg's engine
/// is closed, then the activity log started again at the new size).
pub fn resize_online_mirror(
    dir: &Path,
    mirror: &vouch_mirror::Mirror,
    new_bytes: u64,
) -> Result<OnlineResized> {
    let from = vouch_engine::BlockDevice::size(mirror);
    marked(dir, from, new_bytes, || {
        let fs = RealFs::default();
        let (record, _) = vouch_mirror::set::view(dir)?;
        let pause = std::env::var_os(PAUSE_BETWEEN_LEGS);
        Ok(mirror.resize_online(
            new_bytes,
            vouch_mirror::MirrorResizeSteps {
                leg_files: &mut |leg, bytes| {
                    resize::resize_mirror_leg(&fs, Path::new(leg), bytes)?;
                    if let Some(pause) = &pause {
                        pause_between_legs(Path::new(pause));
                    }
                    Ok(())
                },
                reopen: &|leg, storage, geometry| {
                    storage
                        .reopen(geometry)
                        .map_err(|error| vouch_engine::Error::Path {
                            action: "open",
                            path: PathBuf::from(leg),
                            cause: error.to_string(),
                        })
                },
                new_log: &mut |blocks| {
                    vouch_mirror::set::open_activity(&record, blocks).map(|(log, _)| log)
                },
            },
        )?)
    })
}

/// For tests (`tests/resize_mirror_online.rs`): a file path; an online
/// resize of a mirror creates it after a leg's files were resized and
/// waits a minute there, so a test can kill the server between two legs.
const PAUSE_BETWEEN_LEGS: &str = "VOUCH_TEST_PAUSE_BETWEEN_MIRROR_LEGS";

fn pause_between_legs(marker: &Path) {
    if std::fs::write(marker, b"").is_ok() {
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
}

/// `resize`, one at a time per server, shown in the export's info
/// meanwhile (`in_progress`).
fn marked(
    dir: &Path,
    from: u64,
    new_bytes: u64,
    resize: impl FnOnce() -> Result<OnlineResized>,
) -> Result<OnlineResized> {
    let _one = ONLINE.lock().unwrap_or_else(|poison| poison.into_inner());
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mark = |entry: Option<Resizing>| {
        let mut resizing = RESIZING.lock().unwrap_or_else(|poison| poison.into_inner());
        let map = resizing.get_or_insert_with(HashMap::new);
        match entry {
            Some(entry) => map.insert(dir.to_path_buf(), entry),
            None => map.remove(dir),
        };
    };
    mark(Some((from, new_bytes, started)));
    let done = resize();
    mark(None);
    done
}

fn offline(path: &Path, new_bytes: u64) -> Result<ExitCode> {
    crate::key::volume_dir(path)?;
    if vouch_engine::volume_in_use(path)? {
        bail!(
            "{} is open in a running `vouch serve`: resize it through the server (`vouch resize --server ADDR [EXPORT] SIZE`, its --control address), or stop it first",
            path.display()
        );
    }
    if vouch_mirror::is_mirrored(path) {
        return crate::resize_mirror::offline(path, new_bytes);
    }
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
pub(crate) fn refuse_written_tail(path: &Path, new_bytes: u64, old_bytes: u64) -> Result<()> {
    let encrypted = vouch_engine::volume_superblock(path)?.features.incompat
        & FeatureFlags::INCOMPAT_ENCRYPTED
        != 0;
    let options = OpenOptions {
        read_only: true,
        keyless: encrypted,
        ..OpenOptions::default()
    };
    let (first, end) = (new_bytes / BLOCK, old_bytes / BLOCK);
    let found = if crate::migrate::has_regions(path) {
        // Asked of the region layer: each region's blocks where they are
        // served.
        let volume = vouch_engine::regions::RegionVolume::open(path, &options)?;
        let found = resize::first_written(&volume, first, end)?;
        volume.close()?;
        found
    } else {
        let volume = vouch_engine::open_volume(path, &options)?;
        let found = resize::first_written(&volume, first, end)?;
        volume.close()?;
        found
    };
    if let Some(lba) = found {
        bail!(
            "cannot shrink {} to {new_bytes} bytes: LBA {lba} (byte {}) is written; a shrink cuts only a tail that holds nothing (never written, or trimmed)",
            path.display(),
            lba * BLOCK
        );
    }
    Ok(())
}
