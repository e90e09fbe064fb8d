//! `vouch verify|scrub|copy|compare`: offline on a stopped volume (PATH),
//! or online through a server's control API (`--server ADDR`, export
//! names). Both print the same result: lines for people, `--json` for
//! programs. Exit 0 clean, 1 faults found / compare differs, 2 error.

use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use clap::Args;
use hyper::Method;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use vouch_engine::jobs::JobControl;
use vouch_engine::{BlockDevice, OpenOptions, Volume, BLOCK};

use super::client::{Client, ServerArgs};
use crate::sizes::parse_size;

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// Volume directory (offline) or export name (with --server).
    pub(super) target: String,
    /// First byte (a multiple of 4096; default 0). K, M, G, T (or KiB, MiB, GiB, TiB) are powers of 1024; KB, MB,
    /// GB, TB powers of 1000.
    #[arg(long, value_name = "BYTES", value_parser = crate::sizes::parse_block_bytes)]
    pub(super) offset: Option<u64>,
    /// Bytes to verify (a multiple of 4096; default: to the end). K, M, G, T are
    /// powers of 1024, KB, MB, GB, TB powers of 1000.
    #[arg(long, value_name = "BYTES", value_parser = crate::sizes::parse_block_bytes)]
    pub(super) length: Option<u64>,
    /// Proof of work: 64 hex digits; the result carries a keyed digest of
    /// the verified data (docs/PROTOCOL.md says how to recompute it).
    #[arg(long, value_name = "HEX")]
    pub(super) seed: Option<String>,
    /// With --seed: also list one digest per 1 MiB segment.
    #[arg(long, requires = "seed")]
    pub(super) segments: bool,
    /// Read at most this many bytes per second (e.g. 200M = 200 MiB/s).
    /// K, M, G, T (or KiB, MiB, GiB, TiB) are powers of 1024; KB, MB,
    /// GB, TB powers of 1000.
    #[arg(long, value_name = "RATE", value_parser = parse_size)]
    pub(super) rate: Option<u64>,
    #[command(flatten)]
    pub(super) server: ServerArgs,
    /// Print the result as JSON (no progress).
    #[arg(long)]
    pub(super) json: bool,
    #[command(flatten)]
    pub key: crate::key::KeyArgs,
}

#[derive(Args, Debug)]
pub struct ScrubArgs {
    /// Volume directory (offline) or export name (with --server).
    pub(super) target: String,
    /// Read at most this many bytes per second (e.g. 200M = 200 MiB/s).
    /// K, M, G, T (or KiB, MiB, GiB, TiB) are powers of 1024; KB, MB,
    /// GB, TB powers of 1000.
    #[arg(long, value_name = "RATE", value_parser = parse_size)]
    pub(super) rate: Option<u64>,
    /// Show the last scrub's record (and a running scrub) instead of scrubbing.
    #[arg(long, conflicts_with = "cancel")]
    pub(super) status: bool,
    /// Cancel the running scrub (with --server); it resumes from its cursor next time.
    #[arg(long, requires = "server")]
    pub(super) cancel: bool,
    #[command(flatten)]
    pub(super) server: ServerArgs,
    /// Print the result as JSON (no progress).
    #[arg(long)]
    pub(super) json: bool,
    #[command(flatten)]
    pub key: crate::key::KeyArgs,
    #[command(flatten)]
    pub replica: crate::replica::ReplicaClientArgs,
}

#[derive(Args, Debug)]
pub struct CopyArgs {
    /// Source volume directory (offline) or export name (with --server).
    pub(super) source: String,
    /// Destination volume (may be the source) or export name.
    pub(super) destination: String,
    /// Bytes to copy (a multiple of 4096). K, M, G, T (or KiB, MiB, GiB, TiB) are powers of 1024; KB, MB,
    /// GB, TB powers of 1000.
    #[arg(long, value_name = "BYTES", value_parser = crate::sizes::parse_block_bytes)]
    pub(super) length: u64,
    /// First byte read from SOURCE (a multiple of 4096). K, M, G, T are
    /// powers of 1024, KB, MB, GB, TB powers of 1000.
    #[arg(long, value_name = "BYTES", value_parser = crate::sizes::parse_block_bytes, default_value = "0")]
    pub(super) source_offset: u64,
    /// First byte written in DESTINATION (a multiple of 4096). K, M, G, T are
    /// powers of 1024, KB, MB, GB, TB powers of 1000.
    #[arg(long, value_name = "BYTES", value_parser = crate::sizes::parse_block_bytes, default_value = "0")]
    pub(super) destination_offset: u64,
    /// auto (measure once per volume), reflink or pipelined.
    #[arg(long, default_value = "auto", value_parser = ["auto", "reflink", "pipelined"])]
    pub(super) method: String,
    /// Copy at most this many bytes per second (e.g. 200M = 200 MiB/s).
    /// K, M, G, T (or KiB, MiB, GiB, TiB) are powers of 1024; KB, MB,
    /// GB, TB powers of 1000.
    #[arg(long, value_name = "RATE", value_parser = parse_size)]
    pub(super) rate: Option<u64>,
    #[command(flatten)]
    pub(super) server: ServerArgs,
    /// Print the result as JSON (no progress).
    #[arg(long)]
    pub(super) json: bool,
    #[command(flatten)]
    pub key: crate::key::KeyFileArgs,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("other").required(true).args(["with_file", "with"])))]
pub struct CompareArgs {
    /// Volume directory (offline) or export name (with --server).
    pub(super) target: String,
    /// First byte compared (a multiple of 4096). K, M, G, T (or KiB, MiB, GiB, TiB) are powers of 1024; KB, MB,
    /// GB, TB powers of 1000.
    #[arg(long, value_name = "BYTES", value_parser = crate::sizes::parse_block_bytes, default_value = "0")]
    pub(super) offset: u64,
    /// Bytes to compare (default: the file's length with --with-file). K, M, G, T are
    /// powers of 1024, KB, MB, GB, TB powers of 1000.
    #[arg(long, value_name = "BYTES", value_parser = crate::sizes::parse_block_bytes)]
    pub(super) length: Option<u64>,
    /// Compare with the bytes of this file (with --server, sent 16 MiB per request).
    #[arg(long, value_name = "FILE")]
    pub(super) with_file: Option<PathBuf>,
    /// Compare with a range of another (or the same) volume / export.
    #[arg(long, value_name = "VOLUME")]
    pub(super) with: Option<String>,
    /// First byte of the --with range (a multiple of 4096). K, M, G, T are
    /// powers of 1024, KB, MB, GB, TB powers of 1000.
    #[arg(long, value_name = "BYTES", value_parser = crate::sizes::parse_block_bytes, default_value = "0")]
    pub(super) with_offset: u64,
    #[command(flatten)]
    pub(super) server: ServerArgs,
    /// Print the result as JSON (no progress).
    #[arg(long)]
    pub(super) json: bool,
    #[command(flatten)]
    pub key: crate::key::KeyFileArgs,
}

/// Progress on stderr: a bar on a terminal, a line every few seconds
/// otherwise, nothing with --json.
struct Progress {
    bar: Option<ProgressBar>,
    plain: bool,
    what: &'static str,
    last: Instant,
}

impl Progress {
    fn new(what: &'static str, json: bool) -> Progress {
        let terminal = std::io::stderr().is_terminal();
        let bar = (!json && terminal).then(|| {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
                )
                .expect("static template")
                .progress_chars("=> "),
            );
            bar.set_message(what);
            bar
        });
        Progress {
            bar,
            plain: !json && !terminal,
            what,
            last: Instant::now(),
        }
    }

    fn update(&mut self, done: u64, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total * BLOCK);
            bar.set_position(done * BLOCK);
        } else if self.plain && total > 0 && self.last.elapsed() >= Duration::from_secs(2) {
            self.last = Instant::now();
            eprintln!(
                "{}: {done} of {total} blocks ({}%)",
                self.what,
                done * 100 / total
            );
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// How a job ended, online or offline.
pub(super) struct Ended {
    state: String,
    pub(super) result: Option<Value>,
    pub(super) error: Option<String>,
    /// The error is a block that failed verification.
    fault: bool,
}

/// Run `work` on a thread, showing its progress.
pub(super) fn offline(
    what: &'static str,
    json: bool,
    work: impl FnOnce(&JobControl) -> vouch_engine::Result<Value> + Send,
) -> Ended {
    let control = JobControl::default();
    let mut progress = Progress::new(what, json);
    let outcome = std::thread::scope(|scope| {
        let handle = scope.spawn(|| work(&control));
        while !handle.is_finished() {
            let (done, total) = control.progress();
            progress.update(done, total);
            std::thread::sleep(Duration::from_millis(100));
        }
        handle.join().unwrap_or_else(|_| {
            Err(vouch_engine::Error::InvalidArgument(format!(
                "the {what} thread panicked"
            )))
        })
    });
    progress.finish();
    match outcome {
        Ok(result) => Ended {
            state: result["state"].as_str().unwrap_or("finished").to_string(),
            result: Some(result),
            error: None,
            fault: false,
        },
        Err(error) => Ended {
            state: "failed".into(),
            result: None,
            fault: error.fault().is_some(),
            error: Some(error.to_string()),
        },
    }
}

/// Start a job on the server and follow it to its end.
pub(super) fn online(
    client: &Client,
    what: &'static str,
    json: bool,
    request: Value,
) -> Result<Ended> {
    let created = client.call(Method::POST, "/v1/jobs", Some(&request))?;
    let id = created["id"]
        .as_u64()
        .context("the server's answer has no job id")?;
    let mut progress = Progress::new(what, json);
    let job = loop {
        let job = client.call(Method::GET, &format!("/v1/jobs/{id}?wait=1"), None)?;
        let done = job["progress"]["done_blocks"].as_u64().unwrap_or(0);
        let total = job["progress"]["total_blocks"].as_u64().unwrap_or(0);
        progress.update(done, total);
        if !matches!(job["state"].as_str(), Some("queued" | "running")) {
            break job;
        }
    };
    progress.finish();
    Ok(Ended {
        state: job["state"].as_str().unwrap_or("unknown").to_string(),
        result: Some(job["result"].clone()).filter(|r| !r.is_null()),
        error: job["error"].as_str().map(str::to_string),
        fault: !job["fault"].is_null(),
    })
}

pub(super) fn client(server: &ServerArgs) -> Result<Option<Client>> {
    server
        .server
        .as_ref()
        .map(|_| Client::new(server))
        .transpose()
}

/// Open a volume offline, with its key if it is encrypted (`key::open`;
/// `purpose` says whether `--keyless` may stand in for it).
pub(super) fn open(path: &str, writable: bool, purpose: crate::key::Use) -> Result<Volume> {
    if writable && vouch_mirror::is_mirrored(Path::new(path)) {
        anyhow::bail!(
            "{path} is a leg of a mirror: writing one leg alone would make the legs differ; serve the volume and use --server"
        );
    }
    let options = OpenOptions {
        read_only: !writable,
        ..OpenOptions::default()
    };
    crate::key::open(Path::new(path), options, purpose)
        .with_context(|| format!("opening volume {path}"))
}

/// Offline range check (the server does the same and answers 400).
pub(super) fn blocks(
    device: &dyn BlockDevice,
    offset: u64,
    length: Option<u64>,
) -> Result<(u64, u64)> {
    let size = device.size();
    let length = length.unwrap_or(size.saturating_sub(offset));
    if !offset.is_multiple_of(BLOCK) || !length.is_multiple_of(BLOCK) {
        bail!("offset {offset} and length {length} must be multiples of {BLOCK}");
    }
    if length == 0 {
        bail!("length is 0: nothing to do");
    }
    if offset.checked_add(length).is_none_or(|end| end > size) {
        bail!("range {offset}+{length} is past the end of the volume ({size} bytes)");
    }
    Ok((offset / BLOCK, length / BLOCK))
}

/// Print an ended job and choose the exit code; `faulty` says whether a
/// finished result counts as "faults found / differs".
pub(super) fn finish(
    ended: Ended,
    json: bool,
    human: impl Fn(&Value),
    faulty: impl Fn(&Value) -> bool,
) -> Result<ExitCode> {
    match ended.result {
        Some(result) if ended.error.is_none() => {
            if json {
                println!("{}", serde_json::to_string_pretty(&result)?);
            } else {
                human(&result);
            }
            Ok(if faulty(&result) || ended.state == "failed" {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            })
        }
        _ => {
            let message = ended
                .error
                .unwrap_or_else(|| format!("the job ended {}", ended.state));
            if ended.fault {
                if json {
                    println!(
                        "{}",
                        json!({"state": ended.state, "error": message, "fault": true})
                    );
                }
                eprintln!("vouch: {message}");
                Ok(ExitCode::from(1))
            } else {
                Err(anyhow!(message))
            }
        }
    }
}

pub(super) fn print_faults(result: &Value) {
    for fault in result["faults"].as_array().into_iter().flatten() {
        println!(
            "fault: LBA {} {}",
            fault["lba"],
            fault["kind"].as_str().unwrap_or("?")
        );
    }
}

pub(super) fn has_faults(result: &Value) -> bool {
    result["faults"].as_array().is_some_and(|f| !f.is_empty())
}
