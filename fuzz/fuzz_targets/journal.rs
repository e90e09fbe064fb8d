//! Journal records: header/entry decoding, round trip, and recovery replaying a checksum-valid record built from the input.
//! The body lives in `vouch_sim::fuzz::journal` so stable `cargo test -p vouch-sim` runs it too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| vouch_sim::fuzz::journal(data));
