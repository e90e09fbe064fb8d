//! Readiness notification, as sd_notify(3) defines it: when the service
//! manager sets `NOTIFY_SOCKET` (a Unix datagram socket: a path, or an
//! abstract name written with a leading '@'), the server sends it
//! newline-separated `KEY=VALUE` lines: `READY=1` once it serves,
//! `STATUS=...` for `systemctl status`, `STOPPING=1` when it begins a
//! clean stop. Without `NOTIFY_SOCKET` every call does nothing.
//!
//! Written here instead of taken from the `sd-notify` crate: its 0.5
//! connects to `NOTIFY_SOCKET` as a file path, so the abstract names that
//! systemd itself uses (`@/org/freedesktop/systemd1/notify/...`) fail; the
//! whole protocol is one datagram.

use std::ffi::OsString;
use std::os::linux::net::SocketAddrExt as _;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};

/// Sends state changes to the service manager; cheap to clone.
#[derive(Clone, Default)]
pub struct Notifier {
    target: Option<Arc<Target>>,
}

struct Target {
    socket: UnixDatagram,
    address: SocketAddr,
    /// `NOTIFY_SOCKET` as given, for messages.
    text: String,
}

impl Notifier {
    /// The notifier `NOTIFY_SOCKET` asks for (none when unset or empty).
    /// One it cannot use (systemd's `vsock:` addresses) is logged and
    /// left out: the server still serves, and the service manager's
    /// start timeout reports the readiness it did not hear.
    pub fn from_env() -> Notifier {
        match std::env::var_os("NOTIFY_SOCKET") {
            None => Notifier::default(),
            Some(text) if text.is_empty() => Notifier::default(),
            Some(text) => Notifier::to(text).unwrap_or_else(|error| {
                tracing::warn!("no readiness notification: {error:#}");
                Notifier::default()
            }),
        }
    }

    fn to(text: OsString) -> Result<Notifier> {
        let shown = text.to_string_lossy().into_owned();
        let bytes = text.as_bytes();
        let address = match bytes.first() {
            Some(b'@') => SocketAddr::from_abstract_name(&bytes[1..]),
            Some(b'/') => SocketAddr::from_pathname(&text),
            _ => bail!(
                "NOTIFY_SOCKET={shown:?}: only a socket path or an @abstract name is supported"
            ),
        }
        .with_context(|| format!("NOTIFY_SOCKET={shown:?} is not a Unix socket address"))?;
        let socket = UnixDatagram::unbound().context("creating the notification socket")?;
        Ok(Notifier {
            target: Some(Arc::new(Target {
                socket,
                address,
                text: shown,
            })),
        })
    }

    /// `READY=1` with a status line: every listener is bound and every
    /// volume open.
    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={}", one_line(status)));
    }

    /// `STOPPING=1`: a signal asked for a clean stop, which has begun.
    pub fn stopping(&self, status: &str) {
        self.send(&format!("STOPPING=1\nSTATUS={}", one_line(status)));
    }

    /// A lost notification does not stop the server: the manager's own
    /// timeout (TimeoutStartSec=) reports a service that never became
    /// ready, and the log says why.
    fn send(&self, message: &str) {
        let Some(target) = &self.target else {
            return;
        };
        if let Err(error) = target
            .socket
            .send_to_addr(message.as_bytes(), &target.address)
        {
            tracing::warn!(
                "notifying the service manager on {} failed: {error}",
                target.text
            );
        }
    }
}

/// A status must not end its line early: the protocol is one field a line.
fn one_line(status: &str) -> String {
    status.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_reach_a_path_and_an_abstract_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        Notifier::to(path.clone().into_os_string())
            .unwrap()
            .ready("serving 1 export\non x");
        let mut buffer = [0u8; 256];
        let len = listener.recv(&mut buffer).unwrap();
        assert_eq!(&buffer[..len], b"READY=1\nSTATUS=serving 1 export on x");

        let name = format!("vouch-notify-test-{}", std::process::id());
        let address = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&address).unwrap();
        Notifier::to(format!("@{name}").into())
            .unwrap()
            .stopping("stopping");
        let len = listener.recv(&mut buffer).unwrap();
        assert_eq!(&buffer[..len], b"STOPPING=1\nSTATUS=stopping");
    }

    #[test]
    fn other_addresses_are_refused() {
        assert!(Notifier::to("vsock:2:1234".into()).is_err());
        assert!(Notifier::to("relative/path".into()).is_err());
    }
}
