//! A value read on the hot path without a lock and replaced rarely (the
//! mirror's activity log, replaced by an online resize, `resize.rs`).
//! Every value ever stored is kept until the `Swap` drops, so a reference
//! handed out stays valid while the `Swap` lives: a reader costs one
//! atomic load, a replacement a lock and an allocation (a few per resize, freed
//! with the mirror).

use std::marker::PhantomData;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

pub(crate) struct Swap<T> {
    /// The current value: null, or the value of one of `kept`'s `Arc`s.
    current: AtomicPtr<T>,
    /// Every value stored, never freed before `self`.
    kept: Mutex<Vec<Arc<T>>>,
    /// Shared across threads as an `Arc<T>` is (`get` hands out `&T`).
    _shared: PhantomData<Arc<T>>,
}

impl<T> Swap<T> {
    pub(crate) fn new() -> Swap<T> {
        Swap {
            current: AtomicPtr::new(std::ptr::null_mut()),
            kept: Mutex::new(Vec::new()),
            _shared: PhantomData,
        }
    }

    pub(crate) fn get(&self) -> Option<&T> {
        let current = self.current.load(Ordering::Acquire);
        // SAFETY: `current` is null or the value of an `Arc` in `kept`,
        // which holds it (never mutated, never dropped: `kept` is only
        // pushed to) as long as `self` lives, and `&self` outlives the
        // returned borrow.
        unsafe { current.as_ref() }
    }

    /// Store `value` if nothing was stored yet; else hand it back.
    pub(crate) fn set(&self, value: T) -> std::result::Result<(), T> {
        let mut kept = self.kept.lock();
        if !kept.is_empty() {
            return Err(value);
        }
        self.store(&mut kept, value);
        Ok(())
    }

    /// Store `value` in place of the current one (which stays valid for
    /// the readers holding it).
    pub(crate) fn replace(&self, value: T) {
        let mut kept = self.kept.lock();
        self.store(&mut kept, value);
    }

    fn store(&self, kept: &mut Vec<Arc<T>>, value: T) {
        let value = Arc::new(value);
        let pointer = Arc::as_ptr(&value).cast_mut();
        kept.push(value);
        self.current.store(pointer, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::Swap;

    #[test]
    fn a_value_read_before_a_replace_stays_valid() {
        let swap = Swap::new();
        assert!(swap.get().is_none());
        assert!(swap.set(String::from("one")).is_ok());
        assert_eq!(swap.set(String::from("again")), Err(String::from("again")));
        let before = swap.get().unwrap();
        swap.replace(String::from("two"));
        assert_eq!(before, "one");
        assert_eq!(swap.get().unwrap(), "two");
    }
}
