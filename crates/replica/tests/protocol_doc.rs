//! docs/PROTOCOL.md's replica tables against the code: every op and status
//! with its number and name, and the sizes and limits the text gives.

use vouch_replica::wire::{self, Op, Status};

fn doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/PROTOCOL.md");
    let text = std::fs::read_to_string(path).expect("docs/PROTOCOL.md");
    let start = text
        .find("## The replica protocol")
        .expect("a replica protocol section");
    // Lines are wrapped anywhere: compare with runs of whitespace as one space.
    text[start..]
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// `OutOfRange` -> `OUT_OF_RANGE`.
fn shouting(name: &str) -> String {
    let mut out = String::new();
    for (index, c) in name.chars().enumerate() {
        if c.is_uppercase() && index > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

#[test]
fn every_op_and_status_is_documented_with_its_number() {
    let doc = doc();
    for code in 1..=14u16 {
        let op = Op::from_u16(code).expect("op");
        let row = format!("| {code} | {} |", op.name());
        assert!(doc.contains(&row), "PROTOCOL.md lacks {row}");
    }
    assert!(Op::from_u16(15).is_err(), "a new op needs a row");
    for code in 0..=13u16 {
        let status = Status::from_u16(code).expect("status");
        let row = format!("| {code} | {} |", shouting(&format!("{status:?}")));
        assert!(doc.contains(&row), "PROTOCOL.md lacks {row}");
    }
    assert!(Status::from_u16(14).is_err(), "a new status needs a row");
}

/// 1058816 -> "1,058,816".
fn thousands(value: usize) -> String {
    let digits = value.to_string();
    let mut out = String::new();
    for (index, c) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[test]
fn sizes_and_limits_in_the_text_are_the_code_s() {
    let doc = doc();
    for text in [
        format!("### Hello ({} bytes", wire::HELLO_BYTES),
        format!("### Request header ({} bytes)", wire::REQUEST_HEADER_BYTES),
        format!("### Answer header ({} bytes)", wire::RESPONSE_HEADER_BYTES),
        format!("**INFO ({} bytes):**", wire::INFO_BYTES),
        format!("**WRITE entry ({} bytes):**", wire::WRITE_ENTRY_BYTES),
        format!("**READ entry ({} bytes):**", wire::READ_ENTRY_BYTES),
        format!("at most {}", thousands(wire::MAX_PAYLOAD_BYTES)),
        format!("blocks, 1..{}", wire::MAX_BLOCKS_PER_REQUEST),
        format!("blocks, 1..{}", wire::MAX_VERIFY_BLOCKS),
        format!("8: max blocks, 1..{}", wire::MAX_STATUS_RUNS),
        format!("1..{} bytes UTF-8", wire::MAX_NAME_BYTES),
        format!("message length (4, at most {})", wire::MAX_MESSAGE_BYTES),
        format!("count (4, at most {}), truncated", wire::MAX_VERIFY_FAULTS),
        format!("up to {} requests", vouch_replica::MAX_IN_FLIGHT),
        wire::version_refusal(4),
        format!(
            "| 8 | 4 | version | client: the version it offers ({})",
            wire::PROTOCOL_VERSION
        ),
        format!("## The replica protocol (version {})", wire::PROTOCOL_VERSION),
        format!("Ops 11–14 exist from version {}", wire::SNAPSHOT_VERSION),
        format!(
            "**SNAPSHOTS:** count (4, at most {}), reserved (4), then per snapshot checkpoint seq (8), created (8, Unix seconds), id ({})",
            wire::MAX_SNAPSHOTS_LISTED,
            wire::SNAPSHOT_ID_BYTES
        ),
        format!(
            "| challenge (server) | {} |",
            vouch_replica::auth::CHALLENGE_BYTES
        ),
        format!(
            "| response (client) | {} |",
            vouch_replica::auth::RESPONSE_BYTES
        ),
        format!(
            "| verdict (server) | {} |",
            vouch_replica::auth::VERDICT_BYTES
        ),
        format!("context `{}`", vouch_replica::auth::KEY_CONTEXT),
        format!(
            "{}..{} bytes",
            vouch_replica::auth::SECRET_MIN_BYTES,
            vouch_replica::auth::SECRET_MAX_BYTES
        ),
        format!(
            "at most {} connections",
            vouch_replica::server::MAX_CONNECTIONS
        ),
        format!(
            "has {} s for its TLS handshake",
            vouch_replica::server::HANDSHAKE_TIMEOUT.as_secs()
        ),
        format!(
            "within {} s",
            vouch_replica::server::PAYLOAD_TIMEOUT.as_secs()
        ),
        format!(
            "(default {} GiB)",
            vouch_replica::server::MAX_JOURNAL_BYTES >> 30
        ),
    ] {
        assert!(doc.contains(&text), "PROTOCOL.md lacks {text:?}");
    }
}
