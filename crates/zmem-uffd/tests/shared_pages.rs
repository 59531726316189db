//! `PageMap::shared_pages` after a real fork, in a process of its own: a
//! fork makes every anonymous page of the process shared with the child
//! for a moment, and UFFDIO_MOVE refuses shared pages (EBUSY), so another
//! test's MOVE in the same binary would fail (it hung `tests/uffd.rs` once
//! in ten runs).

use std::sync::atomic::Ordering;

mod common;

use common::watchdog;
use zmem_common::PAGE_SIZE;
use zmem_uffd::{Mapping, PageMap};

/// `PageMap::shared_pages` counts the pages a fork left shared, page by
/// page: those the parent wrote since are its own again, the shared zero
/// page counts in neither figure, and once the child is gone nothing is
/// shared.
#[test]
fn shared_pages_counts_what_a_fork_left_shared_page_by_page() {
    let _wd = watchdog("shared_pages_counts_what_a_fork_left_shared_page_by_page", 60);
    let m = Mapping::new(16 * PAGE_SIZE).unwrap();
    let w = m.words();
    let at = |p: usize| &w[p * PAGE_SIZE / 8];
    for p in 0..14 {
        at(p).store(p as u64 + 1, Ordering::Relaxed);
    }
    // Pages 14 and 15 are read only: the shared zero page.
    assert_eq!(at(14).load(Ordering::Relaxed) + at(15).load(Ordering::Relaxed), 0);
    let pm = PageMap::open().unwrap();
    let alone = pm.shared_pages(m.addr(), 16).unwrap();
    assert_eq!((alone.shared, alone.present), (0, 14), "before the fork");
    let (rd, wr) = std::io::pipe().unwrap();
    // SAFETY: the child only blocks in read(2) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // Its copy of the writing end goes first, or the read never ends.
        drop(wr);
        let mut b = [0u8; 1];
        let _ = std::io::Read::read(&mut &rd, &mut b);
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(0) };
    }
    drop(rd);
    let all = pm.shared_pages(m.addr(), 16).unwrap();
    // The parent writes 10 of them: copies of its own.
    for p in 0..10 {
        at(p).store(100 + p as u64, Ordering::Relaxed);
    }
    let some = pm.shared_pages(m.addr(), 16).unwrap();
    let half = pm.shared_pages(m.addr() + 8 * PAGE_SIZE as u64, 8).unwrap();
    drop(wr);
    let mut status = 0;
    // SAFETY: pid is our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    let after = pm.shared_pages(m.addr(), 16).unwrap();
    assert_eq!((all.shared, all.present), (14, 14), "right after the fork");
    assert_eq!((some.shared, some.present), (4, 14), "after the parent wrote pages 0..10");
    assert_eq!((half.shared, half.present), (4, 6), "pages 8..16");
    assert_eq!((after.shared, after.present), (0, 14), "the child is gone");
}
