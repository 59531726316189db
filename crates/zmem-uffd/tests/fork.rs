//! fork with `fork_event`, in a process of its own: with
//! `UFFD_FEATURE_EVENT_FORK`, every fork of the process waits until the
//! pager's handler reads its FORK event, and a test binary's other tests
//! fork too (while glibc holds every malloc lock, which a handler allocating
//! from glibc's heap would wait for: the shim gives its handler a heap of
//! its own). So this file's one test runs alone.

use std::time::Duration;

mod common;
#[path = "common/pages.rs"]
mod pages;

use common::watchdog;
use pages::{check_page, write_page};
use zmem_common::PAGE_SIZE;
use zmem_uffd::{Pager, PagerConfig};

/// Pages of the second region's last folio left mapped.
const TAIL: usize = 6;

/// fork with `fork_event`: nothing is loaded back. The child's faults
/// before it asks are served by the parent; then it takes its evicted pages
/// over (imported, not expanded), manages them under its own pager, and
/// the two diverge. A child that never asks gets its memory copied in whole
/// when the parent stops waiting. Every page is checked on both sides.
#[test]
fn a_forked_child_takes_its_evicted_pages_over_and_nothing_is_loaded_back() {
    let _wd = watchdog("fork-event", 120);
    let mut cfg = PagerConfig::with_limit(4 << 20);
    cfg.keep_on_fork = true;
    cfg.fork_event = true;
    cfg.fault_around = 4 << 10;
    let p = Pager::new(cfg.clone()).unwrap();
    let r = p.map(16 << 20).unwrap();
    let pages = r.len() / PAGE_SIZE;
    // A second region whose end the program unmapped mid-folio: its last
    // folio keeps TAIL pages, which the child's region (whole folios)
    // cannot take. They went nowhere, and read as zeros in the child.
    let r2 = p.map(1 << 20).unwrap();
    let pages2 = r2.len() / PAGE_SIZE - (64 << 10) / PAGE_SIZE + TAIL;
    let gone = r2.addr() as usize + pages2 * PAGE_SIZE;
    // SAFETY: the end of our own region, reached only through atomics (and
    // never past `pages2`) from here on.
    unsafe { rustix::mm::munmap(gone as *mut _, r2.len() - pages2 * PAGE_SIZE) }.unwrap();
    for pg in 0..pages2 {
        write_page(&r2, pg, 4);
    }
    for pg in 0..pages {
        write_page(&r, pg, 1);
    }
    p.reclaim_now();
    assert!(!r2.is_resident((pages2 - 1) * PAGE_SIZE), "the tail's folio was evicted: {:?}", p.stats());
    // A page here and there: folios loaded in part, the rest of each still
    // in the tier at the fork.
    for pg in (0..pages).step_by(16 * 7).map(|pg| pg + 5) {
        assert_eq!(check_page(&r, pg, 1), 0, "page {pg}");
    }
    let before = p.stats();
    assert!(before.swapped_bytes > 0 && p.tier().pool_total_size() > 0, "{before:?}");
    for ask in [true, false] {
        p.fork_prepare();
        // SAFETY: the child reads and writes the region through atomics,
        // starts a pager of its own, and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // Before it asks, a few evicted pages: the parent serves them.
            let mut bad = 0;
            for pg in (0..pages).step_by(61) {
                bad += check_page(&r, pg, 1);
            }
            let code = if ask {
                let link = p.fork_link_in_child().expect("a link");
                // SAFETY: the parent's pager is never used again here.
                unsafe { p.abandon_in_child() };
                match Pager::from_parent(cfg.clone(), link) {
                    Ok(c) => {
                        for pg in 0..pages2 {
                            bad += check_page(&r2, pg, 4);
                        }
                        for pg in 0..pages {
                            bad += check_page(&r, pg, 1);
                            write_page(&r, pg, 7);
                        }
                        c.reclaim_now();
                        for pg in 0..pages {
                            bad += check_page(&r, pg, 7);
                        }
                        let s = c.stats();
                        if bad != 0 {
                            1
                        } else if s.fork_imported_pages == 0 || s.evicted_folios == 0 || s.usage_bytes > 5 << 20 {
                            3
                        } else {
                            0
                        }
                    }
                    Err(_) => 2,
                }
            } else {
                // Never asks: the parent copies the rest in after its wait.
                std::thread::sleep(Duration::from_millis(2500));
                for pg in 0..pages2 {
                    bad += check_page(&r2, pg, 4);
                }
                for pg in 0..pages {
                    bad += check_page(&r, pg, 1);
                }
                i32::from(bad != 0)
            };
            // SAFETY: leaves the child at once, running nothing of the parent's.
            unsafe { libc::_exit(code) };
        }
        p.fork_parent();
        for pg in (0..pages).step_by(3) {
            write_page(&r, pg, 2);
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child (asks: {ask}): {status:#x}");
        for pg in 0..pages {
            assert_eq!(check_page(&r, pg, if pg % 3 == 0 { 2 } else { 1 }), 0, "page {pg}");
            write_page(&r, pg, 1);
        }
        p.reclaim_now();
    }
    let s = p.stats();
    assert_eq!(s.fork_loads, 0, "nothing loaded back: {s:?}");
    assert_eq!(s.fork_handovers, 1, "{s:?}");
    assert!(s.fork_child_faults > 0, "{s:?}");
}
