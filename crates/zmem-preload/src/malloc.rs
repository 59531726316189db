//! The malloc family: with glibc's allocator next, requests of
//! `ZMEM_THRESHOLD` or more are managed and everything else goes to glibc
//! (`__libc_*`); with any other allocator everything goes to it (`next.rs`).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use zmem_common::RwLockExt;

use crate::errno::set_errno;
use crate::guard::guarded;
use crate::heap;
use crate::init::managed_alloc;
use crate::next::{self, allocator, Allocator};
use crate::state::{adopts_chunks, current, lookup, managed_free, threshold, wants_malloc, REGIONS};
use zmem_common::PAGE_SIZE;

extern "C" {
    fn __libc_malloc(size: usize) -> *mut c_void;
    fn __libc_calloc(n: usize, size: usize) -> *mut c_void;
    fn __libc_realloc(p: *mut c_void, size: usize) -> *mut c_void;
    fn __libc_free(p: *mut c_void);
    fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
}

#[no_mangle]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    match allocator() {
        // SAFETY: the program's own allocator, with the caller's argument.
        Allocator::Foreign => return unsafe { next::malloc(size) },
        Allocator::Early => return next::early_alloc(size, 16),
        Allocator::Zmem => return heap::malloc(size),
        Allocator::Glibc => {}
    }
    if wants_malloc(size) {
        if let Some(p) = managed_alloc(size) {
            return p;
        }
    }
    // SAFETY: glibc's malloc, with the caller's argument.
    let p = unsafe { __libc_malloc(size) };
    adopt_chunk(p, size);
    p
}

/// A chunk glibc mapped for itself (a request of the threshold or more,
/// above glibc's mmap threshold) is managed from its first byte, where a
/// scan would find it only after the program had filled it. The allocator
/// stays glibc's: the chunk's pages are adopted, nothing else; its `free`
/// (an munmap) retires the region, its `realloc` (an mremap) moves it.
fn adopt_chunk(p: *mut c_void, size: usize) {
    adopt_brk_growth();
    // A process that waits to start its pager looks at once, and adopts
    // the chunk below if it started (glibc's lock is free: malloc has
    // returned).
    if !p.is_null()
        && size >= zmem_settings::Settings::DEFAULT_THRESHOLD
        && current().is_none()
        && !crate::waiting::saw_mapping(size, true)
    {
        return;
    }
    if p.is_null() || !adopts_chunks(size) {
        return;
    }
    // SAFETY: p is a live chunk glibc just returned: the two words before
    // it are its header (prev_size, then size with its flag bits), in the
    // same mapping, readable and 8-aligned.
    let header = unsafe { p.cast::<usize>().sub(2) };
    // SAFETY: as above: header points at those two words.
    let words = unsafe { std::slice::from_raw_parts(header, 2) };
    let (prev, head) = (words[0], words[1]);
    const IS_MMAPPED: usize = 2;
    if head & IS_MMAPPED == 0 {
        return; // from glibc's heap, which a scan adopts as a whole
    }
    // An mmapped chunk starts prev_size into its mapping (memalign's lead).
    let chunk = p as usize - 2 * std::mem::size_of::<usize>();
    let (start, len) = (chunk - prev, (head & !7) + prev);
    if start % PAGE_SIZE != 0 {
        return;
    }
    if let Some(s) = current() {
        guarded(|| {
            if let Err(e) = s.pager.adopt(start as u64, len) {
                log::debug!("a chunk of glibc's at {start:#x} was not adopted: {e}");
            }
        });
    }
}

/// The program break as of the growth a waiting process last published;
/// 0 before the first look.
static BRK_PUBLISHED: AtomicUsize = AtomicUsize::new(0);

/// How far the main heap grows before a waiting process publishes it.
const BRK_PUBLISH_STEP: usize = 1 << 20;

/// A process that waits to start its pager (`waiting.rs`) counts the main
/// heap's growth as it counts a large mapping: published in its tree slot at
/// once, and looked at inline where that brings the tree to the start point
/// (glibc's malloc has returned: no allocator lock is held). Left to the
/// stats thread's looks, a program filling its heap at full speed (`brk.c`:
/// 256 MiB of 64 KiB blocks under 32M) filled it past the point between two
/// looks, and its pager started with the tree up to 43.6 MiB, in 4 runs of
/// 12 over 38 MiB.
fn publish_brk_growth() {
    if let Some((_, grown)) = claim_brk_growth(&BRK_PUBLISHED, PAGE_SIZE, BRK_PUBLISH_STEP) {
        crate::waiting::saw_mapping(grown, true);
    }
}

/// The main heap's growth past `mark`, in whole `unit`s and at least `min`
/// bytes, claimed: `mark` moves past it and `(start, len)` comes back. The
/// first call, and a heap trimmed back below `mark`, only set `mark` to the
/// break. `sbrk(0)` returns glibc's cached value: a load, no syscall.
fn claim_brk_growth(mark: &AtomicUsize, unit: usize, min: usize) -> Option<(usize, usize)> {
    // SAFETY: sbrk(0) changes nothing; it returns the current break.
    let cur = unsafe { libc::sbrk(0) } as usize;
    if cur == usize::MAX {
        return None;
    }
    let seen = mark.load(Ordering::Relaxed);
    if seen == 0 || cur < seen {
        let _ = mark.compare_exchange(seen, cur.next_multiple_of(PAGE_SIZE), Ordering::Relaxed, Ordering::Relaxed);
        return None;
    }
    let grown = (cur - seen) / unit * unit;
    if grown < min.max(1) || mark.compare_exchange(seen, seen + grown, Ordering::Relaxed, Ordering::Relaxed).is_err() {
        return None;
    }
    Some((seen, grown))
}

/// The program break up to which the main heap's growth was adopted; 0
/// before the first look.
static BRK_ADOPTED: AtomicUsize = AtomicUsize::new(0);

/// glibc grows its main heap with an internal `sbrk` that no preload sees,
/// so a scan found the growth only after the program had filled it:
/// Python's bytearrays came in 16–25 MiB at a time, over a 40 MiB limit.
/// So after each of glibc's allocations the break is compared with what
/// was adopted (`claim_brk_growth`), and the growth is adopted in whole
/// folios as soon as there is one, before the program fills it. The heap's
/// first part is left to the scan; a heap trimmed back is followed down.
fn adopt_brk_growth() {
    if current().is_none() && crate::waiting::is_waiting() {
        publish_brk_growth();
        return;
    }
    if !adopts_chunks(usize::MAX) {
        return;
    }
    let Some(s) = current() else { return };
    let fs = s.settings.folio;
    let Some((seen, grown)) = claim_brk_growth(&BRK_ADOPTED, fs, fs) else { return };
    guarded(|| match s.pager.adopt(seen as u64, grown) {
        Ok(_) => log::debug!("adopted the heap's growth {seen:#x}+{grown:#x}"),
        // A scan took it first, or part of it.
        Err(e) => log::debug!("the heap's growth at {seen:#x} was not adopted: {e}"),
    });
}

#[no_mangle]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    let Some(total) = n.checked_mul(size) else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    match allocator() {
        // SAFETY: the program's own allocator, with the caller's arguments.
        Allocator::Foreign => return unsafe { next::calloc(n, size) },
        // Never reused, so zeroed.
        Allocator::Early => return next::early_alloc(total, 16),
        Allocator::Zmem => return heap::calloc(total),
        Allocator::Glibc => {}
    }
    if wants_malloc(total) {
        // A fresh region reads as zeros.
        if let Some(p) = managed_alloc(total) {
            return p;
        }
    }
    // SAFETY: glibc's calloc, with the caller's arguments.
    let p = unsafe { __libc_calloc(n, size) };
    adopt_chunk(p, total);
    p
}

#[no_mangle]
pub unsafe extern "C" fn free(p: *mut c_void) {
    if p.is_null() || next::is_early(p) {
        return;
    }
    if heap::owns(p) {
        // SAFETY: zmem's heap made p (the caller's contract: freed once).
        return unsafe { heap::free(p) };
    }
    if next::program_allocator() == Allocator::Foreign {
        // SAFETY: the program's allocator made p (the caller's contract).
        return unsafe { next::free(p) };
    }
    let a = p as usize;
    if a % PAGE_SIZE == 0 && a != 0 {
        if let Some((start, _, _)) = lookup(a) {
            if start == a {
                managed_free(start);
            }
            return;
        }
    }
    // SAFETY: not ours, so glibc's (the caller's contract).
    unsafe { __libc_free(p) }
}

#[no_mangle]
pub unsafe extern "C" fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    if p.is_null() {
        // SAFETY: realloc(NULL, n) is malloc(n).
        return unsafe { malloc(size) };
    }
    if next::is_early(p) {
        // SAFETY: malloc with the caller's size.
        let q = unsafe { malloc(size) };
        if !q.is_null() {
            // SAFETY: p lies in the early arena, readable to its end; q has
            // size bytes; they are distinct.
            unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), q.cast::<u8>(), size.min(next::early_room(p))) };
        }
        return q;
    }
    if heap::owns(p) {
        // SAFETY: zmem's heap made p (the caller's contract).
        return unsafe { heap::realloc(p, size) };
    }
    if next::program_allocator() == Allocator::Foreign {
        // SAFETY: the program's allocator made p (the caller's contract).
        return unsafe { next::realloc(p, size) };
    }
    let a = p as usize;
    let ours = if a % PAGE_SIZE == 0 { lookup(a).filter(|&(s, _, _)| s == a) } else { None };
    if let Some((start, cap, len)) = ours {
        if size <= cap && size >= threshold() / 2 {
            // Fits: keep it (a shrink leaves the tail mapped).
            guarded(|| {
                if let Some(m) = REGIONS.write_ok().get_mut(&start) {
                    m.len = size;
                }
            });
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
    if wants_malloc(size) {
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
    let q = unsafe { __libc_realloc(p, size) };
    // A chunk moved by mremap took its region along; one copied into a
    // fresh mapping is adopted here (a region that has it already refuses).
    adopt_chunk(q, size);
    q
}

pub(crate) fn aligned(align: usize, size: usize) -> *mut c_void {
    match allocator() {
        // SAFETY: the program's own allocator, with the caller's arguments.
        Allocator::Foreign => return unsafe { next::memalign(align, size) },
        Allocator::Early => return next::early_alloc(size, align),
        Allocator::Zmem => return heap::memalign(align, size),
        Allocator::Glibc => {}
    }
    // Regions are folio-aligned.
    let folio = current().map_or(64 << 10, |s| s.settings.folio);
    if align <= folio && wants_malloc(size) {
        if let Some(p) = managed_alloc(size) {
            return p;
        }
    }
    // SAFETY: glibc's memalign with the caller's arguments.
    let p = unsafe { __libc_memalign(align, size) };
    adopt_chunk(p, size);
    p
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
    aligned(PAGE_SIZE, size)
}

pub(crate) type UsableSize = unsafe extern "C" fn(*mut c_void) -> usize;

/// glibc's malloc_usable_size (looked up once; dlsym may allocate, which
/// the reentrancy flag passes through).
pub(crate) unsafe fn glibc_usable_size(p: *mut c_void) -> usize {
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
    if p.is_null() || next::is_early(p) || heap::owns(p) {
        return 0;
    }
    if next::program_allocator() == Allocator::Foreign {
        // SAFETY: the program's allocator made p (the caller's contract).
        return unsafe { next::usable_size(p) };
    }
    if let Some((start, _, len)) = lookup(p as usize) {
        return len - (p as usize - start).min(len);
    }
    // SAFETY: not ours, so glibc's.
    unsafe { glibc_usable_size(p) }
}
