//! Descriptors zmem keeps open for as long as a pager lives: its
//! userfaultfd, its swap file, and its `/proc/self/pagemap` and `statm`
//! readers.
//!
//! A program that closes every descriptor it did not open (a daemon's
//! `closefrom(3)`, Python's `os.closerange`) would close them under the
//! pager. The kernel would then drop the userfaultfd's registrations
//! (evicted pages would read as zeros), and the numbers would go to the
//! program's next files, which zmem would then read and write. Python
//! crashed at once (SIGSEGV) after `os.closerange(3, 4096)`. So the shim's
//! `close`, `close_range` and `closefrom` step over the descriptors kept
//! here, as if the program had never had them.
//!
//! A fixed table of atomics: `close` looks here on every call, from any
//! thread, before the shim has started too.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};

/// Descriptors kept at once: a pager keeps about five.
pub const SLOTS: usize = 64;

static KEPT: [AtomicI32; SLOTS] = [const { AtomicI32::new(-1) }; SLOTS];

/// Keeps `fd` from the program's `close` family until [`forget`].
pub fn keep(fd: RawFd) {
    if fd < 0 {
        return;
    }
    if KEPT.iter().any(|s| s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed).is_ok()) {
        return;
    }
    log::warn!("more than {SLOTS} descriptors kept: descriptor {fd} is not protected from the program's close");
}

/// Descriptors kept for the process's whole life, pager or not: the
/// process tree's segment, inherited from `zmem run`. A forked child that
/// abandons its parent's pager ([`take_all`]) keeps these.
static FOR_GOOD: [AtomicI32; 4] = [const { AtomicI32::new(-1) }; 4];

/// Keeps `fd` from the program's `close` family for good (see
/// [`FOR_GOOD`]); a no-op if it is kept already.
pub fn keep_for_good(fd: RawFd) {
    if fd < 0 || is_kept(fd) {
        return;
    }
    if !FOR_GOOD.iter().any(|s| s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed).is_ok()) {
        log::warn!("descriptor {fd} is not protected from the program's close");
    }
}

/// Lets the program's `close` family reach `fd` again (zmem is about to
/// close it itself).
pub fn forget(fd: RawFd) {
    for s in &KEPT {
        if s.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            return;
        }
    }
}

/// Whether `fd` is one zmem keeps.
pub fn is_kept(fd: RawFd) -> bool {
    fd >= 0 && KEPT.iter().chain(&FOR_GOOD).any(|s| s.load(Ordering::Acquire) == fd)
}

/// The kept descriptors, sorted, in `out`; returns how many.
pub fn kept(out: &mut [RawFd; SLOTS]) -> usize {
    let mut n = 0;
    for s in KEPT.iter().chain(&FOR_GOOD) {
        let fd = s.load(Ordering::Acquire);
        if fd >= 0 && n < out.len() {
            out[n] = fd;
            n += 1;
        }
    }
    out[..n].sort_unstable();
    n
}

/// Empties the table (not the descriptors kept for good) into `out` and
/// returns how many there were: in a
/// forked child, the parent's pager's descriptors, which the child closes
/// as it abandons that pager (the program's own files may get those
/// numbers next, and must be its to close).
pub fn take_all(out: &mut [RawFd; SLOTS]) -> usize {
    let mut n = 0;
    for s in &KEPT {
        let fd = s.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            out[n] = fd;
            n += 1;
        }
    }
    n
}

/// An [`OwnedFd`] kept ([`keep`]) for as long as it lives.
#[derive(Debug)]
pub struct KeptFd(OwnedFd);

impl KeptFd {
    pub fn new(fd: OwnedFd) -> KeptFd {
        keep(fd.as_raw_fd());
        KeptFd(fd)
    }
}

impl Drop for KeptFd {
    fn drop(&mut self) {
        // Before the field's own drop closes it.
        forget(self.0.as_raw_fd());
    }
}

impl std::ops::Deref for KeptFd {
    type Target = OwnedFd;
    fn deref(&self) -> &OwnedFd {
        &self.0
    }
}

impl AsFd for KeptFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl AsRawFd for KeptFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table is the process's: `take_all` in one test empties what
    /// another test kept (12 runs in 40 failed with the tests in parallel).
    static TABLE: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn table() -> std::sync::MutexGuard<'static, ()> {
        TABLE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    #[test]
    fn a_kept_descriptor_is_listed_until_it_is_dropped() {
        let _t = table();
        let fd: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let raw = fd.as_raw_fd();
        assert!(!is_kept(raw));
        let k = KeptFd::new(fd);
        assert!(is_kept(raw));
        let mut out = [0; SLOTS];
        let n = kept(&mut out);
        assert!(out[..n].contains(&raw));
        drop(k);
        assert!(!is_kept(raw));
    }

    #[test]
    fn a_descriptor_kept_for_good_outlives_take_all() {
        let _t = table();
        let fd: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let raw = fd.as_raw_fd();
        keep_for_good(raw);
        let mut out = [0; SLOTS];
        let n = take_all(&mut out);
        assert!(!out[..n].contains(&raw));
        assert!(is_kept(raw));
        let n = kept(&mut out);
        assert!(out[..n].contains(&raw));
        for s in &FOR_GOOD {
            let _ = s.compare_exchange(raw, -1, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
}
