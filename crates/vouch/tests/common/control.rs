//! A plain HTTP/1.1 client for the control API (`vouch serve --control`),
//! written against the wire (no vouch code), over TCP or a Unix socket.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::Server;

/// One request; `(status, JSON body)` (`Value::Null` for an empty body).
pub fn request(
    control: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    token: Option<&str>,
) -> (u16, Value) {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    request_raw(control, method, path, body.as_bytes(), token)
}

/// Like `request` with a body given as bytes (for bodies that are not JSON).
pub fn request_raw(
    control: &str,
    method: &str,
    path: &str,
    body: &[u8],
    token: Option<&str>,
) -> (u16, Value) {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(token) = token {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    head.push_str("\r\n");
    let mut message = head.into_bytes();
    message.extend_from_slice(body);
    let response = if let Some(path) = control.strip_prefix("unix:") {
        let mut stream = UnixStream::connect(path).expect("connect control socket");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        exchange(&mut stream, &message)
    } else {
        let addr = control.trim_start_matches("http://");
        let mut stream = TcpStream::connect(addr).expect("connect control API");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        exchange(&mut stream, &message)
    };
    parse_response(&response)
}

/// One whole HTTP/1.1 response: `(status, JSON body)` (`Value::Null` for
/// an empty body).
pub fn parse_response(response: &[u8]) -> (u16, Value) {
    let text = String::from_utf8_lossy(response).to_string();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("malformed HTTP response: {text:?}"));
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    let value = if body.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
    };
    (status, value)
}

fn exchange<S: Read + Write>(stream: &mut S, message: &[u8]) -> Vec<u8> {
    stream.write_all(message).expect("send request");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).expect("read response");
    response
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").expect("chunk size");
        let size = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
        if size == 0 {
            return out;
        }
        out.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
}

/// The server's control address (it must have been started with --control).
pub fn control(server: &Server) -> &str {
    server
        .control
        .as_deref()
        .expect("server started with --control")
}

/// `POST /v1/jobs`, which must be accepted; the job id.
pub fn submit(server: &Server, body: Value) -> u64 {
    let (status, answer) = request(control(server), "POST", "/v1/jobs", Some(&body), None);
    assert_eq!(status, 202, "POST {body}: {answer}");
    answer["id"].as_u64().expect("job id")
}

/// Long-poll a job until it is no longer queued or running.
pub fn wait_job(server: &Server, id: u64, timeout: Duration) -> Value {
    let deadline = Instant::now() + timeout;
    loop {
        let (status, job) = request(
            control(server),
            "GET",
            &format!("/v1/jobs/{id}?wait=2"),
            None,
            None,
        );
        assert_eq!(status, 200, "GET job {id}: {job}");
        if !matches!(job["state"].as_str(), Some("queued" | "running")) {
            return job;
        }
        assert!(Instant::now() < deadline, "job {id} still running: {job}");
    }
}

/// GET a job now.
pub fn job(server: &Server, id: u64) -> Value {
    let (status, job) = request(
        control(server),
        "GET",
        &format!("/v1/jobs/{id}"),
        None,
        None,
    );
    assert_eq!(status, 200, "GET job {id}: {job}");
    job
}
