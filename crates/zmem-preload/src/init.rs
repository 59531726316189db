//! The shim's state, started on first use from the `ZMEM_*` environment.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{OnceLock, RwLock, RwLockWriteGuard};
use zmem_common::RwLockExt;

use zmem_settings::Settings;
use zmem_uffd::{Pager, Region};

use crate::guard::{guarded, in_zmem, mark_internal_thread};
use crate::stats::stats_main;

/// A managed mapping.
pub(crate) struct Managed {
    pub(crate) region: Region,
    /// Bytes the program asked for (what `malloc_usable_size` reports).
    pub(crate) len: usize,
    /// Bytes the program has unmapped (partial munmaps).
    pub(crate) unmapped: usize,
}

pub(crate) struct Shim {
    pub(crate) pager: Pager,
    pub(crate) settings: Settings,
    pub(crate) regions: RwLock<Table>,
}

pub(crate) static SHIM: OnceLock<Option<Shim>> = OnceLock::new();
/// Managed mappings alive: `free` looks up only while there are some.
pub(crate) static LIVE: AtomicUsize = AtomicUsize::new(0);
/// In a forked child: no new memory is managed, and the parent's regions
/// are plain memory of the child (see `before_fork`).
pub(crate) static CHILD: AtomicBool = AtomicBool::new(false);
/// The shim panicked once: it manages no new memory.
pub(crate) static BROKEN: AtomicBool = AtomicBool::new(false);

type Table = BTreeMap<usize, Managed>;

thread_local! {
    /// The table's write guard, held by the forking thread from the
    /// prepare step of fork to its parent or child step: no region is made
    /// or freed meanwhile, and the child starts with the table unlocked.
    static FORK_GUARD: RefCell<Option<RwLockWriteGuard<'static, Table>>> = const { RefCell::new(None) };
}

/// pthread_atfork's prepare step: the child must see exactly the parent's
/// memory, and it has neither the pager's threads nor a userfaultfd
/// registration. So every evicted folio is loaded back first
/// (`Pager::fork_prepare`), with reclaim frozen until the parent step.
/// vfork and posix_spawn run no atfork handlers, and need none: the child
/// execs (or exits) without touching the parent's memory.
extern "C" fn before_fork() {
    let Some(Some(s)) = SHIM.get() else { return };
    if CHILD.load(Ordering::Relaxed) {
        return;
    }
    guarded(|| {
        let g = s.regions.write_ok();
        s.pager.fork_prepare();
        FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
        // Last: nothing above may allocate once it is held.
        crate::heap::fork_lock();
    });
}

extern "C" fn after_fork_in_parent() {
    let Some(Some(s)) = SHIM.get() else { return };
    if CHILD.load(Ordering::Relaxed) {
        return;
    }
    guarded(|| {
        crate::heap::fork_unlock();
        FORK_GUARD.with(|f| f.borrow_mut().take());
        s.pager.fork_parent();
    });
}

extern "C" fn after_fork_in_child() {
    CHILD.store(true, Ordering::Relaxed);
    // This thread is the child's only one, and held the guards at fork.
    let _ = guarded(|| {
        crate::heap::fork_unlock();
        FORK_GUARD.with(|f| f.borrow_mut().take());
    });
}

/// Starts the shim as the library is loaded (or at a large malloc, if
/// another library's constructor makes one first). Never from mmap: that
/// mmap may run inside another allocator's start-up (jemalloc's, in
/// Debian's redis-server), whose lock the shim's own allocations would then
/// wait on for good. Mappings made before the start are not managed.
#[used]
#[unsafe(link_section = ".init_array")]
static START: extern "C" fn() = start;

extern "C" fn start() {
    let _ = shim();
}

pub(crate) fn shim() -> Option<&'static Shim> {
    if CHILD.load(Ordering::Relaxed) {
        return None;
    }
    SHIM.get_or_init(|| guarded(init).flatten()).as_ref()
}

pub(crate) fn init() -> Option<Shim> {
    zmem_common::init_stderr_logger();
    let settings = match Settings::from_env() {
        Ok(s) if s.disable => return None,
        Ok(s) => s,
        Err(e) => {
            log::warn!("bad setting, the shim is off: {e}");
            return None;
        }
    };
    let mut cfg = settings.pager_config();
    cfg.thread_init = Some(mark_internal_thread);
    cfg.keep_on_fork = true;
    let pager = match Pager::new(cfg) {
        Ok(p) => p,
        Err(e) => {
            log::warn!("cannot start the pager, the shim is off: {e}");
            return None;
        }
    };
    // SAFETY: registers plain functions with no arguments. The child step
    // stores to an atomic and unlocks the table this thread locked; glibc
    // runs it with its own locks (malloc's included) reset.
    let r = unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_in_parent), Some(after_fork_in_child)) };
    if r != 0 {
        log::warn!("pthread_atfork failed ({r}); a forked child may misbehave");
    }
    let stats_dir = settings.stats_dir.clone();
    let interval = settings.stats_interval;
    let spawned = std::thread::Builder::new().name("zmem-stats".into()).spawn(move || {
        mark_internal_thread();
        stats_main(&stats_dir, interval);
    });
    if let Err(e) = spawned {
        log::warn!("no stats thread: {e}");
    }
    Some(Shim { pager, settings, regions: RwLock::new(BTreeMap::new()) })
}

/// Maps `len` bytes of managed memory, or `None` (the caller falls back).
pub(crate) fn managed_alloc(len: usize) -> Option<*mut c_void> {
    let s = shim()?;
    guarded(|| {
        let region = s.pager.map(len).map_err(|e| log::warn!("a managed mapping failed: {e}")).ok()?;
        let addr = region.addr() as usize;
        s.regions.write_ok().insert(addr, Managed { region, len, unmapped: 0 });
        LIVE.fetch_add(1, Ordering::Relaxed);
        Some(addr as *mut c_void)
    })
    .flatten()
}

/// The managed mapping that contains `addr`: (start, region length, asked length).
///
/// zmem's own code never holds managed memory, so inside the shim (where
/// the table lock may be held: a BTreeMap node freed under it) every
/// pointer is glibc's.
pub(crate) fn lookup(addr: usize) -> Option<(usize, usize, usize)> {
    if in_zmem() || LIVE.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let s = SHIM.get()?.as_ref()?;
    guarded(|| {
        let regions = s.regions.read_ok();
        let (&start, m) = regions.range(..=addr).next_back()?;
        (addr < start + m.region.len()).then_some((start, m.region.len(), m.len))
    })
    .flatten()
}

/// Drops the managed mapping at `start`. In a forked child it is plain
/// memory: unmapped, with nothing of the pager's touched.
pub(crate) fn managed_free(start: usize) {
    let Some(s) = SHIM.get().and_then(Option::as_ref) else { return };
    guarded(|| {
        let m = s.regions.write_ok().remove(&start);
        if m.is_some() {
            LIVE.fetch_sub(1, Ordering::Relaxed);
        }
        match m {
            Some(m) if CHILD.load(Ordering::Relaxed) => {
                let len = m.region.len();
                // The region's drop would reach the parent's pager.
                std::mem::forget(m);
                // SAFETY: [start, start + len) is the child's copy of the
                // region, which the program gave up.
                unsafe { libc::syscall(libc::SYS_munmap, start, len) };
            }
            m => drop(m), // unmaps and frees its entries, outside the table lock
        }
    });
}

pub(crate) fn wants(len: usize) -> bool {
    !in_zmem() && !CHILD.load(Ordering::Relaxed) && !BROKEN.load(Ordering::Relaxed) && len >= threshold()
}

pub(crate) fn threshold() -> usize {
    // Before the shim is up, the default; the first large request starts it.
    SHIM.get().map_or(Settings::DEFAULT_THRESHOLD, |s| s.as_ref().map_or(usize::MAX, |s| s.settings.threshold))
}

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: __errno_location has no preconditions.
    let slot = unsafe { libc::__errno_location() };
    // SAFETY: it returns this thread's errno slot, valid and aligned.
    unsafe { *slot = e };
}
