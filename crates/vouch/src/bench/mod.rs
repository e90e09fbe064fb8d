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

mod accounting;
mod args;
mod cold;
mod load;
mod machine;
mod matrix;
mod plan;
mod report;
mod scale;
mod target;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;

pub use args::BenchArgs;
use machine::{command_line, machine_facts, machine_line, WorkDir};
use matrix::matrix;
use scale::{scale, scale_child};

const BLOCK: usize = 4096;
const MIB: usize = 1 << 20;

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
