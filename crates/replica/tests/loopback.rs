//! The replica server and `RemoteLeg` over real loopback sockets, with
//! real volumes: a mirror of a local and a remote leg, repair of the
//! remote copy, and refusals (version, name, holder, malformed frames, a
//! lost connection).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use vouch_engine::DeviceWrites;

use vouch_engine::{
    BlockDevice, CreateOptions, Error, SealedAdmission, SealedDevice, Submitted, BLOCK,
};
use vouch_mirror::{LegState, LegTemplate, Mirror, MirrorLeg};
use vouch_replica::auth;
use vouch_replica::server::{serve, CreatePolicy, Registry, ServerOptions};
use vouch_replica::wire::{self, Hello, Request, ResponseHeader, Status};
use vouch_replica::{ClientOptions, RemoteLeg, ReplicaUrl};

struct TestServer {
    port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestServer {
    fn start(dir: &Path) -> TestServer {
        let registry = Arc::new(Registry::new(dir, CreatePolicy::default()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready, port) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Runtime::new().expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                ready
                    .send(listener.local_addr().expect("addr").port())
                    .expect("ready");
                serve(listener, registry, None, ServerOptions::default(), async {
                    let _ = stopped.await;
                })
                .await;
            });
        });
        TestServer {
            port: port.recv().expect("port"),
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn url(&self, name: &str) -> ReplicaUrl {
        ReplicaUrl::parse(&format!("vouch://127.0.0.1:{}/{name}", self.port)).expect("url")
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn options() -> ClientOptions {
    ClientOptions {
        timeout: Duration::from_secs(10),
        ..ClientOptions::default()
    }
}

fn local_volume(dir: &Path) -> PathBuf {
    let path = dir.join("local");
    let options = CreateOptions::new(4 << 20);
    vouch_engine::create_volume(&path, &options)
        .expect("create")
        .close()
        .expect("close");
    path
}

/// A mirror of an active local and an active remote leg, no membership.
fn local_and_remote(local: Arc<dyn SealedDevice>, remote: Arc<dyn SealedDevice>) -> Arc<Mirror> {
    let leg = |name: &str, device| MirrorLeg {
        name: name.into(),
        device: Some(device),
        state: LegState::Active,
    };
    Mirror::new(vec![leg("local", local), leg("remote", remote)], None).expect("mirror")
}

fn pattern(lba: u64, tag: u8) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (i as u8) ^ tag ^ (lba as u8).wrapping_mul(31))
        .collect()
}

#[test]
fn a_mirror_of_a_local_and_a_remote_leg_writes_both_and_repairs_the_remote_copy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    std::fs::create_dir(&replicas).expect("mkdir");
    let server = TestServer::start(&replicas);
    let local_path = local_volume(dir.path());
    let template = LegTemplate::of(&local_path).expect("template");
    let remote = RemoteLeg::create(&server.url("disk"), &template, &options()).expect("create");
    let local = vouch_engine::open_volume(&local_path, &Default::default()).expect("open");
    assert_eq!(remote.uuid_string(), local.uuid_string());
    assert_eq!(remote.size(), local.size());
    let local: Arc<dyn SealedDevice> = Arc::new(local);
    let remote = Arc::new(remote);
    let mirror = local_and_remote(
        Arc::clone(&local),
        Arc::clone(&remote) as Arc<dyn SealedDevice>,
    );
    for lba in 0..16 {
        mirror
            .write(lba * BLOCK, &pattern(lba, 1), false)
            .expect("write");
    }
    // A sub-block write: read, patched and resealed on the exporter.
    mirror
        .write(20 * BLOCK + 512, &[0xab; 1024], false)
        .expect("partial write");
    mirror.flush().expect("flush");
    for lba in 0..16 {
        let mut buf = vec![0u8; BLOCK as usize];
        remote.read(lba * BLOCK, &mut buf).expect("remote read");
        assert_eq!(buf, pattern(lba, 1), "LBA {lba} on the remote leg");
    }
    // Sealed once on the exporter: both legs store the same context,
    // generation included (the mirror's clock, not the replica's own).
    let here = local.read_sealed(0, 16).expect("local sealed");
    let there = remote.read_sealed(0, 16).expect("remote sealed");
    for (a, b) in here.iter().zip(&there) {
        assert_eq!(a.context, b.context, "LBA {}", a.lba);
        assert!(a.context.generation().is_some_and(|g| g > 0));
    }
    let mut partial = vec![0u8; BLOCK as usize];
    remote.read(20 * BLOCK, &mut partial).expect("read");
    assert_eq!(&partial[..512], &[0u8; 512][..]);
    assert_eq!(&partial[512..1536], &[0xab; 1024][..]);
    assert!(remote.verify(0, 1024).expect("verify").is_empty());

    // Corrupt LBA 5 in the replica's file on disk (split layout: data at
    // LBA * 4096 of data.00000).
    let data_file = replicas.join("disk").join("data.00000");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&data_file)
        .expect("open data");
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, 5 * BLOCK + 100)
        .expect("read");
    byte[0] ^= 0x40;
    file.write_all_at(&byte, 5 * BLOCK + 100).expect("write");
    drop(file);
    let faults = remote.verify(0, 1024).expect("verify");
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(faults[0].lba, 5);
    // Reads through the mirror: good data every time, the remote repaired.
    for _ in 0..4 {
        let mut buf = vec![0u8; BLOCK as usize];
        mirror.read(5 * BLOCK, &mut buf).expect("mirror read");
        assert_eq!(buf, pattern(5, 1));
    }
    let status = mirror.status();
    assert_eq!(status[1].corrected, 1, "{:?}", status[1].repairs);
    assert!(remote.verify(0, 1024).expect("verify").is_empty());
}

/// Open replica `name` once its last connection has released it (the
/// release follows the connection's end), polling for about a second.
fn open_once_released(server: &TestServer, name: &str) -> Option<RemoteLeg> {
    for _ in 0..50 {
        match RemoteLeg::open(&server.url(name), &options()) {
            Ok(leg) => return Some(leg),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    None
}

#[test]
fn refusals_are_named_unknown_replica_in_use_and_bad_names() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    std::fs::create_dir(&replicas).expect("mkdir");
    let server = TestServer::start(&replicas);
    let error = RemoteLeg::open(&server.url("nothing"), &options())
        .err()
        .expect("unknown name refused");
    assert!(
        error.to_string().contains("no replica named nothing"),
        "{error}"
    );
    let template = LegTemplate::of(&local_volume(dir.path())).expect("template");
    let first = RemoteLeg::create(&server.url("r"), &template, &options()).expect("create");
    let again = RemoteLeg::create(&server.url("r"), &template, &options())
        .err()
        .expect("exists");
    assert!(again.to_string().contains("already exists"), "{again}");
    let busy = RemoteLeg::open(&server.url("r"), &options())
        .err()
        .expect("in use");
    assert!(
        busy.to_string().contains("in use by another exporter"),
        "{busy}"
    );
    drop(first);
    // Released when its connection ends.
    let reopened = open_once_released(&server, "r");
    assert!(reopened.is_some(), "the replica was not released");
    // A name with a path in it never reaches the server.
    assert!(ReplicaUrl::parse(&format!("vouch://127.0.0.1:{}/../x", server.port)).is_err());
}

fn raw_connect(port: u16) -> TcpStream {
    let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    stream
}

/// A raw connection past the handshake: hellos, and the answer to a
/// challenge that asks for no secret.
fn raw_handshake(port: u16) -> TcpStream {
    let mut stream = raw_connect(port);
    let hello = Hello {
        version: wire::PROTOCOL_VERSION,
        status: 0,
    };
    stream.write_all(&hello.encode()).expect("hello");
    let mut answer = [0u8; wire::HELLO_BYTES + auth::CHALLENGE_BYTES];
    stream.read_exact(&mut answer).expect("hello and challenge");
    let challenge =
        auth::Challenge::decode(answer[wire::HELLO_BYTES..].try_into().expect("40 bytes"))
            .expect("challenge");
    let response = auth::respond(None, &challenge, &auth::nonce()).expect("response");
    stream.write_all(&response.encode()).expect("response");
    let mut verdict = [0u8; auth::VERDICT_BYTES];
    stream.read_exact(&mut verdict).expect("verdict");
    assert_eq!(
        auth::Verdict::decode(&verdict).expect("verdict").status,
        auth::ACCEPTED
    );
    stream
}

/// A WRITE_SEALED whose payload stops short (its exporter killed, or the
/// link cut, mid-frame): the replica stores nothing of it, answers it
/// with no success, drops the connection and releases the replica, and
/// every write it answered before (flushed or not) is still there.
#[test]
fn a_write_sealed_cut_off_inside_its_payload_is_refused_and_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    std::fs::create_dir(&replicas).expect("mkdir");
    let server = TestServer::start(&replicas);
    let template = LegTemplate::of(&local_volume(dir.path())).expect("template");
    let remote = RemoteLeg::create(&server.url("r"), &template, &options()).expect("create");
    let before: Vec<u8> = (0..8u64)
        .flat_map(|lba| pattern(lba, if lba < 4 { 1 } else { 2 }))
        .collect();
    let half = 4 * BLOCK as usize;
    remote
        .write(0, &before[..half], true)
        .expect("flushed write");
    remote
        .write(4 * BLOCK, &before[half..], false)
        .expect("acknowledged write, not flushed");
    // Eight blocks over all of them, sealed as the exporter would.
    let cut = sealed(&remote, 0, 8, 9);
    drop(remote);
    // A raw connection opens the replica (once the leg's connection has
    // released it) and sends the frame cut inside its payload.
    let mut stream = None;
    for _ in 0..50 {
        let mut raw = raw_handshake(server.port);
        raw.write_all(&wire::encode_request(
            1,
            &Request::Open { name: "r".into() },
        ))
        .expect("open");
        let mut header = [0u8; wire::RESPONSE_HEADER_BYTES];
        raw.read_exact(&mut header).expect("open's answer");
        let header = ResponseHeader::decode(&header).expect("decode");
        let mut body = vec![0u8; header.payload_bytes as usize];
        raw.read_exact(&mut body).expect("open's payload");
        if header.status == Status::Ok {
            stream = Some(raw);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut stream = stream.expect("the replica was not released");
    let frame = wire::encode_request(
        5,
        &Request::WriteSealed {
            blocks: cut,
            fua: false,
        },
    );
    let payload_from = wire::REQUEST_HEADER_BYTES;
    let cut_at = payload_from + (frame.len() - payload_from) / 2;
    stream
        .write_all(&frame[..cut_at])
        .expect("part of the frame");
    stream
        .shutdown(std::net::Shutdown::Write)
        .expect("the sender stops mid-frame");
    // Whatever the server answers before it closes, it is no success.
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).expect("the server closes");
    if rest.len() >= wire::RESPONSE_HEADER_BYTES {
        let header = ResponseHeader::decode(
            rest[..wire::RESPONSE_HEADER_BYTES]
                .try_into()
                .expect("a header"),
        )
        .expect("decode");
        assert_ne!(header.status, Status::Ok, "a cut-off write was answered");
    }
    // The server is still there, and the replica holds what was
    // answered before, nothing of the cut-off write.
    let reopened = open_once_released(&server, "r");
    let reopened = reopened.expect("the replica was not released after the cut-off write");
    let mut after = vec![0u8; before.len()];
    reopened.read(0, &mut after).expect("read");
    assert!(
        after == before,
        "the replica changed: the cut-off write was stored, or an answered write lost"
    );
}

#[test]
fn a_client_of_another_version_is_refused_by_name_on_both_sides() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = TestServer::start(dir.path());
    // The server refuses version 4 and says the newest it speaks.
    let mut stream = raw_connect(server.port);
    stream
        .write_all(
            &Hello {
                version: 4,
                status: 0,
            }
            .encode(),
        )
        .expect("hello");
    let mut answer = [0u8; wire::HELLO_BYTES];
    stream.read_exact(&mut answer).expect("answer");
    let hello = Hello::decode(&answer).expect("decode");
    assert_eq!(hello.version, 3);
    assert_eq!(hello.status, wire::HELLO_VERSION_REFUSED);
    // An exporter from before the snapshot requests (version 2) is
    // accepted at its version.
    let mut stream = raw_connect(server.port);
    stream
        .write_all(
            &Hello {
                version: 2,
                status: 0,
            }
            .encode(),
        )
        .expect("hello");
    stream.read_exact(&mut answer).expect("answer");
    let hello = Hello::decode(&answer).expect("decode");
    assert_eq!((hello.version, hello.status), (2, wire::HELLO_OK));
    // The client refuses a server of version 4 by name.
    let fake = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = fake.local_addr().expect("addr").port();
    let thread = std::thread::spawn(move || {
        let (mut peer, _) = fake.accept().expect("accept");
        let mut hello = [0u8; wire::HELLO_BYTES];
        peer.read_exact(&mut hello).expect("read hello");
        peer.write_all(
            &Hello {
                version: 4,
                status: 0,
            }
            .encode(),
        )
        .expect("write hello");
    });
    let url = ReplicaUrl::parse(&format!("vouch://127.0.0.1:{port}/x")).expect("url");
    let error = RemoteLeg::open(&url, &options()).err().expect("refused");
    assert!(
        error
            .to_string()
            .contains("replica protocol version 4 is not supported (this side speaks 2 to 3)"),
        "{error}"
    );
    thread.join().expect("fake server");
}

#[test]
fn a_malformed_frame_gets_a_malformed_answer_and_the_connection_closes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = TestServer::start(dir.path());
    let mut stream = raw_handshake(server.port);
    // A READ_SEALED of 100000 blocks (over the limit), handle 77.
    let mut frame = wire::encode_request(77, &Request::ReadSealed { first: 0, count: 1 });
    frame[24..32].copy_from_slice(&100_000u64.to_le_bytes());
    stream.write_all(&frame).expect("send");
    let mut header = [0u8; wire::RESPONSE_HEADER_BYTES];
    stream.read_exact(&mut header).expect("answer header");
    let header = ResponseHeader::decode(&header).expect("decode");
    assert_eq!((header.status, header.handle), (Status::Malformed, 77));
    let mut body = vec![0u8; header.payload_bytes as usize];
    stream.read_exact(&mut body).expect("body");
    let body = wire::ErrorBody::decode(&body).expect("error body");
    assert!(body.message.contains("over the limit"), "{}", body.message);
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).expect("closed");
    assert!(rest.is_empty());
    // A data request before OPEN is refused, the connection kept.
    let mut stream = raw_handshake(server.port);
    stream
        .write_all(&wire::encode_request(3, &Request::Flush))
        .expect("send");
    let mut header = [0u8; wire::RESPONSE_HEADER_BYTES];
    stream.read_exact(&mut header).expect("answer header");
    let header = ResponseHeader::decode(&header).expect("decode");
    assert_eq!(header.status, Status::NotOpen);
}

#[test]
fn a_lost_connection_fails_every_later_request_as_unreachable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    std::fs::create_dir(&replicas).expect("mkdir");
    let server = TestServer::start(&replicas);
    let template = LegTemplate::of(&local_volume(dir.path())).expect("template");
    let remote = RemoteLeg::create(&server.url("r"), &template, &options()).expect("create");
    remote.write(0, &pattern(0, 3), true).expect("write");
    drop(server);
    let error = remote
        .write(0, &pattern(0, 4), false)
        .expect_err("server gone");
    assert!(matches!(error, Error::Unreachable(_)), "{error:?}");
    let error = remote.flush().expect_err("still gone");
    assert!(matches!(error, Error::Unreachable(_)), "{error:?}");
}

#[test]
fn a_request_past_its_timeout_drops_the_connection_and_later_requests_fail_at_once() {
    let (port, thread) = silent_peer();
    let timeout = Duration::from_millis(300);
    let connection = connect_to_peer(port, timeout);
    let started = std::time::Instant::now();
    let error = connection.call(&Request::Flush).expect_err("no answer");
    let took = started.elapsed();
    // The connection's own timeout, waited out in full.
    assert!(
        error.to_string().contains("timed out after 300ms"),
        "{error}"
    );
    assert!(took >= timeout, "failed after {took:?}, before the timeout");
    // The connection is dropped: the peer sees it close...
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !thread.is_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "the silent peer still connected 10 s after the timeout"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // ...and a later request fails at once: refused as it is sent, with
    // nothing to wait for.
    assert!(connection
        .dead()
        .is_some_and(|why| why.contains("timed out")));
    let error = connection
        .send(&Request::Flush)
        .err()
        .expect("a dead connection refuses to send");
    assert!(error.to_string().contains("timed out"), "{error}");
    let error = connection.call(&Request::Flush).expect_err("dead");
    assert!(error.to_string().contains("timed out"), "{error}");
    drop(connection);
    thread.join().expect("silent peer");
}

#[test]
fn the_replica_verifies_each_sealed_block_before_storing_any() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    std::fs::create_dir(&replicas).expect("mkdir");
    let server = TestServer::start(&replicas);
    let template = LegTemplate::of(&local_volume(dir.path())).expect("template");
    let remote = RemoteLeg::create(&server.url("r"), &template, &options()).expect("create");
    remote.write(0, &pattern(0, 1), true).expect("write");
    let good = remote.read_sealed(0, 1).expect("sealed").remove(0);
    drop(remote);
    // Raw requests: LBA 0's sealed block is good; the one made for LBA 2
    // from it has a flipped data bit (its guard no longer matches); the
    // one sent to LBA 3 still says LBA 0 in its reference tag.
    let connection =
        vouch_replica::Connection::connect(&server.url("r"), &options()).expect("connect");
    connection
        .call(&Request::Open { name: "r".into() })
        .expect("open");
    let mut bad = good.clone();
    bad.lba = 2;
    if let vouch_format::Context::Data { ref_tag, .. } = &mut bad.context {
        *ref_tag = 2;
    }
    let mut flipped = bad.data.to_vec();
    flipped[7] ^= 1;
    bad.data = vouch_engine::BlockData::copy_from(&flipped);
    let mut misplaced = good.clone();
    misplaced.lba = 3; // its context says LBA 0
    for (blocks, kind) in [
        (vec![good.clone(), bad], "guard_mismatch"),
        (vec![misplaced], "ref_tag_mismatch"),
    ] {
        let error = connection
            .call(&Request::WriteSealed {
                blocks: blocks.clone(),
                fua: true,
            })
            .expect_err("refused");
        let vouch_replica::ClientError::Remote { status, body } = &error else {
            panic!("{error:?}");
        };
        assert_eq!(*status, Status::Fault, "{error}");
        assert_eq!(
            wire::fault_kind_from(body.kind).expect("kind").name(),
            kind,
            "{error}"
        );
        assert_eq!(body.detail[0], blocks.last().expect("a block").lba);
    }
    // Nothing of the refused requests was stored.
    let answer = connection
        .call(&Request::ReadSealed { first: 2, count: 2 })
        .expect("read");
    for entry in wire::decode_read_entries(2, 2, &answer).expect("entries") {
        let wire::ReadEntry::Sealed(block) = entry else {
            panic!("{entry:?}");
        };
        assert_eq!(block.context, vouch_format::Context::Unwritten);
    }
}

/// Plain TCP: callers write their own frames, and one that finds another
/// writing leaves its frame to that one (`plain.rs`). Many threads
/// writing through one connection at once, single blocks and 512 KiB
/// writes: every block lands whole, as sent.
#[test]
fn concurrent_writers_on_one_connection_each_land_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    std::fs::create_dir(&replicas).expect("mkdir");
    let server = TestServer::start(&replicas);
    let template = LegTemplate::of(&local_volume(dir.path())).expect("template");
    let remote =
        Arc::new(RemoteLeg::create(&server.url("r"), &template, &options()).expect("create"));
    // 4 MiB volume: 1024 blocks; thread t owns blocks [t * 128, t * 128 + 128).
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let remote = Arc::clone(&remote);
            std::thread::spawn(move || {
                let first = t * 128;
                if t % 2 == 0 {
                    for lba in first..first + 128 {
                        remote
                            .write(lba * BLOCK, &pattern(lba, 7), false)
                            .expect("write");
                    }
                } else {
                    // 128 blocks: one WRITE_SEALED frame of 257 slices.
                    let data: Vec<u8> = (first..first + 128)
                        .flat_map(|lba| pattern(lba, 7))
                        .collect();
                    remote.write(first * BLOCK, &data, false).expect("write");
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("writer");
    }
    remote.flush().expect("flush");
    let mut all = vec![0u8; (1024 * BLOCK) as usize];
    remote.read(0, &mut all).expect("read");
    for lba in 0..1024u64 {
        let got = &all[(lba * BLOCK) as usize..((lba + 1) * BLOCK) as usize];
        assert!(got == pattern(lba, 7).as_slice(), "LBA {lba}");
    }
    assert!(remote.verify(0, 1024).expect("verify").is_empty());
}

/// A plain connection to a test peer on `port`, with `timeout`.
fn connect_to_peer(port: u16, timeout: Duration) -> Arc<vouch_replica::Connection> {
    let url = ReplicaUrl::parse(&format!("vouch://127.0.0.1:{port}/x")).expect("url");
    let options = ClientOptions {
        timeout,
        ..ClientOptions::default()
    };
    vouch_replica::Connection::connect(&url, &options).expect("connect")
}

/// Accept one client and shake hands as a replica would (asking for no
/// secret).
fn accept_with_hello(listener: &std::net::TcpListener) -> std::net::TcpStream {
    let (mut peer, _) = listener.accept().expect("accept");
    let mut hello = [0u8; wire::HELLO_BYTES];
    peer.read_exact(&mut hello).expect("hello");
    let mut opening = Hello {
        version: wire::PROTOCOL_VERSION,
        status: 0,
    }
    .encode()
    .to_vec();
    let challenge = auth::Challenge {
        flags: 0,
        nonce: auth::nonce(),
    };
    opening.extend_from_slice(&challenge.encode());
    peer.write_all(&opening).expect("hello");
    let mut response = [0u8; auth::RESPONSE_BYTES];
    peer.read_exact(&mut response).expect("response");
    let verdict = auth::Verdict {
        status: auth::ACCEPTED,
        proof: [0; auth::PROOF_BYTES],
    };
    peer.write_all(&verdict.encode()).expect("verdict");
    peer
}

/// A peer that shakes hands and then reads requests, answering none,
/// until the client hangs up.
fn silent_peer() -> (u16, std::thread::JoinHandle<()>) {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = silent.local_addr().expect("addr").port();
    let thread = std::thread::spawn(move || {
        let mut peer = accept_with_hello(&silent);
        let mut sink = Vec::new();
        let _ = peer.read_to_end(&mut sink);
    });
    (port, thread)
}

#[test]
fn a_request_answered_by_callback_times_out_on_the_reader_thread() {
    let (port, thread) = silent_peer();
    let connection = connect_to_peer(port, Duration::from_millis(300));
    assert!(connection.answers_by_callback());
    let (sender, answers) = std::sync::mpsc::channel();
    let started = std::time::Instant::now();
    // Nobody waits on this request: the connection's reader thread must
    // time it out by itself.
    let first = sender.clone();
    connection.send_then(
        &Request::Flush,
        Box::new(move |answer| {
            let _ = first.send(answer);
        }),
    );
    // 5 s: a hang guard for a callback that is never called.
    let answer = answers
        .recv_timeout(Duration::from_secs(5))
        .expect("the callback is called once the timeout runs out");
    let took = started.elapsed();
    let error = answer.expect_err("no answer came");
    assert!(
        error.to_string().contains("timed out after 300ms"),
        "{error}"
    );
    assert!(
        took >= Duration::from_millis(300),
        "timed out after {took:?}, before the timeout"
    );
    // The connection is dead: the next request fails at once, on the
    // caller's thread (answered before send_then returns).
    assert!(!connection.answers_by_callback());
    connection.send_then(
        &Request::Flush,
        Box::new(move |answer| {
            let _ = sender.send(answer);
        }),
    );
    let error = answers
        .try_recv()
        .expect("answered before send_then returned")
        .expect_err("dead");
    assert!(error.to_string().contains("timed out"), "{error}");
    drop(connection);
    thread.join().expect("silent peer");
}

/// Start a write through the mirror's completion path and wait for its
/// outcome; `None` when the mirror declined it.
fn write_completing(
    mirror: &Arc<Mirror>,
    offset: u64,
    data: &[u8],
) -> Option<vouch_engine::Result<()>> {
    let vouch_engine::Submitted::Started(start) = mirror
        .submit_write(
            offset,
            &bytes::Bytes::copy_from_slice(data),
            false,
            vouch_engine::Admission::Callback,
        )
        .expect("begin")
    else {
        return None;
    };
    let (sender, outcome) = std::sync::mpsc::channel();
    start(Box::new(move |result| {
        let _ = sender.send(result);
    }));
    Some(
        outcome
            .recv_timeout(Duration::from_secs(10))
            .expect("the write completes"),
    )
}

#[test]
fn writes_completed_by_the_remote_legs_answer_land_on_both_legs_and_a_lost_replica_is_taken_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    std::fs::create_dir(&replicas).expect("mkdir");
    let server = TestServer::start(&replicas);
    let local_path = local_volume(dir.path());
    let template = LegTemplate::of(&local_path).expect("template");
    let url = server.url("disk");
    let remote = RemoteLeg::create(&url, &template, &options()).expect("create");
    let local = vouch_engine::open_volume(&local_path, &Default::default()).expect("open");
    let local: Arc<dyn SealedDevice> = Arc::new(local);
    let remote = Arc::new(remote);
    let mirror = Mirror::new(
        vec![
            MirrorLeg {
                name: "local".into(),
                device: Some(Arc::clone(&local)),
                state: LegState::Active,
            },
            MirrorLeg {
                name: url.to_string(),
                device: Some(Arc::clone(&remote) as Arc<dyn SealedDevice>),
                state: LegState::Active,
            },
        ],
        None,
    )
    .expect("mirror");
    // A partial block is not started this way (it reads an edge first).
    assert!(write_completing(&mirror, 512, &[1u8; 512]).is_none());
    for lba in 0..8 {
        write_completing(&mirror, lba * BLOCK, &pattern(lba, 7))
            .expect("started")
            .expect("written");
    }
    mirror.flush().expect("flush");
    for lba in 0..8 {
        let mut buf = vec![0u8; BLOCK as usize];
        remote.read(lba * BLOCK, &mut buf).expect("remote read");
        assert_eq!(buf, pattern(lba, 7), "remote LBA {lba}");
        local.read(lba * BLOCK, &mut buf).expect("local read");
        assert_eq!(buf, pattern(lba, 7), "local LBA {lba}");
    }
    // The replica goes away: the write is still acknowledged (the local
    // leg took it) and the remote leg is taken out as unreachable.
    drop(server);
    let outcome = write_completing(&mirror, 8 * BLOCK, &pattern(8, 7));
    if let Some(outcome) = outcome {
        outcome.expect("the local leg took it");
    } else {
        // The dead connection was seen first: the blocking path takes it.
        mirror
            .write(8 * BLOCK, &pattern(8, 7), false)
            .expect("the local leg took it");
    }
    let status = mirror.status();
    assert_eq!(status[1].state, LegState::Stale, "{status:?}");
    assert_eq!(status[0].state, LegState::Active, "{status:?}");
    let mut buf = vec![0u8; BLOCK as usize];
    mirror.read(8 * BLOCK, &mut buf).expect("read");
    assert_eq!(buf, pattern(8, 7));
}

/// A peer that shakes hands and then reads nothing (a replica that stays
/// connected but stopped reading) until `stop` is sent or dropped.
fn deaf_peer() -> (
    u16,
    std::sync::mpsc::Sender<()>,
    std::thread::JoinHandle<()>,
) {
    let deaf = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = deaf.local_addr().expect("addr").port();
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let _peer = accept_with_hello(&deaf);
        let _ = stopped.recv();
    });
    (port, stop, thread)
}

/// `count` sealed blocks from `first` of `tag`'s pattern, as a mirror
/// hands them to a leg.
fn sealed(remote: &RemoteLeg, first: u64, count: u64, tag: u8) -> Vec<vouch_engine::SealedBlock> {
    let data: Vec<u8> = (first..first + count)
        .flat_map(|lba| pattern(lba, tag))
        .collect();
    remote
        .seal_blocks(first, &bytes::Bytes::from(data), 1)
        .expect("seal")
}

/// Requests one `send_then` each, answered on `answers` with the time
/// since the first was sent.
type Answers = std::sync::mpsc::Receiver<(Result<Vec<u8>, vouch_replica::ClientError>, Duration)>;

/// Send 32 requests of 1 MiB with `send_then` to a peer that reads
/// nothing: far more than loopback's socket buffers hold (tcp_wmem's
/// 4 MiB at most, and the deaf peer's receive window), so the socket
/// fills. The block data is shared, not copied.
fn fill_with_send_then(connection: &Arc<vouch_replica::Connection>) -> Answers {
    let block = vouch_engine::SealedBlock {
        lba: 0,
        data: vouch_engine::BlockData::copy_from(&pattern(0, 3)),
        context: vouch_format::Context::Unwritten,
    };
    let request = Request::WriteSealed {
        blocks: vec![block; wire::MAX_BLOCKS_PER_REQUEST as usize],
        fua: false,
    };
    let (sender, answers) = std::sync::mpsc::channel();
    let started = std::time::Instant::now();
    for _ in 0..32 {
        let sender = sender.clone();
        connection.send_then(
            &request,
            Box::new(move |answer| {
                let _ = sender.send((answer, started.elapsed()));
            }),
        );
    }
    answers
}

/// A caller that must not block (the NBD reactor starting a mirrored
/// write) sends with `send_then`: on a replica that stopped reading, the
/// socket fills, and still every call returns at once (`plain.rs`: the
/// sender thread finishes what a full socket did not take).
#[test]
fn send_then_never_waits_on_a_replica_that_stopped_reading() {
    let (port, stop, thread) = deaf_peer();
    // Nothing ends a request but the peer going away or this timeout (a
    // hang guard): a send_then that waited on the full socket would be let
    // go only by it, which kills the connection and answers every request.
    let connection = connect_to_peer(port, Duration::from_secs(120));
    assert!(connection.answers_by_callback());
    let answers = fill_with_send_then(&connection);
    // All 32 calls returned, and none was answered nor the connection
    // killed: none of them waited.
    assert!(
        answers.try_recv().is_err() && connection.dead().is_none(),
        "a request was answered before all 32 were sent: a send_then waited ({:?})",
        connection.dead()
    );
    // The peer goes away: every request is answered, with the error.
    drop(stop);
    thread.join().expect("deaf peer");
    for _ in 0..32 {
        let (answer, _) = answers
            .recv_timeout(Duration::from_secs(60))
            .expect("every request is answered");
        answer.expect_err("the peer answered nothing");
    }
    assert!(connection.dead().is_some());
}

/// The requests a deaf replica's full socket holds fail when the
/// connection's timeout runs out, though the sender thread may be stuck
/// writing them.
#[test]
fn send_then_requests_to_a_replica_that_stopped_reading_time_out() {
    let (port, stop, thread) = deaf_peer();
    let timeout = Duration::from_secs(3);
    let connection = connect_to_peer(port, timeout);
    assert!(connection.answers_by_callback());
    let answers = fill_with_send_then(&connection);
    for _ in 0..32 {
        // timeout + 10 s: a hang guard.
        let (answer, at) = answers
            .recv_timeout(timeout + Duration::from_secs(10))
            .expect("every request is answered");
        let error = answer.expect_err("the peer answered nothing");
        assert!(error.to_string().contains("timed out"), "{error}");
        assert!(
            at >= timeout,
            "failed after {at:?}, before the timeout ({timeout:?})"
        );
    }
    assert!(connection.dead().is_some());
    drop(connection);
    drop(stop);
    thread.join().expect("deaf peer");
}

/// A relay to `upstream` that forwards the client's bytes only while
/// nobody holds `gate` (a replica that stalls, then reads again).
fn gated_relay(upstream: u16, gate: Arc<std::sync::Mutex<()>>) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        let (mut client, _) = listener.accept().expect("accept");
        let mut server = TcpStream::connect(("127.0.0.1", upstream)).expect("upstream");
        let (mut answers, mut to_client) = (
            server.try_clone().expect("clone"),
            client.try_clone().expect("clone"),
        );
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut answers, &mut to_client);
        });
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let read = match client.read(&mut buffer) {
                Ok(0) | Err(_) => break,
                Ok(read) => read,
            };
            drop(gate.lock());
            if server.write_all(&buffer[..read]).is_err() {
                break;
            }
        }
        let _ = server.shutdown(std::net::Shutdown::Write);
    });
    port
}

/// Writes started while the replica does not read fill the socket; the
/// rest is queued or handed to the sender thread, every call returns at
/// once, and once the replica reads again every frame arrives whole and
/// in order: each write is answered and reads back as written.
#[test]
fn writes_sent_while_the_replica_stalls_go_out_whole_once_it_reads_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    std::fs::create_dir(&replicas).expect("mkdir");
    let server = TestServer::start(&replicas);
    let gate = Arc::new(std::sync::Mutex::new(()));
    let port = gated_relay(server.port, Arc::clone(&gate));
    let url = ReplicaUrl::parse(&format!("vouch://127.0.0.1:{port}/r")).expect("url");
    let local = dir.path().join("local");
    vouch_engine::create_volume(&local, &CreateOptions::new(64 << 20))
        .expect("create")
        .close()
        .expect("close");
    let template = LegTemplate::of(&local).expect("template");
    let remote = RemoteLeg::create(&url, &template, &options()).expect("create");
    assert!(remote.answers_by_callback());
    // 64 writes of 1 MiB, sealed beforehand: the whole volume.
    let writes: Vec<_> = (0..64u64)
        .map(|write| sealed(&remote, write * 256, 256, 5))
        .collect();
    let (sender, outcomes) = std::sync::mpsc::channel();
    let stalled = gate.lock().expect("gate");
    for blocks in &writes {
        let sender = sender.clone();
        let Submitted::Started(start) = remote
            .submit_sealed(blocks, false, SealedAdmission::Callback)
            .expect("checked")
        else {
            panic!("a write by callback is started");
        };
        start(Box::new(move |outcome| {
            let _ = sender.send(outcome);
        }));
    }
    // This thread holds the gate: a call that waited on the full socket
    // would return only once the connection's 10 s timeout killed it,
    // answering every write with an error.
    assert!(
        outcomes.try_recv().is_err(),
        "nothing is answered while the replica reads nothing"
    );
    drop(stalled);
    for _ in 0..64 {
        outcomes
            .recv_timeout(Duration::from_secs(10))
            .expect("answered once the replica reads again")
            .expect("written");
    }
    remote.flush().expect("flush");
    let mut all = vec![0u8; 64 << 20];
    remote.read(0, &mut all).expect("read");
    for lba in 0..(64 << 20) / BLOCK {
        let got = &all[(lba * BLOCK) as usize..((lba + 1) * BLOCK) as usize];
        assert!(got == pattern(lba, 5).as_slice(), "LBA {lba}");
    }
}

/// A sealed write that may wait is still started, not waited for, by a
/// remote leg (`submit_sealed` answers `Started` once its requests are
/// sent): the mirror's worker route writes its local legs meanwhile. While
/// the replica reads nothing, both waiting admissions return at once; the
/// writes complete, through the one completion, once it reads again.
#[test]
fn a_remote_legs_waiting_sealed_write_is_started_before_it_is_answered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    std::fs::create_dir(&replicas).expect("mkdir");
    let server = TestServer::start(&replicas);
    let gate = Arc::new(std::sync::Mutex::new(()));
    let port = gated_relay(server.port, Arc::clone(&gate));
    let url = ReplicaUrl::parse(&format!("vouch://127.0.0.1:{port}/r")).expect("url");
    let template = LegTemplate::of(&local_volume(dir.path())).expect("template");
    let remote = RemoteLeg::create(&url, &template, &options()).expect("create");
    let (here, waiting) = (sealed(&remote, 0, 4, 7), sealed(&remote, 8, 2, 7));
    let stalled = gate.lock().expect("gate");
    let started = [
        remote.submit_sealed(&here, false, SealedAdmission::Here),
        remote.submit_sealed(&waiting, true, SealedAdmission::MayWait),
    ]
    .map(|submitted| match submitted.expect("sent") {
        Submitted::Started(start) => start,
        other => panic!("{other:?}: a travelling write is started, not waited for"),
    });
    drop(stalled);
    for start in started {
        Submitted::Started(start).wait().expect("written");
    }
    for lba in (0..4).chain(8..10) {
        let mut buf = vec![0u8; BLOCK as usize];
        remote.read(lba * BLOCK, &mut buf).expect("read");
        assert!(buf == pattern(lba, 7), "LBA {lba}");
    }
}

#[test]
fn a_replica_whose_connection_died_is_neither_present_nor_active_in_the_status() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    std::fs::create_dir(&replicas).expect("mkdir");
    let server = TestServer::start(&replicas);
    let local_path = local_volume(dir.path());
    let template = LegTemplate::of(&local_path).expect("template");
    let remote = RemoteLeg::create(&server.url("disk"), &template, &options()).expect("create");
    let local = vouch_engine::open_volume(&local_path, &Default::default()).expect("open");
    let mirror = local_and_remote(Arc::new(local), Arc::new(remote));
    mirror.write(0, &pattern(0, 1), true).expect("write");
    assert!(mirror.status()[1].present);
    // The replica server goes away; nothing is written meanwhile.
    drop(server);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while mirror.status()[1].present && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = mirror.status();
    assert!(!status[1].present, "a dead replica shown present");
    assert_eq!(
        status[1].state,
        LegState::Stale,
        "active on a dead connection"
    );
    assert_eq!(mirror.active(), vec![0]);
    mirror
        .write(BLOCK, &pattern(1, 1), true)
        .expect("the local leg serves");
}
