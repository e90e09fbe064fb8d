//! `vouch bench` command-line options.

use std::path::PathBuf;

use clap::Args;

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
    /// Volume / file size (a multiple of 4096; K, M, G, T and KiB, MiB,
    /// GiB, TiB are powers of 1024, KB, MB, GB, TB powers of 1000).
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = crate::sizes::parse_volume_size)]
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
    /// Scale mode: volume sizes (1TiB = 1T; K, M, G, T are powers of 1024,
    /// KB, MB, GB, TB powers of 1000).
    #[arg(long, value_name = "SIZE", value_delimiter = ',', default_value = "1GiB,1TiB", value_parser = crate::sizes::parse_volume_size)]
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
