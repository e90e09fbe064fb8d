//! A fault-injection layer (`vouch serve --inject SPEC`), like nbdkit's
//! error filter: a `BlockDevice` wrapping another, failing chosen requests
//! before they reach it, on whichever route (inline, ring, worker) a
//! request takes; every call and fast path it does not change forwards to
//! the device below (`BlockDevice::below`), so `--inject` keeps them all. It proves that layers stack on the block-device
//! trait without the engine knowing, and lets tests and operators see how
//! clients behave on each kind of fault without corrupting a volume.
//!
//! SPEC is a comma-separated list of rules `OP:KIND[@FIRST[-LAST]]`:
//! - OP `read`, KIND a fault kind (`guard_mismatch`, `ref_tag_mismatch`,
//!   `volume_tag_mismatch`, `context_corrupt`, `unreadable`) or `io`;
//! - OP `write` (also trims and zeroes), KIND `io` or `nospace`;
//! - OP `flush`, KIND `io` or `nospace` (no range);
//! - `@FIRST-LAST`: the LBAs (inclusive) the rule applies to; without it,
//!   every LBA.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use vouch_engine::{
    verify_in_turn, Admission, Allocation, BlockDevice, Error, Fault, FaultKind, FlushDone,
    ObjectId, Result, StartRead, Submitted, ZeroFlags, BLOCK,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Read,
    Write,
    Flush,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Injected {
    Fault(FaultKind),
    Io,
    NoSpace,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Rule {
    op: Op,
    what: Injected,
    /// LBAs `[start, end)` the rule applies to.
    lbas: Range<u64>,
}

/// Parsed `--inject` rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InjectSpec {
    text: String,
    rules: Vec<Rule>,
}

impl std::fmt::Display for InjectSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for InjectSpec {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<InjectSpec, String> {
        let rules = text
            .split(',')
            .map(|rule| parse_rule(rule.trim()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(InjectSpec {
            text: text.to_string(),
            rules,
        })
    }
}

fn parse_rule(rule: &str) -> std::result::Result<Rule, String> {
    let usage =
        "expected OP:KIND[@FIRST[-LAST]], e.g. read:guard_mismatch@8-15, write:nospace, flush:io";
    let (head, range) = match rule.split_once('@') {
        Some((head, range)) => (head, Some(range)),
        None => (rule, None),
    };
    let (op, kind) = head
        .split_once(':')
        .ok_or_else(|| format!("inject rule {rule:?}: {usage}"))?;
    let op = match op {
        "read" => Op::Read,
        "write" => Op::Write,
        "flush" => Op::Flush,
        other => {
            return Err(format!(
                "inject rule {rule:?}: unknown operation {other:?} (read, write, flush)"
            ))
        }
    };
    let what = match kind {
        "io" => Injected::Io,
        "nospace" if op != Op::Read => Injected::NoSpace,
        other if op == Op::Read => Injected::Fault(
            FaultKind::ALL
                .into_iter()
                .find(|kind| kind.name() == other)
                .ok_or_else(|| {
                    let names: Vec<&str> = FaultKind::ALL.iter().map(|k| k.name()).collect();
                    format!(
                        "inject rule {rule:?}: unknown read fault {other:?} ({} or io)",
                        names.join(", ")
                    )
                })?,
        ),
        other => {
            return Err(format!(
                "inject rule {rule:?}: unknown {op:?} failure {other:?} (io or nospace)"
            ))
        }
    };
    let lbas = match range {
        None => 0..u64::MAX,
        Some(_) if op == Op::Flush => {
            return Err(format!("inject rule {rule:?}: a flush has no LBA range"))
        }
        Some(range) => {
            let number = |text: &str| {
                text.parse::<u64>()
                    .map_err(|_| format!("inject rule {rule:?}: {text:?} is not an LBA; {usage}"))
            };
            let (first, last) = match range.split_once('-') {
                Some((first, last)) => (number(first)?, number(last)?),
                None => (number(range)?, number(range)?),
            };
            if last < first {
                return Err(format!("inject rule {rule:?}: LAST is before FIRST"));
            }
            first..last.saturating_add(1)
        }
    };
    Ok(Rule { op, what, lbas })
}

/// A device that fails requests matching its rules and passes the rest on.
pub struct FaultInjector {
    inner: Arc<dyn BlockDevice>,
    spec: InjectSpec,
}

impl FaultInjector {
    pub fn new(inner: Arc<dyn BlockDevice>, spec: InjectSpec) -> FaultInjector {
        FaultInjector { inner, spec }
    }

    /// The first rule for `op` that touches blocks `[first, end)`, as the
    /// error it injects at the first LBA it covers.
    fn check(&self, op: Op, first: u64, end: u64) -> Result<()> {
        for rule in &self.spec.rules {
            if rule.op != op || rule.lbas.end <= first || rule.lbas.start >= end {
                continue;
            }
            let lba = rule.lbas.start.max(first);
            let object = ObjectId::Data(0);
            return Err(match rule.what {
                Injected::Fault(kind) => Error::Fault(Fault { lba, kind }),
                Injected::NoSpace => Error::NoSpace {
                    object,
                    offset: lba * BLOCK,
                },
                Injected::Io => Error::Io {
                    op: "injected",
                    object,
                    offset: lba * BLOCK,
                    cause: std::io::Error::other(format!("injected I/O error at LBA {lba}")),
                },
            });
        }
        Ok(())
    }

    fn check_bytes(&self, op: Op, offset: u64, length: u64) -> Result<()> {
        let first = offset / BLOCK;
        let end = offset.saturating_add(length).div_ceil(BLOCK).max(first + 1);
        self.check(op, first, end)
    }
}

/// A layer over the served device: every call it does not name here
/// reaches the device below unchanged, fast paths included
/// (`BlockDevice::below`). It is never a mirror's leg, so it has no
/// sealed face (`SealedDevice`) to check. Every route a
/// rule's operation can take checks the rules first, so no injected fault
/// is skipped because the request took a fast path; a failed check stores
/// nothing and reaches nothing below.
impl BlockDevice for FaultInjector {
    fn below(&self) -> Option<&Arc<dyn BlockDevice>> {
        Some(&self.inner)
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>> {
        self.inner.block_status(offset, length, max_blocks)
    }

    // Reads.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        self.check_bytes(Op::Read, offset, buf.len() as u64)?;
        self.inner.read(offset, buf)
    }
    fn try_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<Vec<Range<u64>>>> {
        self.check_bytes(Op::Read, offset, buf.len() as u64)?;
        self.inner.try_read(offset, buf)
    }
    /// A ring read's outcome carries no error, so a read a rule covers is
    /// declined here and fails on the worker path (`read`), naming its LBA.
    fn try_begin_read(&self, offset: u64, len: usize) -> Option<StartRead> {
        self.check_bytes(Op::Read, offset, len as u64).ok()?;
        self.inner.try_begin_read(offset, len)
    }
    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        self.check(Op::Read, first, first + count)?;
        self.inner.read_blocks_collecting(first, count, out)
    }
    /// Over a range a read rule touches, verified here a chunk at a time
    /// through `read_blocks_collecting`, which injects; elsewhere the
    /// device below verifies its own way.
    fn verify(&self, first: u64, count: u64) -> Result<Vec<Fault>> {
        if self.check(Op::Read, first, first + count).is_err() {
            return verify_in_turn(self, first, count);
        }
        self.inner.verify(first, count)
    }
    fn compare(&self, offset: u64, data: &[u8]) -> Result<Option<u64>> {
        self.check_bytes(Op::Read, offset, data.len() as u64)?;
        self.inner.compare(offset, data)
    }
    /// Reads the source and writes the destination: both sets of rules,
    /// checked before anything is copied.
    fn copy(&self, source: u64, destination: u64, count: u64) -> Result<()> {
        self.check(Op::Read, source, source.saturating_add(count))?;
        self.check(Op::Write, destination, destination.saturating_add(count))?;
        self.inner.copy(source, destination, count)
    }

    // Writes (trims and zeroes too).
    /// Every admission passes on unchanged: the device below keeps each
    /// of its routes (inline, completion, waiting) under the rules.
    fn submit_write(
        &self,
        offset: u64,
        data: &Bytes,
        fua: bool,
        admission: Admission,
    ) -> Result<Submitted> {
        self.check_bytes(Op::Write, offset, data.len() as u64)?;
        self.inner.submit_write(offset, data, fua, admission)
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.check_bytes(Op::Write, offset, length)?;
        self.inner.trim(offset, length, fua)
    }
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()> {
        self.check_bytes(Op::Write, offset, length)?;
        self.inner.write_zeroes(offset, length, flags)
    }

    // Flushes.
    fn flush(&self) -> Result<()> {
        self.check(Op::Flush, 0, u64::MAX)?;
        self.inner.flush()
    }
    fn flush_then(&self, done: FlushDone) {
        match self.check(Op::Flush, 0, u64::MAX) {
            Err(error) => done(Err(error)),
            Ok(()) => self.inner.flush_then(done),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_say_why() {
        let spec: InjectSpec = "read:guard_mismatch@8-15, write:nospace@3, flush:io"
            .parse()
            .expect("valid");
        assert_eq!(spec.rules.len(), 3);
        assert_eq!(spec.rules[0].lbas, 8..16);
        assert_eq!(spec.rules[1].lbas, 3..4);
        assert_eq!(spec.rules[2].op, Op::Flush);
        for (bad, says) in [
            ("read", "expected OP:KIND"),
            ("erase:io", "unknown operation"),
            ("read:nospace", "unknown read fault"),
            ("write:guard_mismatch", "io or nospace"),
            ("read:io@x", "is not an LBA"),
            ("read:io@9-3", "LAST is before FIRST"),
            ("flush:io@1", "no LBA range"),
        ] {
            let error = bad.parse::<InjectSpec>().expect_err(bad);
            assert!(error.contains(says), "{bad}: {error}");
        }
    }
}
