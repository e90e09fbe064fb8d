//! `Mirror::resize_online` over real volume directories: after a grow,
//! a write past the old end is in the activity log on disk before it
//! reaches a leg (what a crash then leaves names its extent), and in the
//! written record (a leg lost then would be resynced there).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vouch_engine::snapshot::RealFs;
use vouch_engine::{
    open_volume, BlockDevice, CreateOptions, DeviceWrites, Error, OpenOptions, BLOCK,
};
use vouch_mirror as mirror;
use vouch_mirror::{create_mirror, open_mirror, MirrorResizeSteps, EXTENT_BLOCKS};

fn legs(dir: &Path) -> Vec<PathBuf> {
    let paths: Vec<PathBuf> = (0..2).map(|i| dir.join(format!("leg{i}"))).collect();
    create_mirror(&paths, &CreateOptions::new(8 << 20))
        .expect("create")
        .close()
        .expect("close");
    paths
}

#[test]
fn a_write_past_the_old_end_after_an_online_grow_is_in_the_new_activity_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = legs(dir.path());
    let (mirror, volumes) = open_mirror(&paths[0], true, &mut |leg| {
        open_volume(leg, &OpenOptions::foreground())
    })
    .expect("open set")
    .into_mirror(true)
    .expect("mirror");
    let record = mirror::set::read_record(&paths[0]).expect("record");
    let (log, _) = mirror::set::open_activity(&record, mirror.size() / BLOCK).expect("log");
    mirror.keep_activity_log(Arc::new(log)).expect("keep");
    mirror
        .write(0, &vec![7u8; BLOCK as usize], false)
        .expect("write before");

    let fs = RealFs::default();
    let resized = mirror
        .resize_online(
            16 << 20,
            MirrorResizeSteps {
                leg_files: &mut |leg, bytes| {
                    vouch_engine::resize::resize_mirror_leg(&fs, Path::new(leg), bytes).map(drop)
                },
                reopen: &|_, storage, geometry| {
                    storage
                        .reopen(geometry)
                        .map_err(|e| Error::InvalidArgument(e.to_string()))
                },
                new_log: &mut |blocks| {
                    mirror::set::open_activity(&record, blocks).map(|(log, _)| log)
                },
            },
        )
        .expect("resize");
    assert_eq!((resized.old_bytes, resized.new_bytes), (8 << 20, 16 << 20));
    assert_eq!(mirror.size(), 16 << 20);
    let blocks = mirror.size() / BLOCK;
    // The new log names nothing: the legs were flushed and closed.
    assert_eq!(
        mirror::set::peek_activity(&record, blocks).expect("peek"),
        mirror::Recovered::Extents(vec![])
    );
    // A write past the old end: its extent is on disk in the log of the
    // new size (a crash now reconciles it) and both legs hold it.
    let lba = 3 * EXTENT_BLOCKS + 5;
    mirror
        .write(lba * BLOCK, &vec![9u8; BLOCK as usize], false)
        .expect("write past the old end");
    assert_eq!(
        mirror::set::peek_activity(&record, blocks).expect("peek"),
        mirror::Recovered::Extents(vec![3])
    );
    for volume in volumes.iter().flatten() {
        let mut block = vec![0u8; BLOCK as usize];
        volume.read(lba * BLOCK, &mut block).expect("read a leg");
        assert_eq!(block, vec![9u8; BLOCK as usize]);
        volume.read(0, &mut block).expect("read a leg");
        assert_eq!(block, vec![7u8; BLOCK as usize]);
    }
    mirror.close_activity_log().expect("close the log");
    drop(mirror);
    for volume in volumes.into_iter().flatten() {
        Arc::try_unwrap(volume)
            .ok()
            .expect("sole owner")
            .close()
            .expect("close");
    }
}
