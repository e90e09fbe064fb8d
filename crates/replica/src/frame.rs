//! A request's bytes in pieces, so a write's block data is sent from where
//! it already is (the `BlockData` the NBD layer received) instead of being
//! copied into one buffer first: `head` holds every byte of the frame but
//! the blocks' data (the header, and each block's LBA and context), and
//! `data` says after which byte of `head` each block's data goes.
//! `to_vec` flattens it (the TLS path); `write_from` writes frames with
//! `writev`, resuming where an earlier write stopped (the plain TCP path).

use std::io::IoSlice;

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

    /// Bytes of `frames` together.
    pub fn total(frames: &[RequestFrame]) -> usize {
        frames.iter().map(RequestFrame::len).sum()
    }

    /// Write `frames` in order, from byte `from` of them on, with `write`
    /// (a `writev`: at most `MAX_SLICES` pieces at a time), resumed after
    /// short writes, until every byte is out or `write` would block.
    /// Returns how many bytes of `frames` are out in all (counted from
    /// their start, so `from` included): `RequestFrame::total(frames)`
    /// when done, fewer when `write` said `WouldBlock` (a send with
    /// `MSG_DONTWAIT` finding the socket full, or `SO_SNDTIMEO` running
    /// out on a blocking one).
    pub fn write_from(
        frames: &[RequestFrame],
        from: usize,
        mut write: impl FnMut(&[IoSlice<'_>]) -> std::io::Result<usize>,
    ) -> std::io::Result<usize> {
        assert!(
            from <= RequestFrame::total(frames),
            "resumed inside the frames"
        );
        let mut slices = Vec::new();
        for frame in frames {
            frame.slices(&mut slices);
        }
        let mut rest = &mut slices[..];
        IoSlice::advance_slices(&mut rest, from);
        let mut out = from;
        while !rest.is_empty() {
            let take = rest.len().min(MAX_SLICES);
            match write(&rest[..take]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(written) => {
                    IoSlice::advance_slices(&mut rest, written);
                    out += written;
                }
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => return Ok(out),
                Err(error) => return Err(error),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_request, encode_request_frame, Request, RequestHeader};
    use vouch_format::Context;

    /// Takes at most `step` bytes per call, as a socket under pressure may,
    /// refuses more than `IOV_MAX` slices, as Linux does, and would block
    /// once it took `room` bytes, as a full socket does.
    struct Trickle {
        out: Vec<u8>,
        step: usize,
        room: usize,
    }

    impl Trickle {
        fn new(step: usize, room: usize) -> Trickle {
            Trickle {
                out: Vec::new(),
                step,
                room,
            }
        }

        fn writev(&mut self, slices: &[IoSlice<'_>]) -> std::io::Result<usize> {
            if slices.len() > 1024 {
                return Err(std::io::ErrorKind::InvalidInput.into());
            }
            let most = self.step.min(self.room);
            if most == 0 {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            let mut n = 0;
            for slice in slices {
                let take = slice.len().min(most - n);
                self.out.extend_from_slice(&slice[..take]);
                n += take;
                if n == most {
                    break;
                }
            }
            self.room -= n;
            Ok(n)
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
        let frames = [write_copy(&write), write_copy(&flush)];
        let total = RequestFrame::total(&frames);
        assert_eq!(total, expected.len());
        for step in [1, 7, 40, 4096, 1 << 20] {
            let mut out = Trickle::new(step, usize::MAX);
            let sent = RequestFrame::write_from(&frames, 0, |slices| out.writev(slices));
            assert_eq!(sent.expect("write"), total);
            assert!(out.out == expected, "step {step}");
        }
        // A socket that fills after `room` bytes, each time: every write
        // resumes where the last stopped.
        for (step, room) in [(1, 1), (7, 13), (4096, 4095), (1 << 20, 5000)] {
            let mut out = Trickle::new(step, room);
            let mut sent = 0;
            while sent < total {
                out.room = room;
                let now = RequestFrame::write_from(&frames, sent, |slices| out.writev(slices));
                let now = now.expect("write");
                assert_eq!(now, total.min(sent + room), "step {step} room {room}");
                sent = now;
            }
            assert!(out.out == expected, "step {step} room {room}");
        }
        // And the bytes are the request.
        let header: [u8; REQUEST_HEADER_BYTES] =
            expected[..REQUEST_HEADER_BYTES].try_into().expect("header");
        let header = RequestHeader::decode(&header).expect("decode header");
        let end = REQUEST_HEADER_BYTES + header.payload_bytes as usize;
        match decode_request(
            &header,
            &bytes::Bytes::copy_from_slice(&expected[REQUEST_HEADER_BYTES..end]),
        )
        .expect("decode")
        {
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
        let mut out = Trickle::new(usize::MAX, usize::MAX);
        let sent =
            RequestFrame::write_from(std::slice::from_ref(&frame), 0, |slices| out.writev(slices));
        assert_eq!(sent.expect("write"), frame.len());
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
