//! `Mirror::reconnect` refuses what it cannot do, by name: a leg that is
//! active, one that does not exist, and a leg whose device cannot
//! reconnect (a local volume: only remote legs lose a connection); and
//! `Mirror::new` refuses more legs than a set on disk can name.

use std::sync::Arc;
use vouch_engine::DeviceWrites;

use vouch_engine::{CreateOptions, Error, SealedDevice, SimStorage, Volume};
use vouch_mirror::{LegState, Mirror, MirrorLeg};

fn volume() -> Arc<dyn SealedDevice> {
    let volume = Volume::create(Arc::new(SimStorage::new()), &CreateOptions::new(64 * 4096))
        .expect("create");
    Arc::new(volume)
}

#[test]
fn reconnecting_an_active_missing_or_local_leg_is_refused_by_name() {
    let mirror = Mirror::new(
        vec![
            MirrorLeg {
                name: "zero".into(),
                device: Some(volume()),
                state: LegState::Active,
            },
            MirrorLeg {
                name: "one".into(),
                device: Some(volume()),
                state: LegState::Stale,
            },
            MirrorLeg {
                name: "two".into(),
                device: None,
                state: LegState::Stale,
            },
        ],
        None,
    )
    .expect("mirror");
    let message = |error: Error| error.to_string();
    let active = message(mirror.reconnect(0).expect_err("active"));
    assert!(active.contains("leg 0 (zero) is in use"), "{active}");
    let local = mirror.reconnect(1).expect_err("a local volume");
    assert!(matches!(local, Error::Unsupported(_)), "{local}");
    let missing = message(mirror.reconnect(2).expect_err("missing"));
    assert!(missing.contains("leg 2 (two) is missing"), "{missing}");
    let none = message(mirror.reconnect(3).expect_err("no such leg"));
    assert!(none.contains("no leg 3"), "{none}");
    assert_eq!(mirror.status()[1].state, LegState::Stale, "nothing changed");
}

/// A write's legs are a bitmask and their outcomes an array of
/// `MAX_LEGS` (`admit.rs`): a mirror of more legs is refused when built,
/// not found out of bounds by its first write.
#[test]
fn a_mirror_of_more_legs_than_a_set_can_name_is_refused() {
    let leg = |name: String| MirrorLeg {
        name,
        device: Some(volume()),
        state: LegState::Active,
    };
    let legs = |n: usize| (0..n).map(|i| leg(format!("leg{i}"))).collect();
    let max = vouch_format::mirror::MAX_LEGS;
    let Err(error) = Mirror::new(legs(max + 1), None) else {
        panic!("a mirror of {} legs is refused", max + 1);
    };
    assert!(matches!(error, Error::InvalidArgument(_)), "{error}");
    assert!(error.to_string().contains("at most 3 legs"), "{error}");
    let mirror = Mirror::new(legs(max), None).expect("a mirror of MAX_LEGS legs");
    mirror
        .write(0, &[7u8; 4096], false)
        .expect("written to every leg");
}
