//! The files of volumes in the model filesystem of `vouch-sim snapshot`
//! (`ModelFs`) and on real files: loaded, written out, written back, a
//! superblock read, an image compared; random writes through a device
//! (`resize_regions`, `resize_mirror`).

use std::path::{Path, PathBuf};

use vouch_engine::{BlockDevice, DeviceWrites};

use crate::rng::Rng;
use crate::snapshot::{ModelFs, Node};
use crate::BLOCK;

const BLOCK_U64: u64 = BLOCK as u64;

/// `check` of `device` finds nothing.
pub(crate) fn check_clean(device: &dyn BlockDevice) -> Result<(), String> {
    let check = vouch_engine::check::check(device, |_, _| {}).map_err(|e| format!("check: {e}"))?;
    match check.faults.first() {
        Some(fault) => Err(format!(
            "check: {} faults, the first {fault:?}",
            check.faults.len()
        )),
        None => Ok(()),
    }
}

/// Random blocks of `range` (and `last` always) written through `device`
/// into `image` (not flushed: the resize's close or flush must keep
/// them).
pub(crate) fn write_some(
    device: &dyn BlockDevice,
    image: &mut [u8],
    rng: &mut Rng,
    range: std::ops::Range<u64>,
    last: u64,
) -> Result<(), String> {
    let lbas: Vec<u64> = (0..rng.range(1, 8))
        .map(|_| rng.range(range.start, range.end - 1))
        .chain([last])
        .collect();
    for lba in lbas {
        let data = rng.bytes(BLOCK);
        device
            .write(lba * BLOCK_U64, &data, false)
            .map_err(|e| format!("write LBA {lba}: {e}"))?;
        image[(lba * BLOCK_U64) as usize..((lba + 1) * BLOCK_U64) as usize].copy_from_slice(&data);
    }
    Ok(())
}

/// Every file under `dir` (a real directory) into `fs` at `root`,
/// durable.
pub(crate) fn load_under(fs: &mut ModelFs, dir: &Path, root: &Path) -> Result<(), String> {
    fs.put_dir(root);
    let mut pending = vec![PathBuf::new()];
    while let Some(relative) = pending.pop() {
        let entries = std::fs::read_dir(dir.join(&relative)).map_err(|e| e.to_string())?;
        for entry in entries {
            let entry = entry.map_err(|e| e.to_string())?;
            let name = relative.join(entry.file_name());
            let to = root.join(&name);
            if entry.file_type().map_err(|e| e.to_string())?.is_dir() {
                fs.put_dir(&to);
                pending.push(name);
            } else {
                let bytes = std::fs::read(entry.path()).map_err(|e| e.to_string())?;
                fs.put_file(&to, bytes);
            }
        }
    }
    fs.sync_all_dirs();
    Ok(())
}

/// Every file under `root` in `fs` written out under `to` (sparse),
/// which must not exist, or whose files are rewritten in place.
pub(crate) fn write_out_of(fs: &ModelFs, root: &Path, to: &Path) -> Result<(), String> {
    use std::os::unix::fs::FileExt as _;
    let root = fs.lookup(root).ok_or("no volume directory")?;
    let mut pending = vec![(root, to.to_path_buf())];
    while let Some((id, path)) = pending.pop() {
        match &fs.nodes[id] {
            Node::Dir { live, .. } => {
                std::fs::create_dir_all(&path).map_err(|e| e.to_string())?;
                for (name, child) in live {
                    pending.push((*child, path.join(name)));
                }
            }
            Node::File { live, .. } => {
                let file = std::fs::File::create(&path).map_err(|e| e.to_string())?;
                file.set_len(live.len() as u64).map_err(|e| e.to_string())?;
                for (index, page) in live.chunks(4096).enumerate() {
                    if page.iter().any(|byte| *byte != 0) {
                        file.write_all_at(page, index as u64 * 4096)
                            .map_err(|e| e.to_string())?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// `read` is `image` (zeros past it).
pub(crate) fn reads_as(read: &[u8], image: &[u8]) -> Result<(), String> {
    let zeros = vec![0u8; BLOCK];
    for (lba, got) in read.chunks(BLOCK).enumerate() {
        let want = image.get(lba * BLOCK..(lba + 1) * BLOCK).unwrap_or(&zeros);
        if got != want {
            return Err(format!("LBA {lba} reads other data"));
        }
    }
    Ok(())
}

/// The superblock of the volume in `dir` of `fs`.
pub(crate) fn superblock_in(fs: &ModelFs, dir: &Path) -> Result<vouch_format::Superblock, String> {
    let path = dir.join(vouch_engine::ObjectId::Superblock.file_name());
    let mut both = fs
        .bytes(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .to_vec();
    both.resize(8192, 0);
    vouch_engine::superblock::select(&both[..4096], &both[4096..])
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// `write_back` of the files under `root` in `fs` over `to`.
pub(crate) fn write_back_of(fs: &ModelFs, root: &Path, to: &Path) -> Result<(), String> {
    let mut pending = vec![PathBuf::new()];
    while let Some(relative) = pending.pop() {
        let entries = std::fs::read_dir(to.join(&relative)).map_err(|e| e.to_string())?;
        for entry in entries {
            let entry = entry.map_err(|e| e.to_string())?;
            let name = relative.join(entry.file_name());
            if entry.file_type().map_err(|e| e.to_string())?.is_dir() {
                pending.push(name);
            } else if fs.lookup(&root.join(&name)).is_none() {
                std::fs::remove_file(entry.path()).map_err(|e| e.to_string())?;
            }
        }
    }
    write_out_of(fs, root, to)
}
