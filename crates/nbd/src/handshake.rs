//! Fixed-newstyle handshake and option haggling.
//!
//! Reads are unbuffered here on purpose: after STARTTLS the byte stream
//! changes hands to rustls, and after GO / EXPORT_NAME to the transmission
//! reader, so no byte read ahead may be stranded in a private buffer.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::debug;

use crate::export::{BlockSizes, Export};
use crate::limits::Limits;
use crate::wire::{self, ClientOption, OptionHeader};

/// Context id we assign to `base:allocation` in SET_META_CONTEXT replies.
pub const BASE_ALLOCATION_CONTEXT_ID: u32 = 1;
/// Context id we assign to `x-vouch:integrity` in SET_META_CONTEXT replies.
pub const INTEGRITY_CONTEXT_ID: u32 = 2;

/// Context id we assign to `qemu:allocation-depth`.
pub const ALLOCATION_DEPTH_CONTEXT_ID: u32 = 3;
/// Context id of the first `qemu:dirty-bitmap:NAME` selected (the next
/// ones follow, in the order the client named them).
pub const FIRST_DIRTY_BITMAP_CONTEXT_ID: u32 = 16;

/// The metadata contexts selected for a session (by SET_META_CONTEXT on
/// the export it entered transmission with), as their context ids.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct MetaContexts {
    pub base_allocation: Option<u32>,
    pub integrity: Option<u32>,
    pub allocation_depth: Option<u32>,
    /// `(context id, bitmap name)`.
    pub dirty_bitmaps: Vec<(u32, String)>,
}

impl MetaContexts {
    pub fn any(&self) -> bool {
        self.base_allocation.is_some()
            || self.integrity.is_some()
            || self.allocation_depth.is_some()
            || !self.dirty_bitmaps.is_empty()
    }
}

/// One context an export offers: its name, the namespace wildcards that
/// list it (a wildcard never selects), and what selecting it means.
struct Offered {
    name: String,
    wildcards: &'static [&'static str],
    kind: OfferedKind,
}

enum OfferedKind {
    BaseAllocation,
    Integrity,
    AllocationDepth,
    DirtyBitmap(String),
}

/// The contexts `export` offers now.
fn offered_contexts(export: &dyn Export) -> Vec<Offered> {
    let mut offered = vec![Offered {
        name: wire::META_BASE_ALLOCATION.to_string(),
        wildcards: &["base:"],
        kind: OfferedKind::BaseAllocation,
    }];
    if export.can_integrity_status() {
        offered.push(Offered {
            name: wire::META_VOUCH_INTEGRITY.to_string(),
            wildcards: &[wire::META_VOUCH_NAMESPACE],
            kind: OfferedKind::Integrity,
        });
    }
    if export.can_allocation_depth() {
        offered.push(Offered {
            name: wire::META_QEMU_ALLOCATION_DEPTH.to_string(),
            wildcards: &[wire::META_QEMU_NAMESPACE],
            kind: OfferedKind::AllocationDepth,
        });
    }
    for bitmap in export.dirty_bitmaps() {
        offered.push(Offered {
            name: format!("{}{bitmap}", wire::META_QEMU_DIRTY_BITMAP),
            wildcards: &[wire::META_QEMU_NAMESPACE, wire::META_QEMU_DIRTY_BITMAP],
            kind: OfferedKind::DirtyBitmap(bitmap),
        });
    }
    offered
}

/// Why a handshake ended without entering transmission.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("client aborted")]
    Aborted,
    #[error("server shutting down")]
    Shutdown,
}

impl From<wire::WireError> for HandshakeError {
    fn from(error: wire::WireError) -> Self {
        HandshakeError::Protocol(error.to_string())
    }
}

/// What option haggling produced.
pub(crate) enum Negotiated {
    /// Enter the transmission phase with this session.
    Transmission(Session),
    /// The client sent STARTTLS and we acknowledged: upgrade, then haggle again.
    StartTls,
}

/// Everything the transmission phase needs about the negotiated export.
pub(crate) struct Session {
    pub export_name: String,
    pub export: Arc<dyn Export>,
    pub size: u64,
    pub transmission_flags: u16,
    pub structured_replies: bool,
    /// The metadata contexts selected for this export (BLOCK_STATUS).
    pub contexts: MetaContexts,
    /// The sizes advertised in NBD_INFO_BLOCK_SIZE.
    pub block_sizes: BlockSizes,
    /// The alignment requests must keep: the advertised minimum for a
    /// client that asked for block sizes (NBD_OPT_GO with
    /// NBD_INFO_BLOCK_SIZE: it MUST abide by them); for one that did not
    /// (NBD_OPT_EXPORT_NAME, or GO without that request) 1 if the export
    /// serves any byte range (`Export::can_byte_granularity`), as the
    /// spec's default sizing says a server SHOULD, else the minimum.
    pub request_alignment: u32,
}

/// Per-connection state carried across options (and reset by STARTTLS).
#[derive(Default)]
pub(crate) struct OptionState {
    pub tls_active: bool,
    pub no_zeroes: bool,
    pub options_seen: u32,
    structured_replies: bool,
    /// Export name whose SET_META_CONTEXT selected `meta_contexts`.
    meta_export: Option<String>,
    meta_contexts: MetaContexts,
}

impl OptionState {
    fn reset_for_tls(&mut self) {
        self.tls_active = true;
        self.structured_replies = false;
        self.meta_export = None;
        self.meta_contexts = MetaContexts::default();
    }
}

/// Read-only view of server configuration used during haggling.
pub(crate) struct HandshakeContext<'a> {
    pub exports: &'a HashMap<String, Arc<dyn Export>>,
    pub default_export: Option<&'a str>,
    pub tls_available: bool,
    pub tls_required: bool,
    pub limits: &'a Limits,
    pub shutting_down: &'a (dyn Fn() -> bool + Sync),
}

impl HandshakeContext<'_> {
    /// Resolve a client-supplied name to (canonical name, export).
    fn lookup(&self, name: &str) -> Option<(String, Arc<dyn Export>)> {
        let canonical = if name.is_empty() {
            match self.exports.get("") {
                Some(export) => return Some((String::new(), export.clone())),
                None => self.default_export?,
            }
        } else {
            name
        };
        self.exports
            .get(canonical)
            .map(|export| (canonical.to_string(), export.clone()))
    }
}

/// Send the greeting and read/validate the client flags.
pub(crate) async fn greet<S>(stream: &mut S, state: &mut OptionState) -> Result<(), HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream
        .write_all(&wire::encode_greeting(wire::SERVER_HANDSHAKE_FLAGS))
        .await?;
    stream.flush().await?;
    let mut raw = [0u8; 4];
    stream.read_exact(&mut raw).await?;
    let client_flags = u32::from_be_bytes(raw);
    // The spec requires dropping the connection on flags we do not know.
    if client_flags & !wire::CLIENT_FLAGS_KNOWN != 0 {
        return Err(HandshakeError::Protocol(format!(
            "unknown client flags {client_flags:#x}"
        )));
    }
    if client_flags & wire::CLIENT_FLAG_FIXED_NEWSTYLE == 0 {
        debug!("client did not set NBD_FLAG_C_FIXED_NEWSTYLE; honouring fixed newstyle anyway");
    }
    state.no_zeroes = client_flags & wire::CLIENT_FLAG_NO_ZEROES != 0;
    Ok(())
}

/// Transmission flags advertised for `export`, derived from its capability probes.
pub(crate) fn transmission_flags(export: &dyn Export, structured_replies: bool) -> u16 {
    let mut flags = wire::TFLAG_HAS_FLAGS | wire::TFLAG_SEND_FLUSH;
    if export.read_only() {
        flags |= wire::TFLAG_READ_ONLY;
    } else {
        if export.can_trim() {
            flags |= wire::TFLAG_SEND_TRIM;
        }
        if export.can_write_zeroes() {
            flags |= wire::TFLAG_SEND_WRITE_ZEROES;
            if export.can_fast_zero() {
                flags |= wire::TFLAG_SEND_FAST_ZERO;
            }
        }
    }
    if export.can_fua() {
        flags |= wire::TFLAG_SEND_FUA;
    }
    if export.can_multi_conn() {
        flags |= wire::TFLAG_CAN_MULTI_CONN;
    }
    if export.can_cache() {
        flags |= wire::TFLAG_SEND_CACHE;
    }
    if structured_replies {
        flags |= wire::TFLAG_SEND_DF;
    }
    flags
}

/// Block sizes we advertise and enforce: the export's, made spec-conformant
/// and with the maximum payload capped by the server limit.
pub(crate) fn effective_block_sizes(export: &dyn Export, limits: &Limits) -> BlockSizes {
    const MINIMUM_LIMIT: u32 = 1 << 16;
    let requested = export.block_sizes();
    let minimum = requested.minimum.clamp(1, MINIMUM_LIMIT);
    let minimum = if minimum.is_power_of_two() {
        minimum
    } else {
        minimum.next_power_of_two()
    };
    let preferred_floor = minimum.max(512);
    let preferred = requested.preferred.max(preferred_floor);
    let preferred = if preferred.is_power_of_two() {
        preferred
    } else {
        preferred.next_power_of_two()
    };
    let maximum = requested
        .maximum
        .min(limits.max_payload_bytes)
        .max(preferred);
    BlockSizes {
        minimum,
        preferred,
        maximum,
    }
}

async fn send_reply<S>(
    stream: &mut S,
    option: u32,
    reply_type: u32,
    data: &[u8],
) -> Result<(), HandshakeError>
where
    S: AsyncWrite + Unpin,
{
    let mut out = Vec::with_capacity(wire::OPTION_REPLY_HEADER_BYTES + data.len());
    wire::encode_option_reply(&mut out, option, reply_type, data);
    stream.write_all(&out).await?;
    stream.flush().await?;
    Ok(())
}

async fn send_error<S>(
    stream: &mut S,
    option: u32,
    reply_type: u32,
    message: &str,
) -> Result<(), HandshakeError>
where
    S: AsyncWrite + Unpin,
{
    debug!(
        option,
        reply_type = format_args!("{reply_type:#x}"),
        message,
        "option refused"
    );
    send_reply(stream, option, reply_type, message.as_bytes()).await
}

/// Haggle options until the client enters transmission, asks for TLS, aborts or misbehaves.
pub(crate) async fn option_loop<S>(
    stream: &mut S,
    context: &HandshakeContext<'_>,
    state: &mut OptionState,
) -> Result<Negotiated, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        let mut raw_header = [0u8; wire::OPTION_HEADER_BYTES];
        stream.read_exact(&mut raw_header).await?;
        let OptionHeader { option, length } = wire::parse_option_header(&raw_header)?;
        if length > context.limits.max_option_bytes {
            return Err(HandshakeError::Protocol(format!(
                "option {option} length {length} over limit"
            )));
        }
        state.options_seen += 1;
        if state.options_seen > context.limits.max_options {
            return Err(HandshakeError::Protocol("too many options".into()));
        }
        let mut data = vec![0u8; length as usize];
        stream.read_exact(&mut data).await?;

        if (context.shutting_down)() && option != wire::OPT_ABORT {
            send_error(
                stream,
                option,
                wire::REP_ERR_SHUTDOWN,
                "server is shutting down",
            )
            .await?;
            return Err(HandshakeError::Shutdown);
        }
        if context.tls_required && !state.tls_active {
            match option {
                wire::OPT_STARTTLS | wire::OPT_ABORT => {}
                wire::OPT_EXPORT_NAME => {
                    // EXPORT_NAME cannot be refused; the spec says terminate.
                    return Err(HandshakeError::Protocol(
                        "EXPORT_NAME before required TLS".into(),
                    ));
                }
                _ => {
                    send_error(
                        stream,
                        option,
                        wire::REP_ERR_TLS_REQD,
                        "TLS is required: use STARTTLS",
                    )
                    .await?;
                    continue;
                }
            }
        }
        let parsed = match wire::parse_option(option, &data) {
            Ok(parsed) => parsed,
            Err(error) => {
                send_error(stream, option, wire::REP_ERR_INVALID, &error.to_string()).await?;
                continue;
            }
        };
        if let Some(outcome) = handle_option(stream, context, state, option, parsed).await? {
            return Ok(outcome);
        }
    }
}

async fn handle_option<S>(
    stream: &mut S,
    context: &HandshakeContext<'_>,
    state: &mut OptionState,
    option: u32,
    parsed: ClientOption,
) -> Result<Option<Negotiated>, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match parsed {
        ClientOption::Abort => {
            // The client may already have closed; a failed ACK is not an error.
            let _ = send_reply(stream, option, wire::REP_ACK, &[]).await;
            Err(HandshakeError::Aborted)
        }
        ClientOption::ExportName { name } => {
            let Some((canonical, export)) = context.lookup(&name) else {
                return Err(HandshakeError::Protocol(format!(
                    "EXPORT_NAME for unknown export {name:?}"
                )));
            };
            let session = make_session(context, state, &name, canonical, export, false);
            let reply =
                wire::export_name_reply(session.size, session.transmission_flags, state.no_zeroes);
            stream.write_all(&reply).await?;
            stream.flush().await?;
            Ok(Some(Negotiated::Transmission(session)))
        }
        ClientOption::List => {
            let mut names: Vec<&String> = context.exports.keys().collect();
            names.sort();
            for name in names {
                send_reply(stream, option, wire::REP_SERVER, &wire::rep_server(name)).await?;
            }
            send_reply(stream, option, wire::REP_ACK, &[]).await?;
            Ok(None)
        }
        ClientOption::StartTls => {
            if state.tls_active {
                send_error(stream, option, wire::REP_ERR_INVALID, "TLS already active").await?;
                Ok(None)
            } else if !context.tls_available {
                send_error(stream, option, wire::REP_ERR_UNSUP, "TLS not configured").await?;
                Ok(None)
            } else {
                send_reply(stream, option, wire::REP_ACK, &[]).await?;
                // The spec forbids keeping negotiation state across STARTTLS.
                state.reset_for_tls();
                Ok(Some(Negotiated::StartTls))
            }
        }
        ClientOption::StructuredReply => {
            state.structured_replies = true;
            send_reply(stream, option, wire::REP_ACK, &[]).await?;
            Ok(None)
        }
        ClientOption::InfoGo { go, name, requests } => {
            let Some((canonical, export)) = context.lookup(&name) else {
                send_error(
                    stream,
                    option,
                    wire::REP_ERR_UNKNOWN,
                    &format!("unknown export {name:?}"),
                )
                .await?;
                return Ok(None);
            };
            // Only GO commits the client to the sizes (OPT_INFO lets it
            // learn them without committing).
            let asked = go && requests.contains(&wire::INFO_BLOCK_SIZE);
            let session = make_session(context, state, &name, canonical, export, asked);
            send_info(stream, option, &session, &requests).await?;
            send_reply(stream, option, wire::REP_ACK, &[]).await?;
            Ok(go.then_some(Negotiated::Transmission(session)))
        }
        ClientOption::MetaContext { set, name, queries } => {
            meta_context(stream, context, state, option, set, &name, &queries).await?;
            Ok(None)
        }
        ClientOption::Unknown { option } => {
            send_error(stream, option, wire::REP_ERR_UNSUP, "unsupported option").await?;
            Ok(None)
        }
    }
}

fn make_session(
    context: &HandshakeContext<'_>,
    state: &OptionState,
    requested_name: &str,
    canonical: String,
    export: Arc<dyn Export>,
    asked_block_sizes: bool,
) -> Session {
    let contexts =
        if state.structured_replies && state.meta_export.as_deref() == Some(requested_name) {
            state.meta_contexts.clone()
        } else {
            MetaContexts::default()
        };
    let block_sizes = effective_block_sizes(export.as_ref(), context.limits);
    let request_alignment = if asked_block_sizes || !export.can_byte_granularity() {
        block_sizes.minimum
    } else {
        1
    };
    Session {
        export_name: canonical,
        size: export.size(),
        transmission_flags: transmission_flags(export.as_ref(), state.structured_replies),
        structured_replies: state.structured_replies,
        contexts,
        block_sizes,
        request_alignment,
        export,
    }
}

async fn send_info<S>(
    stream: &mut S,
    option: u32,
    session: &Session,
    requests: &[u16],
) -> Result<(), HandshakeError>
where
    S: AsyncWrite + Unpin,
{
    send_reply(
        stream,
        option,
        wire::REP_INFO,
        &wire::info_export(session.size, session.transmission_flags),
    )
    .await?;
    if requests.contains(&wire::INFO_NAME) {
        send_reply(
            stream,
            option,
            wire::REP_INFO,
            &wire::info_string(wire::INFO_NAME, &session.export_name),
        )
        .await?;
    }
    if requests.contains(&wire::INFO_DESCRIPTION) {
        if let Some(description) = session.export.description() {
            send_reply(
                stream,
                option,
                wire::REP_INFO,
                &wire::info_string(wire::INFO_DESCRIPTION, &description),
            )
            .await?;
        }
    }
    // Always sent (the spec lets us volunteer information): it binds the
    // client only if it asked for it with GO (`Session::request_alignment`).
    let sizes = session.block_sizes;
    send_reply(
        stream,
        option,
        wire::REP_INFO,
        &wire::info_block_size(sizes.minimum, sizes.preferred, sizes.maximum),
    )
    .await
}

async fn meta_context<S>(
    stream: &mut S,
    context: &HandshakeContext<'_>,
    state: &mut OptionState,
    option: u32,
    set: bool,
    name: &str,
    queries: &[String],
) -> Result<(), HandshakeError>
where
    S: AsyncWrite + Unpin,
{
    if set {
        // SET replaces the previous selection even when it fails.
        state.meta_export = None;
        state.meta_contexts = MetaContexts::default();
        if !state.structured_replies {
            return send_error(
                stream,
                option,
                wire::REP_ERR_INVALID,
                "negotiate structured replies first",
            )
            .await;
        }
    }
    let Some((_, export)) = context.lookup(name) else {
        return send_error(
            stream,
            option,
            wire::REP_ERR_UNKNOWN,
            &format!("unknown export {name:?}"),
        )
        .await;
    };
    // The contexts this export offers now, each with the namespace
    // wildcards that list it (a wildcard never selects: the spec's rule
    // for `base:`, which vouch applies to the other namespaces too).
    let mut selected = MetaContexts::default();
    for offered in offered_contexts(export.as_ref()) {
        let matches = if set {
            queries.contains(&offered.name)
        } else {
            queries.is_empty()
                || queries.iter().any(|query| {
                    *query == offered.name || offered.wildcards.contains(&query.as_str())
                })
        };
        if !matches {
            continue;
        }
        let id = match offered.kind {
            OfferedKind::BaseAllocation => BASE_ALLOCATION_CONTEXT_ID,
            OfferedKind::Integrity => INTEGRITY_CONTEXT_ID,
            OfferedKind::AllocationDepth => ALLOCATION_DEPTH_CONTEXT_ID,
            OfferedKind::DirtyBitmap(_) => {
                FIRST_DIRTY_BITMAP_CONTEXT_ID + selected.dirty_bitmaps.len() as u32
            }
        };
        let context_id = if set { id } else { 0 };
        let payload = wire::rep_meta_context(context_id, &offered.name);
        send_reply(stream, option, wire::REP_META_CONTEXT, &payload).await?;
        match offered.kind {
            OfferedKind::BaseAllocation => selected.base_allocation = Some(id),
            OfferedKind::Integrity => selected.integrity = Some(id),
            OfferedKind::AllocationDepth => selected.allocation_depth = Some(id),
            OfferedKind::DirtyBitmap(bitmap) => selected.dirty_bitmaps.push((id, bitmap)),
        }
    }
    if set && selected.any() {
        state.meta_export = Some(name.to_string());
        state.meta_contexts = selected;
    }
    send_reply(stream, option, wire::REP_ACK, &[]).await
}
