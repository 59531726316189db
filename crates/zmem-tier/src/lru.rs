//! The one global LRU, shared by every pool (zswap's `zswap_list_lru`).
//!
//! Items are `(key, entry id)` in store order: the front is the cold end.
//! Removal is lazy: an entry that is loaded or invalidated leaves its item
//! behind, and whoever pops it finds the id no longer in the tree and drops
//! it. `stale` counts such items, and the tier rebuilds the list when they
//! outnumber the live ones, so it stays within twice the live entries.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use zmem_common::LockExt;

#[derive(Debug, Default)]
pub struct Lru {
    q: Mutex<VecDeque<(u64, u64)>>,
    stale: AtomicUsize,
}

impl Lru {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, u64)>> {
        self.q.lock_ok()
    }

    /// Adds items at the hot end.
    pub fn push(&self, items: impl IntoIterator<Item = (u64, u64)>) {
        self.lock().extend(items);
    }

    /// Takes up to `n` items from the cold end.
    pub fn pop_cold(&self, n: usize) -> Vec<(u64, u64)> {
        let mut q = self.lock();
        let n = n.min(q.len());
        q.drain(..n).collect()
    }

    /// Puts items back at the cold end, in order (a failed writeback).
    pub fn push_cold(&self, items: &[(u64, u64)]) {
        let mut q = self.lock();
        for &it in items.iter().rev() {
            q.push_front(it);
        }
    }

    /// Notes that an item's entry left the tree.
    pub fn note_stale(&self, n: usize) {
        self.stale.fetch_add(n, Ordering::Relaxed);
    }

    /// Items in the list, live and stale.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether stale items outnumber live ones (and the list is worth a pass).
    pub fn needs_rebuild(&self) -> bool {
        let len = self.len();
        let stale = self.stale.load(Ordering::Relaxed);
        len > 4096 && stale * 2 > len
    }

    /// Keeps only the items for which `live` says yes, preserving order.
    /// Items pushed meanwhile are kept (they are new, hence live).
    pub fn rebuild(&self, live: impl Fn(u64, u64) -> bool) {
        let old = std::mem::take(&mut *self.lock());
        let kept: VecDeque<(u64, u64)> = old.into_iter().filter(|&(k, id)| live(k, id)).collect();
        let mut q = self.lock();
        let newer = std::mem::replace(&mut *q, kept);
        q.extend(newer);
        self.stale.store(0, Ordering::Relaxed);
    }
}
