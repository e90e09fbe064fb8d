//! Reading a reflink copy's source blocks from home, as committed (the
//! caller holds the source's committer lock): contexts, then data runs;
//! a block that cannot be read or whose context is corrupt is a fault
//! naming it.

use vouch_format::Context;

use crate::contexts::Lookup;
use crate::engine::Engine;
use crate::error::{Error, Fault, FaultKind, Result};
use crate::state::{context_in_page, load_context_page, BLOCK};
use crate::storage::ObjectId;

/// The contexts of blocks `[first, first + count)` of `engine` as committed
/// (the caller holds its committer lock). A context that cannot be read or
/// decoded is a fault of its block.
pub(super) fn source_contexts(engine: &Engine, first: u64, count: u64) -> Result<Vec<Context>> {
    let shared = engine.shared();
    // Under one short lock; pages not cached are loaded after it.
    let found: Vec<Lookup> = {
        let state = shared.state().read();
        (first..first + count)
            .map(|lba| state.contexts().lookup(lba))
            .collect()
    };
    let mut contexts = Vec::with_capacity(count as usize);
    let mut loaded: Option<(u64, crate::contexts::Page)> = None;
    for (lba, lookup) in (first..).zip(found) {
        let found = match lookup {
            Lookup::Found(found) => found,
            Lookup::NeedPage(page_no) => {
                let page = match &loaded {
                    Some((number, page)) if *number == page_no => page.clone(),
                    _ => match load_context_page(shared.io(), shared.state(), page_no) {
                        Ok(page) => {
                            loaded = Some((page_no, page.clone()));
                            page
                        }
                        Err(_) => return Err(fault(engine, lba, FaultKind::Unreadable)),
                    },
                };
                context_in_page(&page, lba)
            }
        };
        contexts.push(found.map_err(|_| fault(engine, lba, FaultKind::ContextCorrupt))?);
    }
    Ok(contexts)
}

/// Read the blocks with `contexts` (from `first`) from home into `out`:
/// zero-reading blocks are zero-filled without I/O, the rest read in runs.
/// A block that cannot be read is a fault naming it. Not verified here.
pub(super) fn read_data(
    engine: &Engine,
    first: u64,
    contexts: &[Context],
    out: &mut [u8],
) -> Result<()> {
    let shared = engine.shared();
    let geometry = shared.io().geometry;
    let mut index = 0usize;
    while index < contexts.len() {
        if contexts[index].reads_as_zero() {
            out[index * BLOCK as usize..(index + 1) * BLOCK as usize].fill(0);
            index += 1;
            continue;
        }
        let mut end = index + 1;
        while end < contexts.len()
            && !contexts[end].reads_as_zero()
            && geometry.contiguous(first + end as u64 - 1, first + end as u64)
        {
            end += 1;
        }
        let lba = first + index as u64;
        let run = &mut out[index * BLOCK as usize..end * BLOCK as usize];
        let location = geometry.locate(lba);
        let object = ObjectId::Data(location.segment);
        if shared
            .io()
            .try_read(object, location.data_offset, run)
            .is_err()
        {
            // Name the first block that cannot be read.
            for (offset, lba) in (lba..first + end as u64).enumerate() {
                let block = &mut run[offset * BLOCK as usize..(offset + 1) * BLOCK as usize];
                let at = geometry.locate(lba).data_offset;
                if shared.io().try_read(object, at, block).is_err() {
                    return Err(fault(engine, lba, FaultKind::Unreadable));
                }
            }
        }
        shared.io().stats.add_read(run.len() as u64);
        index = end;
    }
    Ok(())
}

/// A fault of a source block: counted, logged, and the copy's error.
pub(super) fn fault(engine: &Engine, lba: u64, kind: FaultKind) -> Error {
    engine.shared().io().stats.count_fault(kind);
    tracing::warn!(
        lba,
        kind = kind.name(),
        "copy source block failed verification"
    );
    Error::Fault(Fault { lba, kind })
}
