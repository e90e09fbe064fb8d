//! The engine against a model with an I/O error after an input-chosen number of writes: fail-stop, acknowledged reads, durable data after reopen and crash.
//! The body lives in `vouch_sim::fuzz::engine_model` so stable `cargo test -p vouch-sim` runs it too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| vouch_sim::fuzz::engine_model(data));
