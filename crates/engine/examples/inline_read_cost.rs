//! The cost of the read pipeline's routes per 4 KiB read of a block in the
//! page cache, for instruction and allocation counts (issue 30: one read
//! pipeline must cost the inline route nothing). Not a test.
//!
//! ```text
//! cargo build --profile ci -p vouch-engine --example inline_read_cost
//! valgrind --tool=callgrind target/ci/examples/inline_read_cost DIR ROUTE N   # and N = 0
//! valgrind --tool=dhat target/ci/examples/inline_read_cost DIR ROUTE N
//! ```
//! creates a 64 MiB volume of LAYOUT (`VT_LAYOUT`: split, the default, or
//! packed) in DIR (which must not exist), writes its first 256 blocks,
//! closes and reopens it, reads them once (loading their contexts), then
//! reads N blocks, one at a time, by ROUTE: `inline` (`try_read`, which
//! must answer each) or `worker` (`read`). The difference between the
//! counts of N and of 0 reads, divided by N, is the cost of one read.

use std::path::Path;
use vouch_engine::DeviceWrites;

use vouch_engine::{
    create_volume, open_volume, BlockDevice, CreateOptions, LayoutKind, OpenOptions, BLOCK,
};

const BLOCKS: u64 = 256;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, dir, route, reads] = &args[..] else {
        panic!("usage: inline_read_cost DIR inline|worker N");
    };
    let reads: u64 = reads.parse().expect("N");
    let mut options = CreateOptions::new(64 << 20);
    if std::env::var("VT_LAYOUT").as_deref() == Ok("packed") {
        options.layout = LayoutKind::Packed;
    }
    let path = Path::new(dir);
    let volume = create_volume(path, &options).expect("create");
    let data: Vec<u8> = (0..BLOCKS * BLOCK).map(|i| (i % 251) as u8).collect();
    volume.write(0, &data, false).expect("write");
    volume.close().expect("close");
    let volume = open_volume(path, &OpenOptions::default()).expect("open");
    let mut all = vec![0u8; (BLOCKS * BLOCK) as usize];
    volume.read(0, &mut all).expect("warm read");
    assert!(all == data, "read back as written");
    let mut block = vec![0u8; BLOCK as usize];
    for at in 0..reads {
        let offset = (at % BLOCKS) * BLOCK;
        match route.as_str() {
            "inline" => {
                let answered = volume.try_read(offset, &mut block).expect("try_read");
                assert!(answered.is_some(), "a cached block is answered inline");
            }
            "worker" => {
                volume.read(offset, &mut block).expect("read");
            }
            other => panic!("route {other}: inline or worker"),
        }
    }
    std::hint::black_box(&block);
    volume.close().expect("close");
}
