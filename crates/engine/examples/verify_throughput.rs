//! Measure verify (with and without the proof-of-work digest) and scrub
//! against a plain sequential read of the volume's data file, all from the
//! page cache. Not a test: numbers for docs/BENCHMARKS.md.
//!
//! ```text
//! cargo run --release -p vouch-engine --example verify_throughput -- DIR [GIB] [ROUNDS]
//! ```
//! creates `DIR/split` and `DIR/packed` (GIB GiB of pseudo-random data
//! each, default 3) if they are missing, then reads each ROUNDS times
//! (default 3) every way and prints the median MiB/s.
//!
//! With `VT_FOREGROUND=MIB_PER_S` it instead measures 4 KiB random reads
//! (one thread, 3 s) alone and while a scrub limited to MIB_PER_S runs with
//! the reader's request count as its foreground counter.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;
use vouch_engine::DeviceWrites;

use vouch_engine::jobs::JobControl;
use vouch_engine::scrub::{scrub, ScrubOptions};
use vouch_engine::verify::{verify, ProofSeed, VerifyOptions};
use vouch_engine::{
    create_volume, open_volume, BlockDevice, CreateOptions, LayoutKind, OpenOptions, BLOCK,
};

fn fill(path: &Path, layout: LayoutKind, bytes: u64) {
    let mut options = CreateOptions::new(bytes);
    options.layout = layout;
    let volume = create_volume(path, &options).expect("create");
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut chunk = vec![0u8; 1 << 20];
    for at in (0..bytes).step_by(chunk.len()) {
        for word in chunk.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        volume.write(at, &chunk, false).expect("write");
    }
    volume.close().expect("close");
}

/// Read every data file of the volume once, 1 MiB at a time.
fn read_files(path: &Path) -> u64 {
    let mut total = 0;
    let mut buffer = vec![0u8; 1 << 20];
    for entry in std::fs::read_dir(path).expect("read_dir") {
        let entry = entry.expect("entry");
        if !entry.file_name().to_string_lossy().starts_with("data.") {
            continue;
        }
        let file = std::fs::File::open(entry.path()).expect("open");
        let mut offset = 0;
        loop {
            let n = file.read_at(&mut buffer, offset).expect("read");
            if n == 0 {
                break;
            }
            offset += n as u64;
        }
        total += offset;
    }
    total
}

/// CPU seconds this thread has used.
fn cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr());
        usage.assume_init()
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// 4 KiB random reads for `seconds`; returns reads per second.
fn random_reads(
    volume: &dyn BlockDevice,
    seconds: f64,
    counter: &std::sync::atomic::AtomicU64,
) -> f64 {
    let blocks = volume.size() / BLOCK;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut block = vec![0u8; BLOCK as usize];
    let started = Instant::now();
    let mut reads = 0u64;
    while started.elapsed().as_secs_f64() < seconds {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        volume
            .read((state % blocks) * BLOCK, &mut block)
            .expect("read");
        reads += 1;
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    reads as f64 / started.elapsed().as_secs_f64()
}

fn foreground(path: &Path, rate_mib: u64) {
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;
    let volume = Arc::new(open_volume(path, &OpenOptions::default()).expect("open"));
    read_files(path);
    let counter = Arc::new(AtomicU64::new(0));
    for _ in 0..2 {
        let alone = random_reads(&*volume, 3.0, &counter);
        let _ = std::fs::remove_file(path.join("scrub.json"));
        let control = Arc::new(JobControl::default());
        let scrubber = {
            let (volume, control, counter) = (volume.clone(), control.clone(), counter.clone());
            let path = path.to_path_buf();
            std::thread::spawn(move || {
                let options = ScrubOptions {
                    rate_bytes_per_second: Some(rate_mib << 20),
                    foreground: Some(Arc::new(move || {
                        counter.load(std::sync::atomic::Ordering::Relaxed)
                    })),
                };
                scrub(&*volume, &path, &options, &control).expect("scrub")
            })
        };
        let during = random_reads(&*volume, 3.0, &counter);
        control.cancel();
        let record = scrubber.join().expect("scrub thread");
        println!(
            "{}: 4 KiB random reads alone {alone:.0}/s, during a {rate_mib} MiB/s scrub {during:.0}/s ({:.2}x); the scrub checked {} blocks",
            path.display(),
            during / alone,
            record.blocks_checked
        );
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().expect("usage: DIR [GIB] [ROUNDS]"));
    let gib: u64 = args.next().map(|a| a.parse().expect("GIB")).unwrap_or(3);
    let rounds: usize = args.next().map(|a| a.parse().expect("ROUNDS")).unwrap_or(3);
    let seed = ProofSeed([7u8; 32]);
    // VT_LAYOUT=split|packed: one layout only (profiling).
    let only = std::env::var("VT_LAYOUT").ok();
    let foreground_rate: Option<u64> = std::env::var("VT_FOREGROUND")
        .ok()
        .map(|r| r.parse().expect("MIB_PER_S"));
    for layout in LayoutKind::ALL {
        if only.as_deref().is_some_and(|name| name != layout.name()) {
            continue;
        }
        let path = dir.join(layout.name());
        if !path.exists() {
            eprintln!("creating {} ({gib} GiB)", path.display());
            fill(&path, layout, gib << 30);
        }
        if let Some(rate) = foreground_rate {
            foreground(&path, rate);
            continue;
        }
        let volume = open_volume(&path, &OpenOptions::default()).expect("open");
        let blocks = volume.size() / BLOCK;
        let mib = (volume.size() >> 20) as f64;
        read_files(&path); // into the page cache
                           // Each way: (wall MiB/s, MiB per CPU second of this thread).
        let mut rates: [Vec<(f64, f64)>; 4] = Default::default();
        let timed = |rates: &mut Vec<(f64, f64)>, run: &mut dyn FnMut()| {
            let (wall, cpu) = (Instant::now(), cpu_seconds());
            run();
            rates.push((
                mib / wall.elapsed().as_secs_f64(),
                mib / (cpu_seconds() - cpu),
            ));
        };
        let digest_options = VerifyOptions {
            seed: Some(seed),
            segments: false,
            rate_bytes_per_second: None,
        };
        for _ in 0..rounds {
            timed(&mut rates[0], &mut || {
                read_files(&path);
            });
            timed(&mut rates[1], &mut || {
                let report = verify(
                    &volume,
                    0,
                    blocks,
                    &VerifyOptions::default(),
                    &JobControl::default(),
                )
                .expect("verify");
                assert!(report.faults.is_empty());
            });
            timed(&mut rates[2], &mut || {
                verify(&volume, 0, blocks, &digest_options, &JobControl::default())
                    .expect("verify");
            });
            let _ = std::fs::remove_file(path.join("scrub.json"));
            timed(&mut rates[3], &mut || {
                scrub(
                    &volume,
                    &path,
                    &ScrubOptions::default(),
                    &JobControl::default(),
                )
                .expect("scrub");
            });
        }
        let wall: Vec<f64> = rates
            .iter()
            .map(|r| median(r.iter().map(|x| x.0).collect()))
            .collect();
        let cpu: Vec<f64> = rates
            .iter()
            .map(|r| median(r.iter().map(|x| x.1).collect()))
            .collect();
        for (what, rate) in [("wall", &wall), ("cpu", &cpu)] {
            println!(
                "{:6} {gib} GiB {what:4} MiB/s: data file read {:.0} | verify {:.0} ({:.2}x file) | verify+digest {:.0} ({:.3}x verify) | scrub {:.0} ({:.2}x file)",
                layout.name(),
                rate[0],
                rate[1],
                rate[1] / rate[0],
                rate[2],
                rate[2] / rate[1],
                rate[3],
                rate[3] / rate[0],
            );
        }
    }
}
