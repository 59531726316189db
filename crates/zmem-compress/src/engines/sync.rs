//! An in-flight batch's flags and item locks, swapped for loom's under
//! `cfg(loom)` so that the publish-once protocol (`Inflight::run`,
//! `abandon`, `take_batch`) is modelled on the real code (`loom_model`
//! in `mod.rs`). The device's other atomics and locks stay std's.

#[cfg(loom)]
pub(super) use loom::sync::{
    atomic::{AtomicBool, AtomicUsize},
    Mutex, MutexGuard,
};
#[cfg(not(loom))]
pub(super) use std::sync::{
    atomic::{AtomicBool, AtomicUsize},
    Mutex, MutexGuard,
};

/// The lock of `m`; a poisoned lock is taken as it is (what a panicking
/// run left is never read: it did not publish).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
