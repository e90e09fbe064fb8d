//! Read repair, in md's order: a block that failed verification on one leg
//! is fetched from another leg that verifies it, written to the bad leg
//! with `write_sealed` (the bad leg verifies the sealed block before it
//! stores it), flushed there, and re-read and compared. The caller gets
//! the good data whether or not the rewrite took. A block bad on every leg
//! is a fault naming its LBA, and nothing is rewritten: a good copy is
//! never overwritten from a bad one, and a context is never rewritten to
//! match data (the sealed block moves whole, with its own context).
//!
//! Counting. A bad block is one fault per read and one repair: the read
//! that finds it judges it (logged, counted in the leg's metrics); a
//! fault the leg's own fast read named is not read on that leg again,
//! and the repair's re-reads of the block (still bad under the stripe
//! lock? did the rewrite take?) are rechecks that judge nothing
//! (`SealedDevice::recheck_blocks`).
//!
//! Crash ordering. A repair's write enters the activity log like every
//! mirror write (ORDER POINT: its extent is in the log on disk before the
//! block reaches the bad leg, and stays there until a flush of every leg
//! that began after it), so a crash while a repair writes leaves any
//! block it touched differing between the legs only inside an extent the
//! next open reconciles, not a fault for a later scrub to count.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::activity::Entered;
use crate::device::Mirror;
use crate::legs::Legs;
use crate::stripes::Stripes;
use crate::written_log::WrittenLog;
use vouch_engine::error::{Error, Fault, FaultKind, Result};
use vouch_engine::{Block, SealedWrites, BLOCK};

/// Read repair as the mirror runs it: the parts it needs, borrowed from
/// the mirror (its legs, which it reads, judges and rewrites; the stripe
/// lock a repair holds; the written log its rewrites enter; the count of
/// client requests a flush for room in the log adds to), never the
/// `Mirror` itself.
pub(crate) struct Repair<'m> {
    legs: &'m Legs,
    stripes: &'m Stripes,
    written: &'m WrittenLog,
    foreground: &'m AtomicU64,
}

impl Mirror {
    /// The mirror's read repair (`Repair`), on its parts.
    pub(super) fn repair(&self) -> Repair<'_> {
        Repair {
            legs: &self.legs,
            stripes: &self.stripes,
            written: &self.written,
            foreground: &self.foreground,
        }
    }
}

impl Repair<'_> {
    /// Enter blocks `[first, end)` in the activity log before a rewrite
    /// reaches a leg, flushing the mirror (as a client flush would: every
    /// leg, the written log told) if that is what makes room.
    fn enter_log(&self, first: u64, end: u64) -> Result<Option<Entered>> {
        self.written.enter(first, end, || {
            self.foreground.fetch_add(1, Ordering::Relaxed);
            self.legs.flush(self.written)
        })
    }

    /// `buf` at byte `offset` (any byte range) from `leg`, every faulty
    /// block repaired; fails naming the first block no leg holds good.
    /// `judged`: a fault `leg` already judged (and counted) on this read.
    /// No hole ranges (the bytes are right; they go as data).
    pub(crate) fn read_bytes_repairing(
        &self,
        leg: usize,
        offset: u64,
        buf: &mut [u8],
        judged: Option<Fault>,
    ) -> Result<Vec<std::ops::Range<u64>>> {
        let first = offset / BLOCK;
        let end = (offset + buf.len() as u64).div_ceil(BLOCK);
        let mut blocks = vec![0u8; ((end - first) * BLOCK) as usize];
        let faults = self.read_blocks_repairing(leg, first, end - first, &mut blocks, judged)?;
        if let Some(fault) = faults.first() {
            return Err(Error::Fault(fault.clone()));
        }
        let skip = (offset - first * BLOCK) as usize;
        buf.copy_from_slice(&blocks[skip..skip + buf.len()]);
        Ok(Vec::new())
    }

    /// `read_blocks_collecting` of `leg`, except the block of `judged` (a
    /// fault `leg` named on this read, counted and logged then): it is not
    /// read again, so it is not counted again; it is listed as faulty.
    fn read_leg_collecting(
        &self,
        leg: usize,
        first: u64,
        count: u64,
        out: &mut [u8],
        judged: Option<&Fault>,
    ) -> Result<Vec<Fault>> {
        let device = self.legs.device(leg);
        let Some(judged) = judged.filter(|fault| (first..first + count).contains(&fault.lba))
        else {
            return device.read_blocks_collecting(first, count, out);
        };
        let at = ((judged.lba - first) * BLOCK) as usize;
        let (before, rest) = out.split_at_mut(at);
        let (block, after) = rest.split_at_mut(BLOCK as usize);
        block.fill(0);
        let mut faults = Vec::new();
        if judged.lba > first {
            faults.extend(device.read_blocks_collecting(first, judged.lba - first, before)?);
        }
        faults.push(judged.clone());
        let rest = first + count - judged.lba - 1;
        if rest > 0 {
            faults.extend(device.read_blocks_collecting(judged.lba + 1, rest, after)?);
        }
        Ok(faults)
    }

    /// Whole blocks from `leg` (or, if it fails the read, from another
    /// active leg), each faulty one repaired; returns the faults no leg
    /// could repair (zero-filled in `out`). `judged`: as
    /// `read_bytes_repairing`.
    pub(crate) fn read_blocks_repairing(
        &self,
        leg: usize,
        first: u64,
        count: u64,
        out: &mut [u8],
        judged: Option<Fault>,
    ) -> Result<Vec<Fault>> {
        let mut read = None;
        for candidate in self.legs.read_order(leg) {
            let judged = judged.as_ref().filter(|_| candidate == leg);
            match self.read_leg_collecting(candidate, first, count, out, judged) {
                Ok(faults) => {
                    read = Some((candidate, faults));
                    break;
                }
                Err(error)
                    if self
                        .legs
                        .judge_read(candidate, &error, first, count, self.written) =>
                {
                    return Err(error)
                }
                Err(_) => {}
            }
        }
        let Some((base, faults)) = read else {
            return Err(Error::Fault(Fault {
                lba: first,
                kind: FaultKind::Unreadable,
            }));
        };
        let mut left = Vec::new();
        for fault in faults {
            let at = ((fault.lba - first) * BLOCK) as usize;
            match self.repair_block(fault.lba, base, fault.kind) {
                Ok(good) => out[at..at + BLOCK as usize].copy_from_slice(&good[..]),
                Err(Error::Fault(unrepaired)) => left.push(unrepaired),
                Err(error) => return Err(error),
            }
        }
        Ok(left)
    }

    /// The good contents of block `lba`, which failed with `kind` on leg
    /// `bad`, from another leg; the bad leg is rewritten from it.
    pub(crate) fn repair_block(&self, lba: u64, bad: usize, kind: FaultKind) -> Result<Box<Block>> {
        let _locked = self.stripes.lock(lba, lba + 1);
        let mut good: Box<Block> = Box::new([0u8; BLOCK as usize]);
        let source = self
            .legs
            .active()
            .into_iter()
            .filter(|&leg| leg != bad)
            .find(|&leg| {
                matches!(
                    self.legs.device(leg).read_blocks_collecting(lba, 1, &mut good[..]),
                    Ok(faults) if faults.is_empty()
                )
            });
        let Some(source) = source else {
            tracing::error!(
                lba,
                leg = bad,
                name = %self.legs[bad].name,
                kind = kind.name(),
                "mirror: block bad on every leg: not repaired, nothing rewritten"
            );
            self.legs.count(bad, kind.name(), false, self.written);
            return Err(Error::Fault(Fault { lba, kind }));
        };
        // A write may have replaced the block on the bad leg since it was
        // read (writes take the lock this holds now): then nothing to do.
        // Rechecked, not judged: the read that found it bad counted it.
        let mut now = [0u8; BLOCK as usize];
        if matches!(
            self.legs.device(bad).recheck_blocks(lba, 1, &mut now),
            Ok(faults) if faults.is_empty()
        ) {
            return Ok(good);
        }
        let repaired = self.rewrite(source, bad, lba, &good);
        if repaired {
            tracing::warn!(
                lba,
                leg = bad,
                name = %self.legs[bad].name,
                kind = kind.name(),
                source,
                "mirror: repaired a block from another leg"
            );
        } else {
            tracing::error!(
                lba,
                leg = bad,
                name = %self.legs[bad].name,
                kind = kind.name(),
                source,
                "mirror: repair failed: the leg still does not hold the good block"
            );
        }
        self.legs
            .count_at(bad, kind.name(), repaired, Some(lba), self.written);
        Ok(good)
    }

    /// `rewrite` of several blocks of one stripe at once: moved sealed
    /// from `source` to `target` in one write, one flush of `target`, then
    /// each re-read there; a batch that fails is retried block by block.
    /// Whether each now reads its `good` copy. The caller holds the
    /// stripe lock.
    pub(crate) fn rewrite_blocks(
        &self,
        source: usize,
        target: usize,
        lbas: &[u64],
        good: &[&[u8]],
    ) -> Vec<bool> {
        if let [lba] = lbas {
            return vec![self.rewrite(
                source,
                target,
                *lba,
                good[0].try_into().expect("one block"),
            )];
        }
        let step = || -> Result<Vec<bool>> {
            let sealed = self.legs.read_runs(source, lbas)?;
            let _logged = self.enter_log(lbas[0], lbas[lbas.len() - 1] + 1)?;
            self.legs.device(target).write_sealed(&sealed)?;
            self.legs.device(target).flush()?;
            let (first, end) = (lbas[0], lbas[lbas.len() - 1] + 1);
            let mut check = vec![0u8; ((end - first) * BLOCK) as usize];
            let faults = self
                .legs
                .device(target)
                .recheck_blocks(first, end - first, &mut check)?;
            Ok(lbas
                .iter()
                .zip(good)
                .map(|(&lba, good)| {
                    let at = ((lba - first) * BLOCK) as usize;
                    !faults.iter().any(|fault| fault.lba == lba)
                        && check[at..at + BLOCK as usize] == good[..]
                })
                .collect())
        };
        match step() {
            Ok(done) => done,
            Err(error) => {
                tracing::warn!(source, target, blocks = lbas.len(), %error,
                    "mirror: rewriting blocks together failed; one by one");
                lbas.iter()
                    .zip(good)
                    .map(|(&lba, good)| {
                        self.rewrite(source, target, lba, (*good).try_into().expect("one block"))
                    })
                    .collect()
            }
        }
    }

    /// Move block `lba` sealed from `source` to `target`, flush `target`
    /// and re-read it there: true if it now reads `good`. The caller holds
    /// the block's stripe lock.
    pub(crate) fn rewrite(&self, source: usize, target: usize, lba: u64, good: &Block) -> bool {
        let step = || -> Result<bool> {
            let sealed = self.legs.device(source).read_sealed(lba, 1)?;
            let _logged = self.enter_log(lba, lba + 1)?;
            self.legs.device(target).write_sealed(&sealed)?;
            self.legs.device(target).flush()?;
            let mut check = [0u8; BLOCK as usize];
            let faults = self
                .legs
                .device(target)
                .recheck_blocks(lba, 1, &mut check)?;
            Ok(faults.is_empty() && check[..] == good[..])
        };
        match step() {
            Ok(done) => done,
            Err(error) => {
                tracing::error!(lba, source, target, %error, "mirror: rewriting a block failed");
                false
            }
        }
    }
}
