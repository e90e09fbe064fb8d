//! The blocks a before-image log has imaged (`storage/before.rs`): one bit
//! per 4 KiB block of each imaged object, and the index that persists them
//! beside an overlay snapshot's log (docs/FORMAT.md, "Imaged-block
//! index"), so a writable open reads the index and only the log's records
//! appended after it, not the whole log.
//!
//! The index only ever says less than the log: it is written after the
//! records it covers are durable, names the log's fence, the bytes of
//! records it covers (`covered`, a record boundary) and a checksum of the
//! log's bytes just before that boundary. An index that is missing, torn,
//! of another fence, longer than the log, or whose checksum of the log
//! does not match is not used: the log is read from its start. A block
//! the index lacks is imaged again by its next write (a second image the
//! reader never uses: the first wins); a block it claimed without a
//! durable record would be written home without its image, which the
//! rules above exclude.

use std::collections::BTreeMap;
use std::io;

use super::ObjectId;

/// The unit of the set: the log's `IMAGE_BLOCK`.
const BLOCK: u64 = 4096;

/// The object kinds a record or the index names (a record's `kind` byte).
pub(crate) const KIND_CONTEXTS: u8 = 1;
pub(crate) const KIND_DATA: u8 = 2;
pub(crate) const KIND_WRITTEN: u8 = 3;

pub(crate) fn kind_of(object: ObjectId) -> (u8, u32) {
    match object {
        ObjectId::Contexts => (KIND_CONTEXTS, 0),
        ObjectId::Data(segment) => (KIND_DATA, segment),
        ObjectId::Written => (KIND_WRITTEN, 0),
        other => unreachable!("{other:?} is never imaged"),
    }
}

pub(crate) fn object_of(kind: u8, segment: u32) -> Option<ObjectId> {
    match (kind, segment) {
        (KIND_CONTEXTS, 0) => Some(ObjectId::Contexts),
        (KIND_DATA, segment) => Some(ObjectId::Data(segment)),
        (KIND_WRITTEN, 0) => Some(ObjectId::Written),
        _ => None,
    }
}

/// Blocks imaged, one bit per 4 KiB block of each object up to the
/// highest imaged: memory bounded by the volume's size (32 KiB per GiB),
/// not by how many blocks were rewritten.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImagedSet {
    bits: BTreeMap<ObjectId, Vec<u64>>,
    count: usize,
}

impl ImagedSet {
    /// Count the block at byte `offset` of `object` imaged.
    pub fn insert(&mut self, object: ObjectId, offset: u64) {
        let block = offset / BLOCK;
        let words = self.bits.entry(object).or_default();
        let word = (block / 64) as usize;
        if words.len() <= word {
            words.resize(word + 1, 0);
        }
        let bit = 1u64 << (block % 64);
        if words[word] & bit == 0 {
            words[word] |= bit;
            self.count += 1;
        }
    }

    /// Is the block at byte `offset` of `object` imaged?
    pub fn contains(&self, object: ObjectId, offset: u64) -> bool {
        let block = offset / BLOCK;
        self.bits
            .get(&object)
            .and_then(|words| words.get((block / 64) as usize))
            .is_some_and(|word| word & (1 << (block % 64)) != 0)
    }

    /// Blocks imaged.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Bytes its bits take.
    pub fn memory_bytes(&self) -> usize {
        self.bits.values().map(|words| words.len() * 8).sum()
    }
}

/// An index's first 4 bytes: "VBX1".
pub const INDEX_MAGIC: u32 = 0x3158_4256;
/// The index's header, before its objects.
pub const INDEX_HEADER_BYTES: usize = 40;
/// The log bytes just before `covered` whose CRC32C the index keeps.
pub const INDEX_TAIL_BYTES: u64 = 4096;

/// The index header's fields: (name, offset, size), as docs/FORMAT.md's
/// table "Imaged-block index" lists them.
pub const INDEX_FIELDS: &[(&str, usize, usize)] = &[
    ("magic", 0, 4),
    ("objects", 4, 4),
    ("fence", 8, 8),
    ("covered", 16, 8),
    ("tail_crc", 24, 4),
    ("reserved", 28, 4),
    ("crc", 32, 4),
    ("reserved2", 36, 4),
];

/// The index of `set` for the log of `fence` whose first `covered` bytes
/// are the records it holds, `tail_crc` the CRC32C of the log's last
/// `INDEX_TAIL_BYTES` (or fewer) bytes before `covered`.
pub fn encode_index(fence: u64, covered: u64, tail_crc: u32, set: &ImagedSet) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(INDEX_HEADER_BYTES + set.memory_bytes() + 16 * 8);
    bytes.extend_from_slice(&INDEX_MAGIC.to_le_bytes());
    bytes.extend_from_slice(&(set.bits.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&fence.to_le_bytes());
    bytes.extend_from_slice(&covered.to_le_bytes());
    bytes.extend_from_slice(&tail_crc.to_le_bytes());
    bytes.extend_from_slice(&[0; 12]); // reserved, crc, reserved2
    for (&object, words) in &set.bits {
        let (kind, segment) = kind_of(object);
        bytes.push(kind);
        bytes.extend_from_slice(&[0; 3]);
        bytes.extend_from_slice(&segment.to_le_bytes());
        bytes.extend_from_slice(&(words.len() as u64).to_le_bytes());
        for word in words {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
    }
    let crc = crc32c::crc32c(&bytes);
    bytes[32..36].copy_from_slice(&crc.to_le_bytes());
    bytes
}

/// An index read back: the log bytes it covers, the checksum of the log
/// before them, and its set.
#[derive(Debug, PartialEq, Eq)]
pub struct Index {
    pub covered: u64,
    pub tail_crc: u32,
    pub set: ImagedSet,
}

/// The index in `bytes` if it is whole and of `fence`; `None` otherwise.
pub fn decode_index(bytes: &[u8], fence: u64) -> Option<Index> {
    let header = bytes.get(..INDEX_HEADER_BYTES)?;
    let u32_at = |from: usize| u32::from_le_bytes(bytes[from..from + 4].try_into().unwrap());
    let u64_at = |from: usize| u64::from_le_bytes(bytes[from..from + 8].try_into().unwrap());
    if u32_at(0) != INDEX_MAGIC || u64_at(8) != fence {
        return None;
    }
    let mut zeroed = bytes.to_vec();
    zeroed[32..36].fill(0);
    if crc32c::crc32c(&zeroed) != u32_at(32) || header[28..32] != [0; 4] {
        return None;
    }
    let mut set = ImagedSet::default();
    let mut at = INDEX_HEADER_BYTES;
    for _ in 0..u32_at(4) {
        bytes.get(at..at + 16)?;
        let object = object_of(bytes[at], u32_at(at + 4))?;
        let words = usize::try_from(u64_at(at + 8)).ok()?;
        at += 16;
        let end = at.checked_add(words.checked_mul(8)?)?;
        let words: Vec<u64> = bytes
            .get(at..end)?
            .chunks_exact(8)
            .map(|word| u64::from_le_bytes(word.try_into().unwrap()))
            .collect();
        set.count += words
            .iter()
            .map(|word| word.count_ones() as usize)
            .sum::<usize>();
        if set.bits.insert(object, words).is_some() {
            return None;
        }
        at = end;
    }
    (at == bytes.len()).then_some(Index {
        covered: u64_at(16),
        tail_crc: u32_at(24),
        set,
    })
}

/// Where an armed layer keeps its index (the file `imaged` beside an
/// overlay's log), or none.
pub trait IndexStore: Send + Sync {
    /// The index's bytes; `None` when there is none.
    fn load(&self) -> io::Result<Option<Vec<u8>>>;
    /// Replace the index with `bytes`, durably and atomically (the old
    /// one or the new, never a mix).
    fn save(&self, bytes: &[u8]) -> io::Result<()>;
}

/// The index as a file `path`: saved as `path.tmp`, synced, renamed over.
pub struct IndexFile {
    pub path: std::path::PathBuf,
}

impl IndexStore for IndexFile {
    fn load(&self) -> io::Result<Option<Vec<u8>>> {
        match std::fs::read(&self.path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(error),
        }
    }
    fn save(&self, bytes: &[u8]) -> io::Result<()> {
        use std::io::Write as _;
        let tmp = self.path.with_extension("tmp");
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, &self.path)
    }
}

/// An index in memory (tests and the crash simulator).
#[derive(Clone, Default)]
pub struct SimIndex {
    pub bytes: std::sync::Arc<parking_lot::Mutex<Option<Vec<u8>>>>,
}

impl IndexStore for SimIndex {
    fn load(&self) -> io::Result<Option<Vec<u8>>> {
        Ok(self.bytes.lock().clone())
    }
    fn save(&self, bytes: &[u8]) -> io::Result<()> {
        *self.bytes.lock() = Some(bytes.to_vec());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_md_describes_the_index_header_the_code_writes() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/FORMAT.md"))
                .expect("docs/FORMAT.md");
        let start = doc
            .find("### Imaged-block index")
            .expect("FORMAT.md has the index's table");
        let rows: Vec<(String, usize, usize)> = doc[start..]
            .lines()
            .skip(1)
            .take_while(|line| !line.starts_with('#'))
            .filter(|line| line.starts_with('|'))
            .filter_map(|line| {
                let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
                Some((
                    cells[2].to_string(),
                    cells[0].parse().ok()?,
                    cells[1].parse().ok()?,
                ))
            })
            .collect();
        let fields: Vec<(String, usize, usize)> = INDEX_FIELDS
            .iter()
            .map(|&(name, offset, size)| (name.to_string(), offset, size))
            .collect();
        assert_eq!(rows, fields);
        let last = INDEX_FIELDS.last().unwrap();
        assert_eq!(last.1 + last.2, INDEX_HEADER_BYTES);
        let mut set = ImagedSet::default();
        set.insert(ObjectId::Data(2), 4096 * 3);
        let bytes = encode_index(9, 4136, 0xabcd, &set);
        let field = |name: &str| {
            let &(_, offset, size) = INDEX_FIELDS.iter().find(|f| f.0 == name).unwrap();
            let mut word = [0u8; 8];
            word[..size].copy_from_slice(&bytes[offset..offset + size]);
            u64::from_le_bytes(word)
        };
        assert_eq!(field("magic"), u64::from(INDEX_MAGIC));
        assert_eq!(field("objects"), 1);
        assert_eq!(field("fence"), 9);
        assert_eq!(field("covered"), 4136);
        assert_eq!(field("tail_crc"), 0xabcd);
        // The entry and its one word: block 3 set.
        assert_eq!(bytes[INDEX_HEADER_BYTES], KIND_DATA);
        assert_eq!(bytes[INDEX_HEADER_BYTES + 4], 2);
        assert_eq!(bytes[INDEX_HEADER_BYTES + 8], 1);
        assert_eq!(bytes[INDEX_HEADER_BYTES + 16], 0b1000);
        assert_eq!(bytes.len(), INDEX_HEADER_BYTES + 16 + 8);
    }

    #[test]
    fn an_index_reads_back_and_any_damage_is_refused() {
        let mut set = ImagedSet::default();
        for (object, offset) in [
            (ObjectId::Data(0), 0),
            (ObjectId::Data(0), 4096 * 130),
            (ObjectId::Data(3), 4096 * 7),
            (ObjectId::Contexts, 4096),
            (ObjectId::Written, 0),
        ] {
            set.insert(object, offset);
        }
        set.insert(ObjectId::Data(0), 0);
        assert_eq!(set.len(), 5);
        assert!(set.contains(ObjectId::Data(0), 4096 * 130 + 17));
        assert!(!set.contains(ObjectId::Data(0), 4096 * 129));
        assert!(!set.contains(ObjectId::Data(1), 0));
        let bytes = encode_index(77, 1234, 99, &set);
        let index = decode_index(&bytes, 77).expect("reads back");
        assert_eq!((index.covered, index.tail_crc), (1234, 99));
        assert_eq!(index.set, set);
        assert!(decode_index(&bytes, 78).is_none(), "another fence");
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x10;
            assert!(decode_index(&bad, 77).is_none(), "byte {at} flipped");
        }
        for len in 0..bytes.len() {
            assert!(decode_index(&bytes[..len], 77).is_none(), "cut at {len}");
        }
    }
}
