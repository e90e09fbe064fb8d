//! Metadata units (a split context page, a packed row) damaged in place: a volume opened and read in full never panics, never reads another unit wrong, and a damaged unit's blocks read what was written there or a fault naming them.
//! The body lives in `vouch_sim::fuzz::unit` so stable `cargo test -p vouch-sim` runs it too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| vouch_sim::fuzz::unit(data));
