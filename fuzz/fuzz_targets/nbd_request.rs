//! Fuzz the transmission request header parser: it must never panic, and
//! whatever it accepts must re-encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vouch_nbd::wire::{encode_request, parse_request, REQUEST_HEADER_BYTES};

fuzz_target!(|data: &[u8]| {
    let Some(header) = data.get(..REQUEST_HEADER_BYTES) else { return };
    let header: &[u8; REQUEST_HEADER_BYTES] = header.try_into().expect("length checked");
    if let Ok(request) = parse_request(header) {
        assert_eq!(&encode_request(&request), header);
    }
});
