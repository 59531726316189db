//! The tree: key → [`Entry`], in 64 shards, each under its own mutex (the
//! xarray and its lock in zswap).
//!
//! Each shard also holds the pools its entries live in, with a count of its
//! entries per pool: the percpu_ref idea, sharded by tree shard instead of by
//! CPU. A store or free only changes its shard's count under the lock it
//! already holds; the pool's `Arc` is cloned or dropped only when a shard's
//! count moves between 0 and 1. A pool that is no longer current is freed
//! when the last shard lets go of it, i.e. when its last entry goes.
//!
//! The writeback protocol lives here too ([`Shard::writeback_commit`]), so
//! that the loom model in `tests/loom.rs` runs the real code.

use std::collections::HashMap;

use crate::entry::{Entry, Stored};
use crate::sync::{Mutex, MutexGuard};

pub const SHARDS: usize = 64;

#[derive(Debug)]
struct PoolRef<P> {
    id: u32,
    pool: P,
    entries: usize,
}

/// One shard of the tree.
#[derive(Debug)]
pub struct Shard<P> {
    entries: HashMap<u64, Entry>,
    pools: Vec<PoolRef<P>>,
    /// For cached entries in the swap file: (entry id, a 128-bit hash of
    /// the page), so that a clean page is recognised without reading it
    /// back. Goes with its entry.
    sums: HashMap<u64, (u64, u128)>,
}

impl<P> Default for Shard<P> {
    fn default() -> Self {
        Shard { entries: HashMap::new(), pools: Vec::new(), sums: HashMap::new() }
    }
}

impl<P: Clone> Shard<P> {
    pub fn get(&self, key: u64) -> Option<&Entry> {
        self.entries.get(&key)
    }

    pub fn get_mut(&mut self, key: u64) -> Option<&mut Entry> {
        self.entries.get_mut(&key)
    }

    /// Records the page hash of the cached entry under `key`.
    pub fn set_sum(&mut self, key: u64, sum: u128) {
        if let Some(e) = self.entries.get(&key) {
            self.sums.insert(key, (e.id, sum));
        }
    }

    /// The page hash recorded for the entry under `key`, if it is that
    /// entry's.
    pub fn sum(&self, key: u64) -> Option<u128> {
        let e = self.entries.get(&key)?;
        self.sums.get(&key).filter(|(id, _)| *id == e.id).map(|&(_, s)| s)
    }

    /// Forgets the page hash under `key`.
    pub fn clear_sum(&mut self, key: u64) {
        if !self.sums.is_empty() {
            self.sums.remove(&key);
        }
    }

    /// The pool with id `id`, which an entry of this shard lives in.
    pub fn pool(&self, id: u32) -> Option<&P> {
        self.pools.iter().find(|r| r.id == id).map(|r| &r.pool)
    }

    fn get_ref(&mut self, id: u32, pool: &P) {
        match self.pools.iter_mut().find(|r| r.id == id) {
            Some(r) => r.entries += 1,
            None => self.pools.push(PoolRef { id, pool: pool.clone(), entries: 1 }),
        }
    }

    /// Drops one entry's reference to pool `id`; returns the pool when that
    /// was this shard's last, so that the caller drops it outside the lock.
    fn put_ref(&mut self, id: u32) -> Option<P> {
        let i = self.pools.iter().position(|r| r.id == id)?;
        self.pools[i].entries -= 1;
        (self.pools[i].entries == 0).then(|| self.pools.swap_remove(i).pool)
    }

    /// Inserts `entry` under `key`; `pool` is the entry's pool (taken when
    /// the entry is in a pool). Returns the entry it replaced, which the
    /// caller MUST release with [`Shard::release`].
    pub fn insert(&mut self, key: u64, entry: Entry, pool: &P) -> Option<Entry> {
        if entry.holds_pool() {
            self.get_ref(entry.pool, pool);
        }
        self.clear_sum(key);
        self.entries.insert(key, entry)
    }

    /// Removes and returns the entry under `key`; release it with
    /// [`Shard::release`].
    pub fn remove(&mut self, key: u64) -> Option<Entry> {
        self.clear_sum(key);
        self.entries.remove(&key)
    }

    /// Frees what a removed entry held, through `free_obj` (the pool object)
    /// and `free_slot` (the swap slot), and drops its pool reference. Returns
    /// the pool if this was the shard's last reference to it.
    pub fn release(
        &mut self,
        e: Entry,
        free_obj: impl FnOnce(&P, &Entry),
        free_slot: impl FnOnce(&Entry),
    ) -> Option<P> {
        match e.stored {
            Stored::Pool { .. } => {
                if let Some(p) = self.pool(e.pool) {
                    free_obj(p, &e);
                }
                self.put_ref(e.pool)
            }
            Stored::Swap { .. } => {
                free_slot(&e);
                if e.holds_pool() {
                    self.put_ref(e.pool)
                } else {
                    None
                }
            }
            Stored::SameFilled(_) => None,
        }
    }

    /// The second half of writeback: if `key` still holds entry `id` in a
    /// pool, it now points at `to` (a [`Stored::Swap`]); the old pool object
    /// is freed through `free_obj`. The pool reference is dropped unless the
    /// written-back object is compressed (it still needs the pool's
    /// compressor). Returns `Ok(pool dropped by this shard, if any)`, or
    /// `Err(())` when the entry changed while the page was being written, in
    /// which case the caller frees the slot.
    #[allow(clippy::result_unit_err)]
    pub fn writeback_commit(
        &mut self,
        key: u64,
        id: u64,
        to: Stored,
        free_obj: impl FnOnce(&P, &Entry),
    ) -> Result<Option<P>, ()> {
        debug_assert!(matches!(to, Stored::Swap { .. }), "{to:?}");
        let Some(e) = self.entries.get_mut(&key) else { return Err(()) };
        if e.id != id || !e.in_pool() {
            return Err(());
        }
        let old = *e;
        e.stored = to;
        let keeps = e.holds_pool();
        if let Some(p) = self.pool(old.pool) {
            free_obj(p, &old);
        }
        Ok(if keeps { None } else { self.put_ref(old.pool) })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.entries.keys().copied()
    }
}

/// The sharded tree.
#[derive(Debug)]
pub struct Tree<P> {
    shards: Box<[Mutex<Shard<P>>]>,
}

impl<P: Clone> Default for Tree<P> {
    fn default() -> Self {
        Tree { shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect() }
    }
}

impl<P: Clone> Tree<P> {
    pub fn shard_of(key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as usize % SHARDS
    }

    pub fn lock(&self, key: u64) -> MutexGuard<'_, Shard<P>> {
        self.lock_shard(Self::shard_of(key))
    }

    pub fn lock_shard(&self, i: usize) -> MutexGuard<'_, Shard<P>> {
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }
}
