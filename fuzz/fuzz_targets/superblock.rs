//! Superblock decoding (and the written map's copy headers), and opening a volume whose superblock copy is the input (first byte: fix-up mode).
//! The body lives in `vouch_sim::fuzz::superblock` so stable `cargo test -p vouch-sim` runs it too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| vouch_sim::fuzz::superblock(data));
