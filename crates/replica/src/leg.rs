//! `RemoteLeg`: a replica on another host as a `BlockDevice`, so a
//! `Mirror` uses it like a local leg.
//!
//! PI travels with the data. A `Mirror` seals each write once on the
//! exporter (`seal_blocks` of its first active leg, with the mirror's
//! generation) and hands every leg the same sealed blocks; this leg sends
//! them, data and context together (`WRITE_SEALED`), after checking them
//! here, and the replica verifies each block against its context before
//! storing it (`Volume::write_sealed`), keeping the guard and generation
//! sent. `seal_blocks` and `write` seal here with the volume's plain
//! protection (guard, reference tag = LBA, volume tag) when this leg is
//! the one asked to seal or the caller is not a mirror. Reads fetch
//! blocks with their contexts (`READ_SEALED`) and verify them again here,
//! so a block damaged anywhere between the replica's disk and this
//! process is a fault naming its LBA, and the mirror repairs it.
//!
//! Every request is bounded by the connection's timeout; a connection that
//! fails makes every later call fail with `Error::Unreachable` (the mirror
//! marks the leg stale) until the leg is opened again, or `reconnect`
//! (a resync of the stale leg) connects anew to the same volume.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Mutex, RwLock};

use vouch_engine::protection::{GuardProtection, Protection};
use vouch_engine::ZeroFlags;
use vouch_engine::{
    Admission, Allocation, BlockData, BlockDevice, Error, Fault, GuardKind, Result,
    SealedAdmission, SealedBlock, SealedDevice, Submitted, WriteDone, BLOCK,
};
use vouch_mirror::LegTemplate;

use crate::client::{ClientError, ClientOptions, Connection};

mod snapshot;
use crate::url::ReplicaUrl;
use crate::wire::{
    self, decode_faults, decode_read_entries, decode_runs, ReadEntry, ReplicaInfo, Request, Status,
    MAX_BLOCKS_PER_REQUEST, MAX_STATUS_RUNS, MAX_VERIFY_BLOCKS,
};

/// The requests of one sealed write answered by callback: the last
/// answer calls `done`.
struct Join {
    remaining: AtomicUsize,
    first_error: Mutex<Option<Error>>,
    done: Mutex<Option<WriteDone>>,
}

impl Join {
    fn arrived(&self, outcome: Result<()>) {
        if let Err(error) = outcome {
            self.first_error.lock().get_or_insert(error);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let outcome = match self.first_error.lock().take() {
            Some(error) => Err(error),
            None => Ok(()),
        };
        if let Some(done) = self.done.lock().take() {
            done(outcome);
        }
    }
}

/// A remote replica as a mirror leg.
pub struct RemoteLeg {
    /// Shared with each write's answer callback (its errors name it): a
    /// count, not a copy of the URL's strings per write.
    url: Arc<ReplicaUrl>,
    /// Replaced only by `reconnect`, once this one is dead.
    connection: RwLock<Arc<Connection>>,
    options: ClientOptions,
    info: ReplicaInfo,
    protection: GuardProtection,
    /// The snapshot of the replica this leg reads (`open_snapshot`): its
    /// name and id.
    snapshot: Option<(String, String)>,
}

impl RemoteLeg {
    /// Connect to the replica at `url` and open it.
    pub fn open(url: &ReplicaUrl, options: &ClientOptions) -> Result<RemoteLeg> {
        let connection = Connection::connect(url, options).map_err(|e| leg_error(url, e))?;
        let answer = connection
            .call(&Request::Open {
                name: url.name.clone(),
            })
            .map_err(|e| leg_error(url, e))?;
        RemoteLeg::with_info(url, options, connection, &answer)
    }

    /// Connect to the server of `url` and create the replica `url.name`
    /// there from `template` (leg 0's superblock: same uuid, geometry,
    /// tags), then hold it open.
    pub fn create(
        url: &ReplicaUrl,
        template: &LegTemplate,
        options: &ClientOptions,
    ) -> Result<RemoteLeg> {
        if template.superblock.len() != wire::SUPERBLOCK_FILE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "a leg template's superblock is {} bytes, not {}",
                template.superblock.len(),
                wire::SUPERBLOCK_FILE_BYTES
            )));
        }
        if template.superblock()?.features.incompat & vouch_format::FeatureFlags::INCOMPAT_ENCRYPTED
            != 0
        {
            return Err(Error::Unsupported(format!(
                "{url}: remote replicas of encrypted volumes are not supported yet"
            )));
        }
        let connection = Connection::connect(url, options).map_err(|e| leg_error(url, e))?;
        let answer = connection
            .call(&Request::Create {
                name: url.name.clone(),
                journal_bytes: template.journal_bytes,
                superblock: template.superblock.clone(),
            })
            .map_err(|e| leg_error(url, e))?;
        RemoteLeg::with_info(url, options, connection, &answer)
    }

    fn with_info(
        url: &ReplicaUrl,
        options: &ClientOptions,
        connection: Arc<Connection>,
        answer: &[u8],
    ) -> Result<RemoteLeg> {
        let info = ReplicaInfo::decode(answer).map_err(|error| {
            Error::Unreachable(format!("replica {url}: malformed OPEN answer: {error}"))
        })?;
        if info.encrypted {
            return Err(Error::Unsupported(format!(
                "replica {url} is encrypted: remote replicas of encrypted volumes are not supported yet"
            )));
        }
        if u64::from(info.block_size) != BLOCK || !info.size_bytes.is_multiple_of(BLOCK) {
            return Err(Error::Corrupt(format!(
                "replica {url}: block size {} and size {} are not a vouch volume's",
                info.block_size, info.size_bytes
            )));
        }
        let guard = GuardKind::from_byte(info.guard)
            .map_err(|error| Error::Corrupt(format!("replica {url}: guard: {error}")))?;
        Ok(RemoteLeg {
            url: Arc::new(url.clone()),
            connection: RwLock::new(connection),
            options: options.clone(),
            protection: GuardProtection::new(guard, info.volume_tag),
            info,
            snapshot: None,
        })
    }

    /// What the replica said of its volume when opened.
    pub fn info(&self) -> &ReplicaInfo {
        &self.info
    }

    /// The replica's volume uuid, hyphenated.
    pub fn uuid_string(&self) -> String {
        format_uuid(&self.info.uuid)
    }

    pub fn url(&self) -> &ReplicaUrl {
        &self.url
    }

    fn call(&self, request: &Request) -> Result<Vec<u8>> {
        let connection = Arc::clone(&self.connection.read());
        connection
            .call(request)
            .map_err(|error| leg_error(&self.url, error))
    }

    /// A malformed answer: the connection is not to be trusted any more.
    fn malformed(&self, what: &str, error: wire::WireError) -> Error {
        let reason = format!("replica {}: malformed {what} answer: {error}", self.url);
        self.connection.read().kill(reason.clone());
        Error::Unreachable(reason)
    }

    /// In bounds: reads and writes take any byte range (whole blocks
    /// travel; partial edge blocks are read-modify-written under the
    /// mirror's stripe lock, see `write`).
    fn check_range(&self, offset: u64, length: u64) -> Result<()> {
        let size = self.info.size_bytes;
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(Error::OutOfRange {
                offset,
                length,
                size,
            });
        }
        Ok(())
    }

    /// A trim or zeroing travels as a byte range, which the replica
    /// protocol takes in whole 512-byte sectors (the mirror writes the
    /// bytes outside them as zeros: `Mirror::zero_sector_edges`).
    fn check_sectors(&self, offset: u64, length: u64) -> Result<()> {
        self.check_range(offset, length)?;
        let sector = u64::from(vouch_format::SECTOR_SIZE);
        if !offset.is_multiple_of(sector) || !length.is_multiple_of(sector) {
            return Err(Error::Misaligned { offset, length });
        }
        Ok(())
    }

    fn check_blocks(&self, first: u64, count: u64) -> Result<()> {
        self.check_range(first.saturating_mul(BLOCK), count.saturating_mul(BLOCK))
    }

    /// Blocks `[first, first + count)` as the replica stores them, in
    /// requests of at most `MAX_BLOCKS_PER_REQUEST`.
    fn read_entries(&self, first: u64, count: u64) -> Result<Vec<ReadEntry>> {
        self.check_blocks(first, count)?;
        let mut entries = Vec::with_capacity(count as usize);
        let mut lba = first;
        while lba < first + count {
            let n = (first + count - lba).min(MAX_BLOCKS_PER_REQUEST);
            let answer = self.call(&Request::ReadSealed {
                first: lba,
                count: n,
            })?;
            entries.extend(
                decode_read_entries(lba, n, &answer)
                    .map_err(|error| self.malformed("READ_SEALED", error))?,
            );
            lba += n;
        }
        Ok(entries)
    }

    /// Verify a block read from the replica here, again.
    fn open_block(&self, block: &SealedBlock) -> std::result::Result<(), Fault> {
        self.protection
            .open(block.lba, &Ok(block.context), &block.data[..])
            .map_err(|kind| Fault {
                lba: block.lba,
                kind,
            })
    }

    /// Seal `data` (whole blocks from `first`) here with `generation` (0:
    /// the replica's commit assigns one): the contexts the replica will
    /// verify and store.
    fn seal(&self, first: u64, data: &Bytes, generation: u64) -> Vec<SealedBlock> {
        (0..data.len() / BLOCK as usize)
            .map(|index| {
                let lba = first + index as u64;
                let block = BlockData::of_buffer(data, index);
                let seal = self
                    .protection
                    .seal_unchanged(lba, &block, generation)
                    .expect("a replica's protection stores data as it is");
                SealedBlock {
                    lba,
                    context: self.protection.context(lba, seal, generation),
                    data: block,
                }
            })
            .collect()
    }

    /// Blocks to send: inside the replica, and each verified here before
    /// it leaves (the replica verifies it again before storing it).
    fn check_sealed(&self, blocks: &[SealedBlock]) -> Result<()> {
        for block in blocks {
            if block.lba >= self.info.size_bytes / BLOCK {
                return Err(Error::OutOfRange {
                    offset: block.lba.saturating_mul(BLOCK),
                    length: BLOCK,
                    size: self.info.size_bytes,
                });
            }
            self.open_block(block).map_err(Error::Fault)?;
        }
        Ok(())
    }

    fn send_sealed(&self, blocks: &[SealedBlock], fua: bool) -> Result<()> {
        for chunk in blocks.chunks(MAX_BLOCKS_PER_REQUEST as usize) {
            self.call(&Request::WriteSealed {
                blocks: chunk.to_vec(),
                fua,
            })?;
        }
        Ok(())
    }
}

fn format_uuid(uuid: &[u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// A client error as the engine's: request errors keep their kind (every
/// leg would refuse the same), a lost connection is `Unreachable` (the
/// mirror marks the leg stale), the replica's own failures fail-stop it.
pub fn leg_error(url: &ReplicaUrl, error: ClientError) -> Error {
    let (status, body) = match error {
        ClientError::Unreachable(why) => return Error::Unreachable(why),
        ClientError::Refused(why) => return Error::Unreachable(why),
        ClientError::Older(theirs) => {
            return Error::Unreachable(format!("replica {url}: {}", wire::version_refusal(theirs)))
        }
        ClientError::Remote { status, body } => (status, body),
    };
    let message = format!("replica {url}: {}", body.message);
    let [first, second, third] = body.detail;
    match status {
        Status::Fault => match wire::fault_kind_from(body.kind) {
            Ok(kind) => Error::Fault(Fault { lba: first, kind }),
            Err(_) => Error::Unreachable(format!("{message} (unknown fault kind {})", body.kind)),
        },
        Status::OutOfRange => Error::OutOfRange {
            offset: first,
            length: second,
            size: third,
        },
        Status::Misaligned => Error::Misaligned {
            offset: first,
            length: second,
        },
        Status::ReadOnly => Error::ReadOnly(format!(" ({message})")),
        Status::InvalidArgument | Status::UnknownName | Status::InUse | Status::Exists => {
            Error::InvalidArgument(message)
        }
        Status::Unsupported => Error::Unsupported(message),
        Status::Corrupt => Error::Corrupt(message),
        Status::Malformed | Status::NotOpen => Error::Unreachable(message),
        Status::Io | Status::Ok => Error::FailStopped(message),
    }
}

impl BlockDevice for RemoteLeg {
    fn size(&self) -> u64 {
        self.info.size_bytes
    }

    /// The replica client's own type, for the snapshot requests a
    /// mirror's snapshot sends to its remote legs (`leg/snapshot.rs`).
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn is_read_only(&self) -> bool {
        self.info.read_only
    }

    /// Fetched sealed and verified here (after the replica read it).
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        self.check_range(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(Vec::new());
        }
        let first = offset / BLOCK;
        let end = (offset + buf.len() as u64).div_ceil(BLOCK);
        for entry in self.read_entries(first, end - first)? {
            let block = match entry {
                ReadEntry::Sealed(block) => block,
                ReadEntry::Fault(fault) => return Err(Error::Fault(fault)),
            };
            self.open_block(&block).map_err(Error::Fault)?;
            // The block's bytes that fall inside the request.
            let block_start = block.lba * BLOCK;
            let from = block_start.max(offset);
            let to = (block_start + BLOCK).min(offset + buf.len() as u64);
            buf[(from - offset) as usize..(to - offset) as usize].copy_from_slice(
                &block.data[(from - block_start) as usize..(to - block_start) as usize],
            );
        }
        Ok(Vec::new())
    }

    /// Sealed here, verified and stored there. Partial blocks at the edges
    /// are read (verified), patched and resealed: the mirror holds the
    /// stripe lock across it. Every write waits for the replica's answer
    /// (a mirror starts a remote leg's share with `submit_sealed`), so
    /// a write that must not wait is declined.
    fn submit_write(
        &self,
        offset: u64,
        data: &Bytes,
        fua: bool,
        admission: Admission,
    ) -> Result<Submitted> {
        if admission != Admission::MayWait {
            return Ok(Submitted::Declined);
        }
        self.check_range(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(Submitted::Done);
        }
        let first = offset / BLOCK;
        let end = (offset + data.len() as u64).div_ceil(BLOCK);
        let aligned = offset.is_multiple_of(BLOCK) && (data.len() as u64).is_multiple_of(BLOCK);
        let blocks = if aligned {
            self.seal(first, data, 0)
        } else {
            let mut whole = vec![0u8; ((end - first) * BLOCK) as usize];
            self.read(first * BLOCK, &mut whole)?;
            let at = (offset - first * BLOCK) as usize;
            whole[at..at + data.len()].copy_from_slice(data);
            self.seal(first, &Bytes::from(whole), 0)
        };
        self.send_sealed(&blocks, fua)?;
        Ok(Submitted::Done)
    }

    fn flush(&self) -> Result<()> {
        self.call(&Request::Flush).map(|_| ())
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.check_sectors(offset, length)?;
        self.call(&Request::Trim {
            offset,
            length,
            fua,
        })
        .map(|_| ())
    }

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()> {
        self.check_sectors(offset, length)?;
        self.call(&Request::WriteZeroes {
            offset,
            length,
            fua: flags.fua,
            allocate: flags.allocate,
        })
        .map(|_| ())
    }

    fn block_status(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>> {
        let answer = self.call(&Request::BlockStatus {
            offset,
            length,
            max_blocks: max_blocks.clamp(1, MAX_STATUS_RUNS),
        })?;
        decode_runs(&answer).map_err(|error| self.malformed("BLOCK_STATUS", error))
    }

    /// Faulty blocks — as the replica found them, or as they verify here —
    /// are zero-filled and listed.
    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        if out.len() as u64 != count.saturating_mul(BLOCK) {
            return Err(Error::InvalidArgument(format!(
                "{count} blocks into a buffer of {} bytes",
                out.len()
            )));
        }
        let mut faults = Vec::new();
        for (index, entry) in self.read_entries(first, count)?.into_iter().enumerate() {
            let slot = &mut out[index * BLOCK as usize..(index + 1) * BLOCK as usize];
            let fault = match entry {
                ReadEntry::Sealed(block) => match self.open_block(&block) {
                    Ok(()) => {
                        slot.copy_from_slice(&block.data[..]);
                        continue;
                    }
                    Err(fault) => fault,
                },
                ReadEntry::Fault(fault) => fault,
            };
            slot.fill(0);
            faults.push(fault);
        }
        Ok(faults)
    }

    fn next_possible_data(&self, lba: u64) -> Result<u64> {
        let answer = self.call(&Request::NextData { lba })?;
        let bytes: [u8; 8] = answer
            .as_slice()
            .try_into()
            .map_err(|_| self.malformed("NEXT_DATA", wire::WireError::Truncated("8 bytes")))?;
        Ok(u64::from_le_bytes(bytes))
    }

    /// On the replica, next to its data: only the faults travel.
    fn verify(&self, first: u64, count: u64) -> Result<Vec<Fault>> {
        self.check_blocks(first, count)?;
        let mut faults = Vec::new();
        let mut lba = first;
        while lba < first + count {
            let n = (first + count - lba).min(MAX_VERIFY_BLOCKS);
            let answer = self.call(&Request::Verify {
                first: lba,
                count: n,
            })?;
            let (found, truncated) =
                decode_faults(&answer).map_err(|error| self.malformed("VERIFY", error))?;
            if truncated {
                tracing::warn!(url = %self.url, lba, "replica VERIFY listed only its first faults");
            }
            faults.extend(found);
            lba += n;
        }
        Ok(faults)
    }
}

impl SealedDevice for RemoteLeg {
    fn unreachable(&self) -> Option<String> {
        self.connection.read().dead()
    }

    /// A new connection when this one is dead; the replica must answer
    /// OPEN with the volume this leg was opened on (uuid, size, guard,
    /// volume tag), or the old, dead connection is kept and the call fails.
    fn reconnect(&self) -> Result<()> {
        if self.connection.read().dead().is_none() {
            return Ok(());
        }
        let fresh = match &self.snapshot {
            Some((snapshot, _)) => RemoteLeg::open_snapshot(&self.url, snapshot, &self.options)?,
            None => RemoteLeg::open(&self.url, &self.options)?,
        };
        let (old, new) = (&self.info, &fresh.info);
        if (old.uuid, old.size_bytes, old.guard, old.volume_tag)
            != (new.uuid, new.size_bytes, new.guard, new.volume_tag)
            || old.instance_tag != new.instance_tag
            || self.snapshot != fresh.snapshot
        {
            return Err(Error::Corrupt(format!(
                "replica {} now holds another volume (uuid {}, {} bytes), not {} ({} bytes)",
                self.url,
                fresh.uuid_string(),
                new.size_bytes,
                self.uuid_string(),
                old.size_bytes
            )));
        }
        *self.connection.write() = Arc::clone(&fresh.connection.read());
        tracing::info!(url = %self.url, "replica: reconnected");
        Ok(())
    }

    /// As stored there; a block the replica cannot read (or whose context
    /// does not decode) fails the call naming it, as a local volume's does.
    fn read_sealed(&self, first: u64, count: u64) -> Result<Vec<SealedBlock>> {
        self.read_entries(first, count)?
            .into_iter()
            .map(|entry| match entry {
                ReadEntry::Sealed(block) => Ok(block),
                ReadEntry::Fault(fault) => Err(Error::Fault(fault)),
            })
            .collect()
    }

    /// Verified here before sending (so no block of a bad call is stored,
    /// even across several requests), and again there before storing.
    /// The waiting admissions (`MayWait`, and `Here`: blocks that will
    /// cross the wire are verified in full anyway) send every request of
    /// the write now, so the replica may store them in any order (the
    /// blocks are distinct LBAs), and answer `Started`: its `StartWrite`
    /// collects the answers (each within the connection's timeout), so a
    /// mirror writes its local legs meanwhile. `Callback`, on a connection
    /// that answers on its own reader thread (plain TCP): `Started`, whose
    /// `StartWrite` sends the requests and returns, the completion called
    /// once all are answered (the first error wins) on that reader thread,
    /// or at once when a request cannot be sent; each request is bounded by
    /// the connection's timeout, enforced by that thread. Every answer
    /// needs a round trip, so `MustNotWait` is declined, and no room is
    /// reserved here.
    fn submit_sealed(
        &self,
        blocks: &[SealedBlock],
        fua: bool,
        admission: SealedAdmission,
    ) -> Result<Submitted> {
        match admission {
            SealedAdmission::MayWait | SealedAdmission::Here => {}
            SealedAdmission::Callback if self.answers_by_callback() => {}
            SealedAdmission::MustNotWait | SealedAdmission::Callback => {
                return Ok(Submitted::Declined)
            }
            SealedAdmission::Reserved => {
                return Err(Error::Unsupported(
                    "writes into reserved room (a remote leg reserves none)".into(),
                ))
            }
        }
        self.check_sealed(blocks)?;
        if blocks.is_empty() {
            return Ok(Submitted::Done);
        }
        let connection = Arc::clone(&self.connection.read());
        let url = Arc::clone(&self.url);
        let request = |chunk: &[SealedBlock]| Request::WriteSealed {
            blocks: chunk.to_vec(),
            fua,
        };
        if admission != SealedAdmission::Callback {
            let pending = blocks
                .chunks(MAX_BLOCKS_PER_REQUEST as usize)
                .map(|chunk| connection.send(&request(chunk)))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|error| leg_error(&url, error))?;
            return Ok(Submitted::Started(Box::new(move |done: WriteDone| {
                let waited = pending.into_iter().try_for_each(|request| {
                    request
                        .wait()
                        .map(drop)
                        .map_err(|error| leg_error(&url, error))
                });
                done(waited);
            })));
        }
        if blocks.len() <= MAX_BLOCKS_PER_REQUEST as usize {
            // One request: its answer is the write's, with no `Join`.
            let request = request(blocks);
            return Ok(Submitted::Started(Box::new(move |done: WriteDone| {
                connection.send_then(
                    &request,
                    Box::new(move |answer| {
                        done(answer.map(drop).map_err(|error| leg_error(&url, error)));
                    }),
                );
            })));
        }
        let requests: Vec<Request> = blocks
            .chunks(MAX_BLOCKS_PER_REQUEST as usize)
            .map(request)
            .collect();
        Ok(Submitted::Started(Box::new(move |done: WriteDone| {
            let join = Arc::new(Join {
                remaining: AtomicUsize::new(requests.len()),
                first_error: Mutex::new(None),
                done: Mutex::new(Some(done)),
            });
            for request in &requests {
                let (join, url) = (Arc::clone(&join), Arc::clone(&url));
                connection.send_then(
                    request,
                    Box::new(move |answer| {
                        join.arrived(answer.map(drop).map_err(|error| leg_error(&url, error)));
                    }),
                );
            }
        })))
    }

    /// On plain TCP the connection's reader thread answers (and times
    /// out) the requests: no caller sleeps on them.
    fn answers_by_callback(&self) -> bool {
        self.connection.read().answers_by_callback()
    }

    /// Sealed here, as the replica would store them (plain protection).
    fn seal_blocks(&self, first: u64, data: &Bytes, generation: u64) -> Result<Vec<SealedBlock>> {
        if !(data.len() as u64).is_multiple_of(BLOCK) {
            return Err(Error::InvalidArgument(format!(
                "sealing {} bytes: not whole blocks",
                data.len()
            )));
        }
        self.check_blocks(first, data.len() as u64 / BLOCK)?;
        Ok(self.seal(first, data, generation))
    }
}
