//! `vouch`: create, inspect, verify, convert and serve vouch volumes.

mod bench;
mod commands;
mod export;
mod inject;
mod key;
mod mirror;
mod offload;
mod replica;
mod resync;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// A block store that vouches for every block: each 4 KiB block is stored
/// with protection information (a guard checksum and a reference tag binding
/// it to its LBA), every read is verified, and every fault is reported with
/// its LBA. Volumes are served over NBD to qemu, nbdcopy, nbdfuse, fio and
/// the kernel client.
#[derive(Parser)]
#[command(name = "vouch", version, about, long_about = None, propagate_version = true)]
struct Cli {
    /// Log filter (e.g. "info", "vouch=debug"); also RUST_LOG.
    #[arg(long, global = true, default_value = "info")]
    log: String,
    #[command(flatten)]
    key: key::KeyArgs,
    #[command(flatten)]
    replica: replica::ReplicaClientArgs,
    #[command(subcommand)]
    command: Command,
}

/// How a new volume is laid out.
#[derive(Args, Clone, Debug)]
pub struct CreateArgs {
    /// Context layout: `split` keeps contexts apart from data (DIX-style;
    /// also catches lost writes; lowest write amplification); `packed` keeps
    /// each context in its block's record (one I/O per read; its journal
    /// carries data, so writes cost about twice).
    #[arg(long, default_value = "split", value_parser = ["split", "packed"])]
    pub layout: String,
    /// Guard checksum per block. crc32c (default): hardware CRC, 0.25-0.3 µs
    /// a 4 KiB block on the machine measured, and detects every burst error
    /// up to 32 bits. xxh3 is a little quicker there but is a hash with no
    /// such guarantee; `vouch bench` prints each guard's cost.
    #[arg(long, default_value = "crc32c", value_parser = ["crc32c", "crc64nvme", "crc16t10dif", "xxh3", "none"])]
    pub guard: String,
    /// Journal capacity (default 128MiB split, 64MiB packed).
    #[arg(long, value_parser = parse_size)]
    pub journal: Option<u64>,
    /// Blocks per data segment file (default: 1 TiB of data per file).
    #[arg(long, hide = true)]
    pub segment_blocks: Option<u64>,
    /// Encrypt every block (AES-256-GCM-SIV, bound to the volume and LBA).
    /// The key: --key-file FILE (32 raw bytes) or VOUCH_KEY_FILE, else a
    /// passphrase chosen on the terminal (Argon2id). Every later command
    /// needs the same key; `vouch key change` replaces it.
    #[arg(long)]
    pub encrypt: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Create a new volume directory at PATH (sparse: instant at any size).
    Create {
        path: PathBuf,
        /// Nominal size, e.g. 10GiB, 16TiB, 1048576 (a multiple of 4096).
        #[arg(long, value_parser = parse_size)]
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
    },
    /// Show a volume's geometry, layout, guard, feature flags and usage.
    Info {
        path: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Verify every written block offline (a mirrored volume: every leg,
    /// each alone, without repair). Exit 0 when clean, 1 when faults were
    /// found (each LBA and fault kind listed; lost metadata once per file
    /// cut short and once per context page or packed row lost), 2 on error.
    Check {
        path: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Convert a raw disk image into a new volume (size rounded up to 4 KiB).
    Import {
        raw: PathBuf,
        path: PathBuf,
        #[command(flatten)]
        create: CreateArgs,
    },
    /// Convert a volume into a new raw disk image. Fails naming the faulty
    /// LBAs unless --allow-faults, which zero-fills them.
    Export {
        path: PathBuf,
        raw: PathBuf,
        /// Zero-fill blocks that fail verification instead of failing.
        #[arg(long)]
        allow_faults: bool,
    },
    /// Build a volume's written map from its metadata as it is now
    /// (offline). A volume made before the map (format flag WRITTEN_MAP)
    /// opens read-only until this runs; a volume whose `written` file is
    /// missing or damaged is refused until this runs or the file is
    /// restored (the map is what tells lost metadata from never-written
    /// blocks, so rebuild it only from metadata you trust).
    Upgrade { path: PathBuf },
    /// Export a volume over NBD (default 127.0.0.1:10809).
    Serve(serve::ServeArgs),
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
    /// legs verify but differ); the report says found, repaired and left.
    /// Exit 0 clean (or all repaired), 1 faults found or not finished,
    /// 2 error.
    Scrub(offload::cli::ScrubArgs),
    /// Copy a range from SRC to DST (volumes offline, export names with
    /// --server; SRC may equal DST: overlapping ranges copy like memmove).
    /// Source blocks are verified on the way: a corrupt one fails the copy
    /// naming its LBA. Exit 0 copied, 1 a source block is corrupt, 2 error.
    Copy(offload::cli::CopyArgs),
    /// Compare a range with a file's bytes or with another range (NVMe
    /// Compare): equal, or the first differing byte. Exit 0 equal,
    /// 1 differ (or a block failed verification), 2 error.
    Compare(offload::cli::CompareArgs),
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
}

/// Parse sizes like 10GiB, 512MiB, 4k, 1048576. A bare K, M, G, T, P or E
/// is a power of 1024 (4K = 4096, like dd and qemu-img); KB, MB... are
/// powers of 1000.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    if let Ok(bytes) = trimmed.parse::<u64>() {
        return Ok(bytes);
    }
    let binary;
    let trimmed = match trimmed.chars().last() {
        Some(unit) if "kKmMgGtTpPeE".contains(unit) => {
            binary = format!("{trimmed}iB");
            binary.as_str()
        }
        _ => trimmed,
    };
    let bytes = trimmed
        .parse::<bytesize::ByteSize>()
        .map(|size| size.as_u64())
        .map_err(|_| format!("'{text}' is not a size (examples: 10GiB, 512MiB, 1048576)"))?;
    // A unit size past 2^64 - 1 bytes saturates instead of failing to parse.
    if bytes == u64::MAX {
        return Err(format!(
            "'{text}' is too large (sizes are at most 16 EiB - 1 byte)"
        ));
    }
    Ok(bytes)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal; logs are plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    key::init(cli.key.clone());
    replica::init(cli.replica.clone());
    let result = match cli.command {
        Command::Create {
            path,
            size,
            mirror: mirrors,
            create,
        } if !mirrors.is_empty() => mirror::create(&path, &mirrors, size, &create),
        Command::Create {
            path, size, create, ..
        } => commands::create(&path, size, &create),
        Command::Mirror { command } => mirror::run(command),
        Command::Info { path, json } => commands::info(&path, json),
        Command::Check { path, json } => commands::check(&path, json),
        Command::Import { raw, path, create } => commands::import(&raw, &path, &create),
        Command::Export {
            path,
            raw,
            allow_faults,
        } => commands::export(&path, &raw, allow_faults),
        Command::Upgrade { path } => commands::upgrade(&path),
        Command::Serve(args) => serve::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Verify(args) => offload::cli_ops::verify(args),
        Command::Scrub(args) => offload::cli_ops::scrub(args),
        Command::Copy(args) => offload::cli_ops::copy(args),
        Command::Compare(args) => offload::cli_ops::compare(args),
        Command::Key { command } => key::run(command),
        Command::Replica { command } => replica::run(command),
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
    use super::parse_size;

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
