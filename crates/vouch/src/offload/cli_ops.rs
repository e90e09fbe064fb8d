//! The four offload commands themselves (`cli.rs` has their arguments,
//! progress display and the offline / online runners).

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context as _, Result};
use hyper::Method;
use serde_json::{json, Value};
use vouch_engine::{BlockDevice, BLOCK};

use super::cli::{
    blocks, client, finish, has_faults, offline, online, open, print_faults, CompareArgs, CopyArgs,
    ScrubArgs, VerifyArgs,
};
use super::client::Client;
use super::engine_api::{
    self as engine, CopyMethod, CopyOptions, ProofSeed, ScrubOptions, VerifyOptions,
};
use super::render;

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
            let volume = open_checking(&args.target)?;
            let volume = volume.as_ref();
            let (first, count) = blocks(volume, args.offset.unwrap_or(0), args.length)?;
            let options = VerifyOptions {
                seed,
                segments: args.segments,
                rate_bytes_per_second: args.rate,
            };
            offline("verifying", args.json, |control| {
                engine::verify(volume, first, count, &options, control)
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

/// The volume at `path` opened read-only to verify or scrub it: a volume
/// with regions through its region layer, each block judged by the
/// member serving it.
fn open_checking(path: &str) -> Result<Box<dyn BlockDevice>> {
    if crate::migrate::has_regions(Path::new(path)) {
        let volume = crate::migrate::open_read_only(Path::new(path), crate::key::Use::Verify)
            .with_context(|| format!("opening volume {path}"))?;
        return Ok(Box::new(volume));
    }
    Ok(Box::new(open(path, false, crate::key::Use::Verify)?))
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
                crate::key::volume_dir(Path::new(&name))?;
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
    if client.is_none() && vouch_mirror::is_mirrored(Path::new(&name)) {
        return crate::mirror::scrub(Path::new(&name), args.rate, args.json);
    }
    let ended = match &client {
        Some(client) => online(
            client,
            "scrubbing",
            args.json,
            json!({"op": "scrub", "export": name, "rate": args.rate}),
        )?,
        None => {
            let volume = open_checking(&name)?;
            let volume = volume.as_ref();
            let options = ScrubOptions {
                rate_bytes_per_second: args.rate,
                foreground: None,
            };
            offline("scrubbing", args.json, |control| {
                engine::scrub(volume, Path::new(&name), &options, control)
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
                "length": args.length, "method": args.method, "rate": args.rate,
            });
            online(&client, "copying", args.json, request)?
        }
        None => {
            let destination = Destination::open(&args.destination)?;
            // Closed whatever happens: a mirror left open would count as
            // an unclean stop and be reconciled at its next open.
            let ended = copy_offline(&args, method, &destination);
            let closed = destination.close();
            let ended = ended?;
            closed?;
            ended
        }
    };
    finish(
        ended,
        args.json,
        |result| {
            println!(
                "copied {} blocks ({}: {}) in {:.3} s",
                result["blocks"],
                result["method"].as_str().unwrap_or("?"),
                result["chosen_by"].as_str().unwrap_or("?"),
                result["elapsed_seconds"].as_f64().unwrap_or(0.0)
            )
        },
        |_| false,
    )
}

/// `vouch copy` offline into `destination` (opened from `args.destination`).
fn copy_offline(
    args: &CopyArgs,
    method: CopyMethod,
    destination: &Destination,
) -> Result<super::cli::Ended> {
    let same = std::fs::canonicalize(&args.source).ok()
        == std::fs::canonicalize(&args.destination).ok()
        || destination.has_leg(&args.source);
    let source_volume = if same {
        None
    } else {
        Some(open(&args.source, false, crate::key::Use::Data)?)
    };
    let source: &dyn BlockDevice = match &source_volume {
        Some(volume) => volume,
        None => destination.device(),
    };
    let (source_first, count) = blocks(source, args.source_offset, Some(args.length))?;
    let (destination_first, _) = blocks(
        destination.device(),
        args.destination_offset,
        Some(args.length),
    )?;
    Ok(offline("copying", args.json, |control| {
        let report = engine::copy(
            source,
            source_first,
            destination.device(),
            destination_first,
            count,
            &CopyOptions {
                method,
                rate_bytes_per_second: args.rate,
            },
            control,
        )?;
        destination.device().flush()?;
        Ok(render::copy_json(&report))
    }))
}

/// An offline copy's destination: a volume, or the whole mirror set when
/// the path is one of its legs (every leg gets the blocks, as `check` and
/// `scrub` given a leg use every leg).
enum Destination {
    Volume(vouch_engine::Volume),
    Mirror(crate::mirror::OpenMirror),
}

impl Destination {
    fn open(path: &str) -> Result<Destination> {
        if vouch_mirror::is_mirrored(Path::new(path)) {
            let set = crate::mirror::open(
                Path::new(path),
                vouch_engine::OpenOptions::default(),
                crate::key::Use::Data,
            )
            .with_context(|| format!("opening the mirror of {path}"))?;
            return Ok(Destination::Mirror(set));
        }
        open(path, true, crate::key::Use::Data).map(Destination::Volume)
    }

    /// `path` is a leg of this mirror: a copy from it is a copy within
    /// the mirror (the set holds every leg open).
    fn has_leg(&self, path: &str) -> bool {
        let (Destination::Mirror(set), Ok(path)) = (self, std::fs::canonicalize(path)) else {
            return false;
        };
        set.record
            .members
            .iter()
            .any(|member| std::fs::canonicalize(&member.path).is_ok_and(|leg| leg == path))
    }

    fn device(&self) -> &dyn BlockDevice {
        match self {
            Destination::Volume(volume) => volume,
            Destination::Mirror(set) => &*set.mirror,
        }
    }

    fn close(self) -> Result<()> {
        match self {
            Destination::Volume(volume) => Ok(volume.close()?),
            Destination::Mirror(set) => set.close(),
        }
    }
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
        Some(client) => match &data {
            Some(data) => compare_online_in_pieces(&client, &args, data)?,
            None => {
                let mut request = json!({"op": "compare", "export": args.target, "offset": args.offset, "length": args.length});
                request["other"] = json!({"export": args.with, "offset": args.with_offset});
                online(&client, "comparing", args.json, request)?
            }
        },
        None => {
            let volume = open(&args.target, false, crate::key::Use::Data)?;
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
                        Some(open(&other_path, false, crate::key::Use::Data)?)
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

/// Compare a file's bytes on a server, one request per
/// `api::MAX_COMPARE_DATA` (16 MiB, the most one request carries), stopping
/// at the first piece that differs or fails; its difference is counted from
/// the start of the whole range.
fn compare_online_in_pieces(
    client: &Client,
    args: &CompareArgs,
    data: &[u8],
) -> Result<super::cli::Ended> {
    use base64::Engine as _;
    let mut at = 0usize;
    loop {
        let piece = &data[at..(at + super::api::MAX_COMPARE_DATA).min(data.len())];
        let request = json!({
            "op": "compare",
            "export": args.target,
            "offset": args.offset + at as u64,
            "length": piece.len(),
            "data_base64": base64::engine::general_purpose::STANDARD.encode(piece),
        });
        let mut ended = online(client, "comparing", args.json, request)?;
        let equal = ended
            .result
            .as_ref()
            .is_some_and(|result| result["equal"] == true);
        if !equal || ended.error.is_some() || at + piece.len() >= data.len() {
            if let Some(result) = ended.result.as_mut() {
                if let Some(offset) = result["first_difference"].as_u64() {
                    result["first_difference"] = (offset + at as u64).into();
                }
            }
            return Ok(ended);
        }
        at += piece.len();
    }
}
