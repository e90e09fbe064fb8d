//! Helpers of the tests of volumes with regions (`vouch migrate`) that
//! are resized: their exported bytes, their record's layouts and size.

use std::path::Path;

use super::{info_json, s, vouch_ok};

/// The volume's bytes as `vouch export` writes them to `out`.
pub fn export_bytes(path: &Path, out: &Path) -> Vec<u8> {
    let _ = std::fs::remove_file(out);
    vouch_ok(&["export", s(path), s(out)]);
    std::fs::read(out).expect("read export")
}

/// The record's layouts, and the size both members' superblocks say
/// (they must agree, and `info` must say it too).
pub fn layouts_and_size(path: &Path) -> (Vec<String>, u64) {
    let info = info_json(path);
    let layouts = info["regions"]["layouts"]
        .as_array()
        .unwrap_or_else(|| panic!("no regions in info: {info}"))
        .iter()
        .map(|layout| layout.as_str().expect("a name").to_string())
        .collect();
    let home = vouch_engine::volume_superblock(path).expect("home superblock");
    let member = vouch_engine::regions::member_path(path, home.layout);
    let other = vouch_engine::volume_superblock(&member).expect("member superblock");
    assert_eq!(
        home.size_bytes, other.size_bytes,
        "the members say different sizes"
    );
    assert_eq!(info["size_bytes"].as_u64(), Some(home.size_bytes));
    (layouts, home.size_bytes)
}
