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
//! `Inner`, what every pager thread shares, holds the settings, the uffd and
//! the tier, and five components, each with its own fields and locks, in the
//! file that keeps their rules: `folios` (`region::FolioTable`: the regions,
//! the stripe locks, and what hangs off a folio between states), `lists`
//! (`lru::ReclaimLists`), `fork` (`fork::ForkState`), `gate`
//! (`events::EventsGate`: `events` and `dropping`) and `acct`
//! (`accounting::Accounting`: usage, the limit, reclaim's wake-ups).
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

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use zmem_common::{LockExt, RwLockExt};

use zmem_tier::{Tier, TierConfig};

pub use config::{AdoptConfig, PagerConfig, PagerError};
pub use follow::unhold_current_thread;

pub use region::Region;
use region::RegionState;
use staging::Staging;
use stats::Counters;
pub use stats::{refaults_within, stall_at_limit, PagerStats, REFAULT_BUCKETS};

use crate::sys::{RegisterMode, Uffd, UffdError};

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

struct Inner {
    cfg: PagerConfig,
    uffd: Uffd,
    tier: Tier,
    tracking: bool,
    /// This process's maps file (`vmas::open_maps`), or why it could not
    /// be opened: for the scans, and for the mapping around an address.
    maps: Result<zmem_common::host::fds::KeptFd, rustix::io::Errno>,
    counters: Counters,
    stop: AtomicBool,
    /// The pager's threads that are running, by name and thread id: one
    /// killed (a seccomp filter's `SECCOMP_RET_KILL_THREAD`) runs no clean-up
    /// and stays listed (`Pager::lost_thread`).
    running: Mutex<Vec<(String, i32)>>,
    /// How many threads the pager started (0 until they are all spawned).
    threads_started: AtomicUsize,
    /// UFFDIO_POISON is available for pages that fail to load.
    poison: bool,
    /// A folio of zeros, the source of a write fault's COPY on a folio
    /// never touched.
    zeros: Box<[u8]>,
    /// Scans adopt new mappings (`PagerConfig::adopt`), until
    /// [`Pager::stop_adopting`].
    adopting: AtomicBool,
    /// Handlers between reading events and being done with them (every
    /// free and allocation made). `fork_prepare` waits for none: with
    /// `fork_event` the fork waits for its event to be read while the
    /// forking thread holds the C allocator's locks, and a handler still
    /// freeing what served the forking thread's last fault would wait for
    /// them (see `Inner::wait_handlers_at_rest`).
    handlers_busy: AtomicUsize,
    /// The regions and their folios' states, and what hangs off a folio
    /// between its states (`region.rs`).
    folios: region::FolioTable,
    /// The reclaim lists and the clocks of the looks (`lru.rs`).
    lists: lru::ReclaimLists,
    /// Where a fork is, and what it holds still (`fork.rs`, `handover.rs`).
    fork: fork::ForkState,
    /// The events gate: COPY and MOVE against the events the handler reads
    /// (`events.rs`).
    gate: events::EventsGate,
    /// Usage, the limit and reclaim's wake-ups (`accounting.rs`).
    acct: accounting::Accounting,
}

/// An Evicting folio's pages in staging (see `FolioTable::staged`).
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

/// Where an Evicting folio's moved pages went (see `FolioTable::forwards`).
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
            folios: region::FolioTable::new(uaccess::epoch_base()),
            lists: lru::ReclaimLists::default(),
            fork: fork::ForkState::default(),
            gate: events::EventsGate::default(),
            acct: accounting::Accounting {
                resident: AtomicUsize::new(0),
                soft: AtomicBool::new(false),
                limit_now: AtomicUsize::new(member.as_ref().map_or(cfg.limit, |m| m.tree().limit())),
                pool_percent: AtomicU32::new(cfg.tier.max_pool_percent),
                balance_refaults: AtomicU64::new(0),
                member,
                kick: (Mutex::new(false), Condvar::new()),
                reclaimed: (Mutex::new(0), Condvar::new()),
                pass_stores: Mutex::new(None),
                reclaim_rounds: AtomicU64::new(0),
            },
            tracking,
            maps,
            counters: Counters::default(),
            stop: AtomicBool::new(false),
            running: Mutex::new(Vec::new()),
            threads_started: AtomicUsize::new(0),
            poison,
            adopting: AtomicBool::new(true),
            zeros: vec![0u8; cfg.folio_size].into_boxed_slice(),
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
            inner.fork.forked.store(true, Ordering::Relaxed);
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
        if self.inner.fork.forked.load(Ordering::Relaxed) {
            self.inner.lists.rescan_shared_now.store(true, Ordering::Release);
            self.inner.kick_reclaim();
            self.inner.wait_for_reclaim_while(deadline, Duration::from_millis(1), false, || {
                self.inner.lists.rescan_shared_now.load(Ordering::Acquire)
            });
        }
        // A soft limit is read only once reclaim has seen the kick: the
        // round under way may have set it before the program's latest
        // loads put folios back on the lists.
        let round = self.inner.acct.reclaim_rounds.load(Ordering::Acquire);
        self.inner.kick_reclaim();
        self.inner.wait_for_reclaim_while(deadline, Duration::from_millis(5), false, || {
            (self.inner.acct.reclaim_rounds.load(Ordering::Acquire) < round + 2
                && !self.inner.stop.load(Ordering::Acquire))
                || (self.inner.usage() > self.inner.low() && !self.inner.acct.soft.load(Ordering::Relaxed))
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
        self.inner.fork.frozen.store(true, Ordering::Release);
        drop(self.inner.fork.reclaim_gate.lock_ok());
        self.inner.release_adopted();
        if self.inner.folios.regions.read_ok().is_empty() {
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
