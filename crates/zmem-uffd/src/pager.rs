//! The pager: anonymous memory under a limit, backed by the tier.
//!
//! A [`Pager`] owns one userfaultfd, a handler thread, a reclaim thread and
//! a [`Tier`]. [`Pager::map`] hands out [`Region`]s: anonymous private
//! memory registered for MISSING faults. Memory is managed in folios
//! (64 KiB by default).
//!
//! # Folio states
//! ```text
//! NEVER ──fault: ZEROPAGE──► RESIDENT ──reclaim: MOVE to staging──► EVICTING
//!                               ▲                                       │ store in the tier
//!                               └──fault: load folio, COPY── EVICTED ◄──┘
//! ```
//! - Eviction takes the folio out of the program's page table with
//!   `UFFDIO_MOVE` (atomic, no copy): from then on any access faults, and the
//!   handler waits while the folio is EVICTING, so no write is lost.
//! - A fault on an EVICTED folio loads all of it (fault-around) into a bounce
//!   buffer and maps it with one `UFFDIO_COPY`.
//! - A fault on a RESIDENT folio is a page the program dropped (madvise): it
//!   gets the zero page.
//! - Pages that were holes at eviction have no entry and come back as
//!   zeros. Pages that could not be moved (EBUSY: shared after fork, pinned)
//!   stay mapped, and the COPY of the folio steps over them.
//!
//! # Accounting and reclaim
//! Usage is resident folios plus the tier's pool plus this pager's
//! metadata. Above the high watermark the reclaim thread evicts, in batches
//! of `reclaim_batch` folios, down to the low watermark, choosing victims
//! from an active and an inactive list (see `pick_victims`). A folio counts
//! as accessed when it was written since it was last looked at (UFFD
//! WP_ASYNC plus PAGEMAP_SCAN, when the kernel offers them), or else when it
//! was faulted in. A fault that finds usage above the limit kicks
//! reclaim and waits for it, at most `direct_reclaim_wait` (so a fault never
//! hangs).
//!
//! # Lock order
//! 1. a folio stripe lock (one of 256, by folio index); never two at once;
//! 2. inside it: the tier (its own order), the reclaim lists' mutex (a leaf).
//!
//! The regions table is an `RwLock`, read by the handler, written by
//! map/unmap, never held across a stripe lock or a tier call.
//!
//! # Events
//! - `madvise(MADV_DONTNEED)` and `munmap` by the program (REMOVE, UNMAP):
//!   the range's entries are invalidated and its folios forget their pages.
//! - `mremap` of a whole region (REMAP): entries are keyed by (region, page),
//!   so the region just moves; partial remaps of a region are not supported.
//! - fork: regions are `MADV_DONTFORK`: a child does not inherit them, and
//!   touching one there is a SIGSEGV, never silently wrong data.
//!
//! # Deadlock and livelock avoidance
//! - `madvise`, `munmap` and `mremap` of a registered range wait until the
//!   handler reads their event, and while an event is unread every COPY,
//!   ZEROPAGE and MOVE fails with EAGAIN. So the handler never waits for the
//!   reclaim thread except on an EVICTING folio, a fault that gets EAGAIN is
//!   deferred until the events are read (its entries stay in the tier until
//!   the COPY succeeds), and reclaim raises no events of its own: it
//!   unregisters its staging area around the DONTNEED that frees it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;
use zmem_tier::{LoadOutcome, StoreOutcome, Tier, TierConfig, TierError};

use crate::mapping::{Mapping, PAGE_SIZE};
use crate::sys::{Event, Features, OpenMode, RegisterMode, Uffd, UffdError, WriteTracker};

/// What became of a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    Done,
    /// An event is unread (EAGAIN): read events, then try again.
    Again,
    /// The folio is being evicted: serve other faults, read events, and
    /// try this one again. The handler never waits for reclaim, because
    /// reclaim's MOVEs fail with EAGAIN until the handler reads events.
    Busy,
}

const NEVER: u8 = 0;
const RESIDENT: u8 = 1;
const EVICTING: u8 = 2;
const EVICTED: u8 = 3;
const STRIPES: usize = 256;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PagerError {
    #[error("invalid pager configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Uffd(#[from] UffdError),
    #[error(transparent)]
    Tier(#[from] TierError),
    #[error("mmap: {0}")]
    Map(rustix::io::Errno),
}

/// Settings of a pager.
#[derive(Debug, Clone)]
pub struct PagerConfig {
    /// Bytes of resident memory plus pool plus metadata the regions may use.
    pub limit: usize,
    /// Reclaim starts above this percent of the limit…
    pub high_watermark_percent: u32,
    /// …and stops below this one.
    pub low_watermark_percent: u32,
    /// The eviction unit: 4 KiB to 2 MiB, a power of two.
    pub folio_size: usize,
    /// Folios per reclaim pass (1..=32).
    pub reclaim_batch: usize,
    /// The longest a fault waits for reclaim when usage is over the limit.
    pub direct_reclaim_wait: Duration,
    /// Threads reading faults from the userfaultfd (1..=16).
    pub handler_threads: usize,
    /// How long a handler busy-polls for the next fault before it blocks in
    /// poll(2). Zero blocks at once: on a 2-vCPU guest a spinning handler
    /// takes a CPU from the program (see `zmem bench fault --spin-us`).
    pub handler_spin: Duration,
    /// CPUs the handler threads are pinned to, round-robin; empty: no pinning.
    pub handler_cpus: Vec<usize>,
    /// Refresh CLOCK's referenced bits from write tracking (UFFD WP_ASYNC
    /// and PAGEMAP_SCAN) when the kernel offers it. Without it a folio is
    /// referenced only when it is faulted in.
    pub track_writes: bool,
    /// Run first on every thread the pager starts (the LD_PRELOAD shim marks
    /// its internal threads with it, so their allocations stay unmanaged).
    pub thread_init: Option<fn()>,
    pub tier: TierConfig,
}

impl PagerConfig {
    /// A pager under `limit` bytes. Its tier's pool may take half of the
    /// limit, and writes back to a swap file in the temporary directory
    /// beyond that: real heap pages compress 2-3x, so a working set of
    /// several times the limit does not fit without writeback.
    pub fn with_limit(limit: usize) -> PagerConfig {
        PagerConfig {
            limit,
            high_watermark_percent: 95,
            low_watermark_percent: 85,
            folio_size: 64 << 10,
            reclaim_batch: 8,
            direct_reclaim_wait: Duration::from_millis(20),
            handler_threads: 1,
            handler_spin: Duration::ZERO,
            handler_cpus: Vec::new(),
            track_writes: true,
            thread_init: None,
            tier: TierConfig { memory_budget: limit, max_pool_percent: 50, ..TierConfig::default() },
        }
    }
}

/// Counters of a pager.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PagerStats {
    /// Faults on never-touched folios, resolved with the zero page.
    pub zero_faults: u64,
    /// Faults that loaded a folio from the tier.
    pub load_faults: u64,
    /// Faults on a resident folio: a page the program dropped, or a second
    /// fault on a folio that another fault just brought in.
    pub dropped_page_faults: u64,
    /// Faults that waited for an eviction to finish.
    pub eviction_waits: u64,
    /// Faults outside every region (a region being dropped, or zmem
    /// touching its own staging: a bug), answered with a zero page.
    pub stray_faults: u64,
    pub evicted_folios: u64,
    /// Folios whose store was rejected and which were put back.
    pub eviction_rejects: u64,
    pub direct_reclaim_waits: u64,
    /// Times the limit turned soft: usage was over it and a reclaim pass
    /// could evict nothing (the pool full with writeback off or failing,
    /// or nothing evictable). Reclaim then backs off and faults stop
    /// waiting for it, as under memory.high.
    pub limit_soft_events: u64,
    /// Whether the limit is soft now.
    pub limit_soft: bool,
    /// Folios whose pages could not be moved out (mlocked, pinned): they
    /// stay resident and are never stored or written back.
    pub unevictable_folios: u64,
    /// Bytes of folios whose store was rejected, kept uncompressed until
    /// they are faulted in again.
    pub held_bytes: u64,
    /// Pages that failed to load (a corrupt swap slot, an I/O error): they
    /// are poisoned, so the program gets SIGBUS there instead of wrong data.
    pub poisoned_pages: u64,
    /// Write-tracking checks (a PAGEMAP_SCAN of one folio CLOCK passes).
    pub write_scans: u64,
    /// Folios found written, which CLOCK then passes over once.
    pub written_folios: u64,
    pub resident_bytes: u64,
    /// The pager's metadata: its folio tables, the CLOCK queue and the
    /// tier's entries (an estimate).
    pub metadata_bytes: u64,
    /// Resident bytes plus the pool plus metadata: what the limit bounds.
    pub usage_bytes: u64,
    /// Whether CLOCK's referenced bits are refreshed from write tracking.
    pub tracking_writes: bool,
}

#[derive(Debug, Default)]
struct Counters {
    zero_faults: AtomicU64,
    load_faults: AtomicU64,
    dropped_page_faults: AtomicU64,
    eviction_waits: AtomicU64,
    stray_faults: AtomicU64,
    evicted_folios: AtomicU64,
    eviction_rejects: AtomicU64,
    direct_reclaim_waits: AtomicU64,
    limit_soft_events: AtomicU64,
    unevictable_folios: AtomicU64,
    poisoned_pages: AtomicU64,
    write_scans: AtomicU64,
    written_folios: AtomicU64,
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The reclaim lists (a folio is in at most one, once: `queued`).
#[derive(Debug, Default)]
struct Lru {
    active: VecDeque<(Arc<RegionState>, usize)>,
    inactive: VecDeque<(Arc<RegionState>, usize)>,
    /// Folios whose pages would not move (mlocked): not looked at until
    /// `UNEVICTABLE_RESCAN` has passed.
    unevictable: Vec<(Arc<RegionState>, usize)>,
}

/// How often unevictable folios go back on the inactive list for a look.
const UNEVICTABLE_RESCAN: Duration = Duration::from_secs(10);

/// A region's bookkeeping: 3 bytes per folio.
#[derive(Debug)]
struct RegionState {
    id: u32,
    start: AtomicU64,
    mapping: Mutex<Option<Mapping>>,
    len: usize,
    state: Box<[AtomicU8]>,
    referenced: Box<[AtomicBool]>,
    /// The folio has an entry in the CLOCK queue (at most one, so the hand
    /// passes each folio once per sweep).
    queued: Box<[AtomicBool]>,
}

impl RegionState {
    fn key(&self, page: usize) -> u64 {
        (u64::from(self.id) << 40) | page as u64
    }
}

struct Inner {
    cfg: PagerConfig,
    uffd: Uffd,
    tier: Tier,
    regions: RwLock<BTreeMap<u64, Arc<RegionState>>>,
    stripes: Vec<(Mutex<()>, Condvar)>,
    clock: Mutex<Lru>,
    resident: AtomicUsize,
    /// Bytes of folio tables of live regions.
    tables: AtomicUsize,
    /// Entries in the CLOCK queue (some may be stale).
    clock_len: AtomicUsize,
    tracking: bool,
    next_region: AtomicU32,
    counters: Counters,
    stop: AtomicBool,
    kick: (Mutex<bool>, Condvar),
    reclaimed: (Mutex<()>, Condvar),
    /// Pages dropped by the program (REMOVE, UNMAP) while their folio was
    /// EVICTING, by (region id, folio): the evictor drops their entries
    /// when it finishes. Written and taken under the folio's stripe lock.
    dropped: Mutex<HashMap<(u32, usize), Vec<bool>>>,
    /// Folios whose store was rejected: their pages, uncompressed, until a
    /// fault maps them again. Reclaim never puts pages back itself: only
    /// the handler maps pages, in event order, so a page the program
    /// dropped can never come back.
    held: Mutex<HashMap<(u32, usize), Held>>,
    held_bytes: AtomicUsize,
    /// The limit is soft (see [`PagerStats::limit_soft_events`]).
    soft: AtomicBool,
    /// UFFDIO_POISON is available for pages that fail to load.
    poison: bool,
}

/// A rejected folio's pages (`present[p]`: page `p` is in `data`).
#[derive(Debug)]
struct Held {
    data: Box<[u8]>,
    present: Vec<bool>,
}

/// What one eviction pass did.
#[derive(Debug, Default, Clone, Copy)]
struct Pass {
    evicted: usize,
    rejected: usize,
    unevictable: usize,
}

/// Anonymous memory under a limit, backed by a compressed tier.
pub struct Pager {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pager").field("limit", &self.inner.cfg.limit).field("stats", &self.stats()).finish()
    }
}

/// Memory handed out by a [`Pager`]. Unmapped (and its entries dropped) on drop.
pub struct Region {
    state: Arc<RegionState>,
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("addr", &self.addr()).field("len", &self.state.len).finish()
    }
}

impl Region {
    pub fn addr(&self) -> u64 {
        self.state.start.load(Ordering::Acquire)
    }

    pub fn len(&self) -> usize {
        self.state.len
    }

    pub fn is_empty(&self) -> bool {
        self.state.len == 0
    }

    /// Whether the folio holding byte `offset` is resident (mapped, not
    /// evicted or being evicted): `mincore` for a region.
    pub fn is_resident(&self, offset: usize) -> bool {
        let f = offset / self.inner.cfg.folio_size;
        self.state.state.get(f).is_some_and(|s| s.load(Ordering::Acquire) == RESIDENT)
    }

    /// The tier key of the page holding byte `offset` (for tools and tests
    /// that look at where a page is stored).
    pub fn entry_key(&self, offset: usize) -> u64 {
        self.state.key(offset / PAGE_SIZE)
    }

    /// The region as atomic words, for the lifetime of the region (touching
    /// a page faults it in).
    pub fn words(&self) -> &[AtomicU64] {
        let addr = self.addr();
        // SAFETY: 1. [addr, addr + len) is this region's mapping, which lives
        // until the Region (and so this borrow) is dropped; 2. it is
        // 8-aligned; 3. its bytes are only ever reached through atomics and
        // the kernel, so shared atomic views are sound.
        unsafe { std::slice::from_raw_parts(addr as *const AtomicU64, self.state.len / 8) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let inner = &self.inner;
        let st = &self.state;
        let addr = st.start.load(Ordering::Acquire);
        let _ = inner.uffd.unregister(addr, st.len as u64);
        inner.regions.write().unwrap_or_else(|e| e.into_inner()).remove(&addr);
        for (f, s) in st.state.iter().enumerate() {
            let (lock, cv) = inner.stripe(st, f);
            let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
            while s.load(Ordering::Acquire) == EVICTING {
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            let old = s.swap(NEVER, Ordering::AcqRel);
            drop(g);
            if old == RESIDENT {
                inner.resident.fetch_sub(1, Ordering::Relaxed);
            }
            if old == EVICTED {
                inner.invalidate_folio(st, f);
            }
        }
        inner.tables.fetch_sub(st.state.len() * 3, Ordering::Relaxed);
        // Unregistered, so munmap raises no event. The region may have been
        // mremapped since it was mapped: unmap it where it is now.
        if let Some(m) = st.mapping.lock().unwrap_or_else(|e| e.into_inner()).take() {
            std::mem::forget(m);
            // SAFETY: [addr, addr + len) is this region's mapping at its
            // current address (tracked through Remap events); nothing refers
            // into it once the Region is gone.
            let r = unsafe { rustix::mm::munmap(addr as *mut _, st.len) };
            debug_assert!(r.is_ok(), "munmap of a region failed: {r:?}");
        }
    }
}

impl Pager {
    /// Starts a pager: its userfaultfd, tier, handler and reclaim threads.
    ///
    /// # Errors
    /// A bad configuration, no userfaultfd (with what to change), or the
    /// tier's errors.
    pub fn new(cfg: PagerConfig) -> Result<Pager, PagerError> {
        let fs = cfg.folio_size;
        if !fs.is_power_of_two() || !(PAGE_SIZE..=2 << 20).contains(&fs) {
            return Err(PagerError::Config(format!("folio_size {fs} must be a power of two in 4 KiB..=2 MiB")));
        }
        if !(1..=32).contains(&cfg.reclaim_batch) {
            return Err(PagerError::Config(format!("reclaim_batch {} must be in 1..=32", cfg.reclaim_batch)));
        }
        if cfg.low_watermark_percent >= cfg.high_watermark_percent || cfg.high_watermark_percent > 100 {
            return Err(PagerError::Config("watermarks must satisfy low < high <= 100".into()));
        }
        if cfg.limit < 4 * fs * cfg.reclaim_batch {
            return Err(PagerError::Config(format!(
                "limit {} is below four reclaim batches ({} bytes)",
                cfg.limit,
                4 * fs * cfg.reclaim_batch
            )));
        }
        if !(1..=16).contains(&cfg.handler_threads) {
            return Err(PagerError::Config(format!("handler_threads {} must be in 1..=16", cfg.handler_threads)));
        }
        let mut want = Features::MOVE | Features::EVENT_REMOVE | Features::EVENT_UNMAP | Features::EVENT_REMAP;
        let offered = Uffd::offered(OpenMode::Auto)?;
        let tracking = cfg.track_writes && offered.contains(Features::WP_ASYNC);
        if tracking {
            want = want | Features::WP_ASYNC;
        }
        let poison = offered.contains(Features::POISON);
        if poison {
            want = want | Features::POISON;
        }
        let uffd = Uffd::open(OpenMode::Auto, want)?;
        // Loads keep their entries until the folio is mapped: a COPY can fail
        // with EAGAIN (an unread event), and the pages must survive a retry.
        let tier = Tier::new(TierConfig { exclusive_loads: false, ..cfg.tier.clone() })?;
        let inner = Arc::new(Inner {
            stripes: (0..STRIPES).map(|_| (Mutex::new(()), Condvar::new())).collect(),
            clock: Mutex::new(Lru::default()),
            regions: RwLock::new(BTreeMap::new()),
            resident: AtomicUsize::new(0),
            tables: AtomicUsize::new(0),
            clock_len: AtomicUsize::new(0),
            tracking,
            next_region: AtomicU32::new(1),
            counters: Counters::default(),
            stop: AtomicBool::new(false),
            kick: (Mutex::new(false), Condvar::new()),
            reclaimed: (Mutex::new(()), Condvar::new()),
            dropped: Mutex::new(HashMap::new()),
            held: Mutex::new(HashMap::new()),
            held_bytes: AtomicUsize::new(0),
            soft: AtomicBool::new(false),
            poison,
            uffd,
            tier,
            cfg,
        });
        let staging = Mapping::new(inner.cfg.folio_size * inner.cfg.reclaim_batch).map_err(PagerError::Map)?;
        // Staging shares the regions' registration mode: UFFDIO_MOVE needs
        // both sides to have the same page protection, and WP registration
        // changes it.
        inner.uffd.register(staging.addr(), staging.len() as u64, inner.register_mode())?;
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            let init = inner.cfg.thread_init;
            std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    if let Some(init) = init {
                        init();
                    }
                    f();
                })
                .map_err(|e| PagerError::Config(format!("spawn a pager thread: {e}")))
        };
        let mut threads = Vec::new();
        for i in 0..inner.cfg.handler_threads {
            let h = Arc::clone(&inner);
            let cpu = (!h.cfg.handler_cpus.is_empty()).then(|| h.cfg.handler_cpus[i % h.cfg.handler_cpus.len()]);
            threads.push(spawn(format!("zmem-handler-{i}"), Box::new(move || h.handler_main(cpu)))?);
        }
        let r = Arc::clone(&inner);
        threads.push(spawn("zmem-reclaim".into(), Box::new(move || r.reclaim_main(staging)))?);
        Ok(Pager { inner, threads })
    }

    /// Maps `len` bytes (rounded up to folios) of managed memory.
    ///
    /// # Errors
    /// mmap or userfaultfd registration errors.
    pub fn map(&self, len: usize) -> Result<Region, PagerError> {
        let fs = self.inner.cfg.folio_size;
        let len = len.max(1).div_ceil(fs) * fs;
        let m = Mapping::new(len).map_err(PagerError::Map)?;
        let addr = m.addr();
        let advice = rustix::mm::Advice::LinuxDontFork;
        // SAFETY: the range is our fresh mapping; DONTFORK changes only what
        // a child inherits.
        unsafe { rustix::mm::madvise(addr as *mut _, len, advice) }.map_err(PagerError::Map)?;
        self.inner.uffd.register(addr, len as u64, self.inner.register_mode())?;
        let nf = len / fs;
        self.inner.tables.fetch_add(nf * 3, Ordering::Relaxed);
        let state = Arc::new(RegionState {
            id: self.inner.next_region.fetch_add(1, Ordering::Relaxed),
            start: AtomicU64::new(addr),
            mapping: Mutex::new(Some(m)),
            len,
            state: (0..nf).map(|_| AtomicU8::new(NEVER)).collect(),
            referenced: (0..nf).map(|_| AtomicBool::new(false)).collect(),
            queued: (0..nf).map(|_| AtomicBool::new(false)).collect(),
        });
        self.inner.regions.write().unwrap_or_else(|e| e.into_inner()).insert(addr, Arc::clone(&state));
        Ok(Region { state, inner: Arc::clone(&self.inner) })
    }

    pub fn tier(&self) -> &Tier {
        &self.inner.tier
    }

    pub fn stats(&self) -> PagerStats {
        let c = &self.inner.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PagerStats {
            zero_faults: r(&c.zero_faults),
            load_faults: r(&c.load_faults),
            dropped_page_faults: r(&c.dropped_page_faults),
            eviction_waits: r(&c.eviction_waits),
            stray_faults: r(&c.stray_faults),
            evicted_folios: r(&c.evicted_folios),
            eviction_rejects: r(&c.eviction_rejects),
            direct_reclaim_waits: r(&c.direct_reclaim_waits),
            limit_soft_events: r(&c.limit_soft_events),
            limit_soft: self.inner.soft.load(Ordering::Relaxed),
            unevictable_folios: r(&c.unevictable_folios),
            held_bytes: self.inner.held_bytes.load(Ordering::Relaxed) as u64,
            poisoned_pages: r(&c.poisoned_pages),
            write_scans: r(&c.write_scans),
            written_folios: r(&c.written_folios),
            resident_bytes: (self.inner.resident.load(Ordering::Relaxed) * self.inner.cfg.folio_size) as u64,
            metadata_bytes: self.inner.metadata() as u64,
            usage_bytes: self.inner.usage() as u64,
            tracking_writes: self.inner.tracking,
        }
    }

    /// Evicts down to the low watermark now, and waits for it.
    pub fn reclaim_now(&self) {
        self.inner.kick_reclaim();
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.inner.usage() > self.inner.low()
            && !self.inner.soft.load(Ordering::Relaxed)
            && Instant::now() < deadline
        {
            let g = self.inner.reclaimed.0.lock().unwrap_or_else(|e| e.into_inner());
            let _ = self.inner.reclaimed.1.wait_timeout(g, Duration::from_millis(5));
        }
    }
}

impl Drop for Pager {
    /// Stops reclaim. The handler serves faults until the last region is
    /// dropped: regions may outlive their pager, and a fault nobody serves
    /// would hang. With no region left, both threads are joined.
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        self.inner.kick_reclaim();
        if self.inner.regions.read().unwrap_or_else(|e| e.into_inner()).is_empty() {
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}

impl Inner {
    fn usage(&self) -> usize {
        self.resident.load(Ordering::Relaxed) * self.cfg.folio_size
            + self.held_bytes.load(Ordering::Relaxed)
            + self.tier.pool_total_size()
            + self.metadata()
    }

    fn metadata(&self) -> usize {
        self.tables.load(Ordering::Relaxed)
            + self.clock_len.load(Ordering::Relaxed) * std::mem::size_of::<(Arc<RegionState>, usize)>()
            + self.tier.entry_metadata_bytes()
    }

    fn register_mode(&self) -> RegisterMode {
        RegisterMode { missing: true, wp: self.tracking }
    }

    fn high(&self) -> usize {
        self.cfg.limit / 100 * self.cfg.high_watermark_percent as usize
    }

    fn low(&self) -> usize {
        self.cfg.limit / 100 * self.cfg.low_watermark_percent as usize
    }

    fn stripe(&self, st: &RegionState, f: usize) -> &(Mutex<()>, Condvar) {
        &self.stripes[(st.id as usize * 7919 + f) % STRIPES]
    }

    fn kick_reclaim(&self) {
        *self.kick.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.kick.1.notify_one();
    }

    fn region_at(&self, addr: u64) -> Option<Arc<RegionState>> {
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let (_, r) = regions.range(..=addr).next_back()?;
        (addr < r.start.load(Ordering::Acquire) + r.len as u64).then(|| Arc::clone(r))
    }

    /// Drops every entry of folio `f`, and its held pages. The caller holds
    /// the folio's stripe lock, or owns the folio (a dying region).
    fn invalidate_folio(&self, st: &RegionState, f: usize) {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        for p in f * ppf..(f + 1) * ppf {
            self.tier.invalidate(st.key(p));
        }
        self.unhold(st, f);
    }

    fn unhold(&self, st: &RegionState, f: usize) {
        if let Some(h) = self.held.lock().unwrap_or_else(|e| e.into_inner()).remove(&(st.id, f)) {
            self.held_bytes.fetch_sub(h.data.len(), Ordering::Relaxed);
        }
    }

    // ---------------------------------------------------------------- faults

    fn handler_main(self: Arc<Self>, cpu: Option<usize>) {
        if let Some(cpu) = cpu {
            let mut set = rustix::thread::CpuSet::new();
            set.set(cpu);
            if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
                eprintln!("zmem: pinning a handler to CPU {cpu} failed: {e}");
            }
        }
        let mut bounce = vec![0u8; self.cfg.folio_size];
        let mut pending: VecDeque<u64> = VecDeque::new();
        let spin = self.cfg.handler_spin;
        let mut last_event = Instant::now();
        loop {
            if self.stop.load(Ordering::Acquire) && self.regions.read().unwrap_or_else(|e| e.into_inner()).is_empty() {
                return;
            }
            // Busy-poll (non-blocking reads) for `spin` after the last
            // event, then block in poll(2).
            let spinning = !spin.is_zero() && pending.is_empty() && last_event.elapsed() < spin;
            if !spinning {
                let timeout = if pending.is_empty() { Duration::from_millis(50) } else { Duration::from_micros(50) };
                if self.uffd.wait(Some(timeout)).is_err() {
                    return;
                }
            }
            let Ok(events) = self.uffd.read_events(64) else { return };
            if events.is_empty() {
                if spinning {
                    std::hint::spin_loop();
                }
            } else {
                last_event = Instant::now();
            }
            for ev in events {
                match ev {
                    Event::PageFault { addr, .. } => pending.push_back(addr),
                    Event::Remove { start, end } | Event::Unmap { start, end } => self.drop_range(start, end),
                    Event::Remap { from, to, len } => self.remap(from, to, len),
                    Event::Fork { .. } | Event::Unknown(_) => {}
                }
            }
            // Serve faults in order; a folio being evicted waits its turn
            // (the others go ahead), and at the first EAGAIN go back and
            // read the event that blocks them all.
            let mut i = 0;
            while i < pending.len() {
                match self.fault(pending[i], &mut bounce) {
                    Served::Done => {
                        pending.remove(i);
                    }
                    Served::Busy => i += 1,
                    Served::Again => break,
                }
            }
        }
    }

    fn fault(&self, addr: u64, bounce: &mut [u8]) -> Served {
        let fs = self.cfg.folio_size as u64;
        let Some(st) = self.region_at(addr) else {
            // Not a region (a staging page, or a region being torn down):
            // map a zero page so that the thread is not stuck.
            inc(&self.counters.stray_faults);
            // SAFETY: an address of a range registered with our uffd, which
            // no Rust reference covers.
            let r = unsafe { self.uffd.zeropage(addr & !(PAGE_SIZE as u64 - 1), PAGE_SIZE as u64, false) };
            return if matches!(r, Err(UffdError::Again { .. })) { Served::Again } else { Served::Done };
        };
        let start = st.start.load(Ordering::Acquire);
        let f = ((addr - start) / fs) as usize;
        let folio_addr = start + f as u64 * fs;
        let (lock, _) = self.stripe(&st, f);
        let g = lock.lock().unwrap_or_else(|e| e.into_inner());
        match st.state[f].load(Ordering::Acquire) {
            EVICTING => {
                // Never wait here: the evictor may need this thread to
                // read an event before its MOVE can finish.
                inc(&self.counters.eviction_waits);
                return Served::Busy;
            }
            NEVER => {
                // SAFETY: the folio lies in our registered region, reached
                // only through atomics and the kernel.
                if let Err(UffdError::Again { .. }) = unsafe { self.uffd.zeropage(folio_addr, fs, false) } {
                    return Served::Again;
                }
                self.became_resident(&st, f);
                inc(&self.counters.zero_faults);
            }
            EVICTED => {
                bounce.fill(0);
                let ppf = bounce.len() / PAGE_SIZE;
                let mut bad = vec![false; ppf];
                for (i, page) in bounce.chunks_exact_mut(PAGE_SIZE).enumerate() {
                    match self.tier.load(st.key(f * ppf + i), page) {
                        Ok(LoadOutcome::Loaded | LoadOutcome::NotFound) => {}
                        Err(e) => {
                            // Never hand the program wrong data: the
                            // page is poisoned below (SIGBUS on touch).
                            eprintln!("zmem: page {} of a region failed to load: {e}", f * ppf + i);
                            bad[i] = true;
                        }
                    }
                }
                if let Some(h) = self.held.lock().unwrap_or_else(|e| e.into_inner()).get(&(st.id, f)) {
                    for (i, page) in bounce.chunks_exact_mut(PAGE_SIZE).enumerate().filter(|(i, _)| h.present[*i]) {
                        page.copy_from_slice(&h.data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
                    }
                }
                if self.copy_folio(folio_addr, bounce, &bad) == Served::Again {
                    // Nothing is lost: the entries are still in the tier.
                    return Served::Again;
                }
                let nbad = bad.iter().filter(|&&b| b).count() as u64;
                self.counters.poisoned_pages.fetch_add(nbad, Ordering::Relaxed);
                self.invalidate_folio(&st, f);
                self.became_resident(&st, f);
                inc(&self.counters.load_faults);
            }
            _ => {
                // A page the program dropped from a resident folio.
                // SAFETY: as above.
                let r = unsafe { self.uffd.zeropage(addr & !(PAGE_SIZE as u64 - 1), PAGE_SIZE as u64, false) };
                if let Err(UffdError::Again { .. }) = r {
                    return Served::Again;
                }
                inc(&self.counters.dropped_page_faults);
            }
        }
        drop(g);
        if self.usage() > self.high() {
            self.kick_reclaim();
        }
        if self.usage() > self.cfg.limit && !self.soft.load(Ordering::Relaxed) {
            // Direct reclaim, bounded: wait for the reclaimer a little.
            inc(&self.counters.direct_reclaim_waits);
            let deadline = Instant::now() + self.cfg.direct_reclaim_wait;
            while self.usage() > self.cfg.limit && Instant::now() < deadline {
                let g = self.reclaimed.0.lock().unwrap_or_else(|e| e.into_inner());
                let _ = self.reclaimed.1.wait_timeout(g, Duration::from_millis(1));
            }
        }
        Served::Done
    }

    /// COPYs a folio, stepping over pages that are still mapped (EEXIST),
    /// and poisons the `bad` pages (or zero-fills them where the kernel
    /// lacks UFFDIO_POISON). On `Again`, what was done stays (a retry steps
    /// over it).
    fn copy_folio(&self, dst: u64, src: &[u8], bad: &[bool]) -> Served {
        let ppf = src.len() / PAGE_SIZE;
        let mut p = 0;
        while p < ppf {
            let run = bad[p..].iter().take_while(|&&b| b == bad[p]).count();
            let (a, n) = (dst + (p * PAGE_SIZE) as u64, (run * PAGE_SIZE) as u64);
            let r = if bad[p] && self.poison {
                match self.uffd.poison(a, n) {
                    Err(UffdError::Again { .. }) => Served::Again,
                    Err(e) => {
                        eprintln!("zmem: UFFDIO_POISON failed: {e}");
                        Served::Done
                    }
                    Ok(_) => Served::Done,
                }
            } else {
                self.copy_run(a, &src[p * PAGE_SIZE..(p + run) * PAGE_SIZE])
            };
            if r == Served::Again {
                return r;
            }
            p += run;
        }
        Served::Done
    }

    fn copy_run(&self, dst: u64, src: &[u8]) -> Served {
        let mut off = 0u64;
        let len = src.len() as u64;
        while off < len {
            // SAFETY: src is our bounce buffer; dst lies in a registered
            // region reached only through atomics and the kernel.
            let n =
                unsafe { self.uffd.copy_wp(dst + off, src[off as usize..].as_ptr(), len - off, false, self.tracking) };
            match n {
                Ok(n) if n == len - off => break,
                // Stopped at a page that is present: step over it.
                Ok(n) => off += n + PAGE_SIZE as u64,
                Err(UffdError::Again { .. }) => return Served::Again,
                Err(e) => {
                    eprintln!("zmem: UFFDIO_COPY failed: {e}");
                    break;
                }
            }
        }
        Served::Done
    }

    fn became_resident(&self, st: &Arc<RegionState>, f: usize) {
        st.state[f].store(RESIDENT, Ordering::Release);
        // With write tracking, loaded pages are mapped write-protected and
        // a write after the fault is what counts; without it, the fault
        // itself is the only access CLOCK can see.
        st.referenced[f].store(!self.tracking, Ordering::Relaxed);
        self.resident.fetch_add(1, Ordering::Relaxed);
        self.clock_push(st, f);
    }

    fn clock_push(&self, st: &Arc<RegionState>, f: usize) {
        if st.queued[f].swap(true, Ordering::AcqRel) {
            return;
        }
        self.clock.lock().unwrap_or_else(|e| e.into_inner()).inactive.push_back((Arc::clone(st), f));
        self.clock_len.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether folio `f` was written since it was last asked (its pages are
    /// write-protected again, so the next write is seen too). Reads are not
    /// seen: a folio only read counts as cold.
    fn written_since_last_pass(&self, tracker: &mut WriteTracker, st: &RegionState, f: usize) -> bool {
        let fs = self.cfg.folio_size as u64;
        let start = st.start.load(Ordering::Acquire) + f as u64 * fs;
        let mut written = false;
        inc(&self.counters.write_scans);
        if let Err(e) = tracker.scan_written(start, start + fs, |_, _| written = true) {
            // A region being unmapped or remapped under us: treat as cold.
            if !matches!(e, UffdError::Ioctl { errno: rustix::io::Errno::INVAL | rustix::io::Errno::PERM, .. }) {
                eprintln!("zmem: write tracking scan failed: {e}");
            }
        }
        if written {
            inc(&self.counters.written_folios);
        }
        written
    }

    /// The program dropped `[start, end)` (madvise or munmap): its entries go.
    fn drop_range(&self, start: u64, end: u64) {
        let Some(st) = self.region_at(start) else { return };
        let base = st.start.load(Ordering::Acquire);
        let first_page = ((start - base) / PAGE_SIZE as u64) as usize;
        let last_page = ((end.min(base + st.len as u64) - base).div_ceil(PAGE_SIZE as u64)) as usize;
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        for f in first_page / ppf..last_page.div_ceil(ppf) {
            let (lock, _) = self.stripe(&st, f);
            let g = lock.lock().unwrap_or_else(|e| e.into_inner());
            let pages = (f * ppf).max(first_page)..((f + 1) * ppf).min(last_page);
            if st.state[f].load(Ordering::Acquire) == EVICTING {
                // The evictor drops these pages' entries when it finishes
                // (this thread must not wait for it: see `fault`).
                let mut d = self.dropped.lock().unwrap_or_else(|e| e.into_inner());
                let mask = d.entry((st.id, f)).or_insert_with(|| vec![false; ppf]);
                mask[pages.start - f * ppf..pages.end - f * ppf].fill(true);
                continue;
            }
            for p in pages.clone() {
                self.tier.invalidate(st.key(p));
            }
            if let Some(h) = self.held.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&(st.id, f)) {
                h.present[pages.start - f * ppf..pages.end - f * ppf].fill(false);
            }
            let whole = first_page <= f * ppf && (f + 1) * ppf <= last_page;
            // A whole folio dropped is as if never touched; a resident folio
            // partly dropped stays resident (its dropped pages fault to zero).
            if whole && st.state[f].swap(NEVER, Ordering::AcqRel) == RESIDENT {
                self.resident.fetch_sub(1, Ordering::Relaxed);
            }
            drop(g);
        }
    }

    /// A whole region moved: entries are region-relative, so only its
    /// address changes.
    fn remap(&self, from: u64, to: u64, len: u64) {
        let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
        if let Some(st) = regions.remove(&from) {
            if st.len as u64 == len {
                st.start.store(to, Ordering::Release);
                regions.insert(to, st);
            } else {
                eprintln!("zmem: a partial mremap of a managed region is not supported; its entries are dropped");
                drop(regions);
                let fs = self.cfg.folio_size;
                for f in 0..st.len / fs {
                    self.invalidate_folio(&st, f);
                }
            }
        }
    }

    // --------------------------------------------------------------- reclaim

    fn reclaim_main(self: Arc<Self>, staging: Mapping) {
        let mut tracker = if self.tracking {
            WriteTracker::open().map_err(|e| eprintln!("zmem: no write tracking ({e}); CLOCK sees faults only")).ok()
        } else {
            None
        };
        let (mut backoff, mut retry_at, mut warned) = (Duration::ZERO, Instant::now(), false);
        let mut rescan_at = Instant::now() + UNEVICTABLE_RESCAN;
        loop {
            if Instant::now() >= rescan_at {
                rescan_at = Instant::now() + UNEVICTABLE_RESCAN;
                let mut lru = self.clock.lock().unwrap_or_else(|e| e.into_inner());
                let back = std::mem::take(&mut lru.unevictable);
                lru.inactive.extend(back);
            }
            {
                let mut k = self.kick.0.lock().unwrap_or_else(|e| e.into_inner());
                if !*k {
                    k = self.kick.1.wait_timeout(k, Duration::from_millis(10)).unwrap_or_else(|e| e.into_inner()).0;
                }
                *k = false;
            }
            if self.stop.load(Ordering::Acquire) {
                // Unregister before the munmap: an UNMAP event would wait
                // for a handler that may already be gone.
                let _ = self.uffd.unregister(staging.addr(), staging.len() as u64);
                return;
            }
            if self.usage() <= self.cfg.limit {
                self.soft.store(false, Ordering::Relaxed);
            }
            if self.usage() > self.high() && Instant::now() >= retry_at {
                while self.usage() > self.low() {
                    let pass = self.evict_batch(&staging, tracker.as_mut());
                    self.reclaimed.1.notify_all();
                    if pass.evicted > 0 || (pass.unevictable > 0 && pass.rejected == 0) {
                        // Progress, or unevictable folios set aside: go on.
                        backoff = Duration::ZERO;
                        self.soft.store(false, Ordering::Relaxed);
                        continue;
                    }
                    // Nothing could go: the pool is full and writeback is
                    // off or failing, or what is left is unevictable. The
                    // limit turns soft, as memory.high does, and reclaim
                    // backs off rather than spin.
                    if self.usage() > self.cfg.limit || pass.rejected + pass.unevictable > 0 {
                        backoff = (backoff * 2).clamp(Duration::from_millis(50), Duration::from_secs(2));
                        retry_at = Instant::now() + backoff;
                        if !self.soft.swap(true, Ordering::Relaxed) {
                            inc(&self.counters.limit_soft_events);
                            if !warned {
                                warned = true;
                                eprintln!(
                                    "zmem: usage {} MiB is over the limit and nothing more can be evicted \
                                     ({}); the limit is soft until reclaim succeeds again",
                                    self.usage() >> 20,
                                    if self.tier.config().writeback {
                                        "the pool is full and writeback fails"
                                    } else {
                                        "the pool is full and writeback is off"
                                    }
                                );
                            }
                        }
                    }
                    break;
                }
            }
            self.reclaimed.1.notify_all();
        }
    }

    /// Picks victims from the two lists. A folio is accessed if it was
    /// faulted in or (with write tracking) written since it was last
    /// looked at; looking clears both (written pages are protected again).
    /// - Inactive head: accessed goes to the active tail, otherwise evicted.
    /// - Active head (while inactive is under a third of all): accessed goes
    ///   round again, otherwise down to the inactive tail.
    ///
    /// A folio written once (a stream) is evicted after one trip through
    /// each list; a folio written all the time stays in the active one.
    fn pick_victims(&self, mut tracker: Option<&mut WriteTracker>) -> Vec<(Arc<RegionState>, usize)> {
        let mut lru = self.clock.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        // Each look may cost a PAGEMAP_SCAN: bound them, and when every
        // folio looked at was in use, take the inactive (then active)
        // heads as they come.
        let mut budget = ((lru.active.len() + lru.inactive.len()) * 2).min(16 * self.cfg.reclaim_batch);
        while out.len() < self.cfg.reclaim_batch && budget > 0 {
            budget -= 1;
            let total = lru.active.len() + lru.inactive.len();
            let from_active = lru.inactive.len() * 3 < total && !lru.active.is_empty();
            let popped = if from_active { lru.active.pop_front() } else { lru.inactive.pop_front() };
            let Some((st, f)) = popped else { break };
            if st.state[f].load(Ordering::Acquire) != RESIDENT || st.mapping.lock().map_or(true, |m| m.is_none()) {
                // Evicted, dropped, or its region is gone.
                self.clock_len.fetch_sub(1, Ordering::Relaxed);
                st.queued[f].store(false, Ordering::Release);
                continue;
            }
            let referenced = st.referenced[f].swap(false, Ordering::Relaxed);
            let written = tracker.as_deref_mut().is_some_and(|t| self.written_since_last_pass(t, &st, f));
            if referenced || written {
                lru.active.push_back((st, f));
            } else if from_active {
                lru.inactive.push_back((st, f));
            } else {
                self.clock_len.fetch_sub(1, Ordering::Relaxed);
                st.queued[f].store(false, Ordering::Release);
                out.push((st, f));
            }
        }
        while out.len() < self.cfg.reclaim_batch {
            let Some((st, f)) = lru.inactive.pop_front().or_else(|| lru.active.pop_front()) else { break };
            self.clock_len.fetch_sub(1, Ordering::Relaxed);
            st.queued[f].store(false, Ordering::Release);
            if st.state[f].load(Ordering::Acquire) == RESIDENT && st.mapping.lock().is_ok_and(|m| m.is_some()) {
                out.push((st, f));
            }
        }
        out
    }

    /// Evicts one batch.
    ///
    /// 1. Isolate: each victim goes RESIDENT -> EVICTING under its stripe
    ///    lock. From here faults on it are deferred (`Served::Busy`).
    /// 2. MOVE its pages into staging, with no lock held: a MOVE that gets
    ///    EAGAIN waits for the handler to read an event, and the handler
    ///    never waits for us.
    /// 3. Store the pages in the tier.
    /// 4. Finish under the stripe lock: EVICTED, dropping the entries of
    ///    pages the program dropped meanwhile. A rejected folio keeps its
    ///    pages uncompressed (`held`) until a fault maps them again.
    fn evict_batch(&self, staging: &Mapping, tracker: Option<&mut WriteTracker>) -> Pass {
        let fs = self.cfg.folio_size;
        let ppf = fs / PAGE_SIZE;
        let mut pass = Pass::default();
        let mut isolated = Vec::new();
        for (st, f) in self.pick_victims(tracker) {
            let (lock, _) = self.stripe(&st, f);
            let g = lock.lock().unwrap_or_else(|e| e.into_inner());
            if st.state[f].load(Ordering::Acquire) != RESIDENT {
                continue;
            }
            st.state[f].store(EVICTING, Ordering::Release);
            self.resident.fetch_sub(1, Ordering::Relaxed);
            drop(g);
            isolated.push((st, f));
        }
        // (victim, slot in staging, which pages moved)
        let mut moved: Vec<(Arc<RegionState>, usize, Vec<bool>)> = Vec::new();
        for (st, f) in isolated {
            let dst = staging.addr() + (moved.len() * fs) as u64;
            let (present, stuck) = self.move_folio(&st, f, dst);
            if stuck && !present.contains(&true) {
                // Nothing could move (mlocked, pinned): it stays resident,
                // and is looked at again only after a trip round the lists.
                self.finish(&st, f, |_| {
                    st.state[f].store(RESIDENT, Ordering::Release);
                    self.resident.fetch_add(1, Ordering::Relaxed);
                });
                // Off the lists (as the kernel's unevictable LRU) until
                // reclaim looks again, now and then: it may be unlocked.
                st.queued[f].store(true, Ordering::Release);
                self.clock.lock().unwrap_or_else(|e| e.into_inner()).unevictable.push((Arc::clone(&st), f));
                self.clock_len.fetch_add(1, Ordering::Relaxed);
                inc(&self.counters.unevictable_folios);
                pass.unevictable += 1;
                continue;
            }
            moved.push((st, f, present));
        }
        let n = moved.len();
        for (slot, (st, f, present)) in moved.iter().enumerate() {
            let base = staging.addr() as usize + slot * fs;
            // Only the pages MOVE filled may be touched: a hole in staging
            // is a MISSING fault, which the handler may be unable to serve
            // while we hold a stripe lock.
            let runs = page_runs(present);
            let run_data = |p: usize, n: usize| {
                // SAFETY: 1. [p, p + n) is a run of present pages of this
                // staging slot, mapped by MOVE; 2. only this thread touches
                // staging, and nothing changes it until the DONTNEED below,
                // after this borrow ends.
                unsafe { std::slice::from_raw_parts((base + p * PAGE_SIZE) as *const u8, n * PAGE_SIZE) }
            };
            let mut ok = true;
            for &(p, n) in &runs {
                match self.tier.store(st.key(f * ppf + p), run_data(p, n)) {
                    Ok(StoreOutcome::Stored { .. }) => {}
                    _ => ok = false,
                }
            }
            // A rejected folio's pages are copied out before the lock.
            let kept = (!ok).then(|| {
                let mut data = vec![0u8; fs].into_boxed_slice();
                for &(p, n) in &runs {
                    data[p * PAGE_SIZE..(p + n) * PAGE_SIZE].copy_from_slice(run_data(p, n));
                }
                data
            });
            self.finish(st, *f, |dropped| {
                if ok {
                    inc(&self.counters.evicted_folios);
                    pass.evicted += 1;
                } else {
                    // Keep the pages as they are (what was stored goes).
                    for p in 0..ppf {
                        self.tier.invalidate(st.key(f * ppf + p));
                    }
                    let present: Vec<bool> = present.iter().zip(dropped).map(|(&p, &d)| p && !d).collect();
                    if let Some(data) = kept.filter(|_| present.contains(&true)) {
                        let h = Held { data, present };
                        self.held_bytes.fetch_add(fs, Ordering::Relaxed);
                        let old = self.held.lock().unwrap_or_else(|e| e.into_inner()).insert((st.id, *f), h);
                        debug_assert!(old.is_none(), "a held folio was evicted again");
                    }
                    inc(&self.counters.eviction_rejects);
                    pass.rejected += 1;
                }
                st.state[*f].store(EVICTED, Ordering::Release);
            });
        }
        if n > 0 {
            // Free the staging pages. A DONTNEED of a registered range raises
            // a REMOVE event, and until it is read every COPY fails with
            // EAGAIN: back to back, reclaim batches would starve faults. So
            // staging is unregistered around it (three cheap syscalls).
            let (a, l) = (staging.addr(), staging.len() as u64);
            let _ = self.uffd.unregister(a, l);
            let _ = staging.dontneed(0, n * fs);
            if let Err(e) = self.uffd.register(a, l, self.register_mode()) {
                eprintln!("zmem: re-registering the staging area failed ({e}); reclaim stops");
                self.stop.store(true, Ordering::Release);
            }
        }
        pass
    }

    /// MOVEs folio `f` (EVICTING) to `dst` in staging. Returns which pages
    /// moved, and whether some page could not move for a reason other than
    /// being a hole (it stays mapped).
    fn move_folio(&self, st: &RegionState, f: usize, dst: u64) -> (Vec<bool>, bool) {
        let fs = self.cfg.folio_size as u64;
        let mut present = vec![false; fs as usize / PAGE_SIZE];
        let mut stuck = false;
        let mut off = 0u64;
        while off < fs {
            // Read the address each time: a REMAP may move the region.
            let src = st.start.load(Ordering::Acquire) + f as u64 * fs;
            // SAFETY: src lies in a registered region (or a range it left,
            // which then fails) and dst in our registered staging area;
            // neither is covered by a reference.
            match unsafe { self.uffd.move_until_hole(dst + off, src + off, fs - off) } {
                Ok(n) => {
                    present[off as usize / PAGE_SIZE..(off + n) as usize / PAGE_SIZE].fill(true);
                    // A hole (or the end) follows what moved.
                    off += n + PAGE_SIZE as u64;
                }
                // An event is unread: the handler reads it (it never waits
                // for an EVICTING folio), then the MOVE goes through.
                Err(UffdError::Again { done }) => {
                    present[off as usize / PAGE_SIZE..(off + done) as usize / PAGE_SIZE].fill(true);
                    off += done;
                    std::thread::sleep(Duration::from_micros(20));
                }
                // A page that cannot move (mlocked, shared, pinned) stays.
                Err(_) => {
                    stuck = true;
                    off += PAGE_SIZE as u64;
                }
            }
        }
        (present, stuck)
    }

    /// Ends an eviction of folio `f` under its stripe lock: `done` gets the
    /// pages the program dropped meanwhile (their entries are gone after
    /// it) and sets the new state; waiters are woken.
    fn finish(&self, st: &RegionState, f: usize, done: impl FnOnce(&[bool])) {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let (lock, cv) = self.stripe(st, f);
        let g = lock.lock().unwrap_or_else(|e| e.into_inner());
        let dropped = self.dropped.lock().unwrap_or_else(|e| e.into_inner()).remove(&(st.id, f));
        let dropped = dropped.unwrap_or_else(|| vec![false; ppf]);
        done(&dropped);
        for p in dropped.iter().enumerate().filter(|(_, &d)| d).map(|(p, _)| p) {
            self.tier.invalidate(st.key(f * ppf + p));
        }
        cv.notify_all();
        drop(g);
    }
}

/// The runs of `true` in `present`, as (first page, pages).
fn page_runs(present: &[bool]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut p = 0;
    while p < present.len() {
        if present[p] {
            let n = present[p..].iter().take_while(|&&x| x).count();
            runs.push((p, n));
            p += n;
        } else {
            p += 1;
        }
    }
    runs
}
