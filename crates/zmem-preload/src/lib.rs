//! zmem's LD_PRELOAD shim (`libzmem_preload.so`), and the C API of
//! `include/zmem.h`.
//!
//! `zmem run -- CMD` starts CMD with this library preloaded. It places the
//! program's large anonymous memory in regions of one in-process [`Pager`]:
//!
//! - `mmap(NULL, len, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0)`
//!   with `len >= ZMEM_THRESHOLD` (jemalloc, Python's arenas, most
//!   allocators' large chunks call mmap through the PLT);
//! - `malloc`, `calloc`, `realloc`, `posix_memalign`, `aligned_alloc`,
//!   `memalign` and `valloc` of that size or more: glibc's malloc maps its
//!   large chunks with an internal mmap no preload can see, so the shim
//!   takes those sizes itself and hands the rest to `__libc_malloc` & co.
//!
//! `munmap`, `mremap`, `madvise` and `free` of managed memory are handled
//! here; everything else goes to the kernel (raw syscalls) or glibc.
//!
//! # Reentrancy
//! A fault taken while serving a fault deadlocks, so zmem's own memory must
//! never be managed. A thread-local flag (`IN_ZMEM`) marks code that runs
//! inside the shim, and is set for good on every thread the pager starts
//! (`PagerConfig::thread_init`). While it is set, every entry point passes
//! straight through. zmem's own big mappings (regions, staging, the
//! mempool) are made with raw syscalls and never reach these symbols.
//!
//! # fork and exec
//! Regions are `MADV_DONTFORK`: a forked child does not have them (touching
//! one is SIGSEGV, never wrong data), and the shim is off in the child, whose
//! frees of the parent's regions are ignored. `exec` starts afresh: the
//! environment carries `LD_PRELOAD` and the settings, so the new program
//! gets its own pager.
//!
//! # Partial munmap
//! Unmapping part of a managed mapping drops its pages (`MADV_DONTNEED`, so
//! the pager frees their entries) and makes the range `PROT_NONE`; the
//! address range is returned when the whole mapping is unmapped.
#![allow(clippy::missing_safety_doc)]

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{OnceLock, RwLock};

use zmem_uffd::{Pager, Region, Settings};

const PAGE: usize = 4096;

thread_local! {
    /// Set while this thread runs shim code, and for good on zmem's threads.
    static IN_ZMEM: Cell<bool> = const { Cell::new(false) };
}

fn in_zmem() -> bool {
    IN_ZMEM.with(Cell::get)
}

/// Marks the calling thread as zmem's own: its allocations are never managed.
pub fn mark_internal_thread() {
    IN_ZMEM.with(|c| c.set(true));
}

/// Runs `f` with the reentrancy flag set, catching any panic: nothing may
/// unwind across the C ABI (that aborts the program). After a panic the
/// shim takes no new memory (`BROKEN`) and `None` is returned; what it
/// already manages stays served.
fn guarded<R>(f: impl FnOnce() -> R) -> Option<R> {
    let was = IN_ZMEM.with(|c| c.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    IN_ZMEM.with(|c| c.set(was));
    match r {
        Ok(r) => Some(r),
        Err(_) => {
            if !BROKEN.swap(true, Ordering::Relaxed) {
                eprintln!("zmem: internal error (a panic, reported above); the shim takes no new memory");
            }
            None
        }
    }
}

/// A managed mapping.
struct Managed {
    region: Region,
    /// Bytes the program asked for (what `malloc_usable_size` reports).
    len: usize,
    /// Bytes the program has unmapped (partial munmaps).
    unmapped: usize,
}

struct Shim {
    pager: Pager,
    settings: Settings,
    regions: RwLock<BTreeMap<usize, Managed>>,
}

static SHIM: OnceLock<Option<Shim>> = OnceLock::new();
/// Managed mappings alive: `free` looks up only while there are some.
static LIVE: AtomicUsize = AtomicUsize::new(0);
/// In a forked child: everything passes through.
static CHILD: AtomicBool = AtomicBool::new(false);
/// The shim panicked once: it manages no new memory.
static BROKEN: AtomicBool = AtomicBool::new(false);

extern "C" fn after_fork_in_child() {
    CHILD.store(true, Ordering::Relaxed);
}

fn shim() -> Option<&'static Shim> {
    if CHILD.load(Ordering::Relaxed) {
        return None;
    }
    SHIM.get_or_init(|| guarded(init).flatten()).as_ref()
}

fn init() -> Option<Shim> {
    let settings = match Settings::from_env() {
        Ok(s) if s.disable => return None,
        Ok(s) => s,
        Err(e) => {
            eprintln!("zmem: bad setting, the shim is off: {e}");
            return None;
        }
    };
    let mut cfg = settings.pager_config();
    cfg.thread_init = Some(mark_internal_thread);
    let pager = match Pager::new(cfg) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("zmem: cannot start the pager, the shim is off: {e}");
            return None;
        }
    };
    // SAFETY: registers a plain function with no arguments; it only stores
    // to an atomic, which is async-signal-safe as a forked child requires.
    let r = unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    if r != 0 {
        eprintln!("zmem: pthread_atfork failed ({r}); a forked child may misbehave");
    }
    let stats_dir = settings.stats_dir.clone();
    let interval = settings.stats_interval;
    let spawned = std::thread::Builder::new().name("zmem-stats".into()).spawn(move || {
        mark_internal_thread();
        stats_main(&stats_dir, interval);
    });
    if let Err(e) = spawned {
        eprintln!("zmem: no stats thread: {e}");
    }
    Some(Shim { pager, settings, regions: RwLock::new(BTreeMap::new()) })
}

/// The stats file: `DIR/zmem-PID.json`, rewritten every `interval`
/// (written to a temporary name and renamed, so readers see whole files).
fn stats_main(dir: &std::path::Path, interval: std::time::Duration) {
    let pid = std::process::id();
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!("zmem: no stats directory {}: {e}", dir.display());
        return;
    }
    let path = dir.join(format!("zmem-{pid}.json"));
    let tmp = dir.join(format!(".zmem-{pid}.json.tmp"));
    loop {
        if CHILD.load(Ordering::Relaxed) {
            return;
        }
        if let Some(s) = SHIM.get().and_then(Option::as_ref) {
            let json = stats_json(s);
            if std::fs::write(&tmp, json).and_then(|()| std::fs::rename(&tmp, &path)).is_err() {
                return;
            }
        }
        std::thread::sleep(interval);
    }
}

fn stats_json(s: &Shim) -> String {
    let p = s.pager.stats();
    let t = s.pager.tier().stats();
    let tier: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap_or(serde_json::Value::Null);
    // The footprint as the OS sees it: RSS (the program's pages, the pool,
    // zmem's metadata) plus the swap file's pages in the page cache.
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|t| t.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        .map_or(0, |pages| pages * PAGE as u64);
    let cached = s.pager.tier().swap_file().and_then(|f| f.page_cache_bytes()).unwrap_or(0);
    serde_json::json!({
        "pid": std::process::id(),
        "footprint": {
            "rss_bytes": rss,
            "swap_page_cache_bytes": cached,
            "footprint_bytes": rss + cached,
            "limit": s.settings.limit,
        },
        "updated_unix_ms": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        "limit": s.settings.limit,
        "compressor": s.pager.tier().compressor(),
        "managed_mappings": LIVE.load(Ordering::Relaxed),
        "pager": {
            "usage_bytes": p.usage_bytes,
            "resident_bytes": p.resident_bytes,
            "metadata_bytes": p.metadata_bytes,
            "zero_faults": p.zero_faults,
            "load_faults": p.load_faults,
            "evicted_folios": p.evicted_folios,
            "eviction_rejects": p.eviction_rejects,
            "eviction_waits": p.eviction_waits,
            "direct_reclaim_waits": p.direct_reclaim_waits,
            "limit_soft_events": p.limit_soft_events,
            "limit_soft": p.limit_soft,
            "unevictable_folios": p.unevictable_folios,
            "held_bytes": p.held_bytes,
            "poisoned_pages": p.poisoned_pages,
            "tracking_writes": p.tracking_writes,
        },
        "tier": tier,
    })
    .to_string()
}

/// Maps `len` bytes of managed memory, or `None` (the caller falls back).
fn managed_alloc(len: usize) -> Option<*mut c_void> {
    let s = shim()?;
    guarded(|| {
        let region = s.pager.map(len).map_err(|e| eprintln!("zmem: a managed mapping failed: {e}")).ok()?;
        let addr = region.addr() as usize;
        s.regions.write().unwrap_or_else(|e| e.into_inner()).insert(addr, Managed { region, len, unmapped: 0 });
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
fn lookup(addr: usize) -> Option<(usize, usize, usize)> {
    if in_zmem() || LIVE.load(Ordering::Relaxed) == 0 || CHILD.load(Ordering::Relaxed) {
        return None;
    }
    let s = SHIM.get()?.as_ref()?;
    guarded(|| {
        let regions = s.regions.read().unwrap_or_else(|e| e.into_inner());
        let (&start, m) = regions.range(..=addr).next_back()?;
        (addr < start + m.region.len()).then_some((start, m.region.len(), m.len))
    })
    .flatten()
}

/// Drops the managed mapping at `start`.
fn managed_free(start: usize) {
    let Some(s) = SHIM.get().and_then(Option::as_ref) else { return };
    guarded(|| {
        let m = s.regions.write().unwrap_or_else(|e| e.into_inner()).remove(&start);
        if m.is_some() {
            LIVE.fetch_sub(1, Ordering::Relaxed);
        }
        drop(m); // unmaps and frees its entries, outside the table lock
    });
}

fn wants(len: usize) -> bool {
    !in_zmem() && !CHILD.load(Ordering::Relaxed) && !BROKEN.load(Ordering::Relaxed) && len >= threshold()
}

fn threshold() -> usize {
    // Before the shim is up, the default; the first large request starts it.
    SHIM.get().map_or(Settings::DEFAULT_THRESHOLD, |s| s.as_ref().map_or(usize::MAX, |s| s.settings.threshold))
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location has no preconditions.
    let slot = unsafe { libc::__errno_location() };
    // SAFETY: it returns this thread's errno slot, valid and aligned.
    unsafe { *slot = e };
}

// ------------------------------------------------------------------ malloc

extern "C" {
    fn __libc_malloc(size: usize) -> *mut c_void;
    fn __libc_calloc(n: usize, size: usize) -> *mut c_void;
    fn __libc_realloc(p: *mut c_void, size: usize) -> *mut c_void;
    fn __libc_free(p: *mut c_void);
    fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
}

#[no_mangle]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    if wants(size) {
        if let Some(p) = managed_alloc(size) {
            return p;
        }
    }
    // SAFETY: glibc's malloc, with the caller's argument.
    unsafe { __libc_malloc(size) }
}

#[no_mangle]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    let Some(total) = n.checked_mul(size) else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    if wants(total) {
        // A fresh region reads as zeros.
        if let Some(p) = managed_alloc(total) {
            return p;
        }
    }
    // SAFETY: glibc's calloc, with the caller's arguments.
    unsafe { __libc_calloc(n, size) }
}

#[no_mangle]
pub unsafe extern "C" fn free(p: *mut c_void) {
    let a = p as usize;
    if a % PAGE == 0 && a != 0 {
        if let Some((start, _, _)) = lookup(a) {
            if start == a {
                managed_free(start);
            }
            return;
        }
        if CHILD.load(Ordering::Relaxed) && is_parent_region(a) {
            return; // the parent's region: not in this process
        }
    }
    // SAFETY: not ours, so glibc's (the caller's contract).
    unsafe { __libc_free(p) }
}

/// In a forked child: whether `a` was a managed mapping of the parent.
fn is_parent_region(a: usize) -> bool {
    let Some(Some(s)) = SHIM.get() else { return false };
    s.regions.try_read().is_ok_and(|r| r.contains_key(&a))
}

#[no_mangle]
pub unsafe extern "C" fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    if p.is_null() {
        // SAFETY: realloc(NULL, n) is malloc(n).
        return unsafe { malloc(size) };
    }
    let a = p as usize;
    let ours = if a % PAGE == 0 { lookup(a).filter(|&(s, _, _)| s == a) } else { None };
    if let Some((start, cap, len)) = ours {
        if size <= cap && size >= threshold() / 2 {
            // Fits: keep it (a shrink leaves the tail mapped).
            if let Some(s) = SHIM.get().and_then(Option::as_ref) {
                guarded(|| {
                    if let Some(m) = s.regions.write().unwrap_or_else(|e| e.into_inner()).get_mut(&start) {
                        m.len = size;
                    }
                });
            }
            return p;
        }
        // SAFETY: malloc with the caller's size.
        let q = unsafe { malloc(size) };
        if !q.is_null() {
            // SAFETY: p is ours with len bytes, q has at least size bytes,
            // and they are distinct allocations.
            unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), q.cast::<u8>(), len.min(size)) };
            managed_free(start);
        }
        return q;
    }
    if wants(size) {
        // SAFETY: p is glibc's (not ours).
        let old = unsafe { glibc_usable_size(p) };
        if let Some(q) = managed_alloc(size) {
            // SAFETY: p holds old readable bytes, q size writable ones,
            // distinct allocations.
            unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), q.cast::<u8>(), old.min(size)) };
            // SAFETY: p is glibc's, freed once.
            unsafe { __libc_free(p) };
            return q;
        }
    }
    // SAFETY: p is glibc's (the caller's contract).
    unsafe { __libc_realloc(p, size) }
}

fn aligned(align: usize, size: usize) -> *mut c_void {
    // Regions are folio-aligned.
    let folio = SHIM.get().and_then(Option::as_ref).map_or(64 << 10, |s| s.settings.folio);
    if align <= folio && wants(size) {
        if let Some(p) = managed_alloc(size) {
            return p;
        }
    }
    // SAFETY: glibc's memalign with the caller's arguments.
    unsafe { __libc_memalign(align, size) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
    if !align.is_power_of_two() || align % std::mem::size_of::<usize>() != 0 {
        return libc::EINVAL;
    }
    let p = aligned(align, size);
    if p.is_null() && size != 0 {
        return libc::ENOMEM;
    }
    // SAFETY: the caller passes a valid out pointer.
    unsafe { *out = p };
    0
}

#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    aligned(align, size)
}

#[no_mangle]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    aligned(align, size)
}

#[no_mangle]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    aligned(PAGE, size)
}

type UsableSize = unsafe extern "C" fn(*mut c_void) -> usize;

/// glibc's malloc_usable_size (looked up once; dlsym may allocate, which
/// the reentrancy flag passes through).
unsafe fn glibc_usable_size(p: *mut c_void) -> usize {
    static NEXT: OnceLock<Option<UsableSize>> = OnceLock::new();
    let f = NEXT.get_or_init(|| {
        guarded(|| {
            // SAFETY: a symbol lookup by a NUL-terminated name.
            let sym = unsafe { libc::dlsym(libc::RTLD_NEXT, c"malloc_usable_size".as_ptr()) };
            // SAFETY: glibc's malloc_usable_size has this signature.
            (!sym.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, UsableSize>(sym) })
        })
        .flatten()
    });
    // SAFETY: p is glibc's (the caller's contract).
    f.map_or(0, |f| unsafe { f(p) })
}

#[no_mangle]
pub unsafe extern "C" fn malloc_usable_size(p: *mut c_void) -> usize {
    if p.is_null() {
        return 0;
    }
    if let Some((start, _, len)) = lookup(p as usize) {
        return len - (p as usize - start).min(len);
    }
    // SAFETY: not ours, so glibc's.
    unsafe { glibc_usable_size(p) }
}

// -------------------------------------------------------------------- mmap

fn raw_mmap(addr: *mut c_void, len: usize, prot: c_int, flags: c_int, fd: c_int, off: libc::off_t) -> *mut c_void {
    // SAFETY: the mmap syscall with the caller's arguments; what it maps is
    // the caller's business, as it would be with glibc's mmap.
    let r = unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off) };
    r as *mut c_void
}

#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    let anon_private = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let plain = flags & !libc::MAP_NORESERVE == anon_private;
    if addr.is_null() && plain && prot == libc::PROT_READ | libc::PROT_WRITE && fd == -1 && wants(len) {
        if let Some(p) = managed_alloc(len) {
            return p;
        }
    }
    raw_mmap(addr, len, prot, flags, fd, off)
}

#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    // SAFETY: the same function under its LFS name.
    unsafe { mmap(addr, len, prot, flags, fd, off) }
}

#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> c_int {
    let a = addr as usize;
    if let Some((start, cap, _)) = lookup(a) {
        let end = (a + len).min(start + cap);
        if a == start && end == start + cap {
            managed_free(start);
            return 0;
        }
        // Part of it: drop the pages (the pager frees their entries) and
        // fence the range; the addresses return with the whole mapping.
        let (pa, plen) = (a & !(PAGE - 1), end.saturating_sub(a & !(PAGE - 1)).div_ceil(PAGE) * PAGE);
        // SAFETY: [pa, pa + plen) lies in our managed mapping, which the
        // program gave up: dropping and fencing it is what munmap promises.
        unsafe {
            libc::syscall(libc::SYS_madvise, pa, plen, libc::MADV_DONTNEED);
        }
        // SAFETY: as above.
        unsafe {
            libc::syscall(libc::SYS_mprotect, pa, plen, libc::PROT_NONE);
        }
        let whole = SHIM.get().and_then(Option::as_ref).is_some_and(|s| {
            guarded(|| {
                let mut r = s.regions.write().unwrap_or_else(|e| e.into_inner());
                r.get_mut(&start).is_some_and(|m| {
                    m.unmapped += plen;
                    m.unmapped >= cap
                })
            })
            .unwrap_or(false)
        });
        if whole {
            managed_free(start);
        }
        return 0;
    }
    // SAFETY: not ours: the kernel's munmap with the caller's arguments.
    unsafe { libc::syscall(libc::SYS_munmap, addr, len) as c_int }
}

/// `mremap`, which C declares variadic (`new_address` is read only with
/// MREMAP_FIXED). On x86-64 a variadic callee reads its arguments from the
/// same registers as a fixed one, so the fifth is declared outright.
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: usize,
    new_len: usize,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    let a = old as usize;
    if let Some((start, cap, len)) = lookup(a) {
        if a != start || flags & libc::MREMAP_FIXED != 0 {
            set_errno(libc::EINVAL);
            return libc::MAP_FAILED;
        }
        if new_len <= cap {
            if let Some(s) = SHIM.get().and_then(Option::as_ref) {
                guarded(|| {
                    if let Some(m) = s.regions.write().unwrap_or_else(|e| e.into_inner()).get_mut(&start) {
                        m.len = new_len;
                    }
                });
            }
            return old;
        }
        if flags & libc::MREMAP_MAYMOVE == 0 {
            set_errno(libc::ENOMEM);
            return libc::MAP_FAILED;
        }
        let Some(q) = managed_alloc(new_len) else {
            set_errno(libc::ENOMEM);
            return libc::MAP_FAILED;
        };
        // SAFETY: both are managed mappings, distinct, with len and new_len
        // bytes.
        unsafe { std::ptr::copy_nonoverlapping(old.cast::<u8>(), q.cast::<u8>(), len.min(old_len).min(new_len)) };
        managed_free(start);
        return q;
    }
    // SAFETY: not ours: the kernel's mremap with the caller's arguments.
    unsafe { libc::syscall(libc::SYS_mremap, old, old_len, new_len, flags, new_addr) as *mut c_void }
}

#[no_mangle]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: usize, advice: c_int) -> c_int {
    // MADV_FREE raises no event: on managed memory it becomes DONTNEED, so
    // the pager drops the range's entries (and the pages read as zeros, as
    // MADV_FREE allows).
    let advice =
        if advice == libc::MADV_FREE && lookup(addr as usize).is_some() { libc::MADV_DONTNEED } else { advice };
    // SAFETY: the kernel's madvise with the caller's arguments.
    unsafe { libc::syscall(libc::SYS_madvise, addr, len, advice) as c_int }
}

// ------------------------------------------------------------------- C API

/// `zmem_map(len)`: managed memory of `len` bytes (any size), or NULL with
/// errno set.
#[no_mangle]
pub unsafe extern "C" fn zmem_map(len: usize) -> *mut c_void {
    if len == 0 {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    managed_alloc(len).unwrap_or_else(|| {
        set_errno(libc::ENOMEM);
        std::ptr::null_mut()
    })
}

/// `zmem_unmap(p)`: frees memory from `zmem_map`. Returns 0, or -1 (EINVAL)
/// for a pointer zmem did not hand out.
#[no_mangle]
pub unsafe extern "C" fn zmem_unmap(p: *mut c_void) -> c_int {
    match lookup(p as usize) {
        Some((start, _, _)) if start == p as usize => {
            managed_free(start);
            0
        }
        _ => {
            set_errno(libc::EINVAL);
            -1
        }
    }
}

/// `zmem_is_managed(p)`: 1 if `p` points into managed memory.
#[no_mangle]
pub unsafe extern "C" fn zmem_is_managed(p: *const c_void) -> c_int {
    c_int::from(lookup(p as usize).is_some())
}

/// `zmem_stats_json(buf, len)`: this process's stats as JSON, NUL-terminated
/// and truncated to `len`. Returns the full length (as snprintf does), or -1
/// when the shim is off.
#[no_mangle]
pub unsafe extern "C" fn zmem_stats_json(buf: *mut u8, len: usize) -> isize {
    let Some(s) = shim() else { return -1 };
    let Some(json) = guarded(|| stats_json(s)) else { return -1 };
    if !buf.is_null() && len > 0 {
        let n = json.len().min(len - 1);
        // SAFETY: the caller gives len writable bytes at buf.
        unsafe {
            std::ptr::copy_nonoverlapping(json.as_ptr(), buf, n);
        }
        // SAFETY: n < len, inside the caller's buffer.
        let end = unsafe { buf.add(n) };
        // SAFETY: as above: a writable byte of the caller's buffer.
        unsafe { *end = 0 };
    }
    json.len() as isize
}
