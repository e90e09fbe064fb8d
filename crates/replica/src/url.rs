//! `vouch://HOST:PORT/NAME`: where a remote replica is, and its name.

use crate::wire::check_name;

/// A parsed replica URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaUrl {
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    pub port: u16,
    pub name: String,
}

impl ReplicaUrl {
    /// Parse `vouch://HOST:PORT/NAME` (`[v6]:PORT` for IPv6 addresses).
    pub fn parse(text: &str) -> Result<ReplicaUrl, String> {
        let bad =
            |why: &str| format!("{text:?} is not a replica URL (vouch://HOST:PORT/NAME): {why}");
        let rest = text
            .strip_prefix(vouch_mirror::remote::REMOTE_SCHEME)
            .ok_or_else(|| bad("it does not start with vouch://"))?;
        let (authority, name) = rest.split_once('/').ok_or_else(|| bad("no /NAME"))?;
        check_name(name).map_err(|error| bad(&error.to_string()))?;
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, port) = v6.split_once("]:").ok_or_else(|| bad("no :PORT"))?;
            (host, port)
        } else {
            authority.rsplit_once(':').ok_or_else(|| bad("no :PORT"))?
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let port: u16 = port
            .parse()
            .map_err(|_| bad("the port is not a number from 1 to 65535"))?;
        if port == 0 {
            return Err(bad("port 0"));
        }
        Ok(ReplicaUrl {
            host: host.to_string(),
            port,
            name: name.to_string(),
        })
    }

    /// `HOST:PORT` as `connect` takes it.
    pub fn address(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl std::fmt::Display for ReplicaUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "vouch://{}/{}", self.address(), self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_bad_ones_say_why() {
        let url = ReplicaUrl::parse("vouch://10.231.0.2:7000/db").unwrap();
        assert_eq!(
            (url.host.as_str(), url.port, url.name.as_str()),
            ("10.231.0.2", 7000, "db")
        );
        assert_eq!(url.to_string(), "vouch://10.231.0.2:7000/db");
        let v6 = ReplicaUrl::parse("vouch://[::1]:7/x").unwrap();
        assert_eq!(v6.address(), "[::1]:7");
        for bad in [
            "http://h:1/x",
            "vouch://h:1/",
            "vouch://h:1/a/b",
            "vouch://h:1/..",
            "vouch://h/x",
            "vouch://h:0/x",
            "vouch://h:99999/x",
            "vouch://:1/x",
        ] {
            let error = ReplicaUrl::parse(bad).expect_err(bad);
            assert!(error.contains("not a replica URL"), "{error}");
        }
    }
}
