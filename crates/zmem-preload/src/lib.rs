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
//!   When the program's allocator is not glibc's (jemalloc, tcmalloc), the
//!   whole family goes to it untouched (`next.rs`).
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
//! A forked child inherits the regions whole: the prepare step of fork loads
//! every evicted folio back and freezes reclaim until the parent step
//! (`Pager::fork_prepare`). In the child the regions are plain memory (the
//! child has neither the pager's threads nor a userfaultfd registration):
//! it manages no new memory, and its frees of the parent's regions unmap
//! them. vfork and posix_spawn run no atfork handlers and need none. `exec`
//! starts afresh: the environment carries `LD_PRELOAD` and the settings, so
//! the new program gets its own pager.
//!
//! # Partial munmap
//! Unmapping part of a managed mapping drops its pages (`MADV_DONTNEED`, so
//! the pager frees their entries) and makes the range `PROT_NONE`; the
//! address range is returned when the whole mapping is unmapped.
#![allow(clippy::missing_safety_doc)]

mod capi;
mod guard;
mod init;
mod malloc;
mod mmap;
mod next;
mod stats;

pub use guard::mark_internal_thread;

/// zmem's own heap is glibc's, called directly: never the interposed
/// `malloc` (which may hand the request to the program's allocator), so a
/// program's allocator that calls mmap with its lock held (jemalloc does)
/// never finds the shim waiting on that same lock.
struct LibcHeap;

extern "C" {
    fn __libc_malloc(size: usize) -> *mut std::ffi::c_void;
    fn __libc_calloc(n: usize, size: usize) -> *mut std::ffi::c_void;
    fn __libc_realloc(p: *mut std::ffi::c_void, size: usize) -> *mut std::ffi::c_void;
    fn __libc_memalign(align: usize, size: usize) -> *mut std::ffi::c_void;
    fn __libc_free(p: *mut std::ffi::c_void);
}

/// glibc's malloc aligns to 16 bytes on x86-64.
const MALLOC_ALIGN: usize = 16;

// SAFETY: every block comes from glibc's allocator and goes back to it;
// alignments above glibc's are asked of memalign, whose blocks free takes.
unsafe impl std::alloc::GlobalAlloc for LibcHeap {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        if l.align() <= MALLOC_ALIGN {
            // SAFETY: glibc's malloc; a null result is GlobalAlloc's failure.
            unsafe { __libc_malloc(l.size()).cast() }
        } else {
            // SAFETY: glibc's memalign with a power-of-two alignment.
            unsafe { __libc_memalign(l.align(), l.size()).cast() }
        }
    }

    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        if l.align() <= MALLOC_ALIGN {
            // SAFETY: glibc's calloc.
            unsafe { __libc_calloc(1, l.size()).cast() }
        } else {
            // SAFETY: as alloc; the block is zeroed before it is handed out.
            let p = unsafe { self.alloc(l) };
            if !p.is_null() {
                // SAFETY: p has l.size() writable bytes.
                unsafe { std::ptr::write_bytes(p, 0, l.size()) };
            }
            p
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, _: std::alloc::Layout) {
        // SAFETY: p came from alloc (glibc's), freed once (GlobalAlloc's contract).
        unsafe { __libc_free(p.cast()) }
    }

    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        if l.align() <= MALLOC_ALIGN {
            // SAFETY: p is glibc's (from alloc), new is non-zero.
            return unsafe { __libc_realloc(p.cast(), new).cast() };
        }
        let Ok(nl) = std::alloc::Layout::from_size_align(new, l.align()) else { return std::ptr::null_mut() };
        // SAFETY: as alloc, with the layout's alignment.
        let q = unsafe { self.alloc(nl) };
        if !q.is_null() {
            // SAFETY: p has l.size() readable bytes, q new writable ones; distinct.
            unsafe { std::ptr::copy_nonoverlapping(p, q, l.size().min(new)) };
            // SAFETY: p is glibc's, freed once.
            unsafe { __libc_free(p.cast()) };
        }
        q
    }
}

#[global_allocator]
static HEAP: LibcHeap = LibcHeap;

const PAGE: usize = zmem_common::PAGE_SIZE;
