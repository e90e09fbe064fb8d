//! The crash simulator's model of one volume's blocks: every value written
//! to each block, and which of them a crash may leave.

use std::sync::Arc;

use super::Allowed;
use crate::{fingerprint, BLOCK};

/// Per block: every value written to it (fingerprints, oldest first), the
/// oldest a power cut may leave (`floor`: the value as of the last flush
/// or FUA write that covered it) and the oldest a crash of the process
/// alone may leave (`acked`: its last acknowledged value). Values after
/// either are later writes, acknowledged or in flight.
pub(super) struct Model {
    pub(super) current: Vec<Vec<u8>>,
    versions: Vec<Vec<u64>>,
    floor: Vec<usize>,
    acked: Vec<usize>,
}

/// Each block's newest value when it was taken (`Model::newest`): what a
/// flush that started then makes durable.
pub(super) struct Mark(Vec<usize>);

impl Model {
    pub(super) fn new(blocks: u64) -> Model {
        let zero = fingerprint(&[0u8; BLOCK]);
        Model {
            current: vec![vec![0u8; BLOCK]; blocks as usize],
            versions: vec![vec![zero]; blocks as usize],
            floor: vec![0; blocks as usize],
            acked: vec![0; blocks as usize],
        }
    }

    pub(super) fn blocks(&self) -> u64 {
        self.current.len() as u64
    }

    /// Apply `data` (or zeros) over the byte range; returns the blocks touched.
    pub(super) fn apply(&mut self, offset: u64, len: u64, data: Option<&[u8]>) -> Vec<usize> {
        let mut touched = Vec::new();
        let mut at = offset;
        while at < offset + len {
            let lba = (at / BLOCK as u64) as usize;
            let within = (at % BLOCK as u64) as usize;
            let n = (BLOCK - within).min((offset + len - at) as usize);
            let block = &mut self.current[lba];
            match data {
                Some(data) => {
                    let from = (at - offset) as usize;
                    block[within..within + n].copy_from_slice(&data[from..from + n]);
                }
                None => block[within..within + n].fill(0),
            }
            let value = fingerprint(block);
            self.versions[lba].push(value);
            touched.push(lba);
            at += n as u64;
        }
        touched
    }

    /// Take back an `apply` of whole blocks that never happened (an inline
    /// write that declined with nothing written): `before` is what
    /// `current` held for the `touched` blocks.
    pub(super) fn undo(&mut self, touched: &[usize], before: Vec<Vec<u8>>) {
        for (lba, value) in touched.iter().zip(before) {
            self.versions[*lba].pop();
            self.current[*lba] = value;
        }
    }

    /// A copy of blocks `[from, from + count)` to `to` (memmove): each
    /// destination block takes the source block's value from before the copy.
    pub(super) fn copy(&mut self, from: u64, to: u64, count: u64) -> Vec<usize> {
        let values: Vec<Vec<u8>> = (from..from + count)
            .map(|lba| self.current[lba as usize].clone())
            .collect();
        let mut touched = Vec::with_capacity(count as usize);
        for (index, value) in values.into_iter().enumerate() {
            let lba = to as usize + index;
            self.versions[lba].push(fingerprint(&value));
            self.current[lba] = value;
            touched.push(lba);
        }
        touched
    }

    /// Every block's newest value now.
    pub(super) fn newest(&self) -> Mark {
        Mark(
            self.versions
                .iter()
                .map(|values| values.len() - 1)
                .collect(),
        )
    }

    /// The values `lba` has held since `mark` was taken (its value then
    /// first): what a read started at `mark` may return.
    pub(super) fn values_since(&self, mark: &Mark, lba: usize) -> &[u64] {
        &self.versions[lba][mark.0[lba]..]
    }

    /// A flush that started at `mark` made each block's value then durable.
    pub(super) fn durable_from(&mut self, mark: &Mark) {
        for (floor, at) in self.floor.iter_mut().zip(&mark.0) {
            *floor = (*floor).max(*at);
        }
    }

    /// A FUA operation on `blocks` returned: their newest values are
    /// durable (nothing else wrote them meanwhile: writers run at commit
    /// steps stay off the blocks of the operation in flight).
    pub(super) fn make_durable(&mut self, blocks: impl Iterator<Item = usize>) {
        for lba in blocks {
            self.floor[lba] = self.versions[lba].len() - 1;
        }
    }

    /// The operation that wrote `blocks` returned: their newest values are
    /// acknowledged.
    pub(super) fn make_acked(&mut self, blocks: impl Iterator<Item = usize>) {
        for lba in blocks {
            self.acked[lba] = self.versions[lba].len() - 1;
        }
    }

    /// What may be read after a crash of the process alone: the last
    /// acknowledged value of each block, or a later one (in flight).
    pub(super) fn allowed_process(&self) -> Arc<Allowed> {
        self.values_from(&self.acked)
    }

    /// What may be read after a power cut: the value as of the last flush
    /// or FUA write, or any later one.
    pub(super) fn allowed(&self) -> Arc<Allowed> {
        self.values_from(&self.floor)
    }

    /// Each block's values from index `oldest[block]` on.
    fn values_from(&self, oldest: &[usize]) -> Arc<Allowed> {
        Arc::new(
            self.versions
                .iter()
                .zip(oldest)
                .map(|(versions, oldest)| versions[*oldest..].to_vec())
                .collect(),
        )
    }
}
