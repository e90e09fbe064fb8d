//! The offline commands: create, info, check, import, export.

use std::fs::{File, OpenOptions as FsOpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::ExitCode;
use vouch_engine::DeviceWrites;

use anyhow::{bail, Context as _, Result};
use serde_json::json;
use vouch_engine::jobs::{scan, JobControl, ScanOptions};
use vouch_engine::scrub::ScrubRecord;
use vouch_engine::BlockDevice;
use vouch_engine::{create_volume, Fault, FaultKind, OpenOptions, Volume, BLOCK};

use crate::create::{create_options, CreateArgs};
use crate::key::{open_read_only, Use};
use crate::progress::progress_bar;

/// Blocks moved per I/O by import and export (1 MiB).
const COPY_CHUNK_BLOCKS: u64 = 256;

pub fn create(path: &Path, size: u64, args: &CreateArgs) -> Result<ExitCode> {
    let volume = create_volume(path, &create_options(size, args)?)?;
    let summary = format!(
        "created {} ({} bytes, layout {}, {})",
        path.display(),
        volume.size(),
        volume.layout().name(),
        if volume.encrypted() {
            "encrypted: AES-256-GCM-SIV".to_string()
        } else {
            format!("guard {}", volume.guard().name())
        }
    );
    volume.close()?;
    println!("{summary}");
    Ok(ExitCode::SUCCESS)
}

/// Shown for a volume another process holds for writing.
const IN_USE_STATE: &str = "in use: another vouch process (a running `vouch serve`) holds it for writing; shown from its superblock and files without opening it (live state: the server's --metrics, or `vouch verify|scrub --server`)";

pub fn info(path: &Path, json_output: bool) -> Result<ExitCode> {
    // A held volume cannot be opened, even read-only (its journal is being
    // written); its superblock and files can be read, which is all `info`
    // needs but the count of journal records a recovery would replay.
    let in_use = vouch_engine::volume_in_use(path)?;
    let region_volume = if !in_use && crate::migrate::has_regions(path) {
        Some(crate::migrate::open_read_only(path, Use::Info)?)
    } else {
        None
    };
    let (info, records_pending) = if in_use {
        (vouch_engine::peek_volume(path)?, None)
    } else if let Some(volume) = &region_volume {
        let pending = volume.home().recovery_report().records_replayed;
        (volume.home().info()?, Some(pending))
    } else {
        let volume = open_read_only(path, Use::Info)?;
        let pending = volume.recovery_report().records_replayed;
        (volume.info()?, Some(pending))
    };
    // The region record: the open volume's, or for a served one (mid
    // online migration, say) the newest copy on disk.
    let record = match &region_volume {
        Some(volume) => Some(volume.record()),
        None if in_use && crate::migrate::has_regions(path) => {
            let superblock = vouch_engine::volume_superblock(path)?;
            Some(vouch_engine::regions::read_record(path, &superblock)?)
        }
        None => None,
    };
    // An unreadable scrub record is shown as such, not a failed `info`: the
    // record is advisory (docs/FORMAT.md).
    let scrub = vouch_engine::scrub::last_scrub(path);
    let snapshots = vouch_engine::snapshot::list(&vouch_engine::snapshot::RealFs::default(), path)?;
    if json_output {
        let value = json!({
            "path": path.display().to_string(),
            "uuid": info.uuid,
            "size_bytes": info.size_bytes,
            "blocks": info.blocks,
            "block_size": info.block_size,
            "layout": info.layout.name(),
            "regions": record.as_ref().map(crate::migrate::regions_json),
            "guard": info.guard.name(),
            "features": {
                "compat": info.features.compat,
                "ro_compat": info.features.ro_compat,
                "incompat": info.features.incompat,
            },
            "segments": info.segments,
            "segment_blocks": info.segment_blocks,
            "journal_bytes": info.journal_bytes,
            "checkpoint_seq": info.checkpoint_seq,
            "in_use": in_use,
            "clean": (!in_use).then_some(info.clean),
            "journal_records_pending": records_pending,
            "read_only": info.read_only,
            "allocated_bytes": info.allocated_bytes,
            "encrypted": info.encrypted,
            "key": info.key_kind,
            "last_scrub": scrub_json(&scrub),
            "snapshots": snapshots
                .iter()
                .map(|entry| match entry {
                    Ok(snap) => json!({ "name": snap.record.name, "record": snap.record }),
                    Err(error) => json!({ "error": error.to_string() }),
                })
                .collect::<Vec<_>>(),
            "mirror": if vouch_mirror::is_mirrored(path) {
                crate::mirror::info_json(path)?
            } else {
                serde_json::Value::Null
            },
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!("path:            {}", path.display());
        println!("uuid:            {}", info.uuid);
        println!(
            "size:            {} bytes ({})",
            info.size_bytes,
            bytesize::ByteSize(info.size_bytes)
        );
        println!(
            "blocks:          {} x {} bytes",
            info.blocks, info.block_size
        );
        println!("layout:          {}", info.layout.name());
        if let Some(record) = &record {
            println!("regions:         {}", crate::migrate::regions_line(record));
        }
        if let Some(key) = info.key_kind {
            println!(
                "encryption:      AES-256-GCM-SIV per block (key: {key}); keyless guard crc32c"
            );
        } else {
            println!("guard:           {}", info.guard.name());
        }
        println!(
            "features:        compat {:#x}, ro_compat {:#x}, incompat {:#x}",
            info.features.compat, info.features.ro_compat, info.features.incompat
        );
        println!(
            "segments:        {} of {} blocks",
            info.segments, info.segment_blocks
        );
        println!(
            "journal:         {} bytes, checkpoint seq {}",
            info.journal_bytes, info.checkpoint_seq
        );
        println!(
            "state:           {}",
            if in_use {
                IN_USE_STATE
            } else if info.clean {
                "clean"
            } else {
                "not closed cleanly (recovers from its journal when opened)"
            }
        );
        if info.features.ro_compat & vouch_format::FeatureFlags::RO_COMPAT_SNAPSHOT != 0 {
            println!(
                "writable:        no: a snapshot (`vouch clone` makes a writable volume of it)"
            );
        } else if info.read_only {
            println!(
                "writable:        no: ro_compat features {:#x} are unknown to this vouch, which only reads it",
                info.features.unknown_ro_compat()
            );
        }
        println!(
            "allocated:       {} bytes ({})",
            info.allocated_bytes,
            bytesize::ByteSize(info.allocated_bytes)
        );
        println!("last scrub:      {}", scrub_text(&scrub));
        for line in snapshot_lines(&snapshots) {
            println!("{line}");
        }
        if vouch_mirror::is_mirrored(path) {
            crate::mirror::print_info(path)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `info`'s lines for the volume's snapshots (none: no line).
fn snapshot_lines(
    snapshots: &[vouch_engine::Result<vouch_engine::snapshot::Snapshot>],
) -> Vec<String> {
    snapshots
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            let label = if i == 0 { "snapshots:" } else { "" };
            match entry {
                Ok(snap) => format!(
                    "{label:<17}{} (checkpoint seq {}, {})",
                    snap.record.name,
                    snap.record.checkpoint_seq,
                    snap.path.display()
                ),
                Err(error) => format!("{label:<17}unreadable: {error}"),
            }
        })
        .collect()
}

/// Faults of the last scrub listed by `vouch info` (all are in scrub.json).
const INFO_FAULTS_SHOWN: usize = 8;

/// The last scrub for `info --json`: `null` if none ran.
fn scrub_json(scrub: &vouch_engine::Result<Option<ScrubRecord>>) -> serde_json::Value {
    match scrub {
        Ok(None) => serde_json::Value::Null,
        Err(error) => json!({ "error": error.to_string() }),
        Ok(Some(record)) => json!({
            "state": record.state.name(),
            "started_unix": record.started_unix,
            "finished_unix": record.finished_unix,
            "cursor": record.cursor,
            "blocks_total": record.blocks_total,
            "blocks_checked": record.blocks_checked,
            "faults_found": record.faults_found,
            "first_faults": record
                .faults
                .iter()
                .take(INFO_FAULTS_SHOWN)
                .map(|fault| json!({ "lba": fault.lba, "kind": fault.kind.name() }))
                .collect::<Vec<_>>(),
            "error": record.error,
        }),
    }
}

/// `unix` seconds as `YYYY-MM-DD HH:MM:SS UTC` (days to a civil date:
/// H. Hinnant's algorithm, proleptic Gregorian).
fn utc_time(unix: u64) -> String {
    let days = (unix / 86400) as i64;
    let seconds = unix % 86400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60
    )
}

/// The last scrub for `info`, on one line or a few.
fn scrub_text(scrub: &vouch_engine::Result<Option<ScrubRecord>>) -> String {
    let record = match scrub {
        Ok(None) => return "never".to_string(),
        Err(error) => return format!("unknown ({error})"),
        Ok(Some(record)) => record,
    };
    let when = utc_time;
    let mut text = format!(
        "{}, started {}{}, {} of {} blocks scanned ({} read and verified, holes skipped), {} fault(s)",
        record.state.name(),
        when(record.started_unix),
        record
            .finished_unix
            .map(|unix| format!(", ended {}", when(unix)))
            .unwrap_or_default(),
        record.cursor,
        record.blocks_total,
        record.blocks_checked,
        record.faults_found,
    );
    if !record.faults.is_empty() {
        let shown: Vec<String> = record
            .faults
            .iter()
            .take(INFO_FAULTS_SHOWN)
            .map(|fault| format!("{} ({})", fault.lba, fault.kind.name()))
            .collect();
        let more = if record.faults_found > shown.len() as u64 {
            ", ..."
        } else {
            ""
        };
        text.push_str(&format!(
            "\n                 faulty LBAs: {}{more}",
            shown.join(", ")
        ));
    }
    if let Some(error) = &record.error {
        text.push_str(&format!("\n                 error: {error}"));
    }
    text
}

pub fn check(path: &Path, json_output: bool) -> Result<ExitCode> {
    // A mirror's snapshot: each leg's copy, in leg order (with --json,
    // the copy given: one report).
    if let Some(copies) = crate::snapshot_mirror::copies(path).filter(|_| !json_output) {
        let mut code = ExitCode::SUCCESS;
        for (leg, copy) in copies {
            let clean = match copy {
                crate::snapshot_mirror::CheckedCopy::Local(copy) => {
                    println!("leg {leg}'s copy {}:", copy.display());
                    check_one(&copy, json_output)? == ExitCode::SUCCESS
                }
                crate::snapshot_mirror::CheckedCopy::Remote { url, name } => {
                    crate::snapshot_remote::check_copy(leg, &url, &name)
                }
            };
            if !clean {
                code = ExitCode::from(1);
            }
        }
        return Ok(code);
    }
    check_one(path, json_output)
}

fn check_one(path: &Path, json_output: bool) -> Result<ExitCode> {
    if vouch_mirror::is_mirrored(path) {
        return crate::mirror::check(path, json_output);
    }
    if crate::migrate::has_regions(path) {
        return crate::migrate::check(path, json_output);
    }
    let volume = open_read_only(path, Use::Verify)?;
    let features = volume.info()?.features;
    if features.incompat & vouch_format::FeatureFlags::INCOMPAT_WRITTEN_MAP == 0 {
        // Without the map a lost context page reads as never written.
        eprintln!(
            "note: {} was made before the written map: lost metadata is not detected in it; `vouch upgrade {}` builds the map",
            path.display(),
            path.display()
        );
    } else if features.incompat & vouch_format::FeatureFlags::INCOMPAT_BOUND_UNITS == 0 {
        // Without whole units a blank slot of a written unit reads as
        // never written.
        eprintln!(
            "note: {} was made before whole metadata units: a context page or packed row cut or zeroed in part, or copied from another place, is not always detected in it; `vouch upgrade {}` makes its units whole",
            path.display(),
            path.display()
        );
    }
    let bar = progress_bar(volume.size(), "checking");
    let report = volume.check(|done, _| bar.set_position(done * BLOCK))?;
    bar.finish_and_clear();
    if json_output {
        let faults: Vec<_> = report
            .faults
            .iter()
            .map(|f| json!({"lba": f.lba, "kind": f.kind.name()}))
            .collect();
        let value = json!({
            "path": path.display().to_string(),
            "damage": describe_faults(&volume, &report.faults, |fault| {
                format!("fault: LBA {} {}", fault.lba, fault.kind.name())
            }),
            "blocks_checked": report.blocks_checked,
            "faults": faults,
            "clean": report.faults.is_empty(),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        for line in describe_faults(&volume, &report.faults, |fault| {
            format!("fault: LBA {} {}", fault.lba, fault.kind.name())
        }) {
            println!("{line}");
        }
        println!(
            "{}: {} blocks checked, {} faults",
            path.display(),
            report.blocks_checked,
            report.faults.len()
        );
    }
    Ok(if report.faults.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub fn import(raw: &Path, path: &Path, args: &CreateArgs) -> Result<ExitCode> {
    let source = File::open(raw).with_context(|| format!("cannot open {}", raw.display()))?;
    let raw_len = source.metadata()?.len();
    if raw_len == 0 {
        bail!("{} is empty: nothing to import", raw.display());
    }
    let size = raw_len.div_ceil(BLOCK) * BLOCK;
    let volume = create_volume(path, &create_options(size, args)?)?;
    let bar = progress_bar(raw_len, "importing");
    let mut chunk = vec![0u8; (COPY_CHUNK_BLOCKS * BLOCK) as usize];
    let mut offset = 0u64;
    let result: Result<()> = (|| {
        while offset < raw_len {
            let n = ((raw_len - offset) as usize).min(chunk.len());
            let want = (n as u64).div_ceil(BLOCK) * BLOCK;
            let buf = &mut chunk[..want as usize];
            buf.fill(0);
            source
                .read_exact_at(&mut buf[..n], offset)
                .with_context(|| format!("reading {}", raw.display()))?;
            // A fresh volume reads zeros everywhere: skip zero chunks (sparse).
            if buf.iter().any(|b| *b != 0) {
                volume.write(offset, buf, false)?;
            }
            offset += n as u64;
            bar.set_position(offset);
        }
        volume.flush()?;
        Ok(())
    })();
    bar.finish_and_clear();
    if let Err(error) = result {
        drop(volume);
        let _ = std::fs::remove_dir_all(path);
        return Err(error.context(format!("import into {} failed; removed it", path.display())));
    }
    volume.close()?;
    println!(
        "imported {} ({raw_len} bytes) into {}",
        raw.display(),
        path.display()
    );
    Ok(ExitCode::SUCCESS)
}

pub fn export(path: &Path, raw: &Path, allow_faults: bool) -> Result<ExitCode> {
    // A volume whose layout is chosen per region is read through its
    // region record (`migrate.rs`); any other as one volume.
    let volume = if crate::migrate::has_regions(path) {
        None
    } else {
        Some(open_read_only(path, Use::Data)?)
    };
    let output = FsOpenOptions::new()
        .write(true)
        .create_new(true)
        .open(raw)
        .with_context(|| format!("cannot create {} (it must not exist)", raw.display()))?;
    let result = match &volume {
        Some(volume) => {
            export_into(volume, &output, allow_faults).map(|faults| (volume.size(), faults))
        }
        None => crate::migrate::export(path, &output, allow_faults),
    };
    match result {
        Ok((size, faults)) => {
            output.sync_all()?;
            let name = |fault: &Fault| format!("LBA {} {}", fault.lba, fault.kind.name());
            let lines = match &volume {
                Some(volume) => describe_faults(volume, &faults, name),
                None => faults.iter().map(name).collect(),
            };
            for line in lines {
                eprintln!("zero-filled: {line}");
            }
            println!(
                "exported {} to {} ({size} bytes, {} faulty blocks zero-filled)",
                path.display(),
                raw.display(),
                faults.len()
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => {
            drop(output);
            let _ = std::fs::remove_file(raw);
            Err(error)
        }
    }
}

fn export_into(volume: &Volume, output: &File, allow_faults: bool) -> Result<Vec<Fault>> {
    let size = volume.size();
    output.set_len(size)?;
    let bar = progress_bar(size, "exporting");
    let mut faults = Vec::new();
    let control = JobControl::default();
    scan(volume, ScanOptions::default(), &control, None, |chunk| {
        faults.extend_from_slice(chunk.faults);
        if chunk.data.iter().any(|b| *b != 0) {
            output
                .write_all_at(chunk.data, chunk.lba * BLOCK)
                .map_err(|error| vouch_engine::Error::Path {
                    action: "write",
                    path: "the raw image".into(),
                    cause: error.to_string(),
                })?;
        }
        bar.set_position((chunk.lba + chunk.count) * BLOCK);
        Ok(())
    })?;
    bar.finish_and_clear();
    if !faults.is_empty() && !allow_faults {
        let list = describe_faults(volume, &faults, |fault| {
            format!("LBA {} ({})", fault.lba, fault.kind.name())
        });
        bail!(
            "{} block(s) failed verification: {}; nothing exported (use --allow-faults to zero-fill them)",
            faults.len(),
            list.join(", ")
        );
    }
    Ok(faults)
}

/// What a scan's faults say, one line per cause: a file cut short once
/// (its faults are counted there, not listed), a unit whose metadata is
/// lost once ("contexts: page 40 is zeroed: LBAs 5120-5247 have no
/// protection information"), a unit copied in from another place or
/// volume once ("... belongs to another place ..."), any other fault as
/// `other` words it.
pub fn describe_faults(
    volume: &Volume,
    faults: &[Fault],
    other: impl Fn(&Fault) -> String,
) -> Vec<String> {
    let short = volume.short_objects();
    let mut lines: Vec<String> = short
        .iter()
        .map(|object| {
            let inside = faults
                .iter()
                .filter(|fault| object.lbas.contains(&fault.lba))
                .count();
            format!("{object} ({inside} faults)")
        })
        .collect();
    let mut unit_done: Option<std::ops::Range<u64>> = None;
    for fault in faults {
        if short.iter().any(|object| object.lbas.contains(&fault.lba)) {
            continue;
        }
        if unit_done
            .as_ref()
            .is_some_and(|unit| unit.contains(&fault.lba))
        {
            continue;
        }
        if fault.kind == FaultKind::MetadataLost {
            unit_done = Some(volume.metadata_unit(fault.lba));
            lines.push(volume.metadata_cause(fault.lba));
            continue;
        }
        let misplaced = matches!(
            fault.kind,
            FaultKind::RefTagMismatch | FaultKind::VolumeTagMismatch | FaultKind::AuthFailed
        );
        if let Some(cause) = misplaced
            .then(|| volume.misplaced_cause(fault.lba))
            .flatten()
        {
            unit_done = Some(volume.metadata_unit(fault.lba));
            lines.push(cause);
            continue;
        }
        lines.push(other(fault));
    }
    lines
}

/// `vouch upgrade`: build the written map from the metadata on disk, fill
/// in the expected generation of every written unit whose value is not
/// known, and make every written unit whole (vacant markers in its blank
/// slots), so a volume made before any of them becomes writable and its
/// older copies are caught, or a lost map is made again.
pub fn upgrade(path: &Path) -> Result<ExitCode> {
    let options = OpenOptions {
        rebuild_written_map: true,
        ..OpenOptions::default()
    };
    let volume = crate::key::open(path, options, Use::Data)?;
    volume.close()?;
    println!(
        "{}: written map built from its metadata, expected generations filled in, every written unit whole; the volume is writable",
        path.display()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_time_formats_civil_dates() {
        assert_eq!(super::utc_time(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(super::utc_time(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(super::utc_time(1_700_000_000), "2023-11-14 22:13:20 UTC");
        assert_eq!(super::utc_time(4_102_444_799), "2099-12-31 23:59:59 UTC");
    }
}
