//! Crashes of a replica server (`vouch replica serve`) while it answers an
//! exporter's requests. The server's own routes run, not an imitation:
//! each request is encoded and decoded as the wire carries it, then taken
//! as the socket loop takes it, by the inline route
//! (`vouch_replica::server::try_serve_inline`: a WRITE_SEALED without FUA
//! the replica's write-back buffer has room for) or else the blocking
//! route (`serve_request`: WRITE_SEALED that may wait, with FUA, FLUSH,
//! TRIM). The replica volume runs the production scheduling: its
//! background committer is stepped by the seed (`crate::stepper`), and at
//! each step of a commit, whoever runs it (the committer, a FLUSH, a write
//! that waits), more WRITE_SEALED requests may take the inline route on
//! blocks the request in flight does not touch, as the connection's task
//! answers them in production while a blocking thread or the committer
//! works.
//!
//! Crash points: right before every write, hole punch and sync the replica
//! volume issues (its held log's appends, its journal, its home writes,
//! the flush's syncs), at commit steps, and at every answer the server
//! hands over (`reply`). A crash of the server process keeps every write
//! that returned: every acknowledged write must read back (its value, or
//! a later one in flight). A power cut keeps what was synced: every block
//! reads what the last answered FLUSH (or FUA write of it) made durable, or
//! a write issued since. Each image is recovered as a restart does it and
//! every block is read: a read that fails, or a value no write allows
//! (zeros where a write was acknowledged), is a violation.
//!
//! `RouteBreaks` breaks a route's ordering on purpose (the self-tests):
//! answering a write before it is written, a flush before its commit.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use bytes::Bytes;
use parking_lot::Mutex;
use vouch_engine::{
    BlockDevice, CommitStep, OrderingBreaks, SealedBlock, SealedDevice, SimStorage, Storage, Volume,
};
use vouch_replica::server::{serve_request, try_serve_inline, RouteBreaks};
use vouch_replica::wire::{
    decode_request, encode_request, Request, RequestHeader, ResponseHeader, Status,
    REQUEST_HEADER_BYTES, RESPONSE_HEADER_BYTES,
};

use crate::mirror_write::Allowed;
use crate::recorder::{crash_image, Recorder, Strategy, STRATEGIES};
use crate::rng::Rng;
use crate::stepper::{step_commits, stepped_tuning, Stepper};
use crate::{fingerprint, BLOCK};

/// Blocks in the replica, and requests per seed.
const BLOCKS: u64 = 32;
const OPERATIONS: usize = 16;

/// What a replica-server crash run found.
#[derive(Debug, Default)]
pub struct ReplicaServerReport {
    pub seeds: u64,
    /// Answers the inline route gave (`try_serve_inline`), of them at
    /// commit steps; requests it handed back (to the blocking route, or
    /// at a step not taken).
    pub inline_answers: u64,
    pub inline_at_steps: u64,
    pub declined: u64,
    /// Answers the blocking route gave (`serve_request`), of them FLUSHes
    /// and FUA writes.
    pub blocking_answers: u64,
    pub flushes: u64,
    pub fua_writes: u64,
    /// Requested commits the simulator ran as the background committer,
    /// and commit steps reached.
    pub background_commits: u64,
    pub commit_steps: u64,
    /// Crash points reached, images checked, of them process crashes.
    pub crash_points: u64,
    pub images: u64,
    pub process_images: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl ReplicaServerReport {
    pub fn summary(&self) -> String {
        format!(
            "replica server: seeds={} answers inline={} (at commit steps {}, declined {}) blocking={} (flushes {}, FUA writes {}) background_commits={} commit_steps={} crash_points={} images={} (process {}) violations={} time={:.1}s",
            self.seeds,
            self.inline_answers,
            self.inline_at_steps,
            self.declined,
            self.blocking_answers,
            self.flushes,
            self.fua_writes,
            self.background_commits,
            self.commit_steps,
            self.crash_points,
            self.images,
            self.process_images,
            self.violations.len(),
            self.seconds
        )
    }
}

/// Run seeds `first..first + seeds` with every route in order.
pub fn run(first: u64, seeds: u64) -> ReplicaServerReport {
    run_with(first, seeds, RouteBreaks::NONE)
}

/// `run`, the server's routes breaking `breaks`.
pub fn run_with(first: u64, seeds: u64, breaks: RouteBreaks) -> ReplicaServerReport {
    let started = Instant::now();
    let mut report = ReplicaServerReport::default();
    for seed in first..first + seeds {
        if let Err(message) = run_seed(seed, breaks, &mut report) {
            report.violations.push(format!("seed {seed}: {message}"));
        }
        report.seeds += 1;
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// A crash image and what each block may read in it.
struct Image {
    storage: SimStorage,
    allowed: Allowed,
    process: bool,
    at: String,
}

/// What the workload, the commit steps, the answers and the I/O hook share.
struct World {
    rng: Rng,
    /// What a power cut may leave (`power`), what a crash of the server
    /// process may leave (`process`): a write's value is added to both
    /// before it is sent; its answer makes it the only one a process
    /// crash may leave (and, with FUA, a power cut); a FLUSH's answer
    /// drops from `power` every value older than the newest one as the
    /// FLUSH was sent.
    power: Allowed,
    process: Allowed,
    /// Blocks the request in flight touches: the requests run at commit
    /// steps stay off them (two writes of one block at once have no order
    /// to check; an exporter never sends them, its stripe lock is held).
    busy: Range<u64>,
    /// What the request being answered is (for violations).
    doing: String,
    next_handle: u64,
    images: Vec<Image>,
    counters: Counters,
}

#[derive(Default)]
struct Counters {
    inline_answers: u64,
    inline_at_steps: u64,
    declined: u64,
    commit_steps: u64,
}

impl World {
    /// A crash image now: of the server process (`process`: the storage
    /// as the kernel holds it), or of a power cut (`strategy`).
    fn crash(
        &mut self,
        (sim, order): (&SimStorage, &[vouch_engine::ObjectId]),
        cut: Option<Strategy>,
        at: &str,
    ) {
        let (storage, allowed, process) = match cut {
            None => (sim.duplicate(), self.process.clone(), true),
            Some(strategy) => (
                crash_image(sim, order, strategy, 4096, &mut self.rng),
                self.power.clone(),
                false,
            ),
        };
        let at = format!("{at} ({})", self.doing);
        self.images.push(Image {
            storage,
            allowed,
            process,
            at,
        });
    }

    fn handle(&mut self) -> u64 {
        self.next_handle += 1;
        self.next_handle
    }

    /// A write of `values` from `lba` is sent: each may now be read.
    fn sent(&mut self, lba: u64, values: &[u64]) {
        for (index, value) in values.iter().enumerate() {
            let block = lba as usize + index;
            self.power[block].push(*value);
            self.process[block].push(*value);
        }
    }

    /// That write was answered: a process crash keeps it; with `fua`, a
    /// power cut too.
    fn answered(&mut self, lba: u64, values: &[u64], fua: bool) {
        for (index, value) in values.iter().enumerate() {
            let block = lba as usize + index;
            self.process[block] = vec![*value];
            if fua {
                self.power[block] = vec![*value];
            }
        }
    }
}

/// A request as the server receives it: encoded as an exporter sends it,
/// its header and payload decoded as the socket loop does.
fn through_wire(handle: u64, request: &Request) -> Result<Request, String> {
    let frame = encode_request(handle, request);
    let header: &[u8; REQUEST_HEADER_BYTES] = frame[..REQUEST_HEADER_BYTES]
        .try_into()
        .map_err(|_| "a short request frame".to_string())?;
    let header = RequestHeader::decode(header).map_err(|e| format!("request header: {e}"))?;
    let payload = Bytes::copy_from_slice(&frame[REQUEST_HEADER_BYTES..]);
    decode_request(&header, &payload).map_err(|e| format!("request: {e}"))
}

/// Whether an answer frame says Ok.
fn answered_ok(frame: &[u8]) -> bool {
    frame
        .get(..RESPONSE_HEADER_BYTES)
        .and_then(|bytes| bytes.try_into().ok())
        .and_then(|bytes| ResponseHeader::decode(bytes).ok())
        .is_some_and(|header| header.status == Status::Ok)
}

/// Blocks `[lba, lba + count)` of `data`, sealed by the exporter (here
/// the replica itself seals: same volume, same contexts).
fn sealed(volume: &Volume, lba: u64, data: Vec<u8>) -> Result<Vec<SealedBlock>, String> {
    let generation = volume.generation_clock();
    volume
        .seal_blocks(lba, &Bytes::from(data), generation)
        .map_err(|e| format!("seal: {e}"))
}

/// Store sealed blocks on `volume` as the replica server does (its
/// routes as the socket loop takes them: inline, else blocking), for the
/// simulators whose legs stand for a remote replica
/// (`mirror_write::Travelling`).
pub(crate) fn serve_write(
    volume: &Volume,
    blocks: &[SealedBlock],
    fua: bool,
) -> vouch_engine::Result<()> {
    let request = Request::WriteSealed {
        blocks: blocks.to_vec(),
        fua,
    };
    let mut frame = None;
    if let Err(request) =
        try_serve_inline(volume, 0, request, RouteBreaks::NONE, |f| frame = Some(f))
    {
        serve_request(volume, 0, request, RouteBreaks::NONE, |f| frame = Some(f));
    }
    match frame {
        Some(frame) if answered_ok(&frame) => Ok(()),
        _ => Err(vouch_engine::Error::InvalidArgument(
            "the replica server refused a sealed write".into(),
        )),
    }
}

/// One seed; violations are pushed to `report`, setup errors returned.
pub fn run_seed(
    seed: u64,
    breaks: RouteBreaks,
    report: &mut ReplicaServerReport,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let (allowed, recorder) = prefilled_replica(&mut rng)?;
    let stepper = Stepper::new(OrderingBreaks::default());
    let volume = Volume::open(
        recorder.clone() as Arc<dyn Storage>,
        &stepper.options(stepped_tuning(&mut rng)),
    )
    .map(Arc::new)
    .map_err(|e| format!("the replica does not open: {e}"))?;
    let world = Arc::new(Mutex::new(World {
        rng: rng.fork(),
        power: allowed.clone(),
        process: allowed,
        busy: 0..0,
        doing: "open".into(),
        next_handle: 0,
        images: Vec::new(),
        counters: Counters::default(),
    }));
    let points = Arc::new(AtomicU64::new(0));
    {
        let (world, points) = (Arc::clone(&world), Arc::clone(&points));
        recorder.set_hook(Some(Box::new(move |sim, order| {
            points.fetch_add(1, Ordering::Relaxed);
            let mut world = world.lock();
            if world.rng.chance(1, 2) {
                world.crash((sim, order), None, "process crash at an I/O");
            }
            if world.rng.chance(1, 2) {
                let strategy = STRATEGIES[world.rng.below(STRATEGIES.len() as u64) as usize];
                world.crash((sim, order), Some(strategy), "power cut at an I/O");
            }
        })));
    }
    stepper.set(Some(at_step(
        Arc::clone(&world),
        Arc::downgrade(&volume),
        Arc::clone(&recorder),
        breaks,
    )));

    for _ in 0..OPERATIONS {
        let lba = rng.below(BLOCKS);
        let count = rng.range(1, 5).min(BLOCKS - lba);
        let request = match rng.below(6) {
            0 => {
                report.flushes += 1;
                Operation::Flush
            }
            1 => Operation::Trim { lba, count },
            _ => {
                let fua = rng.chance(1, 5);
                report.fua_writes += u64::from(fua);
                Operation::Write {
                    lba,
                    data: rng.bytes(count as usize * BLOCK),
                    fua,
                }
            }
        };
        let inline = send(&volume, &world, &recorder, request, breaks)?;
        match inline {
            true => report.inline_answers += 1,
            false => report.blocking_answers += 1,
        }
        report.background_commits += step_commits([&*volume], &mut rng);
        // The server process dies between requests.
        let mut guard = world.lock();
        guard.doing = "between requests".into();
        let order = recorder.order();
        guard.crash((&recorder.sim, &order), None, "process crash");
    }
    stepper.set(None);
    recorder.set_hook(None);
    drop(volume);

    let (images, counters) = {
        let mut world = world.lock();
        (
            std::mem::take(&mut world.images),
            std::mem::take(&mut world.counters),
        )
    };
    report.inline_answers += counters.inline_answers;
    report.inline_at_steps += counters.inline_at_steps;
    report.declined += counters.declined;
    report.commit_steps += counters.commit_steps;
    report.crash_points += points.load(Ordering::Relaxed);
    for (index, image) in images.into_iter().enumerate() {
        report.images += 1;
        report.process_images += u64::from(image.process);
        let at = image.at.clone();
        if let Err(message) = check_image(image) {
            report
                .violations
                .push(format!("seed {seed} image {index} {at}: {message}"));
        }
    }
    Ok(())
}

/// A request of the workload.
enum Operation {
    Write { lba: u64, data: Vec<u8>, fua: bool },
    Trim { lba: u64, count: u64 },
    Flush,
}

/// Send one request of the workload and take it as the socket loop does
/// (inline route, else blocking route), the models updated around it and
/// a crash at its answer. Returns whether the inline route answered.
fn send(
    volume: &Volume,
    world: &Mutex<World>,
    recorder: &Recorder,
    operation: Operation,
    breaks: RouteBreaks,
) -> Result<bool, String> {
    let zero = fingerprint(&[0u8; BLOCK]);
    // What the answer changes in the models (`Answered`), set before sending.
    let (request, busy, answered, doing) = {
        let mut world = world.lock();
        match operation {
            Operation::Write { lba, data, fua } => {
                let values: Vec<u64> = data.chunks_exact(BLOCK).map(fingerprint).collect();
                world.sent(lba, &values);
                let count = values.len() as u64;
                let doing = format!("WRITE_SEALED {lba}+{count} fua={fua}");
                drop(world);
                let blocks = sealed(volume, lba, data)?;
                (
                    Request::WriteSealed { blocks, fua },
                    lba..lba + count,
                    Answered::Write { lba, values, fua },
                    doing,
                )
            }
            Operation::Trim { lba, count } => {
                let values = vec![zero; count as usize];
                world.sent(lba, &values);
                (
                    Request::Trim {
                        offset: lba * BLOCK as u64,
                        length: count * BLOCK as u64,
                        fua: false,
                    },
                    lba..lba + count,
                    Answered::Write {
                        lba,
                        values,
                        fua: false,
                    },
                    format!("TRIM {lba}+{count}"),
                )
            }
            Operation::Flush => {
                let newest = world.power.iter().map(|values| values.len()).collect();
                (
                    Request::Flush,
                    0..0,
                    Answered::Flush { newest },
                    "FLUSH".to_string(),
                )
            }
        }
    };
    let handle = {
        let mut world = world.lock();
        world.busy = busy;
        world.doing = doing;
        world.handle()
    };
    let request = through_wire(handle, &request)?;
    let failed: Mutex<Option<String>> = Mutex::new(None);
    let reply = |frame: Vec<u8>| on_answer(world, recorder, &answered, &failed, &frame);
    let inline = match try_serve_inline(volume, handle, request, breaks, reply) {
        Ok(()) => true,
        Err(request) => {
            let reply = |frame: Vec<u8>| on_answer(world, recorder, &answered, &failed, &frame);
            serve_request(volume, handle, request, breaks, reply);
            false
        }
    };
    let mut world = world.lock();
    world.busy = 0..0;
    match failed.into_inner() {
        Some(message) => Err(message),
        None => Ok(inline),
    }
}

/// The server handed over `frame`, the answer to the request in flight:
/// the models take what it promises, and the server process dies right
/// after it (and, for an answer promising durability, the power fails).
fn on_answer(
    world: &Mutex<World>,
    recorder: &Recorder,
    answered: &Answered,
    failed: &Mutex<Option<String>>,
    frame: &[u8],
) {
    let mut world = world.lock();
    if !answered_ok(frame) {
        *failed.lock() = Some(format!("{} was refused", world.doing));
        return;
    }
    let durable = answered.apply(&mut world);
    let order = recorder.order();
    world.crash((&recorder.sim, &order), None, "process crash at the answer");
    if durable {
        world.crash(
            (&recorder.sim, &order),
            Some(Strategy::Dropped),
            "power cut at the answer",
        );
    }
}

/// What an answer makes true.
enum Answered {
    /// A write (or trim) of `values` from `lba` holds.
    Write {
        lba: u64,
        values: Vec<u64>,
        fua: bool,
    },
    /// A flush: every block's value as it was sent (`newest`: how many
    /// values each block had then) or a later one is durable.
    Flush { newest: Vec<usize> },
}

impl Answered {
    /// Apply to the models; `true` when the answer promised durability.
    fn apply(&self, world: &mut World) -> bool {
        match self {
            Answered::Write { lba, values, fua } => {
                world.answered(*lba, values, *fua);
                *fua
            }
            Answered::Flush { newest } => {
                for (values, newest) in world.power.iter_mut().zip(newest) {
                    values.drain(..newest.saturating_sub(1).min(values.len()));
                }
                true
            }
        }
    }
}

/// What a stepped commit runs at each step: up to two WRITE_SEALED
/// requests through the inline route (the connection's task answering
/// them while the commit runs), then, one time in three, a crash.
fn at_step(
    world: Arc<Mutex<World>>,
    volume: Weak<Volume>,
    recorder: Arc<Recorder>,
    breaks: RouteBreaks,
) -> crate::stepper::AtStep {
    Box::new(move |step: CommitStep| {
        let Some(volume) = volume.upgrade() else {
            return;
        };
        let requests = {
            let mut world = world.lock();
            world.counters.commit_steps += 1;
            world.rng.below(3)
        };
        for _ in 0..requests {
            if let Err(message) = inline_at_step(&volume, &world, breaks) {
                let mut world = world.lock();
                let doing = world.doing.clone();
                world.images.push(failed_image(format!(
                    "at a commit step of {doing}: {message}"
                )));
                return;
            }
        }
        let mut world = world.lock();
        if world.rng.chance(1, 3) {
            let order = recorder.order();
            let at = format!("at commit step {step:?}");
            let cut = match world.rng.chance(1, 2) {
                true => None,
                false => Some(STRATEGIES[world.rng.below(STRATEGIES.len() as u64) as usize]),
            };
            world.crash((&recorder.sim, &order), cut, &at);
        }
    })
}

/// An image standing for a failure found while running (checked first).
fn failed_image(message: String) -> Image {
    Image {
        storage: SimStorage::new(),
        allowed: Vec::new(),
        process: false,
        at: message,
    }
}

/// One WRITE_SEALED of 1-4 blocks off the busy ones through the inline
/// route: modelled before it is sent, taken back when the route hands it
/// back (nothing written: in production it goes to a blocking thread).
fn inline_at_step(
    volume: &Volume,
    world: &Mutex<World>,
    breaks: RouteBreaks,
) -> Result<(), String> {
    let (lba, data, values, before) = {
        let mut world = world.lock();
        let count = world.rng.range(1, 5);
        let lba = world.rng.below(BLOCKS - count + 1);
        if world.busy.start < lba + count && lba < world.busy.end {
            return Ok(());
        }
        let data = world.rng.bytes(count as usize * BLOCK);
        let values: Vec<u64> = data.chunks_exact(BLOCK).map(fingerprint).collect();
        let range = lba as usize..(lba + count) as usize;
        let before = (
            world.power[range.clone()].to_vec(),
            world.process[range].to_vec(),
        );
        world.sent(lba, &values);
        (lba, data, values, before)
    };
    let blocks = sealed(volume, lba, data)?;
    let handle = world.lock().handle();
    let request = through_wire(handle, &Request::WriteSealed { blocks, fua: false })?;
    let mut refused = false;
    let taken = try_serve_inline(volume, handle, request, breaks, |frame| {
        if !answered_ok(&frame) {
            refused = true;
            return;
        }
        world.lock().answered(lba, &values, false);
    });
    let mut world = world.lock();
    if refused {
        return Err("an inline WRITE_SEALED was refused".into());
    }
    match taken {
        Ok(()) => {
            world.counters.inline_answers += 1;
            world.counters.inline_at_steps += 1;
        }
        Err(_) => {
            world.counters.declined += 1;
            let range = lba as usize..lba as usize + values.len();
            world.power[range.clone()].clone_from_slice(&before.0);
            world.process[range].clone_from_slice(&before.1);
        }
    }
    Ok(())
}

/// A replica of `BLOCKS` blocks (`mirror_write::prefilled_volume`) on a
/// recording copy: what each block may read and the recorder.
fn prefilled_replica(rng: &mut Rng) -> Result<(Allowed, Arc<Recorder>), String> {
    let (allowed, sim) = crate::mirror_write::prefilled_volume(rng, BLOCKS)?;
    let recorder = Arc::new(Recorder::new(sim.crash_image(|_, _, _| u64::MAX)));
    Ok((allowed, recorder))
}

/// Recover an image as a restart of the server does (it opens the replica)
/// and read every block.
fn check_image(image: Image) -> Result<(), String> {
    if image.allowed.is_empty() {
        return Err("the run failed".into());
    }
    let volume = Volume::open(
        Arc::new(image.storage) as Arc<dyn Storage>,
        &crate::foreground_options(),
    )
    .map_err(|e| format!("the replica does not open: {e}"))?;
    for lba in 0..BLOCKS {
        let mut buf = vec![0u8; BLOCK];
        volume
            .read(lba * BLOCK as u64, &mut buf)
            .map_err(|e| format!("LBA {lba} fails after recovery: {e}"))?;
        let allowed = &image.allowed[lba as usize];
        if !allowed.contains(&fingerprint(&buf)) {
            let zeros = buf.iter().all(|&byte| byte == 0);
            return Err(format!(
                "LBA {lba} reads a value no write allows{} ({} allowed)",
                if zeros { " (zeros)" } else { "" },
                allowed.len()
            ));
        }
    }
    Ok(())
}
