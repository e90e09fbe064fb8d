//! systemd socket activation, as sd_listen_fds(3) defines it: the service
//! manager binds the sockets (a `.socket` unit, or `systemd-socket-activate`)
//! and starts the server with them open from descriptor 3 on, saying so in
//! `LISTEN_PID` (the process they are for), `LISTEN_FDS` (how many) and
//! `LISTEN_FDNAMES` (colon-separated names, optional).
//!
//! Written here instead of taken from a crate: `sd-notify`'s `listen_fds`
//! hands back bare descriptors without checking what they are, and
//! `listenfd` does not read `LISTEN_FDNAMES`; the checks below (a stream
//! socket, listening, TCP or Unix) are what a wrong `.socket` unit needs to
//! be told, and socket2 (already a dependency) makes them one call each.

use std::os::fd::{FromRawFd as _, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;

use anyhow::{bail, Context as _, Result};
use socket2::{Domain, Socket, Type};

/// The first descriptor passed (`SD_LISTEN_FDS_START`).
const FIRST_FD: RawFd = 3;
/// More passed sockets than this is a broken environment, not a unit file.
const MAX_FDS: u32 = 1024;

/// A listening socket passed by the service manager.
#[derive(Debug)]
pub enum Inherited {
    Tcp {
        listener: std::net::TcpListener,
        /// Its `FileDescriptorName=` (systemd's default: the unit's name).
        name: String,
    },
    Unix {
        listener: UnixListener,
        name: String,
    },
}

/// The sockets passed to this process, or `None` when it was not socket
/// activated (no `LISTEN_PID`, or one naming another process: the
/// variables were inherited, not meant for it). The variables are removed
/// from the environment so nothing started later takes them again; call
/// this before any thread starts (`std::env::remove_var` is not safe to
/// race with readers of the environment).
pub fn take() -> Result<Option<Vec<Inherited>>> {
    let Some(pid) = std::env::var_os("LISTEN_PID") else {
        return Ok(None);
    };
    let count = std::env::var_os("LISTEN_FDS");
    let names = std::env::var_os("LISTEN_FDNAMES");
    for name in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(name);
    }
    let pid = pid.to_string_lossy();
    let pid: u32 = pid
        .parse()
        .with_context(|| format!("socket activation: LISTEN_PID={pid:?} is not a process id"))?;
    if pid != std::process::id() {
        return Ok(None);
    }
    let count = count.map(|count| count.to_string_lossy().into_owned());
    let count: u32 = match count.as_deref() {
        None => return Ok(None),
        Some(text) => text
            .parse()
            .ok()
            .filter(|&n| n <= MAX_FDS)
            .with_context(|| {
                format!("socket activation: LISTEN_FDS={text:?} is not a count of descriptors")
            })?,
    };
    if count == 0 {
        return Ok(None);
    }
    let names = fd_names(names.map(|n| n.to_string_lossy().into_owned()), count)?;
    let mut sockets = Vec::new();
    for (index, name) in names.into_iter().enumerate() {
        let offset = RawFd::try_from(index).context("socket activation: too many descriptors")?;
        sockets.push(adopt(FIRST_FD + offset, name)?);
    }
    Ok(Some(sockets))
}

/// One name per descriptor: `LISTEN_FDNAMES` split on ':', or "unknown"
/// for each (what sd_listen_fds_with_names(3) reports without it).
fn fd_names(names: Option<String>, count: u32) -> Result<Vec<String>> {
    let count = usize::try_from(count).context("socket activation: too many descriptors")?;
    let Some(names) = names else {
        return Ok(vec!["unknown".to_string(); count]);
    };
    let names: Vec<String> = names.split(':').map(str::to_string).collect();
    if names.len() != count {
        bail!(
            "socket activation: LISTEN_FDNAMES has {} names for LISTEN_FDS={count}",
            names.len()
        );
    }
    Ok(names)
}

/// Take ownership of passed descriptor `fd` after checking it is a
/// listening TCP or Unix stream socket; it is made close-on-exec.
fn adopt(fd: RawFd, name: String) -> Result<Inherited> {
    let what = format!("socket activation: descriptor {fd} ({name})");
    // SAFETY: fcntl(2) on a descriptor number only reads or sets its flags;
    // an unused number fails with EBADF and is reported.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("{what} is not open"));
    }
    // SAFETY: as above, on a descriptor that is open.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("{what}: setting close-on-exec"));
    }
    // SAFETY: the descriptor is open (checked above), and nothing else in
    // this process owns it: the service manager passed it for this process
    // alone, and `take` removed LISTEN_FDS before adopting, so no second
    // call wraps it again.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let socket = Socket::from(owned);
    let kind = socket
        .r#type()
        .with_context(|| format!("{what} is not a socket"))?;
    let listening = socket
        .is_listener()
        .with_context(|| format!("{what}: reading SO_ACCEPTCONN"))?;
    if kind != Type::STREAM || !listening {
        bail!("{what} is not a listening stream socket (give the .socket unit ListenStream=)");
    }
    let domain = socket
        .domain()
        .with_context(|| format!("{what}: reading SO_DOMAIN"))?;
    let owned = OwnedFd::from(socket);
    if domain == Domain::IPV4 || domain == Domain::IPV6 {
        Ok(Inherited::Tcp {
            listener: std::net::TcpListener::from(owned),
            name,
        })
    } else if domain == Domain::UNIX {
        Ok(Inherited::Unix {
            listener: UnixListener::from(owned),
            name,
        })
    } else {
        bail!("{what} is neither a TCP nor a Unix socket ({domain:?})")
    }
}

#[cfg(test)]
mod tests {
    use super::fd_names;

    #[test]
    fn names_are_one_per_descriptor() {
        assert_eq!(fd_names(None, 2).unwrap(), ["unknown", "unknown"]);
        assert_eq!(
            fd_names(Some("nbd:nbd-unix".into()), 2).unwrap(),
            ["nbd", "nbd-unix"]
        );
        assert_eq!(fd_names(Some("a::c".into()), 3).unwrap(), ["a", "", "c"]);
        assert!(fd_names(Some("nbd".into()), 2).is_err());
    }
}
