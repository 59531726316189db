//! zmem's own heap: every Rust allocation of the shim, and the C library's
//! allocations on zmem's threads.
//!
//! The program's memory is managed by mapping, whoever made it (see
//! `zmem_uffd`'s adoption), so zmem's heap cannot be glibc's: a glibc arena
//! holding a handler thread's data could be adopted and evicted, and the
//! handler would then fault on memory only it can serve. This heap is
//! dlmalloc over arenas of its own (`PROT_NONE` mappings, recorded as
//! zmem's, `zmem_common::host::owned::add_heap`, before they are committed with
//! `mprotect` as the heap grows; never given back), each as large as all
//! before it, so the address space the heap holds stays within twice what
//! it uses. (One 128 GiB reservation, made up front, counted against
//! `ulimit -v`: under `ulimit -v 8000000` the shim's first allocation
//! aborted every program, and a bash script that ran `ulimit -v 4000000`
//! failed its next allocation.) A block's heap is told by its arena.
//!
//! One lock guards it. The prepare step of fork takes it and both
//! after-fork steps let go ([`fork_lock`], [`fork_unlock`]), so a forked
//! child never starts with it held by a thread it does not have.
//!
//! No thread ever waits for that lock while a fork holds it: it allocates
//! from the side heap instead, and leaves its frees for later. With
//! `UFFD_FEATURE_EVENT_FORK` the fork waits for the pager's handler, and
//! the handler may wait for a lock of the pager's (the LRU's, the region
//! table's) held by the thread that waits for the heap: the fork never
//! ended (a bash script under `zmem run`, its reclaim thread holding the
//! LRU's lock while it grew a list).

use std::cell::{Cell, RefCell, UnsafeCell};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use dlmalloc::Dlmalloc;
use zmem_common::LockExt;

/// Commit in steps of this much.
const STEP: usize = 2 << 20;
/// The main heap's first arena; each next one is as large as all before it.
const FIRST_MAIN: usize = 16 << 20;
/// A side heap's first arena, and its next ones likewise.
const FIRST_SIDE: usize = 4 << 20;

/// This generation of the side heap (a forked child starts the next one).
/// Its arenas are tagged `SIDE_GEN + 1` (`zmem_common::host::owned::heap_tag`);
/// the main heap's, 0; those of an ancestor's side heap, anything else.
static SIDE_GEN: AtomicU64 = AtomicU64::new(0);

/// Each heap's current arena: where it starts, what is committed up to and
/// where it ends (0s before the first), and the bytes of all its arenas.
/// Written under that heap's lock only.
static ARENA: [[AtomicUsize; 4]; 2] = [const { [const { AtomicUsize::new(0) }; 4] }; 2];
const START: usize = 0;
const TOP: usize = 1;
const END: usize = 2;
const MAPPED: usize = 3;

/// Hands dlmalloc committed pieces of the main heap's arenas (`Reserve(0)`)
/// or of the side heap's (`Reserve(1)`).
struct Reserve(usize);

impl Reserve {
    fn tag(&self) -> u64 {
        match self.0 {
            0 => 0,
            _ => SIDE_GEN.load(Ordering::Relaxed) + 1,
        }
    }
}

/// Maps a fresh arena of `len` bytes, `PROT_NONE`, recorded as the shim's
/// heap (tagged `tag`) before it can be made accessible; `None` if the
/// kernel refuses it (`ulimit -v`) or the table of arenas is full.
fn map_arena(len: usize, tag: u64) -> Option<usize> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: a fresh PROT_NONE mapping at an address the kernel picks
    // aliases nothing.
    let p = unsafe { libc::syscall(libc::SYS_mmap, 0usize, len, libc::PROT_NONE, flags, -1, 0usize) };
    if p < 0 {
        return None;
    }
    if !zmem_common::host::owned::add_heap(p as u64, len, tag) {
        // SAFETY: p is the mapping just made, which nothing uses.
        unsafe { libc::syscall(libc::SYS_munmap, p, len) };
        return None;
    }
    Some(p as usize)
}

// SAFETY: alloc returns fresh, committed, zeroed, page-aligned memory from
// this heap's arenas, which nothing else uses, or null; nothing is ever
// freed (free and free_part say so), so no segment is handed out twice.
// Each arena is recorded (with this heap's tag) before any of it is handed
// out, so every block is told by its address (`owner`).
unsafe impl dlmalloc::Allocator for Reserve {
    fn alloc(&self, size: usize) -> (*mut u8, usize, u32) {
        let a = &ARENA[self.0];
        let size = size.div_ceil(STEP) * STEP;
        // Called under this heap's lock: one writer at a time.
        let (mut top, mut end) = (a[TOP].load(Ordering::Relaxed), a[END].load(Ordering::Relaxed));
        if a[START].load(Ordering::Relaxed) == 0 || top + size > end {
            // A new arena, as large as all before it (at least the first's
            // size and this request): the address space held stays within
            // twice what is committed, and the arenas few.
            let first = if self.0 == 0 { FIRST_MAIN } else { FIRST_SIDE };
            let mapped = a[MAPPED].load(Ordering::Relaxed);
            let len = size.max(mapped).max(first).div_ceil(STEP) * STEP;
            let Some(p) = map_arena(len, self.tag()) else { return (std::ptr::null_mut(), 0, 0) };
            (top, end) = (p, p + len);
            a[START].store(p, Ordering::Relaxed);
            a[END].store(end, Ordering::Relaxed);
            a[MAPPED].store(mapped + len, Ordering::Relaxed);
        }
        // SAFETY: [top, top + size) lies in this heap's current arena,
        // unused so far; mprotect only makes it accessible.
        let r = unsafe { libc::syscall(libc::SYS_mprotect, top, size, libc::PROT_READ | libc::PROT_WRITE) };
        if r != 0 {
            return (std::ptr::null_mut(), 0, 0);
        }
        a[TOP].store(top + size, Ordering::Relaxed);
        (top as *mut u8, size, 0)
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

static HEAP: Mutex<Dlmalloc<Reserve>> = Mutex::new(Dlmalloc::new_with_allocator(Reserve(0)));

/// The side heap: the pager's handler thread allocates here, so that it
/// can serve faults while a forking thread holds the main heap's lock
/// (`fork_lock`), and so does every other thread while a fork holds it. With `UFFD_FEATURE_EVENT_FORK`, fork waits for the
/// handler to read its FORK event, and before that the forking thread may
/// fault (glibc locks every malloc arena, and another allocator's atfork
/// handler its own, after the shim's prepare step): a handler waiting for
/// the main heap then would never let the fork finish.
///
/// Its lock is a flag, not a `Mutex`: a forked child may find it held by
/// the parent's handler, which it does not have, and starts a fresh side
/// heap, the next generation, in arenas of its own
/// (`fork_child_side_heap`); what the parent's side heap held is left
/// where it is, never freed or reused.
struct SideHeap {
    locked: AtomicBool,
    dl: UnsafeCell<Dlmalloc<Reserve>>,
}

// SAFETY: `dl` is reached only through `with`, which holds `locked`, or by
// `fork_child_side_heap`, in a child with one thread.
unsafe impl Sync for SideHeap {}

impl SideHeap {
    fn with<R>(&self, f: impl FnOnce(&mut Dlmalloc<Reserve>) -> R) -> R {
        let mut spins = 0u32;
        while self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: `locked` is ours until the store below: no other
        // reference to `dl` exists meanwhile.
        let r = f(unsafe { &mut *self.dl.get() });
        self.locked.store(false, Ordering::Release);
        r
    }
}

static SIDE: SideHeap =
    SideHeap { locked: AtomicBool::new(false), dl: UnsafeCell::new(Dlmalloc::new_with_allocator(Reserve(1))) };

/// Blocks of the main heap freed by a side-heap thread while the main
/// heap's lock was held (a fork): a list through their first word, freed by
/// the next holder of the lock.
static DEFERRED: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());

/// Set while a fork holds the main heap's lock ([`fork_lock`]).
static FORKING: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The heap's guard, held by the forking thread across fork.
    static FORK_GUARD: RefCell<Option<MutexGuard<'static, Dlmalloc<Reserve>>>> = const { RefCell::new(None) };
    /// This thread allocates from the side heap.
    static ON_SIDE: Cell<bool> = const { Cell::new(false) };
}

/// Whose block `p` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    Main,
    Side,
    /// A side heap of an ancestor process's (this is a forked child): never
    /// freed or reused.
    Abandoned,
    None,
}

fn owner(p: *const c_void) -> Owner {
    match zmem_common::host::owned::heap_tag(p as u64) {
        None => Owner::None,
        Some(0) => Owner::Main,
        Some(t) if t == SIDE_GEN.load(Ordering::Relaxed) + 1 => Owner::Side,
        Some(_) => Owner::Abandoned,
    }
}

/// Whether `p` is this heap's (either part).
pub(crate) fn owns(p: *const c_void) -> bool {
    owner(p) != Owner::None
}

/// From now on this thread allocates from the side heap (the pager's
/// handler: see [`SideHeap`]).
pub(crate) fn use_side_heap() {
    ON_SIDE.with(|s| s.set(true));
}

fn on_side() -> bool {
    ON_SIDE.with(Cell::get)
}

/// The main heap, locked, with the frees deferred meanwhile done; `None`
/// for the side heap: on the side heap's threads, and while a fork holds
/// the main heap (see the module's doc). Otherwise a busy lock is waited
/// for by spinning, then yielding, never asleep: a thread asleep on it
/// would not see a fork take it next.
fn main_heap() -> Option<MutexGuard<'static, Dlmalloc<Reserve>>> {
    if on_side() {
        return None;
    }
    let mut spins = 0u32;
    loop {
        match HEAP.try_lock() {
            Ok(mut g) => {
                drain(&mut g);
                return Some(g);
            }
            Err(TryLockError::Poisoned(e)) => {
                let mut g = e.into_inner();
                drain(&mut g);
                return Some(g);
            }
            Err(TryLockError::WouldBlock) if FORKING.load(Ordering::Acquire) => return None,
            Err(TryLockError::WouldBlock) => {
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
}

fn drain(dl: &mut Dlmalloc<Reserve>) {
    if DEFERRED.load(Ordering::Relaxed).is_null() {
        return;
    }
    let mut p = DEFERRED.swap(std::ptr::null_mut(), Ordering::Acquire);
    while !p.is_null() {
        // SAFETY: each listed block is a live main-heap block, freed by its
        // owner and pushed once; its first word holds the next one.
        let next = unsafe { p.cast::<*mut u8>().read() };
        // SAFETY: as above; freed once, here, under the main lock.
        unsafe { dl.c_free(p) };
        p = next;
    }
}

/// Frees a main-heap block, never waiting: with the lock busy it is left
/// on `DEFERRED` for the next holder of the lock.
///
/// # Safety
/// `p` is a live main-heap block, freed once.
unsafe fn free_main(p: *mut u8) {
    let mut g = match HEAP.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(e)) => e.into_inner(),
        Err(TryLockError::WouldBlock) => {
            let mut head = DEFERRED.load(Ordering::Relaxed);
            loop {
                // SAFETY: p is ours to free, so its bytes (at least two
                // words: dlmalloc's smallest block) are ours to write.
                unsafe { p.cast::<*mut u8>().write(head) };
                match DEFERRED.compare_exchange_weak(head, p, Ordering::Release, Ordering::Relaxed) {
                    Ok(_) => return,
                    Err(h) => head = h,
                }
            }
        }
    };
    drain(&mut g);
    // SAFETY: the caller's contract.
    unsafe { g.c_free(p) }
}

/// In a forked child, before any thread starts: the side heap starts
/// afresh, the next generation, in new arenas. The parent's handler may have held its lock
/// at fork, mid-allocation; its blocks stay where they are, abandoned.
///
/// # Safety
/// The calling thread is the process's only one.
pub(crate) unsafe fn fork_child_side_heap() {
    SIDE_GEN.fetch_add(1, Ordering::Relaxed);
    for w in &ARENA[1] {
        w.store(0, Ordering::Relaxed);
    }
    // SAFETY: the only thread (the caller's contract), so no reference to
    // `dl` exists; the old state is forgotten, not dropped (it owns
    // nothing but its arenas' bytes, which stay mapped).
    unsafe { SIDE.dl.get().write(Dlmalloc::new_with_allocator(Reserve(1))) };
    SIDE.locked.store(false, Ordering::Release);
}

/// The prepare step of fork: no zmem thread is inside the main heap at
/// fork. The side heap is not locked (see [`SideHeap`]).
pub(crate) fn fork_lock() {
    // Set the slot up first: its first use registers a TLS destructor,
    // which allocates (from this heap, inside the shim).
    FORK_GUARD.with(|_| ());
    // From here no thread waits for the lock (`main_heap`).
    FORKING.store(true, Ordering::SeqCst);
    let mut g = HEAP.lock_ok();
    drain(&mut g);
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// Both after-fork steps.
pub(crate) fn fork_unlock() {
    FORK_GUARD.with(|f| f.borrow_mut().take());
    FORKING.store(false, Ordering::Release);
}

// The C shapes, for the C library's allocations on zmem's threads.

pub(crate) fn malloc(size: usize) -> *mut c_void {
    match main_heap() {
        // SAFETY: dlmalloc's malloc under its lock; any size is accepted.
        Some(mut g) => unsafe { g.c_malloc(size).cast() },
        // SAFETY: as above.
        None => SIDE.with(|d| unsafe { d.c_malloc(size) }).cast(),
    }
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
    match main_heap() {
        // SAFETY: align is a power of two (checked by callers or by C's contract).
        Some(mut g) => unsafe { g.c_memalign(align.max(16), size).cast() },
        // SAFETY: as above.
        None => SIDE.with(|d| unsafe { d.c_memalign(align.max(16), size) }).cast(),
    }
}

/// # Safety
/// `p` is null or this heap's, not freed.
pub(crate) unsafe fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    let whose = owner(p);
    let main = if whose == Owner::Main { main_heap() } else { None };
    match whose {
        // SAFETY: the caller's contract; a block is reallocated by its own heap.
        Owner::Side => SIDE.with(|d| unsafe { d.c_realloc(p.cast(), size) }).cast(),
        // SAFETY: the caller's contract.
        Owner::Main if main.is_some() => unsafe { main.expect("checked").c_realloc(p.cast(), size).cast() },
        // Moved to a fresh block: an abandoned block stays where it is; a
        // main-heap block whose heap a fork holds is freed later.
        Owner::Abandoned | Owner::Main => {
            // Its size is in its dlmalloc chunk header, the word before it
            // (the size, with flag bits in the low three).
            let q = malloc(size);
            if !q.is_null() {
                // SAFETY: the word before a live dlmalloc block is its
                // chunk header, in the same committed chunk.
                let chunk = unsafe { p.cast::<usize>().wrapping_sub(1).read() } & !7;
                let room = chunk.saturating_sub(std::mem::size_of::<usize>());
                // SAFETY: p has at least `room` bytes, q has `size`; they
                // are distinct blocks.
                unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), q.cast::<u8>(), size.min(room)) };
                // SAFETY: the caller's contract: p is live, and is freed
                // once, here (an abandoned block: not at all).
                unsafe { free(p) };
            }
            q
        }
        // Null: a fresh block.
        Owner::None => malloc(size),
    }
}

/// # Safety
/// `p` is null or this heap's, not freed.
pub(crate) unsafe fn free(p: *mut c_void) {
    match owner(p) {
        // SAFETY: the caller's contract: a live side-heap block, freed once.
        Owner::Side => SIDE.with(|d| unsafe { d.c_free(p.cast()) }),
        // SAFETY: the caller's contract.
        Owner::Main => unsafe { free_main(p.cast()) },
        Owner::Abandoned | Owner::None => {}
    }
}

/// zmem's global allocator.
pub(crate) struct ZmemHeap;

// SAFETY: every block comes from one of the two dlmalloc instances, under
// its lock, with the layout's size and alignment, and goes back to the one
// that made it (told by its address); an abandoned side heap's blocks are
// never freed.
unsafe impl std::alloc::GlobalAlloc for ZmemHeap {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        match main_heap() {
            // SAFETY: GlobalAlloc's contract: a non-zero size, a power-of-two alignment.
            Some(mut g) => unsafe { g.malloc(l.size(), l.align()) },
            // SAFETY: as above.
            None => SIDE.with(|d| unsafe { d.malloc(l.size(), l.align()) }),
        }
    }

    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        match main_heap() {
            // SAFETY: as alloc.
            Some(mut g) => unsafe { g.calloc(l.size(), l.align()) },
            // SAFETY: as alloc.
            None => SIDE.with(|d| unsafe { d.calloc(l.size(), l.align()) }),
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, _: std::alloc::Layout) {
        // SAFETY: p came from alloc, freed once.
        unsafe { free(p.cast()) }
    }

    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        match owner(p.cast()) {
            // SAFETY: p came from alloc with layout l; new is non-zero.
            Owner::Side => return SIDE.with(|d| unsafe { d.realloc(p, l.size(), l.align(), new) }),
            // SAFETY: as above.
            Owner::Main => {
                if let Some(mut g) = main_heap() {
                    // SAFETY: as above.
                    return unsafe { g.realloc(p, l.size(), l.align(), new) };
                }
            }
            _ => {}
        }
        // A main-heap block grown on a side-heap thread or during a fork,
        // or an abandoned one: moved to the side heap, so that nothing
        // waits for the main lock.
        let Ok(layout) = std::alloc::Layout::from_size_align(new, l.align()) else { return std::ptr::null_mut() };
        // SAFETY: new is non-zero (GlobalAlloc's contract).
        let q = unsafe { self.alloc(layout) };
        if !q.is_null() {
            // SAFETY: p has l.size() bytes, q has new; distinct blocks.
            unsafe { std::ptr::copy_nonoverlapping(p, q, l.size().min(new)) };
            // SAFETY: p came from alloc with layout l, freed once.
            unsafe { self.dealloc(p, l) };
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// While a fork holds the main heap, another thread allocates, grows a
    /// main-heap block and frees it without waiting: it allocates from the
    /// side heap, and the free waits on `DEFERRED` for the lock's next
    /// holder. (It waited for the fork, and the fork, with
    /// `UFFD_FEATURE_EVENT_FORK`, for a handler that waited for a lock it
    /// held.)
    #[test]
    fn while_a_fork_holds_the_main_heap_no_thread_waits_for_it() {
        let main_block: Vec<u64> = (0..64).collect();
        assert_eq!(owner(main_block.as_ptr().cast()), Owner::Main);
        fork_lock();
        // This thread's own allocations go to the side heap too (the
        // spawn's, the channel's).
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let fresh = vec![7u8; 1000];
            let mut grown = main_block;
            grown.extend(64..4096);
            let r = (owner(fresh.as_ptr().cast()), owner(grown.as_ptr().cast()), grown.iter().copied().eq(0..4096));
            let _ = tx.send(r);
        });
        let got = rx.recv_timeout(Duration::from_secs(10));
        let deferred = !DEFERRED.load(Ordering::Acquire).is_null();
        fork_unlock();
        assert_eq!(got, Ok((Owner::Side, Owner::Side, true)), "the other thread waited for the fork's lock");
        assert!(deferred, "the main-heap block's free was left for the lock's next holder");
        t.join().unwrap();
    }
}
