//! Offline verification of every written block (`vouch check`), also the
//! reader behind `export`. Holes are skipped with SEEK_DATA, so a sparse
//! 16 TiB volume checks in time proportional to what was written.

use vouch_format::layout::{PACKED_RECORDS_PER_ROW, PACKED_ROW_BYTES};
use vouch_format::{LayoutKind, CONTEXT_BYTES};

use crate::error::{Error, Fault, Result};
use crate::storage::ObjectId;
use crate::volume::{Core, BLOCK};

/// Blocks verified per read while checking (1 MiB).
pub const CHECK_CHUNK_BLOCKS: u64 = 256;

#[derive(Clone, Debug, Default)]
pub struct CheckReport {
    /// Blocks examined (holes skipped without I/O are not counted).
    pub blocks_checked: u64,
    pub faults: Vec<Fault>,
}

impl Core {
    /// Verify every block that may hold data. `progress(done, total)` is
    /// called after each chunk, in blocks.
    pub fn check(&self, mut progress: impl FnMut(u64, u64)) -> Result<CheckReport> {
        let total = self.geometry.blocks;
        let mut report = CheckReport::default();
        let mut buffer = vec![0u8; (CHECK_CHUNK_BLOCKS * BLOCK) as usize];
        let mut lba = 0;
        while lba < total {
            lba = self.next_possible_data(lba)?;
            if lba >= total {
                break;
            }
            let count = (total - lba).min(CHECK_CHUNK_BLOCKS - lba % CHECK_CHUNK_BLOCKS);
            let out = &mut buffer[..(count * BLOCK) as usize];
            report
                .faults
                .extend(self.read_blocks_collecting(lba, count, out)?);
            report.blocks_checked += count;
            lba += count;
            progress(lba, total);
        }
        progress(total, total);
        Ok(report)
    }

    /// The first LBA at or after `lba` whose data or context may be written:
    /// chunks that are holes on disk and have nothing pending are skipped.
    pub fn next_possible_data(&self, lba: u64) -> Result<u64> {
        {
            let state = self.state.read();
            let pending = state.active.range(lba..).next().map(|(l, _)| *l);
            let overlay = state.contexts.next_overlay(lba);
            if pending == Some(lba) || overlay == Some(lba) {
                return Ok(lba);
            }
        }
        let found = match self.geometry.layout {
            LayoutKind::Split => {
                let offset = lba * CONTEXT_BYTES as u64;
                self.seek_data(ObjectId::Contexts, offset)?
                    .map(|at| at / CONTEXT_BYTES as u64)
            }
            LayoutKind::Packed => {
                let mut result = None;
                let mut segment_first = lba;
                while segment_first < self.geometry.blocks {
                    let location = self.geometry.locate(segment_first);
                    let base = segment_first - segment_first % self.geometry.segment_blocks;
                    if let Some(at) =
                        self.seek_data(ObjectId::Data(location.segment), location.data_offset)?
                    {
                        let row_lba = base + (at / PACKED_ROW_BYTES) * PACKED_RECORDS_PER_ROW;
                        result = Some(row_lba.max(segment_first));
                        break;
                    }
                    segment_first = base + self.geometry.segment_blocks;
                }
                result
            }
        };
        let state = self.state.read();
        let pending = [
            state.active.range(lba..).next().map(|(l, _)| *l),
            state.contexts.next_overlay(lba),
            found,
        ];
        let next = pending
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(self.geometry.blocks);
        // Round down to a chunk boundary so chunks stay aligned.
        Ok((next - next % CHECK_CHUNK_BLOCKS).max(lba))
    }

    fn seek_data(&self, object: ObjectId, offset: u64) -> Result<Option<u64>> {
        self.storage
            .next_data(object, offset)
            .map_err(|error| Error::io("seek", object, offset, error))
    }
}
