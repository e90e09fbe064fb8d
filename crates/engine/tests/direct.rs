//! Real files, O_DIRECT data segments and the background committer: a
//! random sequence of writes (any 512-byte alignment), trims, zeroes,
//! flushes and reopens (alternating direct and cached) against a model,
//! for both layouts. Tiny limits make commits and checkpoints constant.

use rand::{rngs::StdRng, Rng, SeedableRng};
use vouch_engine::BlockDevice;
use vouch_engine::DeviceWrites;
use vouch_engine::ZeroFlags;
use vouch_engine::{create_volume, open_volume, CreateOptions, LayoutKind, OpenOptions, Tuning};

const SIZE: u64 = 4 << 20;

fn options(direct: bool) -> OpenOptions {
    OpenOptions {
        read_only: false,
        direct,
        tuning: Tuning {
            dirty_limit_blocks: 16,
            context_cache_pages: 2,
            overlay_limit: 64,
            background_commit: true,
            prompt_commits: true,
        },
        key: None,
        keyless: false,
        rebuild_written_map: false,
        region_member: false,
        schedule: None,
    }
}

fn run(layout: LayoutKind, seed: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("vol");
    let mut create = CreateOptions::new(SIZE);
    create.layout = layout;
    create.journal_bytes = Some(1 << 20);
    create_volume(&path, &create)
        .expect("create")
        .close()
        .expect("close");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut model = vec![0u8; SIZE as usize];
    let mut direct = true;
    let mut volume = open_volume(&path, &options(direct)).expect("open direct");
    for step in 0..600 {
        let sector = rng.gen_range(0..SIZE / 512);
        let max = (SIZE / 512 - sector).min(160);
        let sectors = rng.gen_range(1..=max);
        let (offset, len) = (sector * 512, (sectors * 512) as usize);
        match rng.gen_range(0..100) {
            0..=54 => {
                let byte = rng.gen::<u8>();
                let data: Vec<u8> = (0..len).map(|i| byte ^ (i as u8)).collect();
                volume
                    .write(offset, &data, rng.gen_bool(0.05))
                    .expect("write");
                model[offset as usize..offset as usize + len].copy_from_slice(&data);
            }
            55..=62 => {
                volume.trim(offset, len as u64, false).expect("trim");
                model[offset as usize..offset as usize + len].fill(0);
            }
            63..=68 => {
                volume
                    .write_zeroes(
                        offset,
                        len as u64,
                        ZeroFlags {
                            fua: false,
                            allocate: rng.gen_bool(0.5),
                        },
                    )
                    .expect("zeroes");
                model[offset as usize..offset as usize + len].fill(0);
            }
            69..=72 => volume.flush().expect("flush"),
            73..=74 => {
                volume.close().expect("close");
                direct = !direct;
                volume = open_volume(&path, &options(direct)).expect("reopen");
            }
            _ => {
                let mut buf = vec![0xEEu8; len];
                volume.read(offset, &mut buf).expect("read");
                assert!(
                    buf[..] == model[offset as usize..offset as usize + len],
                    "{layout:?} seed {seed} step {step}: read {offset}+{len} differs (direct={direct})"
                );
            }
        }
    }
    volume.close().expect("close");
    for reopen_direct in [true, false] {
        let volume = open_volume(&path, &options(reopen_direct)).expect("final open");
        let mut all = vec![0u8; SIZE as usize];
        volume.read(0, &mut all).expect("read all");
        assert!(
            all == model,
            "{layout:?} seed {seed}: final contents differ"
        );
        let report = volume.check(|_, _| {}).expect("check");
        assert!(report.faults.is_empty(), "faults: {:?}", report.faults);
        volume.close().expect("close");
    }
}

#[test]
fn split_direct_matches_the_model() {
    for seed in 0..3 {
        run(LayoutKind::Split, seed);
    }
}

#[test]
fn packed_direct_matches_the_model() {
    for seed in 0..3 {
        run(LayoutKind::Packed, seed);
    }
}
