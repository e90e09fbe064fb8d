//! The mirror held still for a snapshot of its legs
//! (`vouch_engine::snapshot::create_legs`): every stripe held, so no
//! write, trim, zeroing, repair or resync copy is in flight and none
//! starts, while the caller enters each active leg's flush point; then
//! released, so clients' writes go on into the legs' write-back buffers
//! while the legs' files are cloned. Every write acknowledged before is
//! then on every active leg, and no later one on any: one flush point
//! for the set.

use crate::device::Mirror;
use vouch_engine::error::{Error, Result};
use vouch_engine::Volume;

/// An active leg as `with_legs_still` hands it over.
pub struct StillLeg<'a> {
    pub leg: usize,
    /// Its path (a local leg's name is its directory).
    pub name: &'a str,
    pub volume: &'a Volume,
}

impl Mirror {
    /// Run `enter` over every active leg with the mirror still (see the
    /// module), until `enter` calls its second argument (the release; the
    /// mirror is released when `enter` returns anyway). Refused while the
    /// legs may differ (reads on one leg: a reconciliation after an unclean
    /// stop runs, or a scrub is owed), and for a leg that is no local
    /// volume (a remote replica takes no snapshot), naming it.
    pub fn with_legs_still<R>(
        &self,
        enter: impl FnOnce(&[StillLeg<'_>], &mut dyn FnMut()) -> Result<R>,
    ) -> Result<R> {
        if let Some(leg) = self.legs.iter().position(|leg| leg.remote) {
            return Err(Error::Unsupported(format!(
                "mirror leg {leg} ({}) is a remote replica: the replica protocol takes no snapshots, so a snapshot of this mirror would miss that leg's copy; remove the leg (`vouch mirror remove`), take the snapshot, and add it again, or take snapshots of a mirror of local legs",
                self.legs[leg].name
            )));
        }
        let mut all = Some(self.stripes.lock_all());
        if self.reads_one_leg() {
            return Err(Error::InvalidArgument(
                "the mirror's legs may differ now (reads go to one leg: a reconciliation after an unclean stop is running, or a scrub is owed): take the snapshot once `vouch mirror status --server` shows every leg active (after a scrub, if one is owed)".into(),
            ));
        }
        let mut legs = Vec::new();
        for leg in self.active() {
            let volume = self
                .device(leg)
                .as_any()
                .and_then(|any| any.downcast_ref::<Volume>())
                .ok_or_else(|| {
                    Error::Unsupported(format!(
                        "mirror leg {leg} ({}) is not a local volume: it takes no snapshot",
                        self.legs[leg].name
                    ))
                })?;
            legs.push(StillLeg {
                leg,
                name: &self.legs[leg].name,
                volume,
            });
        }
        enter(&legs, &mut || drop(all.take()))
    }
}
