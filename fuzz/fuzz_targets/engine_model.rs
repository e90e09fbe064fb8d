//! The engine against a model with an I/O error after an input-chosen number of writes, on the production scheduling (background commits and inline writes as the input picks): fail-stop, acknowledged reads, acknowledged data after a process restart, durable data after a power cut.
//! The body lives in `vouch_sim::fuzz::engine_model` so stable `cargo test -p vouch-sim` runs it too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| vouch_sim::fuzz::engine_model(data));
