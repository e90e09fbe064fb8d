//! `Mirror::reconnect` refuses what it cannot do, by name: a leg that is
//! active, one that does not exist, and a leg whose device cannot
//! reconnect (a local volume: only remote legs lose a connection).

use std::sync::Arc;

use vouch_engine::{BlockDevice, CreateOptions, Error, SimStorage, Volume};
use vouch_mirror::{LegState, Mirror, MirrorLeg};

fn volume() -> Arc<dyn BlockDevice> {
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
