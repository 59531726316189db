//! The pager: anonymous memory under a limit, backed by the tier.
//!
//! A [`Pager`] owns one userfaultfd, handler threads, a reclaim thread and
//! a [`Tier`]. [`Pager::map`] hands out [`Region`]s: anonymous private
//! memory registered for MISSING faults. Memory is managed in folios
//! (64 KiB by default). One file per verb:
//!
//! | file | what |
//! |---|---|
//! | `region.rs` | regions and their folio tables; `Pager::map`; unmapping |
//! | `fault.rs` | the handler loop: read events and faults, serve each by folio state, load |
//! | `readahead.rs` | the streams a handler follows; folios loaded or zero-filled ahead |
//! | `install.rs` | COPYs of loaded or zeroed folios, poisoned pages, residency bookkeeping |
//! | `follow.rs`, `spin.rs` | the handler beside the faulting thread; when it busy-polls |
//! | `events.rs` | REMOVE/UNMAP (`drop_range`) and REMAP |
//! | `uaccess.rs` | managed pages the kernel may find unmapped (user-mode-only userfaultfd) |
//! | `lru.rs` | the active, inactive, once and unevictable lists; `isolate_folios` |
//! | `reclaim.rs` | the reclaim thread: its round of steps, the timed chores, the soft limit |
//! | `evict.rs` | a reclaim pass: isolate, MOVE out, store, finish or hold; shared folios |
//! | `staging.rs` | the staging area reclaim MOVEs a batch into |
//! | `direct.rs` | faults waiting for reclaim store folios of its pass |
//! | `accounting.rs` | usage, watermarks, the fault throttle, the tree's share |
//! | `balance.rs` | the pool's share of the limit, moved by what misses cost |
//! | `codec.rs` | the codec of new stores: the fast one, or a stronger one |
//! | `adopt.rs` | memory the program mapped itself, adopted by mapping |
//! | `fork.rs`, `handover.rs`, `import.rs` | fork with load-back; fork with the child taking its pages over (the parent's side, the child's) |
//! | `stats.rs`, `config.rs` | counters; settings and errors |
//!
//! # Folio states (`Folio`)
//! ```text
//! Never ──fault: ZEROPAGE──► Resident ──reclaim: isolate──► Evicting
//!                               ▲ ▲                             │ MOVE to staging, store
//!                               │ └──fault: COPY from staging───┤ (rescue, until stored)
//!                               └──fault: load, COPY── Evicted ◄┘ (or hold, if rejected)
//! ```
//! - A fault on a Never folio maps the zero page over it (a read), or
//!   COPYs zeros (a write: one ioctl, rather than a copy-on-write fault
//!   per page as the program goes on writing).
//! - Eviction marks the folio Evicting, then takes its pages out of the
//!   program's page table with `UFFDIO_MOVE` (atomic, no copy): from then
//!   on any access to a moved page faults, so no write is lost. Until its
//!   pass is stored, such a fault COPYs the pages back from the staging
//!   slot and the folio is Resident again (`Inner::rescue`; the pass's
//!   entries for it are dropped in `finish`), as the kernel's swap cache
//!   serves a fault on a folio under writeback. A fault that comes before
//!   the MOVE, or on a folio the program dropped, moved or unmapped part of
//!   meanwhile, is deferred until the folio is Evicted.
//! - A fault on an Evicted folio loads all of it (fault-around) into a
//!   bounce buffer and maps it with `UFFDIO_COPY`. A page that fails to load
//!   is poisoned (`UFFDIO_POISON`: SIGBUS on touch), never handed over as
//!   zeros or garbage. A folio that loaded whole keeps its entries as
//!   clean copies (`Tier::retain_clean`), and its next eviction stores
//!   only the pages that changed (`Tier::store_reusing`; ARCHITECTURE.md,
//!   "Kept entries").
//! - A folio the tier rejects (pool full without writeback, a codec error)
//!   keeps its pages uncompressed (`held`) and is Evicted all the same: only
//!   the handler maps pages, in event order, so a page the program dropped
//!   meanwhile never comes back.
//! - A fault on a Resident folio is a page the program dropped (madvise): it
//!   gets the zero page.
//! - Pages that were holes at eviction have no entry and come back as
//!   zeros. Pages that would not move (mlocked, pinned) stay mapped, and the
//!   COPY steps over them; a folio none of whose pages moved stays Resident
//!   on the unevictable list.
//!
//! # Accounting and reclaim
//! Usage is resident folios plus held folios plus the tier's pool plus this
//! pager's metadata. Above the high watermark the reclaim thread evicts, in
//! batches of `reclaim_batch` folios (at least 512 KiB), down to the low watermark. A fault
//! that finds usage above the limit kicks reclaim and waits for it, at most
//! `direct_reclaim_wait`. A pass that can evict nothing makes the limit soft
//! (as memory.high): reclaim backs off (50 ms doubling to 2 s) and faults
//! stop waiting, until a pass evicts again.
//!
//! # Lock order
//! The pager's locks are steps 1 and 2 of the project's one lock order
//! (ARCHITECTURE.md, "Lock order"): `events`, then a folio stripe lock
//! (never two), then the tier; the `dropped`, `dropping`, `held` and
//! `staged` mutexes, the reclaim lists and the regions table are leaves.
//!
//! # Events
//! - `madvise(MADV_DONTNEED)` and `munmap` by the program (REMOVE, UNMAP):
//!   the range's entries are invalidated and its folios forget their pages;
//!   for an Evicting folio the pages are recorded (`dropped`) and the
//!   evictor drops their entries when it finishes.
//! - `mremap` of a whole region (REMAP): entries are keyed by (region, page),
//!   so the region just moves. A partial move splits it: the moved part is
//!   a region of its own at its new address whose keys are the old ones
//!   (`events.rs`, `split_moved`).
//! - fork: by default regions are `MADV_DONTFORK`: a child does not inherit
//!   them, and touching one there is a SIGSEGV, never silently wrong data.
//!   With `keep_on_fork` the child inherits them whole (see `fork.rs`).
//!   Pages a fork left shared with another process are neither evicted nor
//!   charged (`Lru::shared`) until they are this process's own again.
//!
//! # A process tree under one limit
//! With `PagerConfig::tree`, the limit is the tree's, and this pager's is
//! its share (`crate::tree`), refreshed at every throttled fault and every
//! reclaim wake-up (`refresh_limit`).
//!
//! # Deadlock avoidance: the handler never waits for reclaim
//! `madvise`, `munmap` and `mremap` of a registered range wait until the
//! handler reads their event, and while an event is unread every COPY,
//! ZEROPAGE and MOVE fails with EAGAIN. Reclaim's MOVE therefore needs the
//! handler to keep reading events, so:
//! - a fault on an Evicting folio is served from staging or deferred
//!   (`Served::Busy`), never waited for; REMOVE/UNMAP on an Evicting folio
//!   are recorded, never waited for;
//! - reclaim holds no stripe lock while a MOVE may get EAGAIN, and touches
//!   only the staging pages MOVE filled (a hole there would be a fault that
//!   the handler must serve);
//! - a fault that gets EAGAIN is deferred until the events are read (its
//!   entries stay in the tier until the COPY succeeds);
//! - reclaim raises no events of its own: it unregisters its staging area
//!   around the DONTNEED that frees it.

mod accounting;
mod adopt;
mod balance;
mod codec;
mod config;
mod direct;
mod events;
mod evict;
mod fault;
mod follow;
mod fork;
mod handover;
mod import;
mod install;
mod lru;
mod readahead;
mod reclaim;
mod region;
mod spin;
mod staging;
mod stats;
mod uaccess;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use zmem_common::{LockExt, RwLockExt};

use zmem_tier::{Tier, TierConfig};

pub use config::{AdoptConfig, PagerConfig, PagerError};
pub use follow::unhold_current_thread;
use lru::Lru;
pub use region::Region;
use region::RegionState;
use staging::Staging;
use stats::Counters;
pub use stats::{PagerStats, REFAULT_BUCKETS};

use crate::sys::{RegisterMode, Uffd, UffdError};
use zmem_common::PAGE_SIZE;

/// A folio's state (one byte per folio in its region's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Folio {
    /// Never touched, or wholly dropped: a fault maps zeros.
    Never = 0,
    /// Mapped in the program.
    Resident = 1,
    /// Being moved out and stored: faults on it are deferred.
    Evicting = 2,
    /// In the tier (or held): a fault loads it.
    Evicted = 3,
}

impl Folio {
    fn from_u8(v: u8) -> Folio {
        match v {
            0 => Folio::Never,
            1 => Folio::Resident,
            2 => Folio::Evicting,
            _ => Folio::Evicted,
        }
    }
}

const STRIPES: usize = 256;

struct Inner {
    cfg: PagerConfig,
    uffd: Uffd,
    tier: Tier,
    /// Regions by (start, id): an adopted region may lie in a hole of an
    /// older one (the program unmapped part of it, and the kernel put a new
    /// mapping there), so two may share a start.
    regions: RwLock<BTreeMap<(u64, u32), Arc<RegionState>>>,
    /// Folio locks, striped (`stripe`); each counts the threads waiting on
    /// its condvar for a folio's eviction to finish.
    stripes: Vec<(Mutex<u32>, Condvar)>,
    lru: Mutex<Lru<(Arc<RegionState>, usize)>>,
    resident: AtomicUsize,
    /// Bumped before a page the program had mapped may stop being mapped
    /// (an eviction, a drop or move the program made, a new region): a
    /// caller that found a range mapped at one epoch knows it still is
    /// while the epoch has not moved (`uaccess.rs`). Each pager's starts
    /// at its own base (`EPOCH_BASES`).
    epoch: AtomicU64,
    /// Pages of Resident folios left in the tier by partial loads
    /// (`RegionState::swapped`): `resident` counts whole folios, and usage
    /// takes these back off.
    swapped_pages: AtomicUsize,
    /// Bytes of folio tables of live regions.
    tables: AtomicUsize,
    /// Entries on the reclaim lists (some may be stale).
    lru_len: AtomicUsize,
    /// `write_scans` at the last write-protect sweep (`lru.rs`).
    swept_at_scans: AtomicU64,
    tracking: bool,
    /// This process's maps file (`vmas::open_maps`), or why it could not
    /// be opened: for the scans, and for the mapping around an address.
    maps: Result<zmem_common::host::fds::KeptFd, rustix::io::Errno>,
    next_region: AtomicU32,
    counters: Counters,
    stop: AtomicBool,
    /// The pager's threads that are running, by name and thread id: one
    /// killed (a seccomp filter's `SECCOMP_RET_KILL_THREAD`) runs no clean-up
    /// and stays listed (`Pager::lost_thread`).
    running: Mutex<Vec<(String, i32)>>,
    /// How many threads the pager started (0 until they are all spawned).
    threads_started: AtomicUsize,
    kick: (Mutex<bool>, Condvar),
    /// The count of threads in `wait_for_reclaim_while`, and their wake-up.
    reclaimed: (Mutex<u32>, Condvar),
    /// The stores of the reclaim pass under way, which a fault waiting in
    /// `throttle` helps with (`direct.rs`). A leaf lock, held only to
    /// publish, take or clear the pass.
    pass_stores: Mutex<Option<Arc<direct::PassStores>>>,
    /// Pages dropped by the program (REMOVE, UNMAP) while their folio was
    /// Folio::Evicting, by (region id, folio): the evictor drops their entries
    /// when it finishes. Also the pages dropped from a Resident folio whose
    /// zap may still be to come (until a fault on the page shows it done):
    /// the next eviction drops them too. Written and taken under the
    /// folio's stripe lock.
    dropped: Mutex<HashMap<(u32, usize), Vec<bool>>>,
    /// Folios whose store was rejected: their pages, uncompressed, until a
    /// fault maps them again. Reclaim never puts pages back itself: pages
    /// are mapped only by loads, which step over what the program is
    /// dropping (`dropping`), so a page it dropped never comes back.
    held: Mutex<HashMap<(u32, usize), Held>>,
    /// The folios of the pass under way whose pages MOVE put in staging,
    /// by (region id, folio): a fault on one is served from its slot
    /// (`Inner::rescue`), as the kernel's swap cache serves a fault on a
    /// folio under writeback, instead of waiting for the whole pass to be
    /// stored. Put by reclaim before it stores the pass, taken by
    /// `finish`; looked up and marked rescued by a handler. Both under the
    /// folio's stripe lock.
    staged: Mutex<HashMap<(u32, usize), Staged>>,
    /// Folios (region id, folio) whose copy-on-write reclaim broke because
    /// a MOVE found them busy (`break_cow`), and that have not moved
    /// since: busy again, they are pinned, not shared (`evict_batch`).
    /// Only the reclaim thread uses it.
    cow_broken: Mutex<HashSet<(u32, usize)>>,
    /// Folios that were Evicting when a partial mremap moved them (all or
    /// part) into a split-off region: by (region id, folio), each new
    /// region's folio and which pages moved there. The evictor passes the
    /// folio on when it finishes (`events.rs`). Several: two mremaps can
    /// move two parts of one folio while it is evicted; and a folio waiting
    /// for its forward can itself be moved on (its forwards are passed on
    /// in turn).
    forwards: Mutex<HashMap<(u32, usize), Vec<Forward>>>,
    held_bytes: AtomicUsize,
    /// Written by a handler from reading a batch of events until it has
    /// recorded their UNMAP and REMAP bookkeeping (see `Region::drop`) and
    /// their dropped ranges (`dropping`). Read by reclaim over its MOVEs,
    /// and by whoever COPYs pages into the program (a handler, or the
    /// thread preparing a fork) over its COPYs: tried only, under a
    /// stripe lock (`copy_folio`). Lock order: `events`, then stripe locks.
    events: RwLock<()>,
    /// The ranges of REMOVE and UNMAP events read but not yet dropped
    /// (`drop_range`): from the read on, the kernel may zap them at any
    /// moment, and a page COPYed there after the zap would come back with
    /// its old bytes after the program dropped it. Every COPY of data
    /// steps over them (`copy_folio`), under `events` (read).
    dropping: Mutex<Vec<(u64, u64)>>,
    /// The limit is soft (see [`PagerStats::limit_soft_events`]).
    soft: AtomicBool,
    /// Rounds of the reclaim loop done (`Pager::reclaim_now` waits for the
    /// one after its kick).
    reclaim_rounds: AtomicU64,
    /// UFFDIO_POISON is available for pages that fail to load.
    poison: bool,
    /// A fork is being prepared: reclaim isolates nothing, faults do not
    /// wait for it (see `fork.rs`).
    frozen: AtomicBool,
    /// Held by reclaim over a run of passes, so `fork_prepare` can wait for
    /// the one in flight.
    reclaim_gate: Mutex<()>,
    /// The process has forked: pages may be shared with a child, and
    /// reclaim makes a folio's pages the parent's own before it moves them.
    forked: AtomicBool,
    /// A folio of zeros, the source of a write fault's COPY on a folio
    /// never touched.
    zeros: Box<[u8]>,
    /// `reclaim_now` asks for a look at the shared folios; cleared once done.
    rescan_shared_now: AtomicBool,
    /// Scans adopt new mappings (`PagerConfig::adopt`), until
    /// [`Pager::stop_adopting`].
    adopting: AtomicBool,
    /// Shared pages of the folios on the shared list (`Lru::shared`):
    /// resident, but charged to no one while another process maps them too.
    shared_pages: AtomicUsize,
    /// Folios evicted so far (wrapping): the clock of refault distances
    /// (`RegionState::evicted_at`).
    evict_clock: AtomicU32,
    /// The pool's share of the limit, percent: `cfg.tier.max_pool_percent`,
    /// moved by `balance_pool` when `cfg.pool_balance` is on.
    pool_percent: AtomicU32,
    /// Refaults that a resident set one balance step larger would have
    /// saved (`balance.rs`).
    balance_refaults: AtomicU64,
    /// This process's slot in its tree's accounting (`PagerConfig::tree`).
    member: Option<crate::tree::Member>,
    /// The limit that applies now: `cfg.limit`, or this process's share of
    /// its tree's (refreshed by `refresh_limit`).
    limit_now: AtomicUsize,
    /// With `fork_event`: the two ends of the socket pair a fork's
    /// hand-over goes through, made by `fork_prepare`; the parent's end is
    /// taken by the handler as it reads the FORK event, the child's by the
    /// child (and closed by the parent step). See `handover.rs`.
    link_parent: Mutex<Option<zmem_common::host::fds::KeptFd>>,
    link_child: Mutex<Option<zmem_common::host::fds::KeptFd>>,
    /// `handover::Fork` as a number: where the last fork is.
    fork_state: std::sync::atomic::AtomicU8,
    /// The handler is serving a forked child until it hands over: nothing
    /// may free an entry the child may still need (`wait_handover`).
    serving_child: AtomicBool,
    /// Handlers between reading events and being done with them (every
    /// free and allocation made). `fork_prepare` waits for none: with
    /// `fork_event` the fork waits for its event to be read while the
    /// forking thread holds the C allocator's locks, and a handler still
    /// freeing what served the forking thread's last fault would wait for
    /// them (see `Inner::wait_handlers_at_rest`).
    handlers_busy: AtomicUsize,
}

/// An Evicting folio's pages in staging (see `Inner::staged`).
#[derive(Debug)]
struct Staged {
    /// Its slot's address.
    addr: u64,
    /// Which of its pages MOVE put there: only those may be read (a hole in
    /// staging is a MISSING fault on the pager's own uffd).
    present: Vec<bool>,
    /// Which a partial load had left in the tier (they keep their entries).
    swapped: u64,
    /// A fault mapped the pages back: the pass's entries for them go.
    rescued: bool,
}

/// Where an Evicting folio's moved pages went (see `Inner::forwards`).
#[derive(Debug)]
struct Forward {
    to: Arc<RegionState>,
    folio: usize,
    moved: Vec<bool>,
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
    /// Folios taken off the lists (none: the lists were empty).
    isolated: usize,
    evicted: usize,
    /// Set aside as shared with another process (uncharged): progress too.
    parked: usize,
    /// Taken back from staging by a fault while stored (`Inner::rescue`):
    /// progress too, in that the lists were not empty, their heads only in
    /// use (they went back to the tail). Not counting them made a pass all
    /// of whose folios were rescued look stuck, and the limit turned soft
    /// with "nothing is on the reclaim lists" (memcached's 4 threads under
    /// 24M, in CI).
    rescued: usize,
    rejected: usize,
    unevictable: usize,
}

/// Anonymous memory under a limit, backed by a compressed tier.
pub struct Pager {
    inner: Arc<Inner>,
    /// Taken by [`Drop`], or by [`Pager::let_go`].
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pager").field("limit", &self.inner.limit()).field("stats", &self.stats()).finish()
    }
}

impl Pager {
    /// Starts a pager: its userfaultfd, tier, handler and reclaim threads.
    ///
    /// # Errors
    /// A bad configuration, no userfaultfd (with what to change), or the
    /// tier's errors.
    pub fn new(cfg: PagerConfig) -> Result<Pager, PagerError> {
        Self::start(cfg, None)
    }

    /// [`new`](Self::new), or with `handed`, in a forked child: the
    /// userfaultfd the parent handed over and the parent's snapshot of the
    /// child's evicted pages, imported before any thread starts.
    fn start(cfg: PagerConfig, handed: Option<handover::Handed>) -> Result<Pager, PagerError> {
        cfg.validate()?;
        let (want, tracking, poison) = cfg.uffd_features()?;
        // Now, while the program waits for this start: the scans must read
        // it after the program has changed its root.
        let maps = crate::vmas::open_maps();
        let member = cfg.tree.as_deref().map(|p| crate::tree::Tree::open(p).and_then(crate::tree::Tree::join));
        let member = match member {
            // A forked child holding its handed-over memory must start.
            Some(Err(e)) if handed.is_some() => {
                log::warn!("{e}; this process takes the whole limit");
                None
            }
            m => m.transpose()?,
        };
        let (uffd, snapshot) = match handed {
            Some(h) => (h.uffd, Some(h.snapshot)),
            None => (Uffd::open(cfg.open_mode, want)?, None),
        };
        // Loads keep their entries until the folio is mapped: a COPY can fail
        // with EAGAIN (an unread event), and the pages must survive a retry.
        let tier = Tier::new(TierConfig { exclusive_loads: false, ..cfg.tier.clone() })?;
        let inner = Arc::new(Inner {
            stripes: (0..STRIPES).map(|_| (Mutex::new(0), Condvar::new())).collect(),
            lru: Mutex::new(Lru::default()),
            regions: RwLock::new(BTreeMap::new()),
            epoch: AtomicU64::new(uaccess::epoch_base()),
            resident: AtomicUsize::new(0),
            swapped_pages: AtomicUsize::new(0),
            tables: AtomicUsize::new(0),
            lru_len: AtomicUsize::new(0),
            swept_at_scans: AtomicU64::new(0),
            tracking,
            maps,
            next_region: AtomicU32::new(1),
            counters: Counters::default(),
            stop: AtomicBool::new(false),
            running: Mutex::new(Vec::new()),
            threads_started: AtomicUsize::new(0),
            kick: (Mutex::new(false), Condvar::new()),
            reclaimed: (Mutex::new(0), Condvar::new()),
            pass_stores: Mutex::new(None),
            dropped: Mutex::new(HashMap::new()),
            staged: Mutex::new(HashMap::new()),
            cow_broken: Mutex::new(HashSet::new()),
            held: Mutex::new(HashMap::new()),
            forwards: Mutex::new(HashMap::new()),
            held_bytes: AtomicUsize::new(0),
            events: RwLock::new(()),
            dropping: Mutex::new(Vec::new()),
            soft: AtomicBool::new(false),
            reclaim_rounds: AtomicU64::new(0),
            poison,
            frozen: AtomicBool::new(false),
            reclaim_gate: Mutex::new(()),
            forked: AtomicBool::new(false),
            shared_pages: AtomicUsize::new(0),
            evict_clock: AtomicU32::new(0),
            pool_percent: AtomicU32::new(cfg.tier.max_pool_percent),
            balance_refaults: AtomicU64::new(0),
            adopting: AtomicBool::new(true),
            rescan_shared_now: AtomicBool::new(false),
            zeros: vec![0u8; cfg.folio_size].into_boxed_slice(),
            limit_now: AtomicUsize::new(member.as_ref().map_or(cfg.limit, |m| m.tree().limit())),
            member,
            link_parent: Mutex::new(None),
            link_child: Mutex::new(None),
            fork_state: std::sync::atomic::AtomicU8::new(0),
            serving_child: AtomicBool::new(false),
            handlers_busy: AtomicUsize::new(0),
            uffd,
            tier,
            cfg,
        });
        let staging = Staging::new(&inner.uffd, inner.cfg.folio_size, inner.cfg.batch_folios())?;
        if let Some(snap) = snapshot {
            // Before any thread: the child's faults wait in the kernel until
            // its pages are where the handler looks for them.
            inner.import_fork(&snap)?;
            inner.forked.store(true, Ordering::Relaxed);
        }
        let threads = spawn_threads(&inner, staging)?;
        Ok(Pager { inner, threads: Mutex::new(threads) })
    }

    pub fn tier(&self) -> &Tier {
        &self.inner.tier
    }

    /// Whether this pager's userfaultfd serves faults from user mode only
    /// ([`Uffd::user_mode_only`]): the program's own system calls on an
    /// evicted page (`read(2)` into it, `write(2)` from it, a futex in it)
    /// then fail with EFAULT.
    pub fn user_mode_only(&self) -> bool {
        self.inner.uffd.user_mode_only()
    }

    /// The name of a pager thread that is gone without returning: the
    /// kernel killed it (a seccomp filter installed with a raw system call,
    /// which the preload shim cannot see, `SECCOMP_RET_KILL_THREAD` for one
    /// of zmem's calls). The memory it served cannot be served any more: a
    /// fault there waits for good. `None` while all run, once the pager is
    /// stopping, or where the check itself is refused.
    pub fn lost_thread(&self) -> Option<String> {
        if self.inner.stop.load(Ordering::Acquire) {
            return None;
        }
        let running = self.inner.running.lock_ok().clone();
        let pid = std::process::id() as libc::c_long;
        running.into_iter().find_map(|(name, tid)| {
            // SAFETY: tgkill with signal 0 sends nothing: it only checks
            // that the thread `tid` of this process exists.
            let r = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid as libc::c_long, 0 as libc::c_long) };
            let gone = r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
            (gone && !self.inner.stop.load(Ordering::Acquire)).then_some(name)
        })
    }

    /// Evicts down to the low watermark now, and waits for it. Folios set
    /// aside as shared are looked at again first (a forked child may have
    /// exited).
    pub fn reclaim_now(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        if self.inner.forked.load(Ordering::Relaxed) {
            self.inner.rescan_shared_now.store(true, Ordering::Release);
            self.inner.kick_reclaim();
            self.inner.wait_for_reclaim_while(deadline, Duration::from_millis(1), false, || {
                self.inner.rescan_shared_now.load(Ordering::Acquire)
            });
        }
        // A soft limit is read only once reclaim has seen the kick: the
        // round under way may have set it before the program's latest
        // loads put folios back on the lists.
        let round = self.inner.reclaim_rounds.load(Ordering::Acquire);
        self.inner.kick_reclaim();
        self.inner.wait_for_reclaim_while(deadline, Duration::from_millis(5), false, || {
            (self.inner.reclaim_rounds.load(Ordering::Acquire) < round + 2 && !self.inner.stop.load(Ordering::Acquire))
                || (self.inner.usage() > self.inner.low() && !self.inner.soft.load(Ordering::Relaxed))
        });
    }
}

impl Drop for Pager {
    /// Stops reclaim. The handler serves faults until the last region is
    /// dropped: regions may outlive their pager, and a fault nobody serves
    /// would hang. With no region left, both threads are joined.
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        self.inner.kick_reclaim();
        // Reclaim isolates nothing more; adopted regions go back whole.
        self.inner.frozen.store(true, Ordering::Release);
        drop(self.inner.reclaim_gate.lock_ok());
        self.inner.release_adopted();
        if self.inner.regions.read_ok().is_empty() {
            for t in self.threads.get_mut().unwrap_or_else(PoisonError::into_inner).drain(..) {
                let _ = t.join();
            }
        }
    }
}

/// Whether `e` is a userfaultfd call that a seccomp filter refused: the
/// error a filter returns (`EPERM`, `EACCES`, `ENOSYS`), in a process under
/// one (`PR_GET_SECCOMP`, refused too under some filters).
fn refused_by_filter(e: &UffdError) -> bool {
    use rustix::io::Errno;
    if !matches!(e, UffdError::Ioctl { errno: Errno::PERM | Errno::ACCESS | Errno::NOSYS, .. }) {
        return false;
    }
    // SAFETY: PR_GET_SECCOMP takes no pointer; it returns the mode.
    let mode = unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) };
    mode != 0
}

impl Inner {
    /// A call that serves a fault was refused by a seccomp filter that zmem
    /// did not see installed (the shim stops zmem before any filter it sees
    /// is installed; a raw `syscall` instruction, as Chromium's sandbox and
    /// Go's runtime make, goes past it). No page can be given back to the
    /// program any more, so its next fault would wait for good (or fault
    /// again for good, where the wake-up is refused too): the process is
    /// stopped loudly instead, as after a panic of a pager thread.
    pub(super) fn stop_if_filtered(&self, e: &UffdError) {
        if refused_by_filter(e) {
            log::error!(
                "a seccomp filter that zmem did not see installed refuses its userfaultfd calls ({e}): \
                 the program's memory zmem holds can no longer be given back to it; aborting"
            );
            std::process::abort();
        }
    }

    /// This process's maps file, kept since the pager's start.
    fn maps(&self) -> Result<std::os::fd::BorrowedFd<'_>, rustix::io::Errno> {
        use std::os::fd::AsFd;
        self.maps.as_ref().map(AsFd::as_fd).map_err(|e| *e)
    }

    pub(super) fn register_mode(&self) -> RegisterMode {
        RegisterMode { missing: true, wp: self.tracking }
    }

    pub(super) fn stripe(&self, st: &RegionState, f: usize) -> &(Mutex<u32>, Condvar) {
        &self.stripes[(st.id as usize * 7919 + f) % STRIPES]
    }

    /// The region that holds `addr`: its range covers it and the program
    /// has not unmapped it there.
    pub(super) fn region_at(&self, addr: u64) -> Option<Arc<RegionState>> {
        let regions = self.regions.read_ok();
        regions
            .range(..=(addr, u32::MAX))
            .rev()
            .map(|(_, r)| r)
            .find(|r| {
                let s = r.start.load(Ordering::Acquire);
                addr < s + r.len as u64 && !r.in_hole((addr - s) as usize)
            })
            .cloned()
    }

    /// The regions whose ranges overlap `[start, end)`, holes or not.
    pub(super) fn regions_in(&self, start: u64, end: u64) -> Vec<Arc<RegionState>> {
        let regions = self.regions.read_ok();
        regions
            .range(..(end, 0))
            .map(|(_, r)| r)
            .filter(|r| r.start.load(Ordering::Acquire) + r.len as u64 > start)
            .cloned()
            .collect()
    }

    /// Drops every entry of folio `f`, and its held pages. The caller holds
    /// the folio's stripe lock, or owns the folio (a dying region).
    /// A region never touches the entries of pages in its holes: they were
    /// invalidated when the program unmapped them, or belong to the region
    /// a partial mremap split off.
    pub(super) fn invalidate_folio(&self, st: &RegionState, f: usize) {
        for p in self.folio_pages(st, f) {
            self.tier.invalidate(st.key(p));
        }
        self.unhold(st, f);
    }

    /// The pages of folio `f` of `st` (region page numbers) that are not in
    /// its holes: those whose entries are this region's.
    pub(super) fn folio_pages(&self, st: &RegionState, f: usize) -> impl Iterator<Item = usize> {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let holes = st.holes_in(f * ppf, ppf);
        (f * ppf..(f + 1) * ppf).filter(move |&p| !holes.as_ref().is_some_and(|h| h[p - f * ppf]))
    }

    /// After pages `mask` of folio `f` (bit `i`: page `i`; `u64::MAX`: all)
    /// were mapped again from `pages`, the folio's bytes: their pool entries
    /// stay as clean copies (`Tier::retain_clean`), their other entries go.
    /// Same locking as [`invalidate_folio`](Self::invalidate_folio).
    pub(super) fn retain_pages(&self, st: &RegionState, f: usize, mask: u64, pages: &[u8], once: bool) {
        let ppf = self.cfg.folio_size / PAGE_SIZE;
        let mut kept = false;
        // A kept pool entry is memory beside the page it copies, charged to
        // the limit: kept only below the low watermark, where it costs no
        // eviction. (Entries in the swap file cost no memory.) A walk's
        // folios, and a fork's (`once`), keep theirs at any usage: they go
        // first (`Lru::once`),
        // and their entries are what they will be evicted into, so freeing
        // one now would only cost a compression then.
        let keep_pool = once || self.usage() + self.cfg.folio_size <= self.low();
        // A written-back entry is kept only where the pool could not take
        // the page anyway (`Tier::retain_clean_unless`): a hot page would
        // otherwise go back and forth between the program and its slot,
        // each load a read of the disk, while the pool sits half empty. A
        // walk's keep theirs, as its pool entries: the walk reads on, its
        // folios go out behind it, into these entries, and are not read
        // again soon (`a_walk_over_more_than_the_limit_evicts_behind_itself`
        // compressed 26% of what it evicted without this, 2-5% with it).
        let room = !once && self.tier.pool_has_room();
        for p in self.folio_pages(st, f) {
            let i = p - f * ppf;
            if i < 64 && mask >> i & 1 == 0 {
                continue;
            }
            kept |=
                self.tier.retain_clean_unless(st.key(p), &pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE], keep_pool, room);
        }
        if mask == u64::MAX {
            st.cached[f].store(kept, Ordering::Relaxed);
            self.unhold(st, f);
        } else if kept {
            st.cached[f].store(true, Ordering::Relaxed);
        }
    }

    /// Marks pages `mask` of Resident folio `f` as left in the tier (none of
    /// them was). The caller holds the folio's stripe lock.
    pub(super) fn set_swapped(&self, st: &RegionState, f: usize, mask: u64) {
        let old = st.swapped[f].fetch_or(mask, Ordering::Relaxed);
        debug_assert_eq!(old & mask, 0, "pages marked swapped twice");
        self.swapped_pages.fetch_add((mask & !old).count_ones() as usize, Ordering::Relaxed);
    }

    /// Unmarks pages `mask` of folio `f` (loaded, dropped, or the folio
    /// leaves Resident); returns those of them that were marked. The caller
    /// holds the folio's stripe lock.
    pub(super) fn clear_swapped(&self, st: &RegionState, f: usize, mask: u64) -> u64 {
        if st.swapped[f].load(Ordering::Relaxed) & mask == 0 {
            return 0;
        }
        let was = st.swapped[f].fetch_and(!mask, Ordering::Relaxed) & mask;
        self.swapped_pages.fetch_sub(was.count_ones() as usize, Ordering::Relaxed);
        was
    }

    pub(super) fn unhold(&self, st: &RegionState, f: usize) {
        if let Some(h) = self.held.lock_ok().remove(&(st.id, f)) {
            self.held_bytes.fetch_sub(h.data.len(), Ordering::Relaxed);
        }
    }
}

/// Starts the pager's threads: its handlers and its reclaim thread.
fn spawn_threads(inner: &Arc<Inner>, staging: Staging) -> Result<Vec<std::thread::JoinHandle<()>>, PagerError> {
    // A pager thread that panics leaves memory no one serves: a fault
    // there, or on a folio it held isolated, would wait for good (a
    // panic in a forked child's reclaim thread hung the child). The
    // process is stopped loudly instead.
    let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
        let init = inner.cfg.thread_init;
        let me = Arc::clone(inner);
        // With the program's signals blocked: its handlers must never
        // run here (see `zmem_common::host::thread`).
        zmem_common::host::thread::spawn(std::thread::Builder::new().name(name.clone()), move || {
            if let Some(init) = init {
                init();
            }
            let tid = rustix::thread::gettid().as_raw_nonzero().get();
            me.running.lock_ok().push((name.clone(), tid));
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
                log::error!(
                    "zmem's {name} thread panicked (reported above): the memory it serves cannot be served; aborting"
                );
                std::process::abort();
            }
            me.running.lock_ok().retain(|&(_, t)| t != tid);
        })
        .map_err(PagerError::Spawn)
    };
    let mut threads = Vec::new();
    for i in 0..inner.cfg.handler_threads {
        let h = Arc::clone(inner);
        let cpu = (!h.cfg.handler_cpus.is_empty()).then(|| h.cfg.handler_cpus[i % h.cfg.handler_cpus.len()]);
        threads.push(spawn(
            format!("zmem-handler-{i}"),
            Box::new(move || {
                if let Some(init) = h.cfg.handler_init {
                    init();
                }
                h.handler_main(cpu);
            }),
        )?);
    }
    let r = Arc::clone(inner);
    threads.push(spawn("zmem-reclaim".into(), Box::new(move || r.reclaim_main(staging)))?);
    inner.threads_started.store(threads.len(), Ordering::Release);
    Ok(threads)
}
