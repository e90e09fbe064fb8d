//! Server metrics: lock-free counters on the hot path, rendered in the
//! Prometheus text exposition format 0.0.4, plus a tiny HTTP endpoint.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::export::Errno;
use crate::wire::Command;

/// Number of latency histogram buckets (plus +Inf).
pub const LATENCY_BUCKETS: usize = 16;
/// Upper bound of the first bucket; each next bucket doubles (8 µs .. 262 ms).
pub const LATENCY_FIRST_BUCKET_US: u64 = 8;
/// Largest HTTP request head the metrics endpoint reads.
const HTTP_REQUEST_MAX_BYTES: usize = 8192;
/// A metrics scrape that does not send its request in this time is dropped.
const HTTP_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

const COMMANDS: usize = Command::ALL.len();

#[derive(Default)]
struct Histogram {
    /// Non-cumulative counts; rendering accumulates.
    buckets: [AtomicU64; LATENCY_BUCKETS],
    overflow: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    fn observe(&self, latency_us: u64) {
        // Bucket i holds latencies <= 8 µs * 2^i.
        let index = if latency_us <= LATENCY_FIRST_BUCKET_US {
            0
        } else {
            let ratio = (latency_us - 1) / LATENCY_FIRST_BUCKET_US;
            (64 - ratio.leading_zeros()) as usize
        };
        match self.buckets.get(index) {
            Some(bucket) => bucket.fetch_add(1, Relaxed),
            None => self.overflow.fetch_add(1, Relaxed),
        };
        self.sum_us.fetch_add(latency_us, Relaxed);
    }
}

/// All NBD server counters. Shared by every connection of a server.
#[derive(Default)]
pub struct Metrics {
    requests: [AtomicU64; COMMANDS],
    bytes: [AtomicU64; COMMANDS],
    latency: [Histogram; COMMANDS],
    errors: [AtomicU64; Errno::ALL.len()],
    faults: Mutex<BTreeMap<&'static str, u64>>,
    in_flight: AtomicU64,
    connections_open: AtomicU64,
    connections_total: AtomicU64,
    protocol_errors: AtomicU64,
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        Arc::new(Metrics::default())
    }

    pub(crate) fn request_started(&self) {
        self.in_flight.fetch_add(1, Relaxed);
    }

    /// Record a finished request. `bytes` is the payload moved (read/write) or
    /// the affected length (trim, zero, cache).
    pub(crate) fn request_finished(
        &self,
        command: Command,
        bytes: u64,
        latency: Duration,
        errno: Option<Errno>,
    ) {
        let index = command.index();
        self.requests[index].fetch_add(1, Relaxed);
        self.bytes[index].fetch_add(bytes, Relaxed);
        self.latency[index].observe(latency.as_micros() as u64);
        if let Some(errno) = errno {
            self.errors[errno.index()].fetch_add(1, Relaxed);
        }
        self.in_flight.fetch_sub(1, Relaxed);
    }

    /// An error answered without executing (validation failure).
    pub(crate) fn request_rejected(&self, errno: Errno) {
        self.errors[errno.index()].fetch_add(1, Relaxed);
    }

    pub(crate) fn fault(&self, kind: &'static str) {
        *self.faults.lock().entry(kind).or_insert(0) += 1;
    }

    pub(crate) fn connection_opened(&self) {
        self.connections_open.fetch_add(1, Relaxed);
        self.connections_total.fetch_add(1, Relaxed);
    }

    pub(crate) fn connection_closed(&self) {
        self.connections_open.fetch_sub(1, Relaxed);
    }

    pub(crate) fn protocol_error(&self) {
        self.protocol_errors.fetch_add(1, Relaxed);
    }

    pub fn requests(&self, command: Command) -> u64 {
        self.requests[command.index()].load(Relaxed)
    }
    pub fn bytes(&self, command: Command) -> u64 {
        self.bytes[command.index()].load(Relaxed)
    }
    pub fn errors(&self, errno: Errno) -> u64 {
        self.errors[errno.index()].load(Relaxed)
    }
    pub fn faults(&self, kind: &str) -> u64 {
        self.faults.lock().get(kind).copied().unwrap_or(0)
    }
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Relaxed)
    }
    pub fn connections_open(&self) -> u64 {
        self.connections_open.load(Relaxed)
    }
    pub fn connections_total(&self) -> u64 {
        self.connections_total.load(Relaxed)
    }

    /// Prometheus text exposition format 0.0.4.
    pub fn render_prometheus(&self) -> String {
        let mut out = String::with_capacity(8192);
        let commands = Command::ALL.iter().filter(|c| **c != Command::Disc);
        header(
            &mut out,
            "vouch_nbd_requests_total",
            "counter",
            "NBD requests completed, by command.",
        );
        for command in commands.clone() {
            let _ = writeln!(
                out,
                "vouch_nbd_requests_total{{command=\"{}\"}} {}",
                command.name(),
                self.requests(*command)
            );
        }
        header(
            &mut out,
            "vouch_nbd_bytes_total",
            "counter",
            "Bytes read/written or affected (trim, zero, cache), by command.",
        );
        for command in commands.clone() {
            let _ = writeln!(
                out,
                "vouch_nbd_bytes_total{{command=\"{}\"}} {}",
                command.name(),
                self.bytes(*command)
            );
        }
        header(
            &mut out,
            "vouch_nbd_errors_total",
            "counter",
            "NBD error replies, by errno.",
        );
        for errno in Errno::ALL {
            let _ = writeln!(
                out,
                "vouch_nbd_errors_total{{errno=\"{}\"}} {}",
                errno.name(),
                self.errors(errno)
            );
        }
        header(
            &mut out,
            "vouch_nbd_verification_faults_total",
            "counter",
            "Verification faults reported by the export, by kind.",
        );
        for (kind, count) in self.faults.lock().iter() {
            let _ = writeln!(
                out,
                "vouch_nbd_verification_faults_total{{kind=\"{kind}\"}} {count}"
            );
        }
        header(
            &mut out,
            "vouch_nbd_requests_in_flight",
            "gauge",
            "Requests received and not yet answered.",
        );
        let _ = writeln!(out, "vouch_nbd_requests_in_flight {}", self.in_flight());
        header(
            &mut out,
            "vouch_nbd_connections_open",
            "gauge",
            "Open client connections.",
        );
        let _ = writeln!(
            out,
            "vouch_nbd_connections_open {}",
            self.connections_open()
        );
        header(
            &mut out,
            "vouch_nbd_connections_total",
            "counter",
            "Client connections accepted.",
        );
        let _ = writeln!(
            out,
            "vouch_nbd_connections_total {}",
            self.connections_total()
        );
        header(
            &mut out,
            "vouch_nbd_protocol_errors_total",
            "counter",
            "Connections dropped for protocol violations.",
        );
        let _ = writeln!(
            out,
            "vouch_nbd_protocol_errors_total {}",
            self.protocol_errors.load(Relaxed)
        );
        header(
            &mut out,
            "vouch_nbd_request_latency_seconds",
            "histogram",
            "Request latency from header received to reply queued.",
        );
        for command in commands {
            self.render_histogram(&mut out, *command);
        }
        out
    }

    fn render_histogram(&self, out: &mut String, command: Command) {
        let histogram = &self.latency[command.index()];
        let name = command.name();
        let mut cumulative = 0u64;
        for (index, bucket) in histogram.buckets.iter().enumerate() {
            cumulative += bucket.load(Relaxed);
            let bound_us = LATENCY_FIRST_BUCKET_US << index;
            let _ = writeln!(
                out,
                "vouch_nbd_request_latency_seconds_bucket{{command=\"{name}\",le=\"{}\"}} {cumulative}",
                bound_us as f64 / 1e6
            );
        }
        cumulative += histogram.overflow.load(Relaxed);
        let _ = writeln!(out, "vouch_nbd_request_latency_seconds_bucket{{command=\"{name}\",le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(
            out,
            "vouch_nbd_request_latency_seconds_sum{{command=\"{name}\"}} {}",
            histogram.sum_us.load(Relaxed) as f64 / 1e6
        );
        let _ = writeln!(
            out,
            "vouch_nbd_request_latency_seconds_count{{command=\"{name}\"}} {cumulative}"
        );
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Serve `GET /metrics` on an already bound listener (useful with port 0).
/// Each response is `metrics.render_prometheus()` followed by `extra()`.
pub async fn serve_metrics_on(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    extra: impl Fn() -> String + Send + Sync + 'static,
) -> std::io::Result<()> {
    let extra = Arc::new(extra);
    loop {
        let (mut stream, _) = listener.accept().await?;
        let metrics = metrics.clone();
        let extra = extra.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(HTTP_REQUEST_TIMEOUT, async {
                let mut head = Vec::with_capacity(1024);
                let mut chunk = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    let read = stream.read(&mut chunk).await?;
                    if read == 0 || head.len() + read > HTTP_REQUEST_MAX_BYTES {
                        return Ok::<(), std::io::Error>(());
                    }
                    head.extend_from_slice(&chunk[..read]);
                }
                let first_line = head.split(|b| *b == b'\r').next().unwrap_or(&[]);
                let mut parts = first_line.split(|b| *b == b' ');
                let method = parts.next().unwrap_or(&[]);
                let path = parts.next().unwrap_or(&[]);
                let response = if method == b"GET" && (path == b"/metrics" || path.starts_with(b"/metrics?")) {
                    let mut body = metrics.render_prometheus();
                    body.push_str(&extra());
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    )
                } else {
                    let body = "not found\n";
                    format!(
                        "HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    )
                };
                stream.write_all(response.as_bytes()).await?;
                stream.shutdown().await
            })
            .await;
        });
    }
}

/// Bind `addr` and serve `GET /metrics` forever (see [`serve_metrics_on`]).
pub async fn serve_metrics(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    extra: impl Fn() -> String + Send + Sync + 'static,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    serve_metrics_on(listener, metrics, extra).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_doubling() {
        let metrics = Metrics::default();
        for latency_us in [1, 8, 9, 16, 17, 1_000_000] {
            metrics.request_started();
            metrics.request_finished(Command::Read, 4096, Duration::from_micros(latency_us), None);
        }
        let text = metrics.render_prometheus();
        assert!(text.contains(
            "vouch_nbd_request_latency_seconds_bucket{command=\"read\",le=\"0.000008\"} 2"
        ));
        assert!(text.contains(
            "vouch_nbd_request_latency_seconds_bucket{command=\"read\",le=\"0.000016\"} 4"
        ));
        assert!(text.contains(
            "vouch_nbd_request_latency_seconds_bucket{command=\"read\",le=\"0.000032\"} 5"
        ));
        assert!(text
            .contains("vouch_nbd_request_latency_seconds_bucket{command=\"read\",le=\"+Inf\"} 6"));
        assert!(text.contains("vouch_nbd_bytes_total{command=\"read\"} 24576"));
        assert!(text.contains("# TYPE vouch_nbd_request_latency_seconds histogram"));
        assert_eq!(metrics.in_flight(), 0);
    }

    #[test]
    fn errors_and_faults_render() {
        let metrics = Metrics::default();
        metrics.request_rejected(Errno::Inval);
        metrics.fault("guard_mismatch");
        let text = metrics.render_prometheus();
        assert!(text.contains("vouch_nbd_errors_total{errno=\"EINVAL\"} 1"));
        assert!(text.contains("vouch_nbd_verification_faults_total{kind=\"guard_mismatch\"} 1"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            assert!(line.starts_with("vouch_nbd_"), "{line}");
        }
    }
}
