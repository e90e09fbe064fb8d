//! Hostile and broken clients over a raw TcpStream; a well-behaved client
//! must keep working afterwards.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{wait_until, TestOptions, TestServer};
use vouch_nbd::wire::{self, Command, Request};
use vouch_nbd::Limits;

fn connect(server: &TestServer) -> TcpStream {
    let stream = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
}

fn read_exact(stream: &mut TcpStream, count: usize) -> Vec<u8> {
    let mut buf = vec![0u8; count];
    stream.read_exact(&mut buf).unwrap();
    buf
}

/// Greeting + client flags; returns the stream in option haggling.
fn greet(server: &TestServer) -> TcpStream {
    let mut stream = connect(server);
    let greeting = read_exact(&mut stream, wire::GREETING_BYTES);
    assert_eq!(
        greeting,
        wire::encode_greeting(wire::FLAG_FIXED_NEWSTYLE | wire::FLAG_NO_ZEROES)
    );
    stream
        .write_all(&(wire::CLIENT_FLAG_FIXED_NEWSTYLE | wire::CLIENT_FLAG_NO_ZEROES).to_be_bytes())
        .unwrap();
    stream
}

fn send_option(stream: &mut TcpStream, option: u32, data: &[u8]) {
    let header = wire::encode_option_header(&wire::OptionHeader {
        option,
        length: data.len() as u32,
    });
    stream.write_all(&header).unwrap();
    stream.write_all(data).unwrap();
}

/// Read one option reply: (option, type, data).
fn option_reply(stream: &mut TcpStream) -> (u32, u32, Vec<u8>) {
    let head = read_exact(stream, wire::OPTION_REPLY_HEADER_BYTES);
    assert_eq!(head[0..8], wire::OPTION_REPLY_MAGIC.to_be_bytes());
    let option = u32::from_be_bytes(head[8..12].try_into().unwrap());
    let reply_type = u32::from_be_bytes(head[12..16].try_into().unwrap());
    let length = u32::from_be_bytes(head[16..20].try_into().unwrap());
    (option, reply_type, read_exact(stream, length as usize))
}

/// Full handshake with NBD_OPT_GO on "disk" (simple replies); returns (stream, size).
fn go(server: &TestServer) -> (TcpStream, u64) {
    let mut stream = greet(server);
    let mut data = Vec::new();
    data.extend_from_slice(&4u32.to_be_bytes());
    data.extend_from_slice(b"disk");
    data.extend_from_slice(&0u16.to_be_bytes());
    send_option(&mut stream, wire::OPT_GO, &data);
    let mut size = None;
    loop {
        let (option, reply_type, payload) = option_reply(&mut stream);
        assert_eq!(option, wire::OPT_GO);
        match reply_type {
            wire::REP_INFO => {
                if payload[0..2] == wire::INFO_EXPORT.to_be_bytes() {
                    size = Some(u64::from_be_bytes(payload[2..10].try_into().unwrap()));
                }
            }
            wire::REP_ACK => break,
            other => panic!("unexpected reply {other:#x}"),
        }
    }
    (stream, size.expect("NBD_INFO_EXPORT sent"))
}

fn request(
    stream: &mut TcpStream,
    command: u16,
    flags: u16,
    cookie: u64,
    offset: u64,
    length: u32,
) {
    let header = wire::encode_request(&Request {
        flags,
        command,
        cookie,
        offset,
        length,
    });
    stream.write_all(&header).unwrap();
}

/// Read a simple reply header: (error, cookie).
fn simple_reply(stream: &mut TcpStream) -> (u32, u64) {
    let head = read_exact(stream, wire::SIMPLE_REPLY_BYTES);
    assert_eq!(head[0..4], wire::SIMPLE_REPLY_MAGIC.to_be_bytes());
    (
        u32::from_be_bytes(head[4..8].try_into().unwrap()),
        u64::from_be_bytes(head[8..16].try_into().unwrap()),
    )
}

fn assert_closed(stream: &mut TcpStream) {
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("expected the server to close the connection, got {e}"),
        }
    }
}

/// A well-behaved client: write then read back 4 KiB.
fn healthy_round_trip(server: &TestServer, byte: u8) {
    let (mut stream, size) = go(server);
    assert_eq!(size, common::EXPORT_SIZE);
    request(&mut stream, 1, 0, 7, 4096, 4096);
    stream.write_all(&[byte; 4096]).unwrap();
    assert_eq!(simple_reply(&mut stream), (0, 7));
    request(&mut stream, 0, 0, 8, 4096, 4096);
    assert_eq!(simple_reply(&mut stream), (0, 8));
    assert_eq!(read_exact(&mut stream, 4096), vec![byte; 4096]);
    request(&mut stream, 2, 0, 9, 0, 0);
    assert_closed(&mut stream);
}

#[test]
fn garbage_and_bad_handshakes_are_dropped() {
    let server = TestServer::start(TestOptions::default());
    // Garbage instead of client flags + options.
    let mut stream = connect(&server);
    read_exact(&mut stream, wire::GREETING_BYTES);
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert_closed(&mut stream);
    // Unknown client flag.
    let mut stream = connect(&server);
    read_exact(&mut stream, wire::GREETING_BYTES);
    stream.write_all(&0x8000_0001u32.to_be_bytes()).unwrap();
    assert_closed(&mut stream);
    // Bad option magic.
    let mut stream = greet(&server);
    stream.write_all(&[0xff; 16]).unwrap();
    assert_closed(&mut stream);
    // Huge option length: dropped without the server trying to read 1 GiB.
    let mut stream = greet(&server);
    stream
        .write_all(&wire::encode_option_header(&wire::OptionHeader {
            option: wire::OPT_GO,
            length: 1 << 30,
        }))
        .unwrap();
    assert_closed(&mut stream);
    // Unknown option: NBD_REP_ERR_UNSUP; malformed GO: NBD_REP_ERR_INVALID;
    // then an option flood is cut off.
    let mut stream = greet(&server);
    send_option(&mut stream, 0x4242, b"abc");
    assert_eq!(option_reply(&mut stream).1, wire::REP_ERR_UNSUP);
    send_option(&mut stream, wire::OPT_GO, &[0, 0, 0, 99, b'x']);
    assert_eq!(option_reply(&mut stream).1, wire::REP_ERR_INVALID);
    send_option(&mut stream, wire::OPT_LIST, b"junk");
    assert_eq!(option_reply(&mut stream).1, wire::REP_ERR_INVALID);
    for _ in 0..vouch_nbd::limits::DEFAULT_MAX_OPTIONS {
        send_option(&mut stream, wire::OPT_STRUCTURED_REPLY, &[]);
    }
    assert_closed(&mut stream);
    // EXPORT_NAME of an unknown export cannot be refused politely: dropped.
    let mut stream = greet(&server);
    send_option(&mut stream, wire::OPT_EXPORT_NAME, b"missing");
    assert_closed(&mut stream);
    // STARTTLS without TLS configured: NBD_REP_ERR_UNSUP, session continues.
    let mut stream = greet(&server);
    send_option(&mut stream, wire::OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut stream).1, wire::REP_ERR_UNSUP);
    send_option(&mut stream, wire::OPT_ABORT, &[]);
    assert_eq!(option_reply(&mut stream).1, wire::REP_ACK);
    assert_closed(&mut stream);

    healthy_round_trip(&server, 0x61);
}

#[test]
fn bad_requests_in_transmission() {
    let server = TestServer::start(TestOptions::default());
    let (mut stream, size) = go(&server);
    // Unknown command and unknown flags: EINVAL, connection stays usable.
    request(&mut stream, 99, 0, 1, 0, 512);
    assert_eq!(simple_reply(&mut stream), (22, 1));
    request(&mut stream, 0, 0x8000, 2, 0, 512);
    assert_eq!(simple_reply(&mut stream), (22, 2));
    // Read past the end: EINVAL; write past the end: ENOSPC, payload consumed.
    request(&mut stream, 0, 0, 3, size, 512);
    assert_eq!(simple_reply(&mut stream), (22, 3));
    request(&mut stream, 0, 0, 4, u64::MAX - 100, 512);
    assert_eq!(simple_reply(&mut stream), (22, 4));
    request(&mut stream, 1, 0, 5, size - 512, 1024);
    stream.write_all(&[0xee; 1024]).unwrap();
    assert_eq!(simple_reply(&mut stream), (28, 5));
    // FLUSH with a non-zero length is invalid.
    request(&mut stream, 3, 0, 6, 0, 512);
    assert_eq!(simple_reply(&mut stream), (22, 6));
    // BLOCK_STATUS without structured replies / contexts: EINVAL.
    request(&mut stream, 7, 0, 7, 0, 4096);
    assert_eq!(simple_reply(&mut stream), (22, 7));
    // Still in sync: a normal read works.
    request(&mut stream, 0, 0, 8, 0, 512);
    assert_eq!(simple_reply(&mut stream), (0, 8));
    read_exact(&mut stream, 512);
    // Bad request magic: dropped.
    stream
        .write_all(&[0x55; wire::REQUEST_HEADER_BYTES])
        .unwrap();
    assert_closed(&mut stream);
    assert!(server
        .export
        .contents(size - 1024..size)
        .iter()
        .all(|b| *b == 0));
    healthy_round_trip(&server, 0x62);
}

#[test]
fn disconnect_mid_payload_and_disc_finishes_in_flight() {
    let server = TestServer::start(TestOptions::default());
    // Disconnect in the middle of a WRITE payload.
    let (mut stream, _) = go(&server);
    request(&mut stream, 1, 0, 1, 0, 1 << 20);
    stream.write_all(&[0x11; 1000]).unwrap();
    drop(stream);
    // Disconnect in the middle of a request header.
    let (mut stream, _) = go(&server);
    stream
        .write_all(&wire::REQUEST_MAGIC.to_be_bytes())
        .unwrap();
    drop(stream);
    // Pipelined writes then DISC: every write is answered before the close.
    let (mut stream, _) = go(&server);
    for cookie in 0..16u64 {
        request(&mut stream, 1, 0, cookie, cookie * 4096, 4096);
        stream.write_all(&[cookie as u8 + 1; 4096]).unwrap();
    }
    request(&mut stream, 2, 0, 99, 0, 0);
    let mut cookies: Vec<u64> = (0..16)
        .map(|_| simple_reply(&mut stream))
        .map(|(e, c)| {
            assert_eq!(e, 0);
            c
        })
        .collect();
    cookies.sort();
    assert_eq!(cookies, (0..16).collect::<Vec<_>>());
    assert_closed(&mut stream);
    for cookie in 0..16u64 {
        assert_eq!(
            server.export.contents(cookie * 4096..cookie * 4096 + 1),
            vec![cookie as u8 + 1]
        );
    }
    healthy_round_trip(&server, 0x63);
}

/// A client that sends its next request before a WRITE's reply (a deep
/// one) is told to the export (`Export::writes_queued`, vouch's "no
/// prompt commits"): `true` with the first write that has a request
/// behind it, `false` once 8 writes in a row had none (the last write of
/// a deep client's batch has none), nothing while it stays so, and
/// `false` when a connection ends with `true` sent.
#[test]
fn writes_with_requests_queued_behind_are_hinted_to_the_export() {
    let server = TestServer::start(TestOptions::default());
    let (mut stream, _) = go(&server);
    // Three writes in one send: `true` at the first.
    let mut burst = Vec::new();
    for cookie in 0..3u64 {
        burst.extend_from_slice(&wire::encode_request(&Request {
            flags: 0,
            command: 1,
            cookie,
            offset: cookie * 4096,
            length: 4096,
        }));
        burst.extend_from_slice(&[cookie as u8 + 1; 4096]);
    }
    stream.write_all(&burst).unwrap();
    for _ in 0..3 {
        assert_eq!(simple_reply(&mut stream).0, 0);
    }
    assert_eq!(*server.export.queued_hints.lock(), vec![true]);
    // Then writes one at a time, each after the last one's reply: the
    // burst's last write and 7 of these make 8 with nothing behind.
    for cookie in 3..10u64 {
        assert_eq!(*server.export.queued_hints.lock(), vec![true]);
        request(&mut stream, 1, 0, cookie, cookie * 4096, 4096);
        stream.write_all(&[cookie as u8 + 1; 4096]).unwrap();
        assert_eq!(simple_reply(&mut stream), (0, cookie));
    }
    assert_eq!(*server.export.queued_hints.lock(), vec![true, false]);
    // A write with a read behind it, then the connection ends.
    let mut burst = wire::encode_request(&Request {
        flags: 0,
        command: 1,
        cookie: 4,
        offset: 0,
        length: 4096,
    })
    .to_vec();
    burst.extend_from_slice(&[5; 4096]);
    burst.extend_from_slice(&wire::encode_request(&Request {
        flags: 0,
        command: 0,
        cookie: 5,
        offset: 0,
        length: 4096,
    }));
    stream.write_all(&burst).unwrap();
    let mut cookies = Vec::new();
    for _ in 0..2 {
        let (error, cookie) = simple_reply(&mut stream);
        assert_eq!(error, 0);
        if cookie == 5 {
            read_exact(&mut stream, 4096);
        }
        cookies.push(cookie);
    }
    cookies.sort();
    assert_eq!(cookies, vec![4, 5]);
    request(&mut stream, 2, 0, 6, 0, 0);
    assert_closed(&mut stream);
    wait_until("the closing hint", Duration::from_secs(10), || {
        server.export.queued_hints.lock().len() == 4
    });
    assert_eq!(
        *server.export.queued_hints.lock(),
        vec![true, false, true, false]
    );
}

#[test]
fn client_that_never_reads_does_not_stall_others() {
    let limits = Limits {
        max_in_flight_bytes_per_connection: 8 << 20,
        ..Limits::default()
    };
    let server = TestServer::start(TestOptions {
        limits,
        ..TestOptions::default()
    });
    let (mut stubborn, _) = go(&server);
    stubborn
        .set_write_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    // 256 x 1 MiB reads, never reading replies. The server stops reading us
    // once 8 MiB are in flight; our writes may then block, which is fine.
    for cookie in 0..256u64 {
        let header = wire::encode_request(&Request {
            flags: 0,
            command: 0,
            cookie,
            offset: 0,
            length: 1 << 20,
        });
        if stubborn.write_all(&header).is_err() {
            break;
        }
    }
    // Until the server has answered 8 of them: the stubborn connection has
    // had its whole 8 MiB budget in flight at least once.
    wait_until(
        "8 of the stubborn client's reads answered",
        Duration::from_secs(30),
        || server.metrics.requests(Command::Read) >= 8,
    );
    for byte in 0..4 {
        healthy_round_trip(&server, 0x70 + byte);
    }
    assert!(
        server.metrics.in_flight() <= 16,
        "in-flight bounded: {}",
        server.metrics.in_flight()
    );
    drop(stubborn);
}

#[test]
fn connection_limit_and_graceful_shutdown() {
    let limits = Limits {
        max_connections: 2,
        ..Limits::default()
    };
    let mut server = TestServer::start(TestOptions {
        limits,
        ..TestOptions::default()
    });
    let (mut first, _) = go(&server);
    let (_second, _) = go(&server);
    let mut third = connect(&server);
    assert_closed(&mut third);
    // In-flight write answered during shutdown; exports flushed afterwards.
    request(&mut first, 1, 0, 5, 0, 4096);
    first.write_all(&[0x44; 4096]).unwrap();
    assert_eq!(simple_reply(&mut first), (0, 5));
    let flushes_before = server.export.flushes.load(Ordering::Relaxed);
    server.stop();
    assert_closed(&mut first);
    assert!(server.export.flushes.load(Ordering::Relaxed) > flushes_before);
    assert!(
        TcpStream::connect(("127.0.0.1", server.port)).is_err(),
        "listener closed after shutdown"
    );
}

/// Large WRITE payloads raise the socket's receive low-water mark while
/// they arrive: a payload trickled in slow pieces must still be taken,
/// and the mark must be back to one byte for the next request header (a
/// lone 28-byte READ after the write would otherwise never wake the
/// reader, and the 10 s read timeout fails the test).
#[test]
fn large_writes_trickled_then_a_lone_small_request() {
    let server = TestServer::start(TestOptions::default());
    let (mut stream, _) = go(&server);
    const MIB: usize = 1 << 20;
    for (round, byte) in [0x5au8, 0xa5].into_iter().enumerate() {
        let offset = (round * MIB) as u64;
        request(&mut stream, 1, 0, round as u64, offset, MIB as u32);
        let payload = vec![byte; MIB];
        // Uneven pieces with pauses (a slow client, not a
        // synchronisation): the server sees partial payloads.
        for piece in payload.chunks(300 * 1024 + 7) {
            stream.write_all(piece).unwrap();
            std::thread::sleep(Duration::from_millis(30));
        }
        assert_eq!(simple_reply(&mut stream), (0, round as u64));
        // Nothing else is in flight: this header alone must wake the reader.
        request(&mut stream, 0, 0, 100 + round as u64, offset + 4096, 4096);
        assert_eq!(simple_reply(&mut stream), (0, 100 + round as u64));
        assert_eq!(read_exact(&mut stream, 4096), vec![byte; 4096]);
    }
    // A large write and a small one sent back to back in one piece.
    let mut batch = Vec::new();
    let header = |cookie, offset, length| {
        wire::encode_request(&Request {
            flags: 0,
            command: 1,
            cookie,
            offset,
            length,
        })
    };
    batch.extend_from_slice(&header(7, 0, MIB as u32));
    batch.extend_from_slice(&vec![0x77; MIB]);
    batch.extend_from_slice(&header(8, MIB as u64, 4096));
    batch.extend_from_slice(&[0x88; 4096]);
    stream.write_all(&batch).unwrap();
    let mut cookies = [simple_reply(&mut stream), simple_reply(&mut stream)];
    cookies.sort();
    assert_eq!(cookies, [(0, 7), (0, 8)]);
    assert_eq!(
        server.export.contents(MIB as u64 - 1..MIB as u64 + 1),
        vec![0x77, 0x88]
    );
    request(&mut stream, 2, 0, 9, 0, 0);
    assert_closed(&mut stream);
}
