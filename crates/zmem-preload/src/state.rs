//! The shim's state, one owner for each: the running shim (`CURRENT`), the
//! managed mappings (`REGIONS`), and what the program keeps from being
//! managed. A leaf: it starts nothing (`init.rs` starts the shim and
//! installs it here) and calls no other part of the shim but the guard.

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicUsize, Ordering};
use std::sync::{OnceLock, RwLock};
use zmem_common::RwLockExt;

use zmem_settings::Settings;
use zmem_uffd::{Pager, Region};

use crate::guard::{guarded, in_zmem};

/// A managed mapping.
pub(crate) struct Managed {
    /// The pager's region; `None` for one inherited from the parent process
    /// at fork: plain memory of this process, which its own pager adopted.
    pub(crate) region: Option<Region>,
    /// Bytes mapped.
    pub(crate) cap: usize,
    /// Bytes the program asked for (what `malloc_usable_size` reports).
    pub(crate) len: usize,
    /// Bytes the program has unmapped (partial munmaps).
    pub(crate) unmapped: usize,
}

/// A running shim: this process's pager.
pub(crate) struct Shim {
    pub(crate) pager: Pager,
    pub(crate) settings: Settings,
}

/// The managed mappings by start. Kept apart from the shim: a forked child
/// keeps the table (its entries become inherited ones) under a pager of
/// its own.
pub(crate) static REGIONS: RwLock<Table> = RwLock::new(BTreeMap::new());
/// This process's shim: null before the start, or when it could not start.
/// Each is leaked (a forked child abandons its parent's without dropping
/// it: that pager's threads are not in the child).
pub(crate) static CURRENT: AtomicPtr<Shim> = AtomicPtr::new(std::ptr::null_mut());
/// The first start has been tried.
pub(crate) static TRIED: OnceLock<()> = OnceLock::new();
/// Managed mappings alive: `free` looks up only while there are some.
pub(crate) static LIVE: AtomicUsize = AtomicUsize::new(0);
/// A forked child whose own pager could not start: it manages nothing new,
/// and the parent's regions are plain memory of the child.
pub(crate) static CHILD: AtomicBool = AtomicBool::new(false);

pub(crate) type Table = BTreeMap<usize, Managed>;

/// This process's running shim, if any.
pub(crate) fn current() -> Option<&'static Shim> {
    let p = CURRENT.load(Ordering::Acquire);
    // SAFETY: CURRENT is null or a leaked `Box<Shim>`, never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The process whose shim `CURRENT` is: a vfork child shares the memory
/// (and `CURRENT`) of its parent, not its threads.
pub(crate) static SHIM_PID: AtomicU32 = AtomicU32::new(0);

/// Whether this is the process whose shim runs (not a vfork child, and
/// with a shim).
pub(crate) fn is_shim_process() -> bool {
    SHIM_PID.load(Ordering::Relaxed) == std::process::id() && current().is_some()
}

pub(crate) fn install(s: Shim) {
    SHIM_PID.store(std::process::id(), Ordering::Relaxed);
    CURRENT.store(Box::into_raw(Box::new(s)), Ordering::Release);
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
    guarded(|| {
        let regions = REGIONS.read_ok();
        let (&start, m) = regions.range(..=addr).next_back()?;
        (addr < start + m.cap).then_some((start, m.cap, m.len))
    })
    .flatten()
}

/// Drops the managed mapping at `start`. One inherited from the parent at
/// fork is plain memory: unmapped (this process's pager, if it adopted it,
/// sees the unmap).
pub(crate) fn managed_free(start: usize) {
    guarded(|| {
        let m = REGIONS.write_ok().remove(&start);
        if m.is_some() {
            LIVE.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(Managed { region: None, cap, .. }) = m {
            // SAFETY: [start, start + cap) is this process's copy of a
            // parent's region, which the program gave up.
            unsafe { libc::syscall(libc::SYS_munmap, start, cap) };
        }
        // A region unmaps and frees its entries as it drops, outside the
        // table lock.
    });
}

/// Whether the malloc family takes a request of `len` bytes itself: only
/// with adoption off (`ZMEM_ADOPT=0`), where it is the only way glibc's
/// large chunks are managed. With adoption on, the program's allocator,
/// glibc's too, stays its own, and what it maps is adopted by mapping.
pub(crate) fn wants_malloc(len: usize) -> bool {
    wants(len) && current().is_some_and(|s| !s.settings.adopt)
}

/// The program called `mlockall(MCL_FUTURE)`: nothing new is managed.
pub(crate) static LOCKED_ALL: AtomicBool = AtomicBool::new(false);

/// The program locked `[addr, addr + len)`: never adopted.
pub(crate) fn locked(addr: usize, len: usize) {
    let start = addr & !(zmem_common::PAGE_SIZE - 1);
    let end = (addr + len).div_ceil(zmem_common::PAGE_SIZE) * zmem_common::PAGE_SIZE;
    guarded(|| zmem_common::host::owned::add(start as u64, end - start, zmem_common::host::owned::Kind::Locked));
}

/// The program unlocked what it locked at `addr`.
pub(crate) fn unlocked(addr: usize) {
    let start = addr & !(zmem_common::PAGE_SIZE - 1);
    guarded(|| {
        if zmem_common::host::owned::overlapping(start as u64, start as u64 + 1)
            .iter()
            .any(|&(s, _, k)| s == start as u64 && k == zmem_common::host::owned::Kind::Locked)
        {
            zmem_common::host::owned::remove(start as u64);
        }
    });
}

/// `mlockall(flags)` succeeded.
pub(crate) fn locked_all(flags: c_int) {
    if flags & libc::MCL_FUTURE != 0 {
        LOCKED_ALL.store(true, Ordering::Relaxed);
        if let Some(s) = current() {
            guarded(|| s.pager.stop_adopting());
        }
    }
}

/// Whether a chunk of `len` bytes that glibc's malloc mapped for itself is
/// adopted at once (adoption on: see `malloc::adopt_chunk`).
pub(crate) fn adopts_chunks(len: usize) -> bool {
    wants(len) && current().is_some_and(|s| s.settings.adopt)
}

pub(crate) fn wants(len: usize) -> bool {
    !LOCKED_ALL.load(Ordering::Relaxed)
        && !in_zmem()
        && !CHILD.load(Ordering::Relaxed)
        && !crate::guard::BROKEN.load(Ordering::Relaxed)
        && len >= threshold()
}

pub(crate) fn threshold() -> usize {
    // Before the shim is up, the default; the first large request starts it.
    match current() {
        Some(s) => s.settings.threshold,
        None if TRIED.get().is_some() || CHILD.load(Ordering::Relaxed) => usize::MAX,
        None => Settings::DEFAULT_THRESHOLD,
    }
}
