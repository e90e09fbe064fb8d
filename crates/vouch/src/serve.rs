//! `vouch serve`: export volumes over NBD until SIGINT/SIGTERM, then finish
//! in-flight requests, flush, close every volume cleanly and exit 0.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use clap::Args;
use vouch_engine::BlockDevice;
use vouch_engine::{FaultKind, OpenOptions, Volume};
use vouch_nbd::{Export, Listen, Server, ServerConfig};

use crate::commands::create_options;
use crate::export::VolumeExport;
use crate::inject::FaultInjector;
use crate::CreateArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Volume directories to export. The first is also the default export
    /// (the empty export name).
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// Create the (first) volume with this size if PATH does not exist yet
    /// (a multiple of 4096: 10GiB = 10G; K, M, G, T are powers of 1024, KB,
    /// MB, GB, TB powers of 1000).
    #[arg(long, value_name = "SIZE", value_parser = crate::parse_volume_size)]
    create: Option<u64>,
    #[command(flatten)]
    create_args: CreateArgs,
    /// TCP address to listen on. Port 0 picks a free port (printed).
    #[arg(long, default_value = "127.0.0.1:10809")]
    listen: SocketAddr,
    /// Also listen on this Unix socket.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Export names, in the order of PATHs (default: each directory's name).
    #[arg(long = "name")]
    names: Vec<String>,
    /// Refuse writes (NBD_FLAG_READ_ONLY; writes get EPERM).
    #[arg(long)]
    read_only: bool,
    /// Bypass the host page cache for block data (O_DIRECT on the data
    /// segments, like qemu-nbd --cache=none): what to use under a VM, whose
    /// guest caches for itself. Writes still gather in vouch's write-back
    /// buffer and reach the device as one io_uring batch per commit.
    /// The journal and contexts stay cached.
    #[arg(long)]
    direct: bool,
    /// Memory for the split layout's cache of context pages (default 64M:
    /// every context of an 8 GiB volume). A volume whose working set's
    /// contexts do not fit reads a context page before its data on a miss
    /// (from the page cache, or the device when evicted), which is what
    /// the packed layout avoids. At least 4K; 64M = 64 MiB (K, M, G are
    /// powers of 1024, KB, MB, GB powers of 1000).
    #[arg(long, value_name = "SIZE", value_parser = crate::parse_size, default_value = "64M")]
    context_cache: u64,
    /// Serve Prometheus metrics on http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// TLS certificate chain (PEM). With --tls-key, clients must STARTTLS.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// With TLS: also accept plaintext clients (default: TLS is required).
    #[arg(long, requires = "tls_cert")]
    tls_optional: bool,
    /// With TLS: require every client to present a certificate signed by
    /// this CA (PEM), like qemu-nbd's verify-peer=on; a client without one,
    /// or with another CA's, is refused and logged.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_ca: Option<PathBuf>,
    /// Fail chosen requests before they reach the volume, to see how
    /// clients cope (like nbdkit's error filter; the volume is untouched).
    /// Comma-separated rules OP:KIND[@FIRST[-LAST]] over LBAs: OP read
    /// (KIND a fault kind such as guard_mismatch, or io), write (io,
    /// nospace; also trims and zeroes) or flush (io, nospace; no range).
    /// Example: read:guard_mismatch@8-15,write:nospace@100.
    #[arg(long, value_name = "SPEC")]
    inject: Option<crate::inject::InjectSpec>,
    /// Resync floor: a stale mirror leg's resync copies at least this many
    /// bytes per second even while clients are busy (like DRBD's
    /// c-min-rate, md's speed_limit_min). 10M = 10 MiB/s (K, M, G are
    /// powers of 1024, KB, MB, GB powers of 1000).
    #[arg(long, value_name = "RATE", value_parser = crate::parse_size, default_value = "1M")]
    resync_min: u64,
    /// Resync ceiling: at most this many bytes per second, the rate it
    /// runs at while no client request arrives (DRBD's c-max-rate, md's
    /// speed_limit_max). 200M = 200 MiB/s, 2G = 2 GiB/s (K, M, G are powers
    /// of 1024, KB, MB, GB powers of 1000).
    #[arg(long, value_name = "RATE", value_parser = crate::parse_size, default_value = "200M")]
    resync_max: u64,
    #[command(flatten)]
    control: crate::offload::control::ControlArgs,
    #[command(flatten)]
    pub key: crate::key::KeyFileArgs,
    #[command(flatten)]
    pub replica: crate::replica::ReplicaClientArgs,
}

/// `--context-cache` in whole 4 KiB context pages.
fn context_cache_pages(bytes: u64) -> Result<usize> {
    let pages = bytes / vouch_engine::BLOCK;
    if pages == 0 {
        bail!("--context-cache must be at least 4K (one context page), not {bytes} bytes");
    }
    Ok(usize::try_from(pages).unwrap_or(usize::MAX))
}

fn export_name(path: &std::path::Path) -> String {
    path.file_name().map_or_else(
        || "vouch".to_string(),
        |name| name.to_string_lossy().into_owned(),
    )
}

pub fn run(args: ServeArgs) -> Result<ExitCode> {
    // Options are checked before `--create` makes anything.
    let cache_pages = context_cache_pages(args.context_cache)?;
    if !args.names.is_empty() && args.names.len() != args.paths.len() {
        bail!(
            "give one --name per volume ({} names for {} volumes)",
            args.names.len(),
            args.paths.len()
        );
    }
    if args.resync_min == 0 || args.resync_min > args.resync_max {
        bail!(
            "--resync-min ({}) must be positive and at most --resync-max ({})",
            args.resync_min,
            args.resync_max
        );
    }
    if let Some(size) = args.create {
        let path = &args.paths[0];
        if !path.exists() {
            let volume =
                vouch_engine::create_volume(path, &create_options(size, &args.create_args)?)?;
            volume.close()?;
            eprintln!("vouch: created {} ({size} bytes)", path.display());
        }
    }
    let rate = vouch_engine::mirror::ResyncRate {
        min: args.resync_min,
        max: args.resync_max,
    };
    let mut volumes = Vec::new();
    let mut mirrors = Vec::new();
    let mut resyncers = Vec::new();
    for path in &args.paths {
        let mut options = OpenOptions {
            read_only: args.read_only,
            direct: args.direct,
            ..OpenOptions::default()
        };
        options.tuning.context_cache_pages = cache_pages;
        if vouch_engine::mirror::is_mirrored(path) {
            let set = crate::mirror::open(path, options.clone(), crate::key::Use::Data)?;
            eprintln!(
                "vouch: {}: mirror of {} legs, {} active",
                path.display(),
                set.volumes.len(),
                set.mirror.active().len()
            );
            let resyncer = Arc::new(crate::resync::Resyncer::new(&set, options, rate));
            if !args.read_only {
                for note in resyncer.start_at_open()? {
                    eprintln!("vouch: {note}");
                    tracing::warn!("{note}");
                }
            }
            volumes.push(Arc::clone(&set.primary));
            mirrors.push(Some(set));
            resyncers.push(Some(resyncer));
            continue;
        }
        mirrors.push(None);
        resyncers.push(None);
        let volume = crate::key::open(path, options, crate::key::Use::Data)?;
        let report = volume.recovery_report();
        if report.records_replayed > 0 {
            eprintln!(
                "vouch: {}: recovered {} journal records in {:?} ({} blocks verified, {} reverted to their old contents, {} torn, {} unreadable)",
                path.display(),
                report.records_replayed,
                report.duration,
                report.blocks_verified,
                report.blocks_reverted,
                report.blocks_torn.len(),
                report.blocks_unreadable.len()
            );
        }
        volumes.push(Arc::new(volume));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(serve(&args, &volumes, &mirrors, &resyncers));
    let attached: Vec<_> = resyncers
        .iter()
        .flatten()
        .flat_map(|resyncer| resyncer.take_attached())
        .collect();
    drop(resyncers);
    drop(runtime);
    result?;
    for ((path, volume), mirror) in args.paths.iter().zip(volumes).zip(mirrors) {
        if let Some(mirror) = mirror {
            drop(volume);
            mirror
                .close()
                .with_context(|| format!("closing the legs of {}", path.display()))?;
            continue;
        }
        match Arc::try_unwrap(volume) {
            Ok(volume) => volume
                .close()
                .with_context(|| format!("closing {}", path.display()))?,
            Err(volume) => volume.flush()?,
        }
    }
    crate::resync::close_attached(attached).context("closing mirror legs brought back")?;
    eprintln!("vouch: stopped cleanly");
    Ok(ExitCode::SUCCESS)
}

async fn serve(
    args: &ServeArgs,
    volumes: &[Arc<Volume>],
    mirrors: &[Option<crate::mirror::OpenMirror>],
    resyncers: &[Option<Arc<crate::resync::Resyncer>>],
) -> Result<()> {
    // Handle signals before announcing the listener: a SIGTERM right after
    // "serving on" must stop cleanly, not take the default action.
    use tokio::signal::unix::{signal, SignalKind};
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut terminate =
        signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let names: Vec<String> = args
        .paths
        .iter()
        .enumerate()
        .map(|(index, path)| {
            args.names
                .get(index)
                .cloned()
                .unwrap_or_else(|| export_name(path))
        })
        .collect();
    let mut config = ServerConfig::default();
    for (index, volume) in volumes.iter().enumerate() {
        let name = names[index].clone();
        let description = format!(
            "vouch volume {} (layout {}, guard {})",
            volume.uuid_string(),
            volume.layout().name(),
            volume.guard().name()
        );
        let mut device: Arc<dyn BlockDevice> = match &mirrors[index] {
            Some(set) => set.mirror.clone(),
            None => volume.clone(),
        };
        if let Some(spec) = &args.inject {
            eprintln!("vouch: injecting faults into {name}: {spec}");
            device = Arc::new(FaultInjector::new(device, spec.clone()));
        }
        let export: Arc<dyn Export> = Arc::new(VolumeExport::new(device, description));
        if index == 0 {
            config.default_export = Some(name.clone());
        }
        if config.exports.insert(name.clone(), export).is_some() {
            bail!("export name {name:?} is used twice; give distinct --name values");
        }
    }
    config.listen.push(Listen::Tcp(args.listen));
    if let Some(socket) = &args.socket {
        config.listen.push(Listen::Unix(socket.clone()));
    }
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        config.tls = Some(vouch_nbd::tls::server_config(
            cert,
            key,
            args.tls_ca.as_deref(),
        )?);
        config.tls_required = !args.tls_optional;
    }
    let server = Server::bind(config).await?;
    for addr in server.tcp_addrs() {
        println!("vouch: serving on nbd://{addr}");
    }
    if let Some(socket) = &args.socket {
        println!("vouch: serving on nbd+unix:///?socket={}", socket.display());
    }
    let control = crate::offload::control::start_for_server(
        &args.control,
        &names,
        &args.paths,
        volumes,
        resyncers,
        server.metrics(),
    )
    .await?;
    if let Some(addr) = args.metrics {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("metrics on {addr}"))?;
        println!(
            "vouch: metrics on http://{}/metrics",
            listener.local_addr()?
        );
        let engine_volumes: Vec<(String, Arc<Volume>)> =
            names.iter().cloned().zip(volumes.iter().cloned()).collect();
        let mirror_devices: Vec<(String, Arc<vouch_engine::mirror::Mirror>)> = names
            .iter()
            .zip(mirrors)
            .filter_map(|(name, set)| set.as_ref().map(|set| (name.clone(), set.mirror.clone())))
            .collect();
        let offload_jobs = control
            .as_ref()
            .map(|control| Arc::downgrade(&control.jobs));
        tokio::spawn(vouch_nbd::serve_metrics_on(
            listener,
            server.metrics(),
            move || {
                publish_engine_metrics(&engine_volumes);
                crate::mirror::publish_metrics(&mirror_devices);
                crate::resync::publish_metrics(&mirror_devices);
                if let Some(jobs) = offload_jobs.as_ref().and_then(std::sync::Weak::upgrade) {
                    crate::offload::metrics::publish(&jobs);
                }
            },
        ));
    }
    std::io::stdout().flush()?;
    let shutdown = server.shutdown_handle();
    tokio::spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        eprintln!("vouch: signal received: finishing in-flight requests, flushing");
        shutdown.shutdown();
    });
    server.run().await?;
    if let Some(control) = control {
        control.shutdown().await;
    }
    Ok(())
}

/// A counter's name, help text and how to read it from a snapshot.
type Counter = (
    &'static str,
    &'static str,
    fn(&vouch_engine::StatsSnapshot) -> u64,
);

/// Engine counters, one series per volume, published into the metrics
/// recorder at each scrape (run by `vouch_nbd::metrics::router` with the
/// server's recorder as the local one).
pub(crate) fn publish_engine_metrics(volumes: &[(String, Arc<Volume>)]) {
    let counters: [Counter; 10] = [
        (
            "vouch_engine_client_written_bytes_total",
            "Bytes written by clients",
            |s| s.client_bytes_written,
        ),
        (
            "vouch_engine_client_read_bytes_total",
            "Bytes read by clients",
            |s| s.client_bytes_read,
        ),
        (
            "vouch_engine_journal_written_bytes_total",
            "Bytes written to the journal",
            |s| s.journal_bytes_written,
        ),
        (
            "vouch_engine_data_written_bytes_total",
            "Bytes written to data segments",
            |s| s.data_bytes_written,
        ),
        (
            "vouch_engine_context_written_bytes_total",
            "Bytes written to the context table",
            |s| s.context_bytes_written,
        ),
        ("vouch_engine_syncs_total", "fdatasync calls", |s| s.syncs),
        ("vouch_engine_commits_total", "Journal commits", |s| {
            s.commits
        }),
        ("vouch_engine_checkpoints_total", "Checkpoints", |s| {
            s.checkpoints
        }),
        ("vouch_engine_flushes_total", "Flushes", |s| s.flushes),
        (
            "vouch_engine_rechecks_recovered_total",
            "Mismatches that passed on the recheck",
            |s| s.rechecks_recovered,
        ),
    ];
    let snapshots: Vec<(String, vouch_engine::StatsSnapshot)> = volumes
        .iter()
        .map(|(name, volume)| (name.clone(), volume.stats().snapshot()))
        .collect();
    for (metric, help, get) in counters {
        metrics::describe_counter!(metric, help);
        for (name, snapshot) in &snapshots {
            metrics::counter!(metric, "volume" => name.clone()).absolute(get(snapshot));
        }
    }
    let metric = "vouch_engine_checksum_failures_total";
    metrics::describe_counter!(metric, "Blocks that failed verification, by kind");
    for (name, snapshot) in &snapshots {
        for kind in FaultKind::ALL {
            metrics::counter!(metric, "volume" => name.clone(), "kind" => kind.name())
                .absolute(snapshot.faults_of(kind));
        }
    }
    let metric = "vouch_engine_resident_bytes";
    metrics::describe_gauge!(metric, "Memory held by buffers and caches");
    for (name, volume) in volumes {
        metrics::gauge!(metric, "volume" => name.clone()).set(volume.resident_bytes() as f64);
    }
}
