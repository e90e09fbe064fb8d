//! What a request holds while it is in flight: its slot and its share of
//! the connection's and the server's byte budgets (`Limits`). The reader
//! acquires them (`transmission.rs`); the reply carries them until its
//! bytes are on the socket, so memory stays bounded. A leaf: the
//! transmission and the completions (`export/completion.rs`) hold them.

use tokio::sync::OwnedSemaphorePermit;

pub(crate) struct Permits {
    pub(crate) _request: OwnedSemaphorePermit,
    pub(crate) _connection_bytes: Option<OwnedSemaphorePermit>,
    pub(crate) _server_bytes: Option<OwnedSemaphorePermit>,
}
