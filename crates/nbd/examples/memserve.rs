//! Serve an in-memory export over NBD (for benchmarking with fio/qemu).
//!
//! `cargo run --release -p vouch-nbd --example memserve -- [ADDR:PORT] [SIZE_MIB] [WORKERS]`
//! WORKERS = 0 uses tokio's spawn_blocking instead of the dedicated pool.

#[path = "../tests/common/memexport.rs"]
mod memexport;

use std::sync::Arc;

use vouch_nbd::{Executor, Listen, Server, ServerConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let addr = args
        .get(1)
        .map_or("127.0.0.1:10809", String::as_str)
        .parse()?;
    let size_mib: u64 = args.get(2).map_or(Ok(1024), |s| s.parse())?;
    let workers: usize = args
        .get(3)
        .map_or(Ok(vouch_nbd::DEFAULT_WORKER_THREADS), |s| s.parse())?;
    let runtime_threads: usize = std::env::var("MEMSERVE_RT_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let export = Arc::new(memexport::MemExport::new(size_mib << 20, false));
    // Allocated data everywhere, so reads move real bytes rather than holes.
    export.fill(0x5a);
    let mut config = ServerConfig::default();
    config.exports.insert(String::new(), export);
    config.listen.push(Listen::Tcp(addr));
    config.executor = if workers == 0 {
        Executor::TokioBlocking
    } else {
        Executor::Workers(workers)
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(runtime_threads)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let server = Server::bind(config).await?;
        eprintln!("memserve listening on {:?}", server.tcp_addrs());
        let shutdown = server.shutdown_handle();
        tokio::spawn(async move {
            let _ = tokio::signal::ctrl_c().await;
            shutdown.shutdown();
        });
        server.run().await?;
        Ok(())
    })
}
