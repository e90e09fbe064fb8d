//! `vouch-sim`: crash simulator, fault injector and detection matrix.

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use vouch_sim::crash::{CrashConfig, Tearing};
use vouch_sim::faults::{self, FaultConfig};
use vouch_sim::{parse_guard, parse_layout, GuardKind, LayoutKind};

#[derive(Parser)]
#[command(
    name = "vouch-sim",
    about = "Prove the vouch contract: crash images, fault injection, detection matrix"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The layout and seeds of a simulator that runs one layout.
#[derive(Args)]
struct LayoutSeeds {
    #[arg(long, default_value = "split")]
    layout: String,
    #[arg(long, default_value_t = 20)]
    seeds: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Subcommand)]
enum Command {
    /// Random workloads; recover and check every post-crash image.
    Crash {
        #[arg(long, default_value = "split")]
        layout: String,
        #[arg(long, default_value = "crc32c")]
        guard: String,
        #[arg(long, default_value_t = 100)]
        seeds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value = "none")]
        tearing: String,
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Encrypted volumes (the guard is crc32c).
        #[arg(long)]
        encrypted: bool,
    },
    /// Crash `vouch snapshot create`, `vouch clone` and `vouch snapshot
    /// delete` before every file operation (a process crash and two power
    /// cuts each): a snapshot or clone that has its name is complete, the
    /// volume is untouched, and the command run again finishes.
    Snapshot {
        #[command(flatten)]
        run: LayoutSeeds,
        /// Break the ordering on purpose: publish the snapshot's name
        /// before its files are synced (the run must find violations).
        #[arg(long)]
        break_publish: bool,
        /// A volume with regions (migrated to the other layout, its
        /// member `layout.NAME/` and region record in every snapshot).
        #[arg(long)]
        regions: bool,
        /// A mirror of two local legs: `create_legs` (each leg's copy at
        /// one flush point) and the delete of every leg's copy.
        #[arg(long, conflicts_with = "regions")]
        legs: bool,
    },
    /// Crash the online `snapshot create` of a served volume (writes
    /// acknowledged in its buffer, some flushed; the flush point's commit
    /// and checkpoint, the clones, the syncs and the publishing rename)
    /// before every write, sync and file operation (a process crash and
    /// two power cuts each): the volume keeps every acknowledged (process
    /// crash) or flushed (power cut) write, a snapshot that has its name
    /// holds exactly the data at the flush point, and the create run again
    /// finishes.
    SnapshotOnline {
        #[command(flatten)]
        run: LayoutSeeds,
        /// Break the ordering on purpose: publish the snapshot's name
        /// before its files are synced (the run must find violations).
        #[arg(long)]
        break_publish: bool,
        /// Break on purpose: clone the volume's files outside the flush
        /// point (no commit, no checkpoint; the run must find violations).
        #[arg(long)]
        break_outside: bool,
        /// A served volume with regions whose region moves to the other
        /// layout and back while it is written, the snapshot taken at a
        /// step of the moves (both members and the record at one flush
        /// point).
        #[arg(long)]
        regions: bool,
        /// With --regions, break on purpose: hold only the home member at
        /// the flush point (the run must find violations).
        #[arg(long, requires = "regions")]
        break_home_only: bool,
    },
    /// Crash the fenced online snapshot (xfs, btrfs: the fence and the
    /// before-image layer armed at the flush point, then the snapshot
    /// materialised beside the served volume, writes racing both) before
    /// every write, sync and file operation (a process crash and two power
    /// cuts each): the volume keeps every acknowledged (process crash) or
    /// flushed (power cut) write, the open materialises a fence left, a
    /// published snapshot holds exactly the data at the flush point, one
    /// not published is absent or marked failed, FENCED is gone after the
    /// open.
    SnapshotFenced {
        #[command(flatten)]
        run: LayoutSeeds,
        /// Break the ordering on purpose: issue a home write before its
        /// before-image is synced (the run must find violations).
        #[arg(long)]
        break_image_order: bool,
        /// Break on purpose: write each block's last before-image back
        /// instead of its first (the run must find violations).
        #[arg(long)]
        break_last_image: bool,
    },
    /// Crash the overlay snapshot (filesystems that cannot clone: a fence
    /// and the before-image log kept for the snapshot's life), its create
    /// at the flush point, writes while it exists and its delete, before
    /// every write, sync and file operation: the volume keeps its writes
    /// as `snapshot-fenced` says, the open re-arms the layer, an overlay
    /// present reads exactly the data at the flush point (before and after
    /// the recovered volume is written), OVERLAID is set while one exists.
    SnapshotOverlay {
        #[command(flatten)]
        run: LayoutSeeds,
        /// Break the ordering on purpose: issue a home write before its
        /// before-image is synced (the run must find violations).
        #[arg(long)]
        break_image_order: bool,
    },
    /// Crash `vouch resize` (a grow, a grow over a tail written, a
    /// shrink) at every file operation (a process crash and two kinds of
    /// power cut each): the volume opens at the old size or the new one,
    /// every block reads back, a new tail reads zeros, check is clean.
    Resize {
        #[command(flatten)]
        run: LayoutSeeds,
        /// Break the ordering on purpose: write the new size into the
        /// superblock before the files and the map of the new size (the
        /// run must find violations).
        #[arg(long)]
        break_switch: bool,
        /// Through a served volume (`Volume::resize_online`): writes in
        /// its buffer before each resize, the engine closed, its files
        /// resized and opened again.
        #[arg(long)]
        online: bool,
        /// A volume with regions (migrated to the other layout): both
        /// members resized, each image opened through its region layer
        /// after the open's finish. With --online: through a served one
        /// (`RegionVolume::resize_online`: both members' engines closed,
        /// the files resized, both opened again).
        #[arg(long)]
        regions: bool,
        /// With --online --regions, break the online order on purpose: the
        /// files resized with the other member's engine left open (the
        /// run must find violations).
        #[arg(long, requires_all = ["online", "regions"])]
        break_other_open: bool,
        /// With --online: a served mirror of two local legs
        /// (`Mirror::resize_online`: every leg's engine closed, each leg's
        /// files resized in turn, the activity log started again, every
        /// leg opened again); each image's legs at one size, or both
        /// closed cleanly for the offline resize to finish.
        #[arg(long, requires = "online", conflicts_with = "regions")]
        mirror: bool,
        /// With --online --mirror, break the order on purpose: each leg
        /// resized by the one-volume online resize in turn, opened again
        /// before the next is closed (the run must find violations).
        #[arg(long, requires = "mirror")]
        break_leg_by_leg: bool,
    },
    /// Crash at every write and sync of a key change (both layouts): after
    /// each crash exactly one of the two keys opens the volume.
    Keychange {
        #[arg(long, default_value_t = 20)]
        seeds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Crash `vouch upgrade` at every write, punch and sync between its
    /// open and its close (a power cut and a process crash each), then
    /// reopen and upgrade again: every block reads its data.
    Upgrade {
        #[command(flatten)]
        run: LayoutSeeds,
        /// Encrypted volumes.
        #[arg(long)]
        encrypted: bool,
    },
    /// Crash `vouch migrate` (a child process aborted) right before each
    /// of its file operations, then read every block, migrate again and
    /// read again: every block reads what was written.
    Migrate {
        #[command(flatten)]
        run: LayoutSeeds,
        /// Break the ordering on purpose: trim the old layout's region
        /// before the record switches (the run must find violations).
        #[arg(long)]
        break_release: bool,
        /// Break the ordering on purpose: switch the record before the new
        /// member is flushed (the reboot images must find violations).
        #[arg(long)]
        break_switch: bool,
        /// Migrate to the other layout first, then crash the way back.
        #[arg(long)]
        back: bool,
        /// Judge the process-crash images only, not also after a reboot
        /// (the members' held logs gone).
        #[arg(long)]
        no_reboot: bool,
        /// The online move (a server's), a foreground write arriving
        /// before each of its file operations (logged once acknowledged).
        #[arg(long)]
        online: bool,
        /// With --online, break it on purpose: never copy again the chunks
        /// written during the copy (the run must find violations).
        #[arg(long, requires = "online")]
        break_recopy: bool,
        /// Power cuts instead of process crashes: every file and directory
        /// of the volume in the model filesystem, images that drop
        /// unsynced writes and undo unsynced renames at every operation,
        /// and the open's catching up of the record cut at each step.
        #[arg(long, conflicts_with_all = ["online", "break_release", "no_reboot"])]
        power: bool,
        /// With --power: images per crash point keeping a random subset of
        /// the unsynced files and directories (besides none and all).
        #[arg(long, default_value_t = 2, requires = "power")]
        subsets: u64,
        /// With --power: run the migration again on the images of every
        /// Nth crash point (and the last) only; every image is read.
        #[arg(long, default_value_t = 1, requires = "power")]
        again_every: u64,
        /// With --power: judge the crash points from this operation on.
        #[arg(long, default_value_t = 1, requires = "power")]
        from_point: u64,
        /// With --power, break it on purpose: the record not fsynced (when
        /// made, at each switch) before the superblock names it.
        #[arg(long, requires = "power")]
        break_record_sync: bool,
        /// With --power, break it on purpose: the directory syncs of
        /// making the volume one with regions skipped (the member's rename
        /// and the record's entry not durable before the home's flag).
        #[arg(long, requires = "power")]
        break_dir_sync: bool,
        /// With --power, break it on purpose: the open's catching up of a
        /// record newer than the superblock not fsyncing the record before
        /// the superblock's update.
        #[arg(long, requires = "power")]
        break_rewrite_sync: bool,
    },
    /// The child `migrate` runs: migrate PATH, aborting at --crash-at.
    #[command(hide = true)]
    MigrateChild {
        path: std::path::PathBuf,
        #[arg(long)]
        layout: String,
        #[arg(long)]
        crash_at: u64,
        #[arg(long)]
        break_release: bool,
        #[arg(long)]
        break_switch: bool,
        #[arg(long)]
        online: bool,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long)]
        break_recopy: bool,
    },
    /// Inject faults into one layout x guard and print the detection row.
    Faults {
        #[arg(long, default_value = "split")]
        layout: String,
        #[arg(long, default_value = "crc32c")]
        guard: String,
        /// Injections per fault kind.
        #[arg(long, default_value_t = 1000)]
        count: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// An encrypted volume (the guard is crc32c).
        #[arg(long)]
        encrypted: bool,
    },
    /// Write the fuzz targets' seed corpora (one directory per target).
    Corpus {
        #[arg(long, default_value = "fuzz/corpus")]
        out: std::path::PathBuf,
    },
    /// Every fault kind on both layouts and every guard: the Markdown detection matrix.
    Matrix {
        /// Injections per fault kind per cell.
        #[arg(long, default_value_t = 1000)]
        count: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// Lost metadata (files cut short, emptied, deleted; units zeroed, copied
    /// from elsewhere or another volume; older copies; the written map
    /// lost) on both layouts and every guard: the Markdown rows.
    Metadata {
        /// Injections per damage kind per cell.
        #[arg(long, default_value_t = 50)]
        count: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Encrypted volumes (the guard is crc32c).
        #[arg(long)]
        encrypted: bool,
    },
    /// Crash leg 1 of a mirror at every write and sync of read and scrub
    /// repair (`mirror.rs`).
    MirrorRepair {
        #[arg(long, default_value_t = 24)]
        seeds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Crash the exporter at every write and sync of mirrored writes
    /// (`mirror_write.rs`).
    MirrorWrite {
        #[arg(long, default_value_t = 64)]
        seeds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Crash a replica server answering an exporter's requests through
    /// its own routes, at every write and sync, commit step and answer
    /// (`replica_server.rs`).
    ReplicaServer {
        #[arg(long, default_value_t = 64)]
        seeds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Self-test: answer each WRITE_SEALED before it is written.
        #[arg(long)]
        break_write: bool,
        /// Self-test: answer each FLUSH (and FUA write) before its flush.
        #[arg(long)]
        break_flush: bool,
    },
    /// Crash the exporter at every write and sync of mirrored writes with
    /// the activity log (the legs' and the log's), then reconcile the
    /// logged extents (`mirror_reconcile.rs`).
    MirrorReconcile {
        #[arg(long, default_value_t = 64)]
        seeds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Crash the exporter at each step of taking a lost leg out with its
    /// resync map (`mirror_midrun.rs`).
    MirrorMidrun {
        #[arg(long, default_value_t = 24)]
        seeds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Crash the exporter (both legs and the resync map's files) at every
    /// write and sync of a mirror resync with client writes between its
    /// batches; every image is checked and restarted to the end.
    Resync {
        #[arg(long, default_value_t = 16)]
        seeds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Faults on one leg of a 2-leg mirror (crc32c, split and packed): the
    /// "repaired" column of the detection matrix, as Markdown.
    MirrorMatrix {
        /// Injections per fault kind per layout.
        #[arg(long, default_value_t = 200)]
        count: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

fn layout(name: &str) -> Result<LayoutKind, String> {
    parse_layout(name).ok_or_else(|| format!("unknown layout {name:?} (split, packed)"))
}

fn guard(name: &str) -> Result<GuardKind, String> {
    parse_guard(name).ok_or_else(|| {
        format!("unknown guard {name:?} (crc32c, crc64nvme, crc16t10dif, xxh3, none)")
    })
}

/// Print a run's violations and summary; whether it had none.
fn print_report(violations: &[String], summary: &str) -> bool {
    for violation in violations {
        println!("{violation}");
    }
    println!("{summary}");
    violations.is_empty()
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("vouch-sim: {message}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<bool, String> {
    match cli.command {
        Command::Crash {
            layout: layout_name,
            guard: guard_name,
            seeds,
            seed,
            tearing,
            threads,
            encrypted,
        } => {
            let tearing = Tearing::from_name(&tearing)
                .ok_or_else(|| format!("unknown tearing {tearing:?} (none, sector)"))?;
            let mut config = CrashConfig::new(layout(&layout_name)?, guard(&guard_name)?, tearing);
            config.seeds = seeds;
            config.seed = seed;
            config.threads = threads;
            config.encrypted = encrypted;
            let report = vouch_sim::crash::run(&config);
            for violation in &report.violations {
                println!("{violation}");
            }
            println!("{}", report.summary(&config));
            Ok(report.violations.is_empty())
        }
        Command::Faults {
            layout: layout_name,
            guard: guard_name,
            count,
            seed,
            threads,
            encrypted,
        } => {
            let config = FaultConfig {
                cells: vec![(layout(&layout_name)?, guard(&guard_name)?)],
                count,
                seed,
                threads,
                encrypted,
            };
            let report = faults::run(&config);
            print!("{}", report.render(&config));
            Ok(report.violations.is_empty())
        }
        Command::Metadata {
            count,
            seed,
            threads,
            encrypted,
        } => {
            let mut config = vouch_sim::metadata::MetaConfig::all(count, seed, encrypted);
            config.threads = threads;
            if encrypted {
                config
                    .cells
                    .retain(|(_, guard)| *guard == GuardKind::Crc32c);
            }
            let report = vouch_sim::metadata::run(&config);
            print!("{}", report.render(&config));
            Ok(report.violations.is_empty())
        }
        Command::Migrate {
            run,
            break_release,
            break_switch,
            back,
            no_reboot,
            online,
            break_recopy,
            power,
            subsets,
            again_every,
            from_point,
            break_record_sync,
            break_dir_sync,
            break_rewrite_sync,
        } => {
            if power {
                let config = vouch_sim::migrate_power::PowerConfig {
                    layout: layout(&run.layout)?,
                    seeds: run.seeds,
                    seed: run.seed,
                    back,
                    subsets,
                    again_every,
                    from_point,
                    breaks: vouch_sim::migrate_power::PowerBreaks {
                        switch: break_switch,
                        record_sync: break_record_sync,
                        dir_sync: break_dir_sync,
                        rewrite_sync: break_rewrite_sync,
                    },
                };
                let report = vouch_sim::migrate_power::run(&config);
                for violation in &report.violations {
                    println!("{violation}");
                }
                println!("{}", report.summary(&config));
                return Ok(report.violations.is_empty());
            }
            let config = vouch_sim::migrate::MigrateConfig {
                again_every: 1,
                online,
                break_recopy,
                layout: layout(&run.layout)?,
                seeds: run.seeds,
                seed: run.seed,
                child: std::env::current_exe().map_err(|error| error.to_string())?,
                break_release,
                break_switch,
                reboot: !no_reboot,
                back,
            };
            let report = vouch_sim::migrate::run(&config);
            for violation in &report.violations {
                println!("{violation}");
            }
            println!("{}", report.summary(&config));
            Ok(report.violations.is_empty())
        }
        Command::MigrateChild {
            path,
            layout: target,
            crash_at,
            break_release,
            break_switch,
            online,
            seed,
            break_recopy,
        } => {
            if online {
                vouch_sim::migrate::child_online(
                    &path,
                    layout(&target)?,
                    crash_at,
                    seed,
                    break_recopy,
                )?;
            } else {
                vouch_sim::migrate::child(
                    &path,
                    layout(&target)?,
                    crash_at,
                    (break_release, break_switch),
                )?;
            }
            Ok(true)
        }
        Command::Upgrade { run, encrypted } => {
            let config = vouch_sim::upgrade::UpgradeConfig {
                layout: layout(&run.layout)?,
                seeds: run.seeds,
                seed: run.seed,
                encrypted,
            };
            let report = vouch_sim::upgrade::run(&config);
            for violation in &report.violations {
                println!("{violation}");
            }
            println!("{}", report.summary(&config));
            Ok(report.violations.is_empty())
        }
        Command::Resize {
            run,
            break_switch,
            online,
            regions,
            break_other_open,
            mirror,
            break_leg_by_leg,
        } => {
            let config = vouch_sim::resize::ResizeConfig {
                layout: layout(&run.layout)?,
                seeds: run.seeds,
                seed: run.seed,
                breaks: vouch_engine::resize::ResizeBreaks {
                    switch_first: break_switch,
                    other_left_open: break_other_open,
                    ..Default::default()
                },
                online,
                regions,
                mirror,
                leg_by_leg: break_leg_by_leg,
            };
            let report = vouch_sim::resize::run(&config);
            for violation in &report.violations {
                println!("{violation}");
            }
            println!("{}", vouch_sim::resize::summary(&report, &config));
            Ok(report.violations.is_empty())
        }
        Command::SnapshotFenced {
            run,
            break_image_order,
            break_last_image,
        } => {
            use vouch_sim::snapshot_layer as sim;
            let config = sim::LayerConfig {
                route: sim::Route::Fenced,
                layout: layout(&run.layout)?,
                seeds: run.seeds,
                seed: run.seed,
                break_image_order,
                break_last_image,
            };
            let layer = sim::run(&config);
            for violation in &layer.report.violations {
                println!("{violation}");
            }
            println!("{}", sim::summary(&layer, &config));
            Ok(layer.report.violations.is_empty())
        }
        Command::SnapshotOverlay {
            run,
            break_image_order,
        } => {
            use vouch_sim::snapshot_layer as sim;
            let config = sim::LayerConfig {
                route: sim::Route::Overlay,
                layout: layout(&run.layout)?,
                seeds: run.seeds,
                seed: run.seed,
                break_image_order,
                break_last_image: false,
            };
            let layer = sim::run(&config);
            for violation in &layer.report.violations {
                println!("{violation}");
            }
            println!("{}", sim::summary(&layer, &config));
            Ok(layer.report.violations.is_empty())
        }
        Command::SnapshotOnline {
            run,
            break_publish,
            break_outside,
            regions,
            break_home_only,
        } => {
            let breaks = vouch_engine::snapshot::SnapshotBreaks {
                publish_before_sync: break_publish,
            };
            let (violations, summary) = if regions {
                use vouch_sim::snapshot_online_regions as sim;
                let config = sim::RegionsOnlineConfig {
                    layout: layout(&run.layout)?,
                    seeds: run.seeds,
                    seed: run.seed,
                    breaks,
                    break_home_only,
                };
                let online = sim::run(&config);
                let summary = sim::summary(&online, &config);
                (online.report.violations, summary)
            } else {
                use vouch_sim::snapshot_online as sim;
                let config = sim::OnlineConfig {
                    layout: layout(&run.layout)?,
                    seeds: run.seeds,
                    seed: run.seed,
                    breaks,
                    break_outside,
                };
                let online = sim::run(&config);
                let summary = sim::summary(&online, &config);
                (online.report.violations, summary)
            };
            for violation in &violations {
                println!("{violation}");
            }
            println!("{summary}");
            Ok(violations.is_empty())
        }
        Command::Snapshot {
            run,
            break_publish,
            regions,
            legs,
        } => {
            let config = vouch_sim::snapshot::SnapshotConfig {
                layout: layout(&run.layout)?,
                seeds: run.seeds,
                seed: run.seed,
                breaks: vouch_engine::snapshot::SnapshotBreaks {
                    publish_before_sync: break_publish,
                },
            };
            let report = if regions {
                vouch_sim::snapshot_regions::run(&config)
            } else if legs {
                let (report, disagreeing) = vouch_sim::snapshot_legs::run(&config);
                println!("crash images with the legs disagreeing (one copy named): {disagreeing}");
                report
            } else {
                vouch_sim::snapshot::run(&config)
            };
            for violation in &report.violations {
                println!("{violation}");
            }
            println!(
                "{}{}",
                report.summary(&config),
                if regions {
                    " (a volume with regions)"
                } else if legs {
                    " (a mirror of two legs)"
                } else {
                    ""
                }
            );
            Ok(report.violations.is_empty())
        }
        Command::Keychange { seeds, seed } => {
            let report = vouch_sim::keychange::run(seed, seeds);
            for violation in &report.violations {
                println!("{violation}");
            }
            println!("{}", report.summary());
            Ok(report.violations.is_empty())
        }
        Command::Corpus { out } => {
            for (target, name, bytes) in vouch_sim::fuzz::seed_corpus() {
                let dir = out.join(target);
                std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                let path = dir.join(name);
                std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
                println!("{}", path.display());
            }
            Ok(true)
        }
        Command::Resync { seeds, seed } => {
            let report = vouch_sim::resync::run(seed, seeds);
            Ok(print_report(&report.violations, &report.summary()))
        }
        Command::MirrorRepair { seeds, seed } => {
            let report = vouch_sim::mirror::run(seed, seeds);
            Ok(print_report(&report.violations, &report.summary()))
        }
        Command::MirrorWrite { seeds, seed } => {
            let report = vouch_sim::mirror_write::run(seed, seeds);
            Ok(print_report(&report.violations, &report.summary()))
        }
        Command::ReplicaServer {
            seeds,
            seed,
            break_write,
            break_flush,
        } => {
            let breaks = vouch_replica::server::RouteBreaks {
                answer_before_write: break_write,
                answer_before_flush: break_flush,
            };
            let report = vouch_sim::replica_server::run_with(seed, seeds, breaks);
            Ok(print_report(&report.violations, &report.summary()))
        }
        Command::MirrorReconcile { seeds, seed } => {
            let report = vouch_sim::mirror_reconcile::run(seed, seeds, false);
            Ok(print_report(&report.violations, &report.summary()))
        }
        Command::MirrorMidrun { seeds, seed } => {
            let report = vouch_sim::mirror_midrun::run(seed, seeds);
            Ok(print_report(&report.violations, &report.summary()))
        }
        Command::MirrorMatrix { count, seed } => {
            let report = vouch_sim::mirror_faults::run(count, seed);
            for violation in &report.violations {
                println!("{violation}");
            }
            print!("{}", report.render());
            println!("{}", report.summary());
            Ok(report.violations.is_empty())
        }
        Command::Matrix {
            count,
            seed,
            threads,
        } => {
            let config = FaultConfig {
                cells: faults::all_cells(),
                count,
                seed,
                threads,
                encrypted: false,
            };
            let report = faults::run(&config);
            print!("{}", report.render(&config));
            Ok(report.violations.is_empty())
        }
    }
}
