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
use vouch_engine::{open_volume, BlockDevice, OpenOptions, Volume, BLOCK};

use super::client::{Client, ServerArgs};
use super::engine_api::{
    self as engine, CopyMethod, CopyOptions, ProofSeed, ScrubOptions, VerifyOptions,
};
use super::render;
use crate::parse_size;

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// Volume directory (offline) or export name (with --server).
    target: String,
    /// First byte (a multiple of 4096; default 0).
    #[arg(long, value_parser = parse_size)]
    offset: Option<u64>,
    /// Bytes to verify (a multiple of 4096; default: to the end).
    #[arg(long, value_parser = parse_size)]
    length: Option<u64>,
    /// Proof of work: 64 hex digits; the result carries a keyed digest of
    /// the verified data (docs/PROTOCOL.md says how to recompute it).
    #[arg(long, value_name = "HEX")]
    seed: Option<String>,
    /// With --seed: also list one digest per 1 MiB segment.
    #[arg(long, requires = "seed")]
    segments: bool,
    /// Read at most this many bytes per second (e.g. 200M).
    #[arg(long, value_parser = parse_size)]
    rate: Option<u64>,
    #[command(flatten)]
    server: ServerArgs,
    /// Print the result as JSON (no progress).
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct ScrubArgs {
    /// Volume directory (offline) or export name (with --server).
    target: String,
    /// Read at most this many bytes per second.
    #[arg(long, value_parser = parse_size)]
    rate: Option<u64>,
    /// Show the last scrub's record (and a running scrub) instead of scrubbing.
    #[arg(long, conflicts_with = "cancel")]
    status: bool,
    /// Cancel the running scrub (with --server); it resumes from its cursor next time.
    #[arg(long, requires = "server")]
    cancel: bool,
    #[command(flatten)]
    server: ServerArgs,
    /// Print the result as JSON (no progress).
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct CopyArgs {
    /// Source volume directory (offline) or export name (with --server).
    source: String,
    /// Destination volume (may be the source) or export name.
    destination: String,
    /// Bytes to copy (a multiple of 4096).
    #[arg(long, value_parser = parse_size)]
    length: u64,
    #[arg(long, value_parser = parse_size, default_value = "0")]
    source_offset: u64,
    #[arg(long, value_parser = parse_size, default_value = "0")]
    destination_offset: u64,
    /// auto (measure once per volume), reflink or pipelined.
    #[arg(long, default_value = "auto", value_parser = ["auto", "reflink", "pipelined"])]
    method: String,
    #[command(flatten)]
    server: ServerArgs,
    /// Print the result as JSON (no progress).
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("other").required(true).args(["with_file", "with"])))]
pub struct CompareArgs {
    /// Volume directory (offline) or export name (with --server).
    target: String,
    #[arg(long, value_parser = parse_size, default_value = "0")]
    offset: u64,
    /// Bytes to compare (default: the file's length with --with-file).
    #[arg(long, value_parser = parse_size)]
    length: Option<u64>,
    /// Compare with the bytes of this file (at most 16 MiB with --server).
    #[arg(long, value_name = "FILE")]
    with_file: Option<PathBuf>,
    /// Compare with a range of another (or the same) volume / export.
    #[arg(long, value_name = "VOLUME")]
    with: Option<String>,
    #[arg(long, value_parser = parse_size, default_value = "0")]
    with_offset: u64,
    #[command(flatten)]
    server: ServerArgs,
    /// Print the result as JSON (no progress).
    #[arg(long)]
    json: bool,
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
struct Ended {
    state: String,
    result: Option<Value>,
    error: Option<String>,
    /// The error is a block that failed verification.
    fault: bool,
}

/// Run `work` on a thread, showing its progress.
fn offline(
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
fn online(client: &Client, what: &'static str, json: bool, request: Value) -> Result<Ended> {
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

fn client(server: &ServerArgs) -> Result<Option<Client>> {
    server
        .server
        .as_ref()
        .map(|_| Client::new(server))
        .transpose()
}

fn open(path: &str, writable: bool) -> Result<Volume> {
    let options = OpenOptions {
        read_only: !writable,
        ..OpenOptions::default()
    };
    open_volume(Path::new(path), &options).with_context(|| format!("opening volume {path}"))
}

/// Offline range check (the server does the same and answers 400).
fn blocks(volume: &Volume, offset: u64, length: Option<u64>) -> Result<(u64, u64)> {
    let size = volume.size();
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
fn finish(
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

fn print_faults(result: &Value) {
    for fault in result["faults"].as_array().into_iter().flatten() {
        println!(
            "fault: LBA {} {}",
            fault["lba"],
            fault["kind"].as_str().unwrap_or("?")
        );
    }
}

fn has_faults(result: &Value) -> bool {
    result["faults"].as_array().is_some_and(|f| !f.is_empty())
}

pub fn verify(args: VerifyArgs) -> Result<ExitCode> {
    let seed = args.seed.as_deref().map(ProofSeed::from_hex).transpose()?;
    let ended = match client(&args.server)? {
        Some(client) => {
            let request = json!({
                "op": "verify", "export": args.target, "offset": args.offset,
                "length": args.length, "seed": args.seed, "segments": args.segments,
                "rate": args.rate,
            });
            online(&client, "verifying", args.json, request)?
        }
        None => {
            let volume = open(&args.target, false)?;
            let (first, count) = blocks(&volume, args.offset.unwrap_or(0), args.length)?;
            let options = VerifyOptions {
                seed,
                segments: args.segments,
                rate_bytes_per_second: args.rate,
            };
            offline("verifying", args.json, |control| {
                engine::verify(&volume, first, count, &options, control)
                    .map(|r| render::verify_json(&r))
            })
        }
    };
    let target = args.target.clone();
    finish(
        ended,
        args.json,
        |result| {
            print_faults(result);
            for segment in result["segments"].as_array().into_iter().flatten() {
                println!(
                    "segment: LBA {} +{} {}",
                    segment["lba"],
                    segment["count"],
                    segment["digest"].as_str().unwrap_or("")
                );
            }
            if let Some(digest) = result["digest"].as_str() {
                println!("digest: {digest}");
            }
            println!(
                "{target}: {} blocks verified ({} read), {} faults",
                result["blocks"],
                result["blocks_read"],
                result["faults"].as_array().map_or(0, Vec::len)
            );
        },
        has_faults,
    )
}

fn print_scrub(name: &str, record: &Value) {
    print_faults(record);
    println!(
        "{name}: scrub {}: {} of {} blocks checked, cursor {}, {} faults",
        record["state"].as_str().unwrap_or("?"),
        record["blocks_checked"],
        record["blocks_total"],
        record["cursor"],
        record["faults"].as_array().map_or(0, Vec::len)
    );
    if let Some(error) = record["error"].as_str() {
        println!("{name}: error: {error}");
    }
}

/// The server's running scrub job of `export`, if any.
fn running_scrub(client: &Client, export: &str) -> Result<Option<Value>> {
    let jobs = client.call(Method::GET, "/v1/jobs", None)?;
    Ok(jobs["jobs"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|job| {
            job["op"] == "scrub"
                && job["request"]["export"] == export
                && matches!(job["state"].as_str(), Some("queued" | "running"))
        })
        .cloned())
}

pub fn scrub(args: ScrubArgs) -> Result<ExitCode> {
    let name = args.target.clone();
    let client = client(&args.server)?;
    if args.status {
        let (last, running) = match &client {
            Some(client) => {
                let exports = client.call(Method::GET, "/v1/exports", None)?;
                let export = exports["exports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|e| e["name"] == name.as_str())
                    .with_context(|| format!("the server has no export named {name:?}"))?;
                (export["last_scrub"].clone(), running_scrub(client, &name)?)
            }
            None => {
                let record = engine::last_scrub(Path::new(&name))?;
                (
                    record.as_ref().map_or(Value::Null, render::scrub_json),
                    None,
                )
            }
        };
        if args.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"last_scrub": last, "running": running}))?
            );
        } else if last.is_null() {
            println!("{name}: never scrubbed");
        } else {
            print_scrub(&name, &last);
        }
        if let Some(job) = running.filter(|_| !args.json) {
            println!(
                "{name}: job {} {}: {}",
                job["id"],
                job["state"].as_str().unwrap_or("?"),
                job["progress"]
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    if args.cancel {
        let client = client.context("--cancel needs --server")?;
        let job = running_scrub(&client, &name)?
            .with_context(|| format!("no scrub of {name:?} is running"))?;
        let answer = client.call(Method::DELETE, &format!("/v1/jobs/{}", job["id"]), None)?;
        if args.json {
            println!("{answer}");
        } else {
            println!(
                "{name}: scrub job {} cancelled (it resumes from its cursor next time)",
                job["id"]
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let ended = match &client {
        Some(client) => online(
            client,
            "scrubbing",
            args.json,
            json!({"op": "scrub", "export": name, "rate": args.rate}),
        )?,
        None => {
            let volume = open(&name, false)?;
            let options = ScrubOptions {
                rate_bytes_per_second: args.rate,
                foreground: None,
            };
            offline("scrubbing", args.json, |control| {
                engine::scrub(&volume, Path::new(&name), &options, control)
                    .map(|r| render::scrub_json(&r))
            })
        }
    };
    finish(
        ended,
        args.json,
        |record| print_scrub(&name, record),
        |record| has_faults(record) || record["state"] != "finished",
    )
}

pub fn copy(args: CopyArgs) -> Result<ExitCode> {
    let method = CopyMethod::parse(&args.method)?;
    let ended = match client(&args.server)? {
        Some(client) => {
            let request = json!({
                "op": "copy",
                "source": {"export": args.source, "offset": args.source_offset},
                "destination": {"export": args.destination, "offset": args.destination_offset},
                "length": args.length, "method": args.method,
            });
            online(&client, "copying", args.json, request)?
        }
        None => {
            let same = std::fs::canonicalize(&args.source).ok()
                == std::fs::canonicalize(&args.destination).ok();
            let destination = open(&args.destination, true)?;
            let source_volume = if same {
                None
            } else {
                Some(open(&args.source, false)?)
            };
            let source = source_volume.as_ref().unwrap_or(&destination);
            let (source_first, count) = blocks(source, args.source_offset, Some(args.length))?;
            let (destination_first, _) =
                blocks(&destination, args.destination_offset, Some(args.length))?;
            let ended = offline("copying", args.json, |control| {
                let report = engine::copy(
                    source,
                    source_first,
                    &destination,
                    destination_first,
                    count,
                    &CopyOptions { method },
                    control,
                )?;
                destination.flush()?;
                Ok(render::copy_json(&report))
            });
            drop(source_volume);
            destination.close()?;
            ended
        }
    };
    finish(
        ended,
        args.json,
        |result| {
            println!(
                "copied {} blocks ({}) in {:.3} s",
                result["blocks"],
                result["method"].as_str().unwrap_or("?"),
                result["elapsed_seconds"].as_f64().unwrap_or(0.0)
            )
        },
        |_| false,
    )
}

pub fn compare(args: CompareArgs) -> Result<ExitCode> {
    let data = match &args.with_file {
        Some(path) => {
            let bytes =
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            let length = args.length.unwrap_or(bytes.len() as u64);
            if length > bytes.len() as u64 {
                bail!(
                    "{} holds {} bytes, fewer than --length {length}",
                    path.display(),
                    bytes.len()
                );
            }
            Some(bytes[..length as usize].to_vec())
        }
        None => None,
    };
    let ended = match client(&args.server)? {
        Some(client) => {
            let mut request = json!({"op": "compare", "export": args.target, "offset": args.offset, "length": args.length});
            match &data {
                Some(data) => {
                    use base64::Engine as _;
                    request["data_base64"] = base64::engine::general_purpose::STANDARD
                        .encode(data)
                        .into();
                    request["length"] = data.len().into();
                }
                None => request["other"] = json!({"export": args.with, "offset": args.with_offset}),
            }
            online(&client, "comparing", args.json, request)?
        }
        None => {
            let volume = open(&args.target, false)?;
            match data {
                Some(data) => {
                    blocks(&volume, args.offset, Some(data.len() as u64))?;
                    offline("comparing", args.json, |_| {
                        volume.compare(args.offset, &data).map(render::compare_json)
                    })
                }
                None => {
                    let other_path = args.with.clone().context("--with or --with-file")?;
                    let same = std::fs::canonicalize(&args.target).ok()
                        == std::fs::canonicalize(&other_path).ok();
                    let other_volume = if same {
                        None
                    } else {
                        Some(open(&other_path, false)?)
                    };
                    let other = other_volume.as_ref().unwrap_or(&volume);
                    let (first, count) = blocks(&volume, args.offset, args.length)?;
                    let (other_first, _) = blocks(other, args.with_offset, Some(count * BLOCK))?;
                    offline("comparing", args.json, |control| {
                        engine::compare_ranges(&volume, first, other, other_first, count, control)
                            .map(render::compare_json)
                    })
                }
            }
        }
    };
    finish(
        ended,
        args.json,
        |result| match result["first_difference"].as_u64() {
            None => println!("equal"),
            Some(at) => println!(
                "differ: first difference at byte {at} (LBA {})",
                (args.offset + at) / BLOCK
            ),
        },
        |result| result["equal"] == false,
    )
}
