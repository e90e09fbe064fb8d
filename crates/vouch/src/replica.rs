//! Remote replicas in the CLI: `vouch replica serve DIR --listen ADDR`
//! (vouch-replica's server), the exporter's side of the connection (the
//! `--replica-tls-*` options of the commands that open mirrors), and the
//! remote members of a mirror set: created from leg 0, opened and checked
//! against the set's uuid, probed for `status` / `info`, verified for
//! `check`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use clap::{Args, Subcommand};
use vouch_engine::{BlockDevice, Fault, SealedDevice, BLOCK};
use vouch_mirror::set::MirrorRecord;
use vouch_mirror::LegTemplate;
use vouch_replica::tls::TlsFiles;
use vouch_replica::{ClientOptions, RemoteLeg, ReplicaUrl};

/// Seconds a request to a remote replica may take (`--replica-timeout`).
const DEFAULT_REPLICA_TIMEOUT_SECONDS: u64 = 30;

/// How this process reaches remote replicas: the options of the commands
/// that may open a mirror with a remote member (create, info, check,
/// serve, scrub, mirror).
#[derive(Args, Clone, Debug, Default)]
#[command(next_help_heading = "Remote replicas (mirror members vouch://HOST:PORT/NAME)")]
pub struct ReplicaClientArgs {
    /// Mutual TLS to remote replicas (mirror members vouch://HOST:PORT/NAME):
    /// this side's certificate (PEM), presented to the replica server. Give
    /// it with --replica-tls-key and --replica-tls-ca. Without them remote
    /// replicas are reached over plain TCP, which a replica server on a
    /// non-loopback address refuses unless it runs with --insecure.
    #[arg(long, value_name = "FILE")]
    pub replica_tls_cert: Option<PathBuf>,
    /// The private key of --replica-tls-cert (PEM).
    #[arg(long, value_name = "FILE")]
    pub replica_tls_key: Option<PathBuf>,
    /// The CA that signed the replica servers' certificates (PEM): a
    /// replica whose certificate it did not sign is refused.
    #[arg(long, value_name = "FILE")]
    pub replica_tls_ca: Option<PathBuf>,
    /// Bound on each request to a remote replica, in seconds: a request
    /// that takes longer drops the connection and the leg is marked stale,
    /// with a resync map of the blocks written since the last flush and
    /// every write after (no replay queue: a replica that falls behind by
    /// this long gets a map-tracked resync, not a full copy). Default 30.
    #[arg(long, value_name = "SECONDS")]
    pub replica_timeout: Option<u64>,
    /// A secret shared with the replica servers (the file their
    /// --secret-file names; owner-readable only, at least 32 bytes, e.g.
    /// `openssl rand -hex 32`): proven by challenge and response at every
    /// connect, never sent, and the server must prove it back (a server
    /// without it is refused).
    #[arg(long, value_name = "FILE")]
    pub replica_secret_file: Option<PathBuf>,
}

static CLIENT_ARGS: OnceLock<ReplicaClientArgs> = OnceLock::new();
static CLIENT_OPTIONS: OnceLock<std::result::Result<ClientOptions, String>> = OnceLock::new();

/// Remember the command's replica options (once, from `main`).
pub fn init(args: ReplicaClientArgs) {
    let _ = CLIENT_ARGS.set(args);
}

fn build_options(args: &ReplicaClientArgs) -> std::result::Result<ClientOptions, String> {
    let timeout = args
        .replica_timeout
        .unwrap_or(DEFAULT_REPLICA_TIMEOUT_SECONDS);
    if timeout == 0 {
        return Err("--replica-timeout must be at least 1 second".into());
    }
    let tls = match (
        &args.replica_tls_cert,
        &args.replica_tls_key,
        &args.replica_tls_ca,
    ) {
        (None, None, None) => None,
        (Some(cert), Some(key), Some(ca)) => Some(vouch_replica::tls::client_config(&TlsFiles {
            cert,
            key,
            ca,
        })?),
        _ => {
            return Err(
                "--replica-tls-cert, --replica-tls-key and --replica-tls-ca go together".into(),
            )
        }
    };
    let secret = match &args.replica_secret_file {
        Some(path) => Some(Arc::new(vouch_replica::auth::Secret::from_file(path)?)),
        None => None,
    };
    Ok(ClientOptions {
        timeout: Duration::from_secs(timeout),
        tls,
        secret,
    })
}

/// The client options from the command's arguments (built once).
pub fn client_options() -> vouch_engine::Result<ClientOptions> {
    CLIENT_OPTIONS
        .get_or_init(|| build_options(&CLIENT_ARGS.get().cloned().unwrap_or_default()))
        .clone()
        .map_err(vouch_engine::Error::InvalidArgument)
}

fn parse_url(url: &str) -> vouch_engine::Result<ReplicaUrl> {
    ReplicaUrl::parse(url).map_err(vouch_engine::Error::InvalidArgument)
}

fn uuid_string(uuid: &[u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Open the remote member `url` of the set `record` describes: it must
/// hold the set's volume (same uuid), or it is refused by name.
pub fn open_leg(url: &str, record: &MirrorRecord) -> vouch_engine::Result<RemoteLeg> {
    let leg = RemoteLeg::open(&parse_url(url)?, &client_options()?)?;
    if leg.info().uuid != record.uuid {
        return Err(vouch_engine::Error::Corrupt(format!(
            "replica {url} belongs to another volume: its uuid {} is not the set's {}",
            leg.uuid_string(),
            uuid_string(&record.uuid)
        )));
    }
    // A clone shares its origin's uuid: the instance tells them apart.
    if let Some((local, ours)) = local_instance(record) {
        let theirs = leg.info().instance_tag;
        if theirs != ours {
            let hex = |tag: u32| match tag {
                0 => "unknown (written by a vouch from before instance ids)".to_string(),
                tag => format!("{tag:08x}"),
            };
            return Err(vouch_engine::Error::InvalidArgument(format!(
                "replica {url} is a clone of this volume or another instance of it (instance tag {}, not {} of {}): \
                 a mirror's legs are copies of one volume; `vouch mirror add` a fresh volume instead",
                hex(theirs),
                hex(ours),
                local.display()
            )));
        }
    }
    Ok(leg)
}

/// The instance tag of the set's first local leg whose superblock reads
/// (`Superblock::instance_tag`), and that leg.
fn local_instance(record: &MirrorRecord) -> Option<(PathBuf, u32)> {
    record
        .members
        .iter()
        .filter(|member| !vouch_mirror::is_remote_member(&member.path))
        .find_map(|member| {
            let path = PathBuf::from(&member.path);
            let superblock = vouch_engine::volume_superblock(&path).ok()?;
            Some((path, superblock.instance_tag()))
        })
}

/// Is the remote member `url` there for `status` and `info`? A replica
/// held by its exporter (a running `serve`) answers `IN_USE`: it is
/// reachable and in use, which counts as present (its uuid was checked
/// when the exporter opened it).
pub fn probe_member(url: &str, record: &MirrorRecord) -> vouch_engine::Result<()> {
    match open_leg(url, record) {
        Ok(_) => Ok(()),
        Err(vouch_engine::Error::InvalidArgument(message))
            if message.contains("is in use by another exporter") =>
        {
            Ok(())
        }
        Err(error) => Err(error),
    }
}

/// `open_leg` as a mirror leg.
pub fn open_member(
    url: &str,
    record: &MirrorRecord,
) -> vouch_engine::Result<Arc<dyn SealedDevice>> {
    Ok(Arc::new(open_leg(url, record)?))
}

/// Create the remote member `url` from leg 0 at `leg0` (same superblock).
pub fn create_member(url: &str, leg0: &Path) -> vouch_engine::Result<()> {
    let template = LegTemplate::of(leg0)?;
    drop(RemoteLeg::create(
        &parse_url(url)?,
        &template,
        &client_options()?,
    )?);
    Ok(())
}

/// Verify every block of the remote member on the replica: (blocks
/// checked, faults).
pub fn check_member(url: &str, record: &MirrorRecord) -> vouch_engine::Result<(u64, Vec<Fault>)> {
    let leg = open_leg(url, record)?;
    let blocks = leg.size() / BLOCK;
    Ok((blocks, leg.verify(0, blocks)?))
}

#[derive(Subcommand, Debug)]
pub enum ReplicaCommand {
    /// Hold replicas of mirrored volumes under DIR (each a volume directory
    /// DIR/NAME) and serve them to their exporter over the replica protocol
    /// (docs/PROTOCOL.md). An exporter reaches one as a mirror member
    /// vouch://HOST:PORT/NAME: `vouch create PATH --size S --mirror
    /// vouch://HOST:PORT/NAME` creates it here from PATH's superblock. Each
    /// block arrives with its context and is verified before it is stored.
    /// One exporter at a time per replica. Without TLS or --secret-file
    /// every peer that reaches the port is trusted (on loopback: every
    /// local user); with either, only peers that prove it. Stops on
    /// SIGTERM or SIGINT, closing every replica cleanly.
    Serve(ServeArgs),
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The directory holding the replicas (created if missing).
    pub dir: PathBuf,
    /// Listen on ADDR:PORT (port 0 picks one; the address is printed).
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: SocketAddr,
    /// This server's certificate (PEM) for mutual TLS; with --tls-key and
    /// --tls-ca, every exporter must present a certificate that CA signed.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The CA that signs the exporters' client certificates (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_ca: Option<PathBuf>,
    /// Every connection must prove this shared secret (owner-readable
    /// file, at least 32 bytes, e.g. `openssl rand -hex 32`) by challenge
    /// and response before any request, loopback included; the server
    /// proves it back. It is never sent. It does not encrypt the stream:
    /// with TLS too on networks where others can tamper with TCP.
    /// Without it (and without TLS) the server trusts every peer that
    /// reaches its port: on loopback, every local user.
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Accept plain TCP on a non-loopback address with no secret (anyone
    /// who can reach the port can then write the replicas): for isolated
    /// test networks. Without TLS or --secret-file, a non-loopback
    /// --listen is refused unless this is given.
    #[arg(long, conflicts_with_all = ["tls_cert", "secret_file"])]
    pub insecure: bool,
    /// Connections held at once; one more is closed at accept.
    #[arg(long, value_name = "N", default_value_t = vouch_replica::server::MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Seconds a new connection has for its TLS handshake, hello and
    /// authentication; a peer that stalls is dropped.
    #[arg(long, value_name = "SECONDS", default_value_t = vouch_replica::server::HANDSHAKE_TIMEOUT.as_secs())]
    pub handshake_timeout: u64,
    /// Seconds a request has to arrive whole once it began (header and
    /// payload); a payload that never arrives drops the connection.
    #[arg(long, value_name = "SECONDS", default_value_t = vouch_replica::server::PAYLOAD_TIMEOUT.as_secs())]
    pub payload_timeout: u64,
    /// The newest replica protocol version to speak (tests stand in for
    /// a server from before the snapshot requests with 2).
    #[arg(long, hide = true, value_name = "VERSION", default_value_t = vouch_replica::wire::PROTOCOL_VERSION,
          value_parser = clap::value_parser!(u32).range(i64::from(vouch_replica::wire::OLDEST_VERSION)..=i64::from(vouch_replica::wire::PROTOCOL_VERSION)))]
    pub protocol_version: u32,
    /// The largest replica a CREATE may make (default: the size of DIR's
    /// filesystem). K, M, G, T are powers of 1024, KB, MB, GB, TB powers
    /// of 1000.
    #[arg(long, value_name = "SIZE", value_parser = crate::sizes::parse_size)]
    pub max_volume_size: Option<u64>,
    /// The largest journal a CREATE may bring (its size is the one leg 0's
    /// superblock records, shared by every leg). K, M, G are powers of
    /// 1024, KB, MB, GB powers of 1000.
    #[arg(long, value_name = "SIZE", value_parser = crate::sizes::parse_size, default_value = "1G")]
    pub max_journal_size: u64,
}

/// The size of the filesystem holding `dir`, in bytes.
fn filesystem_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .with_context(|| format!("{} has a NUL byte", dir.display()))?;
    // SAFETY: `statvfs` is plain old data; all zeroes is a valid value.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs(3) on a NUL-terminated path into a struct this
    // function owns.
    if unsafe { libc::statvfs(path.as_ptr(), &mut stats) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("statvfs {}", dir.display()));
    }
    Ok((stats.f_blocks as u64).saturating_mul(stats.f_frsize as u64))
}

/// Run a `vouch replica` command.
pub fn run(command: ReplicaCommand) -> Result<ExitCode> {
    match command {
        ReplicaCommand::Serve(args) => serve(args),
    }
}

fn serve(args: ServeArgs) -> Result<ExitCode> {
    let tls = match (&args.tls_cert, &args.tls_key, &args.tls_ca) {
        (Some(cert), Some(key), Some(ca)) => Some(
            vouch_replica::tls::server_config(&TlsFiles { cert, key, ca })
                .map_err(anyhow::Error::msg)
                .context("replica serve TLS")?,
        ),
        _ => None,
    };
    let secret = match &args.secret_file {
        Some(path) => Some(Arc::new(
            vouch_replica::auth::Secret::from_file(path).map_err(anyhow::Error::msg)?,
        )),
        None => None,
    };
    if tls.is_none() && secret.is_none() && !args.listen.ip().is_loopback() && !args.insecure {
        bail!(
            "--listen {} is not a loopback address: replicas take writes, so plain TCP there needs --secret-file (or mutual TLS: --tls-cert, --tls-key, --tls-ca), or --insecure",
            args.listen
        );
    }
    if args.max_connections == 0 || args.handshake_timeout == 0 || args.payload_timeout == 0 {
        bail!("--max-connections, --handshake-timeout and --payload-timeout must be at least 1");
    }
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = args
        .dir
        .canonicalize()
        .with_context(|| format!("opening {}", args.dir.display()))?;
    let options_secret = secret.is_some();
    let runtime = tokio::runtime::Runtime::new().context("starting the runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
        let local = listener.local_addr()?;
        println!(
            "vouch replica: serving {} on {local} ({})",
            dir.display(),
            match (tls.is_some(), options_secret) {
                (true, true) => "mutual TLS, shared secret",
                (true, false) => "mutual TLS",
                (false, true) => "plain TCP, shared secret",
                (false, false) => "plain TCP, no authentication",
            }
        );
        use std::io::Write as _;
        std::io::stdout().flush()?;
        let policy = vouch_replica::server::CreatePolicy {
            max_volume_bytes: match args.max_volume_size {
                Some(size) => size,
                None => filesystem_bytes(&dir)?,
            },
            max_journal_bytes: args.max_journal_size,
        };
        let registry = Arc::new(vouch_replica::server::Registry::new(&dir, policy));
        let options = vouch_replica::server::ServerOptions {
            max_connections: args.max_connections,
            handshake_timeout: Duration::from_secs(args.handshake_timeout),
            payload_timeout: Duration::from_secs(args.payload_timeout),
            secret,
            newest_version: args.protocol_version,
        };
        let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let shutdown = async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            tracing::info!("replica server stopping");
        };
        vouch_replica::server::serve(listener, registry, acceptor, options, shutdown).await;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}
