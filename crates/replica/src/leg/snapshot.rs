//! A remote replica's snapshots, as the exporter asks for them (protocol
//! version 3, `server/snapshot.rs`): taken, listed and deleted on the
//! connection that holds the replica, and a snapshot opened read-only on
//! a connection of its own. A server from before them is refused by
//! name, never skipped: a snapshot of a mirror missing that leg's copy
//! would say it survives the loss of a leg when it does not.

use std::sync::Arc;

use vouch_engine::error::{Error, Result};

use super::{leg_error, RemoteLeg};
use crate::client::{ClientOptions, Connection};
use crate::url::ReplicaUrl;
use crate::wire::{self, Request, SnapshotEntry, SNAPSHOT_VERSION};

/// Refuse a connection agreed at a version without the snapshot requests.
fn supported(url: &ReplicaUrl, connection: &Connection) -> Result<()> {
    if connection.version < SNAPSHOT_VERSION {
        return Err(Error::Unsupported(format!(
            "replica at {url} does not support snapshots: upgrade it (its server speaks replica protocol version {}; snapshots need version {SNAPSHOT_VERSION})",
            connection.version
        )));
    }
    Ok(())
}

impl RemoteLeg {
    /// Connect to the server of `url` and open its replica's snapshot
    /// `snapshot` read-only (reconnects open it again).
    pub fn open_snapshot(
        url: &ReplicaUrl,
        snapshot: &str,
        options: &ClientOptions,
    ) -> Result<RemoteLeg> {
        let connection = Connection::connect(url, options).map_err(|e| leg_error(url, e))?;
        supported(url, &connection)?;
        let answer = connection
            .call(&Request::OpenSnapshot {
                name: url.name.clone(),
                snapshot: snapshot.to_string(),
            })
            .map_err(|e| leg_error(url, e))?;
        let Some(split) = answer.len().checked_sub(wire::SNAPSHOT_ID_BYTES) else {
            return Err(Error::Unreachable(format!(
                "replica {url}: malformed OPEN_SNAPSHOT answer of {} bytes",
                answer.len()
            )));
        };
        let id = String::from_utf8_lossy(&answer[split..]).into_owned();
        let mut leg = RemoteLeg::with_info(url, options, connection, &answer[..split])?;
        leg.snapshot = Some((snapshot.to_string(), id));
        Ok(leg)
    }

    /// The snapshot this leg reads (`open_snapshot`), if any: its name
    /// and id.
    pub fn snapshot(&self) -> Option<(&str, &str)> {
        self.snapshot
            .as_ref()
            .map(|(name, id)| (name.as_str(), id.as_str()))
    }

    /// Refused by name unless the replica's server takes snapshot
    /// requests (a connection agreed at version 3 or later).
    pub fn snapshots_supported(&self) -> Result<()> {
        supported(&self.url, &self.connection.read())
    }

    fn snapshot_call(&self, request: &Request) -> Result<Vec<u8>> {
        let connection = Arc::clone(&self.connection.read());
        supported(&self.url, &connection)?;
        connection
            .call(request)
            .map_err(|error| leg_error(&self.url, error))
    }

    fn entries(&self, answer: &[u8]) -> Result<Vec<SnapshotEntry>> {
        wire::decode_snapshots(answer).map_err(|error| self.malformed("SNAPSHOT_LIST", error))
    }

    /// Take snapshot `name` with id `id` of the replica at its flush
    /// point (the caller holds its mirror still): synced and named on the
    /// replica's host when this returns.
    pub fn snapshot_create(&self, name: &str, id: &str, copy: bool) -> Result<SnapshotEntry> {
        let answer = self.snapshot_call(&Request::SnapshotCreate {
            name: name.to_string(),
            id: id.to_string(),
            copy,
        })?;
        let mut entries = self.entries(&answer)?;
        match (entries.pop(), entries.is_empty()) {
            (Some(entry), true) if entry.name == name && entry.id == id => Ok(entry),
            _ => Err(Error::Unreachable(format!(
                "replica {}: SNAPSHOT_CREATE answered another snapshot than {name}",
                self.url
            ))),
        }
    }

    /// The replica's snapshots.
    pub fn snapshot_list(&self) -> Result<Vec<SnapshotEntry>> {
        let answer = self.snapshot_call(&Request::SnapshotList)?;
        self.entries(&answer)
    }

    /// Delete the replica's snapshot `name`.
    pub fn snapshot_delete(&self, name: &str) -> Result<()> {
        self.snapshot_call(&Request::SnapshotDelete {
            name: name.to_string(),
        })
        .map(drop)
    }
}
