//! The program's own allocator, next after the shim in symbol order:
//! glibc's, or another one loaded as a library (jemalloc in Debian's
//! redis-server, tcmalloc, mimalloc).
//!
//! The shim takes large malloc requests only when the next allocator is
//! glibc's: it hands the rest to `__libc_malloc` & co., and a pointer must
//! go back to the allocator that made it. With any other allocator the
//! whole malloc family goes to it, untouched: it keeps its own chunks (and
//! makes its large ones with mmap, which the shim still sees).
//!
//! Finding out needs `dlsym`, which may itself call malloc: while the
//! lookup runs, requests are served from a small static arena, whose
//! pointers `free` ignores.
//!
//! zmem's own threads must never touch managed memory (a fault there would
//! wait for the very thread that serves it), and another allocator's heap
//! is managed. Their Rust allocations go to glibc (the crate's global
//! allocator); what libc allocates on them through the interposed symbols
//! (a thread's TLS destructor list, at its start) goes to glibc too. A
//! zmem thread is known by its name (`host::thread::is_zmem_name`, set before any of that
//! runs), looked up once per thread.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

extern "C" {
    fn __libc_malloc(size: usize) -> *mut c_void;
}

/// Who serves the malloc family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Allocator {
    /// The lookup is running (on this or another thread): the early arena.
    Early,
    Glibc,
    /// Another allocator: every call goes to it.
    Foreign,
    /// A zmem thread: zmem's own heap (`heap.rs`).
    Zmem,
}

const UNKNOWN: u8 = 0;
const LOOKING: u8 = 1;
const GLIBC: u8 = 2;
const FOREIGN: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);

/// The next allocator's functions (addresses; 0 where it lacks one).
pub(crate) struct Fns {
    malloc: AtomicUsize,
    free: AtomicUsize,
    calloc: AtomicUsize,
    realloc: AtomicUsize,
    memalign: AtomicUsize,
    posix_memalign: AtomicUsize,
    usable_size: AtomicUsize,
}

static NEXT: Fns = Fns {
    malloc: AtomicUsize::new(0),
    free: AtomicUsize::new(0),
    calloc: AtomicUsize::new(0),
    realloc: AtomicUsize::new(0),
    memalign: AtomicUsize::new(0),
    posix_memalign: AtomicUsize::new(0),
    usable_size: AtomicUsize::new(0),
};

/// Whether the calling thread is one of zmem's (by its name, `zmem_common::host::thread::is_zmem_name`). The
/// answer is kept per thread (`flags::thread_kind`).
pub(crate) fn zmem_thread() -> bool {
    match crate::flags::thread_kind() {
        1 => false,
        2 => true,
        _ => {
            let mut name = [0u8; 16];
            // SAFETY: PR_GET_NAME writes at most 16 bytes into name.
            let r = unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
            let ours = r == 0 && zmem_common::host::thread::is_zmem_name(&name);
            crate::flags::set_thread_kind(if ours { 2 } else { 1 });
            ours
        }
    }
}

/// Which allocator serves a new allocation: zmem's heap on zmem's threads
/// and inside the shim (glibc's own allocations for a thread zmem starts,
/// its DTV among them, are made there), else the program's (looked up on
/// first use).
pub(crate) fn allocator() -> Allocator {
    if crate::flags::in_zmem() || zmem_thread() {
        return Allocator::Zmem;
    }
    program_allocator()
}

/// The program's allocator: what frees and reallocates a block that is
/// not zmem's.
pub(crate) fn program_allocator() -> Allocator {
    match STATE.load(Ordering::Acquire) {
        GLIBC => Allocator::Glibc,
        FOREIGN => Allocator::Foreign,
        LOOKING => Allocator::Early,
        _ => look_up(),
    }
}

fn look_up() -> Allocator {
    if STATE.compare_exchange(UNKNOWN, LOOKING, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return program_allocator();
    }
    let sym = |name: &std::ffi::CStr| {
        // SAFETY: a symbol lookup by a NUL-terminated name; a nested
        // malloc is served by the early arena (STATE is LOOKING).
        unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) as usize }
    };
    let malloc = sym(c"malloc");
    NEXT.malloc.store(malloc, Ordering::Relaxed);
    NEXT.free.store(sym(c"free"), Ordering::Relaxed);
    NEXT.calloc.store(sym(c"calloc"), Ordering::Relaxed);
    NEXT.realloc.store(sym(c"realloc"), Ordering::Relaxed);
    NEXT.memalign.store(sym(c"memalign"), Ordering::Relaxed);
    NEXT.posix_memalign.store(sym(c"posix_memalign"), Ordering::Relaxed);
    NEXT.usable_size.store(sym(c"malloc_usable_size"), Ordering::Relaxed);
    let full = [&NEXT.malloc, &NEXT.free, &NEXT.calloc, &NEXT.realloc].iter().all(|f| f.load(Ordering::Relaxed) != 0);
    // glibc's malloc is __libc_malloc under another name.
    let glibc = malloc == 0 || malloc == __libc_malloc as *const () as usize || !full;
    STATE.store(if glibc { GLIBC } else { FOREIGN }, Ordering::Release);
    if glibc {
        Allocator::Glibc
    } else {
        Allocator::Foreign
    }
}

/// The early arena: 256 KiB, bump-allocated, never freed.
const EARLY_BYTES: usize = 256 << 10;
#[repr(C, align(64))]
struct Early([u8; EARLY_BYTES]);
static mut EARLY: Early = Early([0; EARLY_BYTES]);
static EARLY_USED: AtomicUsize = AtomicUsize::new(0);

fn early_base() -> usize {
    // Only the address is taken; the bytes are reached through the pointers
    // `early_alloc` hands out, each range once.
    std::ptr::addr_of_mut!(EARLY) as usize
}

/// `size` bytes (zeroed: the arena is never reused) aligned to `align`
/// (a power of two up to 4096), or null when the arena is used up.
pub(crate) fn early_alloc(size: usize, align: usize) -> *mut c_void {
    let align = align.clamp(16, 4096);
    let base = early_base();
    let mut cur = EARLY_USED.load(Ordering::Relaxed);
    loop {
        let start = (base + cur).next_multiple_of(align) - base;
        let Some(end) = start.checked_add(size.max(1)).filter(|&e| e <= EARLY_BYTES) else {
            return std::ptr::null_mut();
        };
        match EARLY_USED.compare_exchange_weak(cur, end, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return (base + start) as *mut c_void,
            Err(now) => cur = now,
        }
    }
}

/// Whether `p` came from the early arena (and must never be freed).
pub(crate) fn is_early(p: *mut c_void) -> bool {
    let (a, base) = (p as usize, early_base());
    a >= base && a < base + EARLY_BYTES
}

/// Bytes from `p` to the end of the early arena (an upper bound on what a
/// realloc of an early pointer may copy).
pub(crate) fn early_room(p: *mut c_void) -> usize {
    early_base() + EARLY_BYTES - p as usize
}

fn f(slot: &AtomicUsize) -> usize {
    slot.load(Ordering::Relaxed)
}

// The calls below run only in the Foreign state, where look_up found
// malloc, free, calloc and realloc; memalign, posix_memalign and
// malloc_usable_size may be missing (0).

/// The next allocator's function in `slot` as a function pointer of type `F`.
///
/// # Safety
/// `slot` holds the address of a function whose C signature is `F` (look_up
/// stores what dlsym found under the name whose signature each caller
/// names), and is not 0.
unsafe fn next_fn<F: Copy>(slot: &AtomicUsize) -> F {
    let a = f(slot);
    debug_assert!(a != 0 && std::mem::size_of::<F>() == std::mem::size_of::<usize>());
    // SAFETY: the caller's contract: a function of type F lives at a.
    unsafe { std::mem::transmute_copy::<usize, F>(&a) }
}

type MallocFn = unsafe extern "C" fn(usize) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void);
type CallocFn = unsafe extern "C" fn(usize, usize) -> *mut c_void;
type ReallocFn = unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;
type MemalignFn = unsafe extern "C" fn(usize, usize) -> *mut c_void;
type PosixMemalignFn = unsafe extern "C" fn(*mut *mut c_void, usize, usize) -> c_int;
type UsableSizeFn = unsafe extern "C" fn(*mut c_void) -> usize;

pub(crate) unsafe fn malloc(size: usize) -> *mut c_void {
    // SAFETY: NEXT.malloc is the next allocator's malloc (Foreign state).
    let f: MallocFn = unsafe { next_fn(&NEXT.malloc) };
    // SAFETY: its malloc, with the caller's argument.
    unsafe { f(size) }
}

pub(crate) unsafe fn free(p: *mut c_void) {
    // SAFETY: NEXT.free is the next allocator's free (Foreign state).
    let f: FreeFn = unsafe { next_fn(&NEXT.free) };
    // SAFETY: p is that allocator's (the caller's contract).
    unsafe { f(p) }
}

pub(crate) unsafe fn calloc(n: usize, size: usize) -> *mut c_void {
    // SAFETY: NEXT.calloc is the next allocator's calloc (Foreign state).
    let f: CallocFn = unsafe { next_fn(&NEXT.calloc) };
    // SAFETY: its calloc, with the caller's arguments.
    unsafe { f(n, size) }
}

pub(crate) unsafe fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: NEXT.realloc is the next allocator's realloc (Foreign state).
    let f: ReallocFn = unsafe { next_fn(&NEXT.realloc) };
    // SAFETY: p is that allocator's (the caller's contract).
    unsafe { f(p, size) }
}

/// memalign through whichever of memalign and posix_memalign the next
/// allocator has; null if neither.
pub(crate) unsafe fn memalign(align: usize, size: usize) -> *mut c_void {
    if f(&NEXT.memalign) != 0 {
        // SAFETY: NEXT.memalign is the next allocator's memalign.
        let m: MemalignFn = unsafe { next_fn(&NEXT.memalign) };
        // SAFETY: its memalign, with the caller's arguments.
        return unsafe { m(align, size) };
    }
    if f(&NEXT.posix_memalign) == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: NEXT.posix_memalign is the next allocator's posix_memalign.
    let pm: PosixMemalignFn = unsafe { next_fn(&NEXT.posix_memalign) };
    let mut out = std::ptr::null_mut();
    // SAFETY: its posix_memalign; out is a valid slot for the result.
    let r = unsafe { pm(&mut out, align.max(8), size) };
    if r == 0 {
        out
    } else {
        std::ptr::null_mut()
    }
}

pub(crate) unsafe fn usable_size(p: *mut c_void) -> usize {
    if f(&NEXT.usable_size) == 0 {
        return 0;
    }
    // SAFETY: NEXT.usable_size is the next allocator's malloc_usable_size.
    let u: UsableSizeFn = unsafe { next_fn(&NEXT.usable_size) };
    // SAFETY: p is that allocator's (the caller's contract).
    unsafe { u(p) }
}
