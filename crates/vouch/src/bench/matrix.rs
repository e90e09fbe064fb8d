//! Matrix mode: every configuration x workload, `--repeat` rounds, each
//! test measured with its write amplification.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use vouch_engine::GuardKind;

use super::accounting::{
    device_stat_path, device_write_bytes, engine_delta, proc_write_bytes, sync_all,
};
use super::cold::{cold, data_files};
use super::load::{prefill, run_workload, Rng};
use super::plan::{plan, Config, Kind, Workload};
use super::report::{median, print_matrix, summarize, Row};
use super::target::{remove, Target};
use super::{BenchArgs, BLOCK, MIB};

#[derive(Clone, Debug)]
pub(super) struct Sample {
    pub(super) repeat: usize,
    pub(super) config: String,
    pub(super) workload: String,
    pub(super) ops: u64,
    pub(super) bytes: u64,
    pub(super) io_secs: f64,
    pub(super) flush_secs: f64,
    pub(super) wa_engine: Option<f64>,
    pub(super) wa_proc: Option<f64>,
    pub(super) wa_device: Option<f64>,
    pub(super) detail: Value,
}

impl Sample {
    pub(super) fn total_secs(&self) -> f64 {
        self.io_secs + self.flush_secs
    }
    pub(super) fn iops(&self) -> f64 {
        self.ops as f64 / self.total_secs()
    }
    pub(super) fn mbps(&self) -> f64 {
        self.bytes as f64 / self.total_secs() / 1e6
    }
    pub(super) fn to_json(&self) -> Value {
        json!({
            "repeat": self.repeat,
            "config": self.config,
            "workload": self.workload,
            "ops": self.ops,
            "bytes": self.bytes,
            "io_secs": self.io_secs,
            "flush_secs": self.flush_secs,
            "iops": self.iops(),
            "mb_per_s": self.mbps(),
            "wa_engine": self.wa_engine,
            "wa_proc_self_io": self.wa_proc,
            "wa_device": self.wa_device,
            "detail": self.detail,
        })
    }
}

pub(super) fn matrix(
    args: &BenchArgs,
    dir: &Path,
    command_line: &str,
    machine: Value,
) -> Result<ExitCode> {
    let plan = plan(args)?;
    if args.repeat == 0 || args.seconds <= 0.0 {
        bail!("--repeat and --seconds must be positive");
    }
    if args.size < MIB as u64 || args.size & (MIB as u64 - 1) != 0 {
        bail!("--size must be a positive multiple of 1 MiB");
    }
    let stat = device_stat_path(dir);
    let guard_ns = guard_costs(&plan);
    println!(
        "Guard cost on this CPU (ns per 4 KiB block, in cache; median of 5): {}\n",
        guard_ns
            .iter()
            .map(|(name, ns)| format!("{name} {ns:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let tests: usize = plan.iter().map(|(_, w)| w.len()).sum();
    eprintln!(
        "bench: {} configurations, {} tests x {} s x {} repeats (~{:.0} s of I/O plus prefills) in {}",
        plan.len(),
        tests,
        args.seconds,
        args.repeat,
        tests as f64 * args.seconds * args.repeat as f64,
        dir.display()
    );
    let started = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    let mut prefills: Vec<Value> = Vec::new();
    let open = |config: Config, path: &Path, repeat: usize, prefills: &mut Vec<Value>| {
        let target = Target::create(config, path, args.size, args.direct)?;
        sync_all();
        let prefill_secs = prefill(&target, args.size)?;
        prefills.push(
            json!({"repeat": repeat, "config": config.name(), "secs": prefill_secs,
            "mb_per_s": args.size as f64 / prefill_secs / 1e6}),
        );
        let files = data_files(path)?;
        anyhow::Ok((target, files))
    };
    let run = |target: &Target,
               files: &[File],
               config: Config,
               workload: Workload,
               repeat: usize,
               seed: u64| {
        let sample = measure(
            target,
            config,
            workload,
            args,
            repeat,
            seed,
            stat.as_deref(),
            files,
        )?;
        eprintln!(
            "  [{:>4.0}s] round {} {:<18} {:<20} {:>9.0} IOPS {:>8.1} MB/s{}",
            started.elapsed().as_secs_f64(),
            repeat + 1,
            sample.config,
            sample.workload,
            sample.iops(),
            sample.mbps(),
            sample
                .wa_engine
                .map(|wa| format!("  WA {wa:.3}"))
                .unwrap_or_default()
        );
        anyhow::Ok(sample)
    };
    // Rotate the configuration order every round.
    let configs = plan.len();
    let rotated = |repeat: usize| {
        let shift = (repeat * configs.div_ceil(args.repeat.max(1))) % configs;
        (0..configs).map(move |step| (step + shift) % configs)
    };
    if args.interleave {
        let mut open_targets = Vec::new();
        for (config, _) in &plan {
            let path = dir.join(config.name().replace('/', "-"));
            let (target, files) = open(*config, &path, 0, &mut prefills)?;
            open_targets.push((target, files, path));
        }
        let mut workloads: Vec<Workload> = Vec::new();
        for (_, list) in &plan {
            for workload in list {
                if !workloads.contains(workload) {
                    workloads.push(*workload);
                }
            }
        }
        for (index, workload) in workloads.iter().enumerate() {
            for repeat in 0..args.repeat {
                for at in rotated(repeat) {
                    let (config, list) = &plan[at];
                    if list.contains(workload) {
                        let (target, files, _) = &open_targets[at];
                        let seed = (repeat * 100 + index) as u64;
                        samples.push(run(target, files, *config, *workload, repeat, seed)?);
                    }
                }
            }
        }
        for (target, _, path) in open_targets {
            target.close()?;
            remove(&path)?;
        }
    } else {
        for repeat in 0..args.repeat {
            for at in rotated(repeat) {
                let (config, workloads) = &plan[at];
                let path = dir.join(format!("{}-{repeat}", config.name().replace('/', "-")));
                let (target, files) = open(*config, &path, repeat, &mut prefills)?;
                for (index, workload) in workloads.iter().enumerate() {
                    let seed = (repeat * 100 + index) as u64;
                    samples.push(run(&target, &files, *config, *workload, repeat, seed)?);
                }
                target.close()?;
                remove(&path)?;
            }
        }
    }
    let summary = summarize(&plan, &samples);
    print_matrix(args, &summary, stat.is_some());
    if let Some(json_path) = &args.json {
        let value = json!({
            "command": command_line,
            "mode": "matrix",
            "machine": machine,
            "settings": {
                "seconds": args.seconds, "size": args.size, "repeat": args.repeat,
                "qd": args.qd, "seq_qd": args.seq_qd, "full": args.full,
                "interleave": args.interleave,
                "guards": args.guards, "configs": args.configs,
            },
            "elapsed_secs": started.elapsed().as_secs_f64(),
            "guard_ns_per_4k": guard_ns.iter().cloned().collect::<BTreeMap<_, _>>(),
            "prefills": prefills,
            "samples": samples.iter().map(Sample::to_json).collect::<Vec<_>>(),
            "summary": summary.iter().map(Row::to_json).collect::<Vec<_>>(),
        });
        std::fs::write(json_path, serde_json::to_string_pretty(&value)? + "\n")
            .with_context(|| format!("cannot write {}", json_path.display()))?;
        eprintln!("bench: samples written to {}", json_path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// What computing each planned guard over one cache-hot 4 KiB block costs:
/// the floor of a verified read's overhead over a bare read.
pub(super) fn guard_costs(plan: &[(Config, Vec<Workload>)]) -> Vec<(String, f64)> {
    let mut guards: Vec<GuardKind> = Vec::new();
    for (config, _) in plan {
        if let Config::Engine(_, guard) = config {
            if !guards.contains(guard) {
                guards.push(*guard);
            }
        }
    }
    let mut block = vec![0u8; BLOCK];
    Rng::new(7).fill(&mut block);
    const ROUNDS: u32 = 20_000;
    guards
        .into_iter()
        .map(|guard| {
            let mut samples: Vec<f64> = (0..5)
                .map(|_| {
                    let start = Instant::now();
                    for round in 0..ROUNDS {
                        block[0] = round as u8;
                        std::hint::black_box(guard.compute(std::hint::black_box(&block)));
                    }
                    start.elapsed().as_nanos() as f64 / f64::from(ROUNDS)
                })
                .collect();
            (
                guard.name().to_string(),
                median(&mut samples).unwrap_or(0.0),
            )
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
pub(super) fn measure(
    target: &Target,
    config: Config,
    workload: Workload,
    args: &BenchArgs,
    repeat: usize,
    seed: u64,
    stat: Option<&Path>,
    data_files: &[File],
) -> Result<Sample> {
    // Start every test with nothing dirty, so earlier tests' writeback is
    // neither measured nor competing.
    sync_all();
    let proc_before = proc_write_bytes();
    let device_before = device_write_bytes(stat);
    let stats_before = target.stats();
    let test = || run_workload(target, workload, args.size, args.seconds, seed);
    let timed = match workload.kind {
        Kind::ColdRead => cold(data_files, true, test)?,
        Kind::ColdWrite => cold(data_files, false, test)?,
        _ => test()?,
    };
    let stats_after = target.stats();
    let bytes = timed.ops * workload.io_size() as u64;
    let (mut wa_engine, mut wa_proc, mut wa_device) = (None, None, None);
    let mut detail = json!({"qd": workload.qd, "io_size": workload.io_size()});
    if workload.is_write() {
        sync_all();
        let proc_after = proc_write_bytes();
        let device_after = device_write_bytes(stat);
        wa_engine = match (stats_before, stats_after) {
            (Some(before), Some(after)) => {
                detail["engine"] = engine_delta(&after, &before);
                Some(after.write_amplification_since(&before))
            }
            _ => Some(1.0),
        };
        if let (Some(before), Some(after)) = (proc_before, proc_after) {
            detail["proc_write_bytes"] = json!(after - before);
            wa_proc = Some((after - before) as f64 / bytes as f64);
        }
        if let (Some(before), Some(after)) = (device_before, device_after) {
            detail["device_write_bytes"] = json!(after - before);
            wa_device = Some((after - before) as f64 / bytes as f64);
        }
    } else if let (Some(before), Some(after)) = (stats_before, stats_after) {
        detail["engine"] = engine_delta(&after, &before);
    }
    Ok(Sample {
        repeat,
        config: config.name(),
        workload: workload.name(),
        ops: timed.ops,
        bytes,
        io_secs: timed.io_secs,
        flush_secs: timed.flush_secs,
        wa_engine,
        wa_proc,
        wa_device,
        detail,
    })
}
