//! vouch-nbd: an NBD server library (fixed newstyle, structured replies,
//! block status, TLS, metrics) serving anything that implements [`Export`].
//!
//! It knows nothing of the storage engine. Typical use:
//!
//! ```no_run
//! # async fn example(export: std::sync::Arc<dyn vouch_nbd::Export>) -> Result<(), vouch_nbd::ServerError> {
//! use vouch_nbd::{Listen, Server, ServerConfig};
//! let mut config = ServerConfig::default();
//! config.exports.insert("vol0".into(), export);
//! config.default_export = Some("vol0".into());
//! config.listen.push(Listen::Tcp("127.0.0.1:10809".parse().unwrap()));
//! let server = Server::bind(config).await?;
//! let shutdown = server.shutdown_handle(); // call shutdown.shutdown() on SIGTERM
//! let metrics = server.metrics();          // vouch_nbd::metrics::router(metrics, || {})
//! server.run().await
//! # }
//! ```

pub mod export;
pub mod handshake;
pub mod limits;
pub mod metrics;
mod permits;
pub mod server;
pub mod socket_file;
pub mod tls;
mod transmission;
pub mod wire;
mod worker;

pub use crate::metrics::{serve_metrics, serve_metrics_on, Metrics};
pub use export::{
    BlockSizes, Errno, Export, ExportError, Extent, Integrity, IntegrityExtent, PayloadBuffer,
    ReadCompletion, WriteCompletion, ZeroFlags,
};
pub use limits::Limits;
pub use server::{Listen, Server, ServerConfig, ServerError, ShutdownHandle};
pub use worker::{Executor, DEFAULT_WORKER_THREADS};
