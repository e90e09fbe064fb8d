//! Golden-bytes tests of the wire layouts (values from the NBD spec).

use super::*;
use proptest::prelude::*;

#[test]
fn magics_match_the_spec() {
    assert_eq!(&NBD_MAGIC.to_be_bytes(), b"NBDMAGIC");
    assert_eq!(&IHAVEOPT.to_be_bytes(), b"IHAVEOPT");
    assert_eq!(OPTION_REPLY_MAGIC, 0x3e889045565a9);
    assert_eq!(REQUEST_MAGIC, 0x25609513);
    assert_eq!(SIMPLE_REPLY_MAGIC, 0x67446698);
    assert_eq!(STRUCTURED_REPLY_MAGIC, 0x668e33ef);
    assert_eq!(REP_ERR_UNSUP, 0x8000_0001);
    assert_eq!(REP_ERR_TLS_REQD, 0x8000_0005);
    assert_eq!(REP_ERR_TOO_BIG, 0x8000_0009);
    assert_eq!(REPLY_TYPE_ERROR, 0x8001);
    assert_eq!(REPLY_TYPE_ERROR_OFFSET, 0x8002);
}

#[test]
fn greeting_bytes() {
    let expected = *b"NBDMAGICIHAVEOPT\x00\x03";
    assert_eq!(encode_greeting(SERVER_HANDSHAKE_FLAGS), expected);
}

#[test]
fn request_header_layout() {
    let bytes: [u8; 28] = [
        0x25, 0x60, 0x95, 0x13, // magic
        0x00, 0x01, // flags: FUA
        0x00, 0x01, // type: WRITE
        1, 2, 3, 4, 5, 6, 7, 8, // cookie
        0, 0, 0, 0, 0, 0, 0x10, 0, // offset 4096
        0, 0, 0x02, 0, // length 512
    ];
    let request = parse_request(&bytes).unwrap();
    assert_eq!(
        request,
        Request {
            flags: CMD_FLAG_FUA,
            command: 1,
            cookie: 0x0102030405060708,
            offset: 4096,
            length: 512
        }
    );
    assert_eq!(request.known_command(), Some(Command::Write));
    assert_eq!(encode_request(&request), bytes);
    let mut bad = bytes;
    bad[0] = 0;
    assert!(matches!(
        parse_request(&bad),
        Err(WireError::BadMagic { .. })
    ));
}

#[test]
fn reply_layouts() {
    assert_eq!(
        simple_reply(22, 0xabcd),
        [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22, 0, 0, 0, 0, 0, 0, 0xab, 0xcd]
    );
    let mut chunk = Vec::new();
    push_offset_data_header(&mut chunk, REPLY_FLAG_DONE, 7, 4096, 512);
    assert_eq!(
        chunk,
        [
            0x66, 0x8e, 0x33, 0xef, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0x02, 0x08, 0, 0, 0,
            0, 0, 0, 0x10, 0
        ]
    );
    let mut hole = Vec::new();
    push_offset_hole(&mut hole, 0, 7, 0, 4096);
    assert_eq!(hole.len(), 20 + 12);
    assert_eq!(&hole[4..8], &[0, 0, 0, 2]);
    assert_eq!(&hole[16..20], &[0, 0, 0, 12]);
    assert_eq!(&hole[28..32], &[0, 0, 0x10, 0]);
    let mut error = Vec::new();
    push_error_chunk(&mut error, 7, 5, "bad", Some(8192));
    assert_eq!(&error[4..8], &[0, 1, 0x80, 2]);
    assert_eq!(&error[16..20], &(6u32 + 3 + 8).to_be_bytes());
    assert_eq!(&error[20..24], &5u32.to_be_bytes());
    assert_eq!(&error[24..26], &3u16.to_be_bytes());
    assert_eq!(&error[26..29], b"bad");
    assert_eq!(&error[29..37], &8192u64.to_be_bytes());
    let mut long = Vec::new();
    push_error_chunk(&mut long, 1, 5, &"é".repeat(5000), None);
    let message_len = u16::from_be_bytes([long[24], long[25]]) as usize;
    assert!(message_len <= MAX_STRING_BYTES);
    assert!(std::str::from_utf8(&long[26..26 + message_len]).is_ok());
    let mut status = Vec::new();
    push_block_status(
        &mut status,
        REPLY_FLAG_DONE,
        9,
        1,
        &[(4096, STATE_HOLE | STATE_ZERO), (512, 0)],
    );
    assert_eq!(&status[6..8], &5u16.to_be_bytes());
    assert_eq!(&status[16..20], &20u32.to_be_bytes());
    assert_eq!(
        &status[20..],
        &[0, 0, 0, 1, 0, 0, 0x10, 0, 0, 0, 0, 3, 0, 0, 2, 0, 0, 0, 0, 0]
    );
}

#[test]
fn option_layouts() {
    let header = encode_option_header(&OptionHeader {
        option: OPT_GO,
        length: 10,
    });
    assert_eq!(&header[..8], b"IHAVEOPT");
    assert_eq!(
        parse_option_header(&header).unwrap(),
        OptionHeader {
            option: 7,
            length: 10
        }
    );
    let mut reply = Vec::new();
    encode_option_reply(&mut reply, OPT_GO, REP_INFO, &info_export(1 << 30, 0x0d6d));
    assert_eq!(
        reply,
        [
            0, 3, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, 0, 0, 0, 7, 0, 0, 0, 3, 0, 0, 0,
            12, // header
            0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0, 0x0d, 0x6d
        ]
    );
    assert_eq!(
        info_block_size(512, 4096, 1 << 25),
        [0, 3, 0, 0, 2, 0, 0, 0, 0x10, 0, 2, 0, 0, 0]
    );
    assert_eq!(
        export_name_reply(1, 3, true),
        [0, 0, 0, 0, 0, 0, 0, 1, 0, 3]
    );
    assert_eq!(export_name_reply(1, 3, false).len(), 134);
}

#[test]
fn parse_info_go_and_meta_context() {
    let mut data = Vec::new();
    data.extend_from_slice(&4u32.to_be_bytes());
    data.extend_from_slice(b"disk");
    data.extend_from_slice(&2u16.to_be_bytes());
    data.extend_from_slice(&INFO_NAME.to_be_bytes());
    data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    assert_eq!(
        parse_option(OPT_GO, &data).unwrap(),
        ClientOption::InfoGo {
            go: true,
            name: "disk".into(),
            requests: vec![1, 3]
        }
    );
    assert!(parse_option(OPT_INFO, &data[..data.len() - 1]).is_err());
    let mut extra = data.clone();
    extra.push(0);
    assert!(parse_option(OPT_INFO, &extra).is_err());

    let mut meta = Vec::new();
    meta.extend_from_slice(&0u32.to_be_bytes());
    meta.extend_from_slice(&1u32.to_be_bytes());
    meta.extend_from_slice(&15u32.to_be_bytes());
    meta.extend_from_slice(b"base:allocation");
    assert_eq!(
        parse_option(OPT_SET_META_CONTEXT, &meta).unwrap(),
        ClientOption::MetaContext {
            set: true,
            name: String::new(),
            queries: vec!["base:allocation".into()]
        }
    );
    // A query count larger than the data must fail, not allocate.
    let mut lying = Vec::new();
    lying.extend_from_slice(&0u32.to_be_bytes());
    lying.extend_from_slice(&u32::MAX.to_be_bytes());
    assert!(parse_option(OPT_LIST_META_CONTEXT, &lying).is_err());
    assert_eq!(
        parse_option(OPT_EXPORT_NAME, b"disk").unwrap(),
        ClientOption::ExportName {
            name: "disk".into()
        }
    );
    assert_eq!(
        parse_option(OPT_ABORT, b"ignored").unwrap(),
        ClientOption::Abort
    );
    assert!(parse_option(OPT_LIST, b"x").is_err());
    assert_eq!(
        parse_option(0x77, b"x").unwrap(),
        ClientOption::Unknown { option: 0x77 }
    );
}

proptest! {
    #[test]
    fn request_round_trips(flags: u16, command: u16, cookie: u64, offset: u64, length: u32) {
        let request = Request { flags, command, cookie, offset, length };
        prop_assert_eq!(parse_request(&encode_request(&request)).unwrap(), request);
    }

    #[test]
    fn option_parser_never_panics(option in 0u32..16, data in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = parse_option(option, &data);
    }
}
