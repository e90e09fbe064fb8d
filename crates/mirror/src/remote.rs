//! Members of a mirror set that live elsewhere: a member whose path is a
//! `vouch://HOST:PORT/NAME` URL is a remote replica, reached through
//! another crate's `BlockDevice` (vouch-replica's `RemoteLeg`); the engine
//! only names them and makes the template a remote leg is created from.
//!
//! A remote member keeps no `mirror` record: the set's records live on its
//! local legs, and a remote member is identified by its volume's uuid,
//! which must be the set's (checked when it is opened).

use std::path::Path;

use vouch_format::Superblock;

use vouch_engine::error::{Error, Result};
use vouch_engine::storage::FileStorage;

/// The URL scheme of a remote member.
pub const REMOTE_SCHEME: &str = "vouch://";

/// Is this member path a remote replica's URL?
pub fn is_remote_member(path: &str) -> bool {
    path.starts_with(REMOTE_SCHEME)
}

/// What a new leg is made from: the superblock file of an existing leg
/// (both copies: same uuid, geometry, tags and key wrap) and its journal
/// size.
#[derive(Clone, Debug)]
pub struct LegTemplate {
    pub superblock: Vec<u8>,
    pub journal_bytes: u64,
}

/// Bytes of a volume's superblock file (two 4 KiB copies).
pub const SUPERBLOCK_FILE_BYTES: usize = 8192;

fn path_error(action: &'static str, path: &Path, cause: impl std::fmt::Display) -> Error {
    Error::Path {
        action,
        path: path.to_path_buf(),
        cause: cause.to_string(),
    }
}

impl LegTemplate {
    /// The template of the leg at `source`.
    pub fn of(source: &Path) -> Result<LegTemplate> {
        let file = source.join("superblock");
        let mut superblock =
            std::fs::read(&file).map_err(|error| path_error("read", &file, error))?;
        superblock.resize(SUPERBLOCK_FILE_BYTES, 0);
        let journal_bytes = std::fs::metadata(source.join("journal"))
            .map_err(|error| path_error("read", source, error))?
            .len();
        Ok(LegTemplate {
            superblock,
            journal_bytes,
        })
    }

    /// The newest valid superblock copy of the template.
    pub fn superblock(&self) -> Result<Superblock> {
        if self.superblock.len() != SUPERBLOCK_FILE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "a leg template's superblock is {SUPERBLOCK_FILE_BYTES} bytes, not {}",
                self.superblock.len()
            )));
        }
        let (first, second) = self.superblock.split_at(SUPERBLOCK_FILE_BYTES / 2);
        vouch_engine::superblock::select(first, second)
    }

    /// Create an empty leg at `target` (a new directory) from the
    /// template, ready to be filled with `write_sealed`; returns its
    /// superblock.
    pub fn create(&self, target: &Path) -> Result<Superblock> {
        let superblock = self.superblock()?;
        let geometry = superblock
            .geometry()
            .map_err(|error| Error::Corrupt(format!("leg template superblock: {error}")))?;
        if self.journal_bytes == 0 || self.journal_bytes > vouch_engine::MAX_VOLUME_BYTES {
            return Err(Error::InvalidArgument(format!(
                "leg template journal of {} bytes",
                self.journal_bytes
            )));
        }
        if target.exists() {
            return Err(path_error("create", target, "already exists"));
        }
        let result = (|| {
            drop(
                FileStorage::create(target, &geometry, self.journal_bytes)
                    .map_err(|error| path_error("create", target, error))?,
            );
            let file = target.join("superblock");
            std::fs::OpenOptions::new()
                .write(true)
                .open(&file)
                .and_then(|mut out| {
                    std::io::Write::write_all(&mut out, &self.superblock)?;
                    out.sync_all()
                })
                .map_err(|error| path_error("write", &file, error))
        })();
        if let Err(error) = result {
            let _ = std::fs::remove_dir_all(target);
            return Err(error);
        }
        Ok(superblock)
    }
}
