//! Matrix mode's summary: medians per workload and configuration, ratios
//! to `raw`, and the Markdown table.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::matrix::Sample;
use super::plan::{Config, Kind, Workload};
use super::BenchArgs;

pub(super) fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    })
}

pub(super) struct Row {
    pub(super) workload: String,
    pub(super) config: String,
    pub(super) n: usize,
    pub(super) iops: f64,
    pub(super) mbps: f64,
    pub(super) flush_secs: f64,
    pub(super) ratio: Option<f64>,
    /// This configuration's IOPS / raw's IOPS in the same round, sorted.
    pub(super) round_ratios: Vec<f64>,
    pub(super) wa_engine: Option<f64>,
    pub(super) wa_proc: Option<f64>,
    pub(super) wa_device: Option<f64>,
}

impl Row {
    pub(super) fn to_json(&self) -> Value {
        json!({
            "workload": self.workload, "config": self.config, "samples": self.n,
            "median_iops": self.iops, "median_mb_per_s": self.mbps,
            "median_flush_secs": self.flush_secs, "ratio_to_raw": self.ratio,
            "median_wa_engine": self.wa_engine, "median_wa_proc_self_io": self.wa_proc,
            "median_wa_device": self.wa_device,
            "round_ratios_to_raw": self.round_ratios,
        })
    }
}

/// Per-round ratios to raw for one workload and configuration, sorted.
pub(super) fn round_ratios(
    grouped: &BTreeMap<(String, String), Vec<&Sample>>,
    workload: &str,
    group: &[&Sample],
) -> Vec<f64> {
    let Some(raw) = grouped.get(&(workload.to_string(), "raw".to_string())) else {
        return Vec::new();
    };
    let mut ratios: Vec<f64> = group
        .iter()
        .filter_map(|sample| {
            raw.iter()
                .find(|r| r.repeat == sample.repeat)
                .map(|r| sample.iops() / r.iops())
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios
}

pub(super) fn summarize(plan: &[(Config, Vec<Workload>)], samples: &[Sample]) -> Vec<Row> {
    let mut workloads: Vec<Workload> = Vec::new();
    for (_, list) in plan {
        for workload in list {
            if !workloads.contains(workload) {
                workloads.push(*workload);
            }
        }
    }
    let order = |w: &Workload| {
        let kind = [
            Kind::RandRead,
            Kind::ColdRead,
            Kind::RandWrite,
            Kind::ColdWrite,
            Kind::SeqRead,
            Kind::SeqWrite,
        ]
        .iter()
        .position(|k| *k == w.kind)
        .unwrap_or(0);
        (kind, w.qd)
    };
    workloads.sort_by_key(order);
    let mut grouped: BTreeMap<(String, String), Vec<&Sample>> = BTreeMap::new();
    for sample in samples {
        grouped
            .entry((sample.workload.clone(), sample.config.clone()))
            .or_default()
            .push(sample);
    }
    let mut rows = Vec::new();
    for workload in &workloads {
        let name = workload.name();
        let raw_iops = grouped
            .get(&(name.clone(), "raw".to_string()))
            .and_then(|list| median(&mut list.iter().map(|s| s.iops()).collect::<Vec<_>>()));
        for (config, list) in plan {
            if !list.contains(workload) {
                continue;
            }
            let Some(group) = grouped.get(&(name.clone(), config.name())) else {
                continue;
            };
            let pick = |f: &dyn Fn(&Sample) -> Option<f64>| {
                median(&mut group.iter().filter_map(|s| f(s)).collect::<Vec<_>>())
            };
            let iops = pick(&|s| Some(s.iops())).unwrap_or(0.0);
            rows.push(Row {
                workload: name.clone(),
                config: config.name(),
                n: group.len(),
                iops,
                mbps: pick(&|s| Some(s.mbps())).unwrap_or(0.0),
                flush_secs: pick(&|s| Some(s.flush_secs)).unwrap_or(0.0),
                ratio: raw_iops.map(|raw| iops / raw),
                round_ratios: round_ratios(&grouped, &name, group),
                wa_engine: pick(&|s| s.wa_engine),
                wa_proc: pick(&|s| s.wa_proc),
                wa_device: pick(&|s| s.wa_device),
            });
        }
    }
    rows
}

pub(super) fn print_matrix(args: &BenchArgs, rows: &[Row], have_device: bool) {
    println!(
        "Medians of {} rounds, {} s per test, {} volume, 4 KiB random at QD {:?}, 1 MiB sequential at QD {}.",
        args.repeat,
        args.seconds,
        bytesize::ByteSize(args.size).display().iec(),
        args.qd,
        args.seq_qd
    );
    println!(
        "Write tests include the closing flush (engine flush / raw fdatasync) in the timing.\n"
    );
    println!("| workload | config | IOPS | MB/s | x raw | x raw by round: median (min-max) | WA engine | WA /proc/self/io | WA device | flush s |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let fmt = |value: Option<f64>, digits: usize| {
        value.map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
    };
    for row in rows {
        let is_write = row.wa_engine.is_some();
        println!(
            "| {} | {} | {:.0} | {:.1} | {} | {} | {} | {} | {} | {} |",
            row.workload,
            row.config,
            row.iops,
            row.mbps,
            fmt(row.ratio, 2),
            match (row.round_ratios.first(), row.round_ratios.last()) {
                (Some(low), Some(high)) => format!(
                    "{:.2} ({low:.2}-{high:.2})",
                    median(&mut row.round_ratios.clone()).unwrap_or(0.0)
                ),
                _ => "-".to_string(),
            },
            fmt(row.wa_engine, 3),
            fmt(row.wa_proc, 3),
            if have_device {
                fmt(row.wa_device, 3)
            } else {
                "n/a".to_string()
            },
            if is_write {
                format!("{:.2}", row.flush_secs)
            } else {
                "-".to_string()
            }
        );
    }
    println!();
    println!("x raw: median IOPS / median raw IOPS. By round: IOPS / raw IOPS of the same round.");
    println!("WA engine: backing bytes / client bytes from the engine's counters (raw: 1 by definition).");
    println!("WA /proc/self/io: pages this process dirtied (write_bytes - cancelled_write_bytes) / client bytes;");
    println!("  a page rewritten before writeback counts once, so random overwrites of a small, hot volume read below 1.");
    println!("WA device: sectors written on the block device between a sync before and after the test / client bytes;");
    println!("  includes filesystem metadata and any other writer on the machine, and the same page-cache absorption.");
}
