//! Store: compress a folio into the current pool, or reject it.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use zmem_common::LockExt;
use zmem_common::PAGE_SIZE;
use zmem_compress::batch::{Batch, ItemError, Op, Ticket};
use zmem_compress::CompressError;

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

/// One folio for [`Tier::store_many`].
#[derive(Debug, Clone, Copy)]
pub struct StoreRequest<'a> {
    /// The key of its first page; page `i` is `key + i`.
    pub key: u64,
    /// 1..=512 pages.
    pub folio: &'a [u8],
    /// As [`Tier::store_reusing`]: a page equal to its cached entry keeps it.
    pub reuse: bool,
}

/// A folio's store between its checks and its commit.
struct Prep {
    stored: Vec<Option<Stored>>,
    /// The pages to compress.
    todo: Vec<usize>,
    /// Pages whose cached entry was kept (they are stored already).
    reused: Vec<bool>,
    /// Set at the first page that failed: the folio is rejected.
    failed: Option<RejectReason>,
}

impl Prep {
    fn nreused(&self) -> usize {
        self.reused.iter().filter(|&&r| r).count()
    }

    /// The pool's limit (zswap_check_limits), for a folio with pages to
    /// store that has not failed yet.
    fn check_limit(&mut self, tier: &Tier) {
        if self.failed.is_none() && self.nreused() < self.stored.len() && !tier.may_store() {
            self.failed = Some(RejectReason::PoolLimit);
        }
    }
}

/// A page of `store_many`'s work: (request, page in its folio).
type Work = (usize, usize);
/// A batch as `submit` answered it.
type Submitted = Result<Ticket, zmem_compress::Error>;

fn page_of(folio: &[u8], i: usize) -> &[u8] {
    &folio[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]
}

/// Entry ids: unique per store, handed to threads in blocks so that a store
/// does not touch a shared counter per page.
static NEXT_ID_BLOCK: AtomicU64 = AtomicU64::new(1);
/// Four 64 KiB folios: one shared add per four stores, and a clock that
/// runs at most 64 pages a storing thread ahead (with 1024, the reclaim
/// thread and two handlers put it ~3k pages ahead, a fifth of what a 64M
/// limit's pool holds, and ages were read that much too old).
const ID_BLOCK: u64 = 64;

/// The store clock: about the next id to be handed out (ids go to threads
/// in blocks of `ID_BLOCK`, so this runs up to a block ahead of a store).
/// `clock - id` is an entry's age in pages stored since; a store that
/// reuses a clean copy gives it a new id ([`Tier::reuse_cached`]), so the
/// age runs from the page's last eviction.
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
        self.store_one(StoreRequest { key, folio, reuse: false })
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
        self.store_one(StoreRequest { key, folio, reuse: true })
    }

    fn store_one(&self, req: StoreRequest<'_>) -> Result<StoreOutcome, TierError> {
        self.store_many(&[req]).pop().expect("one result per request")
    }

    /// Stores several folios, each as [`store`](Self::store) (or
    /// [`store_reusing`](Self::store_reusing)) would, all or nothing per
    /// folio; one result per request, in order.
    ///
    /// With a compressor that runs beside the caller (the engines, a
    /// device: [`zmem_compress::BatchCompressor::runs_beside`]), every folio is classified,
    /// then the pages of all of them are submitted before the first batch
    /// is waited on, so they compress at once on every engine while this
    /// thread runs its own share (a reclaim pass that stored folio by folio
    /// left the other core idle: `zmem usemem --workers 1`), then each is
    /// checked against the pool's limit and committed in turn. Otherwise
    /// each folio goes through its checks, the synchronous call and its
    /// commit before the next.
    pub fn store_many(&self, reqs: &[StoreRequest<'_>]) -> Vec<Result<StoreOutcome, TierError>> {
        let pool = self.current();
        if !pool.compressor.runs_beside() {
            // Folio by folio: each one's checks see the pool as the folios
            // before it left it.
            return reqs
                .iter()
                .map(|r| {
                    let mut p = self.prepare(r)?;
                    p.check_limit(self);
                    if p.failed.is_none() {
                        p.failed = self.compress_into_pool(&pool, r.folio, &mut p).err();
                    }
                    Ok(self.commit(&pool, r.key, p))
                })
                .collect();
        }
        let mut preps: Vec<Result<Prep, TierError>> = reqs.iter().map(|r| self.prepare(r)).collect();
        self.compress_beside(&pool, reqs, &mut preps);
        // The pool's limit is checked as each folio is committed, with the
        // objects of the pass counted: checked before any commit, every
        // check passed and the pass took the pool past its limit, and the
        // reclaim thread's `shrink_to_limit` then dropped the clean copies
        // a walk had kept (the walk test compressed ~18k of ~19k pages).
        // Here the shrinker that a full pool runs gives kept entries their
        // second chance.
        reqs.iter()
            .zip(preps)
            .map(|(r, p)| {
                p.map(|mut p| {
                    p.check_limit(self);
                    self.commit(&pool, r.key, p)
                })
            })
            .collect()
    }

    /// The checks before compression: the folio's shape, its same-filled
    /// pages and the pages whose cached entry it keeps.
    fn prepare(&self, r: &StoreRequest<'_>) -> Result<Prep, TierError> {
        let n = r.folio.len() / PAGE_SIZE;
        if r.folio.is_empty() || r.folio.len() % PAGE_SIZE != 0 || n > MAX_FOLIO_PAGES {
            return Err(TierError::BadFolio { len: r.folio.len() });
        }
        let mut p = Prep { stored: vec![None; n], todo: Vec::with_capacity(n), reused: vec![false; n], failed: None };
        for (i, page) in r.folio.chunks_exact(PAGE_SIZE).enumerate() {
            match same_filled(page) {
                Some(v) => p.stored[i] = Some(Stored::SameFilled(v)),
                None if r.reuse && self.reuse_cached(r.key.wrapping_add(i as u64), page) => p.reused[i] = true,
                None => p.todo.push(i),
            }
        }
        Ok(p)
    }

    /// Puts a prepared folio's entries in the tree, or rejects it (its pool
    /// objects freed) if any page failed.
    fn commit(&self, pool: &Arc<Pool>, key: u64, p: Prep) -> StoreOutcome {
        let n = p.stored.len();
        let nreused = p.nreused();
        if let Some(reason) = p.failed {
            for s in p.stored.iter().flatten() {
                if let Stored::Pool { handle, .. } = s {
                    let r = pool.zs.free(*handle);
                    debug_assert!(r.is_ok(), "{r:?}");
                }
            }
            return self.reject(key, n, reason);
        }
        let first_id = next_ids(n);
        let mut lru_items = Vec::with_capacity(p.todo.len());
        let (mut same, mut raw) = (0, 0);
        // A folio's keys share a shard: one lock for all of them.
        let mut cursor = Cursor::new(&self.tree);
        let mut dropped = Vec::new();
        for (i, s) in p.stored.into_iter().enumerate() {
            if p.reused[i] {
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
                    self.ages.stored(e.id);
                    if len as usize == PAGE_SIZE {
                        raw += 1;
                        inc(&c.stored_incompressible_pages, 1);
                    }
                    lru_items.push(k / BLOCK as u64);
                }
                Stored::Swap { .. } => unreachable!("stores never go straight to swap"),
            }
            let old = shard.insert(k, e, pool);
            dropped.extend(old.and_then(|o| self.release(shard, o)));
        }
        cursor.unlock();
        drop(dropped);
        self.lru.push(lru_items);
        self.trim_lru();
        let c = &self.counters;
        inc(&c.zswpout, (n - nreused) as u64);
        inc(&c.cached_reused, nreused as u64);
        StoreOutcome::Stored { same_filled: same, incompressible: raw }
    }

    /// Compresses a folio's pages to do in batches, on this thread, and
    /// puts each in the pool.
    fn compress_into_pool(&self, pool: &Pool, folio: &[u8], p: &mut Prep) -> Result<(), RejectReason> {
        let bs = pool.compressor.batch_size().max(1);
        let mut scratch = self.buffers.take(bs * PAGE_SIZE);
        let mut results = vec![Ok(0); bs];
        for chunk in p.todo.chunks(bs) {
            let srcs: Vec<&[u8]> = chunk.iter().map(|&i| page_of(folio, i)).collect();
            let mut dsts: Vec<&mut [u8]> = scratch.chunks_exact_mut(PAGE_SIZE).take(chunk.len()).collect();
            let res = &mut results[..chunk.len()];
            if pool.compressor.compress_batch(&srcs, &mut dsts, res).is_err() {
                return Err(self.fail(RejectReason::CompressFail));
            }
            for (j, &i) in chunk.iter().enumerate() {
                let out = res[j].as_ref().map(|&n| &dsts[j][..n]);
                p.stored[i] = Some(self.place(pool, srcs[j], out)?);
            }
        }
        Ok(())
    }

    /// [`compress_into_pool`](Self::compress_into_pool) for the pages of
    /// every folio at once, through submit and wait: a window of pages is
    /// submitted, then waited on (the waiter runs its own share and helps),
    /// so that the compressor's queues never fill. A folio stops at its
    /// first failed page; the others go on.
    fn compress_beside(&self, pool: &Pool, reqs: &[StoreRequest<'_>], preps: &mut [Result<Prep, TierError>]) {
        let bs = pool.compressor.batch_size().max(1);
        let work: Vec<(usize, usize)> = preps
            .iter()
            .enumerate()
            .filter_map(|(r, p)| p.as_ref().ok().filter(|p| p.failed.is_none()).map(|p| (r, p)))
            .flat_map(|(r, p)| p.todo.iter().map(move |&i| (r, i)))
            .collect();
        let page = |(r, i): (usize, usize)| page_of(reqs[r].folio, i);
        let mut spare = std::mem::take(&mut *self.batches.lock_ok());
        // A sliding window: the oldest batch is placed in the pool while the
        // ones after it still run, and a new one is submitted as soon as it
        // is placed, so the device never waits on the caller's placing.
        let depth = pool.compressor.batches_in_flight().max(1);
        let mut inflight: VecDeque<(&[Work], Submitted)> = VecDeque::with_capacity(depth);
        let mut chunks = work.chunks(bs);
        loop {
            if inflight.len() < depth {
                if let Some(chunk) = chunks.next() {
                    let mut batch = spare.pop().unwrap_or_else(|| Batch::new(Op::Compress));
                    batch.refill(Op::Compress, chunk.iter().map(|&w| page(w)), |src| src.len());
                    inflight.push_back((chunk, pool.compressor.submit(batch)));
                    continue;
                }
            }
            let Some((chunk, ticket)) = inflight.pop_front() else { break };
            let batch = match ticket {
                Ok(t) => pool.compressor.wait(t),
                Err(_) => {
                    for &(r, _) in chunk {
                        if let Ok(p) = &mut preps[r] {
                            if p.failed.is_none() {
                                p.failed = Some(self.fail(RejectReason::CompressFail));
                            }
                        }
                    }
                    continue;
                }
            };
            for (item, &(r, i)) in batch.items.iter().zip(chunk) {
                let Ok(p) = &mut preps[r] else { unreachable!("only prepared folios have work") };
                if p.failed.is_some() {
                    continue;
                }
                let placed = match item.output() {
                    Some(Ok(obj)) => self.place(pool, page((r, i)), Ok(obj)),
                    Some(Err(ItemError::Compress(e))) => self.place(pool, page((r, i)), Err(e)),
                    // Another error (none from our own compress batch).
                    _ => Err(self.fail(RejectReason::CompressFail)),
                };
                match placed {
                    Ok(s) => p.stored[i] = Some(s),
                    Err(reason) => p.failed = Some(reason),
                }
            }
            spare.push(batch);
        }
        // One window's worth (each item owns a page in and out: 1 MiB for
        // the engines' 128 pages).
        spare.truncate(depth);
        *self.batches.lock_ok() = spare;
    }

    /// One compressed page (or, if it did not compress and writeback may
    /// take it, the page itself) into the pool.
    fn place(&self, pool: &Pool, page: &[u8], out: Result<&[u8], &CompressError>) -> Result<Stored, RejectReason> {
        let (obj, raw): (&[u8], bool) = match out {
            Ok(obj) => (obj, false),
            Err(CompressError::Poor) if self.writeback_enabled() => (page, true),
            Err(CompressError::Poor) => return Err(self.fail(RejectReason::CompressPoor)),
            Err(_) => return Err(self.fail(RejectReason::CompressFail)),
        };
        let Ok(handle) = pool.zs.malloc_copy(obj) else {
            return Err(self.fail(RejectReason::AllocFail));
        };
        let len = if raw { PAGE_SIZE } else { obj.len() } as u32;
        Ok(Stored::Pool { handle, len })
    }

    /// Counts a folio's rejection for `reason` (the pool's limit is counted
    /// where it is checked).
    fn fail(&self, reason: RejectReason) -> RejectReason {
        let c = &self.counters;
        match reason {
            RejectReason::CompressPoor => inc(&c.reject_compress_poor, 1),
            RejectReason::CompressFail => inc(&c.reject_compress_fail, 1),
            RejectReason::AllocFail => inc(&c.reject_alloc_fail, 1),
            RejectReason::PoolLimit => {}
        }
        reason
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
        // Stored again, as of now: its age (the store clock less its id,
        // `cold_pool_loads`) starts over. With the id it had, a page read
        // over and over and evicted unchanged each time aged with every
        // trip: on `scripts/node-random.js` under 200M, 3.4M of 3.4M loads
        // counted as loads of the pool's coldest entries. A writeback,
        // load or recompression that took the old id finds it changed and
        // lets the entry be (they re-check the id under the lock).
        e.id = next_ids(1);
        if e.in_pool() {
            // No longer a kept copy: placed again, at its new id.
            self.ages.stored(e.id);
        }
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
