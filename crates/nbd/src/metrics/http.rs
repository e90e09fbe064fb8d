//! `GET /metrics` over HTTP/1 (axum on hyper).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

use super::Metrics;

/// Content type of the Prometheus text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// A client that does not send a whole request head in this time is dropped.
const REQUEST_HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// No connection lives longer than this (keep-alive included).
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(60);
/// Pause after a failed accept (e.g. out of file descriptors).
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// A router with `GET /metrics` (and HEAD): [`Metrics::render_prometheus_with`]
/// with `publish` run first, so it can add its own series (see there). Any
/// other method on /metrics gets 405, any other path 404. Mount it into a
/// larger axum app with `Router::merge`.
pub fn router(metrics: Arc<Metrics>, publish: impl Fn() + Send + Sync + 'static) -> Router {
    let publish: Arc<dyn Fn() + Send + Sync> = Arc::new(publish);
    Router::new()
        .route(
            "/metrics",
            get(move || render(metrics.clone(), publish.clone())),
        )
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n") })
}

async fn render(metrics: Arc<Metrics>, publish: Arc<dyn Fn() + Send + Sync>) -> Response {
    // Publishing may read volume state; keep it off the async workers.
    match tokio::task::spawn_blocking(move || metrics.render_prometheus_with(&*publish)).await {
        Ok(body) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering metrics failed: {error}\n"),
        )
            .into_response(),
    }
}

/// Serve `router` over HTTP/1 on an already bound listener (useful with
/// port 0), forever. Each connection is its own task, so a slow client holds
/// only itself: one that sends no complete request head within 10 s, or stays
/// connected over 60 s, is dropped.
pub async fn serve_on(listener: TcpListener, router: Router) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::warn!(%error, "metrics: accept failed");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let service = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(REQUEST_HEAD_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, connection).await;
        });
    }
}

/// Serve [`router`]`(metrics, publish)` on an already bound listener.
pub async fn serve_metrics_on(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    publish: impl Fn() + Send + Sync + 'static,
) {
    serve_on(listener, router(metrics, publish)).await;
}

/// Bind `addr` and serve `GET /metrics` forever (see [`serve_metrics_on`]).
pub async fn serve_metrics(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    publish: impl Fn() + Send + Sync + 'static,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    serve_metrics_on(listener, metrics, publish).await;
    Ok(())
}
