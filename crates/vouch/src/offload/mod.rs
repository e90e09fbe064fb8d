//! Offloads on a running server and offline (issue 10): verify with a
//! proof-of-work digest, scrub, copy and compare.
//!
//! - `engine_api` — the engine calls (the one place that names them);
//! - `jobs` — the server's job table and threads; `render` — results as JSON;
//! - `api` — the control API's routes; `control` — its listener and guards;
//! - `metrics` — job and scrub series for `serve --metrics`;
//! - `client` — the CLI's HTTP client; `cli` (arguments, progress, runners) and
//!   `cli_ops` — `vouch verify|scrub|copy|compare`.

pub mod api;
pub mod cli;
pub mod cli_ops;
pub mod client;
pub mod control;
pub mod engine_api;
pub mod jobs;
pub mod metrics;
pub mod render;
