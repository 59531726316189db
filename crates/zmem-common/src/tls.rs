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
//! So each zmem thread's DTV is `mlock`ed: the spawner locks it as the
//! thread starts ([`crate::thread::spawn`]), and the thread locks it again
//! wherever glibc may have moved it (a DTV grows, by a new `malloc`, when
//! a `dlopen` adds TLS modules past its room) before it blocks
//! ([`keep_resident`]). The pager never moves an mlocked page, as the
//! kernel refuses to MOVE between locked and unlocked mappings: its folio
//! stays resident. A vector left behind stays locked (a few pages at most).
//!
//! The layout read here is glibc's on x86-64: the thread pointer's second
//! word (`tcbhead_t.dtv`) points one 16-byte entry into the allocation,
//! whose first entry holds the vector's length. Elsewhere this is a no-op.

#[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
mod imp {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, Ordering};

    thread_local! {
        /// The DTV this thread locked last (a `Copy` type: no destructor
        /// to register, see `zmem-tier/src/buffers.rs`).
        static LOCKED: Cell<usize> = const { Cell::new(0) };
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

    /// Locks the pages of the DTV that `dtv` (a `tcbhead_t.dtv` value)
    /// points into. Whether it did.
    pub(crate) fn lock(dtv: usize) -> bool {
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
        let start = (dtv - 16) / page * page;
        let end = (dtv + 16 * (len + 1)).div_ceil(page) * page;
        // SAFETY: mlock only changes the locking of the pages, which are
        // mapped (they hold the live vector).
        let ok = unsafe { libc::mlock(start as *const libc::c_void, end - start) } == 0;
        static WARNED: AtomicBool = AtomicBool::new(false);
        if !ok && !WARNED.swap(true, Ordering::Relaxed) {
            log::warn!(
                "mlock of a zmem thread's TLS vector failed ({}): in a program with its own malloc, \
                 an eviction may hang it (RLIMIT_MEMLOCK?)",
                std::io::Error::last_os_error()
            );
        }
        ok
    }

    pub fn keep_resident() {
        let dtv = own_dtv();
        if LOCKED.with(Cell::get) != dtv && lock(dtv) {
            LOCKED.with(|c| c.set(dtv));
        }
    }
}

/// Locks the calling thread's DTV in memory if it moved since this thread
/// last locked it. zmem's threads call it before they block, so that a DTV
/// glibc grew (reallocated) meanwhile is locked before anything can evict it.
pub fn keep_resident() {
    #[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
    imp::keep_resident();
}

/// Locks the DTV of the thread `t` as it starts (called by its spawner).
pub(crate) fn lock_thread(t: libc::pthread_t) {
    #[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
    imp::lock(imp::dtv_of(t));
    #[cfg(not(all(target_arch = "x86_64", target_env = "gnu")))]
    let _ = t;
}

#[cfg(all(test, target_arch = "x86_64", target_env = "gnu"))]
mod tests {
    use super::*;

    /// The `Locked:` kB of the mapping of ours that holds `addr`.
    fn locked_kib_at(addr: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for l in smaps.lines() {
            let head = l.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = head.split_once('-').filter(|_| !head.ends_with(':')) {
                let (a, b) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16));
                inside = matches!((a, b), (Ok(a), Ok(b)) if (a..b).contains(&addr));
            } else if inside && l.starts_with("Locked:") {
                return l.split_whitespace().nth(1).unwrap().parse().unwrap();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    /// A thread's DTV, read from its own TCB and through its pthread_t, is
    /// one pointer; `keep_resident` locks the pages that hold it, and a
    /// thread from `thread::spawn` starts with them locked.
    #[test]
    fn a_threads_dtv_is_found_both_ways_and_locked() {
        let (mine, via, locked) = std::thread::spawn(|| {
            // SAFETY: pthread_self has no preconditions.
            let me = unsafe { libc::pthread_self() };
            keep_resident();
            (imp::own_dtv(), imp::dtv_of(me), locked_kib_at(imp::own_dtv()))
        })
        .join()
        .unwrap();
        assert_ne!(mine, 0);
        assert_eq!(mine, via);
        assert!(locked >= 4, "{locked} kB locked where the DTV is");
        let t = crate::thread::spawn(std::thread::Builder::new(), || locked_kib_at(imp::own_dtv())).unwrap();
        assert!(t.join().unwrap() >= 4, "a spawned zmem thread's DTV is locked");
    }
}
