//! Byte buffers that start on a page boundary, for bulk reads from the
//! page cache.
//!
//! The kernel copies page-cache pages several times faster into a buffer
//! that starts on a page than into one that starts 16 bytes into it, as a
//! large `Vec<u8>` from malloc does. Measured here: a 4 GiB scrub spent
//! 2.5-3 s of system time in `_copy_to_iter` with malloc'd 1 MiB buffers,
//! 0.7 s with page-aligned ones (`dd` spends 0.34 s).

use std::ops::{Deref, DerefMut};

/// A zero-initialised byte buffer whose first byte is page-aligned.
#[derive(Default)]
pub struct PageBuffer {
    raw: Vec<u8>,
    offset: usize,
    len: usize,
}

impl PageBuffer {
    const ALIGN: usize = 4096;

    /// A buffer of `len` zero bytes.
    pub fn new(len: usize) -> PageBuffer {
        let mut buffer = PageBuffer::default();
        buffer.set_len(len);
        buffer
    }

    /// Make it `len` bytes long, reallocating only when it must grow. The
    /// contents are unspecified (left from earlier use, or zero): callers
    /// overwrite them.
    pub fn set_len(&mut self, len: usize) {
        if self.raw.len() < len + Self::ALIGN {
            self.raw = vec![0u8; len + Self::ALIGN];
            let address = self.raw.as_ptr() as usize;
            self.offset = address.next_multiple_of(Self::ALIGN) - address;
        }
        self.len = len;
    }
}

impl Deref for PageBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.raw[self.offset..self.offset + self.len]
    }
}

impl DerefMut for PageBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.offset..self.offset + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_buffer_starts_on_a_page_and_keeps_its_length() {
        let mut buffer = PageBuffer::new(3 * 4096 + 5);
        assert_eq!(buffer.as_ptr() as usize % 4096, 0);
        assert_eq!(buffer.len(), 3 * 4096 + 5);
        assert!(buffer.iter().all(|byte| *byte == 0));
        buffer[0] = 7;
        buffer.set_len(4096);
        assert_eq!(buffer.len(), 4096);
        assert_eq!(buffer[0], 7, "shrinking keeps the allocation");
        buffer.set_len(1 << 20);
        assert_eq!(buffer.as_ptr() as usize % 4096, 0);
        assert_eq!(buffer.len(), 1 << 20);
    }
}
