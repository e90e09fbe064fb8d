//! How a new volume is laid out (`create`, `import`, `serve --create`,
//! `mirror create`): the options and the engine's `CreateOptions` of them.

use anyhow::{Context as _, Result};
use clap::Args;
use vouch_engine::{CreateOptions, GuardKind, LayoutKind};

use crate::sizes::parse_size;

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
    /// Journal capacity (default 128MiB split, 64MiB packed; K, M, G are
    /// powers of 1024, KB, MB, GB powers of 1000).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
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

pub fn create_options(size: u64, args: &CreateArgs) -> Result<CreateOptions> {
    let mut options = CreateOptions::new(size);
    options.layout = LayoutKind::from_name(&args.layout).context("unknown layout")?;
    options.guard = GuardKind::from_name(&args.guard).context("unknown guard")?;
    options.journal_bytes = args.journal;
    options.segment_blocks = args.segment_blocks;
    if args.encrypt {
        options.encrypt = Some(crate::key::new_secret()?);
    }
    Ok(options)
}
