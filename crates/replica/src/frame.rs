//! A request's bytes in pieces, so a write's block data is sent from where
//! it already is (the `BlockData` the NBD layer received) instead of being
//! copied into one buffer first: `head` holds every byte of the frame but
//! the blocks' data (the header, and each block's LBA and context), and
//! `data` says after which byte of `head` each block's data goes.
//! `to_vec` flattens it (the TLS path); `write_all` writes frames with
//! `writev` (the plain TCP path).

use std::io::{IoSlice, Write};

use vouch_engine::{BlockData, SealedBlock};

use crate::wire::{
    Op, RequestHeader, CONTEXT_BYTES, FLAG_FUA, REQUEST_HEADER_BYTES, WRITE_ENTRY_BYTES,
};

/// Slices one `writev` takes at most (Linux's `IOV_MAX` is 1024).
const MAX_SLICES: usize = 1024;

/// One request's frame (`wire::encode_request_frame`).
pub struct RequestFrame {
    pub head: Vec<u8>,
    /// `(end, data)`: the block's data follows `head[..end]`; ends ascend.
    pub data: Vec<(usize, BlockData)>,
}

impl RequestFrame {
    /// WRITE_SEALED: each block's LBA and context in `head`, its data
    /// shared, not copied.
    pub(crate) fn write_sealed(handle: u64, blocks: &[SealedBlock], fua: bool) -> RequestFrame {
        let header = RequestHeader {
            op: Op::WriteSealed,
            flags: if fua { FLAG_FUA } else { 0 },
            handle,
            offset: 0,
            length: blocks.len() as u64,
            payload_bytes: u32::try_from(blocks.len() * WRITE_ENTRY_BYTES)
                .expect("callers send at most MAX_BLOCKS_PER_REQUEST blocks"),
        };
        let mut head =
            Vec::with_capacity(REQUEST_HEADER_BYTES + blocks.len() * (8 + CONTEXT_BYTES));
        head.extend_from_slice(&header.encode());
        let mut data = Vec::with_capacity(blocks.len());
        for block in blocks {
            head.extend_from_slice(&block.lba.to_le_bytes());
            head.extend_from_slice(&block.context.encode());
            data.push((head.len(), block.data.clone()));
        }
        RequestFrame { head, data }
    }

    /// Bytes of the whole frame.
    pub fn len(&self) -> usize {
        self.head.len() + self.data.iter().map(|(_, data)| data.len()).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The frame as one buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        let mut at = 0;
        for (end, data) in &self.data {
            out.extend_from_slice(&self.head[at..*end]);
            out.extend_from_slice(&data[..]);
            at = *end;
        }
        out.extend_from_slice(&self.head[at..]);
        out
    }

    /// The frame's pieces in order (no empty ones), appended to `slices`.
    fn slices<'a>(&'a self, slices: &mut Vec<IoSlice<'a>>) {
        let mut at = 0;
        for (end, data) in &self.data {
            if *end > at {
                slices.push(IoSlice::new(&self.head[at..*end]));
            }
            slices.push(IoSlice::new(&data[..]));
            at = *end;
        }
        if self.head.len() > at {
            slices.push(IoSlice::new(&self.head[at..]));
        }
    }

    /// Write `frames` whole and in order to `out` (a blocking socket):
    /// `writev` of at most `MAX_SLICES` pieces at a time, resumed after
    /// short writes.
    pub fn write_all(out: &mut impl Write, frames: &[RequestFrame]) -> std::io::Result<()> {
        let mut slices = Vec::new();
        for frame in frames {
            frame.slices(&mut slices);
        }
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            let take = rest.len().min(MAX_SLICES);
            match out.write_vectored(&rest[..take]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(written) => IoSlice::advance_slices(&mut rest, written),
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }
}
