//! Generating the load: a cheap per-thread RNG, queue-depth threads issuing
//! synchronous I/O until a deadline, and the sequential prefill.

use std::time::{Duration, Instant};

use anyhow::Result;
use vouch_engine::direct::AlignedBuf;

use super::plan::Workload;
use super::target::Target;
use super::MIB;

/// xorshift64*: cheap, one per thread.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Rng {
        // splitmix64 of the seed, never zero.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub(super) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
    pub(super) fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let value = self.next().to_le_bytes();
            chunk.copy_from_slice(&value[..chunk.len()]);
        }
    }
}

pub(super) struct Timed {
    pub(super) ops: u64,
    pub(super) io_secs: f64,
    pub(super) flush_secs: f64,
}

pub(super) fn run_workload(
    target: &Target,
    workload: Workload,
    size: u64,
    seconds: f64,
    seed: u64,
) -> Result<Timed> {
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let results: Vec<Result<u64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workload.qd)
            .map(|thread| {
                scope.spawn(move || {
                    worker(
                        target,
                        workload,
                        size,
                        deadline,
                        seed.wrapping_mul(1000) + thread as u64,
                        thread,
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("benchmark worker panicked"))
            .collect()
    });
    let io_secs = start.elapsed().as_secs_f64();
    let mut ops = 0;
    for result in results {
        ops += result?;
    }
    let mut flush_secs = 0.0;
    if workload.is_write() {
        let flush_start = Instant::now();
        target.flush()?;
        flush_secs = flush_start.elapsed().as_secs_f64();
    }
    Ok(Timed {
        ops,
        io_secs,
        flush_secs,
    })
}

pub(super) fn worker(
    target: &Target,
    workload: Workload,
    size: u64,
    deadline: Instant,
    seed: u64,
    thread: usize,
) -> Result<u64> {
    let io = workload.io_size() as u64;
    let mut rng = Rng::new(seed);
    // Page-aligned, as O_DIRECT on the raw file needs (--direct).
    let mut buf = AlignedBuf::zeroed(io as usize);
    rng.fill(&mut buf);
    let units = size / io;
    let per_thread = (units / workload.qd as u64).max(1);
    let region = (thread as u64 * per_thread) % units.max(1);
    let mut position = 0u64;
    let mut ops = 0u64;
    while Instant::now() < deadline {
        let unit = if workload.is_random() {
            rng.below(units)
        } else {
            let unit = (region + position) % units;
            position = (position + 1) % per_thread;
            unit
        };
        let offset = unit * io;
        if workload.is_write() {
            // Every write carries different bytes.
            buf[..8].copy_from_slice(&(seed ^ ops).to_le_bytes());
            target.write(offset, &buf)?;
        } else {
            target.read(offset, &mut buf)?;
        }
        ops += 1;
    }
    Ok(ops)
}

pub(super) fn prefill(target: &Target, size: u64) -> Result<f64> {
    let start = Instant::now();
    let mut rng = Rng::new(size);
    let mut buf = AlignedBuf::zeroed(MIB);
    rng.fill(&mut buf);
    let mut offset = 0u64;
    while offset < size {
        let n = (size - offset).min(MIB as u64) as usize;
        buf[..8].copy_from_slice(&offset.to_le_bytes());
        target.write(offset, &buf[..n])?;
        offset += n as u64;
    }
    target.flush()?;
    Ok(start.elapsed().as_secs_f64())
}
