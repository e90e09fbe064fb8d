//! `cfg(sim_full)`: the simulator's tests run their full counts when the
//! code is optimised (release, and the `ci` profile, which is optimised
//! with debug assertions on) and smaller ones in an unoptimised build, where
//! the same work takes about twenty times longer. Debug assertions say
//! nothing about that, so the tests do not ask them.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(sim_full)");
    if std::env::var("OPT_LEVEL").is_ok_and(|level| level != "0") {
        println!("cargo::rustc-cfg=sim_full");
    }
    println!("cargo::rerun-if-changed=build.rs");
}
