//! Authentication without TLS: a secret shared by the replica server and
//! its exporters (a file on each host), proven by challenge and response
//! right after the hello, so the secret never crosses the wire
//! (docs/PROTOCOL.md, "Authentication").
//!
//! Both sides derive a 32-byte key from the file's contents
//! (`blake3::derive_key` with `KEY_CONTEXT`); each picks a 32-byte random
//! nonce per connection; each proves the key with BLAKE3 keyed by it over
//! its role and both nonces. The server proves itself too (mutual), so an
//! exporter given a secret never writes to a server that cannot prove it.
//! A nonce is fresh per connection on each side, so a recorded proof is
//! worth nothing on another connection.
//!
//! What this does not do: encrypt or protect the stream after the
//! handshake. On a network where someone can inject into a TCP
//! connection, use TLS (the secret may be combined with it).

use std::path::Path;

use rand::RngCore;

/// Bytes of a nonce, and of a proof.
pub const NONCE_BYTES: usize = 32;
pub const PROOF_BYTES: usize = 32;
/// A secret file's contents, at least (after trailing whitespace is
/// dropped): 32 characters, e.g. `openssl rand -hex 32` (64).
pub const SECRET_MIN_BYTES: usize = 32;
/// A secret file's contents, at most.
pub const SECRET_MAX_BYTES: usize = 4096;
/// The key derivation's context string (BLAKE3 `derive_key`).
pub const KEY_CONTEXT: &str = "vouch replica protocol 2026-11 shared secret";

/// Server -> client after its hello: magic, flags, server nonce.
pub const CHALLENGE_BYTES: usize = 8 + NONCE_BYTES;
/// Client -> server: magic, flags, client nonce, proof.
pub const RESPONSE_BYTES: usize = 8 + NONCE_BYTES + PROOF_BYTES;
/// Server -> client: magic, status, server proof.
pub const VERDICT_BYTES: usize = 8 + PROOF_BYTES;

const CHALLENGE_MAGIC: [u8; 4] = *b"VRCH";
const RESPONSE_MAGIC: [u8; 4] = *b"VRPF";
const VERDICT_MAGIC: [u8; 4] = *b"VRVD";

/// Challenge flag: the server checks a shared secret.
pub const SECRET_REQUIRED: u32 = 1;
/// Response flag: the proof field holds a proof.
pub const HAS_PROOF: u32 = 1;
/// Verdict status: accepted.
pub const ACCEPTED: u32 = 0;
/// Verdict status: the proof was missing or wrong; the server closes.
pub const REFUSED: u32 = 1;

const CLIENT_ROLE: &[u8; 6] = b"client";
const SERVER_ROLE: &[u8; 6] = b"server";

/// A shared secret, as the key both sides derive from its file.
pub struct Secret {
    key: [u8; 32],
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// Read the secret file at `path`: it must be readable by its owner
    /// only (like an ssh key), hold `SECRET_MIN_BYTES` to
    /// `SECRET_MAX_BYTES` bytes once trailing whitespace is dropped.
    pub fn from_file(path: &Path) -> Result<Secret, String> {
        use std::os::unix::fs::PermissionsExt;
        let name = path.display();
        let metadata =
            std::fs::metadata(path).map_err(|error| format!("secret file {name}: {error}"))?;
        if metadata.permissions().mode() & 0o077 != 0 {
            return Err(format!(
                "secret file {name} is readable by others (mode {:o}): chmod 600 it",
                metadata.permissions().mode() & 0o777
            ));
        }
        if metadata.len() > SECRET_MAX_BYTES as u64 {
            return Err(format!(
                "secret file {name} is {} bytes, over the limit of {SECRET_MAX_BYTES}",
                metadata.len()
            ));
        }
        let bytes = std::fs::read(path).map_err(|error| format!("secret file {name}: {error}"))?;
        let secret = bytes.trim_ascii_end();
        if secret.len() < SECRET_MIN_BYTES {
            return Err(format!(
                "secret file {name} holds {} bytes, under the minimum of {SECRET_MIN_BYTES} (make one with `openssl rand -hex 32`)",
                secret.len()
            ));
        }
        Ok(Secret::from_bytes(secret))
    }

    /// The key of `secret` (the bytes of a secret file).
    pub fn from_bytes(secret: &[u8]) -> Secret {
        Secret {
            key: blake3::derive_key(KEY_CONTEXT, secret),
        }
    }

    fn proof(&self, role: &[u8; 6], server: &Nonce, client: &Nonce) -> blake3::Hash {
        let mut hasher = blake3::Hasher::new_keyed(&self.key);
        hasher.update(role);
        hasher.update(server);
        hasher.update(client);
        hasher.finalize()
    }

    /// The client's proof for this pair of nonces.
    pub fn client_proof(&self, server: &Nonce, client: &Nonce) -> [u8; PROOF_BYTES] {
        *self.proof(CLIENT_ROLE, server, client).as_bytes()
    }

    /// The server's proof for this pair of nonces.
    pub fn server_proof(&self, server: &Nonce, client: &Nonce) -> [u8; PROOF_BYTES] {
        *self.proof(SERVER_ROLE, server, client).as_bytes()
    }

    /// Does `proof` prove the key in `role`? (Compared in constant time:
    /// `blake3::Hash`'s equality.)
    fn proves(&self, role: &[u8; 6], server: &Nonce, client: &Nonce, proof: &[u8]) -> bool {
        let Ok(proof) = <[u8; PROOF_BYTES]>::try_from(proof) else {
            return false;
        };
        self.proof(role, server, client) == blake3::Hash::from_bytes(proof)
    }

    pub fn is_client_proof(&self, server: &Nonce, client: &Nonce, proof: &[u8]) -> bool {
        self.proves(CLIENT_ROLE, server, client, proof)
    }

    pub fn is_server_proof(&self, server: &Nonce, client: &Nonce, proof: &[u8]) -> bool {
        self.proves(SERVER_ROLE, server, client, proof)
    }
}

pub type Nonce = [u8; NONCE_BYTES];

/// A fresh nonce from the operating system's generator.
pub fn nonce() -> Nonce {
    let mut nonce = [0u8; NONCE_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut nonce);
    nonce
}

/// The server's challenge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Challenge {
    pub flags: u32,
    pub nonce: Nonce,
}

/// The client's response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Response {
    pub flags: u32,
    pub nonce: Nonce,
    pub proof: [u8; PROOF_BYTES],
}

/// The server's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub status: u32,
    pub proof: [u8; PROOF_BYTES],
}

fn check_magic(bytes: &[u8], magic: &[u8; 4], what: &str) -> Result<u32, String> {
    if bytes[..4] != magic[..] {
        return Err(format!("not a replica {what} (bad magic)"));
    }
    Ok(u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes")))
}

impl Challenge {
    pub fn encode(&self) -> [u8; CHALLENGE_BYTES] {
        let mut out = [0u8; CHALLENGE_BYTES];
        out[..4].copy_from_slice(&CHALLENGE_MAGIC);
        out[4..8].copy_from_slice(&self.flags.to_le_bytes());
        out[8..].copy_from_slice(&self.nonce);
        out
    }

    pub fn decode(bytes: &[u8; CHALLENGE_BYTES]) -> Result<Challenge, String> {
        let flags = check_magic(bytes, &CHALLENGE_MAGIC, "challenge")?;
        if flags & !SECRET_REQUIRED != 0 {
            return Err(format!("unknown challenge flags {flags:#x}"));
        }
        Ok(Challenge {
            flags,
            nonce: bytes[8..].try_into().expect("32 bytes"),
        })
    }
}

impl Response {
    pub fn encode(&self) -> [u8; RESPONSE_BYTES] {
        let mut out = [0u8; RESPONSE_BYTES];
        out[..4].copy_from_slice(&RESPONSE_MAGIC);
        out[4..8].copy_from_slice(&self.flags.to_le_bytes());
        out[8..8 + NONCE_BYTES].copy_from_slice(&self.nonce);
        out[8 + NONCE_BYTES..].copy_from_slice(&self.proof);
        out
    }

    pub fn decode(bytes: &[u8; RESPONSE_BYTES]) -> Result<Response, String> {
        let flags = check_magic(bytes, &RESPONSE_MAGIC, "challenge response")?;
        if flags & !HAS_PROOF != 0 {
            return Err(format!("unknown response flags {flags:#x}"));
        }
        Ok(Response {
            flags,
            nonce: bytes[8..8 + NONCE_BYTES].try_into().expect("32 bytes"),
            proof: bytes[8 + NONCE_BYTES..].try_into().expect("32 bytes"),
        })
    }
}

impl Verdict {
    pub fn encode(&self) -> [u8; VERDICT_BYTES] {
        let mut out = [0u8; VERDICT_BYTES];
        out[..4].copy_from_slice(&VERDICT_MAGIC);
        out[4..8].copy_from_slice(&self.status.to_le_bytes());
        out[8..].copy_from_slice(&self.proof);
        out
    }

    pub fn decode(bytes: &[u8; VERDICT_BYTES]) -> Result<Verdict, String> {
        let status = check_magic(bytes, &VERDICT_MAGIC, "verdict")?;
        if status > REFUSED {
            return Err(format!("unknown verdict status {status}"));
        }
        Ok(Verdict {
            status,
            proof: bytes[8..].try_into().expect("32 bytes"),
        })
    }
}

/// The server's side: the verdict on `response` to a challenge with
/// `server` nonce, and whether the client is accepted. Without a secret
/// every client is accepted (and no proof is given back).
pub fn judge(secret: Option<&Secret>, server: &Nonce, response: &Response) -> (Verdict, bool) {
    match secret {
        None => (
            Verdict {
                status: ACCEPTED,
                proof: [0; PROOF_BYTES],
            },
            true,
        ),
        Some(secret)
            if response.flags & HAS_PROOF != 0
                && secret.is_client_proof(server, &response.nonce, &response.proof) =>
        {
            (
                Verdict {
                    status: ACCEPTED,
                    proof: secret.server_proof(server, &response.nonce),
                },
                true,
            )
        }
        Some(_) => (
            Verdict {
                status: REFUSED,
                proof: [0; PROOF_BYTES],
            },
            false,
        ),
    }
}

/// The client's side: its response to `challenge` (with its `client`
/// nonce), or why it will not go on.
pub fn respond(
    secret: Option<&Secret>,
    challenge: &Challenge,
    client: &Nonce,
) -> Result<Response, String> {
    let required = challenge.flags & SECRET_REQUIRED != 0;
    match secret {
        None if required => Err(
            "the replica server requires a shared secret: give --replica-secret-file (the file its --secret-file names)".into(),
        ),
        None => Ok(Response {
            flags: 0,
            nonce: *client,
            proof: [0; PROOF_BYTES],
        }),
        Some(_) if !required => Err(
            "the replica server checks no shared secret, but this side was given one (--replica-secret-file): refusing a server that cannot prove it (give the server --secret-file)".into(),
        ),
        Some(secret) => Ok(Response {
            flags: HAS_PROOF,
            nonce: *client,
            proof: secret.client_proof(&challenge.nonce, client),
        }),
    }
}

/// The client's check of the server's verdict.
pub fn accept_verdict(
    secret: Option<&Secret>,
    challenge: &Challenge,
    client: &Nonce,
    verdict: &Verdict,
) -> Result<(), String> {
    if verdict.status != ACCEPTED {
        return Err(
            "the replica server refused our shared secret (do the secret files differ?)".into(),
        );
    }
    match secret {
        Some(secret) if !secret.is_server_proof(&challenge.nonce, client, &verdict.proof) => Err(
            "the replica server could not prove the shared secret: not our server, or the secret files differ".into(),
        ),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_prove_the_secret_and_a_wrong_secret_or_replayed_proof_fails() {
        let ours = Secret::from_bytes(b"0123456789abcdef0123456789abcdef");
        let other = Secret::from_bytes(b"0123456789abcdef0123456789abcdeX");
        let challenge = Challenge {
            flags: SECRET_REQUIRED,
            nonce: nonce(),
        };
        let client = nonce();
        let response = respond(Some(&ours), &challenge, &client).expect("respond");
        let decoded = Response::decode(&response.encode()).expect("decode");
        let (verdict, accepted) = judge(Some(&ours), &challenge.nonce, &decoded);
        assert!(accepted);
        accept_verdict(Some(&ours), &challenge, &client, &verdict).expect("server proven");
        // A client with another secret is refused.
        let wrong = respond(Some(&other), &challenge, &client).expect("respond");
        assert!(!judge(Some(&ours), &challenge.nonce, &wrong).1);
        // A proof recorded on one connection fails against a new challenge.
        let next = nonce();
        assert!(!judge(Some(&ours), &next, &response).1);
        // A server with another secret cannot prove itself.
        let (forged, _) = judge(Some(&other), &challenge.nonce, &wrong);
        assert!(accept_verdict(Some(&ours), &challenge, &client, &forged).is_err());
        // No proof at all is refused when a secret is required.
        let bare = respond(
            None,
            &Challenge {
                flags: 0,
                ..challenge
            },
            &client,
        )
        .expect("bare");
        assert!(!judge(Some(&ours), &challenge.nonce, &bare).1);
        assert!(respond(None, &challenge, &client).is_err());
        assert!(respond(
            Some(&ours),
            &Challenge {
                flags: 0,
                ..challenge
            },
            &client
        )
        .is_err());
    }
}
