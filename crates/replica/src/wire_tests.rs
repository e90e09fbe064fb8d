//! The decoders against golden bytes, round trips, and truncated and
//! random frames (fuzz-style: every input is an error or a request, never
//! a panic).

use rand::{Rng, SeedableRng};

use super::*;

fn sealed(lba: u64, fill: u8) -> SealedBlock {
    SealedBlock {
        lba,
        data: vouch_engine::BlockData::copy_from(&[fill; BLOCK as usize]),
        context: Context::Data {
            volume_tag: 7,
            ref_tag: lba,
            guard: 0x1234,
            generation: 3,
        },
    }
}

fn every_request() -> Vec<Request> {
    vec![
        Request::Open { name: "db".into() },
        Request::Create {
            name: "db-2".into(),
            journal_bytes: 1 << 20,
            superblock: vec![5u8; SUPERBLOCK_FILE_BYTES],
        },
        Request::ReadSealed { first: 9, count: 3 },
        Request::WriteSealed {
            blocks: vec![sealed(4, 1), sealed(5, 2)],
            fua: true,
        },
        Request::Flush,
        Request::Trim {
            offset: 4096,
            length: 8192,
            fua: false,
        },
        Request::WriteZeroes {
            offset: 512,
            length: 1024,
            fua: true,
            allocate: true,
        },
        Request::Verify {
            first: 0,
            count: 100,
        },
        Request::BlockStatus {
            offset: 0,
            length: 1 << 20,
            max_blocks: 256,
        },
        Request::NextData { lba: 77 },
        Request::SnapshotCreate {
            name: "before-upgrade".into(),
            id: "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0".into(),
            copy: true,
        },
        Request::SnapshotList,
        Request::SnapshotDelete {
            name: "before-upgrade".into(),
        },
        Request::OpenSnapshot {
            name: "db".into(),
            snapshot: "nightly".into(),
        },
    ]
}

#[test]
fn snapshot_lists_round_trip_and_truncated_ones_are_refused() {
    let entries = vec![
        SnapshotEntry {
            name: "a".into(),
            id: "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0".into(),
            checkpoint_seq: 7,
            created_unix: 1_700_000_000,
        },
        SnapshotEntry {
            name: "nightly-2026-11-28".into(),
            id: "1f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0".into(),
            checkpoint_seq: 9,
            created_unix: 1_700_000_100,
        },
    ];
    let bytes = encode_snapshots(&entries);
    assert_eq!(decode_snapshots(&bytes), Ok(entries));
    for cut in 0..bytes.len() {
        assert!(decode_snapshots(&bytes[..cut]).is_err(), "cut at {cut}");
    }
    let mut bad_id = bytes.clone();
    bad_id[8 + 16] = b'z';
    assert!(decode_snapshots(&bad_id).is_err());
}

fn decode(frame: &[u8]) -> Result<Request, WireError> {
    if frame.len() < REQUEST_HEADER_BYTES {
        return Err(WireError::Truncated("header"));
    }
    let header = RequestHeader::decode(frame[..REQUEST_HEADER_BYTES].try_into().unwrap())?;
    decode_request(
        &header,
        &bytes::Bytes::copy_from_slice(&frame[REQUEST_HEADER_BYTES..]),
    )
}

#[test]
fn every_request_round_trips() {
    for (handle, request) in every_request().into_iter().enumerate() {
        let frame = encode_request(handle as u64, &request);
        let header = RequestHeader::decode(frame[..REQUEST_HEADER_BYTES].try_into().unwrap())
            .expect("header");
        assert_eq!(header.handle, handle as u64);
        assert_eq!(decode(&frame), Ok(request));
    }
}

#[test]
fn golden_bytes_of_a_flush_and_a_hello() {
    let frame = encode_request(0x0102_0304_0506_0708, &Request::Flush);
    let mut expected = vec![b'V', b'R', b'R', b'Q', 5, 0, 0, 0];
    expected.extend_from_slice(&[8, 7, 6, 5, 4, 3, 2, 1]);
    expected.extend_from_slice(&[0; 24]);
    assert_eq!(frame, expected);
    let hello = Hello {
        version: 1,
        status: HELLO_OK,
    }
    .encode();
    assert_eq!(&hello, b"VOUCHREP\x01\x00\x00\x00\x00\x00\x00\x00");
    let response = ResponseHeader {
        status: Status::Fault,
        handle: 9,
        payload_bytes: 32,
    }
    .encode();
    assert_eq!(&response[..8], b"VRRS\x02\x00\x00\x00");
}

#[test]
fn a_hello_with_another_magic_is_refused_and_versions_are_named() {
    let mut hello = Hello {
        version: 3,
        status: 0,
    }
    .encode();
    assert_eq!(Hello::decode(&hello).unwrap().version, 3);
    assert_eq!(
        version_refusal(4),
        "replica protocol version 4 is not supported (this side speaks 2 to 3)"
    );
    assert_eq!(
        version_refusal_by(3, 2),
        "replica protocol version 3 is not supported (this side speaks 2)"
    );
    hello[0] = b'X';
    assert!(matches!(Hello::decode(&hello), Err(WireError::BadMagic(_))));
}

#[test]
fn every_truncation_of_every_request_is_an_error() {
    for request in every_request() {
        let frame = encode_request(1, &request);
        for cut in 0..frame.len() {
            assert!(
                decode(&frame[..cut]).is_err(),
                "{request:?} cut at {cut} decoded"
            );
        }
    }
}

#[test]
fn limits_and_names_are_enforced() {
    let header = |op: Op, length: u64, payload_bytes: u32| RequestHeader {
        op,
        flags: 0,
        handle: 1,
        offset: 0,
        length,
        payload_bytes,
    };
    let check = |h: RequestHeader| RequestHeader::decode(&h.encode());
    assert!(matches!(
        check(header(Op::ReadSealed, MAX_BLOCKS_PER_REQUEST + 1, 0)),
        Err(WireError::OverLimit { .. })
    ));
    assert!(matches!(
        check(header(Op::ReadSealed, 0, 0)),
        Err(WireError::OverLimit { .. })
    ));
    assert!(matches!(
        check(header(Op::Verify, MAX_VERIFY_BLOCKS + 1, 0)),
        Err(WireError::OverLimit { .. })
    ));
    assert!(matches!(
        check(header(Op::WriteSealed, 2, WRITE_ENTRY_BYTES as u32)),
        Err(WireError::Length { .. })
    ));
    assert!(matches!(
        check(header(Op::Flush, 0, u32::MAX)),
        Err(WireError::PayloadTooLarge(_))
    ));
    let mut flags = header(Op::Flush, 0, 0).encode();
    flags[6] = 0x80;
    assert!(matches!(
        RequestHeader::decode(&flags),
        Err(WireError::UnknownFlags(_))
    ));
    let mut op = header(Op::Flush, 0, 0).encode();
    op[4] = 99;
    assert!(matches!(
        RequestHeader::decode(&op),
        Err(WireError::UnknownOp(99))
    ));
    for bad in ["", ".", "..", "a/b", "../x", "x\ny"] {
        assert!(check_name(bad).is_err(), "{bad:?} accepted");
        let frame = encode_request(1, &Request::Open { name: bad.into() });
        assert!(decode(&frame).is_err(), "{bad:?} decoded");
    }
    assert!(check_name(&"n".repeat(256)).is_err());
    assert!(check_name("vm-disk.0").is_ok());
    // An empty name reads as one, not as a length over a limit.
    let frame = encode_request(
        1,
        &Request::Open {
            name: String::new(),
        },
    );
    let error = decode(&frame).expect_err("empty name").to_string();
    assert_eq!(error, "replica name \"\": empty");
}

#[test]
fn a_write_with_a_context_that_does_not_decode_names_its_lba() {
    let mut frame = encode_request(
        1,
        &Request::WriteSealed {
            blocks: vec![sealed(4, 1), sealed(5, 2)],
            fua: false,
        },
    );
    // The second entry's context: flip its self-check.
    let context_at = REQUEST_HEADER_BYTES + WRITE_ENTRY_BYTES + 8;
    frame[context_at + 31] ^= 0xff;
    assert_eq!(decode(&frame), Err(WireError::BadContext(5)));
}

#[test]
fn random_and_mutated_frames_never_panic() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    let frames: Vec<Vec<u8>> = every_request()
        .iter()
        .map(|r| encode_request(3, r))
        .collect();
    for round in 0..20_000 {
        let mut frame = if round % 4 == 0 {
            let len = rng.gen_range(0..200);
            (0..len).map(|_| rng.gen()).collect()
        } else {
            frames[round % frames.len()].clone()
        };
        if !frame.is_empty() {
            for _ in 0..rng.gen_range(1..4) {
                let at = rng.gen_range(0..frame.len());
                frame[at] = rng.gen();
            }
        }
        if rng.gen_bool(0.3) {
            let cut = rng.gen_range(0..=frame.len());
            frame.truncate(cut);
        }
        // What is accepted re-encodes to a frame that decodes the same
        // (the body of fuzz/fuzz_targets/replica_frame.rs).
        if let Ok(request) = decode(&frame) {
            let handle = u64::from_le_bytes(frame[8..16].try_into().unwrap());
            assert_eq!(decode(&encode_request(handle, &request)), Ok(request));
        }
        let _ = ErrorBody::decode(&frame);
        let _ = ReplicaInfo::decode(&frame);
        let _ = decode_faults(&frame);
        let _ = decode_runs(&frame);
        let _ = decode_read_entries(0, rng.gen_range(0..3), &frame);
        if frame.len() >= RESPONSE_HEADER_BYTES {
            let _ = ResponseHeader::decode(frame[..RESPONSE_HEADER_BYTES].try_into().unwrap());
        }
    }
}

#[test]
fn answers_round_trip() {
    let info = ReplicaInfo {
        size_bytes: 1 << 30,
        uuid: [9; 16],
        block_size: 4096,
        volume_tag: 77,
        guard: 1,
        layout: 0,
        encrypted: false,
        read_only: false,
        instance_tag: 0xfeed_0001,
        segment_blocks: 1 << 18,
        journal_bytes: 64 << 20,
    };
    assert_eq!(ReplicaInfo::decode(&info.encode()), Ok(info));
    let entries = vec![
        ReadEntry::Sealed(sealed(10, 3)),
        ReadEntry::Fault(Fault {
            lba: 11,
            kind: FaultKind::Unreadable,
        }),
    ];
    assert_eq!(
        decode_read_entries(10, 2, &encode_read_entries(&entries)),
        Ok(entries)
    );
    let faults = vec![Fault {
        lba: 5,
        kind: FaultKind::GuardMismatch,
    }];
    assert_eq!(decode_faults(&encode_faults(&faults)), Ok((faults, false)));
    let runs = vec![(3, Allocation::Hole), (5, Allocation::Data)];
    assert_eq!(decode_runs(&encode_runs(&runs)), Ok(runs));
    let body = ErrorBody {
        detail: [1, 2, 3],
        kind: 4,
        message: "no such replica".into(),
    };
    assert_eq!(ErrorBody::decode(&body.encode()), Ok(body));
}
