//! `vouch bench`: the engine against a plain file, side by side in one run.
//!
//! Matrix mode (default): `raw` (a plain file on the same filesystem, pread /
//! pwrite, fdatasync on flush: the integrity-free ceiling, buffered like the
//! engine) and every selected layout x guard, on 4 KiB random read / write at
//! each queue depth and 1 MiB sequential read / write. Queue depth N = N
//! threads issuing synchronous operations, each with its own RNG. Every
//! configuration is created and prefilled (sequential 1 MiB writes + flush)
//! before its tests, so reads hit real data and random writes overwrite.
//! Write tests end with a flush inside the timed interval. `randread` reads
//! hit the page cache (the prefill left the data there): it measures CPU
//! cost. `randread-cold` evicts the data files (raw file, data segments)
//! before and every 10 ms during the test, so reads go to the device, as
//! they do for a working set larger than the host's memory; the engine's
//! contexts stay in its own cache, as metadata does in dm-integrity's.
//! `randwrite-cold` evicts them once before writing. The whole matrix
//! runs `--repeat` times, the configuration order rotated each round, and
//! medians are reported with the ratio to `raw` and write amplification:
//! - engine: backing bytes / client bytes from the engine's own counters;
//! - /proc/self/io: pages the process dirtied (`write_bytes`), which counts
//!   a page once however often it is rewritten before writeback;
//! - device: sectors written on the filesystem's block device between a
//!   `sync` before and after the test (includes filesystem metadata and any
//!   other writer on the machine).
//!
//! Scale mode (`--scale`): memory and crash-recovery time of a 1 GiB and a
//! 1 TiB sparse volume after N random 4 KiB writes with a flush half-way and
//! no close. Each phase runs in a child process (`--scale-child`), so the
//! process RSS is that phase's alone and the "crash" is a process exit
//! without `close()`.

mod scale;

use scale::{scale, scale_child};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions as FsOpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use clap::Args;
use serde_json::{json, Value};
use vouch_engine::direct::AlignedBuf;
use vouch_engine::BlockDevice;
use vouch_engine::{
    create_volume, open_volume, CreateOptions, GuardKind, LayoutKind, OpenOptions, StatsSnapshot,
    Volume,
};

const BLOCK: usize = 4096;
const MIB: usize = 1 << 20;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Configurations: raw, split, packed (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "raw,split,packed")]
    pub configs: Vec<String>,
    /// Guards for the engine layouts (comma-separated). The first one is the
    /// "primary" guard that runs every workload (see --full).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "crc32c,crc64nvme,crc16t10dif,xxh3,none"
    )]
    pub guards: Vec<String>,
    /// Seconds per test.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Volume / file size.
    #[arg(long, default_value = "1GiB", value_parser = crate::parse_size)]
    pub size: u64,
    /// Directory for the volumes (default: $TMPDIR or /var/tmp); a
    /// subdirectory is created there and removed afterwards.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Run the whole matrix N times (configurations interleaved) and report medians.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Queue depths for the 4 KiB random tests.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    pub qd: Vec<usize>,
    /// Queue depth for the 1 MiB sequential tests (each thread streams its own region).
    #[arg(long, default_value_t = 1)]
    pub seq_qd: usize,
    /// Workloads to run, in this order: seqread, randread (page-cache
    /// hits), randwrite (overwrites of the cached, sequentially filled
    /// data), seqwrite, coldread (4 KiB random reads from the device: the
    /// data files are evicted from the page cache before and every 10 ms
    /// during the test), coldwrite (4 KiB random writes into data files
    /// just evicted from the page cache).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "seqread,randread,randwrite,seqwrite,coldread,coldwrite"
    )]
    pub workloads: Vec<String>,
    /// Run every workload for every guard. Default: non-primary guards run
    /// only the 4 KiB random tests at the highest queue depth.
    #[arg(long)]
    pub full: bool,
    /// Keep every configuration's volume open for the whole run and
    /// interleave them test by test (workload -> round -> configuration)
    /// instead of configuration by configuration: samples compared with
    /// `raw` are seconds apart, which matters on a shared, noisy device.
    /// Every round of a workload runs before the next workload, so the cold
    /// tests (last) never evict the files under a warm test.
    #[arg(long)]
    pub interleave: bool,
    /// Bypass the page cache: the raw file is opened O_DIRECT and the
    /// volumes with direct data segments (`serve --direct`), so both sides
    /// are measured at the device, as ../shared/bench measures its local
    /// raw ceiling (fio io_uring direct=1). The cold/warm distinction goes
    /// away: coldread and coldwrite measure the same as randread and randwrite.
    #[arg(long)]
    pub direct: bool,
    /// Write every raw sample and the summary as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Scale mode: memory and crash-recovery time, 1 GiB vs 1 TiB volumes.
    #[arg(long)]
    pub scale: bool,
    /// Scale mode: volume sizes.
    #[arg(long, value_delimiter = ',', default_value = "1GiB,1TiB", value_parser = crate::parse_size)]
    pub scale_sizes: Vec<u64>,
    /// Scale mode: random 4 KiB writes before the crash (a flush half-way).
    #[arg(long, default_value_t = 20000)]
    pub scale_writes: u64,
    /// Scale mode: layouts.
    #[arg(long, value_delimiter = ',', default_value = "split,packed")]
    pub scale_layouts: Vec<String>,
    /// Internal: run one scale phase (write | open) in this process.
    #[arg(long, hide = true)]
    pub scale_child: Option<String>,
    #[arg(long, hide = true)]
    pub child_path: Option<PathBuf>,
    #[arg(long, hide = true)]
    pub child_size: Option<u64>,
    #[arg(long, hide = true)]
    pub child_layout: Option<String>,
}

pub fn run(args: BenchArgs) -> Result<ExitCode> {
    if let Some(phase) = args.scale_child.clone() {
        return scale_child(&phase, &args);
    }
    let command_line = command_line();
    println!("# vouch bench\n");
    println!("Command: `{command_line}`\n");
    let base = args.dir.clone().unwrap_or_else(|| {
        std::env::var_os("TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/var/tmp"))
    });
    let work = WorkDir::new(&base)?;
    let machine = machine_facts(&work.path);
    println!("Machine: {}\n", machine_line(&machine));
    if args.scale {
        scale(&args, &work.path, &command_line, machine)
    } else {
        matrix(&args, &work.path, &command_line, machine)
    }
}

// --- configurations and workloads ---------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Config {
    Raw,
    Engine(LayoutKind, GuardKind),
}

impl Config {
    fn name(self) -> String {
        match self {
            Config::Raw => "raw".to_string(),
            Config::Engine(layout, guard) => format!("{}/{}", layout.name(), guard.name()),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
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
struct Workload {
    kind: Kind,
    qd: usize,
}

impl Workload {
    fn io_size(self) -> usize {
        match self.kind {
            Kind::RandRead | Kind::ColdRead | Kind::RandWrite | Kind::ColdWrite => BLOCK,
            Kind::SeqRead | Kind::SeqWrite => MIB,
        }
    }
    fn is_write(self) -> bool {
        matches!(
            self.kind,
            Kind::RandWrite | Kind::SeqWrite | Kind::ColdWrite
        )
    }
    fn is_random(self) -> bool {
        matches!(
            self.kind,
            Kind::RandRead | Kind::ColdRead | Kind::RandWrite | Kind::ColdWrite
        )
    }
    fn name(self) -> String {
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

fn plan(args: &BenchArgs) -> Result<Vec<(Config, Vec<Workload>)>> {
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

// --- the thing under test -------------------------------------------------------

enum Target {
    Raw(File),
    Engine(Box<Volume>),
}

impl Target {
    fn create(config: Config, path: &Path, size: u64, direct: bool) -> Result<Target> {
        Ok(match config {
            Config::Raw => {
                let file = FsOpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .custom_flags(if direct { libc::O_DIRECT } else { 0 })
                    .open(path)
                    .with_context(|| format!("cannot create {}", path.display()))?;
                file.set_len(size)?;
                Target::Raw(file)
            }
            Config::Engine(layout, guard) => {
                let mut options = CreateOptions::new(size);
                options.layout = layout;
                options.guard = guard;
                let volume = create_volume(path, &options)?;
                if !direct {
                    return Ok(Target::Engine(Box::new(volume)));
                }
                volume.close()?;
                let open = OpenOptions {
                    direct: true,
                    ..OpenOptions::default()
                };
                Target::Engine(Box::new(open_volume(path, &open)?))
            }
        })
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        match self {
            Target::Raw(file) => file.write_all_at(data, offset)?,
            Target::Engine(volume) => volume.write(offset, data, false)?,
        }
        Ok(())
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        match self {
            Target::Raw(file) => file.read_exact_at(buf, offset)?,
            Target::Engine(volume) => {
                volume.read(offset, buf)?;
            }
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        match self {
            Target::Raw(file) => file.sync_data()?,
            Target::Engine(volume) => volume.flush()?,
        }
        Ok(())
    }

    fn stats(&self) -> Option<StatsSnapshot> {
        match self {
            Target::Raw(_) => None,
            Target::Engine(volume) => Some(volume.stats().snapshot()),
        }
    }

    fn close(self) -> Result<()> {
        if let Target::Engine(volume) = self {
            volume.close()?;
        }
        Ok(())
    }
}

/// xorshift64*: cheap, one per thread.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        // splitmix64 of the seed, never zero.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let value = self.next().to_le_bytes();
            chunk.copy_from_slice(&value[..chunk.len()]);
        }
    }
}

struct Timed {
    ops: u64,
    io_secs: f64,
    flush_secs: f64,
}

fn run_workload(
    target: &Target,
    workload: Workload,
    size: u64,
    seconds: f64,
    seed: u64,
) -> Result<Timed> {
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let results: Vec<Result<u64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workload.qd)
            .map(|thread| {
                scope.spawn(move || {
                    worker(
                        target,
                        workload,
                        size,
                        deadline,
                        seed.wrapping_mul(1000) + thread as u64,
                        thread,
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("benchmark worker panicked"))
            .collect()
    });
    let io_secs = start.elapsed().as_secs_f64();
    let mut ops = 0;
    for result in results {
        ops += result?;
    }
    let mut flush_secs = 0.0;
    if workload.is_write() {
        let flush_start = Instant::now();
        target.flush()?;
        flush_secs = flush_start.elapsed().as_secs_f64();
    }
    Ok(Timed {
        ops,
        io_secs,
        flush_secs,
    })
}

fn worker(
    target: &Target,
    workload: Workload,
    size: u64,
    deadline: Instant,
    seed: u64,
    thread: usize,
) -> Result<u64> {
    let io = workload.io_size() as u64;
    let mut rng = Rng::new(seed);
    // Page-aligned, as O_DIRECT on the raw file needs (--direct).
    let mut buf = AlignedBuf::zeroed(io as usize);
    rng.fill(&mut buf);
    let units = size / io;
    let per_thread = (units / workload.qd as u64).max(1);
    let region = (thread as u64 * per_thread) % units.max(1);
    let mut position = 0u64;
    let mut ops = 0u64;
    while Instant::now() < deadline {
        let unit = if workload.is_random() {
            rng.below(units)
        } else {
            let unit = (region + position) % units;
            position = (position + 1) % per_thread;
            unit
        };
        let offset = unit * io;
        if workload.is_write() {
            // Every write carries different bytes.
            buf[..8].copy_from_slice(&(seed ^ ops).to_le_bytes());
            target.write(offset, &buf)?;
        } else {
            target.read(offset, &mut buf)?;
        }
        ops += 1;
    }
    Ok(ops)
}

fn prefill(target: &Target, size: u64) -> Result<f64> {
    let start = Instant::now();
    let mut rng = Rng::new(size);
    let mut buf = AlignedBuf::zeroed(MIB);
    rng.fill(&mut buf);
    let mut offset = 0u64;
    while offset < size {
        let n = (size - offset).min(MIB as u64) as usize;
        buf[..8].copy_from_slice(&offset.to_le_bytes());
        target.write(offset, &buf[..n])?;
        offset += n as u64;
    }
    target.flush()?;
    Ok(start.elapsed().as_secs_f64())
}

fn remove(path: &Path) -> Result<()> {
    if path.is_dir() {
        std::fs::remove_dir_all(path)?;
    } else {
        std::fs::remove_file(path)?;
    }
    Ok(())
}

// --- page-cache eviction for the cold-read tests --------------------------------

/// The files holding a target's data: the raw file, or a volume's data
/// segments (not its superblock, journal or contexts).
fn data_files(path: &Path) -> Result<Vec<File>> {
    let mut paths = Vec::new();
    if path.is_dir() {
        for entry in std::fs::read_dir(path)? {
            let entry = entry?;
            if entry.file_name().to_string_lossy().starts_with("data.") {
                paths.push(entry.path());
            }
        }
    } else {
        paths.push(path.to_path_buf());
    }
    paths
        .iter()
        .map(|path| File::open(path).with_context(|| format!("cannot open {}", path.display())))
        .collect()
}

/// Drop every clean cached page of `files` (they were synced before).
fn evict(files: &[File]) -> Result<()> {
    for file in files {
        // SAFETY: a valid open descriptor; offset 0, length 0 = whole file.
        let rc = unsafe {
            libc::posix_fadvise(
                std::os::fd::AsRawFd::as_raw_fd(file),
                0,
                0,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        if rc != 0 {
            bail!(
                "posix_fadvise(DONTNEED): {}",
                std::io::Error::from_raw_os_error(rc)
            );
        }
    }
    Ok(())
}

/// Run `test` with `files` evicted from the page cache before it starts and,
/// when `keep_evicting`, again every 10 ms while it runs, so its reads go to
/// the device (a block read twice within 10 ms may still hit; the same holds
/// for every config).
fn cold<T>(files: &[File], keep_evicting: bool, test: impl FnOnce() -> Result<T>) -> Result<T> {
    sync_all();
    evict(files)?;
    if !keep_evicting {
        return test();
    }
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let evictor = scope.spawn(|| -> Result<()> {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(10));
                evict(files)?;
            }
            Ok(())
        });
        let result = test();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        evictor.join().expect("evictor thread panicked")?;
        result
    })
}

// --- write accounting outside the engine -----------------------------------------

fn sync_all() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

/// `write_bytes - cancelled_write_bytes` of this process (all threads).
fn proc_write_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    let field = |name: &str| -> Option<u64> {
        text.lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().parse().ok())
    };
    Some(field("write_bytes:")?.saturating_sub(field("cancelled_write_bytes:").unwrap_or(0)))
}

/// The sysfs stat file of the block device under `dir`.
fn device_stat_path(dir: &Path) -> Option<PathBuf> {
    let dev = std::fs::metadata(dir).ok()?.dev();
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let path = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/stat"));
    path.exists().then_some(path)
}

fn device_write_bytes(stat: Option<&Path>) -> Option<u64> {
    let text = std::fs::read_to_string(stat?).ok()?;
    let sectors: u64 = text.split_whitespace().nth(6)?.parse().ok()?;
    Some(sectors * 512)
}

fn engine_delta(after: &StatsSnapshot, before: &StatsSnapshot) -> Value {
    json!({
        "client_bytes_written": after.client_bytes_written - before.client_bytes_written,
        "client_bytes_read": after.client_bytes_read - before.client_bytes_read,
        "journal_bytes_written": after.journal_bytes_written - before.journal_bytes_written,
        "data_bytes_written": after.data_bytes_written - before.data_bytes_written,
        "context_bytes_written": after.context_bytes_written - before.context_bytes_written,
        "superblock_bytes_written": after.superblock_bytes_written - before.superblock_bytes_written,
        "backing_bytes_written": after.backing_bytes_written() - before.backing_bytes_written(),
        "backing_bytes_read": after.backing_bytes_read - before.backing_bytes_read,
        "syncs": after.syncs - before.syncs,
        "commits": after.commits - before.commits,
        "checkpoints": after.checkpoints - before.checkpoints,
        "flushes": after.flushes - before.flushes,
        "rechecks_recovered": after.rechecks_recovered - before.rechecks_recovered,
    })
}

// --- matrix mode ------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Sample {
    repeat: usize,
    config: String,
    workload: String,
    ops: u64,
    bytes: u64,
    io_secs: f64,
    flush_secs: f64,
    wa_engine: Option<f64>,
    wa_proc: Option<f64>,
    wa_device: Option<f64>,
    detail: Value,
}

impl Sample {
    fn total_secs(&self) -> f64 {
        self.io_secs + self.flush_secs
    }
    fn iops(&self) -> f64 {
        self.ops as f64 / self.total_secs()
    }
    fn mbps(&self) -> f64 {
        self.bytes as f64 / self.total_secs() / 1e6
    }
    fn to_json(&self) -> Value {
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

fn matrix(args: &BenchArgs, dir: &Path, command_line: &str, machine: Value) -> Result<ExitCode> {
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
fn guard_costs(plan: &[(Config, Vec<Workload>)]) -> Vec<(String, f64)> {
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
fn measure(
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

fn median(values: &mut [f64]) -> Option<f64> {
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

struct Row {
    workload: String,
    config: String,
    n: usize,
    iops: f64,
    mbps: f64,
    flush_secs: f64,
    ratio: Option<f64>,
    /// This configuration's IOPS / raw's IOPS in the same round, sorted.
    round_ratios: Vec<f64>,
    wa_engine: Option<f64>,
    wa_proc: Option<f64>,
    wa_device: Option<f64>,
}

impl Row {
    fn to_json(&self) -> Value {
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
fn round_ratios(
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

fn summarize(plan: &[(Config, Vec<Workload>)], samples: &[Sample]) -> Vec<Row> {
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

fn print_matrix(args: &BenchArgs, rows: &[Row], have_device: bool) {
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

// --- scale mode -------------------------------------------------------------------

/// A private directory under the chosen base, removed on drop.
struct WorkDir {
    path: PathBuf,
}

impl WorkDir {
    fn new(base: &Path) -> Result<WorkDir> {
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

fn command_line() -> String {
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

fn machine_facts(dir: &Path) -> Value {
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

fn machine_line(machine: &Value) -> String {
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
fn filesystem_of(dir: &Path) -> (String, String) {
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
