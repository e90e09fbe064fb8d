//! With TLS, a sealed read of the largest size (256 blocks, a 1 MiB
//! answer) must come whole however the link paces it: inside a network
//! namespace whose TCP send buffers are small (`net.ipv4.tcp_wmem`, per
//! namespace), reached through a relay that forwards the replica's
//! answers slowly, so the replica's socket is full when it hands over the
//! end of an answer; with and without a write stream on the same
//! connection. A TLS stream that keeps the end of an answer in its own
//! buffer until the next answer (no flush) made such reads time out.

mod common;
mod replica_support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use vouch_engine::DeviceWrites;

use common::*;
use replica_support::*;
use vouch_engine::{CreateOptions, SealedDevice, BLOCK};
use vouch_mirror::LegTemplate;
use vouch_replica::tls::TlsFiles;
use vouch_replica::{ClientOptions, RemoteLeg, ReplicaUrl};

/// Bytes the relay forwards toward the exporter per step, and the pause
/// after each: about 8 MiB/s, so a 1 MiB answer takes ~130 ms to cross.
const SLOW_STEP_BYTES: usize = 16 << 10;
const SLOW_STEP_PAUSE: Duration = Duration::from_millis(2);

fn small_receive_buffer(stream: &TcpStream) {
    let bytes: libc::c_int = 128 << 10;
    set_socket_option(stream, libc::SO_RCVBUF, &bytes);
}

/// A relay on loopback to `upstream` for one connection: the exporter's
/// bytes go straight through; the replica's come back slowly, read from a
/// small receive buffer. Returns its port; stops when either side closes.
fn slow_relay(upstream: String) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind relay");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        let Ok((client, _)) = listener.accept() else {
            return;
        };
        let server = TcpStream::connect(&upstream).expect("connect upstream");
        small_receive_buffer(&server);
        let (mut client_in, mut server_out) = (
            client.try_clone().expect("clone"),
            server.try_clone().expect("clone"),
        );
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut client_in, &mut server_out);
            let _ = server_out.shutdown(std::net::Shutdown::Write);
        });
        let (mut server_in, mut client_out) = (server, client);
        let mut buffer = vec![0u8; SLOW_STEP_BYTES];
        loop {
            match server_in.read(&mut buffer) {
                Ok(0) | Err(_) => break,
                Ok(got) => {
                    if client_out.write_all(&buffer[..got]).is_err() {
                        break;
                    }
                }
            }
            // A slow link, not a synchronisation: the replica's socket
            // fills while this waits.
            std::thread::sleep(SLOW_STEP_PAUSE);
        }
        let _ = client_out.shutdown(std::net::Shutdown::Both);
    });
    port
}

fn block(lba: u64, tag: u8) -> Vec<u8> {
    let mut out = vec![tag; BLOCK as usize];
    out[..8].copy_from_slice(&lba.to_le_bytes());
    out
}

/// Run `work` on a thread that entered network namespace `netns`: the
/// sockets it creates live there (and may be used from any thread).
fn in_namespace<T: Send + 'static>(netns: &str, work: impl FnOnce() -> T + Send + 'static) -> T {
    use std::os::fd::AsRawFd;
    let path = format!("/var/run/netns/{netns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).expect("namespace file");
        // SAFETY: setns(2) on this thread only, with a namespace file
        // descriptor that stays open for the call.
        let entered = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(
            entered,
            0,
            "setns {path}: {}",
            std::io::Error::last_os_error()
        );
        work()
    })
    .join()
    .expect("namespace thread")
}

#[test]
fn tls_sealed_reads_of_the_largest_size_arrive_whole_through_a_slow_link_under_writes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = pki::make_ca(dir.path(), "ca");
    let server_pair = pki::make_leaf(dir.path(), "replica", &ca, "serverAuth");
    let client_pair = pki::make_leaf(dir.path(), "exporter", &ca, "clientAuth");
    // One namespace of the pair: its loopback, with small send buffers.
    let net = NetnsPair::new("tlsrd");
    let sysctl = run_timeout(
        in_netns(Some(&net.replica), &tool("sysctl", "procps"))
            .args(["-w", "net.ipv4.tcp_wmem=4096 16384 32768"]),
        TIMEOUT,
    );
    assert!(sysctl.status.success(), "{}", text(&sysctl));
    let replica = replica_server(
        &dir.path().join("replicas"),
        "127.0.0.1:0",
        &[
            "--tls-cert",
            s(&server_pair.0),
            "--tls-key",
            s(&server_pair.1),
            "--tls-ca",
            s(&ca.0),
        ],
        Some(&net.replica),
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let leg0 = dir.path().join("leg0");
    vouch_engine::create_volume(&leg0, &CreateOptions::new(16 << 20))
        .expect("create")
        .close()
        .expect("close");
    let options = ClientOptions {
        // A healthy link answers a 1 MiB read in well under this.
        timeout: Duration::from_secs(5),
        tls: Some(
            vouch_replica::tls::client_config(&TlsFiles {
                cert: &client_pair.0,
                key: &client_pair.1,
                ca: &ca.0,
            })
            .expect("client TLS"),
        ),
        ..ClientOptions::default()
    };
    let upstream = replica.addr.clone();
    let port = in_namespace(&net.replica, move || slow_relay(upstream));
    // `localhost` is in the test certificate's names.
    let url = ReplicaUrl::parse(&format!("vouch://localhost:{port}/disk")).expect("url");
    let template = LegTemplate::of(&leg0).expect("template");
    let remote = Arc::new(in_namespace(&net.replica, move || {
        RemoteLeg::create(&url, &template, &options).expect("create the replica through the relay")
    }));
    let mut data = Vec::with_capacity((256 * BLOCK) as usize);
    for lba in 0..256 {
        data.extend(block(lba, 0x3c));
    }
    remote.write(0, &data, true).expect("write the read range");
    let read_all = |round: usize| {
        let sealed = remote
            .read_sealed(0, 256)
            .unwrap_or_else(|error| panic!("read {round}: {error}"));
        assert_eq!(sealed.len(), 256);
        for (lba, one) in sealed.iter().enumerate() {
            assert!(
                one.data[..] == block(lba as u64, 0x3c)[..],
                "read {round}: LBA {lba}"
            );
        }
    };
    // Reads alone: nothing else would push an answer's end out.
    for round in 0..10 {
        read_all(round);
    }
    // Reads under a write stream of 256-block writes elsewhere.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (remote, stop) = (Arc::clone(&remote), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut written = 0u64;
            while !stop.load(Ordering::Acquire) {
                let first = 256 + (written % 8) * 256;
                let payload = vec![(written % 251) as u8; (256 * BLOCK) as usize];
                remote
                    .write(first * BLOCK, &payload, written % 4 == 3)
                    .expect("write stream");
                written += 1;
            }
            written
        })
    };
    for round in 10..30 {
        read_all(round);
    }
    stop.store(true, Ordering::Release);
    let written = writer.join().expect("writer");
    assert!(written > 0, "no write ran beside the reads");
}
