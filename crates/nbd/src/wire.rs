//! NBD wire format: constants and sans-I/O encode/decode.
//!
//! Everything here is a pure function over byte slices so it can be unit
//! tested against golden bytes and fuzzed. All integers on the wire are
//! big-endian (network byte order). Layouts follow
//! `/work/shared/reference/nbd-protocol.md` (the NBD `proto.md`).

use std::fmt;

// ---------------------------------------------------------------------------
// Magics
// ---------------------------------------------------------------------------

/// 'NBDMAGIC', first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// 'IHAVEOPT', newstyle negotiation magic (server greeting and every option).
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every fixed-newstyle option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---------------------------------------------------------------------------
// Handshake flags
// ---------------------------------------------------------------------------

pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Handshake flags this server sends.
pub const SERVER_HANDSHAKE_FLAGS: u16 = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;

pub const CLIENT_FLAG_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_FLAG_NO_ZEROES: u32 = 1 << 1;
/// Client flags we understand; any other bit means the connection is dropped.
pub const CLIENT_FLAGS_KNOWN: u32 = CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES;

// ---------------------------------------------------------------------------
// Transmission flags
// ---------------------------------------------------------------------------

pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR + 1;
pub const REP_ERR_POLICY: u32 = REP_ERR + 2;
pub const REP_ERR_INVALID: u32 = REP_ERR + 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERR + 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR + 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR + 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR + 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR + 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR + 9;

pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Strings in the protocol (names, descriptions, messages) are limited to 4096 bytes.
pub const MAX_STRING_BYTES: usize = 4096;

// ---------------------------------------------------------------------------
// Commands
// ---------------------------------------------------------------------------

pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

pub const REPLY_FLAG_DONE: u16 = 1 << 0;

pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// Size of every request header.
pub const REQUEST_HEADER_BYTES: usize = 28;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_BYTES: usize = 16;
/// Size of a structured reply chunk header.
pub const STRUCTURED_HEADER_BYTES: usize = 20;
/// Size of an option request header (magic, option, length).
pub const OPTION_HEADER_BYTES: usize = 16;
/// Size of an option reply header (magic, option, type, length).
pub const OPTION_REPLY_HEADER_BYTES: usize = 20;
/// Greeting: NBDMAGIC, IHAVEOPT, handshake flags.
pub const GREETING_BYTES: usize = 18;

/// The metadata context name for allocation status.
pub const META_BASE_ALLOCATION: &str = "base:allocation";
/// vouch's integrity context. The spec reserves unregistered namespaces to
/// `x-*` ("for local experiments"), so vouch's namespace is `x-vouch`.
pub const META_VOUCH_INTEGRITY: &str = "x-vouch:integrity";
/// The wildcard that lists every context of vouch's namespace.
pub const META_VOUCH_NAMESPACE: &str = "x-vouch:";
/// qemu's namespace (docs/nbd.txt in qemu): the wildcard listing its contexts.
pub const META_QEMU_NAMESPACE: &str = "qemu:";
/// `qemu:allocation-depth`: how deep in a backing chain each run is
/// allocated (0 not allocated, 1 the top layer, 2 the layer below).
pub const META_QEMU_ALLOCATION_DEPTH: &str = "qemu:allocation-depth";
/// `qemu:dirty-bitmap:NAME` (bit 0 = dirty); this prefix alone is the
/// wildcard listing every bitmap.
pub const META_QEMU_DIRTY_BITMAP: &str = "qemu:dirty-bitmap:";
/// Bit 0 of a `qemu:dirty-bitmap:NAME` descriptor: the run is dirty.
pub const STATE_DIRTY: u32 = 1;
/// `x-vouch:integrity` status flags. 0 claims nothing (the spec requires a
/// status of 0 to be always safe): the extent was not checked.
/// Every block of the extent was read just now and passed verification.
pub const INTEGRITY_VERIFIED: u32 = 1 << 0;
/// Every block of the extent failed verification (a fault named by LBA in
/// the server's log and metrics).
pub const INTEGRITY_FAULT: u32 = 1 << 1;
/// The extent is not stored (a hole): it reads as zeros and has no
/// protection information to check.
pub const INTEGRITY_HOLE: u32 = 1 << 2;

/// Transmission command types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Command {
    Read = 0,
    Write = 1,
    Disc = 2,
    Flush = 3,
    Trim = 4,
    Cache = 5,
    WriteZeroes = 6,
    BlockStatus = 7,
}

impl Command {
    pub const ALL: [Command; 8] = [
        Command::Read,
        Command::Write,
        Command::Disc,
        Command::Flush,
        Command::Trim,
        Command::Cache,
        Command::WriteZeroes,
        Command::BlockStatus,
    ];

    pub fn from_u16(value: u16) -> Option<Command> {
        Self::ALL.get(usize::from(value)).copied()
    }

    /// Stable lower-case name used in logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Command::Read => "read",
            Command::Write => "write",
            Command::Disc => "disc",
            Command::Flush => "flush",
            Command::Trim => "trim",
            Command::Cache => "cache",
            Command::WriteZeroes => "write_zeroes",
            Command::BlockStatus => "block_status",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// A parsed request header. `command` is the raw type so that an unknown
/// command can still be answered (with EINVAL) using its cookie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    pub fn known_command(&self) -> Option<Command> {
        Command::from_u16(self.command)
    }
}

/// A framing error: the stream cannot be trusted any more and the
/// connection must be dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {found:#x}")]
    BadMagic { found: u64 },
    #[error("truncated: need {needed} bytes, have {available}")]
    Truncated { needed: usize, available: usize },
    #[error("malformed {what}")]
    Malformed { what: &'static str },
}

fn be_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([bytes[at], bytes[at + 1]])
}
fn be_u32(bytes: &[u8], at: usize) -> u32 {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&bytes[at..at + 4]);
    u32::from_be_bytes(raw)
}
fn be_u64(bytes: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&bytes[at..at + 8]);
    u64::from_be_bytes(raw)
}

/// Parse a 28-byte request header:
/// magic u32 | flags u16 | type u16 | cookie u64 | offset u64 | length u32.
pub fn parse_request(bytes: &[u8; REQUEST_HEADER_BYTES]) -> Result<Request, WireError> {
    let magic = be_u32(bytes, 0);
    if magic != REQUEST_MAGIC {
        return Err(WireError::BadMagic {
            found: u64::from(magic),
        });
    }
    Ok(Request {
        flags: be_u16(bytes, 4),
        command: be_u16(bytes, 6),
        cookie: be_u64(bytes, 8),
        offset: be_u64(bytes, 16),
        length: be_u32(bytes, 24),
    })
}

/// Encode a request header (used by tests and fuzz corpus generation).
pub fn encode_request(request: &Request) -> [u8; REQUEST_HEADER_BYTES] {
    let mut out = [0u8; REQUEST_HEADER_BYTES];
    out[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&request.flags.to_be_bytes());
    out[6..8].copy_from_slice(&request.command.to_be_bytes());
    out[8..16].copy_from_slice(&request.cookie.to_be_bytes());
    out[16..24].copy_from_slice(&request.offset.to_be_bytes());
    out[24..28].copy_from_slice(&request.length.to_be_bytes());
    out
}

/// The server greeting: NBDMAGIC | IHAVEOPT | handshake flags.
pub fn encode_greeting(handshake_flags: u16) -> [u8; GREETING_BYTES] {
    let mut out = [0u8; GREETING_BYTES];
    out[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[16..18].copy_from_slice(&handshake_flags.to_be_bytes());
    out
}

/// Option request header: IHAVEOPT | option u32 | data length u32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length: u32,
}

pub fn parse_option_header(bytes: &[u8; OPTION_HEADER_BYTES]) -> Result<OptionHeader, WireError> {
    let magic = be_u64(bytes, 0);
    if magic != IHAVEOPT {
        return Err(WireError::BadMagic { found: magic });
    }
    Ok(OptionHeader {
        option: be_u32(bytes, 8),
        length: be_u32(bytes, 12),
    })
}

pub fn encode_option_header(header: &OptionHeader) -> [u8; OPTION_HEADER_BYTES] {
    let mut out = [0u8; OPTION_HEADER_BYTES];
    out[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[8..12].copy_from_slice(&header.option.to_be_bytes());
    out[12..16].copy_from_slice(&header.length.to_be_bytes());
    out
}

/// A decoded option with its data. Names and queries are kept as raw bytes
/// converted lossily only for lookup; the protocol requires UTF-8 but a
/// non-UTF-8 name simply does not match any export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOption {
    ExportName {
        name: String,
    },
    Abort,
    List,
    StartTls,
    /// `go == false` for NBD_OPT_INFO.
    InfoGo {
        go: bool,
        name: String,
        requests: Vec<u16>,
    },
    StructuredReply,
    /// `set == false` for NBD_OPT_LIST_META_CONTEXT.
    MetaContext {
        set: bool,
        name: String,
        queries: Vec<String>,
    },
    Unknown {
        option: u32,
    },
}

/// Why an option's data is unacceptable; answered with NBD_REP_ERR_INVALID
/// (the option framing itself is intact, so the session continues).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid option data: {0}")]
pub struct OptionDataError(pub &'static str);

fn string_from(bytes: &[u8]) -> Result<String, OptionDataError> {
    if bytes.len() > MAX_STRING_BYTES {
        return Err(OptionDataError("string longer than 4096 bytes"));
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| OptionDataError("string is not UTF-8"))
}

/// A cursor over option data that fails instead of panicking.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, count: usize) -> Result<&'a [u8], OptionDataError> {
        let end = self
            .at
            .checked_add(count)
            .filter(|end| *end <= self.bytes.len())
            .ok_or(OptionDataError("length exceeds option data"))?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }
    fn u16(&mut self) -> Result<u16, OptionDataError> {
        Ok(be_u16(self.take(2)?, 0))
    }
    fn u32(&mut self) -> Result<u32, OptionDataError> {
        Ok(be_u32(self.take(4)?, 0))
    }
    fn string_u32(&mut self) -> Result<String, OptionDataError> {
        let length = self.u32()? as usize;
        string_from(self.take(length)?)
    }
    fn finish(&self) -> Result<(), OptionDataError> {
        if self.at == self.bytes.len() {
            Ok(())
        } else {
            Err(OptionDataError("trailing bytes in option data"))
        }
    }
}

/// Parse an option's data. Options that must carry no data fail with
/// `OptionDataError` when they do (except ABORT, which the spec says to accept).
pub fn parse_option(option: u32, data: &[u8]) -> Result<ClientOption, OptionDataError> {
    let mut cursor = Cursor { bytes: data, at: 0 };
    let parsed = match option {
        OPT_EXPORT_NAME => {
            return Ok(ClientOption::ExportName {
                name: string_from(data)?,
            })
        }
        OPT_ABORT => return Ok(ClientOption::Abort),
        OPT_LIST | OPT_STARTTLS | OPT_STRUCTURED_REPLY => {
            if !data.is_empty() {
                return Err(OptionDataError("option takes no data"));
            }
            match option {
                OPT_LIST => ClientOption::List,
                OPT_STARTTLS => ClientOption::StartTls,
                _ => ClientOption::StructuredReply,
            }
        }
        OPT_INFO | OPT_GO => {
            let name = cursor.string_u32()?;
            let count = cursor.u16()?;
            let mut requests = Vec::with_capacity(usize::from(count).min(data.len() / 2));
            for _ in 0..count {
                requests.push(cursor.u16()?);
            }
            ClientOption::InfoGo {
                go: option == OPT_GO,
                name,
                requests,
            }
        }
        OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
            let name = cursor.string_u32()?;
            let count = cursor.u32()?;
            // Each query takes at least 4 bytes, so `count` is bounded by the data.
            let mut queries = Vec::with_capacity((count as usize).min(data.len() / 4));
            for _ in 0..count {
                queries.push(cursor.string_u32()?);
            }
            ClientOption::MetaContext {
                set: option == OPT_SET_META_CONTEXT,
                name,
                queries,
            }
        }
        _ => return Ok(ClientOption::Unknown { option }),
    };
    cursor.finish()?;
    Ok(parsed)
}

/// Encode an option reply: magic | option | reply type | length | data.
pub fn encode_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, data: &[u8]) {
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    // Option reply data is always small (names, info records, messages).
    let length = u32::try_from(data.len()).expect("option reply data fits u32");
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(data);
}

/// NBD_REP_INFO / NBD_INFO_EXPORT payload: type | size u64 | flags u16.
pub fn info_export(size: u64, transmission_flags: u16) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
    out[2..10].copy_from_slice(&size.to_be_bytes());
    out[10..12].copy_from_slice(&transmission_flags.to_be_bytes());
    out
}

/// NBD_INFO_BLOCK_SIZE payload: type | minimum | preferred | maximum.
pub fn info_block_size(minimum: u32, preferred: u32, maximum: u32) -> [u8; 14] {
    let mut out = [0u8; 14];
    out[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    out[2..6].copy_from_slice(&minimum.to_be_bytes());
    out[6..10].copy_from_slice(&preferred.to_be_bytes());
    out[10..14].copy_from_slice(&maximum.to_be_bytes());
    out
}

/// NBD_INFO_NAME / NBD_INFO_DESCRIPTION payload: type | string.
pub fn info_string(info_type: u16, text: &str) -> Vec<u8> {
    let text = truncate_utf8(text, MAX_STRING_BYTES);
    let mut out = Vec::with_capacity(2 + text.len());
    out.extend_from_slice(&info_type.to_be_bytes());
    out.extend_from_slice(text.as_bytes());
    out
}

/// NBD_REP_SERVER payload: name length u32 | name.
pub fn rep_server(name: &str) -> Vec<u8> {
    let name = truncate_utf8(name, MAX_STRING_BYTES);
    let mut out = Vec::with_capacity(4 + name.len());
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// NBD_REP_META_CONTEXT payload: context id u32 | name.
pub fn rep_meta_context(context_id: u32, name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len());
    out.extend_from_slice(&context_id.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// Reply to NBD_OPT_EXPORT_NAME: size u64 | flags u16 | 124 zero bytes unless NO_ZEROES.
pub fn export_name_reply(size: u64, transmission_flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(10 + 124);
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
    if !no_zeroes {
        out.resize(out.len() + 124, 0);
    }
    out
}

/// Largest prefix of `text` of at most `limit` bytes that ends on a char boundary.
pub fn truncate_utf8(text: &str, limit: usize) -> &str {
    if text.len() <= limit {
        return text;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

// ---------------------------------------------------------------------------
// Transmission replies
// ---------------------------------------------------------------------------

/// Simple reply header: magic | error u32 | cookie u64.
pub fn simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_BYTES] {
    let mut out = [0u8; SIMPLE_REPLY_BYTES];
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out
}

/// Structured chunk header: magic | flags u16 | type u16 | cookie u64 | length u32.
pub fn structured_header(
    flags: u16,
    reply_type: u16,
    cookie: u64,
    length: u32,
) -> [u8; STRUCTURED_HEADER_BYTES] {
    let mut out = [0u8; STRUCTURED_HEADER_BYTES];
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&reply_type.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&length.to_be_bytes());
    out
}

/// Append an OFFSET_DATA chunk header (header + 8-byte offset); the caller sends `data_len` bytes next.
pub fn push_offset_data_header(
    out: &mut Vec<u8>,
    flags: u16,
    cookie: u64,
    offset: u64,
    data_len: u32,
) {
    out.extend_from_slice(&structured_header(
        flags,
        REPLY_TYPE_OFFSET_DATA,
        cookie,
        data_len + 8,
    ));
    out.extend_from_slice(&offset.to_be_bytes());
}

/// Append an OFFSET_HOLE chunk: header + offset u64 + hole size u32.
pub fn push_offset_hole(out: &mut Vec<u8>, flags: u16, cookie: u64, offset: u64, hole_len: u32) {
    out.extend_from_slice(&structured_header(
        flags,
        REPLY_TYPE_OFFSET_HOLE,
        cookie,
        12,
    ));
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&hole_len.to_be_bytes());
}

/// Append an error chunk (ERROR, or ERROR_OFFSET when `offset` is given),
/// always with DONE set: an error ends our replies.
pub fn push_error_chunk(
    out: &mut Vec<u8>,
    cookie: u64,
    error: u32,
    message: &str,
    offset: Option<u64>,
) {
    let message = truncate_utf8(message, MAX_STRING_BYTES);
    let (reply_type, tail) = match offset {
        Some(_) => (REPLY_TYPE_ERROR_OFFSET, 8),
        None => (REPLY_TYPE_ERROR, 0),
    };
    let length = (6 + message.len() + tail) as u32;
    out.extend_from_slice(&structured_header(
        REPLY_FLAG_DONE,
        reply_type,
        cookie,
        length,
    ));
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message.as_bytes());
    if let Some(offset) = offset {
        out.extend_from_slice(&offset.to_be_bytes());
    }
}

/// Append a BLOCK_STATUS chunk: header | context id | (length u32, flags u32)*.
pub fn push_block_status(
    out: &mut Vec<u8>,
    flags: u16,
    cookie: u64,
    context_id: u32,
    extents: &[(u32, u32)],
) {
    let length = (4 + 8 * extents.len()) as u32;
    out.extend_from_slice(&structured_header(
        flags,
        REPLY_TYPE_BLOCK_STATUS,
        cookie,
        length,
    ));
    out.extend_from_slice(&context_id.to_be_bytes());
    for (extent_len, status) in extents {
        out.extend_from_slice(&extent_len.to_be_bytes());
        out.extend_from_slice(&status.to_be_bytes());
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.known_command().map_or("unknown", Command::name);
        write!(
            f,
            "{name}(type={} flags={:#x} cookie={:#x} offset={} length={})",
            self.command, self.flags, self.cookie, self.offset, self.length
        )
    }
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
