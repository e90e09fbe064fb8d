//! `vouch serve`: export volumes over NBD until SIGINT/SIGTERM, then finish
//! in-flight requests, flush, close every volume cleanly and exit 0.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use clap::Args;
use vouch_engine::regions::RegionVolume;
use vouch_engine::BlockDevice;
use vouch_engine::{FaultKind, OpenOptions, Volume};
use vouch_nbd::{Export, Listen, Server, ServerConfig};

use crate::create::create_options;
use crate::create::CreateArgs;
use crate::export::VolumeExport;
use crate::inject::FaultInjector;
use crate::service::activation::{self, Inherited};
use crate::service::listen;
use crate::service::notify::Notifier;
use crate::service::pid_file::PidFile;

/// Where `vouch serve` listens when given neither --listen nor --socket.
const DEFAULT_LISTEN: &str = "127.0.0.1:10809";

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Volume directories to export. The first is also the default export
    /// (the empty export name).
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// Create the (first) volume with this size if PATH does not exist yet
    /// (a multiple of 4096: 10GiB = 10G; K, M, G, T are powers of 1024, KB,
    /// MB, GB, TB powers of 1000).
    #[arg(long, value_name = "SIZE", value_parser = crate::sizes::parse_volume_size)]
    create: Option<u64>,
    #[command(flatten)]
    create_args: CreateArgs,
    /// Listen for NBD clients on HOST:PORT over TCP; give it again for
    /// more addresses (--listen 127.0.0.1:10809 --listen [::1]:10809).
    /// HOST may be a name (localhost, myhost): every address it resolves
    /// to is listened on. No port means 10809; port 0 picks a free one
    /// (printed). Default: 127.0.0.1:10809, unless --socket is given.
    #[arg(long, value_name = "HOST:PORT")]
    listen: Vec<String>,
    /// Listen on this Unix socket; without --listen, on it alone (no TCP).
    /// A stale socket file is replaced, a live server's refused; the file
    /// is removed when the server stops cleanly.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Write the server's process id to FILE once it serves (every
    /// listener bound, every volume open); removed when it stops cleanly.
    #[arg(long, value_name = "FILE")]
    pid_file: Option<PathBuf>,
    /// Export names, in the order of PATHs (default: each directory's name).
    #[arg(long = "name")]
    names: Vec<String>,
    /// Refuse writes (NBD_FLAG_READ_ONLY; writes get EPERM).
    #[arg(long)]
    read_only: bool,
    /// Serve snapshot NAME of the one volume PATH (PATH/snapshots/NAME,
    /// read-only, export name NAME unless --name), in the layout it was
    /// taken in. A snapshot's directory can also be given as a PATH,
    /// beside the volume's own: `serve VOL VOL/snapshots/NAME`.
    #[arg(long, value_name = "NAME")]
    snapshot: Option<String>,
    /// Bypass the host page cache for block data (O_DIRECT on the data
    /// segments, like qemu-nbd --cache=none): what to use under a VM, whose
    /// guest caches for itself. Writes still gather in vouch's write-back
    /// buffer and reach the device as one io_uring batch per commit.
    /// The journal and contexts stay cached.
    #[arg(long)]
    direct: bool,
    /// Commit the write-back buffer only when it is full (16 MiB), on a
    /// flush or on FUA. By default it is also committed as writes come,
    /// once more than 64 blocks were written since the last flush: on a
    /// VM whose idle vCPUs halt that keeps small synchronous writers fast
    /// (docs/BENCHMARKS.md, "prompt commits"), at a journal record and
    /// fsync per commit (not while the client has more requests sent
    /// behind a write: a deep one is committed at the limit). Either way
    /// a write is acknowledged from the held log and survives a crash of
    /// the process (docs/CRASH_MODEL.md).
    #[arg(long)]
    commit_at_limit: bool,
    /// Memory for the split layout's cache of context pages (default 64M:
    /// every context of an 8 GiB volume). A volume whose working set's
    /// contexts do not fit reads a context page before its data on a miss
    /// (from the page cache, or the device when evicted), which is what
    /// the packed layout avoids. At least 4K; 64M = 64 MiB (K, M, G are
    /// powers of 1024, KB, MB, GB powers of 1000).
    #[arg(long, value_name = "SIZE", value_parser = crate::sizes::parse_size, default_value = "64M")]
    context_cache: u64,
    /// Serve Prometheus metrics on http://ADDR/metrics (IP:PORT).
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
    /// Example: read:guard_mismatch@8-15,write:nospace@100. The rules hold
    /// on every route (inline, read ring, worker); every other request
    /// takes the fast paths it would without --inject.
    #[arg(long, value_name = "SPEC")]
    inject: Option<crate::inject::InjectSpec>,
    /// Resync floor: a stale mirror leg's resync copies at least this many
    /// bytes per second even while clients are busy (like DRBD's
    /// c-min-rate, md's speed_limit_min). 10M = 10 MiB/s (K, M, G are
    /// powers of 1024, KB, MB, GB powers of 1000). The reconciliation of
    /// the extents a mirror's activity log names after an unclean stop is
    /// paced by the same floor and ceiling (bytes checked per second).
    #[arg(long, value_name = "RATE", value_parser = crate::sizes::parse_size, default_value = "1M")]
    resync_min: u64,
    /// Resync ceiling: at most this many bytes per second, the rate it
    /// runs at while no client request arrives (DRBD's c-max-rate, md's
    /// speed_limit_max). 200M = 200 MiB/s, 2G = 2 GiB/s (K, M, G are powers
    /// of 1024, KB, MB, GB powers of 1000).
    #[arg(long, value_name = "RATE", value_parser = crate::sizes::parse_size, default_value = "200M")]
    resync_max: u64,
    /// Serve every one-layout volume through the region layer, so that
    /// the control API can migrate it online (`vouch migrate --server`,
    /// `POST /v1/exports/{export}/migrate`): each becomes a volume with
    /// regions (docs/FORMAT.md, every region still in its layout) when the
    /// server starts. Such a volume is not verified, scrubbed, snapshotted
    /// or resized until `vouch migrate PATH --layout HOME` (offline) makes
    /// it a one-layout volume again. Without it, a one-layout volume is
    /// served as it is (no region layer in its path).
    #[arg(long)]
    migratable: bool,
    /// Move each region to LAYOUT on its first write (read, verified, and
    /// written in LAYOUT before the write goes there; a region that fails
    /// verification stays where it is and the failure is logged). Implies
    /// --migratable for volumes not in LAYOUT.
    #[arg(long, value_name = "LAYOUT", value_parser = ["split", "packed"])]
    migrate_on_write: Option<String>,
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

pub fn run(mut args: ServeArgs) -> Result<ExitCode> {
    if let Some(name) = &args.snapshot {
        if args.paths.len() != 1 || args.create.is_some() {
            bail!(
                "--snapshot NAME serves a snapshot of one volume: give one PATH (and no --create)"
            );
        }
        args.paths[0] = crate::snapshot::served_path(&args.paths[0], name)?;
        args.read_only = true;
    }
    // First, while this is the only thread: taking the sockets clears
    // LISTEN_* from the environment.
    let activated = activation::take()?;
    let notifier = Notifier::from_env();
    // Options are checked before `--create` makes anything.
    if activated.is_some() && (!args.listen.is_empty() || args.socket.is_some()) {
        bail!("--listen and --socket cannot be combined with socket activation (LISTEN_FDS): the service manager passes the sockets");
    }
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
    let rate = vouch_mirror::ResyncRate {
        min: args.resync_min,
        max: args.resync_max,
    };
    let mut volumes = Vec::new();
    let mut mirrors = Vec::new();
    let mut resyncers = Vec::new();
    let mut regions: Vec<Option<Arc<RegionVolume>>> = Vec::new();
    let mut migrations: Vec<Option<Arc<crate::migrate_online::Migration>>> = Vec::new();
    let on_write = args
        .migrate_on_write
        .as_deref()
        .and_then(vouch_format::LayoutKind::from_name);
    for path in &args.paths {
        let mut options = OpenOptions {
            read_only: args.read_only,
            direct: args.direct,
            ..OpenOptions::default()
        };
        options.tuning.context_cache_pages = cache_pages;
        options.tuning.prompt_commits = !args.commit_at_limit;
        if let Some((leg, name)) = crate::snapshot_mirror::of_snapshot_dir(path) {
            // A mirror's snapshot: a read-only mirror over its copies.
            let copies = crate::snapshot_mirror::open_served(&leg, &name, options.clone())?;
            let set = crate::mirror::OpenMirror {
                mirror: copies.mirror,
                volumes: copies.volumes,
                primary: copies.primary,
                record: copies.record,
            };
            eprintln!(
                "vouch: {}: snapshot {name} of a mirror, {} copies",
                path.display(),
                set.mirror.active().len()
            );
            volumes.push(Arc::clone(&set.primary));
            mirrors.push(Some(set));
            resyncers.push(None);
            regions.push(None);
            migrations.push(None);
            continue;
        }
        if vouch_mirror::is_mirrored(path) {
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
                // The extents an unclean stop may have left different,
                // online and paced like a resync.
                if set.mirror.start_reconcile(rate)? {
                    eprintln!(
                        "vouch: {}: reconciling the extents the activity log names",
                        path.display()
                    );
                }
            }
            volumes.push(Arc::clone(&set.primary));
            mirrors.push(Some(set));
            resyncers.push(Some(resyncer));
            regions.push(None);
            migrations.push(None);
            continue;
        }
        mirrors.push(None);
        resyncers.push(None);
        let with_regions = crate::migrate::has_regions(path);
        let migratable = !args.read_only
            && (args.migratable
                || on_write.is_some_and(|target| {
                    vouch_engine::volume_superblock(path)
                        .is_ok_and(|superblock| superblock.layout != target)
                }));
        if with_regions || migratable {
            // A volume with regions (`vouch migrate`, or made one now):
            // served through the region layer; the home member stands for
            // it in metrics.
            let options = crate::key::open_options(path, options, crate::key::Use::Data)?;
            let volume = if with_regions {
                RegionVolume::open(path, &options)?
            } else {
                // The options carry the key already (asked once).
                let home = vouch_engine::open_volume(path, &options)?;
                vouch_engine::regions::open_served(path, home, &options)?
            };
            let volume = Arc::new(volume);
            volume.set_migrate_on_write(on_write);
            let [split, packed] = volume.record().counts();
            eprintln!(
                "vouch: {}: a volume with regions ({split} split, {packed} packed){}",
                path.display(),
                on_write.map_or(String::new(), |target| format!(
                    ", each moving to {} on its first write",
                    target.name()
                ))
            );
            volumes.push(volume.home_shared());
            migrations.push(Some(Arc::new(crate::migrate_online::Migration::new(
                Arc::clone(&volume),
            ))));
            regions.push(Some(volume));
            continue;
        }
        regions.push(None);
        migrations.push(None);
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
        if report.held_blocks > 0 {
            eprintln!(
                "vouch: {}: {} blocks a crashed vouch process had acknowledged were put back from its held log and committed",
                path.display(),
                report.held_blocks
            );
        }
        volumes.push(Arc::new(volume));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let service = Service {
        activated,
        notifier,
    };
    let served = runtime.block_on(serve(
        &args,
        service,
        &volumes,
        &mirrors,
        &regions,
        &resyncers,
        &migrations,
    ));
    // A running migration stops between regions (resumed by the next one).
    for migration in migrations.iter().flatten() {
        migration.stop_and_join();
    }
    drop(migrations);
    let attached: Vec<_> = resyncers
        .iter()
        .flatten()
        .flat_map(|resyncer| resyncer.take_attached())
        .collect();
    drop(resyncers);
    drop(runtime);
    // Closed whether serving ended cleanly or failed to start (a busy
    // port): either way the volumes are left clean, with no recovery due.
    let closed = close_volumes(&args.paths, volumes, mirrors, regions, attached);
    // The pid file goes last: while it exists the volumes may be open.
    let pid_file = served?;
    closed?;
    drop(pid_file);
    eprintln!("vouch: stopped cleanly");
    Ok(ExitCode::SUCCESS)
}

fn close_volumes(
    paths: &[PathBuf],
    volumes: Vec<Arc<Volume>>,
    mirrors: Vec<Option<crate::mirror::OpenMirror>>,
    regions: Vec<Option<Arc<RegionVolume>>>,
    attached: Vec<Arc<Volume>>,
) -> Result<()> {
    for (((path, volume), mirror), region) in paths.iter().zip(volumes).zip(mirrors).zip(regions) {
        if let Some(region) = region {
            drop(volume);
            match Arc::try_unwrap(region) {
                Ok(region) => region
                    .close()
                    .with_context(|| format!("closing {}", path.display()))?,
                Err(region) => region.flush()?,
            }
            continue;
        }
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
    crate::resync::close_attached(attached).context("closing mirror legs brought back")
}

/// What the service manager handed over: sockets (socket activation) and
/// where to report readiness.
struct Service {
    activated: Option<Vec<Inherited>>,
    notifier: Notifier,
}

/// The NBD listeners: the sockets systemd passed, else --listen (TCP,
/// bound here) and --socket; 127.0.0.1:10809 when neither is given.
fn nbd_listeners(args: &ServeArgs, activated: Option<Vec<Inherited>>) -> Result<Vec<Listen>> {
    if let Some(sockets) = activated {
        return Ok(sockets
            .into_iter()
            .map(|socket| match socket {
                Inherited::Tcp { listener, name } => {
                    tracing::info!(%name, addr = ?listener.local_addr().ok(), "socket activation: TCP");
                    Listen::TcpListener(Arc::new(listener))
                }
                Inherited::Unix { listener, name } => {
                    tracing::info!(%name, addr = ?listener.local_addr().ok(), "socket activation: Unix");
                    Listen::UnixListener(Arc::new(listener))
                }
            })
            .collect());
    }
    let texts = if args.listen.is_empty() && args.socket.is_none() {
        vec![DEFAULT_LISTEN.to_string()]
    } else {
        args.listen.clone()
    };
    let endpoints = listen::resolve(&texts)?;
    let mut listens: Vec<Listen> = listen::bind(&endpoints)?
        .into_iter()
        .map(|listener| Listen::TcpListener(Arc::new(listener)))
        .collect();
    if let Some(socket) = &args.socket {
        listens.push(Listen::Unix(socket.clone()));
    }
    Ok(listens)
}

async fn serve(
    args: &ServeArgs,
    service: Service,
    volumes: &[Arc<Volume>],
    mirrors: &[Option<crate::mirror::OpenMirror>],
    regions: &[Option<Arc<RegionVolume>>],
    resyncers: &[Option<Arc<crate::resync::Resyncer>>],
    migrations: &[Option<Arc<crate::migrate_online::Migration>>],
) -> Result<Option<PidFile>> {
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
        let mut device: Arc<dyn BlockDevice> = match (&mirrors[index], &regions[index]) {
            (Some(set), _) => set.mirror.clone(),
            (None, Some(region)) => region.clone(),
            (None, None) => volume.clone(),
        };
        if let Some(spec) = &args.inject {
            eprintln!("vouch: injecting faults into {name}: {spec}");
            device = Arc::new(FaultInjector::new(device, spec.clone()));
        }
        let mut export = VolumeExport::new(device, description);
        let snapshot_of_mirror =
            crate::snapshot_mirror::of_snapshot_dir(&args.paths[index]).is_some();
        if !snapshot_of_mirror {
            let mut changes =
                crate::changed::Changes::new(&args.paths[index], volume.uuid_string());
            if let Some(region) = &regions[index] {
                changes = changes.with_regions(Arc::clone(region));
            }
            if let Some(set) = &mirrors[index] {
                // Each snapshot's copy on an active leg, with that leg.
                changes = changes.with_mirror(Arc::clone(&set.mirror), &set.volumes);
            }
            export = export.with_changes(changes);
        }
        let export: Arc<dyn Export> = Arc::new(export);
        if index == 0 {
            config.default_export = Some(name.clone());
        }
        if config.exports.insert(name.clone(), export).is_some() {
            bail!("export name {name:?} is used twice; give distinct --name values");
        }
    }
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        config.tls = Some(vouch_nbd::tls::server_config(
            cert,
            key,
            args.tls_ca.as_deref(),
        )?);
        config.tls_required = !args.tls_optional;
    }
    // Every listener is bound before anything is announced: a busy port
    // fails the start with nothing printed on stdout, no pid file, no
    // READY=1, and the socket files made so far removed again.
    config.listen = nbd_listeners(args, service.activated)?;
    let server = Server::bind(config).await?;
    let metrics_listener = match args.metrics {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} for --metrics"))?,
        ),
        None => None,
    };
    let control_listener = crate::offload::control::bind(&args.control).await?;
    let pid_file = args.pid_file.as_deref().map(PidFile::write).transpose()?;

    let mut endpoints = Vec::new();
    for addr in server.tcp_addrs() {
        endpoints.push(format!("nbd://{addr}"));
    }
    for socket in server.unix_sockets() {
        endpoints.push(format!("nbd+unix:///?socket={socket}"));
    }
    let mut announcement = String::new();
    for endpoint in &endpoints {
        announcement.push_str(&format!("vouch: serving on {endpoint}\n"));
    }
    if let Some(control) = &control_listener {
        announcement.push_str(&format!("vouch: control on {}\n", control.url()));
    }
    if let Some(listener) = &metrics_listener {
        announcement.push_str(&format!(
            "vouch: metrics on http://{}/metrics\n",
            listener.local_addr()?
        ));
    }
    // A server whose stdout was closed (`vouch serve ... | head -1`, a
    // supervisor that drops it) goes on serving: the announcement is for
    // whoever reads it, and the volumes are open.
    let mut stdout = std::io::stdout();
    if let Err(error) = stdout
        .write_all(announcement.as_bytes())
        .and_then(|()| stdout.flush())
    {
        tracing::warn!("could not print where vouch serves ({error}); serving anyway");
    }

    let control = control_listener
        .map(|listener| {
            crate::offload::control::start_for_server(
                listener,
                &names,
                &args.paths,
                volumes,
                resyncers,
                migrations,
                server.metrics(),
            )
        })
        .transpose()?;
    if let Some(listener) = metrics_listener {
        let engine_volumes: Vec<(String, Arc<Volume>)> =
            names.iter().cloned().zip(volumes.iter().cloned()).collect();
        let mirror_devices: Vec<(String, Arc<vouch_mirror::Mirror>)> = names
            .iter()
            .zip(mirrors)
            .filter_map(|(name, set)| set.as_ref().map(|set| (name.clone(), set.mirror.clone())))
            .collect();
        let migrating: Vec<(String, Arc<crate::migrate_online::Migration>)> = names
            .iter()
            .zip(migrations)
            .filter_map(|(name, migration)| migration.as_ref().map(|m| (name.clone(), m.clone())))
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
                for (name, migration) in &migrating {
                    migration.publish(name);
                }
                if let Some(jobs) = offload_jobs.as_ref().and_then(std::sync::Weak::upgrade) {
                    crate::offload::metrics::publish(&jobs);
                }
            },
        ));
    }
    let notifier = service.notifier;
    notifier.ready(&format!(
        "serving {} on {}",
        plural(names.len(), "export"),
        endpoints.join(", ")
    ));
    let shutdown = server.shutdown_handle();
    tokio::spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        notifier.stopping("stopping: finishing in-flight requests, flushing, closing volumes");
        eprintln!("vouch: signal received: finishing in-flight requests, flushing");
        shutdown.shutdown();
    });
    server.run().await?;
    if let Some(control) = control {
        control.shutdown().await;
    }
    Ok(pid_file)
}

/// "1 export", "2 exports".
fn plural(count: usize, noun: &str) -> String {
    if count == 1 {
        format!("1 {noun}")
    } else {
        format!("{count} {noun}s")
    }
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
