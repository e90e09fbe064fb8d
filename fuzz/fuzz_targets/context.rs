//! Protection-context decoding: canonical round trip; a single bit flip of a valid context never decodes to it.
//! The body lives in `vouch_sim::fuzz::context` so stable `cargo test -p vouch-sim` runs it too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| vouch_sim::fuzz::context(data));
