//! The atomics of the lock-free part (the handle table), swapped for loom's
//! under `cfg(loom)` so that `tests/loom.rs` can model them.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
