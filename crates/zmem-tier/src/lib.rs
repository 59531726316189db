//! zmem's tier: zswap as a library.
//!
//! `Tier::store` compresses a folio (1..512 pages) in batches through the
//! current pool's [`BatchCompressor`] and keeps the objects in its zs pool;
//! `Tier::load` brings a page back; `Tier::invalidate` drops one. When the
//! pool passes its limit, the shrinker writes the coldest entries back to an
//! (encrypted) swap file. The compressor can be switched at any time: new
//! stores go to a new pool, old entries keep loading from theirs.
//!
//! | file | what |
//! |---|---|
//! | `store.rs` | `Tier::store`: same-filled markers, batch compression into the pool, rejections |
//! | `load.rs` | `Tier::load`, `invalidate`, `lookup` |
//! | `writeback.rs` | `Tier::writeback`: the coldest entries to the swap file, in batches |
//! | `recompress.rs` | `Tier::recompress`: entries to a stronger compressor's pool, as zram's recompress |
//! | `shrinker.rs` | `Shrinker::{count, scan}` and `shrink_to`, which a store that finds the pool full runs |
//! | `pool.rs`, `entry.rs`, `tree.rs`, `lru.rs` | a refcounted compressor+zs pool; entries; the sharded tree; the LRU |
//! | `config.rs`, `error.rs`, `stats.rs` | settings, errors, counters (zswap's debugfs names) |
//!
//! # Lock order
//! The tier's locks are steps 3 to 6 of the project's one lock order
//! (ARCHITECTURE.md, "Lock order"): `shrink_lock`, a tree shard, then a
//! leaf inside it; the LRU's mutex and the `current` pool lock are leaves.
//!
//! # Entry lifecycle
//! ```text
//! store ──► SameFilled ─────────────────────────────┐
//!   │                                               ├─► load (exclusive) / invalidate / store again ─► freed
//!   └─────► Pool{handle} ──(shrinker)──► Swap{slot} ┘
//!              ▲ on the LRU            (off the LRU)
//!              └─ recompress: same entry, a new object in a stronger pool
//! ```
//! A non-exclusive load leaves the entry where it is and sets `referenced`.
#![forbid(unsafe_code)]

mod ages;
mod buffers;
mod config;
pub mod entry;
mod error;
mod export;
mod load;
pub mod lru;
pub mod pool;
mod recompress;
mod sample;
mod shrinker;
pub mod stats;
mod store;
mod sync;
pub mod tree;
mod writeback;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use zmem_common::ConfigError;
use zmem_common::PAGE_SIZE;
use zmem_compress::{BatchCompressor, Engines, Sequential};
use zmem_swapfile::SwapFile;
use zmem_zsmalloc::Mempool;

pub use config::{total_ram, TierConfig};
pub use entry::{Entry, Stored};
pub use error::TierError;
pub use export::Exported;
pub use load::{LoadOutcome, LoadOutcomes};
pub use pool::Pool;
pub use recompress::Recompressed;
pub use sample::CodecSample;
pub use shrinker::Shrinker;
pub use stats::TierStats;
pub use store::{RejectReason, StoreOutcome, StoreRequest};
pub use zmem_compress::CodecSpec;

use stats::{dec, Counters};
use tree::{Shard, Tree};

/// A locked shard of the tier's tree.
type ShardGuard<'a> = sync::MutexGuard<'a, Shard<Arc<Pool>>>;

/// Locks the shard of each key of a run in turn, keeping the lock while the
/// keys stay in one shard (a folio's do: see [`tree::BLOCK`]). Never holds
/// two shards. Pools an entry's release gives back are dropped by the
/// caller after [`unlock`](Self::unlock), as with a plain shard lock.
pub(crate) struct Cursor<'a> {
    tree: &'a Tree<Arc<Pool>>,
    cur: Option<(usize, ShardGuard<'a>)>,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(tree: &'a Tree<Arc<Pool>>) -> Self {
        Cursor { tree, cur: None }
    }

    /// The shard of `key`, locked.
    pub(crate) fn lock(&mut self, key: u64) -> &mut Shard<Arc<Pool>> {
        let i = Tree::<Arc<Pool>>::shard_of(key);
        if self.cur.as_ref().is_none_or(|(j, _)| *j != i) {
            // The old guard goes first: never two shards at once.
            self.cur = None;
            self.cur = Some((i, self.tree.lock_shard(i)));
        }
        &mut self.cur.as_mut().expect("just set").1
    }

    pub(crate) fn unlock(&mut self) {
        self.cur = None;
    }
}

/// The largest folio one store takes (2 MiB).
pub const MAX_FOLIO_PAGES: usize = 512;

/// A compressed-memory tier.
#[derive(Debug)]
pub struct Tier {
    cfg: TierConfig,
    tree: Tree<Arc<Pool>>,
    lru: lru::Lru,
    /// Cached pool entries (`retain_clean`) in the order they were kept:
    /// a full pool frees these first, oldest first, as they cost no I/O.
    clean: lru::Lru,
    /// Cached entries in the swap file, likewise: they take no pool
    /// memory, only slots, and go only when the swap file is full
    /// (`drop_clean(0)`).
    clean_swap: lru::Lru,
    current: RwLock<Arc<Pool>>,
    pools: Mutex<Vec<Weak<Pool>>>,
    next_pool_id: AtomicU32,
    group_pages: Arc<AtomicUsize>,
    mempool: Arc<Mempool>,
    swap: Option<SwapFile>,
    counters: Counters,
    full: AtomicBool,
    /// The pool limit and the accept threshold under it; set at start,
    /// changed by [`Tier::set_max_pool_bytes`].
    max_bytes: AtomicUsize,
    accept_bytes: AtomicUsize,
    /// A load from the swap file is a `swap_refaults` when it lies fewer
    /// pages back in the writeback stream than this; 0: than the pool
    /// holds entries.
    refault_window: AtomicU64,
    /// A load from the pool is a `cold_pool_loads` when its entry is at
    /// least this old (pages stored since): the oldest window's start,
    /// placed by `ages` each time the window is set; 0 (no window): every
    /// load.
    cold_age: AtomicU64,
    /// The pool's entries by id, to place that window: those in the pool
    /// and not kept copies of resident pages (`Entry::cached`), which go
    /// first and free whenever the pool shrinks.
    ages: ages::Ages,
    shrink_lock: Mutex<Vec<u8>>,
    /// The codec paths' buffers (not thread-locals: see `buffers`).
    buffers: buffers::Buffers,
    /// Owned batches `store_many` reuses with a compressor that runs beside.
    batches: Mutex<Vec<zmem_compress::batch::Batch>>,
    /// Where [`Tier::recompress`] moves entries, and with which codec.
    recompress_to: Mutex<Option<(CodecSpec, Weak<Pool>)>>,
    /// The shard the next [`Tier::recompress`] starts at.
    recompress_cursor: AtomicUsize,
    /// Where `sample_codec` goes on from.
    sample_cursor: AtomicUsize,
}

impl Tier {
    /// A tier with `cfg.compressor`.
    ///
    /// # Errors
    /// [`TierError::Config`] for bad percentages or writeback without a swap
    /// file; errors creating the mempool, the engines or the swap file.
    pub fn new(cfg: TierConfig) -> Result<Tier, TierError> {
        let compressor = Self::make_compressor(&cfg, cfg.compressor)?;
        Self::with_compressor(cfg, compressor)
    }

    /// A tier whose first pool uses `compressor` (for custom or
    /// fault-injecting codecs); `cfg.compressor` is ignored.
    ///
    /// # Errors
    /// As [`Tier::new`].
    pub fn with_compressor(cfg: TierConfig, compressor: Arc<dyn BatchCompressor>) -> Result<Tier, TierError> {
        for (name, v) in
            [("max_pool_percent", cfg.max_pool_percent), ("accept_threshold_percent", cfg.accept_threshold_percent)]
        {
            if !(1..=100).contains(&v) {
                return Err(ConfigError::out_of_range(name, v, "1..=100").into());
            }
        }
        if cfg.writeback && cfg.swap.is_none() {
            return Err(ConfigError::invalid("writeback", "needs a swap file (set swap, or writeback=false)").into());
        }
        let max_bytes = cfg.max_pool_bytes.unwrap_or(cfg.memory_budget / 100 * cfg.max_pool_percent as usize);
        if max_bytes < PAGE_SIZE {
            return Err(ConfigError::out_of_range("max_pool_bytes", max_bytes, "a page or more").into());
        }
        let accept_bytes = max_bytes / 100 * cfg.accept_threshold_percent as usize;
        let mempool = Arc::new(Mempool::new(cfg.mempool.clone())?);
        mempool.set_high_watermark(free_pages_kept(max_bytes, cfg.mempool.high_watermark));
        let swap = match &cfg.swap {
            Some(s) if cfg.writeback => Some(SwapFile::create(s, Arc::clone(&mempool)).map_err(TierError::SwapCreate)?),
            _ => None,
        };
        let group_pages = Arc::new(AtomicUsize::new(0));
        let first = Arc::new(Pool::new(0, compressor, cfg.zs, Arc::clone(&mempool), Arc::clone(&group_pages))?);
        Ok(Tier {
            pools: Mutex::new(vec![Arc::downgrade(&first)]),
            current: RwLock::new(first),
            next_pool_id: AtomicU32::new(1),
            tree: Tree::default(),
            lru: lru::Lru::default(),
            clean: lru::Lru::default(),
            clean_swap: lru::Lru::default(),
            group_pages,
            mempool,
            swap,
            counters: Counters::default(),
            full: AtomicBool::new(false),
            max_bytes: AtomicUsize::new(max_bytes),
            accept_bytes: AtomicUsize::new(accept_bytes),
            refault_window: AtomicU64::new(0),
            cold_age: AtomicU64::new(0),
            ages: ages::Ages::new(),
            shrink_lock: Mutex::new(Vec::new()),
            recompress_to: Mutex::new(None),
            recompress_cursor: AtomicUsize::new(0),
            sample_cursor: AtomicUsize::new(0),
            buffers: buffers::Buffers::default(),
            batches: Mutex::new(Vec::new()),
            cfg,
        })
    }

    fn make_compressor(cfg: &TierConfig, spec: CodecSpec) -> Result<Arc<dyn BatchCompressor>, TierError> {
        Ok(match &cfg.engines {
            Some(e) => Arc::new(Engines::new(e.clone(), spec.factory())?),
            None => Arc::new(Sequential::new(spec.factory(), cfg.batch_size)?),
        })
    }

    pub fn config(&self) -> &TierConfig {
        &self.cfg
    }

    /// The pool is below its accept threshold and not refusing stores: a
    /// page stored now goes into it without writing another back.
    pub fn pool_has_room(&self) -> bool {
        !self.full.load(Ordering::Relaxed) && self.pool_total_size() < self.accept_bytes.load(Ordering::Relaxed)
    }

    /// The pool limit, in bytes.
    pub fn max_pool_bytes(&self) -> usize {
        self.max_bytes.load(Ordering::Relaxed)
    }

    /// Sets the pool limit to `bytes` (at least a page), with the accept
    /// threshold at the configured percent of it, as writing zswap's
    /// `max_pool_percent` does. A pool already over the new limit shrinks
    /// at the next store, or at [`shrink_to_limit`](Self::shrink_to_limit).
    /// A process in a tree follows its share of the tree's limit this way.
    pub fn set_max_pool_bytes(&self, bytes: usize) {
        let max = bytes.max(PAGE_SIZE);
        self.max_bytes.store(max, Ordering::Relaxed);
        self.mempool.set_high_watermark(free_pages_kept(max, self.cfg.mempool.high_watermark));
        self.accept_bytes.store(max / 100 * self.cfg.accept_threshold_percent as usize, Ordering::Relaxed);
    }

    /// How far back in the writeback stream (in pages written back) a load
    /// from the swap file counts as a `swap_refaults`: those a pool that
    /// many entries larger would have kept. 0 (the default): as many as
    /// the pool holds, a pool twice as large. The same window of the
    /// pool's oldest entries makes a load from the pool a
    /// `cold_pool_loads`; where that window starts is placed now, by
    /// the ids of the entries in the pool (`ages`).
    pub fn set_swap_refault_window(&self, pages: u64) {
        let age = self.ages.cold_age(store::id_clock(), pages);
        self.refault_window.store(pages, Ordering::Relaxed);
        self.cold_age.store(age, Ordering::Relaxed);
    }

    /// Writes back (and, without writeback, drops clean copies) until the
    /// pool is down to its accept threshold, if it is over its limit.
    /// Returns whether the pool is within its limit afterwards.
    pub fn shrink_to_limit(&self) -> bool {
        if self.pool_total_size() <= self.max_pool_bytes() {
            return true;
        }
        let accept = self.accept_bytes.load(Ordering::Relaxed);
        self.drop_clean(accept);
        if self.writeback_enabled() && self.pool_total_size() > accept {
            self.shrinker().shrink_to(accept);
        }
        self.pool_total_size() <= self.max_pool_bytes()
    }

    pub(crate) fn current(&self) -> Arc<Pool> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether stores compress on the calling thread (no engines or device
    /// runs beside it): then [`store_many`](Self::store_many) stores folio
    /// by folio, and a batch's folios may as well be stored by several
    /// threads at once, each calling it for its own.
    pub fn stores_on_caller(&self) -> bool {
        !self.current().compressor.runs_beside()
    }

    /// The current pool's compressor name.
    pub fn compressor(&self) -> String {
        self.current().name().to_string()
    }

    /// Makes `spec` the compressor of new stores. Entries stored before keep
    /// loading from their own pool, which is freed with its last entry.
    ///
    /// # Errors
    /// Errors making the compressor or the pool; the current one stays.
    pub fn set_compressor(&self, spec: CodecSpec) -> Result<(), TierError> {
        let c = Self::make_compressor(&self.cfg, spec)?;
        self.set_batch_compressor(c)
    }

    /// As [`set_compressor`](Self::set_compressor), with any batch compressor.
    ///
    /// # Errors
    /// As [`set_compressor`](Self::set_compressor).
    pub fn set_batch_compressor(&self, c: Arc<dyn BatchCompressor>) -> Result<(), TierError> {
        let pool = self.new_pool(c)?;
        let old = std::mem::replace(&mut *self.current.write().unwrap_or_else(|e| e.into_inner()), pool);
        drop(old);
        Ok(())
    }

    /// A new pool for `c`, with an id no live pool has.
    pub(crate) fn new_pool(&self, c: Arc<dyn BatchCompressor>) -> Result<Arc<Pool>, TierError> {
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        pools.retain(|w| w.strong_count() > 0);
        // An entry has 15 bits for its pool's id: ids wrap, skipping those
        // of pools still alive (one per switch whose entries are not all
        // gone yet).
        let id = loop {
            let id = self.next_pool_id.fetch_add(1, Ordering::Relaxed) & tree::MAX_POOL_ID;
            if !pools.iter().any(|w| w.upgrade().is_some_and(|p| p.id == id)) {
                break id;
            }
        };
        let pool = Arc::new(Pool::new(id, c, self.cfg.zs, Arc::clone(&self.mempool), Arc::clone(&self.group_pages))?);
        pools.push(Arc::downgrade(&pool));
        Ok(pool)
    }

    /// Bytes of zspages of every pool: zswap's `pool_total_size`.
    pub fn pool_total_size(&self) -> usize {
        self.group_pages.load(Ordering::Relaxed) * PAGE_SIZE
    }

    /// The memory the tier's entries take, counted as it is allocated: the
    /// tree's blocks (16 bytes per entry, [`tree::BLOCK`] entries to a
    /// block), the page hashes of cached swap entries, and the LRU lists'
    /// items (the pools' own metadata is counted by
    /// [`TierStats::memory_bytes`]).
    pub fn entry_metadata_bytes(&self) -> usize {
        let (tree, lru, clean) = self.entry_metadata_parts();
        tree + lru + clean
    }

    /// [`entry_metadata_bytes`](Self::entry_metadata_bytes) in its parts:
    /// the tree's blocks, the LRU's items, the kept entries' page hashes.
    pub fn entry_metadata_parts(&self) -> (usize, usize, usize) {
        (self.tree.bytes(), self.lru.bytes(), self.clean.bytes() + self.clean_swap.bytes())
    }

    /// Gives the free pages the mempool keeps for reuse back to the OS
    /// (reclaim does, before its limit turns soft). Returns how many pages
    /// went.
    pub fn release_free_pages(&self) -> usize {
        self.mempool.release_free()
    }

    pub(crate) fn writeback_enabled(&self) -> bool {
        self.cfg.writeback && self.swap.is_some()
    }

    /// Frees what entry `e` (just removed from `shard`) holds and updates the
    /// gauges. Returns a pool to drop once the shard lock is released.
    pub(crate) fn release(&self, shard: &mut Shard<Arc<Pool>>, e: Entry) -> Option<Arc<Pool>> {
        let c = &self.counters;
        if e.cached {
            dec(&c.cached_pages, 1);
        }
        match e.stored {
            Stored::SameFilled(_) => {
                dec(&c.stored_pages, 1);
                dec(&c.same_filled_pages, 1);
            }
            Stored::Pool { len, .. } => {
                dec(&c.stored_pages, 1);
                if !e.cached {
                    self.ages.removed(e.id);
                }
                if len as usize == PAGE_SIZE {
                    dec(&c.stored_incompressible_pages, 1);
                }
            }
            Stored::Swap { .. } => dec(&c.swap_pages, 1),
        }
        shard.release(
            e,
            |p, e| {
                if let Stored::Pool { handle, .. } = e.stored {
                    let r = p.zs.free(handle);
                    debug_assert!(r.is_ok(), "{r:?}");
                }
            },
            |e| {
                if let (Stored::Swap { slot, .. }, Some(sf)) = (e.stored, &self.swap) {
                    let r = sf.free(slot);
                    debug_assert!(r.is_ok(), "{r:?}");
                }
            },
        )
    }

    /// Compacts every pool; returns pages freed.
    pub fn compact(&self) -> usize {
        self.live_pools().iter().map(|p| p.zs.compact()).sum()
    }

    pub(crate) fn live_pools(&self) -> Vec<Arc<Pool>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(Weak::upgrade).collect()
    }

    /// The shrinker (one per tier, shared by every pool).
    pub fn shrinker(&self) -> Shrinker<'_> {
        Shrinker { tier: self }
    }

    pub fn stats(&self) -> TierStats {
        let c = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let pools = self.live_pools();
        let pool_meta: usize = pools.iter().map(|p| p.zs.metadata_bytes()).sum();
        let tree_bytes = self.entry_metadata_bytes();
        let swap_meta = self.swap.as_ref().map_or(0, SwapFile::metadata_bytes);
        let swap = self.swap.as_ref().map(SwapFile::stats).unwrap_or_default();
        TierStats {
            stored_pages: r(&c.stored_pages),
            pool_total_size: self.pool_total_size() as u64,
            stored_incompressible_pages: r(&c.stored_incompressible_pages),
            same_filled_pages: r(&c.same_filled_pages),
            written_back_pages: r(&c.written_back_pages),
            pool_limit_hit: r(&c.pool_limit_hit),
            reject_compress_poor: r(&c.reject_compress_poor),
            reject_compress_fail: r(&c.reject_compress_fail),
            reject_alloc_fail: r(&c.reject_alloc_fail),
            reject_reclaim_fail: r(&c.reject_reclaim_fail),
            decompress_fail: r(&c.decompress_fail),
            zswpout: r(&c.zswpout),
            cached_pages: r(&c.cached_pages),
            cached_reused: r(&c.cached_reused),
            cached_dropped: r(&c.cached_dropped),
            recompressed_pages: r(&c.recompressed_pages),
            zswpin: r(&c.zswpin),
            pswpin: r(&c.pswpin),
            swap_refaults: r(&c.swap_refaults),
            cold_pool_loads: r(&c.cold_pool_loads),
            zswpwb: r(&c.written_back_pages),
            swap_pages: r(&c.swap_pages),
            swap_slots: swap.slots_in_use,
            swap_written_bytes: swap.pages_written * PAGE_SIZE as u64,
            swap_readahead_blocks: swap.readahead_blocks,
            swap_readahead_hits: swap.readahead_hits,
            pools: pools.len() as u64,
            memory_bytes: (self.mempool.bytes_held() + pool_meta + tree_bytes + swap_meta) as u64,
        }
    }

    /// Fault injection (`zmem bench soak`): the current pool's next `n`
    /// allocations fail, so stores are rejected with `AllocFail`.
    #[doc(hidden)]
    pub fn inject_alloc_failures(&self, n: u32) {
        self.current().zs.inject_alloc_failures(n);
    }

    /// The entries placed by age (`ages`), for tests: each pool entry
    /// that is not a kept copy, once.
    #[doc(hidden)]
    pub fn aged_entries(&self) -> i64 {
        self.ages.entries()
    }

    /// The swap file, for tests that inject faults into it.
    #[doc(hidden)]
    pub fn swap_file(&self) -> Option<&SwapFile> {
        self.swap.as_ref()
    }
}

/// Free pages the mempool keeps for reuse under a pool limit of `max_bytes`:
/// a sixteenth of it, between 32 pages and `most` (the configured high
/// watermark). They are not charged to the memory limit (see the pager's
/// `usage`), so a small limit keeps a small cache: 1,088 free pages
/// (4.25 MiB) were 5–10% of a 48M process's share, on top of it.
fn free_pages_kept(max_bytes: usize, most: usize) -> usize {
    (max_bytes / PAGE_SIZE / 16).clamp(32.min(most), most)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_free_pages_kept_follow_the_pool_limit_within_bounds() {
        assert_eq!(free_pages_kept(1 << 30, 1024), 1024, "a large pool: the configured most");
        assert_eq!(free_pages_kept(32 << 20, 1024), 512);
        assert_eq!(free_pages_kept(1 << 20, 1024), 32, "a tiny pool: the floor");
        assert_eq!(free_pages_kept(1 << 20, 8), 8, "never above the configured most");
    }

    /// A store that reuses a clean copy gives the entry a new id, so that
    /// its age (the store clock less the id: `cold_pool_loads`) runs from
    /// this eviction, not from the page's first store; and a writeback or
    /// load that took the old id then lets the entry be.
    #[test]
    fn a_reused_clean_copy_takes_a_new_id() {
        let t = Tier::new(TierConfig { exclusive_loads: false, ..TierConfig::without_writeback() }).unwrap();
        let page = zmem_compress::corpus::Corpus::sample().page(3).to_vec();
        t.store(7, &page).unwrap();
        let id = |t: &Tier| t.tree.lock(7).get(7).map(|e| (e.id, e.cached)).unwrap();
        let (first, _) = id(&t);
        // Other stores move the clock on.
        for k in 100..300 {
            t.store(k, zmem_compress::corpus::Corpus::sample().page(k as usize)).unwrap();
        }
        let mut buf = vec![0u8; PAGE_SIZE];
        assert_eq!(t.load(7, &mut buf).unwrap(), LoadOutcome::Loaded);
        assert_eq!(buf, page);
        assert!(t.retain_clean(7, &buf, true));
        assert_eq!(id(&t), (first, true));
        t.store_reusing(7, &page).unwrap();
        let (now, cached) = id(&t);
        assert!(!cached);
        assert!(now.wrapping_sub(first) >= 200, "{first} -> {now}: stored again as of now");
        assert_eq!(t.stats().cached_reused, 1);
    }
}
