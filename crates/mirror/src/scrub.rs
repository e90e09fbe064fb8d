//! Scrub repair: every block that may hold data is read and verified on
//! every active leg, a scan chunk (1 MiB, ending on the legs' metadata
//! units: `jobs::ChunkWalk`) at a time under the mirror's stripe locks,
//! and every repairable fault repaired (`Mirror::rewrite`: sealed
//! block from a good leg, flush, re-read).
//!
//! Which copy is right, per block:
//! - legs whose copy fails verification are bad; if no leg verifies, the
//!   block is left (reported, nothing rewritten);
//! - if the verifying copies agree, they are the source;
//! - if they differ after an unclean shutdown (reads go to one leg until
//!   a scrub, `Mirror::read_one_leg_until_scrubbed`), the copy of the leg
//!   clients read wins, so a block never changes under a reader without a
//!   write (md resyncs from the disk it reads);
//! - otherwise, if they differ, the copy with the highest generation wins
//!   and the others are rewritten from it as `stale` (a lost write on one
//!   leg): every leg stores a write with the one generation the mirror
//!   stamped (`Mirror::admit`), so generations compare across legs; a copy
//!   claiming a generation above the mirror's clock is not believed; when
//!   that cannot decide (a hole against data, two different copies with
//!   the same generation) every copy is left as a `conflict`.

use std::path::Path;

use serde::Serialize;

use crate::device::Mirror;
use crate::legs::is_request_error;
use vouch_engine::error::{Error, FaultKind, Result};
use vouch_engine::jobs::{ChunkWalk, Cursor, CursorFile, JobControl, ScanEnd, ScanOptions};
use vouch_engine::scrub::ScrubOptions;
use vouch_engine::BLOCK;

/// Findings kept in a report; past this only the counts grow.
pub const MAX_FINDINGS: usize = 65536;

/// One bad copy a scrub found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub lba: u64,
    pub leg: usize,
    /// A `FaultKind` name, `stale` or `conflict`.
    pub kind: &'static str,
    pub repaired: bool,
}

/// What a mirror scrub found, repaired and left.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MirrorScrubReport {
    pub blocks_checked: u64,
    pub found: u64,
    pub repaired: u64,
    pub left: u64,
    pub findings: Vec<Finding>,
}

impl MirrorScrubReport {
    fn note(&mut self, finding: Finding) {
        self.found += 1;
        if finding.repaired {
            self.repaired += 1;
        } else {
            self.left += 1;
        }
        if self.findings.len() < MAX_FINDINGS {
            self.findings.push(finding);
        }
    }
}

/// The file in a leg's directory (the one a scrub was started from) that
/// keeps where a mirror scrub stands (`jobs::CursorFile`), so that a
/// cancelled or interrupted one resumes there.
pub const CURSOR_FILE: &str = "mirror.scrub.cursor";

/// The cursor of mirror scrubs started from the leg directory `dir`.
pub fn cursor_in(dir: &Path) -> CursorFile {
    CursorFile::new(dir.join(CURSOR_FILE))
}

/// Scrub every active leg of `mirror` from its first block, repairing
/// what can be repaired (`scrub_from`, with no cursor).
pub fn scrub(
    mirror: &Mirror,
    options: &ScrubOptions,
    control: &JobControl,
) -> Result<MirrorScrubReport> {
    scrub_from(mirror, options, control, None)
}

/// Scrub every active leg of `mirror`, repairing what can be repaired;
/// `control` reports progress and cancels (`Error::Cancelled`). A job
/// like any other: `jobs::scan`'s walk (`ChunkWalk`) over the chunks that
/// may hold data, on the grid of the legs' metadata units (a packed row
/// read once per leg), paced by `options` (its
/// rate, and backing off for foreground requests) with the waits counted
/// in `control`, and resumes from `cursor`, saved as it goes and when
/// cancelled. The report covers the blocks this run checked.
///
/// While reads go to one leg (the legs may differ after an unclean stop)
/// the cursor is cleared first: only a run over every block proves the
/// legs agree, and only such a run with nothing left sends reads to every
/// leg again.
pub fn scrub_from(
    mirror: &Mirror,
    options: &ScrubOptions,
    control: &JobControl,
    cursor: Option<&dyn Cursor>,
) -> Result<MirrorScrubReport> {
    if let Some(cursor) = cursor.filter(|_| mirror.reads_one_leg()) {
        cursor.clear()?;
    }
    let mut report = MirrorScrubReport::default();
    let scan = ScanOptions {
        rate_bytes_per_second: options.rate_bytes_per_second,
        foreground: options.foreground.clone(),
        ..ScanOptions::default()
    };
    let walk = ChunkWalk::begin(mirror, &scan, control, cursor)?;
    if walk.resumed() {
        tracing::info!(at = walk.at(), "mirror scrub: resuming from its cursor");
    }
    let whole = !walk.resumed();
    let ended = walk.run(|chunk| {
        mirror.scrub_chunk(chunk.start, chunk.end - chunk.start, &mut report, "stale")
    })?;
    if let ScanEnd::Cancelled { at } = ended {
        return Err(Error::Cancelled(format!(
            "mirror scrub cancelled at LBA {at}"
        )));
    }
    if report.left == 0 && whole {
        mirror.legs.legs_agree();
    }
    Ok(report)
}

impl Mirror {
    /// Check and repair blocks `[first, count)` on every active leg.
    /// Copies that verify but differ while reads go to one leg (after an
    /// unclean stop) are found as `divergence` (`stale` for a scrub,
    /// `reconcile` for the reconciliation of the activity log's extents)
    /// and not counted against the leg.
    pub(super) fn scrub_chunk(
        &self,
        first: u64,
        count: u64,
        report: &mut MirrorScrubReport,
        divergence: &'static str,
    ) -> Result<()> {
        let _locked = self.stripes.lock(first, first + count);
        let active = self.active();
        let read_leg = self
            .reads_one_leg()
            .then(|| active.first().copied())
            .flatten();
        let size = (count * BLOCK) as usize;
        let mut legs = Vec::with_capacity(active.len());
        let mut copies: Vec<Vec<u8>> = Vec::with_capacity(active.len());
        let mut faults: Vec<Vec<Option<FaultKind>>> = Vec::with_capacity(active.len());
        for leg in active {
            let mut data = vec![0u8; size];
            let mut kinds = vec![None; count as usize];
            match self
                .device(leg)
                .read_blocks_collecting(first, count, &mut data)
            {
                Ok(found) => {
                    for fault in found {
                        kinds[(fault.lba - first) as usize] = Some(fault.kind);
                    }
                }
                Err(error) if is_request_error(&error) => return Err(error),
                // A leg that cannot be reached is taken out (stale, its
                // map from the blocks written since the last flush), not
                // found unreadable block by block and "repaired" by
                // rewrites that cannot reach it either.
                Err(error @ Error::Unreachable(_)) => {
                    self.fail(leg, &format!("scrub read failed: {error}"), &error);
                    continue;
                }
                Err(error) => {
                    tracing::warn!(leg, first, count, %error, "mirror scrub: leg failed a read");
                    kinds.fill(Some(FaultKind::Unreadable));
                }
            }
            legs.push(leg);
            copies.push(data);
            faults.push(kinds);
        }
        report.blocks_checked += count;
        // (lba, source, target, kind), by position in `legs`: rewritten
        // after the chunk is judged, a batch per pair of legs (one flush).
        let mut repairs: Vec<(u64, usize, usize, &'static str)> = Vec::new();
        for index in 0..count as usize {
            let lba = first + index as u64;
            let block =
                |at: usize| &copies[at][index * BLOCK as usize..(index + 1) * BLOCK as usize];
            let good: Vec<usize> = (0..legs.len())
                .filter(|&at| faults[at][index].is_none())
                .collect();
            let mut targets: Vec<(usize, &'static str)> = (0..legs.len())
                .filter_map(|at| faults[at][index].map(|kind| (at, kind.name())))
                .collect();
            if good.is_empty() {
                for (at, kind) in targets {
                    tracing::error!(lba, leg = legs[at], kind, "mirror scrub: bad on every leg");
                    self.legs.count(legs[at], kind, false, &self.written);
                    report.note(Finding {
                        lba,
                        leg: legs[at],
                        kind,
                        repaired: false,
                    });
                }
                continue;
            }
            let mut source = good[0];
            if good.iter().any(|&at| block(at) != block(source)) {
                // After an unclean shutdown clients have read one leg only
                // (`read_one_leg_until_scrubbed`): its verifying copy wins,
                // as md resyncs from the disk it reads, so no block a
                // client has read changes under it. Otherwise the newest.
                let read_copy = good.iter().copied().find(|&at| read_leg == Some(legs[at]));
                match read_copy.or_else(|| self.newest(lba, &legs, &good, &block)) {
                    Some(winner) => {
                        source = winner;
                        targets.extend(good.iter().filter(|&&at| block(at) != block(winner)).map(
                            |&at| {
                                (
                                    at,
                                    if read_leg.is_some() {
                                        divergence
                                    } else {
                                        "stale"
                                    },
                                )
                            },
                        ));
                    }
                    None => {
                        for at in good.iter().copied().chain(targets.iter().map(|t| t.0)) {
                            tracing::error!(
                                lba,
                                leg = legs[at],
                                "mirror scrub: legs differ and no generation decides: left"
                            );
                            report.note(Finding {
                                lba,
                                leg: legs[at],
                                kind: "conflict",
                                repaired: false,
                            });
                        }
                        continue;
                    }
                }
            }
            repairs.extend(
                targets
                    .into_iter()
                    .map(|(at, kind)| (lba, source, at, kind)),
            );
        }
        // Legs that differ after an unclean shutdown (the copy clients
        // read decided) are the set's doing, not the leg's own errors:
        // rewritten in one batch per pair of legs (one flush). A leg's own
        // errors are rewritten one by one, each flushed and re-read.
        let crash_divergence = read_leg.is_some();
        let together = |kind: &str| crash_divergence && kind == divergence;
        let mut batches: Vec<Vec<(u64, &'static str)>> = Vec::new();
        let mut pairs: Vec<(usize, usize)> = Vec::new();
        for &(lba, source, target, kind) in &repairs {
            let last = pairs.iter().rposition(|&pair| pair == (source, target));
            match last {
                Some(at) if together(kind) && together(batches[at][0].1) => {
                    batches[at].push((lba, kind));
                }
                _ => {
                    pairs.push((source, target));
                    batches.push(vec![(lba, kind)]);
                }
            }
        }
        for ((source, target), batch) in pairs.into_iter().zip(batches) {
            let lbas: Vec<u64> = batch.iter().map(|b| b.0).collect();
            let good: Vec<&[u8]> = lbas
                .iter()
                .map(|&lba| {
                    let at = ((lba - first) * BLOCK) as usize;
                    &copies[source][at..at + BLOCK as usize]
                })
                .collect();
            let repaired = self
                .repair()
                .rewrite_blocks(legs[source], legs[target], &lbas, &good);
            for ((lba, kind), repaired) in batch.into_iter().zip(repaired) {
                let leg = legs[target];
                if !repaired {
                    tracing::error!(lba, leg, kind, "mirror scrub: repair failed");
                } else if kind == divergence && crash_divergence {
                    tracing::debug!(
                        lba,
                        leg,
                        kind,
                        source = legs[source],
                        "mirror scrub: repaired"
                    );
                } else {
                    tracing::warn!(
                        lba,
                        leg,
                        kind,
                        source = legs[source],
                        "mirror scrub: repaired"
                    );
                }
                if crash_divergence && kind == divergence {
                    self.note_repair(leg, kind, repaired);
                } else {
                    self.count_at(leg, kind, repaired, Some(lba));
                }
                report.note(Finding {
                    lba,
                    leg,
                    kind,
                    repaired,
                });
            }
        }
        Ok(())
    }

    /// Among the verifying copies `good` of block `lba`, the one with the
    /// highest generation, if that decides: every copy has a generation,
    /// and no copy with different bytes shares the highest.
    fn newest<'a>(
        &self,
        lba: u64,
        legs: &[usize],
        good: &[usize],
        block: &dyn Fn(usize) -> &'a [u8],
    ) -> Option<usize> {
        // The exporter's own record: no copy can be newer than the mirror's
        // clock (every write it stamped came from it). A copy claiming more
        // is not believed, whatever its checksums say.
        let clock = self.generation_clock();
        let mut generations = Vec::with_capacity(good.len());
        for &at in good {
            let sealed = self.device(legs[at]).read_sealed(lba, 1).ok()?;
            // A zero context's generation is its leg's own commit's, not
            // one this mirror stamped: it orders nothing between legs.
            let generation = match sealed.first()?.context {
                vouch_format::Context::Zero { .. } => 0,
                context => context.generation()?,
            };
            if clock < u64::from(u32::MAX) && u64::from(generation) > clock {
                tracing::error!(
                    lba,
                    leg = legs[at],
                    generation,
                    clock,
                    "mirror scrub: a copy claims a generation this mirror never stamped"
                );
                continue;
            }
            generations.push((at, generation));
        }
        let highest = generations.iter().map(|g| g.1).max()?;
        let winners: Vec<usize> = generations
            .iter()
            .filter(|g| g.1 == highest)
            .map(|g| g.0)
            .collect();
        let winner = winners[0];
        winners
            .iter()
            .all(|&at| block(at) == block(winner))
            .then_some(winner)
    }
}
