//! Bodies of the cargo-fuzz targets in `fuzz/fuzz_targets/`. They are plain
//! functions so that stable `cargo test` runs them over many seeded random
//! inputs too (see `tests/fuzz_bodies.rs`); a target is one line calling
//! one of these. Each panics (assert) on a broken property: a panic is a
//! finding.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use vouch_engine::DeviceWrites;

use vouch_engine::read_superblock;
use vouch_engine::BlockDevice;
use vouch_engine::{
    CreateOptions, Error, FaultPlan, GuardKind, LayoutKind, ObjectId, OpenOptions, SimStorage,
    Storage, Tuning, Volume,
};
use vouch_format::journal::{decode_entries, encode_record, record_data, JournalHeader};
use vouch_format::{crc32c, Context, JournalEntry, Superblock, CONTEXT_BYTES, SUPERBLOCK_BYTES};

const SMALL_BLOCKS: u64 = 32;

/// Writes `engine_model` saw the inline route take, and requested commits
/// it ran as the background committer, over every call in this process
/// (so a test can tell the production scheduling ran).
pub static ENGINE_MODEL_INLINE_WRITES: AtomicU64 = AtomicU64::new(0);
pub static ENGINE_MODEL_BACKGROUND_COMMITS: AtomicU64 = AtomicU64::new(0);

fn small_tuning() -> OpenOptions {
    OpenOptions {
        read_only: false,
        direct: false,
        tuning: Tuning {
            dirty_limit_blocks: 4,
            context_cache_pages: 1,
            overlay_limit: 8,
            background_commit: false,
            prompt_commits: true,
        },
        key: None,
        keyless: false,
        rebuild_written_map: false,
        region_member: false,
        schedule: None,
    }
}

/// A closed 32-block volume on fresh simulated storage.
fn small_volume(layout: LayoutKind, guard: GuardKind) -> SimStorage {
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(SMALL_BLOCKS * 4096);
    options.layout = layout;
    options.guard = guard;
    options.journal_bytes = Some(1 << 20);
    options.segment_blocks = Some(if layout == LayoutKind::Packed { 31 } else { 16 });
    Volume::create(Arc::new(sim.clone()), &options)
        .and_then(Volume::close)
        .expect("create a small volume");
    sim
}

/// Read every block of an opened volume: data or a clean error, never a panic.
fn read_everything(volume: &Volume) {
    let blocks = volume.geometry().blocks.min(64);
    let mut buf = vec![0u8; 4096];
    for lba in 0..blocks {
        let _ = volume.read(lba * 4096, &mut buf);
    }
    let _ = volume.check(|_, _| {});
}

/// Superblock decoding (and the written map's copy headers), and opening
/// a volume whose superblock is `data`.
/// The first byte picks whether the checksum (and magic, version, block
/// size) are fixed up, so the fuzzer gets past them.
pub fn superblock(data: &[u8]) {
    // The written map's headers (a bits copy, a generations copy) from the
    // same bytes: decode and round trip, never a panic.
    if let Ok(header) = vouch_format::written::WrittenHeader::decode(data) {
        assert_eq!(
            vouch_format::written::WrittenHeader::decode(&header.encode()),
            Ok(header)
        );
    }
    if let Ok(header) = vouch_format::written::GenerationsHeader::decode(data) {
        assert_eq!(
            vouch_format::written::GenerationsHeader::decode(&header.encode()),
            Ok(header)
        );
    }
    if let Ok(decoded) = Superblock::decode(data) {
        assert_eq!(Superblock::decode(&decoded.encode()), Ok(decoded));
        let _ = decoded.geometry();
    }
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut raw = vec![0u8; 4096];
    let n = rest.len().min(SUPERBLOCK_BYTES);
    raw[..n].copy_from_slice(&rest[..n]);
    if mode & 1 == 1 {
        raw[0..8].copy_from_slice(&vouch_format::superblock::MAGIC);
        raw[8..12].copy_from_slice(&1u32.to_le_bytes());
        raw[12..16].copy_from_slice(&(SUPERBLOCK_BYTES as u32).to_le_bytes());
        raw[56..60].copy_from_slice(&4096u32.to_le_bytes());
        if mode & 2 == 2 {
            // Keep sizes small enough that opening does bounded work.
            let size = u64::from_le_bytes(raw[64..72].try_into().expect("8 bytes")) % (1 << 30);
            raw[64..72].copy_from_slice(&size.to_le_bytes());
        }
        let crc = crc32c(&raw[..252]);
        raw[252..256].copy_from_slice(&crc.to_le_bytes());
    }
    let decoded = Superblock::decode(&raw);
    if let Ok(sb) = decoded {
        assert_eq!(Superblock::decode(&sb.encode()), Ok(sb));
    }
    if mode & 4 == 0 {
        return;
    }
    // Open a volume with this superblock (copy 0; copy 1 empty): a clear
    // error or a working volume, never a panic.
    let sim = SimStorage::new();
    sim.overwrite(ObjectId::Superblock, 0, &raw);
    match read_superblock(&sim) {
        Ok(sb) => assert!(decoded.is_ok() && sb == decoded.clone().expect("ok")),
        Err(error) => assert!(!error.to_string().is_empty()),
    }
    if let Ok(volume) = Volume::open(Arc::new(sim), &small_tuning()) {
        read_everything(&volume);
    }
}

/// Context decoding: canonical round trip, and every single-bit flip of a
/// valid context is rejected or decodes to something else.
pub fn context(data: &[u8]) {
    if let Ok(decoded) = Context::decode(data) {
        assert_eq!(Context::decode(&decoded.encode()), Ok(decoded));
    }
    if data.len() < CONTEXT_BYTES + 1 {
        return;
    }
    // Fixed up: a valid Data or Zero context built from the bytes.
    let mut raw = [0u8; CONTEXT_BYTES];
    raw.copy_from_slice(&data[..CONTEXT_BYTES]);
    raw[0] = 1 + (raw[0] & 1);
    raw[1..4].fill(0);
    let crc = crc32c(&raw[..28]);
    raw[28..32].copy_from_slice(&crc.to_le_bytes());
    let decoded = Context::decode(&raw).expect("a fixed-up context decodes");
    assert_eq!(Context::decode(&decoded.encode()), Ok(decoded));
    let bit = usize::from(data[CONTEXT_BYTES]) % (CONTEXT_BYTES * 8);
    let mut flipped = raw;
    flipped[bit / 8] ^= 1 << (bit % 8);
    assert_ne!(Context::decode(&flipped).ok(), Some(decoded), "bit {bit}");
    // A vacant marker from the same bytes binds its LBA and volume: it is
    // that place's and no other's, and any flipped bit unbinds it.
    let tag = u32::from_le_bytes(raw[4..8].try_into().expect("4 bytes"));
    let lba = u64::from_le_bytes(raw[8..16].try_into().expect("8 bytes"));
    let marker = vouch_format::encode_vacant(tag, lba);
    assert!(vouch_format::vacant_of(&marker, tag, lba));
    assert!(!vouch_format::vacant_of(&marker, tag, lba ^ 1));
    assert!(!vouch_format::vacant_of(&marker, tag ^ 1, lba));
    let mut flipped = marker;
    flipped[bit / 8] ^= 1 << (bit % 8);
    assert!(!vouch_format::vacant_of(&flipped, tag, lba), "bit {bit}");
    let _ = vouch_format::vacant_of(data, tag, lba);
}

/// Metadata units (a split context page, a packed row) as damage leaves
/// them: a written volume of a few units has bytes of one unit replaced by
/// `data` (byte 0: bit 0 the layout, the rest the unit; bytes 1..3: the
/// offset in the unit; then the bytes written there), then is opened and
/// read in full. Never a panic; every block of another unit reads what
/// was written (a unit's judgement never spills over); a block of the
/// damaged unit reads what was written there (zeros only if it was never
/// written or was trimmed) or fails with a fault naming it. The bytes decode through the vacant
/// and lost markers, the map's judgement and each layout's read path.
pub fn unit(data: &[u8]) {
    let [mode, low, high, bytes @ ..] = data else {
        return;
    };
    let layout = if mode & 1 == 0 {
        LayoutKind::Split
    } else {
        LayoutKind::Packed
    };
    let (unit_blocks, unit_bytes) = match layout {
        LayoutKind::Split => (128u64, 4096u64),
        LayoutKind::Packed => (31, 128 * 1024),
    };
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(UNIT_BLOCKS * 4096);
    options.layout = layout;
    options.journal_bytes = Some(1 << 20);
    Volume::create(Arc::new(sim.clone()), &options)
        .and_then(Volume::close)
        .expect("create");
    // Every third block left never written, every seventh trimmed: units
    // hold data, vacant markers and zero contexts.
    let mut model = vec![vec![0u8; 4096]; UNIT_BLOCKS as usize];
    let volume = Volume::open(Arc::new(sim.clone()), &small_tuning()).expect("open");
    for lba in 0..UNIT_BLOCKS {
        if lba % 3 == 0 {
            continue;
        }
        let block = vec![(lba as u8) | 1; 4096];
        volume.write(lba * 4096, &block, false).expect("write");
        model[lba as usize] = block;
        if lba % 7 == 0 {
            volume.trim(lba * 4096, 4096, false).expect("trim");
            model[lba as usize] = vec![0u8; 4096];
        }
    }
    volume.close().expect("close");
    let units = UNIT_BLOCKS.div_ceil(unit_blocks);
    let unit = u64::from(mode >> 1) % units;
    let offset = u64::from(u16::from_le_bytes([*low, *high])) % unit_bytes;
    let (object, base) = match layout {
        LayoutKind::Split => (ObjectId::Contexts, unit * unit_bytes),
        LayoutKind::Packed => (ObjectId::Data(0), unit * unit_bytes),
    };
    let len = bytes.len().min((unit_bytes - offset) as usize);
    sim.overwrite(object, base + offset, &bytes[..len]);
    let Ok(volume) = Volume::open(Arc::new(sim), &small_tuning()) else {
        return;
    };
    let damaged = unit * unit_blocks..(unit + 1) * unit_blocks;
    let mut buf = vec![0u8; 4096];
    for lba in 0..UNIT_BLOCKS {
        let read = volume.read(lba * 4096, &mut buf);
        if !damaged.contains(&lba) {
            assert!(read.is_ok(), "LBA {lba} outside the damaged unit: {read:?}");
            assert_eq!(
                buf, model[lba as usize],
                "LBA {lba} outside the damaged unit"
            );
            continue;
        }
        match read {
            Ok(_) => assert_eq!(
                buf, model[lba as usize],
                "LBA {lba} of the damaged unit reads what was not written there"
            ),
            Err(Error::Fault(fault)) => assert_eq!(fault.lba, lba),
            Err(error) => panic!("LBA {lba}: {error}"),
        }
    }
    let _ = volume.check(|_, _| {});
}

/// Blocks of the volume `unit` damages: three split pages, about twelve
/// packed rows.
const UNIT_BLOCKS: u64 = 3 * 128;

/// Journal records: header and entries decode without panics and round
/// trip; a record built from fuzzed entries, with valid checksums, is
/// replayed by `Volume::open` into a clean error or a working volume.
pub fn journal(data: &[u8]) {
    if let Ok(header) = JournalHeader::decode(data) {
        assert_eq!(JournalHeader::decode(&header.encode()), Ok(header));
        if let Ok(entries) = decode_entries(&header, data) {
            assert_eq!(entries.len(), header.entry_count as usize);
            for index in 0..header.data_blocks as usize {
                let _ = record_data(&header, data, index);
            }
        }
    }
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let entries: Vec<JournalEntry> = rest
        .chunks_exact(vouch_format::JOURNAL_ENTRY_BYTES)
        .take(64)
        .filter_map(|chunk| {
            let mut chunk = chunk.to_vec();
            if mode & 1 == 1 {
                // Fix the context checksum so entries decode more often.
                let crc = crc32c(&chunk[16..16 + 28]);
                chunk[16 + 28..16 + 32].copy_from_slice(&crc.to_le_bytes());
            }
            JournalEntry::decode(&chunk).ok()
        })
        .collect();
    let layout = if mode & 2 == 0 {
        LayoutKind::Split
    } else {
        LayoutKind::Packed
    };
    let data_entries = entries
        .iter()
        .filter(|entry| entry.context.carries_data())
        .count();
    let blocks: Vec<Vec<u8>> = (0..data_entries).map(|i| vec![i as u8; 4096]).collect();
    let block_refs: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
    let with_data = (layout == LayoutKind::Packed).then_some(&block_refs[..]);
    let record = encode_record(7, [9; 16], 3, &entries, with_data);
    let header = JournalHeader::decode(&record).expect("an encoded record decodes");
    assert_eq!(decode_entries(&header, &record).expect("entries"), entries);
    if mode & 4 == 0 {
        return;
    }
    // Replay it: a volume whose journal holds this record as the next commit.
    let sim = small_volume(layout, GuardKind::Crc32c);
    let sb = read_superblock(&sim).expect("superblock");
    let entries: Vec<JournalEntry> = if mode & 8 == 0 {
        // Keep LBAs in range most of the time.
        entries
            .into_iter()
            .map(|mut entry| {
                entry.lba %= SMALL_BLOCKS;
                entry.count = entry.count.min((SMALL_BLOCKS - entry.lba) as u32).max(1);
                entry
            })
            .collect()
    } else {
        entries
    };
    let record = encode_record(
        sb.checkpoint_seq + 1,
        sb.uuid,
        sb.checkpoint_seq,
        &entries,
        with_data,
    );
    sim.overwrite(ObjectId::Journal, 0, &record);
    if let Ok(volume) = Volume::open(Arc::new(sim), &small_tuning()) {
        read_everything(&volume);
    }
}

/// The engine against a model, with an I/O error after a fuzzed number of
/// writes: until the error every read returns the newest data; after it,
/// writes and flushes are refused, reads return acknowledged data (or a
/// clean error), a reopen (a process restart: the held log kept) keeps
/// every block at its last acknowledged value or a later one, and a crash
/// image (a power cut) at its last durable value or a later one.
///
/// The volume runs the production scheduling (`crate::stepper`): a
/// background committer the input steps, and the NBD reactor's inline
/// route for whole-block writes without FUA. An operation's byte picks
/// both: bit 6 offers the write to the inline route (its range widened to
/// whole blocks), bit 5 runs the commit it requested afterwards (a failed background commit reaches the
/// client as fail-stopped at its next request).
pub fn engine_model(data: &[u8]) {
    let mut bytes = data.iter().copied();
    let mut next = move || bytes.next();
    let Some(head) = next() else { return };
    let layout = if head & 1 == 0 {
        LayoutKind::Split
    } else {
        LayoutKind::Packed
    };
    let guard = GuardKind::ALL[usize::from(head >> 1) % GuardKind::ALL.len()];
    let countdown = next().unwrap_or(255);
    let sim = small_volume(layout, guard);
    let stepped = crate::stepper::Stepper::new(vouch_engine::OrderingBreaks::default())
        .options(small_tuning().tuning);
    let volume = Volume::open(Arc::new(sim.clone()), &stepped).expect("open");
    if countdown != 255 {
        sim.set_faults(FaultPlan {
            fail_write_after: Some(sim.counts().0 + u64::from(countdown)),
            ..FaultPlan::default()
        });
    }
    let blocks = SMALL_BLOCKS as usize;
    // Per block: values since the last durable one, and the index of the
    // newest acknowledged one.
    let mut values: Vec<Vec<Vec<u8>>> = vec![vec![vec![0u8; 4096]]; blocks];
    let mut acked: Vec<usize> = vec![0; blocks];
    let mut failed = false;
    let mut ops = 0;
    while let (Some(kind), Some(at), Some(len), Some(fill)) = (next(), next(), next(), next()) {
        ops += 1;
        if ops > 48 {
            break;
        }
        let sectors = SMALL_BLOCKS * 8;
        let mut start = (u64::from(at) * 2 + u64::from(fill & 1)) % sectors;
        let mut count = u64::from(len % 24 + 1).min(sectors - start);
        let inline = kind & 0x40 != 0;
        if inline {
            // Offered to the inline route: whole blocks, as it takes them.
            start -= start % 8;
            count = (count.div_ceil(8) * 8).min(sectors - start);
        }
        let (offset, length) = (start * 512, count * 512);
        let fua = kind & 0x80 != 0;
        match kind % 5 {
            0..=2 => {
                let payload: Vec<u8> = (0..length)
                    .map(|i| fill.wrapping_add((i / 512) as u8).wrapping_add(ops as u8))
                    .collect();
                let trim = kind % 5 == 2;
                let touched = apply(&mut values, offset, length, (!trim).then_some(&payload[..]));
                let result = if trim {
                    volume.trim(offset, length, fua)
                } else {
                    let payload = bytes::Bytes::from(payload);
                    crate::stepper::write_as_served(&volume, offset, &payload, fua, inline).map(
                        |took| {
                            if took {
                                ENGINE_MODEL_INLINE_WRITES.fetch_add(1, Ordering::Relaxed);
                            }
                        },
                    )
                };
                settle(&mut values, &mut acked, &touched, &result, fua, &mut failed);
            }
            3 => {
                let result = volume.flush();
                let all: Vec<usize> = (0..blocks).collect();
                settle(&mut values, &mut acked, &all, &result, true, &mut failed);
            }
            _ => {
                let lba = (start / 8) as usize;
                let mut buf = vec![0u8; 4096];
                match volume.read(lba as u64 * 4096, &mut buf) {
                    Ok(_) if failed => assert!(
                        values[lba][acked[lba]..].contains(&buf),
                        "read of LBA {lba} after an I/O error returned unacknowledged data"
                    ),
                    Ok(_) => assert!(
                        *values[lba].last().expect("value") == buf,
                        "read of LBA {lba} differs from the model"
                    ),
                    Err(Error::Fault(fault)) if failed && fault.lba == lba as u64 => {}
                    Err(error) => assert!(failed, "read failed before any fault: {error}"),
                }
            }
        }
        if kind & 0x20 != 0 && volume.run_requested_commit() {
            ENGINE_MODEL_BACKGROUND_COMMITS.fetch_add(1, Ordering::Relaxed);
        }
    }
    drop(volume);
    sim.set_faults(FaultPlan::default());
    // A process restart keeps everything acknowledged (the held log), a
    // power loss everything durable.
    let crashed = sim.crash_image(|_, _, _| 0);
    for (storage, restart) in [(sim, true), (crashed, false)] {
        let volume = Volume::open(Arc::new(storage) as Arc<dyn Storage>, &small_tuning())
            .expect("reopen after the error");
        let mut buf = vec![0u8; 4096];
        for (lba, allowed) in values.iter().enumerate() {
            volume
                .read(lba as u64 * 4096, &mut buf)
                .expect("read after reopen");
            let from = if restart { acked[lba] } else { 0 };
            assert!(
                allowed[from..].contains(&buf),
                "LBA {lba} lost its {} value after {}",
                if restart { "acknowledged" } else { "durable" },
                if restart {
                    "a process restart"
                } else {
                    "a power cut"
                }
            );
        }
    }
}

/// Apply a write (or zeros) to the per-block value lists; returns the blocks touched.
fn apply(values: &mut [Vec<Vec<u8>>], offset: u64, len: u64, data: Option<&[u8]>) -> Vec<usize> {
    let mut touched = Vec::new();
    let mut at = offset;
    while at < offset + len {
        let lba = (at / 4096) as usize;
        let within = (at % 4096) as usize;
        let n = (4096 - within).min((offset + len - at) as usize);
        let mut block = values[lba].last().expect("value").clone();
        match data {
            Some(d) => {
                let from = (at - offset) as usize;
                block[within..within + n].copy_from_slice(&d[from..from + n]);
            }
            None => block[within..within + n].fill(0),
        }
        values[lba].push(block);
        touched.push(lba);
        at += n as u64;
    }
    touched
}

/// After an operation: acknowledge, make durable, or note the failure.
fn settle(
    values: &mut [Vec<Vec<u8>>],
    acked: &mut [usize],
    touched: &[usize],
    result: &Result<(), Error>,
    durable: bool,
    failed: &mut bool,
) {
    match result {
        Ok(()) => {
            assert!(!*failed, "an operation succeeded after an I/O error");
            for lba in touched {
                let newest = values[*lba].len() - 1;
                if durable {
                    values[*lba].drain(..newest);
                    acked[*lba] = 0;
                } else {
                    acked[*lba] = newest;
                }
            }
        }
        Err(error) => {
            if *failed {
                assert!(
                    matches!(error, Error::FailStopped(_) | Error::StoppedFull(_)),
                    "after an I/O error, an operation failed with {error} instead of being refused"
                );
            }
            *failed = true;
        }
    }
}

/// Seed corpora for the targets: (target, file name, bytes).
/// `vouch-sim corpus --out fuzz/corpus` writes them.
pub fn seed_corpus() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    for layout in LayoutKind::ALL {
        let sim = small_volume(layout, GuardKind::Crc32c);
        let sb = read_superblock(&sim).expect("superblock").encode().to_vec();
        out.push(("superblock", format!("{}-raw", layout.name()), sb.clone()));
        for mode in [5u8, 7] {
            let mut seed = vec![mode];
            seed.extend_from_slice(&sb);
            out.push(("superblock", format!("{}-mode{mode}", layout.name()), seed));
        }
    }
    let data = Context::Data {
        volume_tag: 0x1122_3344,
        ref_tag: 5,
        guard: 0xE306_9283,
        generation: 7,
    };
    let zero = Context::Zero {
        volume_tag: 0x1122_3344,
        ref_tag: 6,
        generation: 2,
    };
    for (name, context) in [("data", data), ("zero", zero)] {
        let mut seed = context.encode().to_vec();
        seed.push(77);
        out.push(("context", name.to_string(), seed));
    }
    let entries = [
        JournalEntry {
            lba: 3,
            count: 1,
            context: data,
        },
        JournalEntry {
            lba: 8,
            count: 4,
            context: zero,
        },
    ];
    out.push((
        "journal",
        "record".to_string(),
        encode_record(2, [1; 16], 1, &entries, None),
    ));
    let mut raw = vec![5u8];
    for entry in &entries {
        let mut bytes = [0u8; vouch_format::JOURNAL_ENTRY_BYTES];
        entry.encode_into(&mut bytes);
        raw.extend_from_slice(&bytes);
    }
    out.push(("journal", "replay-split".to_string(), raw.clone()));
    raw[0] = 7;
    out.push(("journal", "replay-packed".to_string(), raw));
    // engine_model: layout/guard byte, write-error countdown, then 4-byte ops.
    // unit: layout and unit byte, offset, then the bytes written there (a
    // blank slot, a foreign vacant marker).
    out.push((
        "unit",
        "split-blank-slot".to_string(),
        vec![2, 64, 0, 0, 0, 0, 0],
    ));
    let mut foreign = vec![3, 0x20, 0x10];
    foreign.extend_from_slice(&vouch_format::encode_vacant(7, 40));
    out.push(("unit", "packed-foreign-vacant".to_string(), foreign));
    out.push((
        "engine_model",
        "split-error-after-3".to_string(),
        vec![0, 3, 0, 0, 8, 1, 0x80, 16, 8, 2, 3, 0, 0, 0, 4, 0, 0, 0],
    ));
    out.push((
        "engine_model",
        "packed-no-error".to_string(),
        vec![3, 255, 1, 5, 20, 9, 3, 0, 0, 0, 2, 4, 30, 0, 4, 4, 0, 0],
    ));
    out
}
