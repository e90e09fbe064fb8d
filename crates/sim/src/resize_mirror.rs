//! `vouch-sim resize --online --mirror`: a served mirror of two local
//! legs resized online (`Mirror::resize_online`) crashed at every file
//! operation its legs' resizes issue.
//!
//! Per seed: a mirror of two small legs made on real files, opened
//! writable with its activity log (as `vouch serve` opens it), random
//! blocks written through it before each resize (left in the legs'
//! write-back buffers). Then three resizes through it: a grow, a grow
//! after blocks of the new tail were written (its last always), and a
//! shrink back over the unwritten tail. Each leg's files are resized by
//! the offline leg resize (`resize::resize_mirror_leg`) on the model
//! filesystem of `vouch-sim snapshot` holding both legs (`/a`, `/b`;
//! loaded from the real files, where the legs' engines closed them
//! cleanly), then written back; three crash images are taken right before
//! each operation (a process crash, a power cut keeping nothing unsynced,
//! one keeping a random subset). On each, after what the next open does
//! first (`resize::finish` of each leg):
//!
//! - each leg says the old size or the new one, and is closed cleanly (no
//!   leg is open while any leg's files change);
//! - legs of two sizes (the mirror's open refuses them) are taken by the
//!   offline `vouch resize` of the mirror, which (each leg lacking the
//!   size resized) brings both to the new size;
//! - each leg, written out to real files, opens writable, reads as the
//!   model says (every write acknowledged before the resize; zeros in a
//!   new tail), `check` finds nothing, and the legs hold the same blocks.
//!
//! After each resize the served mirror has the new size on both legs and
//! reads as the model; at the end it is closed and each leg read whole.
//!
//! `--break-leg-by-leg` resizes the legs one after the other with the
//! one-volume online resize (`Volume::resize_online`: each leg's engine
//! opened again before the next leg is closed): a leg's files change
//! while the other is open, and a crash between them leaves a leg of the
//! new size not closed cleanly beside one of the old size, which nothing
//! can finish (the mirror's open refuses two sizes, the offline resize a
//! leg not closed cleanly): the run must find it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use vouch_engine::resize;
use vouch_engine::{BlockDevice, CreateOptions, OpenOptions, Volume};
use vouch_format::superblock::STATE_CLEAN;
use vouch_mirror::Mirror;

use crate::faults::BLOCKS;
use crate::migrate::TempDir;
use crate::model_files::{
    check_clean, load_under, reads_as, superblock_in, write_back_of, write_out_of, write_some,
};
use crate::rng::Rng;
use crate::snapshot::{ModelFs, Recording, SnapshotReport};
use crate::BLOCK;

const BLOCK_U64: u64 = BLOCK as u64;
/// The legs in the model filesystem.
const LEGS: [&str; 2] = ["/a", "/b"];

/// The resize under way: the sizes before and after, and the mirror's
/// image (as long as the larger).
#[derive(Clone)]
struct Step {
    from: u64,
    to: u64,
    image: Arc<Vec<u8>>,
}

fn sim_error(error: String) -> vouch_engine::Error {
    vouch_engine::Error::InvalidArgument(error)
}

/// One seed in `layout`; `leg_by_leg`: the broken order.
pub(crate) fn run_seed_online(
    layout: vouch_engine::LayoutKind,
    leg_by_leg: bool,
    seed: u64,
    report: &mut SnapshotReport,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let temp = TempDir::new(&format!("resize-mirror-online-{seed}"));
    let real: Vec<PathBuf> = ["a", "b"].iter().map(|leg| temp.0.join(leg)).collect();
    let options = CreateOptions {
        layout,
        journal_bytes: Some(1 << 20),
        ..CreateOptions::new(BLOCKS * BLOCK_U64)
    };
    vouch_mirror::create_mirror(&real, &options)
        .and_then(Volume::close)
        .map_err(|e| format!("create the mirror: {e}"))?;
    let first = BLOCKS + rng.range(1, 160);
    let second = first + rng.range(1, 160);

    let set = vouch_mirror::open_mirror(&real[0], true, &mut |leg| {
        vouch_engine::open_volume(leg, &OpenOptions::default())
    })
    .map_err(|e| format!("open the mirror: {e}"))?;
    let record = set.record.clone();
    let (mirror, volumes) = set.into_mirror(true).map_err(|e| e.to_string())?;
    let (log, _) = vouch_mirror::set::open_activity(&record, BLOCKS).map_err(|e| e.to_string())?;
    mirror
        .keep_activity_log(Arc::new(log))
        .map_err(|e| e.to_string())?;

    let recording = Recording::new(ModelFs::new());
    let step: Arc<Mutex<Option<Step>>> = Arc::default();
    let findings = crate::snapshot::Findings::default();
    {
        let step = step.clone();
        let scratch = temp.0.join("image");
        *recording.hook.lock() = Some(findings.hook(rng.fork(), move |fs| {
            let Some(step) = step.lock().clone() else {
                return Ok(());
            };
            verify(fs, &step, &scratch)
                .map_err(|e| format!("online mirror {} -> {} blocks: {e}", step.from, step.to))
        }));
    }
    // A leg's files resized on the model holding both legs as their real
    // files are now, then written back.
    let leg_files = |leg: &str, bytes: u64| -> vouch_engine::Result<()> {
        let model = LEGS[usize::from(Path::new(leg) != real[0])];
        let mut fs = ModelFs::new();
        for (root, dir) in LEGS.iter().zip(&real) {
            load_under(&mut fs, dir, Path::new(root)).map_err(sim_error)?;
        }
        *recording.fs.lock() = fs;
        resize::resize_mirror_leg(&recording, Path::new(model), bytes)?;
        let fs = recording.fs.lock().clone();
        write_back_of(&fs, Path::new(model), Path::new(leg)).map_err(sim_error)
    };
    let resize_online = |from: u64, to: u64, image: &[u8]| -> Result<(), String> {
        *step.lock() = Some(Step {
            from,
            to,
            image: Arc::new(image.to_vec()),
        });
        let done = if leg_by_leg {
            one_leg_after_another(&volumes, &real, to * BLOCK_U64, &leg_files)
        } else {
            mirror
                .resize_online(
                    to * BLOCK_U64,
                    vouch_mirror::MirrorResizeSteps {
                        leg_files: &mut |leg, bytes| leg_files(leg, bytes),
                        reopen: &|_, storage, geometry| {
                            storage
                                .reopen(geometry)
                                .map_err(|e| sim_error(format!("reopen: {e}")))
                        },
                        new_log: &mut |blocks| {
                            vouch_mirror::set::open_activity(&record, blocks).map(|(log, _)| log)
                        },
                    },
                )
                .map(drop)
        };
        *step.lock() = None;
        done.map_err(|e| format!("online resize {from} -> {to} blocks failed: {e}"))?;
        if leg_by_leg {
            return Ok(()); // the mirror keeps its old size: judged by the images only
        }
        read_mirror(&mirror, to)
            .and_then(|read| reads_as(&read, image))
            .map_err(|e| format!("served, after the online resize to {to} blocks: {e}"))
    };

    let mut image = vec![0u8; (BLOCKS * BLOCK_U64) as usize];
    write_some(&*mirror, &mut image, &mut rng, 0..BLOCKS, BLOCKS - 1)?;
    image.resize((first * BLOCK_U64) as usize, 0);
    resize_online(BLOCKS, first, &image)?;
    if !leg_by_leg {
        write_some(&*mirror, &mut image, &mut rng, BLOCKS..first, first - 1)?;
    }
    let mut grown = image.clone();
    grown.resize((second * BLOCK_U64) as usize, 0);
    resize_online(first, second, &grown)?;
    if !leg_by_leg {
        write_some(&*mirror, &mut grown, &mut rng, 0..first, first - 1)?;
        resize_online(second, first, &grown)?;
    }
    *recording.hook.lock() = None;
    mirror.close_activity_log().map_err(|e| e.to_string())?;
    drop(mirror);
    for volume in volumes.into_iter().flatten() {
        Arc::try_unwrap(volume)
            .map_err(|_| "a leg is still held".to_string())?
            .close()
            .map_err(|e| format!("close a leg: {e}"))?;
    }
    if !leg_by_leg {
        for leg in &real {
            let read = read_leg(leg, first).map_err(|e| format!("at the end: {e}"))?;
            reads_as(&read, &grown[..(first * BLOCK_U64) as usize])
                .map_err(|e| format!("at the end, {}: {e}", leg.display()))?;
        }
    }
    findings.end(report)
}

/// The broken order (`--break-leg-by-leg`): each leg's one-volume online
/// resize in turn, each opened again before the next is closed.
fn one_leg_after_another(
    volumes: &[Option<Arc<Volume>>],
    real: &[PathBuf],
    new_bytes: u64,
    leg_files: &dyn Fn(&str, u64) -> vouch_engine::Result<()>,
) -> vouch_engine::Result<()> {
    for (volume, leg) in volumes.iter().zip(real) {
        let volume = volume
            .as_ref()
            .ok_or_else(|| sim_error("a leg is not open".into()))?;
        let name = leg.display().to_string();
        volume.resize_online(
            new_bytes,
            vouch_engine::volume::ResizeSteps {
                files: &mut |bytes| leg_files(&name, bytes),
                reopen: &mut |storage, geometry| {
                    storage
                        .reopen(geometry)
                        .map_err(|e| sim_error(format!("reopen: {e}")))
                },
            },
        )?;
    }
    Ok(())
}

/// The leg at `path` opened alone (writable: it recovers as an open
/// does), at `blocks` blocks, read whole, checked (nothing found), closed.
fn read_leg(path: &Path, blocks: u64) -> Result<Vec<u8>, String> {
    let volume = vouch_engine::open_volume(path, &OpenOptions::default())
        .map_err(|e| format!("open: {e}"))?;
    if volume.size() != blocks * BLOCK_U64 {
        return Err(format!(
            "opens at {} bytes, not {}",
            volume.size(),
            blocks * BLOCK_U64
        ));
    }
    let mut image = vec![0u8; (blocks * BLOCK_U64) as usize];
    volume
        .read(0, &mut image)
        .map_err(|e| format!("read: {e}"))?;
    check_clean(&volume)?;
    volume.close().map_err(|e| format!("close: {e}"))?;
    Ok(image)
}

/// The served mirror, of `blocks` blocks, read whole.
fn read_mirror(mirror: &Mirror, blocks: u64) -> Result<Vec<u8>, String> {
    if mirror.size() != blocks * BLOCK_U64 {
        return Err(format!(
            "the mirror has {} bytes, not {}",
            mirror.size(),
            blocks * BLOCK_U64
        ));
    }
    let mut image = vec![0u8; (blocks * BLOCK_U64) as usize];
    for (lba, block) in image.chunks_mut(BLOCK).enumerate() {
        mirror
            .read(lba as u64 * BLOCK_U64, block)
            .map_err(|e| format!("read LBA {lba}: {e}"))?;
    }
    Ok(image)
}

/// A crash image of both legs, judged (see the module).
fn verify(fs: ModelFs, step: &Step, scratch: &Path) -> Result<(), String> {
    let recovered = Recording::new(fs);
    for leg in LEGS {
        resize::finish(&recovered, Path::new(leg)).map_err(|e| format!("{leg}: finish: {e}"))?;
    }
    let fs = recovered.fs.lock().clone();
    let mut sizes = Vec::new();
    for leg in LEGS {
        let superblock = superblock_in(&fs, Path::new(leg))?;
        let blocks = superblock.size_bytes / BLOCK_U64;
        if blocks != step.from && blocks != step.to {
            return Err(format!(
                "{leg} has {blocks} blocks: neither the old size nor the new one"
            ));
        }
        // No leg is open while any leg's files change: a leg opened again
        // (or not closed yet) beside legs of another size is a state
        // nothing finishes (the mirror's open refuses the two sizes, the
        // offline resize a leg not closed cleanly).
        if superblock.state != STATE_CLEAN {
            return Err(format!(
                "{leg} ({blocks} blocks) was not closed cleanly while a leg's files were resized"
            ));
        }
        sizes.push(blocks);
    }
    let apart = sizes[0] != sizes[1];
    let fs = if apart {
        // The mirror's open refuses them; the offline resize takes them
        // (every leg closed cleanly) and gives both the new size.
        let again = Recording::new(fs);
        for leg in LEGS {
            resize::resize_mirror_leg(&again, Path::new(leg), step.to * BLOCK_U64)
                .map_err(|e| format!("{leg}: the offline resize again: {e}"))?;
        }
        let fs = again.fs.lock().clone();
        fs
    } else {
        fs
    };
    let blocks = if apart { step.to } else { sizes[0] };
    let mut reads = Vec::new();
    for leg in LEGS {
        let out = scratch.join(&leg[1..]);
        let _ = std::fs::remove_dir_all(&out);
        write_out_of(&fs, Path::new(leg), &out)?;
        let read = read_leg(&out, blocks).map_err(|e| format!("{leg}: {e}"))?;
        reads_as(&read, &step.image).map_err(|e| format!("{leg}: {e}"))?;
        reads.push(read);
    }
    if reads[0] != reads[1] {
        return Err("the legs hold different blocks".into());
    }
    Ok(())
}
