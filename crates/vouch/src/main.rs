//! `vouch`: create, inspect, verify, convert and serve vouch volumes.

mod bench;
mod changed;
mod commands;
mod create;
mod export;
mod inject;
mod key;
mod migrate;
mod migrate_online;
mod mirror;
mod offload;
mod progress;
mod replica;
mod resize;
mod resize_mirror;
mod resync;
mod serve;
mod service;
mod sizes;
mod snapshot;
mod snapshot_held;
mod snapshot_mirror;
mod snapshot_remote;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory as _, FromArgMatches as _, Parser, Subcommand};

use create::CreateArgs;
use sizes::parse_volume_size;

/// A block store that vouches for every block: each 4 KiB block is stored
/// with protection information (a guard checksum and a reference tag binding
/// it to its LBA), every read is verified, and every fault is reported with
/// its LBA. Volumes are served over NBD to qemu, nbdcopy, nbdfuse, fio and
/// the kernel client.
#[derive(Parser)]
#[command(name = "vouch", version, about, long_about = None, propagate_version = true)]
#[command(after_help = SIZES_HELP)]
struct Cli {
    /// Log filter (e.g. "info", "vouch=debug"); also RUST_LOG. Logs go to
    /// stderr, coloured only on a terminal and never when NO_COLOR is set.
    #[arg(long, global = true, default_value = "info")]
    log: String,
    #[command(flatten)]
    before: OptionsBeforeCommand,
    #[command(subcommand)]
    command: Command,
}

/// How every size option reads (like qemu-img's).
const SIZES_HELP: &str = "Sizes: 4096, 4K, 10M, 2G, 1T: K, M, G, T (and KiB, MiB, GiB, TiB) are powers of 1024; KB, MB, GB, TB are powers of 1000 (2GB = 2000000000 bytes).";

/// The key and replica options once were global, and users put them
/// before the command (`vouch --replica-tls-cert F ... serve VOL`). They
/// are now options of the commands they apply to, and still accepted
/// there, for those commands only (hidden from --help).
#[derive(Args, Debug, Default)]
struct OptionsBeforeCommand {
    #[arg(long, hide = true, value_name = "FILE")]
    key_file: Option<PathBuf>,
    #[arg(long, hide = true)]
    keyless: bool,
    #[arg(long, hide = true, value_name = "FILE")]
    replica_tls_cert: Option<PathBuf>,
    #[arg(long, hide = true, value_name = "FILE")]
    replica_tls_key: Option<PathBuf>,
    #[arg(long, hide = true, value_name = "FILE")]
    replica_tls_ca: Option<PathBuf>,
    #[arg(long, hide = true, value_name = "SECONDS")]
    replica_timeout: Option<u64>,
    #[arg(long, hide = true, value_name = "FILE")]
    replica_secret_file: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Create a new volume directory at PATH (sparse: instant at any size).
    Create {
        /// The new volume's directory (must not exist, or be empty).
        path: PathBuf,
        /// Nominal size, a multiple of 4096: 10GiB = 10G, 16TiB, 1048576.
        /// K, M, G, T (and KiB, MiB, GiB, TiB) are powers of 1024; KB, MB,
        /// GB, TB are powers of 1000 (2GB = 2000000000 bytes).
        #[arg(long, value_name = "SIZE", value_parser = parse_volume_size)]
        size: u64,
        /// Make PATH leg 0 of a mirror and this directory another leg (give
        /// it once or twice: 2 or 3 legs, e.g. on different disks). Every
        /// leg is a whole volume with the same uuid; `serve`, `info`,
        /// `check` and `scrub` given any leg use every leg, and a block
        /// that fails verification on one leg is repaired from another.
        /// A leg may be a remote replica, vouch://HOST:PORT/NAME: created
        /// as NAME on that host's `vouch replica serve` (PATH, leg 0, stays
        /// local and keeps the set's record).
        #[arg(long, value_name = "PATH2|vouch://HOST:PORT/NAME")]
        mirror: Vec<PathBuf>,
        #[command(flatten)]
        create: CreateArgs,
        #[command(flatten)]
        key: key::KeyFileArgs,
        #[command(flatten)]
        replica: replica::ReplicaClientArgs,
    },
    /// Show a volume's geometry, layout, guard, feature flags and usage.
    /// Read-only: a volume a running `vouch serve` holds is shown from its
    /// superblock and files, without opening it (live counters: the
    /// server's --metrics; its checks: `verify`/`scrub --server`).
    Info {
        /// The volume's directory (any leg of a mirrored volume).
        path: PathBuf,
        /// Print JSON. `read_only` is true when this vouch can only read
        /// the volume (it carries ro_compat features this build does not
        /// know); `in_use` when another process holds it for writing.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        key: key::KeyArgs,
        #[command(flatten)]
        replica: replica::ReplicaClientArgs,
    },
    /// Verify every written block offline (a mirrored volume: every leg,
    /// each alone, without repair; a mirror's snapshot, LEG/snapshots/NAME:
    /// every leg's copy, each reported, or with --json the copy given). Exit 0 when clean, 1 when faults were
    /// found (each LBA and fault kind listed; lost metadata once per file
    /// cut short and once per context page or packed row lost), 2 on error.
    Check {
        /// The volume's directory (any leg of a mirrored volume).
        path: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        key: key::KeyArgs,
        #[command(flatten)]
        replica: replica::ReplicaClientArgs,
    },
    /// Convert a raw disk image into a new volume (size rounded up to 4 KiB).
    Import {
        /// The raw disk image to read.
        raw: PathBuf,
        /// The new volume's directory (must not exist, or be empty).
        path: PathBuf,
        #[command(flatten)]
        create: CreateArgs,
        #[command(flatten)]
        key: key::KeyFileArgs,
    },
    /// Convert a volume into a new raw disk image. Fails naming the faulty
    /// LBAs unless --allow-faults, which zero-fills them.
    Export {
        /// The volume's directory.
        path: PathBuf,
        /// The raw image to write (must not exist).
        raw: PathBuf,
        /// Zero-fill blocks that fail verification instead of failing.
        #[arg(long)]
        allow_faults: bool,
        #[command(flatten)]
        key: key::KeyFileArgs,
    },
    /// Build a volume's written map from its metadata as it is now, and
    /// make every written metadata unit whole (offline). A volume made
    /// before the map (format flag WRITTEN_MAP) or before whole units
    /// (BOUND_UNITS: vacant markers in the never-written slots of a
    /// written context page or packed row) opens read-only until this
    /// runs; a volume whose `written` file is missing or damaged is
    /// refused until this runs or the file is restored (the map is what
    /// tells lost metadata from never-written blocks, so rebuild it only
    /// from metadata you trust). It also fills in the expected generation
    /// of every written unit that has none (a volume made before them, or
    /// last written by a binary that kept none), so an older copy of a
    /// file restored later is caught. An upgrade cut short is finished by
    /// running it again.
    Upgrade {
        /// The volume's directory (offline: no server may have it open).
        path: PathBuf,
        #[command(flatten)]
        key: key::KeyFileArgs,
    },
    /// Move a volume to another layout, region by region (offline: no
    /// server may have it open). Each region (62 MiB) not in LAYOUT is read
    /// and verified under its old protection, written in the new layout,
    /// made durable, then switched in the region record and released from
    /// the old layout: a crash at any point leaves every region whole in
    /// one layout, and running it again finishes. A block that fails
    /// verification stops it, naming the block's LBA (the regions before
    /// it stay moved; the volume stays readable).
    ///
    /// While any region is out of the layout the volume was created in (a
    /// volume with regions), it is served (`serve`, without --control),
    /// read, checked, verified, scrubbed, exported, migrated, snapshotted
    /// offline (`vouch snapshot create`: each member's files, and the
    /// record, as they stand), cloned, diffed and resized offline (`vouch
    /// resize`: both members and the record) and resized online (`vouch
    /// resize --server`), but not mirrored or rekeyed yet. Migrated back to the
    /// layout it was created in, every region back home, it is a one-layout
    /// volume again (the record and the other layout's directory removed)
    /// and every command takes it.
    ///
    /// Online, with --server ADDR [EXPORT]: the server (`serve --control
    /// --migratable`, or `--migrate-on-write`) moves the export's regions in
    /// the background while clients read and write it, at most --rate
    /// bytes a second, and yielding to them: while their requests arrive
    /// it copies at most 16 MiB a second (or --rate when lower); the bar
    /// follows it, Ctrl-C leaves it running (stop it with `--stop`).
    Migrate {
        /// The volume's directory (offline: no server may have it open),
        /// or with --server the export's name (default: the only one).
        #[arg(required_unless_present = "server")]
        path: Option<PathBuf>,
        /// The layout to move every region to.
        #[arg(long, value_parser = ["split", "packed"], required_unless_present = "stop")]
        layout: Option<String>,
        /// With --server: at most this many bytes a second (200M = 200 MiB/s;
        /// K, M, G are powers of 1024, KB, MB, GB powers of 1000), the pace
        /// while no client request arrives; while they do, at most 16M
        /// (default: no limit when idle).
        #[arg(long, value_name = "RATE", value_parser = crate::sizes::parse_size, requires = "server")]
        rate: Option<u64>,
        /// With --server: stop the export's running migration between
        /// regions (the regions moved stay moved).
        #[arg(long, requires = "server")]
        stop: bool,
        #[command(flatten)]
        server: offload::client::ServerArgs,
        #[command(flatten)]
        key: key::KeyFileArgs,
    },
    /// Export volumes over NBD (default 127.0.0.1:10809) until SIGINT or
    /// SIGTERM, then finish in-flight requests, flush and close them.
    ///
    /// Under a service manager: with systemd socket activation (LISTEN_PID,
    /// LISTEN_FDS, LISTEN_FDNAMES) it serves the TCP and Unix stream sockets
    /// passed from descriptor 3 on instead of binding any; with
    /// NOTIFY_SOCKET it reports READY=1 once every listener is bound and
    /// every volume is open, STATUS= lines, and STOPPING=1 when a signal
    /// starts a clean stop (a unit can use Type=notify). dist/systemd/ has
    /// vouch.socket and vouch@.service.
    ///
    /// A write is answered once it is buffered and in the volume's held
    /// log: two files in memory that outlive the process (tmpfs), in
    /// $VOUCH_RUNTIME_DIR, else $RUNTIME_DIRECTORY (systemd's
    /// RuntimeDirectory=), else /dev/shm. A crash or `kill -9` of the
    /// server loses no answered write: the next open puts them back. Only a
    /// power cut loses writes not yet flushed, as NBD allows.
    Serve(Box<serve::ServeArgs>),
    /// Verify a range (default: all) without moving its data: every bad
    /// LBA and its fault kind, and with --seed a proof-of-work digest.
    /// Offline on a stopped volume (PATH), or on a running server with
    /// --server (an export name). Exit 0 clean, 1 faults found, 2 error.
    Verify(offload::cli::VerifyArgs),
    /// Scrub a whole volume (verify, resumable from a cursor kept in the
    /// volume directory; the record is shown by --status and `vouch info`).
    /// Offline, or with --server as a background job of the server.
    /// A mirrored volume: every leg is checked and every block bad on one
    /// leg repaired from another (the newer generation wins where two
    /// legs verify but differ), at --rate like any scrub; the report says
    /// found, repaired and left.
    /// Exit 0 clean (or all repaired), 1 faults found or not finished,
    /// 2 error.
    Scrub(offload::cli::ScrubArgs),
    /// Copy a range from SRC to DST (volumes offline, export names with
    /// --server; SRC may equal DST: overlapping ranges copy like memmove).
    /// A mirrored DST (any leg offline, or a mirrored export) is written
    /// through its mirror: every leg gets the blocks. Source blocks are
    /// verified on the way: a corrupt one fails the copy naming its LBA.
    /// Exit 0 copied, 1 a source block is corrupt, 2 error.
    Copy(offload::cli::CopyArgs),
    /// Compare a range with a file's bytes or with another range (NVMe
    /// Compare): equal, or the first differing byte. Exit 0 equal,
    /// 1 differ (or a block failed verification), 2 error.
    Compare(offload::cli::CompareArgs),
    /// Read-only snapshots of a volume: create, list, delete (offline).
    Snapshot {
        #[command(subcommand)]
        command: snapshot::SnapshotCommand,
    },
    /// Make NEWPATH a writable volume from a snapshot
    /// (PATH/snapshots/NAME), sharing its blocks (FICLONE: instant on xfs
    /// and btrfs). It keeps the volume's uuid, to which every block's
    /// protection is bound; its `origin` file names the snapshot.
    Clone {
        /// The snapshot's directory (PATH/snapshots/NAME).
        snapshot: PathBuf,
        /// The new volume's directory (must not exist).
        new_path: PathBuf,
        /// Where the filesystem cannot share blocks (ext4), make a full
        /// copy of the snapshot's files instead (holes kept).
        #[arg(long)]
        copy: bool,
    },
    /// Resize the volume at PATH to SIZE: grow it (the new blocks read as
    /// zeros and take no space until written), or shrink it when every
    /// block past SIZE is unwritten (never written, or trimmed); a shrink
    /// over written data is refused naming its first written LBA. SIZE
    /// like `create --size` (2G = 2 GiB), a multiple of 4096, at most
    /// 1 PiB. A snapshot is read-only (resize a clone of it). A mirror
    /// (PATH any leg) has every leg resized in turn: each must be local,
    /// active and closed cleanly; legs a resize cut short left at
    /// different sizes are refused by the mirror's open, and the resize
    /// run again finishes them. A volume with
    /// regions (after `vouch migrate`) has both its members resized and
    /// its region record with them (new regions in the layout it was
    /// created in). A volume that was not closed cleanly is recovered
    /// first (an encrypted one needs its key for that). Crash-safe: an
    /// interrupted resize leaves the old size or the new one, finished by
    /// the next open (a read-only one too, which then writes: the map,
    /// the record and the other member brought to the size the
    /// superblock says).
    ///
    /// Online: `vouch resize --server ADDR [EXPORT] SIZE` resizes a served
    /// volume (the control API's `POST /v1/exports/{export}/resize`):
    /// clients' requests wait while the engine is closed, resized and
    /// opened again (the command prints how long). NBD has no resize
    /// notice: connections made after it see the new size, connections
    /// already open keep the size they negotiated (after a shrink, their
    /// requests past the new end fail with EINVAL; nothing they wrote
    /// there can be acknowledged, as the tail must be unwritten). A volume
    /// with regions is resized online too: requests wait while both its
    /// members are closed, resized and opened again (refused while a
    /// background migration runs: stop it first). A mirror is resized
    /// online when every leg is local and active (no resync, no
    /// reconciliation or scrub owed): requests wait while every leg is
    /// flushed, closed, resized in turn and opened again, and the
    /// activity log is started again at the new size; a remote leg is
    /// refused (remove it, resize, add it again).
    Resize {
        /// The volume's directory; with --server, the export (optional
        /// when the server has one), then SIZE.
        path: String,
        /// The new size: 2G = 2 GiB; K, M, G, T (and KiB, MiB, GiB, TiB)
        /// are powers of 1024; KB, MB, GB, TB are powers of 1000.
        size: Option<String>,
        #[command(flatten)]
        server: offload::client::ServerArgs,
        #[command(flatten)]
        key: key::KeyFileArgs,
    },
    /// The blocks changed since a snapshot, from the protection information
    /// vouch keeps (each block's context), never from the data: written,
    /// trimmed or zeroed since, or not known (lost metadata). Offline; a
    /// served volume answers `qemu:dirty-bitmap:NAME` over NBD instead.
    Diff {
        /// The snapshot's directory (PATH/snapshots/NAME): changes since it.
        snapshot: PathBuf,
        /// Another snapshot of the same volume (its directory, or its NAME)
        /// to compare with; absent: the volume itself (PATH), stopped.
        to: Option<PathBuf>,
        /// Print JSON: size, block_size, changed_bytes and ranges
        /// (offset, length).
        #[arg(long)]
        json: bool,
    },
    /// Engine benchmark: raw file vs split vs packed, every guard.
    Bench(bench::BenchArgs),
    /// Mirrored volumes: the legs' state and counters, replacing a leg.
    Mirror {
        #[command(subcommand)]
        command: mirror::MirrorCommand,
    },
    /// Remote replicas: `vouch replica serve DIR --listen ADDR:PORT` holds
    /// them for the hosts that export their volumes.
    Replica {
        #[command(subcommand)]
        command: replica::ReplicaCommand,
    },
    /// Manage an encrypted volume's key.
    Key {
        #[command(subcommand)]
        command: key::KeyCommand,
    },
    /// Write a manual page per command into DIR (for packages).
    #[command(hide = true)]
    Man {
        /// The directory to write the pages into (made if missing).
        dir: PathBuf,
    },
}

/// The key and replica options `command` takes; `None` for those it does
/// not take.
struct VolumeOptions<'a> {
    key_file: Option<&'a key::KeyFileArgs>,
    keyless: Option<bool>,
    replica: Option<&'a replica::ReplicaClientArgs>,
}

/// `--key-file` and `--keyless` of a command that checks blocks.
fn checks(key: &key::KeyArgs) -> (Option<&key::KeyFileArgs>, Option<bool>) {
    (Some(&key.file), Some(key.keyless))
}

impl Command {
    fn volume_options(&self) -> VolumeOptions<'_> {
        use mirror::MirrorCommand as M;
        let none = VolumeOptions {
            key_file: None,
            keyless: None,
            replica: None,
        };
        let ((key_file, keyless), replica) = match self {
            Command::Create { key, replica, .. } => ((Some(key), None), Some(replica)),
            Command::Info { key, replica, .. } | Command::Check { key, replica, .. } => {
                (checks(key), Some(replica))
            }
            Command::Import { key, .. }
            | Command::Export { key, .. }
            | Command::Upgrade { key, .. }
            | Command::Resize { key, .. } => ((Some(key), None), None),
            Command::Migrate { key, .. } => ((Some(key), None), None),
            Command::Serve(args) => ((Some(&args.key), None), Some(&args.replica)),
            Command::Verify(args) => (checks(&args.key), None),
            Command::Scrub(args) => (checks(&args.key), Some(&args.replica)),
            Command::Copy(args) => ((Some(&args.key), None), None),
            Command::Compare(args) => ((Some(&args.key), None), None),
            Command::Mirror { command } => match command {
                M::Status { replica, .. } => ((None, None), Some(replica)),
                M::Resync { key, replica, .. }
                | M::Replace { key, replica, .. }
                | M::Add { key, replica, .. } => ((Some(key), None), Some(replica)),
                M::Remove { .. } => return none,
            },
            Command::Key {
                command: key::KeyCommand::Change { key, .. },
            } => ((Some(key), None), None),
            Command::Bench(_)
            | Command::Replica { .. }
            | Command::Man { .. }
            | Command::Clone { .. }
            | Command::Diff { .. } => return none,
            Command::Snapshot { command } => match command {
                snapshot::SnapshotCommand::Create { key, .. } => ((Some(key), None), None),
                _ => return none,
            },
        };
        VolumeOptions {
            key_file,
            keyless,
            replica,
        }
    }

    /// A server: it runs until stopped and writes to clients' sockets.
    fn serves(&self) -> bool {
        matches!(
            self,
            Command::Serve(_)
                | Command::Replica {
                    command: replica::ReplicaCommand::Serve(_)
                }
        )
    }
}

/// The command's key and replica options, with those given before the
/// command (`OptionsBeforeCommand`) filling in what is not given after
/// it. One given before a command that does not take it is an error.
fn volume_options(
    before: &OptionsBeforeCommand,
    command: &Command,
    name: &str,
) -> Result<(key::KeyArgs, replica::ReplicaClientArgs), String> {
    let takes = command.volume_options();
    let refuse = |option: &str| format!("{option} does not apply to `vouch {name}`");
    let mut key = key::KeyArgs::default();
    match takes.key_file {
        Some(args) => key.file.key_file = args.key_file.clone().or(before.key_file.clone()),
        None if before.key_file.is_some() => return Err(refuse("--key-file")),
        None => {}
    }
    match takes.keyless {
        Some(keyless) => key.keyless = keyless || before.keyless,
        None if before.keyless => return Err(refuse("--keyless")),
        None => {}
    }
    let given_before = before.replica_tls_cert.is_some()
        || before.replica_tls_key.is_some()
        || before.replica_tls_ca.is_some()
        || before.replica_timeout.is_some()
        || before.replica_secret_file.is_some();
    let replica = match takes.replica {
        Some(args) => replica::ReplicaClientArgs {
            replica_tls_cert: args
                .replica_tls_cert
                .clone()
                .or(before.replica_tls_cert.clone()),
            replica_tls_key: args
                .replica_tls_key
                .clone()
                .or(before.replica_tls_key.clone()),
            replica_tls_ca: args
                .replica_tls_ca
                .clone()
                .or(before.replica_tls_ca.clone()),
            replica_timeout: args.replica_timeout.or(before.replica_timeout),
            replica_secret_file: args
                .replica_secret_file
                .clone()
                .or(before.replica_secret_file.clone()),
        },
        None if given_before => {
            return Err(refuse(
                "--replica-tls-*/--replica-timeout/--replica-secret-file",
            ))
        }
        None => replica::ReplicaClientArgs::default(),
    };
    Ok((key, replica))
}

/// The subcommand's name as typed, e.g. "mirror status".
fn command_name(matches: &clap::ArgMatches) -> String {
    let mut names = Vec::new();
    let mut current = matches;
    while let Some((name, sub)) = current.subcommand() {
        names.push(name);
        current = sub;
    }
    names.join(" ")
}

/// Set SIGPIPE's disposition: `SIG_DFL` ends the process at a write to a
/// closed pipe, `SIG_IGN` (Rust's start-up choice) makes it fail EPIPE.
fn sigpipe(disposition: libc::sighandler_t) {
    // SAFETY: signal(2) with SIG_DFL or SIG_IGN installs no handler code;
    // called from the main thread before any other thread starts.
    unsafe { libc::signal(libc::SIGPIPE, disposition) };
}

/// Colours for a person at a terminal who has not set NO_COLOR
/// (https://no-color.org: present and not empty).
fn colour_logs() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty())
}

/// Buffers of a few MiB come from the allocator's heaps and stay there
/// when freed, up to 16 MiB free at a heap's top. With glibc's defaults a
/// 1 MiB buffer freed (an NBD READ's reply, sent) is trimmed off its heap
/// or was mapped on its own, so the next one faults every page in again:
/// 48-250 page faults per 1 MiB READ served, a packed 1 MiB sequential
/// read at 1.1-1.3x the server CPU of a process whose heaps happened to
/// keep them (1.5 faults per READ with these). Explicit values also turn
/// off glibc's own adjustment of both, which depended on what the process
/// had freed before: a large mapped buffer freed raised them, and the
/// journal's records (once built whole in one buffer) and 1 MiB write
/// payloads (now received into the held log's landing area) no longer
/// free any.
fn keep_large_buffers() {
    // SAFETY: mallopt with integer arguments, before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 16 << 20);
    }
}

fn main() -> ExitCode {
    keep_large_buffers();
    // A command whose output is cut short (`vouch check VOL | head -1`)
    // ends as Unix filters do: killed by SIGPIPE at its next write to the
    // closed pipe, quietly (the shell sees 141, so a cut-short `check`
    // never reports success it did not deliver). Rust ignores SIGPIPE, so
    // the write would fail and `println!` panic instead. This covers every
    // write to stdout and stderr, help included. Sockets are unaffected:
    // std sends with MSG_NOSIGNAL. Servers keep SIGPIPE ignored (below).
    sigpipe(libc::SIG_DFL);
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit());
    if cli.command.serves() {
        // A server runs for long: a closed stdout or stderr (a supervisor's
        // log pipe) must fail a write, not kill it with every volume open.
        sigpipe(libc::SIG_IGN);
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Logs are plain text unless a person at a terminal reads them.
        .with_ansi(colour_logs())
        .init();
    let (key_options, replica_options) =
        match volume_options(&cli.before, &cli.command, &command_name(&matches)) {
            Ok(options) => options,
            Err(message) => {
                eprintln!("vouch: error: {message}");
                return ExitCode::from(2);
            }
        };
    key::init(key_options);
    replica::init(replica_options);
    let result = match cli.command {
        Command::Create {
            path,
            size,
            mirror: mirrors,
            create,
            ..
        } if !mirrors.is_empty() => mirror::create(&path, &mirrors, size, &create),
        Command::Create {
            path, size, create, ..
        } => commands::create(&path, size, &create),
        Command::Mirror { command } => mirror::run(command),
        Command::Info { path, json, .. } => commands::info(&path, json),
        Command::Check { path, json, .. } => commands::check(&path, json),
        Command::Import {
            raw, path, create, ..
        } => commands::import(&raw, &path, &create),
        Command::Export {
            path,
            raw,
            allow_faults,
            ..
        } => commands::export(&path, &raw, allow_faults),
        Command::Upgrade { path, .. } => commands::upgrade(&path),
        Command::Migrate {
            path,
            layout,
            rate,
            stop,
            server,
            ..
        } => crate::migrate::run_cli(&server, path, layout, rate, stop),
        Command::Serve(args) => serve::run(*args),
        Command::Bench(args) => bench::run(args),
        Command::Verify(args) => offload::cli_ops::verify(args),
        Command::Scrub(args) => offload::cli_ops::scrub(args),
        Command::Copy(args) => offload::cli_ops::copy(args),
        Command::Compare(args) => offload::cli_ops::compare(args),
        Command::Key { command } => key::run(command),
        Command::Snapshot { command } => snapshot::run(command),
        Command::Resize {
            path, size, server, ..
        } => resize::run(&path, size.as_deref(), &server),
        Command::Clone {
            snapshot,
            new_path,
            copy,
        } => snapshot::clone(&snapshot, &new_path, copy),
        Command::Diff { snapshot, to, json } => changed::diff(&snapshot, to.as_deref(), json),
        Command::Replica { command } => replica::run(command),
        Command::Man { dir } => service::man::run(&dir),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("vouch: error: {error:#}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use crate::sizes::{parse_block_bytes, parse_size, parse_volume_size};
    use clap::CommandFactory as _;

    /// Every command and subcommand, with its name as typed.
    fn every_command() -> Vec<(String, clap::Command)> {
        let mut found = Vec::new();
        let mut stack = vec![(String::from("vouch"), Cli::command())];
        while let Some((name, command)) = stack.pop() {
            for sub in command.get_subcommands() {
                stack.push((format!("{name} {}", sub.get_name()), sub.clone()));
            }
            found.push((name, command));
        }
        found
    }

    fn help_of(arg: &clap::Arg) -> String {
        [arg.get_help(), arg.get_long_help()]
            .into_iter()
            .flatten()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_argument_has_a_description() {
        for (name, command) in every_command() {
            for arg in command.get_arguments().filter(|arg| !arg.is_hide_set()) {
                assert!(
                    !help_of(arg).trim().is_empty(),
                    "`{name}`: {} has no description in --help",
                    arg.get_id()
                );
            }
            let positionals = command.get_positionals().count();
            let described = command
                .get_positionals()
                .filter(|arg| !help_of(arg).trim().is_empty())
                .count();
            assert_eq!(
                positionals, described,
                "`{name}`: a positional without a description"
            );
        }
    }

    #[test]
    fn every_size_option_says_how_sizes_read() {
        let mut sizes = 0;
        for (name, command) in every_command() {
            for arg in command.get_arguments().filter(|arg| !arg.is_hide_set()) {
                let names = arg.get_value_names().unwrap_or_default();
                if names
                    .iter()
                    .any(|value| ["SIZE", "BYTES", "RATE"].contains(&value.as_str()))
                {
                    sizes += 1;
                    let help = help_of(arg);
                    assert!(
                        help.contains("powers of 1024") && help.contains("powers of 1000"),
                        "`{name} --{}` takes a size but its help does not say K = 1024, KB = 1000: {help}",
                        arg.get_id()
                    );
                }
            }
        }
        assert!(sizes >= 20, "only {sizes} size options found");
    }

    #[test]
    fn a_size_that_is_not_whole_blocks_is_told_in_its_own_unit() {
        assert_eq!(
            parse_volume_size("2GB"),
            Err("2GB is 2000000000 bytes (GB is decimal; G and GiB are 1024-based): not a positive multiple of 4096".into())
        );
        assert_eq!(parse_volume_size("2G"), Ok(2 << 30));
        assert_eq!(
            parse_volume_size("2gb").map_err(|e| e.contains("gb is decimal; G and GiB")),
            Err(true)
        );
        assert_eq!(
            parse_volume_size("0"),
            Err("0 is not a positive multiple of 4096".into())
        );
        assert!(parse_volume_size("2PiB").is_err_and(|e| e.contains("largest volume")));
        assert_eq!(
            parse_block_bytes("1.5K"),
            Err("1.5K is 1536 bytes: not a multiple of 4096".into())
        );
        assert_eq!(parse_block_bytes("0"), Ok(0));
        assert_eq!(parse_block_bytes("8K"), Ok(8192));
    }

    #[test]
    fn a_bare_unit_letter_is_a_power_of_1024() {
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("1MB"), Ok(1_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("4Q").is_err());
        assert!(parse_size("").is_err());
    }
}
