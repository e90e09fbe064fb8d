//! `vouch bench --scale`: memory and crash-recovery time, 1 GiB vs 1 TiB.

use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;
use vouch_engine::DeviceWrites;

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use vouch_engine::BlockDevice;
use vouch_engine::{create_volume, open_volume, CreateOptions, GuardKind, LayoutKind, OpenOptions};

use super::load::Rng;
use super::{BenchArgs, BLOCK};

pub(super) fn scale(
    args: &BenchArgs,
    dir: &Path,
    command_line: &str,
    machine: Value,
) -> Result<ExitCode> {
    let exe = std::env::current_exe().context("cannot find the vouch binary")?;
    let mut results = Vec::new();
    for layout in &args.scale_layouts {
        LayoutKind::from_name(layout).with_context(|| format!("unknown layout '{layout}'"))?;
        for &size in &args.scale_sizes {
            let path = dir.join(format!("scale-{layout}-{size}"));
            let mut phases =
                json!({"layout": layout, "size_bytes": size, "writes": args.scale_writes});
            for phase in ["write", "open"] {
                let output = Command::new(&exe)
                    .args(["bench", "--scale-child", phase, "--child-path"])
                    .arg(&path)
                    .args(["--child-size", &size.to_string(), "--child-layout", layout])
                    .args(["--scale-writes", &args.scale_writes.to_string()])
                    .stdin(Stdio::null())
                    .stderr(Stdio::inherit())
                    .output()
                    .context("cannot run the scale child")?;
                let stdout = String::from_utf8_lossy(&output.stdout);
                let line = stdout
                    .lines()
                    .find_map(|line| line.strip_prefix("SCALE_RESULT "))
                    .with_context(|| format!("scale child ({phase}) failed: {}", output.status))?;
                phases[phase] = serde_json::from_str(line)?;
            }
            let _ = std::fs::remove_dir_all(&path);
            eprintln!(
                "  scale {layout} {}: done",
                bytesize::ByteSize(size).display().iec()
            );
            results.push(phases);
        }
    }
    print_scale(args, &results);
    if let Some(json_path) = &args.json {
        let value = json!({
            "command": command_line, "mode": "scale", "machine": machine, "results": results,
        });
        std::fs::write(json_path, serde_json::to_string_pretty(&value)? + "\n")
            .with_context(|| format!("cannot write {}", json_path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) fn print_scale(args: &BenchArgs, results: &[Value]) {
    let mib = |v: &Value| {
        v.as_f64()
            .map_or("-".to_string(), |b| format!("{:.1}", b / 1048576.0))
    };
    let ms = |v: &Value| {
        v.as_f64()
            .map_or("-".to_string(), |s| format!("{:.1}", s * 1000.0))
    };
    println!(
        "{} random 4 KiB writes per volume: a flush after half, then the rest with no flush and no close\n\
         (commits every 4096 buffered blocks keep journaling); the writer process then exits without close().\n",
        args.scale_writes
    );
    println!("| layout | size | records replayed | blocks verified | blocks reverted | open (ms) | recovery (ms) | resident after open (MiB) | RSS before / after open (MiB) | resident after {} reads (MiB) | RSS after reads / peak (MiB) | writer RSS / peak (MiB) |", args.scale_writes);
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for result in results {
        let open = &result["open"];
        let write = &result["write"];
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} / {} | {} / {} |",
            result["layout"].as_str().unwrap_or("?"),
            bytesize::ByteSize(result["size_bytes"].as_u64().unwrap_or(0))
                .display()
                .iec(),
            open["records_replayed"],
            open["blocks_verified"],
            open["blocks_reverted"],
            ms(&open["open_secs"]),
            ms(&open["recovery_secs"]),
            mib(&open["resident_after_open"]),
            mib(&open["rss_before_open"]),
            mib(&open["rss_after_open"]),
            mib(&open["resident_after_reads"]),
            mib(&open["rss_after_reads"]),
            mib(&open["rss_peak"]),
            mib(&write["rss_before_crash"]),
            mib(&write["rss_peak"]),
        );
    }
    println!();
    println!("open = wall time of open_volume;");
    println!("recovery = recovery_report().duration. resident = Volume::resident_bytes() (buffers + context cache);");
    println!("RSS = VmRSS of the child process doing that phase alone, peak = VmHWM.");
}

pub(super) fn status_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find_map(|line| line.strip_prefix(field))?;
    let kib: u64 = line.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

pub(super) fn scale_child(phase: &str, args: &BenchArgs) -> Result<ExitCode> {
    let path = args.child_path.clone().context("--child-path")?;
    let size = args.child_size.context("--child-size")?;
    let layout = args.child_layout.as_deref().context("--child-layout")?;
    let layout = LayoutKind::from_name(layout).context("layout")?;
    let writes = args.scale_writes;
    let blocks = size / BLOCK as u64;
    let mut rng = Rng::new(size ^ 0x5ca1e);
    let mut buf = vec![0u8; BLOCK];
    rng.fill(&mut buf);
    let result = match phase {
        "write" => {
            let mut options = CreateOptions::new(size);
            options.layout = layout;
            options.guard = GuardKind::Crc32c;
            let start = Instant::now();
            let volume = create_volume(&path, &options)?;
            let create_secs = start.elapsed().as_secs_f64();
            let start = Instant::now();
            for index in 0..writes {
                if index == writes / 2 {
                    volume.flush()?;
                }
                buf[..8].copy_from_slice(&index.to_le_bytes());
                volume.write(rng.below(blocks) * BLOCK as u64, &buf, false)?;
            }
            let write_secs = start.elapsed().as_secs_f64();
            let stats = volume.stats().snapshot();
            let value = json!({
                "create_secs": create_secs,
                "write_secs": write_secs,
                "commits": stats.commits,
                "checkpoints": stats.checkpoints,
                "journal_bytes_written": stats.journal_bytes_written,
                "resident_before_crash": volume.resident_bytes(),
                "rss_before_crash": status_bytes("VmRSS:"),
                "rss_peak": status_bytes("VmHWM:"),
            });
            // The crash: no close, no flush of the last buffered writes.
            std::mem::forget(volume);
            value
        }
        "open" => {
            let rss_before_open = status_bytes("VmRSS:");
            let start = Instant::now();
            let volume = open_volume(&path, &OpenOptions::default())?;
            let open_secs = start.elapsed().as_secs_f64();
            let report = volume.recovery_report().clone();
            let resident_after_open = volume.resident_bytes();
            let rss_after_open = status_bytes("VmRSS:");
            let start = Instant::now();
            for _ in 0..writes {
                volume.read(rng.below(blocks) * BLOCK as u64, &mut buf)?;
            }
            let read_secs = start.elapsed().as_secs_f64();
            let value = json!({
                "was_clean": report.was_clean,
                "records_replayed": report.records_replayed,
                "blocks_verified": report.blocks_verified,
                "blocks_reverted": report.blocks_reverted,
                "blocks_torn": report.blocks_torn.len(),
                "recovery_secs": report.duration.as_secs_f64(),
                "open_secs": open_secs,
                "rss_before_open": rss_before_open,
                "resident_after_open": resident_after_open,
                "rss_after_open": rss_after_open,
                "read_secs": read_secs,
                "resident_after_reads": volume.resident_bytes(),
                "rss_after_reads": status_bytes("VmRSS:"),
                "rss_peak": status_bytes("VmHWM:"),
            });
            volume.close()?;
            value
        }
        other => bail!("unknown scale phase '{other}'"),
    };
    println!("SCALE_RESULT {result}");
    Ok(ExitCode::SUCCESS)
}
