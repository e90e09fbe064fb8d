//! Fuzz the option header and option data parsers: first 16 bytes are an
//! option header (magic, option, length), the rest is the option data.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vouch_nbd::wire::{parse_option, parse_option_header, OPTION_HEADER_BYTES};

fuzz_target!(|data: &[u8]| {
    let Some((header, rest)) = data.split_first_chunk::<OPTION_HEADER_BYTES>() else { return };
    let option = match parse_option_header(header) {
        Ok(header) => header.option,
        // Still exercise the data parser with the raw option number.
        Err(_) => u32::from_be_bytes([header[8], header[9], header[10], header[11]]),
    };
    let _ = parse_option(option, rest);
});
