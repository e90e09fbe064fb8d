//! Machine facts and housekeeping: the private work directory, the command
//! line and the machine description printed (and saved) with every run.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use serde_json::{json, Value};

use super::accounting::device_stat_path;

/// A private directory under the chosen base, removed on drop.
pub(super) struct WorkDir {
    pub(super) path: PathBuf,
}

impl WorkDir {
    pub(super) fn new(base: &Path) -> Result<WorkDir> {
        let path = base.join(format!("vouch-bench-{}", std::process::id()));
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(WorkDir { path })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

pub(super) fn command_line() -> String {
    std::env::args()
        .map(|arg| {
            if !arg.is_empty()
                && arg
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@%".contains(c))
            {
                arg
            } else {
                format!("'{}'", arg.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

pub(super) fn machine_facts(dir: &Path) -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name"))
        .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kib| kib * 1024);
    let (filesystem, device) = filesystem_of(dir);
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "cpu": cpu,
        "kernel": kernel,
        "memory_bytes": memory,
        "dir": dir.display().to_string(),
        "filesystem": filesystem,
        "device": device,
        "device_stat": device_stat_path(dir).map(|p| p.display().to_string()),
    })
}

pub(super) fn machine_line(machine: &Value) -> String {
    format!(
        "{} CPUs ({}), {:.1} GiB RAM, Linux {}, {} on {} at {}",
        machine["nproc"],
        machine["cpu"].as_str().unwrap_or("?"),
        machine["memory_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 30) as f64,
        machine["kernel"].as_str().unwrap_or("?"),
        machine["filesystem"].as_str().unwrap_or("?"),
        machine["device"].as_str().unwrap_or("?"),
        machine["dir"].as_str().unwrap_or("?"),
    )
}

/// Filesystem type and source of the mount holding `dir` (longest prefix).
pub(super) fn filesystem_of(dir: &Path) -> (String, String) {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let mut best: Option<(usize, String, String)> = None;
    for line in mounts.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 3 {
            continue;
        }
        let mount = Path::new(fields[1]);
        if dir.starts_with(mount) {
            let depth = mount.as_os_str().len();
            if best.as_ref().is_none_or(|(d, _, _)| depth >= *d) {
                best = Some((depth, fields[2].to_string(), fields[0].to_string()));
            }
        }
    }
    best.map_or(("?".into(), "?".into()), |(_, fs, dev)| (fs, dev))
}
