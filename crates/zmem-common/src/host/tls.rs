//! zmem's threads keep their thread vector resident.
//!
//! Every thread-local access of code in a shared object (the shim's, the
//! Rust standard library's inside it) goes through glibc's
//! `__tls_get_addr`, which reads the thread's vector of TLS blocks (the
//! DTV). glibc allocates that vector with `malloc`, and the loader looks
//! `malloc` up in the executable first, before any preload: in a program
//! whose executable defines the malloc family (rustc links jemalloc in; so
//! do many programs with a static allocator) the DTV of every zmem thread
//! sits in the program's heap, which zmem adopts. Evicted, it hung the
//! program: the handler faulted on its own DTV (nobody left to serve it),
//! or reclaim faulted on a DTV in the folio it was evicting (a fault there
//! waits for that eviction to end). `cargo build` under `zmem run` hung in
//! its first rustc; `tests/data/own_malloc.c` hangs the same way.
//!
//! So each zmem thread's DTV is *pinned*: its pages go in a list that the
//! pager's reclaim consults, and a folio holding a pinned page is never
//! evicted ([`pinned`]). The spawner pins it as the thread starts
//! ([`super::thread::spawn`]), and the thread pins it again wherever glibc
//! may have moved it (a DTV grows, by a new `malloc`, when a `dlopen` adds
//! TLS modules past its room) before it blocks ([`keep_resident`]). A
//! vector left behind stays pinned (a few pages at most). `mlock` was the
//! first way: it splits the program's mapping around the page, and a COPY
//! of a folio across the split failed (ENOENT), which the pager reads as
//! an unmapped range: 4,095 words of `own_malloc.c` read wrong in CI.
//!
//! The layout read here is glibc's on x86-64: the thread pointer's second
//! word (`tcbhead_t.dtv`) points one 16-byte entry into the allocation,
//! whose first entry holds the vector's length. Elsewhere this is a no-op.

/// Pinned byte ranges `[start, end)`: zmem's threads' TLS vectors.
static PINS: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

fn pin(start: usize, end: usize) {
    let mut pins = crate::LockExt::lock_ok(&PINS);
    if !pins.iter().any(|&(s, e)| s <= start && end <= e) {
        pins.push((start, end));
    }
}

/// The list's lock, for a forking thread to hold across fork
/// (`crate::owned::fork_lock`).
pub(crate) fn fork_lock() -> std::sync::MutexGuard<'static, Vec<(usize, usize)>> {
    crate::LockExt::lock_ok(&PINS)
}

/// Whether any of `[start, start + len)` holds a pinned page: reclaim must
/// leave a folio that does resident.
pub fn pinned(start: u64, len: usize) -> bool {
    let (s, e) = (start as usize, start as usize + len);
    crate::LockExt::lock_ok(&PINS).iter().any(|&(ps, pe)| ps < e && s < pe)
}

#[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
mod imp {
    use std::cell::Cell;

    thread_local! {
        /// The DTV this thread pinned last (a `Copy` type: no destructor
        /// to register, see `zmem-tier/src/buffers.rs`).
        static PINNED: Cell<usize> = const { Cell::new(0) };
    }

    /// The calling thread's DTV, as `tcbhead_t.dtv` holds it.
    pub(crate) fn own_dtv() -> usize {
        let dtv: usize;
        // SAFETY: on x86-64 glibc, %fs points at the thread's TCB, whose
        // second word is the DTV pointer; reading it changes nothing.
        unsafe {
            std::arch::asm!("mov {}, qword ptr fs:[8]", out(reg) dtv, options(nostack, readonly, preserves_flags))
        };
        dtv
    }

    /// The DTV of the thread whose `pthread_t` is `t` (on x86-64 glibc, the
    /// address of its TCB).
    pub(crate) fn dtv_of(t: libc::pthread_t) -> usize {
        let second = (t as *const usize).wrapping_add(1);
        // SAFETY: `t` is a live thread's pthread_t, the address of its
        // `struct pthread`, which starts with `tcbhead_t` { tcb, dtv, … }:
        // its second word is readable for as long as the thread exists.
        unsafe { *second }
    }

    /// Pins the pages of the DTV that `dtv` (a `tcbhead_t.dtv` value)
    /// points into. Whether it did.
    pub(crate) fn pin_dtv(dtv: usize) -> bool {
        if dtv < 4096 || dtv % 8 != 0 {
            return false;
        }
        // SAFETY: `dtv` points one 16-byte entry into glibc's allocation
        // (INSTALL_DTV stores `&dtv[1]`); the entry before it is part of
        // the same allocation and holds the vector's length in its first
        // word, which glibc wrote when it allocated it.
        let len = unsafe { *((dtv - 16) as *const usize) };
        if len == 0 || len > 1 << 16 {
            return false;
        }
        let page = 4096;
        super::pin((dtv - 16) / page * page, (dtv + 16 * (len + 1)).div_ceil(page) * page);
        true
    }

    pub fn keep_resident() {
        let dtv = own_dtv();
        if PINNED.with(Cell::get) != dtv && pin_dtv(dtv) {
            PINNED.with(|c| c.set(dtv));
        }
    }
}

/// Pins the calling thread's DTV if it moved since this thread last
/// pinned it. zmem's threads call it before they block, so that a DTV
/// glibc grew (reallocated) meanwhile is locked before anything can evict it.
pub fn keep_resident() {
    #[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
    imp::keep_resident();
}

/// Pins the DTV of the thread `t` as it starts (called by its spawner).
pub(crate) fn pin_thread(t: libc::pthread_t) {
    #[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
    imp::pin_dtv(imp::dtv_of(t));
    #[cfg(not(all(target_arch = "x86_64", target_env = "gnu")))]
    let _ = t;
}

#[cfg(all(test, target_arch = "x86_64", target_env = "gnu"))]
mod tests {
    use super::*;

    /// A thread's DTV, read from its own TCB and through its pthread_t, is
    /// one pointer; `keep_resident` pins the pages that hold it, and a
    /// thread from `thread::spawn` starts with them pinned.
    #[test]
    fn a_threads_dtv_is_found_both_ways_and_pinned() {
        let (mine, via) = std::thread::spawn(|| {
            // SAFETY: pthread_self has no preconditions.
            let me = unsafe { libc::pthread_self() };
            keep_resident();
            (imp::own_dtv(), imp::dtv_of(me))
        })
        .join()
        .unwrap();
        assert_ne!(mine, 0);
        assert_eq!(mine, via);
        assert!(pinned(mine as u64, 16), "its DTV is pinned");
        assert!(!pinned(8 << 20, 4096), "a page of nobody's is not");
        let t = crate::host::thread::spawn(std::thread::Builder::new(), || {
            let d = imp::own_dtv();
            (d, pinned(d as u64 - 16, 32))
        })
        .unwrap();
        assert!(t.join().unwrap().1, "a spawned zmem thread's DTV is pinned");
    }
}
