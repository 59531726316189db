//! Load, invalidate and lookup.

use zmem_common::PAGE_SIZE;
use zmem_compress::DecompressError;

use std::sync::Arc;

use smallvec::SmallVec;

use crate::stats::inc;
use crate::tree::{Shard, BLOCK};
use crate::{Cursor, ShardGuard};
use crate::{Entry, Pool, Stored, Tier, TierError};

/// A page [`Tier::load_many`] took an object for.
struct Taken {
    page: usize,
    /// The entry's id when taken.
    id: u32,
    /// The pool whose compressor expands the object.
    pool: Option<Arc<Pool>>,
    /// The object: `objs[at..at + len]`.
    at: usize,
    len: usize,
}

/// Per-page arrays of one load: inline for a folio of up to this many
/// pages (64 KiB), so that a fault's load allocates nothing.
const INLINE: usize = 16;

/// What [`Tier::load_many`] returns: one outcome per page.
pub type LoadOutcomes = SmallVec<[Result<LoadOutcome, TierError>; INLINE]>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOutcome {
    Loaded,
    NotFound,
}

pub(crate) fn fill(dst: &mut [u8], v: u64) {
    let b = v.to_ne_bytes();
    for w in dst.chunks_exact_mut(8) {
        w.copy_from_slice(&b);
    }
}

impl Tier {
    /// Decompresses (or copies, for a raw page) a pool entry into `dst`.
    pub(crate) fn load_from_pool(pool: &Pool, key: u64, e: &Entry, dst: &mut [u8]) -> Result<(), TierError> {
        let Stored::Pool { handle, .. } = e.stored else { unreachable!("a pool entry") };
        pool.zs.map(handle, |obj| Self::expand(pool, key, obj, dst)).map_err(TierError::Pool)?
    }

    /// The page `obj` (an object as the pool holds it: compressed by
    /// `pool`'s compressor, or the raw page) into `dst`.
    pub(crate) fn expand(pool: &Pool, key: u64, obj: &[u8], dst: &mut [u8]) -> Result<(), TierError> {
        if obj.len() == PAGE_SIZE {
            dst.copy_from_slice(obj);
            return Ok(());
        }
        let mut res = [Ok(0)];
        let mut d = [&mut *dst];
        pool.compressor.decompress_batch(&[obj], &mut d, &mut res)?;
        match res[0] {
            Ok(n) if n == PAGE_SIZE => Ok(()),
            Ok(got) => Err(TierError::Decompress {
                key,
                source: DecompressError::LengthMismatch { codec: "codec", got, want: PAGE_SIZE },
            }),
            Err(ref source) => Err(TierError::Decompress { key, source: source.clone() }),
        }
    }

    /// The refault window, in pages: how far back in the writeback stream
    /// a load from the swap file is a `swap_refaults`. Unset: as many as the
    /// pool holds.
    fn refault_window(&self) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        match self.refault_window.load(Relaxed) {
            0 => self.counters.stored_pages.load(Relaxed),
            w => w,
        }
    }

    /// Counts a load of pool entry `e` that lay in the oldest window of the
    /// pool (`cold_pool_loads`), by its age in pages stored since (the
    /// store clock, `crate::store::id_clock`) against the window's start
    /// (placed by `crate::ages` when the window is set). An entry kept from a
    /// load and stored again unchanged takes a new id then, so its age runs
    /// from that eviction.
    fn pool_loaded(&self, e: &Entry) {
        use std::sync::atomic::Ordering::Relaxed;
        let age = u64::from(crate::store::id_clock().wrapping_sub(e.id));
        if age >= self.cold_age.load(Relaxed) {
            inc(&self.counters.cold_pool_loads, 1);
        }
    }

    /// Pages read back from the swap file so far (`pswpin`), without the
    /// rest of [`Tier::stats`]: the pager tells a fault that read the swap
    /// file from one served by the pool by this count's move.
    pub fn swap_reads(&self) -> u64 {
        self.counters.pswpin.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts pages read back from the swap file's `slots` (`pswpin`), and
    /// those a somewhat larger pool would have held (`swap_refaults`, see
    /// [`Tier::set_swap_refault_window`]).
    fn swapped_in(&self, sf: &zmem_swapfile::SwapFile, slots: &[zmem_swapfile::Slot]) {
        inc(&self.counters.pswpin, slots.len() as u64);
        inc(&self.counters.swap_refaults, sf.written_within(slots, self.refault_window()) as u64);
    }

    /// Swap-in read-ahead: starts reading the swap file's slots of the
    /// pages of `ranges` (first key, pages), for loads to come (a walk's
    /// next folios), without waiting (`SwapFile::prefetch`). Pages in the
    /// pool, or not stored, cost a lookup.
    pub fn prefetch(&self, ranges: &[(u64, usize)]) {
        let Some(sf) = self.swap.as_ref() else { return };
        let mut slots = Vec::new();
        let mut cursor = Cursor::new(&self.tree);
        for &(key, n) in ranges {
            for i in 0..n as u64 {
                let k = key.wrapping_add(i);
                if let Some(Stored::Swap { slot, .. }) = cursor.lock(k).get(k).map(|e| e.stored) {
                    if slots.last() != Some(&slot) {
                        slots.push(slot);
                    }
                }
            }
        }
        cursor.unlock();
        if !slots.is_empty() {
            sf.prefetch(&slots);
        }
    }

    /// Reads a written-back entry's object from the swap file into `dst`
    /// and expands it (the caller holds the entry's shard).
    fn load_from_swap(&self, shard: &Shard<Arc<Pool>>, key: u64, e: &Entry, dst: &mut [u8]) -> Result<(), TierError> {
        let Stored::Swap { slot, off, len } = e.stored else { unreachable!("a swap entry") };
        let sf = self.swap.as_ref().expect("swap entries exist only with a swap file");
        let mut obj = [0u8; PAGE_SIZE];
        let obj = &mut obj[..usize::from(len)];
        let r = sf.read_objs(&mut [(slot, off, &mut *obj)]).pop().expect("one result per request");
        r.map_err(|source| TierError::Swap { key, source })?;
        self.swapped_in(sf, &[slot]);
        if obj.len() == PAGE_SIZE {
            dst.copy_from_slice(obj);
            return Ok(());
        }
        let pool = shard.pool(e.pool).expect("a compressed swap entry's shard holds its pool");
        Self::expand(pool, key, obj, dst)
    }

    /// Loads the page stored under `key` into `dst` (one page). An exclusive
    /// load (the default) frees the entry.
    ///
    /// # Errors
    /// [`TierError::Decompress`] or [`TierError::Swap`] (a corrupt slot, an
    /// I/O error): `decompress_fail` is counted, `dst` holds garbage and the
    /// entry stays, so nothing is lost. [`TierError::BadFolio`] for a `dst`
    /// that is not one page.
    pub fn load(&self, key: u64, dst: &mut [u8]) -> Result<LoadOutcome, TierError> {
        if dst.len() != PAGE_SIZE {
            return Err(TierError::BadFolio { len: dst.len() });
        }
        let mut shard = self.tree.lock(key);
        let Some(e) = shard.get(key) else { return Ok(LoadOutcome::NotFound) };
        let r = match e.stored {
            Stored::SameFilled(v) => {
                fill(dst, v);
                Ok(())
            }
            Stored::Pool { .. } => {
                self.pool_loaded(&e);
                Self::load_from_pool(shard.pool(e.pool).expect("a pool entry's shard holds its pool"), key, &e, dst)
            }
            Stored::Swap { .. } => self.load_from_swap(&shard, key, &e, dst),
        };
        if let Err(err) = r {
            inc(&self.counters.decompress_fail, 1);
            return Err(err);
        }
        let dropped = self.loaded(&mut shard, key);
        drop(shard);
        drop(dropped);
        Ok(LoadOutcome::Loaded)
    }

    /// Loads `dst.len() / PAGE_SIZE` pages from keys `key`, `key + 1`, ...
    /// (a folio): as many [`load`](Self::load)s, but batched. Each entry's
    /// object is taken under its shard lock (copied out of the pool, or
    /// noted for the swap file); then, with no lock held, the swap file's
    /// objects are read together (one `preadv` per run of neighbouring
    /// slots, each slot once), and every compressed object is decompressed
    /// in `decompress_batch` calls of the pool's batch size. `out[i]` is
    /// page `i`'s outcome; a page that fails keeps its entry, as `load`.
    ///
    /// At the end each entry is freed under its lock if the key still
    /// holds the same entry (the same id: its content cannot have changed,
    /// wherever writeback moved it); a page whose entry changed meanwhile
    /// (invalidated, or stored again) is loaded again with `load`.
    ///
    /// A page whose outcome is `NotFound` is left as it was in `dst`.
    pub fn load_many(&self, key: u64, dst: &mut [u8]) -> LoadOutcomes {
        if dst.is_empty() || dst.len() % PAGE_SIZE != 0 {
            return smallvec::smallvec![Err(TierError::BadFolio { len: dst.len() })];
        }
        let n = dst.len() / PAGE_SIZE;
        let mut out = LoadOutcomes::with_capacity(n);
        // Objects copied out or read in, back to back: only what is written
        // is read, so the buffer is reused as it is (zeroing 64 KiB per
        // fault cost the handler ~2 µs of its ~80 per folio).
        let mut scratch = self.buffers.take(n * PAGE_SIZE);
        let objs = &mut scratch[..n * PAGE_SIZE];
        let mut used = 0;
        let mut taken: SmallVec<[Taken; INLINE]> = SmallVec::with_capacity(n);
        // (slot, offset, at, len, index in `taken`) of the swap file's objects.
        let mut reads: Vec<(zmem_swapfile::Slot, u16, usize, usize, usize)> = Vec::new();
        // A folio's keys share a shard: one lock for all of them.
        let mut cursor = Cursor::new(&self.tree);
        let mut dropped = Vec::new();
        for (i, page) in dst.chunks_exact_mut(PAGE_SIZE).enumerate() {
            let k = key.wrapping_add(i as u64);
            let shard = cursor.lock(k);
            let Some(e) = shard.get(k) else {
                out.push(Ok(LoadOutcome::NotFound));
                continue;
            };
            let pool = if e.holds_pool() { shard.pool(e.pool).cloned() } else { None };
            let len = match e.stored {
                Stored::SameFilled(v) => {
                    fill(page, v);
                    dropped.extend(self.loaded(shard, k));
                    out.push(Ok(LoadOutcome::Loaded));
                    continue;
                }
                Stored::Pool { handle, len } => {
                    let len = len as usize;
                    let p = pool.as_ref().expect("a pool entry's shard holds its pool");
                    let at = &mut objs[used..used + len];
                    if let Err(err) = p.zs.map(handle, |o| at.copy_from_slice(&o[..len])) {
                        inc(&self.counters.decompress_fail, 1);
                        out.push(Err(TierError::Pool(err)));
                        continue;
                    }
                    self.pool_loaded(&e);
                    len
                }
                Stored::Swap { slot, off, len } if self.swap.is_some() => {
                    reads.push((slot, off, used, usize::from(len), taken.len()));
                    usize::from(len)
                }
                Stored::Swap { .. } => unreachable!("swap entries exist only with a swap file"),
            };
            taken.push(Taken { page: i, id: e.id, pool, at: used, len });
            used += len;
            out.push(Ok(LoadOutcome::Loaded));
        }
        cursor.unlock();
        drop(dropped);
        if taken.is_empty() {
            return out;
        }
        // The swap file's objects, each slot read once.
        let mut failed: SmallVec<[Option<TierError>; INLINE]> = (0..n).map(|_| None).collect();
        if !reads.is_empty() {
            let sf = self.swap.as_ref().expect("checked above");
            let mut rest = &mut objs[..used];
            let mut base = 0;
            // `reads` is in `objs` order (pushed as `used` grew).
            let mut reqs: Vec<(zmem_swapfile::Slot, u16, &mut [u8])> = Vec::with_capacity(reads.len());
            for &(slot, off, at, len, _) in &reads {
                let tail = std::mem::take(&mut rest);
                let (_, tail) = tail.split_at_mut(at - base);
                let (obj, tail) = tail.split_at_mut(len);
                rest = tail;
                base = at + len;
                reqs.push((slot, off, obj));
            }
            let mut read = Vec::with_capacity(reads.len());
            for (&(slot, .., t), res) in reads.iter().zip(sf.read_objs(&mut reqs)) {
                if let Err(source) = res {
                    let page = taken[t].page;
                    failed[page] = Some(TierError::Swap { key: key.wrapping_add(page as u64), source });
                } else {
                    read.push(slot);
                }
            }
            self.swapped_in(sf, &read);
        }
        // Expand: raw objects are copied, compressed ones decompressed in
        // batches per pool.
        let mut pages: SmallVec<[Option<&mut [u8]>; INLINE]> = dst.chunks_exact_mut(PAGE_SIZE).map(Some).collect();
        let mut batch: SmallVec<[usize; INLINE]> = SmallVec::new();
        for (t, tk) in taken.iter().enumerate() {
            if failed[tk.page].is_some() {
                continue;
            }
            if tk.len == PAGE_SIZE {
                pages[tk.page].as_deref_mut().expect("each page once").copy_from_slice(&objs[tk.at..tk.at + tk.len]);
            } else {
                batch.push(t);
            }
        }
        while let Some(&first) = batch.first() {
            let pool = taken[first].pool.clone().expect("a compressed object holds its pool");
            let max = pool.compressor.batch_size().max(1);
            let group: SmallVec<[usize; INLINE]> = batch
                .iter()
                .copied()
                .filter(|&t| taken[t].pool.as_ref().is_some_and(|p| Arc::ptr_eq(p, &pool)))
                .take(max)
                .collect();
            batch.retain(|t| !group.contains(t));
            let src: SmallVec<[&[u8]; INLINE]> =
                group.iter().map(|&t| &objs[taken[t].at..taken[t].at + taken[t].len]).collect();
            let mut d: SmallVec<[&mut [u8]; INLINE]> = SmallVec::with_capacity(group.len());
            for &t in &group {
                // Each page appears once in `taken`, so each is taken once.
                d.push(pages[taken[t].page].take().expect("each page once"));
            }
            let mut res: SmallVec<[Result<usize, DecompressError>; INLINE]> = smallvec::smallvec![Ok(0); group.len()];
            let whole = pool.compressor.decompress_batch(&src, &mut d, &mut res);
            for ((&t, r), dp) in group.iter().zip(res).zip(d) {
                let page = taken[t].page;
                let k = key.wrapping_add(page as u64);
                let err = match (&whole, r) {
                    (Err(e), _) => Some(TierError::from(e.clone())),
                    (Ok(()), Ok(n)) if n == PAGE_SIZE => None,
                    (Ok(()), Ok(got)) => Some(TierError::Decompress {
                        key: k,
                        source: DecompressError::LengthMismatch { codec: "codec", got, want: PAGE_SIZE },
                    }),
                    (Ok(()), Err(source)) => Some(TierError::Decompress { key: k, source }),
                };
                failed[page] = err;
                pages[page] = Some(dp);
            }
        }
        // Commit: free each entry that is still the one taken.
        let mut again = Vec::new();
        let mut cursor = Cursor::new(&self.tree);
        let mut dropped = Vec::new();
        for tk in &taken {
            let k = key.wrapping_add(tk.page as u64);
            let shard = cursor.lock(k);
            if shard.get(k).is_none_or(|e| e.id != tk.id) {
                again.push(tk.page);
                continue;
            }
            if let Some(err) = failed[tk.page].take() {
                inc(&self.counters.decompress_fail, 1);
                out[tk.page] = Err(err);
                continue;
            }
            dropped.extend(self.loaded(shard, k));
        }
        cursor.unlock();
        drop(dropped);
        drop(taken);
        for i in again {
            let page = pages[i].take().expect("each page once");
            out[i] = self.load(key.wrapping_add(i as u64), page);
        }
        out
    }

    /// A page of `key` was loaded (its shard locked by the caller): count
    /// it, then free the entry (exclusive loads) or mark it referenced.
    /// Returns a pool whose last entry this was, for the caller to drop
    /// after the shard lock.
    fn loaded(&self, shard: &mut Shard<Arc<Pool>>, key: u64) -> Option<Arc<Pool>> {
        inc(&self.counters.zswpin, 1);
        if self.cfg.exclusive_loads {
            let e = shard.remove(key).expect("looked up under the same lock");
            self.release(shard, e)
        } else {
            if let Some(mut e) = shard.get_mut(key) {
                e.referenced = true;
            }
            None
        }
    }

    /// The page under `key` was loaded and is mapped again as `page`,
    /// unchanged (a non-exclusive load): its entry stays as its clean copy,
    /// `cached` (see [`Entry`]), and is reused if the page is evicted
    /// unchanged. A pool entry is compared byte for byte then; one in the
    /// swap file (which costs no memory, only its share of a slot) by a
    /// 128-bit hash of the page taken now, so that no read is needed. A
    /// same-filled marker (free to make again) is dropped, and so is a
    /// written-back entry once the swap file is half full, and a pool entry
    /// unless `keep_pool` (a kept pool entry is memory beside the page: the
    /// caller keeps them only with room to spare). Returns whether the
    /// entry was kept.
    pub fn retain_clean(&self, key: u64, page: &[u8], keep_pool: bool) -> bool {
        self.retain_clean_unless(key, page, keep_pool, false)
    }

    /// As [`retain_clean`](Self::retain_clean), but a written-back entry
    /// goes too if `pool_has_room`: the caller saw room in the pool
    /// ([`pool_has_room`](Self::pool_has_room)). Kept, the entry would send
    /// the page back to its slot unchanged at its next eviction, and its
    /// next load to the disk (~100 µs, decrypted and checked) where the
    /// pool would serve it in a few; given up, the page is compressed into
    /// the pool then, and the slot is free now.
    pub fn retain_clean_unless(&self, key: u64, page: &[u8], keep_pool: bool, pool_has_room: bool) -> bool {
        let mut shard = self.tree.lock(key);
        let Some(e) = shard.get(key) else { return false };
        let keep = match e.stored {
            // Past half the swap file, slots are worth more than the
            // compressions a kept entry may save (do_swap_page frees the
            // slot when vm_swap_full()).
            Stored::Swap { .. } => !pool_has_room && !self.swap.as_ref().is_some_and(|s| s.half_full()),
            Stored::Pool { .. } => keep_pool,
            Stored::SameFilled(_) => false,
        };
        if !keep {
            self.free_locked(shard, key);
            return false;
        }
        let fresh = !e.cached;
        if fresh && e.in_pool() {
            // A kept copy goes first and free when the pool shrinks: it is
            // not placed among the entries by age (`Tier::ages`).
            self.ages.removed(e.id);
        }
        if let Some(mut m) = shard.get_mut(key) {
            m.cached = true;
            // A second trip round the LRU from now, as a store.
            m.referenced = true;
        }
        let in_swap = !e.in_pool();
        if in_swap {
            shard.set_sum(key, xxhash_rust::xxh3::xxh3_128(page));
        }
        if fresh {
            // Under the shard lock, as `release`'s decrement: never below zero.
            inc(&self.counters.cached_pages, 1);
        }
        drop(shard);
        if fresh {
            let list = if in_swap { &self.clean_swap } else { &self.clean };
            list.push([key / BLOCK as u64]);
            self.tidy_clean();
        }
        true
    }

    /// Keeps the clean list within twice the cached entries (items of
    /// entries reused or dropped stay behind until popped).
    fn tidy_clean(&self) {
        if self.clean.needs_rebuild() {
            self.clean.rebuild(|b| self.block_has(b, |e| e.cached && e.in_pool()));
        }
        if self.clean_swap.needs_rebuild() {
            self.clean_swap.rebuild(|b| self.block_has(b, |e| e.cached && !e.in_pool()));
        }
    }

    /// Frees cached pool entries, oldest first, until the pool is at most
    /// `target` bytes or none is left. Returns how many went. No I/O: each
    /// is a clean copy of a page that is mapped. With a target of 0 it
    /// frees them all, and the swap file's too: a full swap file does that,
    /// for their slots.
    ///
    /// Cached entries in the swap file take no pool memory, and are on a
    /// list of their own (`clean_swap`). On one list with the pool's, a
    /// pool over its limit freed every one of them too, looking for pool
    /// memory that they did not hold (reclaim's `shrink_to_limit` runs before
    /// each pass): the folios a fork loaded back were then compressed
    /// again, not stored into their entries, in half of the runs of
    /// `after_a_fork_that_execs_…` (`tests/pager.rs`).
    pub(crate) fn drop_clean(&self, target: usize) -> usize {
        let mut done = self.drop_listed(true, target > 0, |t| t.pool_total_size() > target);
        if target == 0 {
            done += self.drop_listed(false, false, |_| true);
        }
        if done > 0 && target == 0 {
            self.compact();
        }
        inc(&self.counters.cached_dropped, done as u64);
        done
    }

    /// Frees cached entries of one kind, the pool's (`in_pool`, the `clean`
    /// list) or the swap file's (`clean_swap`), oldest first, while `more`
    /// says so, compacting the pool between batches with `compact`. A
    /// block on both lists keeps its entries of the other kind. Returns how
    /// many went.
    fn drop_listed(&self, in_pool: bool, compact: bool, more: impl Fn(&Self) -> bool) -> usize {
        let list = if in_pool { &self.clean } else { &self.clean_swap };
        let mut done = 0;
        while more(self) {
            let items = list.pop_cold(4);
            if items.is_empty() {
                break;
            }
            for b in items {
                // A block's keys share one shard.
                let first = b * BLOCK as u64;
                let mut dropped = Vec::new();
                let mut shard = self.tree.lock(first);
                for k in first..=first + (BLOCK - 1) as u64 {
                    if shard.get(k).is_some_and(|e| e.cached && e.in_pool() == in_pool) {
                        done += usize::from(self.free_in(&mut shard, k, &mut dropped));
                    }
                }
                drop(shard);
                drop(dropped);
            }
            if compact && done > 0 && more(self) {
                self.compact();
            }
        }
        done
    }

    /// Drops the entry under `key` if it is a cached clean copy (the page
    /// was written since it was loaded). Returns whether it did.
    pub fn drop_cached(&self, key: u64) -> bool {
        let shard = self.tree.lock(key);
        if !shard.get(key).is_some_and(|e| e.cached) {
            return false;
        }
        inc(&self.counters.cached_dropped, 1);
        self.free_locked(shard, key)
    }

    /// Drops the entry under `key`, if any.
    pub fn invalidate(&self, key: u64) -> bool {
        self.free_locked(self.tree.lock(key), key)
    }

    /// Removes the entry under `key` from `shard` (its lock held) and frees
    /// what it holds; a pool whose last entry it was is dropped after the
    /// lock. Returns whether there was one.
    pub(crate) fn free_locked(&self, mut shard: ShardGuard<'_>, key: u64) -> bool {
        let mut dropped = Vec::new();
        let found = self.free_in(&mut shard, key, &mut dropped);
        drop(shard);
        drop(dropped);
        found
    }

    /// [`free_locked`](Self::free_locked) for a caller that goes on holding
    /// the shard: a pool whose last entry this was goes in `dropped`, for
    /// the caller to drop after the lock.
    pub(crate) fn free_in(&self, shard: &mut Shard<Arc<Pool>>, key: u64, dropped: &mut Vec<Arc<Pool>>) -> bool {
        let Some(e) = shard.remove(key) else { return false };
        dropped.extend(self.release(shard, e));
        true
    }

    /// Whether `key` has an entry, and where.
    pub fn lookup(&self, key: u64) -> Option<Stored> {
        self.tree.lock(key).get(key).map(|e| e.stored)
    }
}
