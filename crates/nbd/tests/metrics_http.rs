//! The Prometheus endpoint over real HTTP after real traffic.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{python, TestOptions, TestServer};

/// One request on its own connection; the whole response, head and body.
fn http_request(port: u16, method: &str, path: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .unwrap_or_else(|error| panic!("{method} {path}: no whole response in 10 s: {error}"));
    response
}

/// Serve the endpoint of `server` on an ephemeral port in its own runtime,
/// with one extra gauge published at each scrape.
fn serve_endpoint(server: &TestServer) -> u16 {
    let metrics = server.metrics.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        runtime.block_on(async move {
            let serve = vouch_nbd::serve_metrics_on(listener, metrics, || {
                metrics::gauge!("vouch_engine_test").set(1.0);
            });
            let _ = tokio::time::timeout(Duration::from_secs(30), serve).await;
        })
    });
    port
}

#[test]
fn metrics_endpoint_serves_prometheus_text() {
    let server = TestServer::start(TestOptions::default());
    python(&server, "h = nbd.NBD(); h.connect_uri(URI); h.pwrite(b'x' * 4096, 0); h.pread(4096, 0); h.flush()\n");
    let port = serve_endpoint(&server);
    let response = http_request(port, "GET", "/metrics");
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(
        response
            .to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{response}"
    );
    for expected in [
        "# TYPE vouch_nbd_requests_total counter",
        "vouch_nbd_requests_total{command=\"write\",export=\"disk\"} 1",
        "vouch_nbd_requests_total{command=\"read\",export=\"disk\"} 1",
        "vouch_nbd_requests_total{command=\"flush\",export=\"disk\"} 1",
        "vouch_nbd_bytes_total{command=\"write\",export=\"disk\"} 4096",
        // The in-memory export has no try_read / try_write: all via workers.
        "vouch_nbd_inline_requests_total{command=\"read\",export=\"disk\"} 0",
        "vouch_nbd_request_latency_seconds_count{command=\"read\",export=\"disk\"} 1",
        "vouch_nbd_connections_total 1",
        "vouch_engine_test 1",
    ] {
        assert!(
            response.contains(expected),
            "missing {expected}:\n{response}"
        );
    }
}

#[test]
fn metrics_endpoint_rejects_other_paths_and_methods() {
    let server = TestServer::start(TestOptions::default());
    let port = serve_endpoint(&server);
    for path in ["/other", "/", "/metrics/x"] {
        let response = http_request(port, "GET", path);
        assert!(response.starts_with("HTTP/1.1 404"), "{path}: {response}");
    }
    for method in ["POST", "PUT", "DELETE"] {
        let response = http_request(port, method, "/metrics");
        assert!(response.starts_with("HTTP/1.1 405"), "{method}: {response}");
    }
    let garbage = {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream
            .write_all(b"\x16\x03\x01 not http at all\r\n\r\n")
            .unwrap();
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        response
    };
    assert!(
        garbage.is_empty() || garbage.starts_with("HTTP/1.1 400"),
        "{garbage}"
    );
    // The endpoint still answers after all of that.
    assert!(http_request(port, "GET", "/metrics").starts_with("HTTP/1.1 200 OK\r\n"));
}

#[test]
fn slow_clients_do_not_hold_the_endpoint() {
    let server = TestServer::start(TestOptions::default());
    let port = serve_endpoint(&server);
    // Clients that connect and send half a request head, or nothing at all.
    let mut idle = Vec::new();
    for index in 0..8 {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        if index % 2 == 0 {
            stream.write_all(b"GET /metr").unwrap();
        }
        idle.push(stream);
    }
    // A server that took connections one at a time would answer this
    // only after dropping each idle client at its 10 s request-head
    // timeout (and http_request's own 10 s read timeout fails first).
    let response = http_request(port, "GET", "/metrics");
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    // Answered while every idle client is still connected: the scrape did
    // not wait for any of them to be dropped.
    for (index, stream) in idle.iter_mut().enumerate() {
        stream.set_nonblocking(true).unwrap();
        let mut byte = [0u8; 1];
        match stream.read(&mut byte) {
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("idle client {index} was closed before the scrape: {other:?}"),
        }
    }
    drop(idle);
}
