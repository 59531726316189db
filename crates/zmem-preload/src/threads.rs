//! Thread stacks: recorded as they are made, so that the mapping scan
//! never adopts a zmem thread's stack (a handler that faulted on its own
//! stack would wait for itself), nor the program's unless `ZMEM_STACKS=1`.
//!
//! `pthread_create` runs the new thread through a trampoline that records
//! its stack (`pthread_getattr_np` on itself) before the program's start
//! routine, and records it as cached when the thread exits (glibc keeps it
//! for its next thread: `Kind::CachedStack`). The creating thread holds
//! `owned::spawn_lock` from before the stack exists until it is recorded,
//! so a scan, which holds `owned::scan_lock`, never sees it unrecorded.
//! zmem's own threads are made by zmem code (the reentrancy flag is set),
//! and their stacks are recorded as zmem's.
//!
//! The record of a thread's exit is a pthread key's value, not a Rust
//! thread-local with a destructor: registering one takes the dynamic
//! loader's lock (`__cxa_thread_atexit_impl`). A library constructor that
//! starts a thread (OpenBLAS's pool, on `import numpy`) holds that lock
//! while its `pthread_create`, ours, waits for the new thread's record:
//! the two waited for each other for good.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use zmem_common::host::owned::{self, Kind};

use crate::guard::in_zmem;

type Start = extern "C" fn(*mut c_void) -> *mut c_void;
type Create = unsafe extern "C" fn(*mut libc::pthread_t, *const libc::pthread_attr_t, Start, *mut c_void) -> c_int;

struct Trampoline {
    start: Start,
    arg: *mut c_void,
    kind: Kind,
    /// On the creator's stack, which it leaves only once this is set.
    recorded: *const AtomicBool,
    /// The creator's signal mask as the program called: the thread's own
    /// from its first line of the program's. It is made inside the shim,
    /// which blocks the asynchronous signals (`guard::guarded`), and would
    /// otherwise keep them blocked for good (memcached's workers never saw
    /// the SIGINT of its `shutdown`).
    mask: libc::sigset_t,
}

/// Records the thread's stack as cached when the thread exits (the value
/// of a pthread key, whose destructor runs on pthread_exit too). It is not forgotten: glibc
/// keeps the stack mapped for its next thread, and a scan that adopted it
/// meanwhile would hand a managed stack to that thread, which may be
/// zmem's (a forked child's new pager starts its threads on the stacks
/// its parent's threads left). The thread still runs on it here, too.
///
/// With `ZMEM_STACKS=1` a program thread's stack may be managed already:
/// it is given back first (`Pager::release`), for the same reason.
struct StackRecord {
    addr: u64,
    len: usize,
    kind: Kind,
}

impl Drop for StackRecord {
    fn drop(&mut self) {
        let (addr, len) = (self.addr, self.len);
        // Inside the shim: what this allocates comes from zmem's heap.
        crate::guard::guarded(|| {
            owned::add(addr, len, Kind::CachedStack);
            if self.kind == Kind::Stack {
                if let Some(s) = crate::state::current().filter(|s| s.settings.stacks) {
                    s.pager.release(addr, len);
                }
            }
        });
    }
}

/// The key whose value is the calling thread's `Box<StackRecord>`, dropped
/// by [`drop_record`] when the thread exits; `None` if no key was left.
fn stack_key() -> Option<libc::pthread_key_t> {
    static KEY: OnceLock<Option<libc::pthread_key_t>> = OnceLock::new();
    *KEY.get_or_init(|| {
        let mut k: libc::pthread_key_t = 0;
        // SAFETY: k is a writable key; drop_record is what the key's values
        // need at thread exit (see there).
        let r = unsafe { libc::pthread_key_create(&mut k, Some(drop_record)) };
        (r == 0).then_some(k)
    })
}

/// A thread's exit: its record's value, set by `record_own_stack`.
unsafe extern "C" fn drop_record(p: *mut c_void) {
    // SAFETY: every non-null value of the key is a Box<StackRecord> that
    // record_own_stack leaked for this thread, and glibc hands each value to
    // this destructor once (it clears the value before the call).
    drop(unsafe { Box::from_raw(p.cast::<StackRecord>()) });
}

/// The calling thread's stack: (lowest address, bytes).
fn own_stack() -> Option<(u64, usize)> {
    // SAFETY: pthread_attr_t is plain data; all zeros is what
    // pthread_getattr_np expects to fill in.
    let mut a: libc::pthread_attr_t = unsafe { std::mem::zeroed() };
    // SAFETY: pthread_self has no preconditions.
    let me = unsafe { libc::pthread_self() };
    // SAFETY: a is a writable attr; me is the calling thread.
    if unsafe { libc::pthread_getattr_np(me, &mut a) } != 0 {
        return None;
    }
    let (mut addr, mut size) = (std::ptr::null_mut(), 0usize);
    // SAFETY: a was filled in above; the out pointers are live locals.
    let r = unsafe { libc::pthread_attr_getstack(&a, &mut addr, &mut size) };
    // SAFETY: a was initialised by pthread_getattr_np, destroyed once.
    unsafe { libc::pthread_attr_destroy(&mut a) };
    (r == 0).then_some((addr as u64, size))
}

/// Records the calling thread's stack as `kind`, until it exits.
pub(crate) fn record_own_stack(kind: Kind) {
    if let Some((addr, size)) = own_stack() {
        owned::add(addr, size, kind);
        let Some(key) = stack_key() else { return };
        let rec = Box::into_raw(Box::new(StackRecord { addr, len: size, kind }));
        // SAFETY: key is a live key; the value is the box drop_record takes
        // back. A thread records its stack once (its trampoline), so no
        // earlier value is overwritten.
        if unsafe { libc::pthread_setspecific(key, rec.cast()) } != 0 {
            // SAFETY: not stored, so still ours alone.
            drop(unsafe { Box::from_raw(rec) });
        }
    }
}

extern "C" fn trampoline(t: *mut c_void) -> *mut c_void {
    // SAFETY: t is the Trampoline box pthread_create below made for this
    // thread and gave up to it.
    let t = unsafe { Box::from_raw(t.cast::<Trampoline>()) };
    // Inside the shim: what recording allocates (its TLS slot's destructor
    // entry among it) comes from zmem's heap, never from the program's
    // allocator, which may mmap, and a managed mmap waits for any scan,
    // which waits for our creator, which waits for us.
    crate::guard::guarded(|| record_own_stack(t.kind));
    // SAFETY: the flag lives on the creator's stack until the creator sees
    // it set; it is not touched after this store.
    unsafe { (*t.recorded).store(true, Ordering::Release) };
    zmem_common::host::thread::set_signal_mask(&t.mask);
    (t.start)(t.arg)
}

fn real_create() -> Option<Create> {
    static REAL: OnceLock<Option<usize>> = OnceLock::new();
    let f = REAL.get_or_init(|| {
        // SAFETY: a symbol lookup by a NUL-terminated name.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, c"pthread_create".as_ptr()) };
        (!p.is_null()).then_some(p as usize)
    });
    // SAFETY: the next pthread_create has this signature.
    f.map(|p| unsafe { std::mem::transmute::<usize, Create>(p) })
}

#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    start: Start,
    arg: *mut c_void,
) -> c_int {
    let Some(real) = real_create() else { return libc::EAGAIN };
    // A new thread inherits its creator's mask: not the one CPU a handler
    // may hold this thread on (`zmem_uffd::unhold_current_thread`).
    if !in_zmem() {
        zmem_uffd::unhold_current_thread();
    }
    let kind = if in_zmem() || crate::next::zmem_thread() { Kind::Zmem } else { Kind::Stack };
    let recorded = AtomicBool::new(false);
    let mask = zmem_common::host::thread::signal_mask();
    let t = Box::into_raw(Box::new(Trampoline { start, arg, kind, recorded: &recorded, mask }));
    let _spawning = owned::spawn_lock();
    // Inside the shim: what glibc allocates for the thread (its DTV) comes
    // from zmem's heap, and nothing it maps is managed, so this thread,
    // which holds the spawn lock, never asks for it again (a scan queued
    // meanwhile would make that wait for good).
    let r = crate::guard::guarded(|| {
        // SAFETY: the caller's arguments, with our trampoline and its box
        // as the start routine and argument.
        unsafe { real(thread, attr, trampoline, t.cast()) }
    })
    .unwrap_or(libc::EAGAIN);
    if r != 0 {
        // SAFETY: the thread was not made, so the box is still ours alone.
        drop(unsafe { Box::from_raw(t) });
        return r;
    }
    // The new thread records its stack first thing; `recorded` must
    // outlive its store.
    while !recorded.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
    0
}
