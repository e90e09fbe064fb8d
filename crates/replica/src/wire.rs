//! The replica protocol's bytes (docs/PROTOCOL.md, "Replica protocol"):
//! the handshake, request and response headers, and every payload, as
//! pure functions over byte slices. Every integer is little-endian. Every
//! length is bounded before anything is allocated; a frame that breaks a
//! rule is a `WireError`, never a panic.

use bytes::Bytes;
use vouch_engine::{Allocation, BlockData, Fault, FaultKind, SealedBlock, BLOCK};

pub use crate::frame::RequestFrame;
use vouch_format::Context;

/// The first 8 bytes each side sends.
pub const HELLO_MAGIC: [u8; 8] = *b"VOUCHREP";
/// The protocol version this side speaks.
/// Version 2 added authentication after the hello (`auth.rs`): a
/// challenge, a response, a verdict, sent on every connection. Version 3
/// added the snapshot requests (SNAPSHOT_CREATE, SNAPSHOT_LIST,
/// SNAPSHOT_DELETE, OPEN_SNAPSHOT); the hello agrees on a version, so
/// either side speaks 2 with a peer from before them.
pub const PROTOCOL_VERSION: u32 = 3;
/// The oldest version this side still speaks (a peer from before the
/// snapshot requests).
pub const OLDEST_VERSION: u32 = 2;
/// The first version with the snapshot requests: on a connection agreed
/// at an older one they are never sent (the client refuses by name) and
/// are malformed (the server answers as one from before them).
pub const SNAPSHOT_VERSION: u32 = 3;
/// Handshake message: magic, version (u32), status (u32).
pub const HELLO_BYTES: usize = 16;
/// Handshake status: accepted.
pub const HELLO_OK: u32 = 0;
/// Handshake status: the server does not speak the client's version.
pub const HELLO_VERSION_REFUSED: u32 = 1;

/// "VRRQ" read as a little-endian u32.
pub const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"VRRQ");
/// "VRRS" read as a little-endian u32.
pub const RESPONSE_MAGIC: u32 = u32::from_le_bytes(*b"VRRS");
pub const REQUEST_HEADER_BYTES: usize = 40;
pub const RESPONSE_HEADER_BYTES: usize = 24;

/// Blocks a READ_SEALED or WRITE_SEALED may carry (1 MiB of data).
pub const MAX_BLOCKS_PER_REQUEST: u64 = 256;
/// Blocks one VERIFY may cover (64 MiB).
pub const MAX_VERIFY_BLOCKS: u64 = 16384;
/// Faults one VERIFY answer lists at most (then `truncated` is set).
pub const MAX_VERIFY_FAULTS: usize = 4096;
/// Runs one BLOCK_STATUS answer holds at most.
pub const MAX_STATUS_RUNS: u64 = 4096;
/// Bytes of a replica name.
pub const MAX_NAME_BYTES: usize = 255;
/// Bytes of an error message.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// A volume's superblock file (two 4 KiB copies), carried by CREATE.
pub const SUPERBLOCK_FILE_BYTES: usize = 8192;
/// One block in WRITE_SEALED: LBA (u64), context (32), data (4096).
pub const WRITE_ENTRY_BYTES: usize = 8 + CONTEXT_BYTES + BLOCK as usize;
/// One block in a READ_SEALED answer: status (u8), fault kind (u8), 6
/// reserved, context (32), data (4096).
pub const READ_ENTRY_BYTES: usize = 8 + CONTEXT_BYTES + BLOCK as usize;
/// The INFO answer of OPEN and CREATE.
pub const INFO_BYTES: usize = 56;
/// A snapshot's id on the wire (`SnapshotRecord::id`: a hyphenated
/// UUID, the one every copy of a mirror's snapshot shares).
pub const SNAPSHOT_ID_BYTES: usize = 36;
/// Snapshots one SNAPSHOT_LIST answer holds at most.
pub const MAX_SNAPSHOTS_LISTED: usize = 1024;
/// One SNAPSHOT_LIST entry without its name: checkpoint seq (8), created
/// (8), id (36), name length (2), reserved (2).
pub const SNAPSHOT_ENTRY_FIXED_BYTES: usize = 56;
/// The largest payload either side accepts.
pub const MAX_PAYLOAD_BYTES: usize = MAX_BLOCKS_PER_REQUEST as usize * WRITE_ENTRY_BYTES;

pub(crate) const CONTEXT_BYTES: usize = vouch_format::context::CONTEXT_BYTES;
const _: () = assert!(WRITE_ENTRY_BYTES == 4136 && READ_ENTRY_BYTES == 4136);
const _: () = assert!(SUPERBLOCK_FILE_BYTES + 16 + MAX_NAME_BYTES < MAX_PAYLOAD_BYTES);
const _: () = assert!(8 + MAX_VERIFY_FAULTS * 16 < MAX_PAYLOAD_BYTES);
const _: () = assert!(8 + MAX_STATUS_RUNS as usize * 16 < MAX_PAYLOAD_BYTES);
const _: () = assert!(
    8 + MAX_SNAPSHOTS_LISTED * (SNAPSHOT_ENTRY_FIXED_BYTES + MAX_NAME_BYTES) < MAX_PAYLOAD_BYTES
);

/// Request flag: durable before the answer (NBD FUA).
pub const FLAG_FUA: u16 = 1;
/// WRITE_ZEROES flag: record written zeroes, not holes (NBD NO_HOLE).
pub const FLAG_ALLOCATE: u16 = 2;
const KNOWN_FLAGS: u16 = FLAG_FUA | FLAG_ALLOCATE;

/// A frame or payload that breaks the protocol's rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("unknown operation {0}")]
    UnknownOp(u16),
    #[error("unknown flags {0:#06x}")]
    UnknownFlags(u16),
    #[error("reserved field is {0}, not 0")]
    Reserved(u64),
    #[error("payload of {0} bytes is over the limit of {MAX_PAYLOAD_BYTES}")]
    PayloadTooLarge(u64),
    #[error("{what}: {got} bytes where {expected} were expected")]
    Length {
        what: &'static str,
        got: u64,
        expected: u64,
    },
    #[error("{what} is {got}, over the limit of {limit}")]
    OverLimit {
        what: &'static str,
        got: u64,
        limit: u64,
    },
    #[error("replica name {0:?}: {1}")]
    BadName(String, &'static str),
    #[error("not UTF-8: {0}")]
    NotUtf8(&'static str),
    #[error("unknown {what} {value}")]
    UnknownValue { what: &'static str, value: u64 },
    #[error("the context of LBA {0} does not decode")]
    BadContext(u64),
    #[error("frame truncated: {0}")]
    Truncated(&'static str),
}

/// Operations (the request header's `op`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Op {
    Open = 1,
    Create = 2,
    ReadSealed = 3,
    WriteSealed = 4,
    Flush = 5,
    Trim = 6,
    WriteZeroes = 7,
    Verify = 8,
    BlockStatus = 9,
    NextData = 10,
    SnapshotCreate = 11,
    SnapshotList = 12,
    SnapshotDelete = 13,
    OpenSnapshot = 14,
}

impl Op {
    pub fn from_u16(value: u16) -> Result<Op, WireError> {
        Ok(match value {
            1 => Op::Open,
            2 => Op::Create,
            3 => Op::ReadSealed,
            4 => Op::WriteSealed,
            5 => Op::Flush,
            6 => Op::Trim,
            7 => Op::WriteZeroes,
            8 => Op::Verify,
            9 => Op::BlockStatus,
            10 => Op::NextData,
            11 => Op::SnapshotCreate,
            12 => Op::SnapshotList,
            13 => Op::SnapshotDelete,
            14 => Op::OpenSnapshot,
            other => return Err(WireError::UnknownOp(other)),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Op::Open => "OPEN",
            Op::Create => "CREATE",
            Op::ReadSealed => "READ_SEALED",
            Op::WriteSealed => "WRITE_SEALED",
            Op::Flush => "FLUSH",
            Op::Trim => "TRIM",
            Op::WriteZeroes => "WRITE_ZEROES",
            Op::Verify => "VERIFY",
            Op::BlockStatus => "BLOCK_STATUS",
            Op::NextData => "NEXT_DATA",
            Op::SnapshotCreate => "SNAPSHOT_CREATE",
            Op::SnapshotList => "SNAPSHOT_LIST",
            Op::SnapshotDelete => "SNAPSHOT_DELETE",
            Op::OpenSnapshot => "OPEN_SNAPSHOT",
        }
    }

    /// Is it one of version 3's snapshot requests?
    pub fn is_snapshot(self) -> bool {
        matches!(
            self,
            Op::SnapshotCreate | Op::SnapshotList | Op::SnapshotDelete | Op::OpenSnapshot
        )
    }
}

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(bytes[at..at + 2].try_into().expect("2 bytes"))
}
fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// The handshake message (both directions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub version: u32,
    pub status: u32,
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut out = [0u8; HELLO_BYTES];
        out[..8].copy_from_slice(&HELLO_MAGIC);
        out[8..12].copy_from_slice(&self.version.to_le_bytes());
        out[12..16].copy_from_slice(&self.status.to_le_bytes());
        out
    }

    /// Fails only on a wrong magic: the version is the caller's to judge.
    pub fn decode(bytes: &[u8; HELLO_BYTES]) -> Result<Hello, WireError> {
        if bytes[..8] != HELLO_MAGIC {
            return Err(WireError::BadMagic(u32_at(bytes, 0)));
        }
        Ok(Hello {
            version: u32_at(bytes, 8),
            status: u32_at(bytes, 12),
        })
    }
}

/// How a refused version is named, on both sides.
pub fn version_refusal(theirs: u32) -> String {
    version_refusal_by(theirs, PROTOCOL_VERSION)
}

/// `version_refusal` by a side whose newest version is `ours`.
pub fn version_refusal_by(theirs: u32, ours: u32) -> String {
    if ours > OLDEST_VERSION {
        format!(
            "replica protocol version {theirs} is not supported (this side speaks {OLDEST_VERSION} to {ours})"
        )
    } else {
        format!("replica protocol version {theirs} is not supported (this side speaks {ours})")
    }
}

/// A request header as sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    pub op: Op,
    pub flags: u16,
    pub handle: u64,
    pub offset: u64,
    pub length: u64,
    pub payload_bytes: u32,
}

impl RequestHeader {
    pub fn encode(&self) -> [u8; REQUEST_HEADER_BYTES] {
        let mut out = [0u8; REQUEST_HEADER_BYTES];
        out[0..4].copy_from_slice(&REQUEST_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&(self.op as u16).to_le_bytes());
        out[6..8].copy_from_slice(&self.flags.to_le_bytes());
        out[8..16].copy_from_slice(&self.handle.to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
        out[24..32].copy_from_slice(&self.length.to_le_bytes());
        out[32..36].copy_from_slice(&self.payload_bytes.to_le_bytes());
        out
    }

    /// Check magic, op, flags, reserved bytes and the payload's size
    /// against the op; the payload itself is `decode_request`'s.
    pub fn decode(bytes: &[u8; REQUEST_HEADER_BYTES]) -> Result<RequestHeader, WireError> {
        let magic = u32_at(bytes, 0);
        if magic != REQUEST_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let op = Op::from_u16(u16_at(bytes, 4))?;
        let flags = u16_at(bytes, 6);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(WireError::UnknownFlags(flags));
        }
        let reserved = u32_at(bytes, 36);
        if reserved != 0 {
            return Err(WireError::Reserved(u64::from(reserved)));
        }
        let header = RequestHeader {
            op,
            flags,
            handle: u64_at(bytes, 8),
            offset: u64_at(bytes, 16),
            length: u64_at(bytes, 24),
            payload_bytes: u32_at(bytes, 32),
        };
        if header.payload_bytes as usize > MAX_PAYLOAD_BYTES {
            return Err(WireError::PayloadTooLarge(u64::from(header.payload_bytes)));
        }
        header.check_payload_size()?;
        Ok(header)
    }

    fn check_payload_size(&self) -> Result<(), WireError> {
        let got = u64::from(self.payload_bytes);
        let exact = |expected: u64| {
            if got == expected {
                Ok(())
            } else {
                Err(WireError::Length {
                    what: self.op.name(),
                    got,
                    expected,
                })
            }
        };
        let blocks = |limit: u64| {
            if self.length == 0 || self.length > limit {
                Err(WireError::OverLimit {
                    what: "block count",
                    got: self.length,
                    limit,
                })
            } else {
                Ok(())
            }
        };
        match self.op {
            Op::Open => {
                if got == 0 {
                    return Err(WireError::BadName(String::new(), "empty"));
                }
                if got > MAX_NAME_BYTES as u64 {
                    return Err(WireError::OverLimit {
                        what: "OPEN name length",
                        got,
                        limit: MAX_NAME_BYTES as u64,
                    });
                }
                Ok(())
            }
            Op::Create => {
                let fixed = SUPERBLOCK_FILE_BYTES as u64;
                if got == fixed {
                    return Err(WireError::BadName(String::new(), "empty"));
                }
                if got < fixed || got > fixed + MAX_NAME_BYTES as u64 {
                    return Err(WireError::Length {
                        what: "CREATE",
                        got,
                        expected: fixed + 1,
                    });
                }
                Ok(())
            }
            Op::ReadSealed => {
                blocks(MAX_BLOCKS_PER_REQUEST)?;
                exact(0)
            }
            Op::WriteSealed => {
                blocks(MAX_BLOCKS_PER_REQUEST)?;
                exact(self.length * WRITE_ENTRY_BYTES as u64)
            }
            Op::Verify => {
                blocks(MAX_VERIFY_BLOCKS)?;
                exact(0)
            }
            Op::BlockStatus => exact(8),
            Op::Flush | Op::Trim | Op::WriteZeroes | Op::NextData | Op::SnapshotList => exact(0),
            Op::SnapshotCreate => {
                let fixed = SNAPSHOT_ID_BYTES as u64;
                if got <= fixed || got > fixed + MAX_NAME_BYTES as u64 || self.length > 1 {
                    return Err(WireError::Length {
                        what: "SNAPSHOT_CREATE",
                        got,
                        expected: fixed + 1,
                    });
                }
                Ok(())
            }
            Op::SnapshotDelete | Op::OpenSnapshot => {
                // OPEN_SNAPSHOT: `length` is the replica name's bytes, the
                // snapshot's follow.
                let names = if self.op == Op::OpenSnapshot { 2 } else { 1 };
                if got < names || got > names * MAX_NAME_BYTES as u64 {
                    return Err(WireError::OverLimit {
                        what: "snapshot name length",
                        got,
                        limit: names * MAX_NAME_BYTES as u64,
                    });
                }
                if self.op == Op::OpenSnapshot && (self.length == 0 || self.length >= got) {
                    return Err(WireError::Length {
                        what: "OPEN_SNAPSHOT replica name",
                        got: self.length,
                        expected: got.saturating_sub(1),
                    });
                }
                Ok(())
            }
        }
    }
}

/// A decoded request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Open {
        name: String,
    },
    Create {
        name: String,
        journal_bytes: u64,
        superblock: Vec<u8>,
    },
    ReadSealed {
        first: u64,
        count: u64,
    },
    WriteSealed {
        blocks: Vec<SealedBlock>,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        length: u64,
        fua: bool,
    },
    WriteZeroes {
        offset: u64,
        length: u64,
        fua: bool,
        allocate: bool,
    },
    Verify {
        first: u64,
        count: u64,
    },
    BlockStatus {
        offset: u64,
        length: u64,
        max_blocks: u64,
    },
    NextData {
        lba: u64,
    },
    /// Take snapshot `name` of the open replica at its flush point, with
    /// the id the exporter gives (the one all of a mirror's copies share).
    SnapshotCreate {
        name: String,
        id: String,
        /// A full copy where the filesystem cannot share blocks.
        copy: bool,
    },
    SnapshotList,
    SnapshotDelete {
        name: String,
    },
    /// Open snapshot `snapshot` of replica `name`, read-only (instead of
    /// OPEN: the connection then reads the snapshot).
    OpenSnapshot {
        name: String,
        snapshot: String,
    },
}

/// Is `name` a plain replica name (no `/`, not `.` or `..`, not empty,
/// printable, at most `MAX_NAME_BYTES`)?
pub fn check_name(name: &str) -> Result<(), WireError> {
    let bad = |why| Err(WireError::BadName(name.to_string(), why));
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > MAX_NAME_BYTES {
        return bad("longer than 255 bytes");
    }
    if name == "." || name == ".." {
        return bad("not a plain name");
    }
    if name.contains('/') || name.contains('\\') {
        return bad("contains a path separator");
    }
    if name.chars().any(|c| c.is_control()) {
        return bad("contains a control character");
    }
    Ok(())
}

fn decode_name(bytes: &[u8]) -> Result<String, WireError> {
    let name = std::str::from_utf8(bytes)
        .map_err(|_| WireError::NotUtf8("replica name"))?
        .to_string();
    check_name(&name)?;
    Ok(name)
}

/// Decode a request from its checked header and its payload. A
/// WRITE_SEALED's blocks are windows of `payload` (no copy: on a replica
/// each block is copied once more anyway, into its held log).
pub fn decode_request(header: &RequestHeader, payload: &Bytes) -> Result<Request, WireError> {
    if payload.len() != header.payload_bytes as usize {
        return Err(WireError::Truncated("payload shorter than its header says"));
    }
    let fua = header.flags & FLAG_FUA != 0;
    Ok(match header.op {
        Op::Open => Request::Open {
            name: decode_name(payload)?,
        },
        Op::Create => Request::Create {
            journal_bytes: header.length,
            superblock: payload[..SUPERBLOCK_FILE_BYTES].to_vec(),
            name: decode_name(&payload[SUPERBLOCK_FILE_BYTES..])?,
        },
        Op::ReadSealed => Request::ReadSealed {
            first: header.offset,
            count: header.length,
        },
        Op::WriteSealed => {
            let count = payload.len() / WRITE_ENTRY_BYTES;
            Request::WriteSealed {
                blocks: (0..count)
                    .map(|index| decode_write_entry(payload, index * WRITE_ENTRY_BYTES, count))
                    .collect::<Result<_, _>>()?,
                fua,
            }
        }
        Op::Flush => Request::Flush,
        Op::Trim => Request::Trim {
            offset: header.offset,
            length: header.length,
            fua,
        },
        Op::WriteZeroes => Request::WriteZeroes {
            offset: header.offset,
            length: header.length,
            fua,
            allocate: header.flags & FLAG_ALLOCATE != 0,
        },
        Op::Verify => Request::Verify {
            first: header.offset,
            count: header.length,
        },
        Op::BlockStatus => {
            let max_blocks = u64_at(payload, 0);
            if max_blocks == 0 || max_blocks > MAX_STATUS_RUNS {
                return Err(WireError::OverLimit {
                    what: "BLOCK_STATUS max_blocks",
                    got: max_blocks,
                    limit: MAX_STATUS_RUNS,
                });
            }
            Request::BlockStatus {
                offset: header.offset,
                length: header.length,
                max_blocks,
            }
        }
        Op::NextData => Request::NextData { lba: header.offset },
        Op::SnapshotCreate => Request::SnapshotCreate {
            id: decode_id(&payload[..SNAPSHOT_ID_BYTES])?,
            name: decode_name(&payload[SNAPSHOT_ID_BYTES..])?,
            copy: header.length == 1,
        },
        Op::SnapshotList => Request::SnapshotList,
        Op::SnapshotDelete => Request::SnapshotDelete {
            name: decode_name(payload)?,
        },
        Op::OpenSnapshot => {
            let split = header.length as usize;
            Request::OpenSnapshot {
                name: decode_name(&payload[..split])?,
                snapshot: decode_name(&payload[split..])?,
            }
        }
    })
}

/// A snapshot id: 36 bytes of hex digits and hyphens.
fn decode_id(bytes: &[u8]) -> Result<String, WireError> {
    if !bytes.iter().all(|b| b.is_ascii_hexdigit() || *b == b'-') {
        return Err(WireError::NotUtf8("snapshot id (hex digits and hyphens)"));
    }
    Ok(String::from_utf8_lossy(bytes).into_owned())
}

/// The entry at byte `at` of a WRITE_SEALED payload of `count` entries.
fn decode_write_entry(payload: &Bytes, at: usize, count: usize) -> Result<SealedBlock, WireError> {
    let entry = &payload[at..at + WRITE_ENTRY_BYTES];
    let lba = u64_at(entry, 0);
    let context =
        Context::decode(&entry[8..8 + CONTEXT_BYTES]).map_err(|_| WireError::BadContext(lba))?;
    let data = BlockData::in_buffer(payload, at + 8 + CONTEXT_BYTES, count);
    Ok(SealedBlock { lba, data, context })
}

/// A request as bytes: header then payload.
pub fn encode_request(handle: u64, request: &Request) -> Vec<u8> {
    encode_request_frame(handle, request).to_vec()
}

/// `encode_request` in pieces: a WRITE_SEALED's block data is not copied
/// (`RequestFrame`).
pub fn encode_request_frame(handle: u64, request: &Request) -> RequestFrame {
    let (op, flags, offset, length, payload) = match request {
        Request::Open { name } => (Op::Open, 0, 0, 0, name.as_bytes().to_vec()),
        Request::Create {
            name,
            journal_bytes,
            superblock,
        } => {
            let mut payload = superblock.clone();
            payload.extend_from_slice(name.as_bytes());
            (Op::Create, 0, 0, *journal_bytes, payload)
        }
        Request::ReadSealed { first, count } => (Op::ReadSealed, 0, *first, *count, Vec::new()),
        Request::WriteSealed { blocks, fua } => {
            return RequestFrame::write_sealed(handle, blocks, *fua);
        }
        Request::Flush => (Op::Flush, 0, 0, 0, Vec::new()),
        Request::Trim {
            offset,
            length,
            fua,
        } => (
            Op::Trim,
            if *fua { FLAG_FUA } else { 0 },
            *offset,
            *length,
            Vec::new(),
        ),
        Request::WriteZeroes {
            offset,
            length,
            fua,
            allocate,
        } => {
            let flags = if *fua { FLAG_FUA } else { 0 } | if *allocate { FLAG_ALLOCATE } else { 0 };
            (Op::WriteZeroes, flags, *offset, *length, Vec::new())
        }
        Request::Verify { first, count } => (Op::Verify, 0, *first, *count, Vec::new()),
        Request::BlockStatus {
            offset,
            length,
            max_blocks,
        } => (
            Op::BlockStatus,
            0,
            *offset,
            *length,
            max_blocks.to_le_bytes().to_vec(),
        ),
        Request::NextData { lba } => (Op::NextData, 0, *lba, 0, Vec::new()),
        Request::SnapshotCreate { name, id, copy } => {
            let mut payload = id.as_bytes().to_vec();
            payload.resize(SNAPSHOT_ID_BYTES, b'-');
            payload.extend_from_slice(name.as_bytes());
            (Op::SnapshotCreate, 0, 0, u64::from(*copy), payload)
        }
        Request::SnapshotList => (Op::SnapshotList, 0, 0, 0, Vec::new()),
        Request::SnapshotDelete { name } => (Op::SnapshotDelete, 0, 0, 0, name.as_bytes().to_vec()),
        Request::OpenSnapshot { name, snapshot } => {
            let mut payload = name.as_bytes().to_vec();
            payload.extend_from_slice(snapshot.as_bytes());
            (Op::OpenSnapshot, 0, 0, name.len() as u64, payload)
        }
    };
    let header = RequestHeader {
        op,
        flags,
        handle,
        offset,
        length,
        payload_bytes: payload.len() as u32,
    };
    let mut head = header.encode().to_vec();
    head.extend_from_slice(&payload);
    RequestFrame {
        head,
        data: Vec::new(),
    }
}

/// Response status codes (the response header's `status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Status {
    Ok = 0,
    /// The request broke the protocol; the server closes the connection.
    Malformed = 1,
    /// A block failed verification: `detail[0]` its LBA, `kind` the fault.
    Fault = 2,
    /// `detail`: offset, length, volume size.
    OutOfRange = 3,
    /// `detail`: offset, length.
    Misaligned = 4,
    ReadOnly = 5,
    InvalidArgument = 6,
    Unsupported = 7,
    /// A data request before OPEN or CREATE succeeded.
    NotOpen = 8,
    /// OPEN of a name the server does not hold.
    UnknownName = 9,
    /// OPEN of a replica another connection holds.
    InUse = 10,
    /// CREATE of a name that exists.
    Exists = 11,
    /// The replica's storage failed (fail-stopped, I/O error, no space).
    Io = 12,
    /// The replica's volume is corrupt or cannot be opened.
    Corrupt = 13,
}

impl Status {
    pub fn from_u16(value: u16) -> Result<Status, WireError> {
        Ok(match value {
            0 => Status::Ok,
            1 => Status::Malformed,
            2 => Status::Fault,
            3 => Status::OutOfRange,
            4 => Status::Misaligned,
            5 => Status::ReadOnly,
            6 => Status::InvalidArgument,
            7 => Status::Unsupported,
            8 => Status::NotOpen,
            9 => Status::UnknownName,
            10 => Status::InUse,
            11 => Status::Exists,
            12 => Status::Io,
            13 => Status::Corrupt,
            other => {
                return Err(WireError::UnknownValue {
                    what: "status",
                    value: u64::from(other),
                })
            }
        })
    }
}

/// A response header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponseHeader {
    pub status: Status,
    pub handle: u64,
    pub payload_bytes: u32,
}

impl ResponseHeader {
    pub fn encode(&self) -> [u8; RESPONSE_HEADER_BYTES] {
        let mut out = [0u8; RESPONSE_HEADER_BYTES];
        out[0..4].copy_from_slice(&RESPONSE_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&(self.status as u16).to_le_bytes());
        out[8..16].copy_from_slice(&self.handle.to_le_bytes());
        out[16..20].copy_from_slice(&self.payload_bytes.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8; RESPONSE_HEADER_BYTES]) -> Result<ResponseHeader, WireError> {
        let magic = u32_at(bytes, 0);
        if magic != RESPONSE_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let status = Status::from_u16(u16_at(bytes, 4))?;
        let reserved = u64::from(u16_at(bytes, 6)) | u64::from(u32_at(bytes, 20));
        if reserved != 0 {
            return Err(WireError::Reserved(reserved));
        }
        let payload_bytes = u32_at(bytes, 16);
        if payload_bytes as usize > MAX_PAYLOAD_BYTES {
            return Err(WireError::PayloadTooLarge(u64::from(payload_bytes)));
        }
        Ok(ResponseHeader {
            status,
            handle: u64_at(bytes, 8),
            payload_bytes,
        })
    }
}

/// An error answer's payload: three details (see `Status`), a fault kind,
/// and a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorBody {
    pub detail: [u64; 3],
    pub kind: u16,
    pub message: String,
}

impl ErrorBody {
    pub fn encode(&self) -> Vec<u8> {
        let message = truncate_utf8(&self.message, MAX_MESSAGE_BYTES);
        let mut out = Vec::with_capacity(32 + message.len());
        for detail in self.detail {
            out.extend_from_slice(&detail.to_le_bytes());
        }
        out.extend_from_slice(&self.kind.to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&(message.len() as u32).to_le_bytes());
        out.extend_from_slice(message.as_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<ErrorBody, WireError> {
        if bytes.len() < 32 {
            return Err(WireError::Truncated("error body"));
        }
        let length = u32_at(bytes, 28) as usize;
        if length > MAX_MESSAGE_BYTES || bytes.len() != 32 + length {
            return Err(WireError::Length {
                what: "error message",
                got: bytes.len() as u64,
                expected: 32 + length.min(MAX_MESSAGE_BYTES) as u64,
            });
        }
        Ok(ErrorBody {
            detail: [u64_at(bytes, 0), u64_at(bytes, 8), u64_at(bytes, 16)],
            kind: u16_at(bytes, 24),
            message: String::from_utf8_lossy(&bytes[32..]).into_owned(),
        })
    }
}

fn truncate_utf8(text: &str, limit: usize) -> &str {
    if text.len() <= limit {
        return text;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A fault kind on the wire: its index in `FaultKind::ALL`.
pub fn fault_kind_code(kind: FaultKind) -> u16 {
    FaultKind::ALL
        .iter()
        .position(|&k| k == kind)
        .expect("every kind is in ALL") as u16
}

pub fn fault_kind_from(code: u16) -> Result<FaultKind, WireError> {
    FaultKind::ALL
        .get(usize::from(code))
        .copied()
        .ok_or(WireError::UnknownValue {
            what: "fault kind",
            value: u64::from(code),
        })
}

/// What OPEN and CREATE answer: the replica's volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaInfo {
    pub size_bytes: u64,
    pub uuid: [u8; 16],
    pub block_size: u32,
    pub volume_tag: u32,
    pub guard: u8,
    pub layout: u8,
    pub encrypted: bool,
    pub read_only: bool,
    /// `Superblock::instance_tag`: 0 when the instance is unknown (or the
    /// replica's server is from before instance ids, which sends zero).
    pub instance_tag: u32,
    pub segment_blocks: u64,
    pub journal_bytes: u64,
}

impl ReplicaInfo {
    pub fn encode(&self) -> [u8; INFO_BYTES] {
        let mut out = [0u8; INFO_BYTES];
        out[0..8].copy_from_slice(&self.size_bytes.to_le_bytes());
        out[8..24].copy_from_slice(&self.uuid);
        out[24..28].copy_from_slice(&self.block_size.to_le_bytes());
        out[28..32].copy_from_slice(&self.volume_tag.to_le_bytes());
        out[32] = self.guard;
        out[33] = self.layout;
        out[34] = u8::from(self.encrypted);
        out[35] = u8::from(self.read_only);
        out[36..40].copy_from_slice(&self.instance_tag.to_le_bytes());
        out[40..48].copy_from_slice(&self.segment_blocks.to_le_bytes());
        out[48..56].copy_from_slice(&self.journal_bytes.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<ReplicaInfo, WireError> {
        if bytes.len() != INFO_BYTES {
            return Err(WireError::Length {
                what: "INFO",
                got: bytes.len() as u64,
                expected: INFO_BYTES as u64,
            });
        }
        let flag = |at: usize| match bytes[at] {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(WireError::UnknownValue {
                what: "INFO flag",
                value: u64::from(other),
            }),
        };
        Ok(ReplicaInfo {
            size_bytes: u64_at(bytes, 0),
            uuid: bytes[8..24].try_into().expect("16 bytes"),
            block_size: u32_at(bytes, 24),
            volume_tag: u32_at(bytes, 28),
            guard: bytes[32],
            layout: bytes[33],
            encrypted: flag(34)?,
            read_only: flag(35)?,
            instance_tag: u32_at(bytes, 36),
            segment_blocks: u64_at(bytes, 40),
            journal_bytes: u64_at(bytes, 48),
        })
    }
}

/// One block of a READ_SEALED answer: as stored, or the fault that kept
/// the replica from reading it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadEntry {
    Sealed(SealedBlock),
    Fault(Fault),
}

/// A READ_SEALED answer's payload.
pub fn encode_read_entries(entries: &[ReadEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * READ_ENTRY_BYTES);
    for entry in entries {
        let mut bytes = [0u8; READ_ENTRY_BYTES];
        match entry {
            ReadEntry::Sealed(block) => {
                bytes[8..8 + CONTEXT_BYTES].copy_from_slice(&block.context.encode());
                bytes[8 + CONTEXT_BYTES..].copy_from_slice(&block.data[..]);
            }
            ReadEntry::Fault(fault) => {
                bytes[0] = 1;
                bytes[1] = fault_kind_code(fault.kind) as u8;
            }
        }
        out.extend_from_slice(&bytes);
    }
    out
}

/// Decode a READ_SEALED answer for blocks `[first, first + count)`. A
/// context that does not decode is a `ContextCorrupt` fault of its block.
pub fn decode_read_entries(
    first: u64,
    count: u64,
    bytes: &[u8],
) -> Result<Vec<ReadEntry>, WireError> {
    let expected = count.saturating_mul(READ_ENTRY_BYTES as u64);
    if bytes.len() as u64 != expected {
        return Err(WireError::Length {
            what: "READ_SEALED answer",
            got: bytes.len() as u64,
            expected,
        });
    }
    bytes
        .chunks_exact(READ_ENTRY_BYTES)
        .enumerate()
        .map(|(index, entry)| {
            let lba = first + index as u64;
            if entry[2..8].iter().any(|&b| b != 0) {
                return Err(WireError::Reserved(lba));
            }
            match entry[0] {
                0 => {
                    let Ok(context) = Context::decode(&entry[8..8 + CONTEXT_BYTES]) else {
                        return Ok(ReadEntry::Fault(Fault {
                            lba,
                            kind: FaultKind::ContextCorrupt,
                        }));
                    };
                    let data = BlockData::copy_from(&entry[8 + CONTEXT_BYTES..]);
                    Ok(ReadEntry::Sealed(SealedBlock { lba, data, context }))
                }
                1 => Ok(ReadEntry::Fault(Fault {
                    lba,
                    kind: fault_kind_from(u16::from(entry[1]))?,
                })),
                other => Err(WireError::UnknownValue {
                    what: "READ_SEALED entry status",
                    value: u64::from(other),
                }),
            }
        })
        .collect()
}

/// A VERIFY answer: the faults found, and whether more were found than
/// listed.
pub fn encode_faults(faults: &[Fault]) -> Vec<u8> {
    let listed = &faults[..faults.len().min(MAX_VERIFY_FAULTS)];
    let mut out = Vec::with_capacity(8 + listed.len() * 16);
    out.extend_from_slice(&(listed.len() as u32).to_le_bytes());
    out.extend_from_slice(&u32::from(listed.len() < faults.len()).to_le_bytes());
    for fault in listed {
        out.extend_from_slice(&fault.lba.to_le_bytes());
        out.extend_from_slice(&fault_kind_code(fault.kind).to_le_bytes());
        out.extend_from_slice(&[0; 6]);
    }
    out
}

/// The count (4 bytes, at most `limit`) that opens an answer of 8
/// bytes or more (`answer`, `what` name them in errors).
fn counted(
    bytes: &[u8],
    answer: &'static str,
    what: &'static str,
    limit: usize,
) -> Result<usize, WireError> {
    if bytes.len() < 8 {
        return Err(WireError::Truncated(answer));
    }
    let count = u32_at(bytes, 0) as usize;
    if count > limit {
        return Err(WireError::OverLimit {
            what,
            got: count as u64,
            limit: limit as u64,
        });
    }
    Ok(count)
}

pub fn decode_faults(bytes: &[u8]) -> Result<(Vec<Fault>, bool), WireError> {
    let count = counted(
        bytes,
        "VERIFY answer",
        "VERIFY fault count",
        MAX_VERIFY_FAULTS,
    )?;
    if bytes.len() != 8 + count * 16 {
        return Err(WireError::Length {
            what: "VERIFY answer",
            got: bytes.len() as u64,
            expected: 8 + count as u64 * 16,
        });
    }
    let truncated = match u32_at(bytes, 4) {
        0 => false,
        1 => true,
        other => {
            return Err(WireError::UnknownValue {
                what: "VERIFY truncated flag",
                value: u64::from(other),
            })
        }
    };
    let faults = bytes[8..]
        .chunks_exact(16)
        .map(|entry| {
            Ok(Fault {
                lba: u64_at(entry, 0),
                kind: fault_kind_from(u16_at(entry, 8))?,
            })
        })
        .collect::<Result<_, WireError>>()?;
    Ok((faults, truncated))
}

fn allocation_code(allocation: Allocation) -> u8 {
    match allocation {
        Allocation::Hole => 0,
        Allocation::Zero => 1,
        Allocation::Data => 2,
    }
}

/// A BLOCK_STATUS answer: runs of (blocks, allocation).
pub fn encode_runs(runs: &[(u64, Allocation)]) -> Vec<u8> {
    let listed = &runs[..runs.len().min(MAX_STATUS_RUNS as usize)];
    let mut out = Vec::with_capacity(8 + listed.len() * 16);
    out.extend_from_slice(&(listed.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    for &(blocks, allocation) in listed {
        out.extend_from_slice(&blocks.to_le_bytes());
        out.push(allocation_code(allocation));
        out.extend_from_slice(&[0; 7]);
    }
    out
}

pub fn decode_runs(bytes: &[u8]) -> Result<Vec<(u64, Allocation)>, WireError> {
    if bytes.len() < 8 {
        return Err(WireError::Truncated("BLOCK_STATUS answer"));
    }
    let count = u32_at(bytes, 0) as u64;
    if count > MAX_STATUS_RUNS || bytes.len() as u64 != 8 + count * 16 {
        return Err(WireError::Length {
            what: "BLOCK_STATUS answer",
            got: bytes.len() as u64,
            expected: 8 + count.min(MAX_STATUS_RUNS) * 16,
        });
    }
    bytes[8..]
        .chunks_exact(16)
        .map(|run| {
            let allocation = match run[8] {
                0 => Allocation::Hole,
                1 => Allocation::Zero,
                2 => Allocation::Data,
                other => {
                    return Err(WireError::UnknownValue {
                        what: "allocation",
                        value: u64::from(other),
                    })
                }
            };
            Ok((u64_at(run, 0), allocation))
        })
        .collect()
}

/// A replica's snapshot as SNAPSHOT_CREATE and SNAPSHOT_LIST answer it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotEntry {
    pub name: String,
    pub id: String,
    /// The replica's journal checkpoint at the snapshot's flush point.
    pub checkpoint_seq: u64,
    pub created_unix: u64,
}

/// SNAPSHOT_LIST's answer (and SNAPSHOT_CREATE's, one entry): count (4),
/// reserved (4), then per snapshot checkpoint seq (8), created (8), id
/// (36), name length (2), reserved (2), name.
pub fn encode_snapshots(entries: &[SnapshotEntry]) -> Vec<u8> {
    let listed = &entries[..entries.len().min(MAX_SNAPSHOTS_LISTED)];
    let mut out = Vec::with_capacity(8 + listed.len() * (SNAPSHOT_ENTRY_FIXED_BYTES + 16));
    out.extend_from_slice(&(listed.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    for entry in listed {
        out.extend_from_slice(&entry.checkpoint_seq.to_le_bytes());
        out.extend_from_slice(&entry.created_unix.to_le_bytes());
        let mut id = entry.id.as_bytes().to_vec();
        id.resize(SNAPSHOT_ID_BYTES, b'-');
        out.extend_from_slice(&id[..SNAPSHOT_ID_BYTES]);
        let name = truncate_utf8(&entry.name, MAX_NAME_BYTES);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&[0; 2]);
        out.extend_from_slice(name.as_bytes());
    }
    out
}

pub fn decode_snapshots(bytes: &[u8]) -> Result<Vec<SnapshotEntry>, WireError> {
    let count = counted(
        bytes,
        "SNAPSHOT_LIST answer",
        "SNAPSHOT_LIST count",
        MAX_SNAPSHOTS_LISTED,
    )?;
    let mut at = 8;
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        let fixed = bytes
            .get(at..at + SNAPSHOT_ENTRY_FIXED_BYTES)
            .ok_or(WireError::Truncated("SNAPSHOT_LIST entry"))?;
        let length = usize::from(u16_at(fixed, 52));
        if u16_at(fixed, 54) != 0 {
            return Err(WireError::Reserved(u64::from(u16_at(fixed, 54))));
        }
        let name = bytes
            .get(at + SNAPSHOT_ENTRY_FIXED_BYTES..at + SNAPSHOT_ENTRY_FIXED_BYTES + length)
            .ok_or(WireError::Truncated("SNAPSHOT_LIST name"))?;
        entries.push(SnapshotEntry {
            checkpoint_seq: u64_at(fixed, 0),
            created_unix: u64_at(fixed, 8),
            id: decode_id(&fixed[16..16 + SNAPSHOT_ID_BYTES])?,
            name: decode_name(name)?,
        });
        at += SNAPSHOT_ENTRY_FIXED_BYTES + length;
    }
    if at != bytes.len() {
        return Err(WireError::Length {
            what: "SNAPSHOT_LIST answer",
            got: bytes.len() as u64,
            expected: at as u64,
        });
    }
    Ok(entries)
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
