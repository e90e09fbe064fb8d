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
use vouch_engine::{BlockDevice, SealedDevice, Volume};

/// An active local leg as `with_legs_still` hands it over.
pub struct StillLeg<'a> {
    pub leg: usize,
    /// Its path (a local leg's name is its directory).
    pub name: &'a str,
    pub volume: &'a Volume,
}

/// An active remote leg as `with_legs_still` hands it over: its device
/// (the caller knows the replica client's type, `BlockDevice::as_any`).
pub struct StillRemote<'a> {
    pub leg: usize,
    /// Its URL.
    pub name: &'a str,
    pub device: &'a dyn BlockDevice,
}

impl Mirror {
    /// Run `enter` over every active leg with the mirror still (see the
    /// module), until `enter` calls its third argument (the release; the
    /// mirror is released when `enter` returns anyway): the local legs,
    /// then the remote ones. Refused while the legs may differ (reads on
    /// one leg: a reconciliation after an unclean stop runs, or a scrub
    /// is owed), and for a local leg that is no volume, naming it.
    pub fn with_legs_still<R>(
        &self,
        enter: impl FnOnce(&[StillLeg<'_>], &[StillRemote<'_>], &mut dyn FnMut()) -> Result<R>,
    ) -> Result<R> {
        let mut all = Some(self.stripes.lock_all());
        if self.reads_one_leg() {
            return Err(Error::InvalidArgument(
                "the mirror's legs may differ now (reads go to one leg: a reconciliation after an unclean stop is running, or a scrub is owed): take the snapshot once `vouch mirror status --server` shows every leg active (after a scrub, if one is owed)".into(),
            ));
        }
        let mut legs = Vec::new();
        let mut remote = Vec::new();
        for leg in self.active() {
            if self.legs[leg].remote {
                remote.push(StillRemote {
                    leg,
                    name: &self.legs[leg].name,
                    device: self.device(leg),
                });
                continue;
            }
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
        enter(&legs, &remote, &mut || drop(all.take()))
    }
}

impl Mirror {
    /// The device of leg `leg` when it is present (a remote leg's client,
    /// for its replica's snapshot requests).
    pub fn present_device(&self, leg: usize) -> Option<&dyn SealedDevice> {
        self.legs.get(leg)?.device.get().map(|device| &**device)
    }
}
