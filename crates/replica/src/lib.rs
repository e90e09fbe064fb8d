//! Remote replicas of a vouch volume (docs/PROTOCOL.md, "Replica
//! protocol"; docs/ARCHITECTURE.md).
//!
//! - `wire` — the protocol's bytes: handshake, headers, payloads; pure
//!   functions, bounded, fuzzed by its tests.
//! - `server` — `vouch replica serve`: replicas (volume directories) held
//!   under a directory by name, served over TCP or TLS, one exporter per
//!   replica at a time.
//! - `client` — one connection, several requests in flight (handles),
//!   a timeout on every request; a failed or timed-out connection stays
//!   failed until the leg is opened again.
//! - `leg` — `RemoteLeg`: a `BlockDevice` over a connection (and, in
//!   `leg/snapshot.rs`, its replica's snapshots: version 3's requests). The exporter
//!   seals each block once (guard, reference tag, volume tag) and sends
//!   data with its context (`WRITE_SEALED`); the replica verifies it before
//!   storing; blocks read back are verified again on the exporter.
//! - `frame` — a request's bytes in pieces: a write's block data is
//!   sent from where it is (`writev`), not copied into one buffer.
//! - `auth` — a shared secret proven by challenge and response at every
//!   connect (authentication without TLS; mutual).
//! - `url` — `vouch://HOST:PORT/NAME`; `tls` — rustls configurations.

pub mod auth;
pub mod client;
mod frame;
pub mod leg;
mod plain;
pub mod server;
pub mod tls;
pub mod url;
pub mod wire;

pub use client::{ClientError, ClientOptions, Connection};
pub use leg::RemoteLeg;
pub use url::ReplicaUrl;

/// Default bound on one request's round trip.
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Bound on connecting and the handshake.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Requests a server runs at once per connection; it reads no further
/// request until one finishes (backpressure through TCP).
pub const MAX_IN_FLIGHT: usize = 32;
