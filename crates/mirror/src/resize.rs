//! A served mirror resized in place (`vouch resize --server`, the control
//! API; docs/CRASH_MODEL.md, "Online resize of a mirror"): every leg
//! local, active and present; none read alone (a reconciliation or an
//! owed scrub refuses it). Beside the write path: it holds every stripe
//! (`Stripes::lock_all`: no write, trim, zeroing, repair or resync copy in
//! flight, none starts), flushes the mirror (every write acknowledged is
//! durable on every leg), then resizes the legs with the one-volume online
//! resize (`Volume::resize_online`), nested so that every leg's engine is
//! closed cleanly before any leg's files change and none is opened again
//! before all of them have the new size:
//!
//! 1. each leg's engine closed cleanly (its own shrink check first: a
//!    written tail refuses the resize, naming its LBA, before any file
//!    changes);
//! 2. each leg's files resized in turn (`steps.leg_files`: the offline
//!    `resize_mirror_leg`, its own crash ordering); one that fails puts
//!    those already resized back to the old size;
//! 3. the activity log started again at the new size in every leg's
//!    directory, naming nothing (`steps.new_log`: the legs were flushed
//!    and closed with nothing in flight, so they agree);
//! 4. each leg's engine opened again; the mirror takes the new size, the
//!    new log, and the written record's new end (`written.rs`); released.
//!
//! A crash in 2 leaves every leg closed cleanly, some at the new size:
//! the next open refuses legs of different sizes (`Mirror::new` and
//! `set.rs`, naming both sizes) and `vouch resize PATH SIZE` (offline)
//! resizes those that lack it. A crash in 3 or 4 leaves every leg at the
//! new size: the log of the old size is no log for the new one, and the
//! legs were closed cleanly (nothing to reconcile); after 3, the new log
//! names nothing and a leg opened again has had nothing written. A step
//! that fails after a leg's files changed with the legs left apart (the
//! old size could not be put back), or without the new log, opens no leg
//! again: each fails its requests (fail-stop) until the server restarts,
//! so the mirror never serves legs of different sizes.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Instant;

use vouch_engine::device::BlockDevice;
use vouch_engine::error::{Error, Result};
use vouch_engine::storage::Storage;
use vouch_engine::volume::{OnlineResized, ResizeSteps};
use vouch_engine::{Volume, BLOCK};
use vouch_format::mirror::LegState;
use vouch_format::Geometry;

use crate::activity::ActivityLog;
use crate::device::Mirror;

/// What an online resize of a mirror asks of its caller.
pub struct MirrorResizeSteps<'a> {
    /// The files of the leg at directory `name` (its engine closed
    /// cleanly) resized to `bytes`: `resize::resize_mirror_leg`.
    pub leg_files: &'a mut dyn FnMut(&str, u64) -> Result<()>,
    /// The storage of leg `name` opened again for a geometry (sharing
    /// the old storage's lock: `Storage::reopen`).
    pub reopen: &'a ReopenLeg<'a>,
    /// The activity log started for `blocks` blocks in every leg's
    /// directory, naming nothing (`set::open_activity`); asked only when
    /// the mirror keeps one.
    pub new_log: &'a mut dyn FnMut(u64) -> Result<ActivityLog>,
}

/// The storage of a leg (its directory) opened again for a geometry.
pub type ReopenLeg<'a> = dyn Fn(&str, &dyn Storage, &Geometry) -> Result<Arc<dyn Storage>> + 'a;

impl Mirror {
    /// Resize this served mirror to `new_bytes` (see the module).
    /// Connections keep the size they negotiated; new ones get the new
    /// size.
    pub fn resize_online(
        &self,
        new_bytes: u64,
        steps: MirrorResizeSteps<'_>,
    ) -> Result<OnlineResized> {
        if self.is_read_only() {
            return Err(Error::ReadOnly(
                "the mirror is read-only: it is not resized".into(),
            ));
        }
        let asked = Instant::now();
        let all = self.stripes.lock_all();
        let waited = asked.elapsed();
        let locked = Instant::now();
        let legs = self.resizable_legs()?;
        let old_bytes = self.size();
        let resized = |held| OnlineResized {
            old_bytes,
            new_bytes,
            waited,
            held,
        };
        if new_bytes == old_bytes {
            return Ok(resized(locked.elapsed()));
        }
        // Every write acknowledged is durable on every leg.
        BlockDevice::flush(self)?;
        if new_bytes < old_bytes {
            // New requests past the new end are refused from here on.
            self.legs.set_size(new_bytes);
        }
        let stop = Cell::new(false);
        let mut log = None;
        let keeps_log = self.written.activity_log().is_some();
        let MirrorResizeSteps {
            leg_files,
            reopen,
            new_log,
        } = steps;
        let mut files = || -> Result<()> {
            let mut done: Vec<&str> = Vec::new();
            for (name, _) in &legs {
                if let Err(error) = leg_files(name, new_bytes) {
                    for name in done {
                        if let Err(back) = leg_files(name, old_bytes) {
                            tracing::error!(leg = name, %back, "mirror resize: a leg could not be put back to the old size");
                            stop.set(true);
                        }
                    }
                    return Err(error);
                }
                done.push(name);
            }
            if keeps_log {
                match new_log(new_bytes / BLOCK) {
                    Ok(started) => log = Some(started),
                    Err(error) => {
                        stop.set(true);
                        return Err(error);
                    }
                }
            }
            Ok(())
        };
        let reopen = |name: &str, storage: &dyn Storage, geometry: &Geometry| {
            if stop.get() {
                return Err(Error::InvalidArgument(format!(
                    "mirror leg {name} is not opened again: the legs' sizes may differ (restart the server; if it refuses the legs' sizes, `vouch resize PATH SIZE` gives every leg the size)"
                )));
            }
            reopen(name, storage, geometry)
        };
        let outcome = nest(&legs, new_bytes, &reopen, &mut files);
        if let Err(error) = outcome {
            if !stop.get() {
                self.legs.set_size(old_bytes);
            }
            return Err(error);
        }
        self.written.set_blocks(new_bytes / BLOCK);
        if let Some(log) = log {
            self.written.replace_activity_log(Arc::new(log));
        }
        self.legs.set_size(new_bytes);
        drop(all);
        Ok(resized(locked.elapsed()))
    }

    /// Every leg, as (directory, volume): refused unless each is local,
    /// active and present, and the legs agree (reads on every leg).
    fn resizable_legs(&self) -> Result<Vec<(&str, &Volume)>> {
        if self.reads_one_leg() {
            return Err(Error::InvalidArgument(
                "the mirror's legs may differ now (reads go to one leg: a reconciliation after an unclean stop is running, or a scrub is owed): resize it once `vouch mirror status --server` shows every leg active (after a scrub, if one is owed)".into(),
            ));
        }
        let mut legs = Vec::new();
        for (index, leg) in self.legs.iter().enumerate() {
            if leg.remote {
                return Err(Error::Unsupported(format!(
                    "mirror leg {index} ({}) is remote: the replica protocol has no resize; remove it (`vouch mirror remove`), resize the mirror, then add it again",
                    leg.name
                )));
            }
            let state = leg.state();
            let volume = leg
                .device
                .get()
                .and_then(|device| device.as_any())
                .and_then(|any| any.downcast_ref::<Volume>());
            match volume {
                Some(volume) if state == LegState::Active => legs.push((leg.name.as_str(), volume)),
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "mirror leg {index} ({}) is {}: every leg must be active to be resized (let its resync finish, or `vouch mirror replace` it, first)",
                        leg.name,
                        if leg.device.get().is_none() { "missing" } else { state.name() }
                    )))
                }
            }
        }
        Ok(legs)
    }
}

/// `legs[0]`'s engine closed, then the rest's (`nest` again, inside its
/// files step), then `files`, then each opened again, innermost first.
fn nest(
    legs: &[(&str, &Volume)],
    new_bytes: u64,
    reopen: &ReopenLeg<'_>,
    files: &mut dyn FnMut() -> Result<()>,
) -> Result<()> {
    let Some(((name, volume), rest)) = legs.split_first() else {
        return files();
    };
    volume
        .resize_online(
            new_bytes,
            ResizeSteps {
                files: &mut |_| nest(rest, new_bytes, reopen, files),
                reopen: &mut |storage, geometry| reopen(name, storage, geometry),
            },
        )
        .map(drop)
}
