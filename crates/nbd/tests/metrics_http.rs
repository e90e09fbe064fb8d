//! The Prometheus endpoint over real HTTP after real traffic.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;

use common::{python, TestOptions, TestServer};

fn http_get(port: u16, path: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

#[test]
fn metrics_endpoint_serves_prometheus_text() {
    let server = TestServer::start(TestOptions::default());
    python(&server, "h = nbd.NBD(); h.connect_uri(URI); h.pwrite(b'x' * 4096, 0); h.pread(4096, 0); h.flush()\n");
    let metrics = server.metrics.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let thread = std::thread::spawn(move || {
        runtime.block_on(async move {
            let serve = vouch_nbd::serve_metrics_on(listener, metrics, || {
                "vouch_engine_test 1\n".to_string()
            });
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), serve).await;
        })
    });
    let response = http_get(port, "/metrics");
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(
        response.contains("Content-Type: text/plain; version=0.0.4"),
        "{response}"
    );
    for expected in [
        "# TYPE vouch_nbd_requests_total counter",
        "vouch_nbd_requests_total{command=\"write\"} 1",
        "vouch_nbd_requests_total{command=\"read\"} 1",
        "vouch_nbd_requests_total{command=\"flush\"} 1",
        "vouch_nbd_bytes_total{command=\"write\"} 4096",
        "vouch_nbd_request_latency_seconds_count{command=\"read\"} 1",
        "vouch_nbd_connections_total 1",
        "vouch_engine_test 1",
    ] {
        assert!(
            response.contains(expected),
            "missing {expected}:\n{response}"
        );
    }
    assert!(http_get(port, "/other").starts_with("HTTP/1.1 404"));
    drop(thread);
}
