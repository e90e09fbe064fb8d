//! Copy next to the data: blocks move from one device (or one range) to
//! another without passing through a client, verified on the way, with
//! their destination contexts re-tagged for the new LBAs. Source and
//! destination are any `BlockDevice` (a volume, a mirror, a layer); two
//! volumes (`AsVolume`) may also take the reflink fast path.
//!
//! Two methods:
//! - **pipelined** (`copy/pipelined.rs`, any device, any layout): segments of 1 MiB,
//!   a reader thread verifying source segments ahead of the writer, a
//!   bounded number of segments in flight (the "slots" of the NVMe simple
//!   copy discussion). The destination writes are ordinary writes: sealed
//!   for their new LBAs, buffered, committed like any write.
//! - **reflink** (`copy/reflink.rs`, two volumes, split layout, one
//!   filesystem that shares extents): the source blocks are read and verified, the
//!   destination's new contexts journaled (ORDER POINT A), then the data
//!   extents are shared with `FICLONERANGE` as the "home write", then the
//!   contexts published — the crash contract of a write (CRASH_MODEL.md).
//!
//! `Auto` picks once per (destination, source) pair and caches the choice
//! in the destination's engine, by measuring (as the kernel's RAID xor
//! benchmark picks its routine): `MEASURE_BYTES` of the source's first
//! data segment written to a nameless scratch file beside the destination
//! and synced, then cloned there and synced; reflink when it can work and
//! the clone was faster, pipelined otherwise. Both methods read and verify
//! every source block, so the landing is what differs. The report says
//! which method ran and why.

mod pipelined;
mod reflink;
mod source;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::device::BlockDevice;
use crate::error::{Error, Result};
use crate::jobs::{JobControl, Pace, Visit};
use crate::verify::check_block_range;
use crate::volume::{AsVolume, Volume};

/// How `copy` moves the blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMethod {
    /// Pick by measuring once per volume (cached), like the kernel's RAID xor benchmark.
    Auto,
    /// FICLONERANGE data extents, then rewrite only the contexts (split layout, same filesystem).
    Reflink,
    /// Segmented copy, several segments in flight, bounded memory.
    Pipelined,
}

impl CopyMethod {
    /// The method's name: "auto", "reflink" or "pipelined".
    pub fn name(self) -> &'static str {
        match self {
            CopyMethod::Auto => "auto",
            CopyMethod::Reflink => "reflink",
            CopyMethod::Pipelined => "pipelined",
        }
    }

    /// The method named `text`; anything else is `InvalidArgument`.
    pub fn parse(text: &str) -> Result<CopyMethod> {
        match text {
            "auto" => Ok(CopyMethod::Auto),
            "reflink" => Ok(CopyMethod::Reflink),
            "pipelined" => Ok(CopyMethod::Pipelined),
            other => Err(Error::InvalidArgument(format!(
                "unknown copy method {other:?}: expected auto, reflink or pipelined"
            ))),
        }
    }
}

/// How to copy.
#[derive(Clone, Debug)]
pub struct CopyOptions {
    pub method: CopyMethod,
    /// Bytes per second copied at most (`None`: as fast as it goes), the
    /// jobs' `Pace::Fixed`: either method waits between its steps.
    pub rate_bytes_per_second: Option<u64>,
}

impl CopyOptions {
    /// Copy by `method`, as fast as it goes.
    pub fn with(method: CopyMethod) -> CopyOptions {
        CopyOptions {
            method,
            rate_bytes_per_second: None,
        }
    }
}

impl Default for CopyOptions {
    fn default() -> CopyOptions {
        CopyOptions::with(CopyMethod::Auto)
    }
}

/// Bytes `Auto` writes and clones to choose a method (see module doc).
pub const MEASURE_BYTES: u64 = 4 << 20;

/// What a copy did.
#[derive(Clone, Debug)]
pub struct CopyReport {
    /// The method actually used (never `Auto`).
    pub method: CopyMethod,
    /// Why: "forced", or what `Auto` measured or found.
    pub chosen_by: String,
    /// Blocks copied.
    pub blocks: u64,
    pub elapsed: Duration,
    /// Times the copy waited for its rate (`JobControl::paced_waits`).
    pub paced_waits: u64,
}

/// The method `Auto` chose for each source volume (by UUID), kept in the
/// destination volume so the probe runs once per pair.
#[derive(Default)]
pub struct MethodCache {
    chosen: Mutex<HashMap<[u8; 16], (CopyMethod, String)>>,
}

/// Copy `count` blocks from `source` LBA `source_first` to `destination`
/// LBA `destination_first` (may be the same device: memmove semantics when
/// the ranges overlap). Source blocks verified; a corrupt source block fails
/// the copy naming its LBA (Error::Fault / the engine's fault error) and is
/// never written anywhere. Destination contexts re-tagged for the new LBAs.
/// Crash contract = writes: each destination block reads old or new, never
/// a mix of data and context; durable after a flush. Progress and cancel via
/// `control` (progress in blocks; cancelled -> Err naming how far it got,
/// every block before that copied, none after it half-copied), paced by
/// `options.rate_bytes_per_second`: a `jobs::Visit` over the blocks to
/// copy, with no cursor (a copy is not resumed: it is asked for again).
pub fn copy(
    source: &dyn BlockDevice,
    source_first: u64,
    destination: &dyn BlockDevice,
    destination_first: u64,
    count: u64,
    options: &CopyOptions,
    control: &JobControl,
) -> Result<CopyReport> {
    let started = Instant::now();
    check_block_range(source, source_first, count)?;
    check_block_range(destination, destination_first, count)?;
    match destination.as_volume() {
        Some(volume) => volume.engine().check_writable()?,
        None if destination.is_read_only() => {
            return Err(Error::ReadOnly(" (the copy's destination)".into()))
        }
        None => {}
    }
    let job = Job {
        source,
        source_first,
        destination,
        destination_first,
        count,
        control,
        volumes: source.as_volume().zip(destination.as_volume()),
    };
    let (method, chosen_by) = choose(&job, options.method)?;
    let pace = Pace::fixed(options.rate_bytes_per_second);
    let mut run = Visit::begin(control, 0..count, pace, None, None)?;
    if job.overlap_shift() == Some(0) {
        // A range onto itself: nothing moves, but a corrupt source block
        // still fails the copy, as any copy's would.
        pipelined::verify_only(&job, &mut run)?;
    } else if count > 0 {
        match method {
            CopyMethod::Reflink => reflink::run(
                &job,
                job.volumes
                    .ok_or_else(|| Error::Unsupported(reflink::NOT_VOLUMES.to_string()))?,
                &mut run,
            )?,
            _ => pipelined::run(&job, &mut run)?,
        }
    }
    Ok(CopyReport {
        method,
        chosen_by,
        blocks: count,
        elapsed: started.elapsed(),
        paced_waits: control.paced_waits(),
    })
}

/// One copy request, as the methods see it.
pub(crate) struct Job<'a> {
    pub source: &'a dyn BlockDevice,
    pub source_first: u64,
    pub destination: &'a dyn BlockDevice,
    pub destination_first: u64,
    pub count: u64,
    pub control: &'a JobControl,
    /// Both ends are volumes: the reflink path and `Auto`'s measurement
    /// are open to the job.
    pub volumes: Option<(&'a Volume, &'a Volume)>,
}

impl Job<'_> {
    /// Source and destination are one device.
    pub fn same_volume(&self) -> bool {
        match self.volumes {
            Some((source, destination)) => {
                std::sync::Arc::ptr_eq(&source.engine(), &destination.engine())
            }
            None => std::ptr::addr_eq(self.source, self.destination),
        }
    }

    /// The ranges overlap in one volume and the destination starts inside
    /// the source: copy from the end backwards (memmove).
    pub fn backwards(&self) -> bool {
        self.same_volume()
            && self.destination_first > self.source_first
            && self.destination_first < self.source_first + self.count
    }

    /// Blocks between the two ranges' starts, when they overlap in one
    /// volume (a copy step must not be longer, or it would overwrite
    /// source blocks it has not read).
    pub fn overlap_shift(&self) -> Option<u64> {
        let shift = self.source_first.abs_diff(self.destination_first);
        (self.same_volume() && shift < self.count).then_some(shift)
    }

    /// The error of a copy cancelled with `done` blocks copied.
    pub fn cancelled(&self, done: u64) -> Error {
        let copied = if done == 0 {
            "nothing was copied".to_string()
        } else if self.backwards() {
            let end = self.destination_first + self.count;
            format!("destination blocks {}..{end} are copied", end - done)
        } else {
            format!(
                "destination blocks {}..{} are copied",
                self.destination_first,
                self.destination_first + done
            )
        };
        Error::Cancelled(format!(
            "copy cancelled after {done} of {} blocks: {copied}, the rest of the destination is unchanged",
            self.count
        ))
    }
}

/// The method to use, and why: forced ones are checked (a reflink that
/// cannot work is an error, never a silent fallback); `Auto` measures once
/// per pair (module doc).
fn choose(job: &Job<'_>, requested: CopyMethod) -> Result<(CopyMethod, String)> {
    match requested {
        CopyMethod::Pipelined => Ok((CopyMethod::Pipelined, "forced".to_string())),
        CopyMethod::Reflink => match reflink::possible(job) {
            Ok(_) => Ok((CopyMethod::Reflink, "forced".to_string())),
            Err(why) => Err(Error::Unsupported(format!(
                "reflink copy is not possible here: {why} (use the pipelined or auto method)"
            ))),
        },
        CopyMethod::Auto => {
            // A small shift inside one volume would clone in tiny steps.
            if let Some((_, destination)) = job.volumes {
                let piece = reflink::piece_blocks(&destination.engine());
                if job.overlap_shift().is_some_and(|shift| shift < piece) {
                    let why = format!("a shift of less than {piece} blocks within one volume");
                    return Ok((CopyMethod::Pipelined, why));
                }
            }
            let Some((source, destination)) = job.volumes else {
                return Ok((CopyMethod::Pipelined, reflink::NOT_VOLUMES.to_string()));
            };
            let cache = &destination.copy_methods().chosen;
            let key = source.engine().shared().uuid();
            if let Some(chosen) = cache.lock().get(&key) {
                return Ok(chosen.clone());
            }
            let chosen = measure(job);
            tracing::info!(method = chosen.0.name(), why = %chosen.1, "copy: method chosen");
            cache.lock().insert(key, chosen.clone());
            Ok(chosen)
        }
    }
}

/// `Auto`'s measurement for a pair whose choice is not cached yet.
fn measure(job: &Job<'_>) -> (CopyMethod, String) {
    let volumes = match reflink::possible(job) {
        Ok(volumes) => volumes,
        Err(why) => {
            return (
                CopyMethod::Pipelined,
                format!("reflink not possible: {why}"),
            )
        }
    };
    let engines = (volumes.0.engine(), volumes.1.engine());
    let source = engines.0.shared().io();
    let destination = engines.1.shared().io();
    let timing = destination.storage().measure_clone(
        source.storage(),
        crate::storage::ObjectId::Data(0),
        MEASURE_BYTES,
    );
    match timing {
        Err(error) => (
            CopyMethod::Pipelined,
            format!("reflink not measurable: {error}"),
        ),
        Ok(timing) => {
            let method = if timing.clone < timing.write {
                CopyMethod::Reflink
            } else {
                CopyMethod::Pipelined
            };
            let why = format!(
                "measured {} KiB: cloned and synced in {:.3} ms, written and synced in {:.3} ms",
                timing.bytes / 1024,
                timing.clone.as_secs_f64() * 1e3,
                timing.write.as_secs_f64() * 1e3
            );
            (method, why)
        }
    }
}
