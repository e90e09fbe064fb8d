//! The mirror's background threads (its resyncs and its reconciliation)
//! and the flag that stops them: a type of its own, so the jobs that
//! start threads hold it without holding the `Mirror`.

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

/// Running job threads, joined when the mirror stops them.
#[derive(Default)]
pub(crate) struct Threads {
    handles: Mutex<Vec<std::thread::JoinHandle<()>>>,
    stopping: AtomicBool,
}

impl Threads {
    /// Run `job` on a new thread named `name`, joined by `stop_all`.
    pub(crate) fn spawn(
        &self,
        name: String,
        job: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<()> {
        let handle = std::thread::Builder::new().name(name).spawn(job)?;
        self.handles.lock().push(handle);
        Ok(())
    }

    /// Whether `stop_all` was called: every job thread ends at its next
    /// step.
    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Tell every job thread to stop, and wait until each has.
    pub(crate) fn stop_all(&self) {
        self.stopping.store(true, Ordering::Release);
        let handles: Vec<_> = self.handles.lock().drain(..).collect();
        for handle in handles {
            let _ = handle.join();
        }
    }
}
