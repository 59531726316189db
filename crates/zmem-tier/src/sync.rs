//! The tree's lock, swapped for loom's under `cfg(loom)` so that
//! `tests/loom.rs` can model the store/invalidate/writeback race on the real
//! `Shard` code.

#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};
