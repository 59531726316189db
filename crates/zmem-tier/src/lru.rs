//! The one global LRU, shared by every pool (zswap's `zswap_list_lru`).
//!
//! Items are tree blocks ([`crate::tree::BLOCK`] consecutive keys, a 64 KiB
//! folio's pages), in the order their entries were stored: the front is the
//! cold end. A store pushes its block once (the pager stores a folio at a
//! time), so an item costs 8 bytes per block, half a byte per page, where
//! an item per entry cost 16. The shrinker visits a block's entries
//! together: each gets its second chance by its own `referenced` bit.
//!
//! Removal is lazy: a block whose entries were loaded or invalidated leaves
//! its item behind, and whoever pops it finds nothing there. A block stored
//! again may have two items. The list is rebuilt (stale items dropped, one
//! item kept per block, the oldest) whenever it has doubled since the last
//! rebuild, so it stays within about twice the live blocks.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use zmem_common::LockExt;

/// Below this many items the list is never rebuilt.
const REBUILD_FLOOR: usize = 4096;

#[derive(Debug, Default)]
pub struct Lru {
    q: Mutex<VecDeque<u64>>,
    /// Items left after the last rebuild.
    live: AtomicUsize,
    /// The list's capacity in items, for [`bytes`](Self::bytes).
    cap: AtomicUsize,
}

impl Lru {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<u64>> {
        self.q.lock_ok()
    }

    /// The memory the list holds.
    pub fn bytes(&self) -> usize {
        self.cap.load(Ordering::Relaxed) * std::mem::size_of::<u64>()
    }

    fn note_cap(&self, q: &VecDeque<u64>) {
        self.cap.store(q.capacity(), Ordering::Relaxed);
    }

    /// Adds blocks at the hot end; a block already at the hot end is not
    /// added again.
    pub fn push(&self, blocks: impl IntoIterator<Item = u64>) {
        let mut q = self.lock();
        for b in blocks {
            if q.back() != Some(&b) {
                q.push_back(b);
            }
        }
        self.note_cap(&q);
    }

    /// Takes up to `n` blocks from the cold end.
    pub fn pop_cold(&self, n: usize) -> Vec<u64> {
        let mut q = self.lock();
        let n = n.min(q.len());
        let out = q.drain(..n).collect();
        // Give memory back once the list is mostly empty.
        if q.capacity() > REBUILD_FLOOR && q.len() < q.capacity() / 4 {
            let keep = q.len() * 2;
            q.shrink_to(keep);
        }
        self.note_cap(&q);
        out
    }

    /// Puts blocks back at the cold end, in order (a failed writeback, or a
    /// block a pass did not finish).
    pub fn push_cold(&self, blocks: &[u64]) {
        let mut q = self.lock();
        for &b in blocks.iter().rev() {
            if q.front() != Some(&b) {
                q.push_front(b);
            }
        }
        self.note_cap(&q);
    }

    /// Items in the list, live and stale.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the list has doubled since the last rebuild (and is worth a
    /// pass).
    pub fn needs_rebuild(&self) -> bool {
        let len = self.len();
        len > REBUILD_FLOOR && len > 2 * self.live.load(Ordering::Relaxed)
    }

    /// Keeps one item (the oldest) of each block for which `live` says yes,
    /// preserving order. Items pushed meanwhile are kept (they are new,
    /// hence live). `live` runs with the list unlocked.
    pub fn rebuild(&self, live: impl Fn(u64) -> bool) {
        let old = std::mem::take(&mut *self.lock());
        let mut seen = HashSet::with_capacity(old.len());
        let kept: VecDeque<u64> = old.into_iter().filter(|&b| seen.insert(b) && live(b)).collect();
        let mut q = self.lock();
        let newer = std::mem::replace(&mut *q, kept);
        q.extend(newer);
        q.shrink_to_fit();
        self.live.store(q.len(), Ordering::Relaxed);
        self.note_cap(&q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_pushed_twice_in_a_row_is_one_item_and_rebuild_keeps_the_oldest() {
        let l = Lru::default();
        l.push([1, 1, 2, 2, 1]);
        assert_eq!(l.len(), 3);
        l.rebuild(|b| b != 2);
        assert_eq!(l.pop_cold(10), vec![1]);
        l.push([5, 6]);
        l.push_cold(&[4, 4]);
        assert_eq!(l.pop_cold(10), vec![4, 5, 6]);
        assert!(l.is_empty());
    }
}
