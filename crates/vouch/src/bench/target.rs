//! The thing under test: a plain file or an engine volume, behind the same
//! read / write / flush calls.

use std::fs::{File, OpenOptions as FsOpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use vouch_engine::DeviceWrites;

use anyhow::{Context as _, Result};
use vouch_engine::BlockDevice;
use vouch_engine::{create_volume, open_volume, CreateOptions, OpenOptions, StatsSnapshot, Volume};

use super::plan::Config;

pub(super) enum Target {
    Raw(File),
    Engine(Box<Volume>),
}

impl Target {
    pub(super) fn create(config: Config, path: &Path, size: u64, direct: bool) -> Result<Target> {
        Ok(match config {
            Config::Raw => {
                let file = FsOpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .custom_flags(if direct { libc::O_DIRECT } else { 0 })
                    .open(path)
                    .with_context(|| format!("cannot create {}", path.display()))?;
                file.set_len(size)?;
                Target::Raw(file)
            }
            Config::Engine(layout, guard) => {
                let mut options = CreateOptions::new(size);
                options.layout = layout;
                options.guard = guard;
                let volume = create_volume(path, &options)?;
                if !direct {
                    return Ok(Target::Engine(Box::new(volume)));
                }
                volume.close()?;
                let open = OpenOptions {
                    direct: true,
                    ..OpenOptions::default()
                };
                Target::Engine(Box::new(open_volume(path, &open)?))
            }
        })
    }

    pub(super) fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        match self {
            Target::Raw(file) => file.write_all_at(data, offset)?,
            Target::Engine(volume) => volume.write(offset, data, false)?,
        }
        Ok(())
    }

    pub(super) fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        match self {
            Target::Raw(file) => file.read_exact_at(buf, offset)?,
            Target::Engine(volume) => {
                volume.read(offset, buf)?;
            }
        }
        Ok(())
    }

    pub(super) fn flush(&self) -> Result<()> {
        match self {
            Target::Raw(file) => file.sync_data()?,
            Target::Engine(volume) => volume.flush()?,
        }
        Ok(())
    }

    pub(super) fn stats(&self) -> Option<StatsSnapshot> {
        match self {
            Target::Raw(_) => None,
            Target::Engine(volume) => Some(volume.stats().snapshot()),
        }
    }

    pub(super) fn close(self) -> Result<()> {
        if let Target::Engine(volume) = self {
            volume.close()?;
        }
        Ok(())
    }
}

pub(super) fn remove(path: &Path) -> Result<()> {
    if path.is_dir() {
        std::fs::remove_dir_all(path)?;
    } else {
        std::fs::remove_file(path)?;
    }
    Ok(())
}
