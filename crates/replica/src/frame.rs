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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_request, encode_request_frame, Request, RequestHeader};
    use vouch_format::Context;

    /// Takes at most `step` bytes per call, as a socket under pressure may,
    /// and refuses more than `IOV_MAX` slices, as Linux does.
    struct Trickle {
        out: Vec<u8>,
        step: usize,
    }

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let n = buf.len().min(self.step);
            self.out.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn write_vectored(&mut self, slices: &[IoSlice<'_>]) -> std::io::Result<usize> {
            if slices.len() > 1024 {
                return Err(std::io::ErrorKind::InvalidInput.into());
            }
            let mut n = 0;
            for slice in slices {
                let take = slice.len().min(self.step - n);
                self.out.extend_from_slice(&slice[..take]);
                n += take;
                if n == self.step {
                    break;
                }
            }
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn blocks(count: u64) -> Vec<SealedBlock> {
        (0..count)
            .map(|lba| SealedBlock {
                lba: 100 + lba,
                data: BlockData::copy_from(&[lba as u8 ^ 0x5a; 4096]),
                context: Context::Data {
                    volume_tag: 7,
                    ref_tag: 100 + lba,
                    guard: 0x1234,
                    generation: 3,
                },
            })
            .collect()
    }

    #[test]
    fn frames_written_in_short_pieces_are_the_encoded_bytes_in_order() {
        let write = encode_request_frame(
            9,
            &Request::WriteSealed {
                blocks: blocks(3),
                fua: true,
            },
        );
        let flush = encode_request_frame(10, &Request::Flush);
        let mut expected = write.to_vec();
        expected.extend_from_slice(&flush.to_vec());
        for step in [1, 7, 40, 4096, 1 << 20] {
            let mut out = Trickle {
                out: Vec::new(),
                step,
            };
            let frames = [write_copy(&write), write_copy(&flush)];
            RequestFrame::write_all(&mut out, &frames).expect("write");
            assert!(out.out == expected, "step {step}");
        }
        // And the bytes are the request.
        let header: [u8; REQUEST_HEADER_BYTES] =
            expected[..REQUEST_HEADER_BYTES].try_into().expect("header");
        let header = RequestHeader::decode(&header).expect("decode header");
        let end = REQUEST_HEADER_BYTES + header.payload_bytes as usize;
        match decode_request(&header, &expected[REQUEST_HEADER_BYTES..end]).expect("decode") {
            Request::WriteSealed { blocks: got, fua } => {
                assert!(fua);
                assert_eq!(got.len(), 3);
                for (got, sent) in got.iter().zip(blocks(3)) {
                    assert_eq!((got.lba, got.context), (sent.lba, sent.context));
                    assert!(got.data[..] == sent.data[..]);
                }
            }
            other => panic!("decoded {other:?}"),
        }
    }

    /// More slices than one `writev` takes: 600 blocks are 1200 slices.
    #[test]
    fn a_frame_of_more_slices_than_one_writev_takes_goes_out_whole() {
        let frame = RequestFrame::write_sealed(1, &blocks(600), false);
        let mut out = Trickle {
            out: Vec::new(),
            step: usize::MAX,
        };
        RequestFrame::write_all(&mut out, std::slice::from_ref(&frame)).expect("write");
        assert!(out.out == frame.to_vec());
        assert_eq!(
            out.out.len(),
            REQUEST_HEADER_BYTES + 600 * WRITE_ENTRY_BYTES
        );
    }

    fn write_copy(frame: &RequestFrame) -> RequestFrame {
        RequestFrame {
            head: frame.head.clone(),
            data: frame.data.clone(),
        }
    }
}
