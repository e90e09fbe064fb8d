//! `--listen HOST:PORT`: names resolved to every address they stand for,
//! each bound before the server announces anything.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs as _};

use anyhow::{Context as _, Result};
use socket2::{Domain, Protocol, Socket, Type};

/// The NBD port (IANA), used when `--listen` names no port.
pub const NBD_PORT: u16 = 10809;
/// Pending connections the kernel queues per listener (tokio's default).
const BACKLOG: i32 = 1024;

/// One address to listen on and the `--listen` text it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpEndpoint {
    pub addr: SocketAddr,
    pub from: String,
}

/// Every address the `--listen` texts stand for, in order, each once.
/// A text is `HOST:PORT`, `[IPV6]:PORT`, or a host or address alone (port
/// 10809); HOST may be a name, resolved by the system resolver.
pub fn resolve(texts: &[String]) -> Result<Vec<TcpEndpoint>> {
    let mut endpoints: Vec<TcpEndpoint> = Vec::new();
    for text in texts {
        for addr in resolve_one(text)? {
            if !endpoints.iter().any(|seen| seen.addr == addr) {
                endpoints.push(TcpEndpoint {
                    addr,
                    from: text.clone(),
                });
            }
        }
    }
    Ok(endpoints)
}

fn resolve_one(text: &str) -> Result<Vec<SocketAddr>> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, NBD_PORT)]);
    }
    let with_port;
    let text_with_port = if text.contains(':') {
        text
    } else {
        with_port = format!("{text}:{NBD_PORT}");
        &with_port
    };
    let addrs: Vec<SocketAddr> = text_with_port
        .to_socket_addrs()
        .with_context(|| {
            format!("--listen {text}: not HOST:PORT, [IPV6]:PORT or a host the resolver knows")
        })?
        .collect();
    if addrs.is_empty() {
        anyhow::bail!("--listen {text}: the name resolves to no address");
    }
    Ok(addrs)
}

/// Bind and listen on every endpoint; the first that fails fails them all,
/// naming its address. An IPv6 socket is made IPv6-only when an IPv4
/// endpoint shares its port, so `[::]:P` and `0.0.0.0:P` can both be
/// given; alone, `[::]:P` keeps the system's dual-stack default.
pub fn bind(endpoints: &[TcpEndpoint]) -> Result<Vec<std::net::TcpListener>> {
    endpoints
        .iter()
        .map(|endpoint| {
            let addr = endpoint.addr;
            let only_v6 = addr.is_ipv6()
                && endpoints
                    .iter()
                    .any(|other| other.addr.is_ipv4() && other.addr.port() == addr.port());
            bind_one(addr, only_v6).with_context(|| {
                if endpoint.from == addr.to_string() {
                    format!("cannot listen on {addr}")
                } else {
                    format!("cannot listen on {addr} (--listen {})", endpoint.from)
                }
            })
        })
        .collect()
}

fn bind_one(addr: SocketAddr, only_v6: bool) -> std::io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if only_v6 {
        socket.set_only_v6(true)?;
    }
    // As std and tokio do: a restarted server can bind at once while the
    // previous one's connections sit in TIME_WAIT.
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(texts: &[&str]) -> Vec<SocketAddr> {
        let texts: Vec<String> = texts.iter().map(|t| t.to_string()).collect();
        resolve(&texts)
            .unwrap()
            .into_iter()
            .map(|e| e.addr)
            .collect()
    }

    #[test]
    fn numbers_names_and_default_ports() {
        assert_eq!(
            addrs(&["127.0.0.1:7000"]),
            ["127.0.0.1:7000".parse().unwrap()]
        );
        assert_eq!(addrs(&["[::1]:7000"]), ["[::1]:7000".parse().unwrap()]);
        assert_eq!(addrs(&["127.0.0.1"]), ["127.0.0.1:10809".parse().unwrap()]);
        assert_eq!(addrs(&["::1"]), ["[::1]:10809".parse().unwrap()]);
        let local = addrs(&["localhost:7000"]);
        assert!(
            !local.is_empty()
                && local
                    .iter()
                    .all(|a| a.ip().is_loopback() && a.port() == 7000)
        );
        // Each address once, however many texts name it.
        assert_eq!(addrs(&["127.0.0.1:7000", "127.0.0.1:7000"]).len(), 1);
    }

    #[test]
    fn a_bad_text_names_itself() {
        let error = resolve(&["nonsense:port".to_string()]).unwrap_err();
        assert!(
            format!("{error:#}").contains("--listen nonsense:port"),
            "{error:#}"
        );
    }
}
