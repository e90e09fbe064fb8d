//! Resource limits shared by the listener, the handshake and the
//! transmission phase. It lives apart from `server` so that the handshake
//! and transmission modules can read limits without importing the server
//! that drives them: dependencies run server -> handshake/transmission -> limits.

use std::time::Duration;

/// Largest READ/WRITE payload (the spec's interoperable maximum, 2^25).
pub const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 32 * 1024 * 1024;
/// Request payload bytes in flight on one connection before we stop reading it.
pub const DEFAULT_MAX_IN_FLIGHT_BYTES_PER_CONNECTION: u64 = 64 * 1024 * 1024;
/// Request payload bytes in flight across the server.
pub const DEFAULT_MAX_IN_FLIGHT_BYTES_PER_SERVER: u64 = 256 * 1024 * 1024;
/// Concurrent client connections (more are accepted and closed at once).
pub const DEFAULT_MAX_CONNECTIONS: usize = 128;
/// Requests in flight on one connection.
pub const DEFAULT_MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION: usize = 256;
/// Longest option data accepted during the handshake.
pub const DEFAULT_MAX_OPTION_BYTES: u32 = 64 * 1024;
/// Options accepted on one connection before it is dropped.
pub const DEFAULT_MAX_OPTIONS: u32 = 64;
/// Time allowed from accept to the transmission phase.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// A connection whose replies make no progress this long is dropped.
pub const DEFAULT_REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest invalid WRITE payload read and discarded (bigger ones drop the connection).
pub const DEFAULT_MAX_DISCARD_BYTES: u64 = 64 * 1024 * 1024;

/// Resource limits; every field defaults to the constant of the same name.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_payload_bytes: u32,
    pub max_in_flight_bytes_per_connection: u64,
    pub max_in_flight_bytes_per_server: u64,
    pub max_connections: usize,
    pub max_in_flight_requests_per_connection: usize,
    pub max_option_bytes: u32,
    pub max_options: u32,
    pub handshake_timeout: Duration,
    pub reply_write_timeout: Duration,
    pub max_discard_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            max_in_flight_bytes_per_connection: DEFAULT_MAX_IN_FLIGHT_BYTES_PER_CONNECTION,
            max_in_flight_bytes_per_server: DEFAULT_MAX_IN_FLIGHT_BYTES_PER_SERVER,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_in_flight_requests_per_connection: DEFAULT_MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION,
            max_option_bytes: DEFAULT_MAX_OPTION_BYTES,
            max_options: DEFAULT_MAX_OPTIONS,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            reply_write_timeout: DEFAULT_REPLY_WRITE_TIMEOUT,
            max_discard_bytes: DEFAULT_MAX_DISCARD_BYTES,
        }
    }
}
