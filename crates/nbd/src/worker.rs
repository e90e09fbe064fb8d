//! Where blocking export calls run: never on the async reactor.
//!
//! Two executors: a dedicated fixed pool of threads sharing one job queue
//! (default: cheapest hand-off, only wakes a thread when one is idle) and
//! tokio's `spawn_blocking` (unbounded thread growth; kept for comparison).

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// How export calls are executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Executor {
    /// A dedicated pool with this many threads.
    Workers(usize),
    /// tokio's blocking thread pool (`spawn_blocking`).
    TokioBlocking,
}

/// Default dedicated worker count: enough that a few slow fsyncs (FLUSH/FUA)
/// do not starve cheap page-cache reads, small enough to stay cheap on 2 cores.
pub const DEFAULT_WORKER_THREADS: usize = 8;

impl Default for Executor {
    fn default() -> Self {
        Executor::Workers(DEFAULT_WORKER_THREADS)
    }
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    threads: usize,
    idle: usize,
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    available: Condvar,
}

/// A fixed pool of worker threads; closed (threads exit) when dropped.
pub(crate) struct WorkerPool {
    shared: Option<Arc<Shared>>,
}

impl WorkerPool {
    pub(crate) fn new(executor: Executor) -> std::io::Result<WorkerPool> {
        let Executor::Workers(threads) = executor else {
            return Ok(WorkerPool { shared: None });
        };
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                threads: threads.max(1),
                ..Queue::default()
            }),
            available: Condvar::new(),
        });
        for index in 0..threads.max(1) {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("nbd-worker-{index}"))
                .spawn(move || worker_main(&shared))?;
        }
        Ok(WorkerPool {
            shared: Some(shared),
        })
    }

    pub(crate) fn submit(&self, job: Job) {
        let Some(shared) = &self.shared else {
            drop(tokio::task::spawn_blocking(job));
            return;
        };
        let mut queue = shared.queue.lock();
        queue.jobs.push_back(job);
        // Only pay for a futex wake when the awake workers are outnumbered by
        // queued jobs: cheap jobs are drained by whoever is awake, and when
        // awake workers block (fsync) the queue grows and wakes more.
        let awake = queue.threads - queue.idle;
        let wake = queue.idle > 0 && queue.jobs.len() > awake;
        drop(queue);
        if wake {
            shared.available.notify_one();
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        if let Some(shared) = &self.shared {
            shared.queue.lock().closed = true;
            shared.available.notify_all();
        }
    }
}

fn worker_main(shared: &Shared) {
    loop {
        let job = {
            let mut queue = shared.queue.lock();
            loop {
                if let Some(job) = queue.jobs.pop_front() {
                    break job;
                }
                if queue.closed {
                    return;
                }
                queue.idle += 1;
                shared.available.wait(&mut queue);
                queue.idle -= 1;
            }
        };
        job();
    }
}
