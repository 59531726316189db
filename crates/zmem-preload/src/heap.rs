//! zmem's own heap: every Rust allocation of the shim, and the C library's
//! allocations on zmem's threads.
//!
//! The program's memory is managed by mapping, whoever made it (see
//! `zmem_uffd`'s adoption), so zmem's heap cannot be glibc's: a glibc arena
//! holding a handler thread's data could be adopted and evicted, and the
//! handler would then fault on memory only it can serve. This heap is
//! dlmalloc over one reservation (`RESERVE` bytes of address space,
//! `PROT_NONE`, committed with `mprotect` as it grows, never given back),
//! which the scan knows as zmem's (`zmem_common::owned::set_heap`).
//!
//! One lock guards it. The prepare step of fork takes it and both
//! after-fork steps let go ([`fork_lock`], [`fork_unlock`]), so a forked
//! child never starts with it held by a thread it does not have.

use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use dlmalloc::Dlmalloc;
use zmem_common::LockExt;

/// Address space reserved for the heap: 64 GiB, no memory until used.
const RESERVE: usize = 64 << 30;
/// Commit in steps of this much.
const STEP: usize = 2 << 20;

static BASE: AtomicUsize = AtomicUsize::new(0);
static TOP: AtomicUsize = AtomicUsize::new(0);

/// Hands dlmalloc committed pieces of the reservation, in address order.
struct Reserve;

// SAFETY: alloc returns fresh, committed, zeroed, page-aligned memory from
// the reservation that nothing else uses, or null; nothing is ever freed
// (free and free_part say so), so no segment is handed out twice.
unsafe impl dlmalloc::Allocator for Reserve {
    fn alloc(&self, size: usize) -> (*mut u8, usize, u32) {
        let Some(base) = reserve() else { return (std::ptr::null_mut(), 0, 0) };
        let size = size.div_ceil(STEP) * STEP;
        // Called under the heap lock: TOP has one writer at a time.
        let top = TOP.load(Ordering::Relaxed);
        if top + size > RESERVE {
            return (std::ptr::null_mut(), 0, 0);
        }
        // SAFETY: [base + top, base + top + size) lies in our reservation,
        // unused so far; mprotect only makes it accessible.
        let r = unsafe { libc::syscall(libc::SYS_mprotect, base + top, size, libc::PROT_READ | libc::PROT_WRITE) };
        if r != 0 {
            return (std::ptr::null_mut(), 0, 0);
        }
        TOP.store(top + size, Ordering::Relaxed);
        ((base + top) as *mut u8, size, 0)
    }

    fn remap(&self, _: *mut u8, _: usize, _: usize, _: bool) -> *mut u8 {
        std::ptr::null_mut()
    }

    fn free_part(&self, _: *mut u8, _: usize, _: usize) -> bool {
        false
    }

    fn free(&self, _: *mut u8, _: usize) -> bool {
        false
    }

    fn can_release_part(&self, _: u32) -> bool {
        false
    }

    fn allocates_zeros(&self) -> bool {
        true
    }

    fn page_size(&self) -> usize {
        zmem_common::PAGE_SIZE
    }
}

/// The reservation's base, made on first use.
fn reserve() -> Option<usize> {
    let b = BASE.load(Ordering::Acquire);
    if b != 0 {
        return Some(b);
    }
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: a fresh PROT_NONE mapping at an address the kernel picks
    // aliases nothing. Called under the heap lock, so made once.
    let p = unsafe { libc::syscall(libc::SYS_mmap, 0usize, RESERVE, libc::PROT_NONE, flags, -1, 0usize) };
    if p < 0 {
        return None;
    }
    let p = p as usize;
    zmem_common::owned::set_heap(p as u64, RESERVE);
    BASE.store(p, Ordering::Release);
    Some(p)
}

static HEAP: Mutex<Dlmalloc<Reserve>> = Mutex::new(Dlmalloc::new_with_allocator(Reserve));

thread_local! {
    /// The heap's guard, held by the forking thread across fork.
    static FORK_GUARD: RefCell<Option<MutexGuard<'static, Dlmalloc<Reserve>>>> = const { RefCell::new(None) };
}

/// Whether `p` is this heap's.
pub(crate) fn owns(p: *const c_void) -> bool {
    let b = BASE.load(Ordering::Acquire);
    b != 0 && (b..b + RESERVE).contains(&(p as usize))
}

/// The prepare step of fork: no zmem thread is inside the heap at fork.
pub(crate) fn fork_lock() {
    // Set the slot up first: its first use registers a TLS destructor,
    // which allocates (from this heap, inside the shim).
    FORK_GUARD.with(|_| ());
    let g = HEAP.lock_ok();
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// Both after-fork steps.
pub(crate) fn fork_unlock() {
    FORK_GUARD.with(|f| f.borrow_mut().take());
}

// The C shapes, for the C library's allocations on zmem's threads.

pub(crate) fn malloc(size: usize) -> *mut c_void {
    // SAFETY: dlmalloc's malloc under its lock; any size is accepted.
    unsafe { HEAP.lock_ok().c_malloc(size).cast() }
}

pub(crate) fn calloc(total: usize) -> *mut c_void {
    let p = malloc(total);
    if !p.is_null() {
        // SAFETY: p has total writable bytes (a reused block is not zeroed).
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, total) };
    }
    p
}

pub(crate) fn memalign(align: usize, size: usize) -> *mut c_void {
    // SAFETY: align is a power of two (checked by callers or by C's contract).
    unsafe { HEAP.lock_ok().c_memalign(align.max(16), size).cast() }
}

/// # Safety
/// `p` is null or this heap's, not freed.
pub(crate) unsafe fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: the caller's contract.
    unsafe { HEAP.lock_ok().c_realloc(p.cast(), size).cast() }
}

/// # Safety
/// `p` is null or this heap's, not freed.
pub(crate) unsafe fn free(p: *mut c_void) {
    // SAFETY: the caller's contract.
    unsafe { HEAP.lock_ok().c_free(p.cast()) }
}

/// zmem's global allocator.
pub(crate) struct ZmemHeap;

// SAFETY: every block comes from the one dlmalloc instance, under its lock,
// with the layout's size and alignment, and goes back to it.
unsafe impl std::alloc::GlobalAlloc for ZmemHeap {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        // SAFETY: GlobalAlloc's contract: a non-zero size, a power-of-two alignment.
        unsafe { HEAP.lock_ok().malloc(l.size(), l.align()) }
    }

    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        // SAFETY: as alloc.
        unsafe { HEAP.lock_ok().calloc(l.size(), l.align()) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        // SAFETY: p came from alloc with layout l, freed once.
        unsafe { HEAP.lock_ok().free(p, l.size(), l.align()) }
    }

    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        // SAFETY: p came from alloc with layout l; new is non-zero.
        unsafe { HEAP.lock_ok().realloc(p, l.size(), l.align(), new) }
    }
}
