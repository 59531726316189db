//! The tree: key → [`Entry`], in 64 shards, each under its own mutex (the
//! xarray and its lock in zswap).
//!
//! Entries live in flat blocks of [`BLOCK`] consecutive keys (a 64 KiB
//! folio's pages), each entry packed in 16 bytes, as zram's table entry is
//! (`Packed`): a shard maps a block number to its block, and a whole block
//! is in one shard, so the pages of a folio are looked up in one table and
//! the same cache lines. A block is freed with its last entry.
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
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use zmem_zsmalloc::Handle;

use crate::entry::{Entry, Stored};
use crate::sync::{Mutex, MutexGuard};

pub const SHARDS: usize = 64;

/// Keys per block: the pages of a 64 KiB folio.
pub const BLOCK: usize = 16;

/// The largest pool id an entry can name (15 bits of a packed entry).
pub const MAX_POOL_ID: u32 = (1 << 15) - 1;

/// The memory one block costs: the block itself and its slot in the
/// shard's map (key, box pointer and about a control byte).
pub const BLOCK_BYTES: usize = std::mem::size_of::<Block>() + 2 * std::mem::size_of::<u64>() + 1;

/// The memory one page hash costs (`Shard::set_sum`).
const SUM_BYTES: usize = std::mem::size_of::<(u64, (u32, u128))>() + 1;

// `Packed::meta`: kind (2 bits), referenced, cached, a pool object's
// length (13 bits), the pool id (15 bits), the entry id (32 bits).
const KIND: u64 = 0b11;
const KIND_SAME: u64 = 1;
const KIND_POOL: u64 = 2;
const KIND_SWAP: u64 = 3;
const REFERENCED: u64 = 1 << 2;
const CACHED: u64 = 1 << 3;
const LEN_SHIFT: u32 = 4;
const LEN_MASK: u64 = (1 << 13) - 1;
const POOL_SHIFT: u32 = 17;
const ID_SHIFT: u32 = 32;

/// One entry in 16 bytes: `word` is the same-filled value, the pool
/// handle, or the swap slot, offset and length; `meta` the rest. A zero
/// `meta` is no entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Packed {
    word: u64,
    meta: u64,
}

impl Packed {
    fn pack(e: &Entry) -> Packed {
        debug_assert!(e.pool <= MAX_POOL_ID, "pool id {} has no room in an entry", e.pool);
        let (kind, word, len) = match e.stored {
            Stored::SameFilled(v) => (KIND_SAME, v, 0),
            Stored::Pool { handle, len } => {
                debug_assert!(u64::from(len) <= LEN_MASK);
                (KIND_POOL, handle.to_raw(), u64::from(len))
            }
            Stored::Swap { slot, off, len } => {
                (KIND_SWAP, (u64::from(slot) << 32) | (u64::from(off) << 16) | u64::from(len), 0)
            }
        };
        let meta = kind
            | if e.referenced { REFERENCED } else { 0 }
            | if e.cached { CACHED } else { 0 }
            | (len << LEN_SHIFT)
            | (u64::from(e.pool & MAX_POOL_ID) << POOL_SHIFT)
            | (u64::from(e.id) << ID_SHIFT);
        Packed { word, meta }
    }

    fn unpack(self) -> Option<Entry> {
        let stored = match self.meta & KIND {
            KIND_SAME => Stored::SameFilled(self.word),
            KIND_POOL => {
                Stored::Pool { handle: Handle::from_raw(self.word), len: ((self.meta >> LEN_SHIFT) & LEN_MASK) as u32 }
            }
            KIND_SWAP => {
                Stored::Swap { slot: (self.word >> 32) as u32, off: (self.word >> 16) as u16, len: self.word as u16 }
            }
            _ => return None,
        };
        Some(Entry {
            id: (self.meta >> ID_SHIFT) as u32,
            pool: ((self.meta >> POOL_SHIFT) as u32) & MAX_POOL_ID,
            stored,
            referenced: self.meta & REFERENCED != 0,
            cached: self.meta & CACHED != 0,
        })
    }

    fn is_some(self) -> bool {
        self.meta & KIND != 0
    }
}

/// [`BLOCK`] consecutive keys' entries.
#[derive(Debug, Default)]
struct Block {
    e: [Packed; BLOCK],
    live: u8,
}

fn split(key: u64) -> (u64, usize) {
    (key / BLOCK as u64, (key % BLOCK as u64) as usize)
}

#[derive(Debug)]
struct PoolRef<P> {
    id: u32,
    pool: P,
    entries: usize,
}

/// One shard of the tree.
#[derive(Debug)]
pub struct Shard<P> {
    blocks: HashMap<u64, Box<Block>>,
    entries: usize,
    pools: Vec<PoolRef<P>>,
    /// For cached entries in the swap file: (entry id, a 128-bit hash of
    /// the page), so that a clean page is recognised without reading it
    /// back. Goes with its entry.
    sums: HashMap<u64, (u32, u128)>,
    /// Bytes of blocks and page hashes live in the whole tree (shared by
    /// its shards).
    tree_bytes: Arc<AtomicUsize>,
}

/// A mutable view of an entry ([`Shard::get_mut`]), packed back when
/// dropped.
#[derive(Debug)]
pub struct EntryMut<'a> {
    slot: &'a mut Packed,
    e: Entry,
}

impl Deref for EntryMut<'_> {
    type Target = Entry;
    fn deref(&self) -> &Entry {
        &self.e
    }
}

impl DerefMut for EntryMut<'_> {
    fn deref_mut(&mut self) -> &mut Entry {
        &mut self.e
    }
}

impl Drop for EntryMut<'_> {
    fn drop(&mut self) {
        *self.slot = Packed::pack(&self.e);
    }
}

impl<P> Shard<P> {
    fn counted(tree_bytes: Arc<AtomicUsize>) -> Self {
        Shard { blocks: HashMap::new(), entries: 0, pools: Vec::new(), sums: HashMap::new(), tree_bytes }
    }

    fn slot(&self, key: u64) -> Option<Packed> {
        let (b, i) = split(key);
        self.blocks.get(&b).map(|blk| blk.e[i]).filter(|p| p.is_some())
    }

    fn slot_mut(&mut self, key: u64) -> Option<&mut Packed> {
        let (b, i) = split(key);
        self.blocks.get_mut(&b).map(|blk| &mut blk.e[i]).filter(|p| p.is_some())
    }

    /// Puts `p` under `key`; returns what was there.
    fn put(&mut self, key: u64, p: Packed) -> Option<Entry> {
        let (b, i) = split(key);
        let tree_bytes = &self.tree_bytes;
        let blk = self.blocks.entry(b).or_insert_with(|| {
            tree_bytes.fetch_add(BLOCK_BYTES, Ordering::Relaxed);
            Box::default()
        });
        let old = std::mem::replace(&mut blk.e[i], p);
        if !old.is_some() {
            blk.live += 1;
            self.entries += 1;
        }
        old.unpack()
    }

    /// Takes the entry under `key` out; frees its block with its last.
    fn take(&mut self, key: u64) -> Option<Entry> {
        let (b, i) = split(key);
        let blk = self.blocks.get_mut(&b)?;
        let old = std::mem::take(&mut blk.e[i]);
        if !old.is_some() {
            return None;
        }
        blk.live -= 1;
        self.entries -= 1;
        if blk.live == 0 {
            self.blocks.remove(&b);
            self.tree_bytes.fetch_sub(BLOCK_BYTES, Ordering::Relaxed);
        }
        old.unpack()
    }
}

impl<P: Clone> Shard<P> {
    pub fn get(&self, key: u64) -> Option<Entry> {
        self.slot(key).and_then(Packed::unpack)
    }

    /// The entry under `key`, to change in place.
    pub fn get_mut(&mut self, key: u64) -> Option<EntryMut<'_>> {
        let slot = self.slot_mut(key)?;
        let e = slot.unpack()?;
        Some(EntryMut { slot, e })
    }

    /// Records the page hash of the cached entry under `key`.
    pub fn set_sum(&mut self, key: u64, sum: u128) {
        if let Some(e) = self.get(key) {
            if self.sums.insert(key, (e.id, sum)).is_none() {
                self.tree_bytes.fetch_add(SUM_BYTES, Ordering::Relaxed);
            }
        }
    }

    /// The page hash recorded for the entry under `key`, if it is that
    /// entry's.
    pub fn sum(&self, key: u64) -> Option<u128> {
        let e = self.get(key)?;
        self.sums.get(&key).filter(|(id, _)| *id == e.id).map(|&(_, s)| s)
    }

    /// Forgets the page hash under `key`.
    pub fn clear_sum(&mut self, key: u64) {
        if !self.sums.is_empty() && self.sums.remove(&key).is_some() {
            self.tree_bytes.fetch_sub(SUM_BYTES, Ordering::Relaxed);
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
        self.put(key, Packed::pack(&entry))
    }

    /// Removes and returns the entry under `key`; release it with
    /// [`Shard::release`].
    pub fn remove(&mut self, key: u64) -> Option<Entry> {
        self.clear_sum(key);
        self.take(key)
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

    /// The second half of writeback: if `key` still holds entry `id` with
    /// its object at `from` (the one written: recompression may have moved
    /// it since), it now points at `to` (a [`Stored::Swap`]); the old pool object
    /// is freed through `free_obj`. The pool reference is dropped unless the
    /// written-back object is compressed (it still needs the pool's
    /// compressor). Returns `Ok(pool dropped by this shard, if any)`, or
    /// `Err(())` when the entry changed while the page was being written, in
    /// which case the caller frees the slot.
    #[allow(clippy::result_unit_err)]
    pub fn writeback_commit(
        &mut self,
        key: u64,
        id: u32,
        from: Handle,
        to: Stored,
        free_obj: impl FnOnce(&P, &Entry),
    ) -> Result<Option<P>, ()> {
        debug_assert!(matches!(to, Stored::Swap { .. }), "{to:?}");
        self.move_object(key, id, from, to, None, free_obj)
    }

    /// The second half of recompression: if `key` still holds entry `id`
    /// with its object at `from` (in a pool), it now holds `to`, an object
    /// of the pool `(id, pool)`; the old object is freed through `free_obj`.
    /// Returns `Ok(old pool dropped by this shard, if any)`, or `Err(())`
    /// when the entry changed meanwhile, in which case the caller frees
    /// `to`'s object.
    #[allow(clippy::result_unit_err)]
    pub fn recompress_commit(
        &mut self,
        key: u64,
        id: u32,
        from: Handle,
        to_pool: (u32, &P),
        to: Stored,
        free_obj: impl FnOnce(&P, &Entry),
    ) -> Result<Option<P>, ()> {
        debug_assert!(matches!(to, Stored::Pool { .. }), "{to:?}");
        self.move_object(key, id, from, to, Some(to_pool), free_obj)
    }

    /// Both commits: `key`'s entry `id`, if its object is still the pool
    /// object `from`, now holds `to` (in pool `to_pool`, if given); the old
    /// object is freed, and the old pool's reference dropped unless the
    /// entry still needs that pool.
    fn move_object(
        &mut self,
        key: u64,
        id: u32,
        from: Handle,
        to: Stored,
        to_pool: Option<(u32, &P)>,
        free_obj: impl FnOnce(&P, &Entry),
    ) -> Result<Option<P>, ()> {
        let Some(mut e) = self.get_mut(key) else { return Err(()) };
        if e.id != id || !matches!(e.stored, Stored::Pool { handle, .. } if handle == from) {
            return Err(());
        }
        let old = *e;
        debug_assert!(to_pool.is_none_or(|(pid, _)| pid != old.pool), "recompressed into its own pool");
        e.stored = to;
        if let Some((pid, _)) = to_pool {
            e.pool = pid;
        }
        let keeps = e.holds_pool() && e.pool == old.pool;
        drop(e);
        if let Some((pid, p)) = to_pool {
            self.get_ref(pid, p);
        }
        if let Some(p) = self.pool(old.pool) {
            free_obj(p, &old);
        }
        Ok(if keeps { None } else { self.put_ref(old.pool) })
    }

    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.blocks.iter().flat_map(|(&b, blk)| {
            blk.e.iter().enumerate().filter(|(_, p)| p.is_some()).map(move |(i, _)| b * BLOCK as u64 + i as u64)
        })
    }
}

/// The sharded tree.
#[derive(Debug)]
pub struct Tree<P> {
    shards: Box<[Mutex<Shard<P>>]>,
    bytes: Arc<AtomicUsize>,
}

impl<P: Clone> Default for Tree<P> {
    fn default() -> Self {
        let bytes = Arc::new(AtomicUsize::new(0));
        Tree { shards: (0..SHARDS).map(|_| Mutex::new(Shard::counted(Arc::clone(&bytes)))).collect(), bytes }
    }
}

impl<P: Clone> Tree<P> {
    /// The shard of `key`: that of its block, so a folio's keys share one.
    pub fn shard_of(key: u64) -> usize {
        (split(key).0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as usize % SHARDS
    }

    /// The tree's memory: its blocks and page hashes.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    pub fn lock(&self, key: u64) -> MutexGuard<'_, Shard<P>> {
        self.lock_shard(Self::shard_of(key))
    }

    pub fn lock_shard(&self, i: usize) -> MutexGuard<'_, Shard<P>> {
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stored() -> impl Strategy<Value = Stored> {
        prop_oneof![
            any::<u64>().prop_map(Stored::SameFilled),
            (any::<u64>(), 1..=4096u32).prop_map(|(h, len)| Stored::Pool { handle: Handle::from_raw(h), len }),
            (any::<u32>(), any::<u16>(), any::<u16>()).prop_map(|(slot, off, len)| Stored::Swap { slot, off, len }),
        ]
    }

    fn entry() -> impl Strategy<Value = Entry> {
        (any::<u32>(), 0..=MAX_POOL_ID, stored(), any::<bool>(), any::<bool>())
            .prop_map(|(id, pool, stored, referenced, cached)| Entry { id, pool, stored, referenced, cached })
    }

    proptest! {
        /// Every entry packs into 16 bytes and back unchanged.
        #[test]
        fn an_entry_packs_and_unpacks_unchanged(e in entry()) {
            let p = Packed::pack(&e);
            prop_assert!(p.is_some());
            prop_assert_eq!(p.unpack(), Some(e));
        }

        /// A shard behaves as a map from key to entry, whatever the order of
        /// inserts and removes, and frees every block with its last entry.
        #[test]
        fn a_shard_is_a_map_and_frees_its_blocks(
            ops in proptest::collection::vec((0..200u64, proptest::option::of(entry())), 1..300),
        ) {
            let tree: Tree<()> = Tree::default();
            let mut model = std::collections::BTreeMap::new();
            for (k, e) in ops {
                let mut s = tree.lock(k);
                match e {
                    Some(e) => {
                        let old = s.put(k, Packed::pack(&e));
                        prop_assert_eq!(old, model.insert(k, e));
                    }
                    None => prop_assert_eq!(s.take(k), model.remove(&k)),
                }
            }
            let mut keys: Vec<u64> = (0..SHARDS).flat_map(|i| tree.lock_shard(i).keys().collect::<Vec<_>>()).collect();
            keys.sort_unstable();
            prop_assert_eq!(keys, model.keys().copied().collect::<Vec<_>>());
            let entries: usize = (0..SHARDS).map(|i| tree.lock_shard(i).len()).sum();
            prop_assert_eq!(entries, model.len());
            for (&k, e) in &model {
                prop_assert_eq!(tree.lock(k).get(k), Some(*e));
            }
            let blocks: std::collections::BTreeSet<u64> = model.keys().map(|k| k / BLOCK as u64).collect();
            prop_assert_eq!(tree.bytes(), blocks.len() * BLOCK_BYTES);
            for &k in model.keys() {
                tree.lock(k).take(k);
            }
            prop_assert_eq!(tree.bytes(), 0);
        }
    }
}
