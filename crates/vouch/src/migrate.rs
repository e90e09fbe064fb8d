//! `vouch migrate` and what `info`, `check` and `export` do with a volume
//! whose layout is chosen per region (`vouch_engine::regions`).

use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use hyper::Method;

use anyhow::{bail, Context as _, Result};
use vouch_engine::regions::{self, MigrateBreaks, RegionVolume};
use vouch_engine::{Fault, OpenOptions, BLOCK};
use vouch_format::regions::RegionRecord;
use vouch_format::LayoutKind;

use crate::key::Use;
use crate::offload::client::{Client, ServerArgs};
use crate::progress::progress_bar;
use vouch_mirror::migrate::{self, LegStage};

/// Blocks read per step of `export` and `check`.
const CHUNK_BLOCKS: u64 = 256;

/// `vouch migrate`: offline on PATH, or online with --server.
pub fn run_cli(
    server: &ServerArgs,
    path: Option<PathBuf>,
    layout: Option<String>,
    rate: Option<u64>,
    stop: bool,
) -> Result<ExitCode> {
    if server.server.is_some() {
        return run_online(server, path, layout, rate, stop);
    }
    let path = path.context("give the volume's directory")?;
    run(&path, &layout.context("give --layout")?)
}

/// `vouch migrate --server ADDR [EXPORT] --layout L [--rate R]`: start the
/// export's online migration and follow it with the bar to its end
/// (`--stop`: stop it).
fn run_online(
    server: &ServerArgs,
    export: Option<PathBuf>,
    layout: Option<String>,
    rate: Option<u64>,
    stop: bool,
) -> Result<ExitCode> {
    let client = Client::new(server)?;
    let export = match export {
        Some(export) => export.to_string_lossy().into_owned(),
        None => {
            let exports = client.call(Method::GET, "/v1/exports", None)?;
            let names: Vec<String> = exports["exports"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|export| export["name"].as_str().map(str::to_string))
                .collect();
            match names.as_slice() {
                [only] => only.clone(),
                _ => bail!(
                    "the server has {} exports ({}): name one",
                    names.len(),
                    names.join(", ")
                ),
            }
        }
    };
    let route = format!("/v1/exports/{export}/migrate");
    if stop {
        let status = client.call(Method::DELETE, &route, None)?;
        println!(
            "{export}: stopping the migration ({})",
            status["state"].as_str().unwrap_or("?")
        );
        return Ok(ExitCode::SUCCESS);
    }
    let layout = layout.context("give --layout")?;
    let mut request = serde_json::json!({ "layout": layout });
    if let Some(rate) = rate {
        request["rate"] = rate.into();
    }
    client.call(Method::POST, &route, Some(&request))?;
    let bar = progress_bar(0, &format!("migrating {export} to {layout}"));
    let status = loop {
        let status = client.call(Method::GET, &route, None)?;
        bar.set_length(status["total_bytes"].as_u64().unwrap_or(0));
        bar.set_position(status["done_bytes"].as_u64().unwrap_or(0));
        if status["state"] != "running" {
            break status;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    bar.finish_and_clear();
    match status["state"].as_str() {
        Some("done") => {
            println!(
                "{export}: {} regions moved to {layout} online ({:.1} MB/s); regions: {} split, {} packed",
                status["regions_moved"],
                status["mb_per_second"].as_f64().unwrap_or(0.0),
                status["regions"]["split"],
                status["regions"]["packed"],
            );
            Ok(ExitCode::SUCCESS)
        }
        _ => bail!(
            "{export}: the migration {}: {}",
            status["state"].as_str().unwrap_or("ended"),
            status["error"].as_str().unwrap_or("no reason given")
        ),
    }
}

pub fn run(path: &Path, layout: &str) -> Result<ExitCode> {
    let target = LayoutKind::from_name(layout).context("unknown layout")?;
    crate::key::volume_dir(path)?;
    if vouch_mirror::is_mirrored(path) {
        return run_mirror(path, target);
    }
    let options = crate::key::open_options(path, OpenOptions::default(), Use::Data)?;
    let bar = progress_bar(0, &format!("migrating to {}", target.name()));
    let report = regions::migrate(
        path,
        target,
        &options,
        &MigrateBreaks::default(),
        |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        },
    );
    bar.finish_and_clear();
    if report.is_err() && has_regions(path) {
        eprintln!("{}", not_served_note(path));
    }
    let report = report?;
    println!(
        "{}: {} regions moved to {}, {} were in it already{}",
        path.display(),
        report.moved,
        target.name(),
        report.already,
        if report.released > 0 {
            format!(", {} left by an interrupted run released", report.released)
        } else {
            String::new()
        }
    );
    if has_regions(path) {
        println!("{}", not_served_note(path));
    }
    Ok(ExitCode::SUCCESS)
}

/// For tests (`tests/migrate_mirror.rs`): `LEG:STAGE` (leg index;
/// `before`, `after` the exchange); a mirror's migration aborts the
/// process there, as a crash would.
const CRASH_AT: &str = "VOUCH_TEST_MIGRATE_MIRROR_CRASH_AT";

/// `vouch migrate LEG --layout L` of a mirror: each leg rebuilt in `target`
/// in turn (`vouch_mirror::migrate`), the others whole meanwhile.
fn run_mirror(path: &Path, target: LayoutKind) -> Result<ExitCode> {
    let options = crate::key::open_options(path, OpenOptions::default(), Use::Data)?;
    let crash_at = std::env::var(CRASH_AT).ok();
    let bar = progress_bar(0, &format!("migrating the mirror to {}", target.name()));
    let report = migrate::migrate_mirror(
        path,
        target,
        migrate::MigrateHooks {
            open_leg: &mut |leg| {
                crate::key::open(leg, options.clone(), Use::Data)
                    .map_err(|error| vouch_engine::Error::InvalidArgument(format!("{error:#}")))
            },
            progress: &mut |done, total| {
                bar.set_length(total);
                bar.set_position(done);
            },
            at: &mut |leg, stage| {
                let here = match stage {
                    LegStage::BeforeExchange => format!("{leg}:before"),
                    LegStage::AfterExchange => format!("{leg}:after"),
                    LegStage::Done => return,
                };
                if crash_at.as_deref() == Some(here.as_str()) {
                    std::process::abort();
                }
            },
        },
    );
    bar.finish_and_clear();
    let report = report?;
    for leftover in &report.leftovers {
        eprintln!(
            "vouch: removed {}, left by a migration cut short",
            leftover.display()
        );
    }
    for leg in &report.legs {
        match leg.from {
            None => println!(
                "leg {} ({}): in {} already",
                leg.index,
                leg.path.display(),
                target.name()
            ),
            Some(from) => {
                println!(
                    "leg {} ({}): {} -> {}, {} blocks copied and verified{}",
                    leg.index,
                    leg.path.display(),
                    from.name(),
                    target.name(),
                    leg.copied,
                    if leg.repaired.is_empty() {
                        String::new()
                    } else {
                        format!(
                            ", {} taken from another leg (failed on this one: LBAs {})",
                            leg.repaired.len(),
                            leg.repaired
                                .iter()
                                .map(u64::to_string)
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    }
                );
            }
        }
    }
    println!(
        "{}: every leg of the mirror is {} now",
        path.display(),
        target.name()
    );
    Ok(ExitCode::SUCCESS)
}

/// What `migrate` says after a run that leaves a volume with regions.
fn not_served_note(path: &Path) -> String {
    let home = vouch_engine::volume_superblock(path)
        .map(|superblock| superblock.layout.name())
        .unwrap_or("home");
    format!(
        "note: {path} is now a volume with regions: it can be served, read, checked, verified, scrubbed, exported, snapshotted (offline), resized (offline, and online through `vouch resize --server`) and migrated, but not mirrored (`vouch migrate` of a mirror rebuilds each leg whole in the layout instead) or rekeyed yet; `vouch migrate {path} --layout {home}` makes it a one-layout volume again",
        path = path.display()
    )
}

/// Is the volume at `path` one whose layout is chosen per region? A path
/// whose superblock cannot be read is not: the command's own open says why.
pub fn has_regions(path: &Path) -> bool {
    vouch_engine::volume_superblock(path).is_ok_and(|superblock| regions::has_regions(&superblock))
}

/// Open a REGIONS volume read-only with its key.
pub fn open_read_only(path: &Path, purpose: Use) -> Result<RegionVolume> {
    let options = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let options = crate::key::open_options(path, options, purpose)?;
    Ok(RegionVolume::open(path, &options)?)
}

/// `info`'s line about the regions: how many each layout serves.
pub fn regions_line(record: &RegionRecord) -> String {
    let [split, packed] = record.counts();
    format!(
        "{} of 62 MiB: {split} split, {packed} packed (record seq {})",
        split + packed,
        record.seq
    )
}

/// `info --json`'s regions.
pub fn regions_json(record: &RegionRecord) -> serde_json::Value {
    let [split, packed] = record.counts();
    serde_json::json!({
        "region_blocks": record.region_blocks,
        "split": split,
        "packed": packed,
        "seq": record.seq,
        "layouts": record.layouts.iter().map(|layout| layout.name()).collect::<Vec<_>>(),
    })
}

/// Every block read and verified by the member serving it; faulty blocks
/// zero-filled and returned. `each(lba, bytes)` sees every chunk.
pub fn scan(
    volume: &RegionVolume,
    what: &str,
    mut each: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<Vec<Fault>> {
    let bar = progress_bar(volume.size(), what);
    let mut faults = Vec::new();
    let mut buf = vec![0u8; (CHUNK_BLOCKS * BLOCK) as usize];
    let mut lba = 0;
    while lba < volume.blocks() {
        let count = CHUNK_BLOCKS.min(volume.blocks() - lba);
        let part = &mut buf[..(count * BLOCK) as usize];
        faults.extend(volume.read_blocks_collecting(lba, count, part)?);
        each(lba, part)?;
        lba += count;
        bar.set_position(lba * BLOCK);
    }
    bar.finish_and_clear();
    Ok(faults)
}

pub fn check(path: &Path, json_output: bool) -> Result<ExitCode> {
    let volume = open_read_only(path, Use::Verify)?;
    let faults = scan(&volume, "checking", |_, _| Ok(()))?;
    let blocks = volume.blocks();
    if json_output {
        let value = serde_json::json!({
            "path": path.display().to_string(),
            "blocks_checked": blocks,
            "faults": faults.iter().map(|f| serde_json::json!({"lba": f.lba, "kind": f.kind.name()})).collect::<Vec<_>>(),
            "clean": faults.is_empty(),
            "regions": regions_json(&volume.record()),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        for fault in &faults {
            println!("fault: LBA {} {}", fault.lba, fault.kind.name());
        }
        println!(
            "{}: {blocks} blocks checked, {} faults (regions: {})",
            path.display(),
            faults.len(),
            regions_line(&volume.record())
        );
    }
    volume.close()?;
    Ok(if faults.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub fn export(path: &Path, output: &File, allow_faults: bool) -> Result<(u64, Vec<Fault>)> {
    let volume = open_read_only(path, Use::Data)?;
    let size = volume.size();
    output.set_len(size)?;
    let faults = scan(&volume, "exporting", |lba, bytes| {
        if bytes.iter().any(|b| *b != 0) {
            output
                .write_all_at(bytes, lba * BLOCK)
                .context("writing the raw image")?;
        }
        Ok(())
    })?;
    volume.close()?;
    if !faults.is_empty() && !allow_faults {
        let list: Vec<String> = faults
            .iter()
            .map(|fault| format!("LBA {} ({})", fault.lba, fault.kind.name()))
            .collect();
        bail!(
            "{} block(s) failed verification: {}; nothing exported (use --allow-faults to zero-fill them)",
            faults.len(),
            list.join(", ")
        );
    }
    Ok((size, faults))
}
