//! The control API's routes (axum): `/v1/exports` and `/v1/jobs`. Every
//! request is validated here (400/403/404/409 with a one-line JSON error);
//! jobs run on `Jobs`' threads. docs/PROTOCOL.md is the reference.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use vouch_engine::BLOCK;

use super::engine_api::{self as engine, CopyMethod, ProofSeed, VerifyOptions};
use super::jobs::{CompareWith, JobSpec, Jobs};
use super::render;

/// Most bytes a compare may send inline (`data_base64`, decoded).
pub const MAX_COMPARE_DATA: usize = 16 << 20;
/// Longest long-poll (`?wait=`).
const MAX_WAIT_SECONDS: f64 = 300.0;

/// An API error: a status and one line for `{"error": ...}`.
#[derive(Debug)]
pub struct ApiError(pub StatusCode, pub String);

impl ApiError {
    fn bad(message: impl Into<String>) -> ApiError {
        ApiError(StatusCode::BAD_REQUEST, message.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({"error": self.1}))).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// What the router shares: the jobs and the bearer token, if any.
#[derive(Clone)]
pub struct ApiState {
    pub jobs: Arc<Jobs>,
    pub token: Option<Arc<String>>,
}

pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/v1/exports", get(exports))
        .route("/v1/jobs", get(list_jobs).post(create_job))
        .route("/v1/jobs/{id}", get(get_job).delete(cancel_job))
        .route(
            "/v1/exports/{export}/snapshots",
            get(list_snapshots).post(create_snapshot),
        )
        .route(
            "/v1/exports/{export}/snapshots/{name}",
            axum::routing::delete(delete_snapshot),
        )
        .route(
            "/v1/exports/{export}/resize",
            axum::routing::post(resize_export),
        )
        .route(
            "/v1/exports/{export}/migrate",
            get(migration_status)
                .post(migration_start)
                .delete(migration_stop),
        )
        .route("/v1/mirrors/{export}", get(mirror_status))
        .route(
            "/v1/mirrors/{export}/resync",
            axum::routing::post(mirror_resync),
        )
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_COMPARE_DATA / 3 * 4 + 4096))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            authorize,
        ))
        .with_state(state)
}

/// Constant-time comparison of two byte strings.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn authorize(State(state): State<ApiState>, request: Request, next: Next) -> Response {
    if let Some(token) = &state.token {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "));
        match given {
            Some(given) if same_secret(given.trim().as_bytes(), token.as_bytes()) => {}
            Some(_) => {
                return ApiError(StatusCode::UNAUTHORIZED, "wrong bearer token".into())
                    .into_response()
            }
            None => {
                return ApiError(
                    StatusCode::UNAUTHORIZED,
                    "missing bearer token: this control API needs 'Authorization: Bearer TOKEN'"
                        .into(),
                )
                .into_response()
            }
        }
    }
    next.run(request).await
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        format!("no such endpoint: {method} {uri} (see docs/PROTOCOL.md)"),
    )
}

async fn exports(State(state): State<ApiState>) -> ApiResult<Json<Value>> {
    let mut list = Vec::new();
    for entry in &state.jobs.exports {
        let dir = entry.dir.clone();
        let last = tokio::task::spawn_blocking(move || engine::last_scrub(&dir))
            .await
            .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
            .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        let volume = &entry.volume;
        list.push(json!({
            "name": entry.name,
            "size": vouch_engine::BlockDevice::size(&**volume),
            "blocks": vouch_engine::BlockDevice::size(&**volume) / BLOCK,
            "layout": volume.layout().name(),
            "guard": volume.guard().name(),
            "read_only": vouch_engine::BlockDevice::is_read_only(&**volume),
            "last_scrub": last.as_ref().map(render::scrub_json),
            "resizing": crate::resize::in_progress(&entry.dir),
        }));
    }
    Ok(Json(json!({ "exports": list })))
}

fn export_of<'a>(state: &'a ApiState, export: &str) -> ApiResult<&'a super::jobs::ExportEntry> {
    state
        .jobs
        .exports
        .iter()
        .find(|entry| entry.name == export)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no export {export:?}")))
}

/// An export whose snapshots can be taken and deleted here: a writable
/// volume, with regions or not (its snapshot is taken with both members
/// at one flush point, a migration running or not), or a mirror (every
/// active leg's copy at one flush point, `snapshot_mirror.rs`).
fn snapshot_target<'a>(
    state: &'a ApiState,
    export: &str,
) -> ApiResult<&'a super::jobs::ExportEntry> {
    let entry = export_of(state, export)?;
    if vouch_engine::BlockDevice::is_read_only(&*entry.volume) {
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!("export {export:?} is read-only (a snapshot, or served --read-only): take snapshots of the volume it belongs to"),
        ));
    }
    Ok(entry)
}

fn internal(error: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
}

/// `GET /v1/exports/{export}/snapshots`.
async fn list_snapshots(
    State(state): State<ApiState>,
    Path(export): Path<String>,
) -> ApiResult<Json<Value>> {
    let entry = export_of(&state, &export)?;
    let (dir, mirror) = (entry.dir.clone(), entry.mirror.clone());
    let list = tokio::task::spawn_blocking(move || match mirror {
        Some(mirror) => Ok(crate::snapshot_mirror::list_served(&mirror)),
        None => crate::snapshot::list_json(&dir),
    })
    .await
    .map_err(internal)?
    .map_err(|error| ApiError(StatusCode::CONFLICT, format!("{error:#}")))?;
    Ok(Json(json!({"export": export, "snapshots": list})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotRequest {
    name: String,
    #[serde(default)]
    copy: bool,
    /// Answer once the snapshot is published (the default), or, false, at
    /// its fence while it is materialised (`fenced` snapshots on xfs and
    /// btrfs; others are answered when published either way).
    #[serde(default = "answer_when_published")]
    wait: bool,
}

fn answer_when_published() -> bool {
    true
}

/// `POST /v1/exports/{export}/snapshots {"name": NAME, "copy": false,
/// "wait": true}`: take a snapshot at a flush point; answered when it is
/// published (or with `"wait": false` at a fenced snapshot's fence).
async fn create_snapshot(
    State(state): State<ApiState>,
    Path(export): Path<String>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let request: SnapshotRequest = serde_json::from_slice(&body).map_err(|error| {
        ApiError::bad(format!(
            "snapshot request: {error} (expected {{\"name\": NAME, \"copy\": false, \"wait\": true}})"
        ))
    })?;
    vouch_engine::snapshot::check_name(&request.name).map_err(|e| ApiError::bad(e.to_string()))?;
    let entry = snapshot_target(&state, &export)?;
    let (dir, volume) = (entry.dir.clone(), entry.volume.clone());
    let mirror = entry.mirror.clone();
    let mirror_export = mirror.is_some();
    // A volume with regions: `volume` is its home member only.
    let regions = entry.migration.as_ref().map(|m| Arc::clone(&m.volume));
    let taken = tokio::task::spawn_blocking(move || {
        if let Some(mirror) = &mirror {
            return crate::snapshot_mirror::create_online(mirror, &request.name, request.copy);
        }
        let served = match &regions {
            Some(regions) => crate::snapshot::Served::Regions(regions),
            None => crate::snapshot::Served::One(&volume),
        };
        crate::snapshot::create_online(&dir, served, &request.name, request.copy, request.wait)
            .map(|taken| (vec![taken.snapshot], taken.times))
    })
    .await
    .map_err(internal)?
    .map_err(|error| ApiError(StatusCode::CONFLICT, format!("{error:#}")))?;
    let (copies, times) = taken;
    let first = &copies[0];
    let mut answer = json!({
        "export": export,
        "name": first.record.name,
        "path": first.path.display().to_string(),
        "record": first.record,
        "held_ms": times.held.as_secs_f64() * 1e3,
        "flush_ms": times.flush.as_secs_f64() * 1e3,
        "total_ms": times.total.as_secs_f64() * 1e3,
        "materialising": first.materialising,
    });
    if mirror_export {
        answer["copies"] = json!(copies
            .iter()
            .map(|copy| copy.path.display().to_string())
            .collect::<Vec<_>>());
    }
    Ok((StatusCode::CREATED, Json(answer)))
}

/// `DELETE /v1/exports/{export}/snapshots/{name}`.
async fn delete_snapshot(
    State(state): State<ApiState>,
    Path((export, name)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    let entry = snapshot_target(&state, &export)?;
    let (dir, mirror) = (entry.dir.clone(), entry.mirror.clone());
    let volume = entry.volume.clone();
    vouch_engine::snapshot::check_name(&name).map_err(|e| ApiError::bad(e.to_string()))?;
    // A name with nothing behind it is not a conflict: 404, as for any
    // resource that is not there (a half-made copy is still deleted).
    if mirror.is_none()
        && !vouch_engine::snapshot::snapshot_path(&dir, &name).exists()
        && !vouch_engine::snapshot::partial_path(&dir, &name).exists()
    {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("export {export:?} has no snapshot {name:?} (`GET /v1/exports/{export}/snapshots` lists them)"),
        ));
    }
    let deleted = name.clone();
    tokio::task::spawn_blocking(move || match mirror {
        Some(mirror) => crate::snapshot_mirror::delete_online(&mirror, &deleted),
        None => crate::snapshot::delete_online(&dir, Some(&volume), &deleted),
    })
    .await
    .map_err(internal)?
    .map_err(|error| ApiError(StatusCode::CONFLICT, format!("{error:#}")))?;
    Ok(Json(json!({"export": export, "deleted": name})))
}

/// `POST /v1/exports/{export}/resize {"size": 10737418240 | "10G"}`:
/// resize a served volume (`Volume::resize_online`; a volume with
/// regions: `RegionVolume::resize_online`; a mirror with local legs:
/// `Mirror::resize_online`); answered when done.
/// New connections see the new size; open ones keep theirs.
async fn resize_export(
    State(state): State<ApiState>,
    Path(export): Path<String>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let expected = "expected {\"size\": BYTES} or {\"size\": \"10G\"}";
    let request: Value = serde_json::from_slice(&body)
        .map_err(|error| ApiError::bad(format!("resize request: {error} ({expected})")))?;
    let size = match request
        .as_object()
        .map(|fields| (fields.len(), fields.get("size")))
    {
        Some((1, Some(Value::String(text)))) => text.clone(),
        Some((1, Some(Value::Number(number)))) => number.to_string(),
        _ => {
            return Err(ApiError::bad(format!(
                "resize request: {request} ({expected})"
            )))
        }
    };
    let new_bytes = crate::sizes::parse_volume_size(&size).map_err(ApiError::bad)?;
    let entry = export_of(&state, &export)?;
    if vouch_engine::BlockDevice::is_read_only(&*entry.volume) {
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!("export {export:?} is read-only (a snapshot, or served --read-only): it is not resized"),
        ));
    }
    let (dir, volume, migration, mirror) = (
        entry.dir.clone(),
        entry.volume.clone(),
        entry.migration.clone(),
        entry.mirror.clone(),
    );
    let done = tokio::task::spawn_blocking(move || match (mirror, migration) {
        // A mirror: every leg in turn, then its own files.
        (Some(mirror), _) => crate::resize::resize_online_mirror(&dir, &mirror, new_bytes),
        // A volume with regions: its region layer is resized, each member
        // in turn (`volume` is its home member only).
        (None, Some(migration)) => {
            crate::resize::resize_online_regions(&dir, &migration, new_bytes)
        }
        (None, None) => crate::resize::resize_online(&dir, &volume, new_bytes),
    })
    .await
    .map_err(internal)?
    .map_err(|error| ApiError(StatusCode::CONFLICT, format!("{error:#}")))?;
    Ok(Json(json!({
        "export": export,
        "old_size": done.old_bytes,
        "size": done.new_bytes,
        "waited_ms": done.waited.as_secs_f64() * 1e3,
        "held_ms": done.held.as_secs_f64() * 1e3,
    })))
}

fn resyncer_of(state: &ApiState, export: &str) -> ApiResult<Arc<crate::resync::Resyncer>> {
    export_of(state, export)?
        .resync
        .clone()
        .ok_or_else(|| ApiError::bad(format!("export {export:?} is not a mirrored volume")))
}

/// `GET /v1/mirrors/{export}`: every leg's state and resync progress.
async fn mirror_status(
    State(state): State<ApiState>,
    Path(export): Path<String>,
) -> ApiResult<Json<Value>> {
    let resyncer = resyncer_of(&state, &export)?;
    Ok(Json(
        json!({"export": export, "legs": resyncer.status_json()}),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResyncBody {
    leg: usize,
}

/// `POST /v1/mirrors/{export}/resync {"leg": N}`: start resyncing leg N.
async fn mirror_resync(
    State(state): State<ApiState>,
    Path(export): Path<String>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let resyncer = resyncer_of(&state, &export)?;
    let body: ResyncBody = serde_json::from_slice(&body).map_err(|error| {
        ApiError::bad(format!("resync request: {error} (expected {{\"leg\": N}})"))
    })?;
    let message = tokio::task::spawn_blocking(move || resyncer.resync(body.leg))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|error| ApiError(StatusCode::CONFLICT, format!("{error:#}")))?;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"export": export, "leg": body.leg, "message": message})),
    ))
}

/// The online migration of `export`: a volume with regions only.
fn migration_of(
    state: &ApiState,
    export: &str,
) -> ApiResult<Arc<crate::migrate_online::Migration>> {
    let entry = export_of(state, export)?;
    if entry.mirror.is_some() {
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!("export {export:?} is a mirror: a mirror is migrated offline only (each leg rebuilt whole in the layout in turn, the server stopped): stop the server and run `vouch migrate LEG --layout LAYOUT`"),
        ));
    }
    entry.migration.clone().ok_or_else(|| {
        ApiError(
            StatusCode::CONFLICT,
            format!("export {export:?} is served as a one-layout volume: serve it with --migratable (or --migrate-on-write LAYOUT) to migrate it online, or stop the server and run `vouch migrate PATH --layout LAYOUT`"),
        )
    })
}

/// `GET /v1/exports/{export}/migrate`: the migration's progress.
async fn migration_status(
    State(state): State<ApiState>,
    Path(export): Path<String>,
) -> ApiResult<Json<Value>> {
    let migration = migration_of(&state, &export)?;
    let mut status = migration.status_json();
    status["export"] = json!(export);
    Ok(Json(status))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MigrateBody {
    layout: String,
    /// Bytes a second: a number, or a size such as "200M".
    rate: Option<Value>,
}

/// `POST /v1/exports/{export}/migrate {"layout": "packed", "rate": "200M"}`:
/// start moving every region to the layout, in the background.
async fn migration_start(
    State(state): State<ApiState>,
    Path(export): Path<String>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let migration = migration_of(&state, &export)?;
    let body: MigrateBody = serde_json::from_slice(&body).map_err(|error| {
        ApiError::bad(format!(
            "migrate request: {error} (expected {{\"layout\": \"split\"|\"packed\", \"rate\": \"200M\"}})"
        ))
    })?;
    let target = vouch_format::LayoutKind::from_name(&body.layout).ok_or_else(|| {
        ApiError::bad(format!(
            "unknown layout {:?} (split or packed)",
            body.layout
        ))
    })?;
    let rate = match body.rate {
        None | Some(Value::Null) => None,
        Some(Value::Number(number)) => {
            Some(number.as_u64().ok_or_else(|| {
                ApiError::bad("\"rate\" must be a whole number of bytes a second")
            })?)
        }
        Some(Value::String(text)) => Some(crate::sizes::parse_size(&text).map_err(ApiError::bad)?),
        Some(_) => {
            return Err(ApiError::bad(
                "\"rate\" must be a number or a size such as \"200M\"",
            ))
        }
    };
    let mut status = migration
        .start(target, rate)
        .map_err(|error| ApiError(StatusCode::CONFLICT, error))?;
    status["export"] = json!(export);
    Ok((StatusCode::ACCEPTED, Json(status)))
}

/// `DELETE /v1/exports/{export}/migrate`: stop it between regions.
async fn migration_stop(
    State(state): State<ApiState>,
    Path(export): Path<String>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let migration = migration_of(&state, &export)?;
    let mut status = migration.stop();
    status["export"] = json!(export);
    Ok((StatusCode::ACCEPTED, Json(status)))
}

async fn list_jobs(State(state): State<ApiState>) -> Json<Value> {
    let jobs: Vec<Value> = state
        .jobs
        .list()
        .iter()
        .map(|job| job.to_json(&state.jobs.exports))
        .collect();
    Json(json!({ "jobs": jobs }))
}

fn job_of(state: &ApiState, id: &str) -> ApiResult<Arc<super::jobs::Job>> {
    id.parse::<u64>()
        .ok()
        .and_then(|id| state.jobs.get(id))
        .ok_or_else(|| {
            ApiError(
                StatusCode::NOT_FOUND,
                format!(
                    "no job {id:?} (finished jobs are kept for the last {})",
                    super::jobs::KEEP_FINISHED
                ),
            )
        })
}

async fn get_job(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    let job = job_of(&state, &id)?;
    for key in query.keys() {
        if key != "wait" {
            return Err(ApiError::bad(format!(
                "unknown query parameter {key:?} (only wait=SECONDS)"
            )));
        }
    }
    if let Some(wait) = query.get("wait") {
        let seconds: f64 = wait
            .parse()
            .ok()
            .filter(|s: &f64| s.is_finite() && *s >= 0.0)
            .ok_or_else(|| ApiError::bad(format!("wait={wait:?} is not a number of seconds")))?;
        job.wait(Duration::from_secs_f64(seconds.min(MAX_WAIT_SECONDS)))
            .await;
    }
    Ok(Json(job.to_json(&state.jobs.exports)))
}

async fn cancel_job(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let job = job_of(&state, &id)?;
    let cancelled = state.jobs.cancel(&job);
    Ok(Json(
        json!({"id": job.id, "cancelled": cancelled, "state": job.state().name()}),
    ))
}

async fn create_job(
    State(state): State<ApiState>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let jobs = state.jobs.clone();
    // Decoding base64 and checking ranges is cheap; the job itself runs on
    // its own thread.
    let spec = parse_job(&jobs, &body)?;
    let job = jobs
        .submit(spec)
        .map_err(|conflict| ApiError(StatusCode::CONFLICT, conflict.0))?;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"id": job.id, "state": job.state().name()})),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VerifyRequest {
    export: String,
    offset: Option<u64>,
    length: Option<u64>,
    seed: Option<String>,
    #[serde(default)]
    segments: bool,
    rate: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScrubRequest {
    export: String,
    rate: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Place {
    export: String,
    offset: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CopyRequest {
    source: Place,
    destination: Place,
    length: u64,
    method: Option<String>,
    rate: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompareRequest {
    export: String,
    offset: Option<u64>,
    length: Option<u64>,
    data_base64: Option<String>,
    other: Option<Place>,
}

fn fields<T: DeserializeOwned>(op: &str, body: Value) -> ApiResult<T> {
    serde_json::from_value(body)
        .map_err(|error| ApiError::bad(format!("bad {op} request: {error}")))
}

/// Parse and validate a `POST /v1/jobs` body into a job.
pub fn parse_job(jobs: &Jobs, body: &[u8]) -> ApiResult<JobSpec> {
    let mut value: Value = serde_json::from_slice(body)
        .map_err(|error| ApiError::bad(format!("the body is not JSON: {error}")))?;
    let object = value
        .as_object_mut()
        .ok_or_else(|| ApiError::bad("the body must be a JSON object with an \"op\""))?;
    let op = match object.remove("op") {
        Some(Value::String(op)) => op,
        Some(_) => return Err(ApiError::bad("\"op\" must be a string")),
        None => {
            return Err(ApiError::bad(
                "missing \"op\" (verify, scrub, copy or compare)",
            ))
        }
    };
    let export = |name: &str| {
        let index = jobs
            .export_index(name)
            .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no export named {name:?}")))?;
        if jobs.exports[index].migration.is_some() {
            return Err(ApiError(
                StatusCode::CONFLICT,
                format!("export {name:?} is a volume with regions: verify, scrub, copy and compare jobs do not run on it yet (its online migration verifies every block it moves)"),
            ));
        }
        Ok(index)
    };
    match op.as_str() {
        "verify" => {
            let request: VerifyRequest = fields(&op, value)?;
            let index = export(&request.export)?;
            let (first, count) = range(jobs, index, request.offset, request.length)?;
            let seed = request
                .seed
                .map(|text| ProofSeed::from_hex(&text))
                .transpose()
                .map_err(|e| ApiError::bad(e.to_string()))?;
            Ok(JobSpec::Verify {
                export: index,
                first,
                count,
                options: VerifyOptions {
                    seed,
                    segments: request.segments,
                    rate_bytes_per_second: request.rate,
                },
            })
        }
        "scrub" => {
            let request: ScrubRequest = fields(&op, value)?;
            Ok(JobSpec::Scrub {
                export: export(&request.export)?,
                rate: request.rate,
            })
        }
        "copy" => {
            let request: CopyRequest = fields(&op, value)?;
            let source = export(&request.source.export)?;
            let destination = export(&request.destination.export)?;
            let method = CopyMethod::parse(request.method.as_deref().unwrap_or("auto"))
                .map_err(|e| ApiError::bad(e.to_string()))?;
            let (source_first, count) =
                range(jobs, source, request.source.offset, Some(request.length))?;
            let (destination_first, _) = range(
                jobs,
                destination,
                request.destination.offset,
                Some(request.length),
            )?;
            if vouch_engine::BlockDevice::is_read_only(&*jobs.exports[destination].volume) {
                return Err(ApiError(
                    StatusCode::FORBIDDEN,
                    format!(
                        "export {:?} is read-only: cannot copy into it",
                        request.destination.export
                    ),
                ));
            }
            Ok(JobSpec::Copy {
                source,
                source_first,
                destination,
                destination_first,
                count,
                method,
                rate: request.rate,
            })
        }
        "compare" => {
            let request: CompareRequest = fields(&op, value)?;
            let index = export(&request.export)?;
            match (request.data_base64, request.other) {
                (Some(data), None) => {
                    let data = base64::engine::general_purpose::STANDARD
                        .decode(data.trim())
                        .map_err(|e| ApiError::bad(format!("data_base64 is not base64: {e}")))?;
                    if data.len() > MAX_COMPARE_DATA {
                        return Err(ApiError::bad(format!(
                            "data_base64 holds {} bytes; at most {MAX_COMPARE_DATA} (compare a range of another export instead)",
                            data.len()
                        )));
                    }
                    let length = request.length.unwrap_or(data.len() as u64);
                    if length != data.len() as u64 {
                        return Err(ApiError::bad(format!(
                            "length {length} but data_base64 holds {} bytes",
                            data.len()
                        )));
                    }
                    let (first, count) = range(jobs, index, request.offset, Some(length))?;
                    Ok(JobSpec::Compare {
                        export: index,
                        first,
                        count,
                        with: CompareWith::Data(Arc::new(data)),
                    })
                }
                (None, Some(other)) => {
                    let other_index = export(&other.export)?;
                    let (first, count) = range(jobs, index, request.offset, request.length)?;
                    let (other_first, _) =
                        range(jobs, other_index, other.offset, Some(count * BLOCK))?;
                    Ok(JobSpec::Compare {
                        export: index,
                        first,
                        count,
                        with: CompareWith::Range {
                            export: other_index,
                            first: other_first,
                        },
                    })
                }
                _ => Err(ApiError::bad(
                    "compare takes exactly one of \"data_base64\" and \"other\"",
                )),
            }
        }
        other => Err(ApiError::bad(format!(
            "unknown op {other:?} (verify, scrub, copy or compare)"
        ))),
    }
}

/// A byte range of an export as blocks: both 4096-aligned, not empty,
/// inside the export. `length` `None` runs to the end.
fn range(
    jobs: &Jobs,
    export: usize,
    offset: Option<u64>,
    length: Option<u64>,
) -> ApiResult<(u64, u64)> {
    let entry = &jobs.exports[export];
    let size = vouch_engine::BlockDevice::size(&*entry.volume);
    let offset = offset.unwrap_or(0);
    if !offset.is_multiple_of(BLOCK) {
        return Err(ApiError::bad(format!(
            "offset {offset} is not a multiple of {BLOCK}"
        )));
    }
    let length = length.unwrap_or(size.saturating_sub(offset));
    if !length.is_multiple_of(BLOCK) {
        return Err(ApiError::bad(format!(
            "length {length} is not a multiple of {BLOCK}"
        )));
    }
    if length == 0 {
        return Err(ApiError::bad("length is 0: nothing to do"));
    }
    if offset.checked_add(length).is_none_or(|end| end > size) {
        return Err(ApiError::bad(format!(
            "range {offset}+{length} is past the end of export {:?} ({size} bytes)",
            entry.name
        )));
    }
    Ok((offset / BLOCK, length / BLOCK))
}
