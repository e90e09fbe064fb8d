//! What a matrix run measures: the configurations (raw file or engine
//! layout x guard) and the workloads each one runs, from the options.

use anyhow::{bail, Context as _, Result};
use vouch_engine::{GuardKind, LayoutKind};

use super::{BenchArgs, BLOCK, MIB};

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Config {
    Raw,
    Engine(LayoutKind, GuardKind),
}

impl Config {
    pub(super) fn name(self) -> String {
        match self {
            Config::Raw => "raw".to_string(),
            Config::Engine(layout, guard) => format!("{}/{}", layout.name(), guard.name()),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Kind {
    SeqRead,
    RandRead,
    /// 4 KiB random reads that miss the page cache: the data files are
    /// evicted before the test and every few milliseconds during it, so
    /// reads go to the device. Engine metadata stays in memory.
    ColdRead,
    RandWrite,
    SeqWrite,
    /// 4 KiB random writes into data files just evicted from the page
    /// cache (new 4 KiB folios instead of the large folios a sequential
    /// fill leaves; partial-page writes must read the page first).
    ColdWrite,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Workload {
    pub(super) kind: Kind,
    pub(super) qd: usize,
}

impl Workload {
    pub(super) fn io_size(self) -> usize {
        match self.kind {
            Kind::RandRead | Kind::ColdRead | Kind::RandWrite | Kind::ColdWrite => BLOCK,
            Kind::SeqRead | Kind::SeqWrite => MIB,
        }
    }
    pub(super) fn is_write(self) -> bool {
        matches!(
            self.kind,
            Kind::RandWrite | Kind::SeqWrite | Kind::ColdWrite
        )
    }
    pub(super) fn is_random(self) -> bool {
        matches!(
            self.kind,
            Kind::RandRead | Kind::ColdRead | Kind::RandWrite | Kind::ColdWrite
        )
    }
    pub(super) fn name(self) -> String {
        let (what, size) = match self.kind {
            Kind::SeqRead => ("seqread", "1m"),
            Kind::RandRead => ("randread", "4k"),
            Kind::ColdRead => ("randread-cold", "4k"),
            Kind::RandWrite => ("randwrite", "4k"),
            Kind::SeqWrite => ("seqwrite", "1m"),
            Kind::ColdWrite => ("randwrite-cold", "4k"),
        };
        format!("{what}-{size}-qd{}", self.qd)
    }
}

pub(super) fn plan(args: &BenchArgs) -> Result<Vec<(Config, Vec<Workload>)>> {
    let mut kinds = Vec::new();
    for name in &args.workloads {
        kinds.push(match name.as_str() {
            "seqread" => Kind::SeqRead,
            "randread" => Kind::RandRead,
            "coldread" => Kind::ColdRead,
            "randwrite" => Kind::RandWrite,
            "seqwrite" => Kind::SeqWrite,
            "coldwrite" => Kind::ColdWrite,
            other => bail!(
                "unknown workload '{other}' (seqread, randread, randwrite, seqwrite, coldread, coldwrite)"
            ),
        });
    }
    if args.qd.is_empty() || args.qd.contains(&0) || args.seq_qd == 0 {
        bail!("queue depths must be at least 1");
    }
    let max_qd = *args.qd.iter().max().expect("not empty");
    let mut all = Vec::new();
    for kind in [
        Kind::SeqRead,
        Kind::RandRead,
        Kind::RandWrite,
        Kind::SeqWrite,
        Kind::ColdRead,
        Kind::ColdWrite,
    ] {
        if !kinds.contains(&kind) {
            continue;
        }
        match kind {
            Kind::RandRead | Kind::ColdRead | Kind::RandWrite | Kind::ColdWrite => {
                for &qd in &args.qd {
                    all.push(Workload { kind, qd });
                }
            }
            _ => all.push(Workload {
                kind,
                qd: args.seq_qd,
            }),
        }
    }
    let mut guards = Vec::new();
    for name in &args.guards {
        guards.push(GuardKind::from_name(name).with_context(|| {
            format!("unknown guard '{name}' (crc32c, crc64nvme, crc16t10dif, xxh3, none)")
        })?);
    }
    if guards.is_empty() {
        bail!("--guards is empty");
    }
    let mut plan = Vec::new();
    for name in &args.configs {
        match name.as_str() {
            "raw" => plan.push((Config::Raw, all.clone())),
            layout => {
                let layout = LayoutKind::from_name(layout).with_context(|| {
                    format!("unknown configuration '{layout}' (raw, split, packed)")
                })?;
                for (index, guard) in guards.iter().enumerate() {
                    let workloads: Vec<Workload> = if index == 0 || args.full {
                        all.clone()
                    } else {
                        all.iter()
                            .copied()
                            .filter(|w| {
                                matches!(w.kind, Kind::RandRead | Kind::RandWrite) && w.qd == max_qd
                            })
                            .collect()
                    };
                    if !workloads.is_empty() {
                        plan.push((Config::Engine(layout, *guard), workloads));
                    }
                }
            }
        }
    }
    if plan.is_empty() {
        bail!("nothing to run");
    }
    Ok(plan)
}
