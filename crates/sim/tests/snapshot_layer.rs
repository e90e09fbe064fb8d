//! The fenced snapshot (`vouch-sim snapshot-fenced`) and the overlay
//! snapshot with its delete (`vouch-sim snapshot-overlay`), each driven
//! by the engine's own code with writes racing it and crashed before
//! every write, sync and file operation (a process crash and two kinds of
//! power cut each): the volume keeps every acknowledged or flushed write,
//! a published snapshot holds exactly the data at its flush point, an
//! overlay reads so again after the recovered volume is written, FENCED
//! never outlives the next open. A home write issued before its image is
//! synced, and (fenced) the last image written back instead of the first,
//! are caught.

use vouch_sim::snapshot_layer::{run, summary, LayerConfig, Route};
use vouch_sim::LayoutKind;

fn config(route: Route, layout: LayoutKind) -> LayerConfig {
    LayerConfig {
        route,
        layout,
        seeds: 1,
        seed: 1,
        break_image_order: false,
        break_last_image: false,
    }
}

/// A break is caught when a violation of its seed says `what`.
fn caught(broken: LayerConfig, what: &str, break_name: &str) {
    let layer = run(&broken);
    assert!(
        layer.report.violations.iter().any(|v| v.contains(what)),
        "{break_name} went unseen: {}",
        summary(&layer, &broken)
    );
}

#[test]
fn a_crash_during_a_fenced_snapshot_keeps_the_volume_and_the_flush_point() {
    for layout in LayoutKind::ALL {
        let config = config(Route::Fenced, layout);
        let layer = run(&config);
        eprintln!("{}", summary(&layer, &config));
        assert!(
            layer.report.violations.is_empty()
                && layer.report.images > 3 * 100
                && layer.published > 0
                && layer.armed_writes > 0,
            "{}\n{}",
            layer.report.violations.join("\n"),
            summary(&layer, &config)
        );
    }
    caught(
        LayerConfig {
            break_image_order: true,
            ..config(Route::Fenced, LayoutKind::Split)
        },
        "the snapshot: LBA",
        "a home write issued before its image is synced",
    );
    caught(
        LayerConfig {
            break_last_image: true,
            ..config(Route::Fenced, LayoutKind::Split)
        },
        "the snapshot: LBA",
        "the last image written back",
    );
}

#[test]
fn a_crash_during_an_overlay_snapshot_or_its_delete_keeps_the_volume_and_the_overlay() {
    for layout in LayoutKind::ALL {
        let config = config(Route::Overlay, layout);
        let layer = run(&config);
        eprintln!("{}", summary(&layer, &config));
        assert!(
            layer.report.violations.is_empty()
                && layer.report.images > 3 * 60
                && layer.published > 0
                && layer.armed_writes > 0,
            "{}\n{}",
            layer.report.violations.join("\n"),
            summary(&layer, &config)
        );
    }
    caught(
        LayerConfig {
            break_image_order: true,
            ..config(Route::Overlay, LayoutKind::Split)
        },
        "the overlay after",
        "a home write issued before its image is synced",
    );
}
