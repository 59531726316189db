//! Store: compress a folio into the current pool, or reject it.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use zmem_compress::CompressError;
use zmem_zsmalloc::PAGE_SIZE;

use crate::stats::{dec, inc};
use crate::tree::BLOCK;
use crate::{Cursor, Entry, Pool, Stored, Tier, TierError, MAX_FOLIO_PAGES};

/// Why a store was rejected (each has its counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// The pool is at its limit and the shrinker could not make room.
    PoolLimit,
    /// A page did not compress and writeback is off.
    CompressPoor,
    /// The compressor failed.
    CompressFail,
    /// The pool could not allocate.
    AllocFail,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    /// Every page is stored; how many as same-filled markers and raw.
    Stored { same_filled: usize, incompressible: usize },
    /// Nothing is stored, and older entries for these keys are gone.
    Rejected(RejectReason),
}

/// Entry ids: unique per store, handed to threads in blocks so that a store
/// does not touch a shared counter per page.
static NEXT_ID_BLOCK: AtomicU64 = AtomicU64::new(1);
const ID_BLOCK: u64 = 1024;

/// The store clock: about the next id to be handed out (ids go to threads
/// in blocks of `ID_BLOCK`, so this runs up to a block ahead of a store).
/// `clock - id` is an entry's age in pages stored since.
pub(crate) fn id_clock() -> u32 {
    NEXT_ID_BLOCK.load(Ordering::Relaxed) as u32
}

pub(crate) fn next_ids(n: usize) -> u32 {
    thread_local!(static IDS: Cell<(u64, u64)> = const { Cell::new((0, 0)) });
    IDS.with(|c| {
        let (mut next, mut end) = c.get();
        if next + n as u64 > end {
            let take = ID_BLOCK.max(n as u64);
            next = NEXT_ID_BLOCK.fetch_add(take, Ordering::Relaxed);
            end = next + take;
        }
        c.set((next + n as u64, end));
        // An entry keeps 32 bits of its id (`tree::Packed`): a writeback or
        // LRU item would mistake a new entry for the one it picked only if
        // 2^32 stores came between.
        next as u32
    })
}

/// The repeated word if every 8-byte word of `page` is the same.
fn same_filled(page: &[u8]) -> Option<u64> {
    let (first, rest) = page.split_at(8);
    let v = u64::from_ne_bytes(first.try_into().ok()?);
    rest.chunks_exact(8).all(|w| w == first).then_some(v)
}

impl Tier {
    /// zswap_check_limits, with hysteresis; shrinks inline when it can.
    fn may_store(&self) -> bool {
        let total = self.pool_total_size();
        let (max_bytes, accept_bytes) =
            (self.max_bytes.load(Ordering::Relaxed), self.accept_bytes.load(Ordering::Relaxed));
        if total >= max_bytes {
            inc(&self.counters.pool_limit_hit, 1);
            self.full.store(true, Ordering::Relaxed);
        } else if self.full.load(Ordering::Relaxed) && total <= accept_bytes {
            self.full.store(false, Ordering::Relaxed);
        }
        if !self.full.load(Ordering::Relaxed) {
            return true;
        }
        // There is no kswapd here: the store that finds the pool full runs
        // the shrinker itself, down to the accept threshold: clean copies
        // first (no I/O), then writeback.
        if !self.writeback_enabled() && self.counters.cached_pages.load(Ordering::Relaxed) > 0 {
            self.drop_clean(accept_bytes);
            if self.pool_total_size() <= accept_bytes {
                self.full.store(false, Ordering::Relaxed);
                return true;
            }
        }
        if self.writeback_enabled() {
            self.shrinker().shrink_to(accept_bytes);
            if self.pool_total_size() <= accept_bytes {
                self.full.store(false, Ordering::Relaxed);
                return true;
            }
        }
        false
    }

    /// Stores `folio` (1..=512 pages) under keys `key`, `key + 1`, … All or
    /// nothing: on a rejection no page stays stored and older entries for
    /// these keys are invalidated (as zswap_store does).
    ///
    /// # Errors
    /// [`TierError::BadFolio`] (nothing changes); [`TierError::Compress`] if
    /// the batch call itself is refused (a bug).
    pub fn store(&self, key: u64, folio: &[u8]) -> Result<StoreOutcome, TierError> {
        self.store_folio(key, folio, false)
    }

    /// [`store`](Self::store) for a folio that was loaded and kept its
    /// entries as clean copies ([`retain_clean`](Self::retain_clean)): a
    /// page equal to its cached entry keeps that entry, and is neither
    /// compressed nor allocated again (`cached_reused`). Equality is checked
    /// on the bytes (the entry is decompressed and compared), so a page
    /// written since its load, however the caller tracks writes, is simply
    /// compressed anew.
    ///
    /// # Errors
    /// As [`store`](Self::store).
    pub fn store_reusing(&self, key: u64, folio: &[u8]) -> Result<StoreOutcome, TierError> {
        self.store_folio(key, folio, true)
    }

    fn store_folio(&self, key: u64, folio: &[u8], reuse: bool) -> Result<StoreOutcome, TierError> {
        let n = folio.len() / PAGE_SIZE;
        if folio.is_empty() || folio.len() % PAGE_SIZE != 0 || n > MAX_FOLIO_PAGES {
            return Err(TierError::BadFolio { len: folio.len() });
        }
        let mut stored: Vec<Option<Stored>> = vec![None; n];
        let pages: Vec<&[u8]> = folio.chunks_exact(PAGE_SIZE).collect();
        let mut todo = Vec::with_capacity(n);
        // Pages whose cached entry was kept (they are stored already).
        let mut reused = vec![false; n];
        for (i, p) in pages.iter().enumerate() {
            match same_filled(p) {
                Some(v) => stored[i] = Some(Stored::SameFilled(v)),
                None if reuse && self.reuse_cached(key.wrapping_add(i as u64), p) => reused[i] = true,
                None => todo.push(i),
            }
        }
        let nreused = reused.iter().filter(|&&r| r).count();
        if nreused < n && !self.may_store() {
            return Ok(self.reject(key, n, RejectReason::PoolLimit));
        }
        let pool = self.current();
        if let Err(reason) = self.compress_into_pool(&pool, &pages, &todo, &mut stored) {
            for s in stored.iter().flatten() {
                if let Stored::Pool { handle, .. } = s {
                    let r = pool.zs.free(*handle);
                    debug_assert!(r.is_ok(), "{r:?}");
                }
            }
            return Ok(self.reject(key, n, reason));
        }
        let first_id = next_ids(n);
        let mut lru_items = Vec::with_capacity(todo.len());
        let (mut same, mut raw) = (0, 0);
        // A folio's keys share a shard: one lock for all of them.
        let mut cursor = Cursor::new(&self.tree);
        let mut dropped = Vec::new();
        for (i, s) in stored.into_iter().enumerate() {
            if reused[i] {
                continue;
            }
            let s = s.expect("every page was stored");
            let e = Entry {
                id: first_id.wrapping_add(i as u32),
                pool: pool.id,
                stored: s,
                referenced: true,
                cached: false,
            };
            let k = key.wrapping_add(i as u64);
            let c = &self.counters;
            let shard = cursor.lock(k);
            // The gauges go up under the shard lock, before the entry is
            // seen: an invalidate takes them down under the same lock, so
            // they never wrap below zero.
            inc(&c.stored_pages, 1);
            match s {
                Stored::SameFilled(_) => {
                    same += 1;
                    inc(&c.same_filled_pages, 1);
                }
                Stored::Pool { len, .. } => {
                    if len as usize == PAGE_SIZE {
                        raw += 1;
                        inc(&c.stored_incompressible_pages, 1);
                    }
                    lru_items.push(k / BLOCK as u64);
                }
                Stored::Swap { .. } => unreachable!("stores never go straight to swap"),
            }
            let old = shard.insert(k, e, &pool);
            dropped.extend(old.and_then(|o| self.release(shard, o)));
        }
        cursor.unlock();
        drop(dropped);
        self.lru.push(lru_items);
        self.trim_lru();
        let c = &self.counters;
        inc(&c.zswpout, (n - nreused) as u64);
        inc(&c.cached_reused, nreused as u64);
        Ok(StoreOutcome::Stored { same_filled: same, incompressible: raw })
    }

    /// Compresses the pages `todo` in batches and puts each in the pool.
    fn compress_into_pool(
        &self,
        pool: &Pool,
        pages: &[&[u8]],
        todo: &[usize],
        stored: &mut [Option<Stored>],
    ) -> Result<(), RejectReason> {
        let bs = pool.compressor.batch_size().max(1);
        let mut scratch = self.buffers.take(bs * PAGE_SIZE);
        let mut results = vec![Ok(0); bs];
        for chunk in todo.chunks(bs) {
            let srcs: Vec<&[u8]> = chunk.iter().map(|&i| pages[i]).collect();
            let mut dsts: Vec<&mut [u8]> = scratch.chunks_exact_mut(PAGE_SIZE).take(chunk.len()).collect();
            let res = &mut results[..chunk.len()];
            if pool.compressor.compress_batch(&srcs, &mut dsts, res).is_err() {
                inc(&self.counters.reject_compress_fail, 1);
                return Err(RejectReason::CompressFail);
            }
            for (j, &i) in chunk.iter().enumerate() {
                let (obj, raw): (&[u8], bool) = match &res[j] {
                    Ok(len) => (&dsts[j][..*len], false),
                    Err(CompressError::Poor) if self.writeback_enabled() => (pages[i], true),
                    Err(CompressError::Poor) => {
                        inc(&self.counters.reject_compress_poor, 1);
                        return Err(RejectReason::CompressPoor);
                    }
                    Err(_) => {
                        inc(&self.counters.reject_compress_fail, 1);
                        return Err(RejectReason::CompressFail);
                    }
                };
                let Ok(handle) = pool.zs.malloc_copy(obj) else {
                    inc(&self.counters.reject_alloc_fail, 1);
                    return Err(RejectReason::AllocFail);
                };
                let len = if raw { PAGE_SIZE } else { obj.len() } as u32;
                stored[i] = Some(Stored::Pool { handle, len });
            }
        }
        Ok(())
    }

    /// Whether `key` holds a cached entry whose page equals `page`; if so
    /// the entry is the page's stored copy from now on (no longer cached).
    /// The object is expanded and compared under the shard lock, so the
    /// shrinker cannot free it in between.
    fn reuse_cached(&self, key: u64, page: &[u8]) -> bool {
        let mut shard = self.tree.lock(key);
        let Some(e) = shard.get(key).filter(|e| e.cached) else { return false };
        let same = match e.stored {
            Stored::Pool { .. } => {
                let pool = shard.pool(e.pool).expect("a pool entry's shard holds its pool");
                let mut x = self.buffers.take(PAGE_SIZE);
                let x = &mut x[..PAGE_SIZE];
                Self::load_from_pool(pool, key, &e, x).is_ok() && x[..] == *page
            }
            Stored::Swap { .. } => shard.sum(key) == Some(xxhash_rust::xxh3::xxh3_128(page)),
            Stored::SameFilled(_) => false,
        };
        if !same {
            return false;
        }
        shard.clear_sum(key);
        let mut e = shard.get_mut(key).expect("looked up under the same lock");
        e.cached = false;
        e.referenced = true;
        dec(&self.counters.cached_pages, 1);
        true
    }

    fn reject(&self, key: u64, n: usize, reason: RejectReason) -> StoreOutcome {
        for i in 0..n as u64 {
            self.invalidate(key.wrapping_add(i));
        }
        StoreOutcome::Rejected(reason)
    }
}
