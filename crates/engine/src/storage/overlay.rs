//! An overlay snapshot's storage (docs/FORMAT.md, "Overlay snapshots";
//! docs/CRASH_MODEL.md): a read-only `Storage` whose superblock and
//! journal are the snapshot's own files, and whose data segments, context
//! table and written map are the volume's live files seen through the
//! snapshot's before-image log (`storage/before.rs`).
//!
//! A block of an imaged file reads as its *first* image in the log when
//! it has one (its bytes at the fence), else as the live file's bytes
//! (never written since the fence). The live file is read first and the
//! log's index brought up to date after: a live read that saw bytes newer
//! than the fence saw them after their image was appended and synced (the
//! layer issues no home write before), so the image is found and wins.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use parking_lot::Mutex;

use super::before::{
    is_imaged, read_records, scan_log_from, BeforeLog, LogEnd, IMAGE_BLOCK, SCAN_PIECE,
};
use super::{ObjectId, Storage};

/// Where each imaged block's first image is in the log, read so far.
#[derive(Default)]
struct Index {
    /// Bytes of whole records read from the log's start.
    end: u64,
    /// (object, block offset) -> offset in the log of its first image.
    first: BTreeMap<(ObjectId, u64), u64>,
}

/// The overlay (see the module's comment).
pub struct OverlayStorage {
    /// The snapshot's own objects: its superblock and journal.
    own: Arc<dyn Storage>,
    /// The volume's live files (data segments, contexts, written map).
    live: Arc<dyn Storage>,
    log: Box<dyn BeforeLog>,
    fence: u64,
    /// Each imaged object's length at the fence: bytes past it read as
    /// zeros, whatever the live file holds there now.
    lengths: HashMap<ObjectId, u64>,
    index: Mutex<Index>,
}

fn read_only() -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        "an overlay snapshot is read-only",
    )
}

impl OverlayStorage {
    /// The overlay of `live` through `log` (fence `fence`), the imaged
    /// objects' lengths at the fence `lengths`, its superblock and journal
    /// in `own`.
    pub fn new(
        own: Arc<dyn Storage>,
        live: Arc<dyn Storage>,
        log: Box<dyn BeforeLog>,
        fence: u64,
        lengths: HashMap<ObjectId, u64>,
    ) -> OverlayStorage {
        OverlayStorage {
            own,
            live,
            log,
            fence,
            lengths,
            index: Mutex::default(),
        }
    }

    /// Bytes of the log (the snapshot's space).
    pub fn log_bytes(&self) -> io::Result<u64> {
        self.log.bytes()
    }

    fn length(&self, object: ObjectId) -> u64 {
        self.lengths.get(&object).copied().unwrap_or(0)
    }

    /// The index with every whole record appended since it was last
    /// read; a torn or growing tail waits for the next call.
    fn refreshed(&self) -> io::Result<parking_lot::MutexGuard<'_, Index>> {
        let mut index = self.index.lock();
        let len = self.log.bytes()?;
        if len > index.end {
            // In pieces from where the last look ended, never the whole
            // tail in memory.
            let mut found = Vec::new();
            let scanned = match scan_log_from(
                &*self.log,
                self.fence,
                index.end,
                SCAN_PIECE,
                &mut |record| found.push(*record),
            ) {
                Ok(scanned) => scanned,
                // Cut meanwhile (a torn tail the volume's open removed).
                Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => return Ok(index),
                Err(error) => return Err(error),
            };
            if let LogEnd::Corrupt { at, .. } = scanned.end {
                // Never the live bytes for a block whose image was lost.
                return Err(io::Error::other(format!(
                    "the overlay's before-image log is damaged at byte {at}: a record does not read whole and valid records follow"
                )));
            }
            for record in found {
                for block in 0..(record.len / IMAGE_BLOCK) {
                    let at = record.payload_at + block * IMAGE_BLOCK;
                    let key = (record.object, record.offset + block * IMAGE_BLOCK);
                    index.first.entry(key).or_insert(at);
                }
            }
            index.end = scanned.valid;
        }
        Ok(index)
    }
}

impl Storage for OverlayStorage {
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if !is_imaged(object) {
            return self.own.read_at(object, offset, buf);
        }
        let end = offset + buf.len() as u64;
        let fenced = self.length(object).clamp(offset, end);
        let live = (fenced - offset) as usize;
        // ORDER POINT: the live bytes first, the log after (module comment).
        self.live.read_at(object, offset, &mut buf[..live])?;
        buf[live..].fill(0);
        if live == 0 {
            return Ok(());
        }
        let from = offset - offset % IMAGE_BLOCK;
        let images: Vec<(u64, u64)> = self
            .refreshed()?
            .first
            .range((object, from)..(object, fenced))
            .map(|(&(_, block), &at)| (block, at))
            .collect();
        for (block, at) in images {
            let start = block.max(offset);
            let stop = (block + IMAGE_BLOCK).min(fenced);
            let into = &mut buf[(start - offset) as usize..(stop - offset) as usize];
            self.log.read_at(at + (start - block), into)?;
        }
        Ok(())
    }
    // Read-only: what `own` (files opened read-only) answers.
    fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
        self.own.write_at(object, offset, data)
    }
    fn sync(&self, object: ObjectId) -> io::Result<()> {
        self.own.sync(object)
    }
    fn punch_hole(&self, object: ObjectId, offset: u64, len: u64) -> io::Result<()> {
        self.own.punch_hole(object, offset, len)
    }
    fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>> {
        if !is_imaged(object) {
            return self.own.next_data(object, offset);
        }
        let fenced = self.length(object);
        if offset >= fenced {
            return Ok(None);
        }
        // Data live, or a block imaged (it held data at the fence, or
        // may have: an image of a hole is zeros, which is still "may").
        let live = self
            .live
            .next_data(object, offset)?
            .filter(|&at| at < fenced);
        let from = offset - offset % IMAGE_BLOCK;
        let imaged = self
            .refreshed()?
            .first
            .range((object, from)..(object, fenced))
            .next()
            .map(|(&(_, block), _)| block.max(offset));
        Ok(match (live, imaged) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        })
    }
    fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64> {
        match object {
            // The snapshot's own space: its files and its log.
            ObjectId::Superblock => Ok(self.own.allocated_bytes(object)? + self.log.bytes()?),
            object if is_imaged(object) => Ok(0),
            object => self.own.allocated_bytes(object),
        }
    }
    fn object_len(&self, object: ObjectId) -> io::Result<Option<u64>> {
        if is_imaged(object) {
            return Ok(Some(self.length(object)));
        }
        self.own.object_len(object)
    }
}

/// Where `log` (of `fence`) is damaged: a record that does not read
/// whole with a valid record of the fence somewhere after it (a synced
/// record was lost, not a torn tail: `LogEnd::Corrupt`). `None` when it
/// reads whole or ends in a tear (damage to the very last record cannot
/// be told from one).
pub fn damaged_at(log: &[u8], fence: u64) -> Option<u64> {
    match read_records(log, fence).1.end {
        LogEnd::Corrupt { at, .. } => Some(at),
        LogEnd::Whole | LogEnd::Torn { .. } => None,
    }
}

/// Files opened read-only, by object: an overlay's own files, or the
/// volume's live ones (opened without the volume's lock, which its
/// server holds: the overlay never writes them).
pub struct ReadFiles {
    files: HashMap<ObjectId, File>,
}

impl ReadFiles {
    pub fn new(files: HashMap<ObjectId, File>) -> ReadFiles {
        ReadFiles { files }
    }

    fn file(&self, object: ObjectId) -> io::Result<&File> {
        self.files.get(&object).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} is not part of this overlay", object.file_name()),
            )
        })
    }
}

impl Storage for ReadFiles {
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let file = self.file(object)?;
        let mut done = 0;
        while done < buf.len() {
            match FileExt::read_at(file, &mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        // Past the end of the file: zeros.
        buf[done..].fill(0);
        Ok(())
    }
    fn write_at(&self, _object: ObjectId, _offset: u64, _data: &[u8]) -> io::Result<()> {
        Err(read_only())
    }
    fn sync(&self, _object: ObjectId) -> io::Result<()> {
        Ok(())
    }
    fn punch_hole(&self, _object: ObjectId, _offset: u64, _len: u64) -> io::Result<()> {
        Err(read_only())
    }
    fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>> {
        super::file::next_data_of(self.file(object)?, offset)
    }
    fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64> {
        use std::os::unix::fs::MetadataExt as _;
        Ok(self.file(object)?.metadata()?.blocks() * 512)
    }
    fn object_len(&self, object: ObjectId) -> io::Result<Option<u64>> {
        Ok(Some(self.file(object)?.metadata()?.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::before::{BeforeImages, SimLog, RECORD_HEADER_BYTES};
    use crate::storage::sim::SimStorage;
    use crate::storage::Run;
    use rand::{Rng as _, SeedableRng as _};

    const FENCE: u64 = 0x0e7a;
    const OBJECTS: [ObjectId; 4] = [
        ObjectId::Data(0),
        ObjectId::Data(1),
        ObjectId::Contexts,
        ObjectId::Written,
    ];
    const OBJECT_BYTES: u64 = 16 * IMAGE_BLOCK;

    fn bytes_of(storage: &dyn Storage, object: ObjectId) -> Vec<u8> {
        let mut bytes = vec![0u8; OBJECT_BYTES as usize];
        storage.read_at(object, 0, &mut bytes).unwrap();
        bytes
    }

    fn lengths() -> HashMap<ObjectId, u64> {
        OBJECTS.iter().map(|&o| (o, OBJECT_BYTES)).collect()
    }

    /// Random files, synced: the volume at its fence.
    fn fenced_volume(rng: &mut rand::rngs::StdRng) -> (SimStorage, Vec<Vec<u8>>) {
        let sim = SimStorage::new();
        for object in OBJECTS {
            let bytes: Vec<u8> = (0..OBJECT_BYTES).map(|_| rng.gen()).collect();
            sim.write_at(object, 0, &bytes).unwrap();
            sim.sync(object).unwrap();
        }
        let fenced = OBJECTS.iter().map(|&o| bytes_of(&sim, o)).collect();
        (sim, fenced)
    }

    /// Random writes, punches and batches through the armed layer over
    /// the volume's files; after each, a crash (every home write issued
    /// landed, the log only as synced) and the overlay of the crashed
    /// files through the durable log, read whole and in odd pieces,
    /// must equal the files at the fence. Returns the crash points where
    /// it did not.
    fn run(seed: u64, overlay_reads_live_only: bool) -> usize {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (sim, fenced) = fenced_volume(&mut rng);
        let log = SimLog::default();
        let layer = BeforeImages::new(Arc::new(sim.clone()));
        assert_eq!(
            layer.arm(Box::new(log.clone()), FENCE).unwrap(),
            LogEnd::Whole
        );
        let mut wrong = 0;
        for _ in 0..40 {
            let object = OBJECTS[rng.gen_range(0..OBJECTS.len())];
            let offset = rng.gen_range(0..OBJECT_BYTES - 3 * IMAGE_BLOCK);
            let len = rng.gen_range(1..3 * IMAGE_BLOCK);
            let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            match rng.gen_range(0..3) {
                0 => layer.write_at(object, offset, &data).unwrap(),
                1 => layer.punch_hole(object, offset & !4095, 4096).unwrap(),
                _ => {
                    let parts: [&[u8]; 1] = [&data];
                    layer
                        .write_runs(
                            object,
                            &[Run {
                                offset,
                                parts: &parts,
                            }],
                        )
                        .unwrap();
                }
            }
            let crashed = sim.crash_image(|_, _, _| u64::MAX);
            let durable = if overlay_reads_live_only {
                SimLog::default()
            } else {
                SimLog::from_bytes(log.durable())
            };
            let overlay = OverlayStorage::new(
                Arc::new(SimStorage::new()),
                Arc::new(crashed),
                Box::new(durable),
                FENCE,
                lengths(),
            );
            for (&object, at_fence) in OBJECTS.iter().zip(&fenced) {
                let whole = bytes_of(&overlay, object);
                let from = rng.gen_range(0..OBJECT_BYTES - 1);
                let piece = rng.gen_range(1..(OBJECT_BYTES - from).min(3 * IMAGE_BLOCK));
                let mut part = vec![0u8; piece as usize];
                overlay.read_at(object, from, &mut part).unwrap();
                if whole != *at_fence
                    || part[..] != at_fence[from as usize..(from + piece) as usize]
                {
                    wrong += 1;
                }
            }
        }
        wrong
    }

    #[test]
    fn every_crash_point_reads_the_fence_through_the_overlay() {
        for seed in 0..20 {
            assert_eq!(run(seed, false), 0, "seed {seed}");
        }
    }

    #[test]
    fn an_overlay_without_the_log_is_caught() {
        assert!(run(1, true) > 0);
    }

    /// The live files, where a write through the layer lands at the
    /// start of each live read (as a writer racing a reader would): the
    /// overlay must still read the fence.
    struct Racing {
        sim: SimStorage,
        layer: std::sync::OnceLock<Arc<BeforeImages>>,
        writes: Mutex<Vec<(ObjectId, u64)>>,
    }

    impl Storage for Racing {
        fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
            if let Some((object, at)) = self.writes.lock().pop() {
                let layer = self.layer.get().expect("set");
                layer.write_at(object, at, &[0xa5; 4096])?;
            }
            self.sim.read_at(object, offset, buf)
        }
        fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
            self.sim.write_at(object, offset, data)
        }
        fn sync(&self, object: ObjectId) -> io::Result<()> {
            self.sim.sync(object)
        }
        fn punch_hole(&self, object: ObjectId, offset: u64, len: u64) -> io::Result<()> {
            self.sim.punch_hole(object, offset, len)
        }
        fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>> {
            self.sim.next_data(object, offset)
        }
        fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64> {
            self.sim.allocated_bytes(object)
        }
    }

    /// A write that lands between the overlay's look at the log and its
    /// read of the live file is still not seen: the live file is read
    /// first, the log after (read the other way round, each of these
    /// reads would see the write's bytes).
    #[test]
    fn a_write_racing_a_read_is_not_seen() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (sim, fenced) = fenced_volume(&mut rng);
        let log = SimLog::default();
        let layer = Arc::new(BeforeImages::new(Arc::new(sim.clone())));
        assert_eq!(
            layer.arm(Box::new(log.clone()), FENCE).unwrap(),
            LogEnd::Whole
        );
        let writes: Vec<(ObjectId, u64)> = (0..OBJECT_BYTES / IMAGE_BLOCK)
            .flat_map(|block| OBJECTS.map(|object| (object, block * IMAGE_BLOCK)))
            .collect();
        let racing = Arc::new(Racing {
            sim,
            layer: std::sync::OnceLock::new(),
            writes: Mutex::new(writes.clone()),
        });
        let _ = racing.layer.set(layer);
        let overlay = OverlayStorage::new(
            Arc::new(SimStorage::new()),
            racing.clone(),
            Box::new(log),
            FENCE,
            lengths(),
        );
        for (object, at) in writes.into_iter().rev() {
            let which = OBJECTS.iter().position(|&o| o == object).unwrap();
            let mut block = vec![0u8; IMAGE_BLOCK as usize];
            overlay.read_at(object, at, &mut block).unwrap();
            let at = at as usize;
            assert_eq!(
                block,
                fenced[which][at..at + IMAGE_BLOCK as usize],
                "{object:?} {at}"
            );
        }
        assert!(racing.writes.lock().is_empty());
    }

    /// A record damaged in the middle of the log (valid ones after it)
    /// fails every read of the overlay: never the live bytes.
    #[test]
    fn a_log_damaged_mid_way_fails_reads() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (sim, _) = fenced_volume(&mut rng);
        let log = SimLog::default();
        let layer = BeforeImages::new(Arc::new(sim.clone()));
        assert_eq!(
            layer.arm(Box::new(log.clone()), FENCE).unwrap(),
            LogEnd::Whole
        );
        for block in [1u64, 5, 9] {
            layer
                .write_at(ObjectId::Data(0), block * IMAGE_BLOCK, &[9; 4096])
                .unwrap();
        }
        let mut bytes = log.durable();
        assert_eq!(damaged_at(&bytes, FENCE), None);
        // The second record's payload.
        bytes[RECORD_HEADER_BYTES + 4096 + RECORD_HEADER_BYTES + 7] ^= 1;
        assert_eq!(
            damaged_at(&bytes, FENCE),
            Some((RECORD_HEADER_BYTES + 4096) as u64)
        );
        let overlay = OverlayStorage::new(
            Arc::new(SimStorage::new()),
            Arc::new(sim),
            Box::new(SimLog::from_bytes(bytes.clone())),
            FENCE,
            lengths(),
        );
        let mut block = vec![0u8; 4096];
        assert!(overlay.read_at(ObjectId::Data(0), 0, &mut block).is_err());
        // The last record cut short is a tear, not damage.
        let mut torn = log.durable();
        torn.truncate(torn.len() - 100);
        assert_eq!(damaged_at(&torn, FENCE), None);
    }

    #[test]
    fn next_data_finds_an_imaged_block_punched_since() {
        let sim = SimStorage::new();
        sim.write_at(ObjectId::Data(0), 8 * IMAGE_BLOCK, &[7; 4096])
            .unwrap();
        let log = SimLog::default();
        let layer = BeforeImages::new(Arc::new(sim.clone()));
        assert_eq!(
            layer.arm(Box::new(log.clone()), FENCE).unwrap(),
            LogEnd::Whole
        );
        layer
            .punch_hole(ObjectId::Data(0), 8 * IMAGE_BLOCK, IMAGE_BLOCK)
            .unwrap();
        let overlay = OverlayStorage::new(
            Arc::new(SimStorage::new()),
            Arc::new(sim),
            Box::new(log),
            FENCE,
            lengths(),
        );
        let found = overlay.next_data(ObjectId::Data(0), 0).unwrap();
        assert!(found.is_some_and(|at| at <= 8 * IMAGE_BLOCK), "{found:?}");
        let mut block = vec![0u8; 4096];
        overlay
            .read_at(ObjectId::Data(0), 8 * IMAGE_BLOCK, &mut block)
            .unwrap();
        assert_eq!(block, vec![7; 4096]);
        assert_eq!(
            overlay.next_data(ObjectId::Data(0), OBJECT_BYTES).unwrap(),
            None
        );
    }
}
