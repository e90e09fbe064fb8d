//! The engine's offloads, as the control API and the CLI use them: every
//! call they make to the engine's verify, compare, copy and scrub goes
//! through these names (one place to look when the engine API changes).

pub use vouch_engine::copy::{copy, CopyMethod, CopyOptions, CopyReport};
pub use vouch_engine::scrub::{last_scrub, scrub, ScrubOptions, ScrubRecord, ScrubState};
pub use vouch_engine::verify::{compare_ranges, verify, ProofSeed, VerifyOptions, VerifyReport};

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
