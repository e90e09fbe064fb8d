//! Fuzz the replica protocol's request decoder (crates/replica/src/wire.rs):
//! it must never panic, and whatever it accepts must encode to a frame
//! that decodes to the same request.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use vouch_replica::wire::{decode_request, encode_request, RequestHeader, REQUEST_HEADER_BYTES};

fuzz_target!(|data: &[u8]| {
    let Some(header) = data.get(..REQUEST_HEADER_BYTES) else { return };
    let header: &[u8; REQUEST_HEADER_BYTES] = header.try_into().expect("length checked");
    let Ok(parsed) = RequestHeader::decode(header) else { return };
    let payload = Bytes::copy_from_slice(&data[REQUEST_HEADER_BYTES..]);
    let Ok(request) = decode_request(&parsed, &payload) else { return };
    let frame = encode_request(parsed.handle, &request);
    let again = RequestHeader::decode(frame[..REQUEST_HEADER_BYTES].try_into().expect("header"))
        .expect("an encoded header decodes");
    assert_eq!(
        decode_request(&again, &Bytes::copy_from_slice(&frame[REQUEST_HEADER_BYTES..]))
            .expect("an encoded request decodes"),
        request
    );
});
