//! Engine errors: a small stable kind plus context (LBA, object, offset).

use std::io;

use crate::storage::ObjectId;

/// What was wrong with a block that failed verification.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// The data does not match the guard in its context.
    GuardMismatch,
    /// The context names another LBA (misdirected write or read).
    RefTagMismatch,
    /// The context belongs to another volume.
    VolumeTagMismatch,
    /// The context itself fails its checksum or is malformed.
    ContextCorrupt,
    /// The backing storage returned an error reading the block.
    Unreadable,
    /// Encrypted volumes: the block does not authenticate under the
    /// volume's key, uuid and its LBA (moved, swapped or forged).
    AuthFailed,
    /// The block was written but its protection information is gone: its
    /// context page or packed row reads as zeros (a file cut short,
    /// emptied or zeroed) where the written map says it was written.
    MetadataLost,
}

impl FaultKind {
    pub const ALL: [FaultKind; 7] = [
        FaultKind::GuardMismatch,
        FaultKind::RefTagMismatch,
        FaultKind::VolumeTagMismatch,
        FaultKind::ContextCorrupt,
        FaultKind::Unreadable,
        FaultKind::AuthFailed,
        FaultKind::MetadataLost,
    ];

    /// Stable snake_case name used in logs, JSON and metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::GuardMismatch => "guard_mismatch",
            FaultKind::RefTagMismatch => "ref_tag_mismatch",
            FaultKind::VolumeTagMismatch => "volume_tag_mismatch",
            FaultKind::ContextCorrupt => "context_corrupt",
            FaultKind::Unreadable => "unreadable",
            FaultKind::AuthFailed => "auth_failed",
            FaultKind::MetadataLost => "metadata_lost",
        }
    }
}

/// A verified-read failure: which block, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    pub lba: u64,
    pub kind: FaultKind,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LBA {} failed verification: {}",
            self.lba,
            self.kind.name()
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Fault(Fault),
    #[error("range {offset}+{length} is past the end of the volume ({size} bytes)")]
    OutOfRange { offset: u64, length: u64, size: u64 },
    #[error("range {offset}+{length} is not aligned to 512 bytes")]
    Misaligned { offset: u64, length: u64 },
    #[error("volume is read-only{0}")]
    ReadOnly(String),
    #[error("volume stopped accepting writes after an earlier I/O error ({0}); reopen it")]
    FailStopped(String),
    /// Like `FailStopped`, after the backing filesystem (or the held log's
    /// tmpfs) ran out of space: clients are told ENOSPC, the one answer a
    /// hypervisor pauses a guest on (qemu's `werror=enospc`) instead of
    /// failing its I/O.
    #[error(
        "volume stopped accepting writes when the disk filled ({0}); free space and reopen it"
    )]
    StoppedFull(String),
    #[error("no space left on the backing filesystem ({object:?} at {offset}); nothing acknowledged was lost")]
    NoSpace { object: ObjectId, offset: u64 },
    /// The held log (`held.rs`) failed an I/O: a write it could not take
    /// was not acknowledged (and the volume fail-stops).
    #[error("cannot {op} the held log (where acknowledged writes wait for their commit, in memory that survives a crash of this process; the volume's `held` file names it): {cause}; this write was not acknowledged, nothing acknowledged was lost")]
    HeldLog { op: &'static str, cause: io::Error },
    #[error("I/O error {op} {object:?} at {offset}: {cause}")]
    Io {
        op: &'static str,
        object: ObjectId,
        offset: u64,
        cause: io::Error,
    },
    /// The volume's on-disk structures are not what vouch writes (both
    /// superblock copies invalid, an impossible journal record).
    #[error("{0}")]
    Corrupt(String),
    /// An encrypted volume's key is missing, malformed or wrong.
    #[error("{0}")]
    Key(String),
    /// The volume uses features this build does not implement.
    #[error("{0}")]
    Unsupported(String),
    /// A job (verify, compare, copy) was cancelled through its
    /// `JobControl`; the message says how far it got.
    #[error("{0}")]
    Cancelled(String),
    /// A remote device (a replica) could not be reached, or its connection
    /// failed or timed out mid-request: the device, not the request, is at
    /// fault, and it stays unreachable until it is opened again.
    #[error("{0}")]
    Unreachable(String),
    /// A caller asked for something impossible (a size, a geometry).
    #[error("{0}")]
    InvalidArgument(String),
    /// A volume directory could not be created or opened.
    #[error("cannot {action} {}: {cause}", path.display())]
    Path {
        action: &'static str,
        path: std::path::PathBuf,
        cause: String,
    },
    /// An error about the volume at `path`.
    #[error("{}: {source}", path.display())]
    InVolume {
        path: std::path::PathBuf,
        source: Box<Error>,
    },
}

impl Error {
    /// Name the volume directory an error happened in.
    pub fn in_volume(self, path: &std::path::Path) -> Error {
        Error::InVolume {
            path: path.to_path_buf(),
            source: Box::new(self),
        }
    }

    pub fn fault(&self) -> Option<&Fault> {
        match self {
            Error::Fault(fault) => Some(fault),
            _ => None,
        }
    }

    /// Whether this error says the backing storage is full.
    pub fn is_no_space(&self) -> bool {
        match self {
            Error::NoSpace { .. } | Error::StoppedFull(_) => true,
            Error::HeldLog { cause, .. } => cause.raw_os_error() == Some(libc::ENOSPC),
            _ => false,
        }
    }

    /// An I/O error with context; ENOSPC becomes `NoSpace`.
    pub fn io(op: &'static str, object: ObjectId, offset: u64, source: io::Error) -> Error {
        if source.raw_os_error() == Some(libc::ENOSPC) {
            Error::NoSpace { object, offset }
        } else {
            Error::Io {
                op,
                object,
                offset,
                cause: source,
            }
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
