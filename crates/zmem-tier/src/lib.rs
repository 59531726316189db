//! zmem's tier: zswap as a library.
//!
//! `Tier::store` compresses a folio (1..512 pages) in batches through the
//! current pool's [`BatchCompressor`] and keeps the objects in its zs pool;
//! `Tier::load` brings a page back; `Tier::invalidate` drops one. When the
//! pool passes its limit, the shrinker writes the coldest entries back to an
//! (encrypted) swap file. The compressor can be switched at any time: new
//! stores go to a new pool, old entries keep loading from theirs.
//!
//! # Lock order (outermost first)
//! 1. `shrink_lock`: one shrinker at a time.
//! 2. a tree shard (`tree.rs`); never two at once.
//! 3. inside a shard: a zs pool class lock (map/malloc/free), a codec
//!    context pool, the swap file's slot table. Each is a leaf.
//!
//! The LRU's mutex and the `current` pool lock are leaves too: they are
//! never held while taking any other lock. Pools are dropped (their last
//! `Arc` released) only after the shard lock is let go.
//!
//! # Entry lifecycle
//! ```text
//! store ──► SameFilled ─────────────────────────────┐
//!   │                                               ├─► load (exclusive) / invalidate / store again ─► freed
//!   └─────► Pool{handle} ──(shrinker)──► Swap{slot} ┘
//!              ▲ on the LRU            (off the LRU)
//! ```
//! A non-exclusive load leaves the entry where it is and sets `referenced`.
#![forbid(unsafe_code)]

pub mod entry;
pub mod lru;
pub mod pool;
pub mod stats;
mod sync;
pub mod tree;

use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use thiserror::Error;
use zmem_compress::{BatchCompressor, CompressError, DecompressError, Engines, EnginesConfig, Sequential};
use zmem_swapfile::{SwapError, SwapFile, SwapFileConfig};
use zmem_zsmalloc::{Mempool, MempoolConfig, ZsPoolConfig, PAGE_SIZE};

pub use entry::{Entry, Stored};
pub use pool::Pool;
pub use stats::TierStats;
pub use zmem_compress::CodecSpec;

use stats::{dec, inc, Counters};
use tree::{Shard, Tree};

/// The largest folio one store takes (2 MiB).
pub const MAX_FOLIO_PAGES: usize = 512;

/// Errors of the tier. Rejections of a store are outcomes, not errors.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TierError {
    #[error("invalid tier configuration: {0}")]
    Config(String),
    #[error("a folio must be 1..={MAX_FOLIO_PAGES} whole pages of {PAGE_SIZE} bytes, got {len} bytes")]
    BadFolio { len: usize },
    #[error("key {key}: stored page failed to decompress: {source}")]
    Decompress { key: u64, source: DecompressError },
    #[error("key {key}: {source}")]
    Swap { key: u64, source: SwapError },
    #[error(transparent)]
    Compress(#[from] zmem_compress::Error),
    #[error(transparent)]
    Pool(#[from] zmem_zsmalloc::ZsError),
    #[error(transparent)]
    Mempool(#[from] zmem_zsmalloc::MempoolError),
    #[error("creating the swap file: {0}")]
    SwapCreate(SwapError),
}

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOutcome {
    Loaded,
    NotFound,
}

/// Settings of a tier.
#[derive(Debug, Clone)]
pub struct TierConfig {
    pub compressor: CodecSpec,
    /// Pages per compress call of the sequential adapter (1..=32).
    pub batch_size: usize,
    /// Compress through the multi-engine device instead.
    pub engines: Option<EnginesConfig>,
    /// The pool limit in bytes; when `None`, `max_pool_percent` of
    /// `memory_budget`.
    pub max_pool_bytes: Option<usize>,
    pub max_pool_percent: u32,
    pub memory_budget: usize,
    /// After the limit is hit, stores resume below this percent of it.
    pub accept_threshold_percent: u32,
    /// Write cold entries back to the swap file (memory.zswap.writeback).
    pub writeback: bool,
    /// The swap file; needed for writeback.
    pub swap: Option<SwapFileConfig>,
    /// Free an entry when it is loaded (the default, as zswap does).
    pub exclusive_loads: bool,
    pub zs: ZsPoolConfig,
    pub mempool: MempoolConfig,
}

/// Total RAM from /proc/meminfo, or 1 GiB if it cannot be read.
pub fn total_ram() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<usize>().ok()
        })
        .map_or(1 << 30, |kib| kib * 1024)
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            compressor: "lz4".parse().expect("lz4 is a codec"),
            batch_size: zmem_compress::batch::DEFAULT_BATCH_SIZE,
            engines: None,
            max_pool_bytes: None,
            max_pool_percent: 20,
            memory_budget: total_ram(),
            accept_threshold_percent: 90,
            writeback: true,
            swap: Some(SwapFileConfig::default()),
            exclusive_loads: true,
            zs: ZsPoolConfig::default(),
            mempool: MempoolConfig::default(),
        }
    }
}

impl TierConfig {
    /// A tier with no swap file: writeback off, incompressible pages rejected.
    pub fn without_writeback() -> Self {
        TierConfig { writeback: false, swap: None, ..Default::default() }
    }

    pub fn with_swap_dir(mut self, dir: PathBuf, encrypt: bool) -> Self {
        self.swap = Some(SwapFileConfig { dir, encrypt, ..SwapFileConfig::default() });
        self
    }
}

/// Entry ids: unique per store, handed to threads in blocks so that a store
/// does not touch a shared counter per page.
static NEXT_ID_BLOCK: AtomicU64 = AtomicU64::new(1);
const ID_BLOCK: u64 = 1024;

fn next_ids(n: usize) -> u64 {
    thread_local!(static IDS: Cell<(u64, u64)> = const { Cell::new((0, 0)) });
    IDS.with(|c| {
        let (mut next, mut end) = c.get();
        if next + n as u64 > end {
            let take = ID_BLOCK.max(n as u64);
            next = NEXT_ID_BLOCK.fetch_add(take, Ordering::Relaxed);
            end = next + take;
        }
        c.set((next + n as u64, end));
        next
    })
}

/// The repeated word if every 8-byte word of `page` is the same.
fn same_filled(page: &[u8]) -> Option<u64> {
    let (first, rest) = page.split_at(8);
    let v = u64::from_ne_bytes(first.try_into().ok()?);
    rest.chunks_exact(8).all(|w| w == first).then_some(v)
}

fn fill(dst: &mut [u8], v: u64) {
    let b = v.to_ne_bytes();
    for w in dst.chunks_exact_mut(8) {
        w.copy_from_slice(&b);
    }
}

/// A compressed-memory tier.
#[derive(Debug)]
pub struct Tier {
    cfg: TierConfig,
    tree: Tree<Arc<Pool>>,
    lru: lru::Lru,
    current: RwLock<Arc<Pool>>,
    pools: Mutex<Vec<Weak<Pool>>>,
    next_pool_id: AtomicU32,
    group_pages: Arc<AtomicUsize>,
    mempool: Arc<Mempool>,
    swap: Option<SwapFile>,
    counters: Counters,
    full: AtomicBool,
    max_bytes: usize,
    accept_bytes: usize,
    shrink_lock: Mutex<Vec<u8>>,
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
                return Err(TierError::Config(format!("{name} must be in 1..=100, got {v}")));
            }
        }
        if cfg.writeback && cfg.swap.is_none() {
            return Err(TierError::Config("writeback needs a swap file (set swap, or writeback=false)".into()));
        }
        let max_bytes = cfg.max_pool_bytes.unwrap_or(cfg.memory_budget / 100 * cfg.max_pool_percent as usize);
        if max_bytes < PAGE_SIZE {
            return Err(TierError::Config(format!("the pool limit of {max_bytes} bytes is below one page")));
        }
        let accept_bytes = max_bytes / 100 * cfg.accept_threshold_percent as usize;
        let mempool = Arc::new(Mempool::new(cfg.mempool.clone())?);
        let swap = match &cfg.swap {
            Some(s) if cfg.writeback => Some(SwapFile::create(s, Arc::clone(&mempool)).map_err(TierError::SwapCreate)?),
            _ => None,
        };
        let group_pages = Arc::new(AtomicUsize::new(0));
        let sw = Sequential::new(compressor_factory(&cfg, &compressor)?, 1)?;
        let first = Arc::new(Pool::new(0, compressor, sw, cfg.zs, Arc::clone(&mempool), Arc::clone(&group_pages))?);
        Ok(Tier {
            pools: Mutex::new(vec![Arc::downgrade(&first)]),
            current: RwLock::new(first),
            next_pool_id: AtomicU32::new(1),
            tree: Tree::default(),
            lru: lru::Lru::default(),
            group_pages,
            mempool,
            swap,
            counters: Counters::default(),
            full: AtomicBool::new(false),
            max_bytes,
            accept_bytes,
            shrink_lock: Mutex::new(Vec::new()),
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

    /// The pool limit, in bytes.
    pub fn max_pool_bytes(&self) -> usize {
        self.max_bytes
    }

    fn current(&self) -> Arc<Pool> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
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
        let id = self.next_pool_id.fetch_add(1, Ordering::Relaxed);
        let sw = Sequential::new(compressor_factory(&self.cfg, &c)?, 1)?;
        let pool =
            Arc::new(Pool::new(id, c, sw, self.cfg.zs, Arc::clone(&self.mempool), Arc::clone(&self.group_pages))?);
        {
            let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
            pools.retain(|w| w.strong_count() > 0);
            pools.push(Arc::downgrade(&pool));
        }
        let old = std::mem::replace(&mut *self.current.write().unwrap_or_else(|e| e.into_inner()), pool);
        drop(old);
        Ok(())
    }

    /// Bytes of zspages of every pool: zswap's `pool_total_size`.
    pub fn pool_total_size(&self) -> usize {
        self.group_pages.load(Ordering::Relaxed) * PAGE_SIZE
    }

    /// A cheap estimate of the memory the tier's entries take: a tree entry
    /// per page in the pool or same-filled (written-back entries and the
    /// pools' own metadata are counted by [`TierStats::memory_bytes`]).
    pub fn entry_metadata_bytes(&self) -> usize {
        self.counters.stored_pages.load(Ordering::Relaxed) as usize * (std::mem::size_of::<Entry>() + 16)
    }

    fn writeback_enabled(&self) -> bool {
        self.cfg.writeback && self.swap.is_some()
    }

    /// zswap_check_limits, with hysteresis; shrinks inline when it can.
    fn may_store(&self) -> bool {
        let total = self.pool_total_size();
        if total >= self.max_bytes {
            inc(&self.counters.pool_limit_hit, 1);
            self.full.store(true, Ordering::Relaxed);
        } else if self.full.load(Ordering::Relaxed) && total <= self.accept_bytes {
            self.full.store(false, Ordering::Relaxed);
        }
        if !self.full.load(Ordering::Relaxed) {
            return true;
        }
        // There is no kswapd here: the store that finds the pool full runs
        // the shrinker itself, down to the accept threshold.
        if self.writeback_enabled() {
            self.shrink_to(self.accept_bytes);
            if self.pool_total_size() <= self.accept_bytes {
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
        let n = folio.len() / PAGE_SIZE;
        if folio.is_empty() || folio.len() % PAGE_SIZE != 0 || n > MAX_FOLIO_PAGES {
            return Err(TierError::BadFolio { len: folio.len() });
        }
        if !self.may_store() {
            return Ok(self.reject(key, n, RejectReason::PoolLimit));
        }
        let pool = self.current();
        let mut stored: Vec<Option<Stored>> = vec![None; n];
        let pages: Vec<&[u8]> = folio.chunks_exact(PAGE_SIZE).collect();
        let mut todo = Vec::with_capacity(n);
        for (i, p) in pages.iter().enumerate() {
            match same_filled(p) {
                Some(v) => stored[i] = Some(Stored::SameFilled(v)),
                None => todo.push(i),
            }
        }
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
        for (i, s) in stored.into_iter().enumerate() {
            let s = s.expect("every page was stored");
            let e = Entry { id: first_id + i as u64, pool: pool.id, stored: s, referenced: true };
            let k = key.wrapping_add(i as u64);
            match s {
                Stored::SameFilled(_) => same += 1,
                Stored::Pool { len, .. } => {
                    raw += usize::from(len as usize == PAGE_SIZE);
                    lru_items.push((k, e.id));
                }
                Stored::Swap { .. } => unreachable!("stores never go straight to swap"),
            }
            let mut shard = self.tree.lock(k);
            let old = shard.insert(k, e, &pool);
            let dropped = old.and_then(|o| self.release(&mut shard, o));
            drop(shard);
            drop(dropped);
        }
        self.lru.push(lru_items);
        let c = &self.counters;
        inc(&c.stored_pages, n as u64);
        inc(&c.same_filled_pages, same as u64);
        inc(&c.stored_incompressible_pages, raw as u64);
        inc(&c.zswpout, n as u64);
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
        thread_local!(static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) });
        let bs = pool.compressor.batch_size().max(1);
        SCRATCH.with(|s| {
            let mut scratch = s.borrow_mut();
            scratch.resize(bs * PAGE_SIZE, 0);
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
        })
    }

    fn reject(&self, key: u64, n: usize, reason: RejectReason) -> StoreOutcome {
        for i in 0..n as u64 {
            self.invalidate(key.wrapping_add(i));
        }
        StoreOutcome::Rejected(reason)
    }

    /// Frees what entry `e` (just removed from `shard`) holds and updates the
    /// gauges. Returns a pool to drop once the shard lock is released.
    fn release(&self, shard: &mut Shard<Arc<Pool>>, e: Entry) -> Option<Arc<Pool>> {
        let c = &self.counters;
        match e.stored {
            Stored::SameFilled(_) => {
                dec(&c.stored_pages, 1);
                dec(&c.same_filled_pages, 1);
            }
            Stored::Pool { len, .. } => {
                dec(&c.stored_pages, 1);
                if len as usize == PAGE_SIZE {
                    dec(&c.stored_incompressible_pages, 1);
                }
                self.lru.note_stale(1);
            }
            Stored::Swap { .. } => {}
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
                if let (Stored::Swap { slot }, Some(sf)) = (e.stored, &self.swap) {
                    let r = sf.free(slot);
                    debug_assert!(r.is_ok(), "{r:?}");
                }
            },
        )
    }

    /// Decompresses (or copies, for a raw page) a pool entry into `dst`.
    fn load_from_pool(pool: &Pool, key: u64, e: &Entry, dst: &mut [u8]) -> Result<(), TierError> {
        let Stored::Pool { handle, len } = e.stored else { unreachable!("a pool entry") };
        pool.zs
            .map(handle, |obj| {
                if len as usize == PAGE_SIZE {
                    dst.copy_from_slice(obj);
                    return Ok(());
                }
                let mut res = [Ok(0)];
                let mut d = [&mut *dst];
                pool.sw.decompress_batch(&[obj], &mut d, &mut res)?;
                match res[0] {
                    Ok(n) if n == PAGE_SIZE => Ok(()),
                    Ok(got) => Err(TierError::Decompress {
                        key,
                        source: DecompressError::LengthMismatch { codec: "codec", got, want: PAGE_SIZE },
                    }),
                    Err(ref source) => Err(TierError::Decompress { key, source: source.clone() }),
                }
            })
            .map_err(TierError::Pool)?
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
        let Some(e) = shard.get(key).copied() else { return Ok(LoadOutcome::NotFound) };
        let r = match e.stored {
            Stored::SameFilled(v) => {
                fill(dst, v);
                Ok(())
            }
            Stored::Pool { .. } => {
                Self::load_from_pool(shard.pool(e.pool).expect("a pool entry's shard holds its pool"), key, &e, dst)
            }
            Stored::Swap { slot } => match &self.swap {
                Some(sf) => sf.read(slot, dst).map_err(|source| TierError::Swap { key, source }),
                None => unreachable!("swap entries exist only with a swap file"),
            },
        };
        if let Err(err) = r {
            inc(&self.counters.decompress_fail, 1);
            return Err(err);
        }
        inc(&self.counters.zswpin, 1);
        let dropped = if self.cfg.exclusive_loads {
            let e = shard.remove(key).expect("looked up under the same lock");
            self.release(&mut shard, e)
        } else {
            if let Some(e) = shard.get_mut(key) {
                e.referenced = true;
            }
            None
        };
        drop(shard);
        drop(dropped);
        Ok(LoadOutcome::Loaded)
    }

    /// Loads `dst.len() / PAGE_SIZE` pages from keys `key`, `key + 1`, …
    /// Returns how many were found; missing pages are left untouched.
    ///
    /// # Errors
    /// The first page's error, as in [`load`](Self::load); earlier pages stay loaded.
    pub fn load_folio(&self, key: u64, dst: &mut [u8]) -> Result<usize, TierError> {
        if dst.is_empty() || dst.len() % PAGE_SIZE != 0 {
            return Err(TierError::BadFolio { len: dst.len() });
        }
        let mut found = 0;
        for (i, page) in dst.chunks_exact_mut(PAGE_SIZE).enumerate() {
            if self.load(key.wrapping_add(i as u64), page)? == LoadOutcome::Loaded {
                found += 1;
            }
        }
        Ok(found)
    }

    /// Drops the entry under `key`, if any.
    pub fn invalidate(&self, key: u64) -> bool {
        let mut shard = self.tree.lock(key);
        let Some(e) = shard.remove(key) else { return false };
        let dropped = self.release(&mut shard, e);
        drop(shard);
        drop(dropped);
        true
    }

    /// Whether `key` has an entry, and where.
    pub fn lookup(&self, key: u64) -> Option<Stored> {
        self.tree.lock(key).get(key).map(|e| e.stored)
    }

    /// Writes back up to `nr` of the coldest pool entries now, whatever the
    /// pool's size (`memory.reclaim source=zswap`). Returns how many went.
    pub fn writeback(&self, nr: usize) -> usize {
        let mut scratch = self.shrink_lock.lock().unwrap_or_else(|e| e.into_inner());
        // Every entry may need two visits (the first clears `referenced`).
        let budget = 2 * self.lru.len() + nr;
        let (mut done, mut scanned) = (0, 0);
        while done < nr && scanned < budget {
            let pass = self.writeback_batch(&mut scratch, (nr - done).min(WRITEBACK_BATCH));
            if pass.failed || pass.scanned == 0 {
                break;
            }
            done += pass.written;
            scanned += pass.scanned;
        }
        done
    }

    /// Writes back until the pool is at most `target` bytes, or nothing more
    /// can go.
    fn shrink_to(&self, target: usize) -> usize {
        let mut scratch = self.shrink_lock.lock().unwrap_or_else(|e| e.into_inner());
        let budget = 2 * self.lru.len() + WRITEBACK_BATCH;
        let (mut done, mut scanned, mut since_compact) = (0, 0, 0);
        while self.pool_total_size() > target && scanned < budget {
            let pass = self.writeback_batch(&mut scratch, WRITEBACK_BATCH);
            if pass.failed || pass.scanned == 0 {
                break;
            }
            done += pass.written;
            scanned += pass.scanned;
            since_compact += pass.written;
            // Freed objects leave holes in zspages; compaction turns them
            // into free pages, which is what the limit counts.
            if since_compact >= WRITEBACK_BATCH * 16 {
                self.compact();
                since_compact = 0;
            }
        }
        if self.pool_total_size() > target {
            self.compact();
        }
        done
    }

    /// One batch of writeback from the cold end of the LRU. The caller holds
    /// `shrink_lock` and passes its scratch buffer.
    fn writeback_batch(&self, scratch: &mut Vec<u8>, max: usize) -> Pass {
        let mut pass = Pass::default();
        let Some(sf) = self.swap.as_ref().filter(|_| self.cfg.writeback) else { return pass };
        if self.lru.needs_rebuild() {
            self.lru.rebuild(|k, id| self.tree.lock(k).get(k).is_some_and(|e| e.id == id && e.in_pool()));
        }
        scratch.resize(max * PAGE_SIZE, 0);
        let mut victims: Vec<(u64, u64)> = Vec::with_capacity(max);
        let mut rotate = Vec::new();
        let mut scanned = 0;
        while victims.len() < max && scanned < max * 8 {
            let items = self.lru.pop_cold(max - victims.len());
            if items.is_empty() {
                break;
            }
            for (key, id) in items {
                scanned += 1;
                pass.scanned += 1;
                let mut shard = self.tree.lock(key);
                let Some(e) = shard.get_mut(key) else { continue };
                if e.id != id || !e.in_pool() {
                    continue; // a stale LRU item
                }
                if e.referenced {
                    // Second chance, as shrink_memcg_cb gives.
                    e.referenced = false;
                    rotate.push((key, id));
                    continue;
                }
                let e = *e;
                let pool = shard.pool(e.pool).expect("a pool entry's shard holds its pool");
                let dst = &mut scratch[victims.len() * PAGE_SIZE..(victims.len() + 1) * PAGE_SIZE];
                match Self::load_from_pool(pool, key, &e, dst) {
                    Ok(()) => victims.push((key, id)),
                    Err(_) => {
                        inc(&self.counters.decompress_fail, 1);
                        rotate.push((key, id));
                    }
                }
            }
        }
        self.lru.push(rotate);
        if victims.is_empty() {
            return pass;
        }
        let pages: Vec<&[u8]> = scratch.chunks_exact(PAGE_SIZE).take(victims.len()).collect();
        let slots = match sf.write_batch(&pages) {
            Ok(s) => s,
            Err(_) => {
                // ENOSPC, EIO, no bounce pages: the entries stay in the pool.
                inc(&self.counters.reject_reclaim_fail, victims.len() as u64);
                self.lru.push_cold(&victims);
                pass.failed = true;
                return pass;
            }
        };
        let mut written = 0;
        for ((key, id), slot) in victims.into_iter().zip(slots) {
            let mut shard = self.tree.lock(key);
            let mut raw = false;
            let r = shard.writeback_commit(key, id, slot, |p, e| {
                if let Stored::Pool { handle, len } = e.stored {
                    raw = len as usize == PAGE_SIZE;
                    let r = p.zs.free(handle);
                    debug_assert!(r.is_ok(), "{r:?}");
                }
            });
            drop(shard);
            match r {
                Ok(dropped) => {
                    drop(dropped);
                    written += 1;
                    dec(&self.counters.stored_pages, 1);
                    if raw {
                        dec(&self.counters.stored_incompressible_pages, 1);
                    }
                }
                // Loaded, invalidated or stored again while we wrote: the
                // slot holds nothing anyone needs.
                Err(()) => {
                    let _ = sf.free(slot);
                }
            }
        }
        inc(&self.counters.written_back_pages, written as u64);
        pass.written = written;
        pass
    }

    /// Compacts every pool; returns pages freed.
    pub fn compact(&self) -> usize {
        self.live_pools().iter().map(|p| p.zs.compact()).sum()
    }

    fn live_pools(&self) -> Vec<Arc<Pool>> {
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
        let entries: usize = (0..tree::SHARDS).map(|i| self.tree.lock_shard(i).len()).sum();
        let tree_bytes = entries * (std::mem::size_of::<Entry>() + 16);
        let swap_meta = self.swap.as_ref().map_or(0, SwapFile::metadata_bytes);
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
            zswpin: r(&c.zswpin),
            zswpwb: r(&c.written_back_pages),
            swap_pages: self.swap.as_ref().map_or(0, |s| s.stats().slots_in_use),
            pools: pools.len() as u64,
            memory_bytes: (self.mempool.bytes_held() + pool_meta + tree_bytes + swap_meta) as u64,
        }
    }

    /// The swap file, for tests that inject faults into it.
    #[doc(hidden)]
    pub fn swap_file(&self) -> Option<&SwapFile> {
        self.swap.as_ref()
    }
}

/// What one writeback pass did.
#[derive(Debug, Default, Clone, Copy)]
struct Pass {
    /// LRU items looked at (written, rotated, or stale).
    scanned: usize,
    written: usize,
    /// The swap file refused the batch (ENOSPC, EIO): stop for now.
    failed: bool,
}

/// How many entries one writeback pass takes (one pwritev per run).
const WRITEBACK_BATCH: usize = 32;

/// A factory of single-page contexts for a pool's loads: the compressor's
/// own codec when it is a known one.
fn compressor_factory(cfg: &TierConfig, c: &Arc<dyn BatchCompressor>) -> Result<zmem_compress::Factory, TierError> {
    // A custom compressor whose name is no codec spec falls back to the
    // configured codec for decompression.
    let spec: CodecSpec = c.name().parse().unwrap_or(cfg.compressor);
    Ok(spec.factory())
}

/// `Shrinker::{count, scan}`, as the kernel's shrinker API names them.
#[derive(Debug)]
pub struct Shrinker<'a> {
    tier: &'a Tier,
}

impl Shrinker<'_> {
    /// Entries that writeback could free: pool entries (not same-filled,
    /// not already in the swap file).
    pub fn count(&self) -> usize {
        let s = self.tier.stats();
        (s.stored_pages - s.same_filled_pages) as usize
    }

    /// Writes back up to `nr` entries; returns how many went.
    pub fn scan(&self, nr: usize) -> usize {
        self.tier.writeback(nr)
    }
}
