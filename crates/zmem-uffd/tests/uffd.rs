//! The userfaultfd layer on real userfaultfds, real threads and real faults.

use std::sync::atomic::Ordering;
use std::time::Duration;

mod common;

use common::watchdog;
use zmem_common::PAGE_SIZE;
use zmem_uffd::{Event, Features, Mapping, OpenMode, PageMap, RegisterMode, Uffd};

const MISSING: RegisterMode = RegisterMode { missing: true, wp: false };

fn uffd(f: Features) -> Uffd {
    Uffd::open(OpenMode::Auto, f).expect("userfaultfd (this machine allows it)")
}

/// Waits for and returns the next event.
fn next_event(u: &Uffd) -> Event {
    assert!(u.wait(Some(Duration::from_secs(10))).unwrap(), "no userfaultfd event within 10 s");
    let mut ev = u.read_events(1).unwrap();
    assert_eq!(ev.len(), 1);
    ev.pop().unwrap()
}

fn page_of(v: u64) -> Vec<u8> {
    zmem_compress::corpus::filled_page(v)
}

#[test]
fn the_kernel_offers_what_zmem_needs() {
    let _wd = watchdog("the_kernel_offers_what_zmem_needs", 60);
    let f = Uffd::offered(OpenMode::Auto).unwrap();
    for (name, need) in [
        ("MOVE", Features::MOVE),
        ("EVENT_REMOVE", Features::EVENT_REMOVE),
        ("EVENT_UNMAP", Features::EVENT_UNMAP),
        ("EVENT_REMAP", Features::EVENT_REMAP),
        ("PAGEFAULT_FLAG_WP", Features::PAGEFAULT_FLAG_WP),
    ] {
        assert!(f.contains(need), "the kernel lacks UFFD_FEATURE_{name} (offers {:#x})", f.0);
    }
}

#[test]
fn every_open_mode_works_or_explains_itself() {
    let _wd = watchdog("every_open_mode_works_or_explains_itself", 60);
    for mode in [OpenMode::Syscall, OpenMode::UserModeOnly, OpenMode::DevUserfaultfd] {
        match Uffd::open(mode, Features::default()) {
            Ok(u) => assert_ne!(u.api_ioctls(), 0, "{mode:?}"),
            Err(e) => {
                let msg = e.to_string();
                assert!(mode == OpenMode::DevUserfaultfd, "{mode:?}: {msg}");
                assert!(msg.contains("/dev/userfaultfd"), "{msg}");
            }
        }
    }
    let e = Uffd::open(OpenMode::Auto, Features(1 << 62)).unwrap_err();
    assert!(e.to_string().contains("lacks userfaultfd features"), "{e}");
}

#[test]
fn missing_faults_are_served_by_copy_on_another_thread() {
    let _wd = watchdog("missing_faults_are_served_by_copy_on_another_thread", 60);
    let u = uffd(Features::default());
    let m = Mapping::new(16 * PAGE_SIZE).unwrap();
    u.register(m.addr(), m.len() as u64, MISSING).unwrap();
    std::thread::scope(|s| {
        let handler = s.spawn(|| {
            for _ in 0..16 {
                let Event::PageFault { addr, .. } = next_event(&u) else { panic!("expected a fault") };
                let page = addr & !(PAGE_SIZE as u64 - 1);
                let data = page_of(page);
                // SAFETY: data is a readable page; the destination is in our
                // registered mapping, reached only through atomics.
                let n = unsafe { u.copy(page, data.as_ptr(), PAGE_SIZE as u64, false) }.unwrap();
                assert_eq!(n, PAGE_SIZE as u64);
            }
        });
        let w = m.words();
        for p in 0..16 {
            let at = p * PAGE_SIZE / 8 + 3;
            assert_eq!(w[at].load(Ordering::Relaxed), m.addr() + (p * PAGE_SIZE) as u64, "page {p}");
        }
        handler.join().unwrap();
    });
}

#[test]
fn zeropage_resolves_and_copy_over_a_present_page_is_eexist_resolved() {
    let _wd = watchdog("zeropage_resolves_and_copy_over_a_present_page_is_eexist_resolved", 60);
    let u = uffd(Features::default());
    let m = Mapping::new(4 * PAGE_SIZE).unwrap();
    u.register(m.addr(), m.len() as u64, MISSING).unwrap();
    // SAFETY: the range is our registered mapping, reached only via atomics.
    assert_eq!(unsafe { u.zeropage(m.addr(), 2 * PAGE_SIZE as u64, false) }.unwrap(), 2 * PAGE_SIZE as u64);
    assert_eq!(m.words()[10].load(Ordering::Relaxed), 0);
    let data = page_of(7);
    // SAFETY: as above; data is readable.
    let n = unsafe { u.copy(m.addr(), data.as_ptr(), PAGE_SIZE as u64, false) }.unwrap();
    assert_eq!(n, 0, "the page was already there: EEXIST, reported resolved");
    // A larger copy stops at the first present page, having copied before it.
    let two = [page_of(1), page_of(2)].concat();
    // SAFETY: as above.
    let n = unsafe { u.copy(m.addr() + 2 * PAGE_SIZE as u64, two.as_ptr(), 2 * PAGE_SIZE as u64, false) }.unwrap();
    assert_eq!(n, 2 * PAGE_SIZE as u64);
    assert_eq!(m.words()[3 * PAGE_SIZE / 8].load(Ordering::Relaxed), 2);
}

#[test]
fn move_takes_a_folio_away_atomically_and_brings_it_back_on_fault() {
    let _wd = watchdog("move_takes_a_folio_away_atomically_and_brings_it_back_on_fault", 60);
    let u = uffd(Features::MOVE);
    let region = Mapping::new(16 * PAGE_SIZE).unwrap();
    let staging = Mapping::new(16 * PAGE_SIZE).unwrap();
    u.register(region.addr(), region.len() as u64, MISSING).unwrap();
    u.register(staging.addr(), staging.len() as u64, MISSING).unwrap();
    let folio: Vec<u8> = (0..16u64).flat_map(page_of).collect();
    let len = folio.len() as u64;
    // SAFETY: registered mappings reached only through atomics; folio readable.
    unsafe { u.copy(region.addr(), folio.as_ptr(), len, false) }.unwrap();
    // Leave a hole: the last page is dropped, and MOVE skips it.
    region.dontneed(15 * PAGE_SIZE, PAGE_SIZE).unwrap();
    // SAFETY: as above, both ranges.
    let moved = unsafe { u.move_pages(staging.addr(), region.addr(), len, true) }.unwrap();
    assert_eq!(moved, len, "holes count as moved");
    assert_eq!(staging.words()[5 * PAGE_SIZE / 8].load(Ordering::Relaxed), 5);
    // The page tables say the same: staging holds the 15 pages, the hole
    // stayed a hole, and the region is empty.
    let pm = PageMap::open().unwrap();
    let held = pm.mapped(staging.addr(), 16).unwrap();
    assert_eq!(held, (0..16).map(|p| p < 15).collect::<Vec<_>>());
    assert_eq!(pm.mapped(region.addr(), 16).unwrap(), vec![false; 16]);
    std::thread::scope(|s| {
        let handler = s.spawn(|| {
            let Event::PageFault { addr, .. } = next_event(&u) else { panic!("expected a fault") };
            assert_eq!(addr & !(PAGE_SIZE as u64 - 1), region.addr() + 9 * PAGE_SIZE as u64);
            // Bring the folio's first 15 pages back (the hole stays missing).
            // SAFETY: as above.
            unsafe { u.move_pages(region.addr(), staging.addr(), 15 * PAGE_SIZE as u64, false) }.unwrap();
            u.wake(region.addr(), len).unwrap();
        });
        assert_eq!(region.words()[9 * PAGE_SIZE / 8].load(Ordering::Relaxed), 9);
        handler.join().unwrap();
    });
    for p in 0..15 {
        assert_eq!(region.words()[p * PAGE_SIZE / 8 + 1].load(Ordering::Relaxed), p as u64);
    }
}

#[test]
fn a_write_protected_page_blocks_the_writer_until_unprotected() {
    let _wd = watchdog("a_write_protected_page_blocks_the_writer_until_unprotected", 60);
    let u = uffd(Features::PAGEFAULT_FLAG_WP);
    let m = Mapping::new(2 * PAGE_SIZE).unwrap();
    u.register(m.addr(), m.len() as u64, RegisterMode { missing: true, wp: true }).unwrap();
    let data = page_of(41);
    // SAFETY: registered mapping, atomics only; data readable.
    unsafe { u.copy(m.addr(), data.as_ptr(), PAGE_SIZE as u64, false) }.unwrap();
    u.writeprotect(m.addr(), PAGE_SIZE as u64, true, false).unwrap();
    std::thread::scope(|s| {
        let writer = s.spawn(|| m.words()[2].store(42, Ordering::Relaxed));
        let Event::PageFault { addr, write, wp, .. } = next_event(&u) else { panic!("expected a WP fault") };
        assert!(write && wp && addr & !(PAGE_SIZE as u64 - 1) == m.addr());
        assert_eq!(m.words()[2].load(Ordering::Relaxed), 41, "the write waits");
        u.writeprotect(m.addr(), PAGE_SIZE as u64, false, false).unwrap();
        writer.join().unwrap();
    });
    assert_eq!(m.words()[2].load(Ordering::Relaxed), 42);
}

/// Write tracking as reclaim uses it (`WriteTracker`, UFFD WP_ASYNC): a
/// sweep protects every written page of a range, more runs of them than a
/// scan's list holds, and leaves its holes as they were, so that a write
/// there is still a MISSING fault for the pager; a look finds a range
/// written if any page of it was written since, and not otherwise.
#[test]
fn a_sweep_protects_every_written_page_and_a_look_sees_each_write_after_it() {
    let _wd = watchdog("a_sweep_protects_every_written_page_and_a_look_sees_each_write_after_it", 60);
    let u = uffd(Features::WP_ASYNC);
    let pages = 4096;
    let m = Mapping::new(pages * PAGE_SIZE).unwrap();
    let w = m.words();
    let words = PAGE_SIZE / 8;
    let hole = |pg: usize| pg % 4 == 3;
    // Present before registration, but for the holes: no fault needs
    // serving until a hole is touched.
    for pg in (0..pages).filter(|&pg| !hole(pg)) {
        w[pg * words].store(pg as u64, Ordering::Relaxed);
    }
    u.register(m.addr(), m.len() as u64, RegisterMode { missing: true, wp: true }).unwrap();
    let mut t = zmem_uffd::WriteTracker::open().unwrap();
    let (start, end) = (m.addr(), m.addr() + m.len() as u64);
    let page = |pg: usize| (m.addr() + (pg * PAGE_SIZE) as u64, m.addr() + ((pg + 1) * PAGE_SIZE) as u64);
    // A hole's pagemap entry is all zeros: no uffd-wp marker (bit 57),
    // which would turn reclaim's MOVE over it into a failure.
    let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
    let holes_unmarked = || {
        (0..pages).filter(|&pg| hole(pg) && pg != 3).all(|pg| {
            let mut e = [0u8; 8];
            std::os::unix::fs::FileExt::read_exact_at(&pagemap, &mut e, page(pg).0 / PAGE_SIZE as u64 * 8).unwrap();
            u64::from_ne_bytes(e) == 0
        })
    };
    assert!(t.written(start, end).unwrap(), "never protected: every page reads as written");
    t.protect_written(start, end).unwrap();
    assert!(!t.written(start, end).unwrap(), "the sweep left a page unprotected");
    assert!(holes_unmarked(), "the sweep marked holes");
    // Every other page: 2,048 runs, four times what a 512-entry list holds.
    for pg in (0..pages).step_by(2) {
        w[pg * words + 1].store(1, Ordering::Relaxed);
    }
    for pg in 0..pages {
        let (a, b) = page(pg);
        assert_eq!(t.written(a, b).unwrap(), pg % 2 == 0, "page {pg}");
    }
    // A write into a hole after the sweep reaches the pager as a MISSING
    // fault, and its COPY goes in.
    std::thread::scope(|s| {
        let writer = s.spawn(|| w[3 * words + 2].store(7, Ordering::Relaxed));
        let Event::PageFault { addr, write, wp, .. } = next_event(&u) else { panic!("expected a fault") };
        assert!(write && !wp && addr & !(PAGE_SIZE as u64 - 1) == page(3).0, "{addr:#x} {write} {wp}");
        let data = vec![0u8; PAGE_SIZE];
        // SAFETY: the destination is the registered hole; data is a page.
        unsafe { u.copy(page(3).0, data.as_ptr(), PAGE_SIZE as u64, false) }.unwrap();
        writer.join().unwrap();
    });
    t.protect_written(start, end).unwrap();
    assert!(!t.written(start, end).unwrap(), "the second sweep left a page unprotected");
    assert!(holes_unmarked(), "the second sweep marked holes");
    // The whole range's look finds its one written page, near its end.
    w[(pages - 2) * words + 2].store(1, Ordering::Relaxed);
    assert!(t.written(start, end).unwrap());
    assert!(!t.written(start, page(pages - 3).1).unwrap());
    for pg in (0..pages).filter(|&pg| !hole(pg)) {
        assert_eq!(w[pg * words].load(Ordering::Relaxed), pg as u64, "page {pg}");
        assert_eq!(w[pg * words + 1].load(Ordering::Relaxed), u64::from(pg % 2 == 0), "page {pg}");
    }
    assert_eq!(w[3 * words + 2].load(Ordering::Relaxed), 7);
}

#[test]
fn madvise_munmap_and_mremap_are_reported() {
    let _wd = watchdog("madvise_munmap_and_mremap_are_reported", 60);
    let u = uffd(Features::EVENT_REMOVE | Features::EVENT_UNMAP | Features::EVENT_REMAP);
    let m = Mapping::new(8 * PAGE_SIZE).unwrap();
    u.register(m.addr(), m.len() as u64, MISSING).unwrap();
    let data = vec![1u8; m.len()];
    // SAFETY: registered mapping, atomics only; data readable.
    unsafe { u.copy(m.addr(), data.as_ptr(), m.len() as u64, false) }.unwrap();
    let base = m.addr();
    std::thread::scope(|s| {
        // The kernel holds madvise until the event is read.
        let t = s.spawn(|| m.dontneed(2 * PAGE_SIZE, 2 * PAGE_SIZE).unwrap());
        match next_event(&u) {
            Event::Remove { start, end } => assert_eq!((start, end), (base + 2 * 4096, base + 4 * 4096)),
            e => panic!("expected Remove, got {e:?}"),
        }
        t.join().unwrap();
    });
    // mremap the mapping elsewhere, then unmap it; both wait, as madvise
    // does, until the event is read, so they run on another thread.
    let target = Mapping::new(8 * PAGE_SIZE).unwrap();
    let to = target.addr();
    std::mem::forget(target); // mremap replaces it
    std::mem::forget(m); // its range moves to `to`
    std::thread::scope(|s| {
        let t = s.spawn(move || {
            // SAFETY: moves our own mapping over our own (forgotten) target
            // range; nothing refers into either afterwards but `to`.
            let r = unsafe {
                rustix::mm::mremap_fixed(
                    base as *mut _,
                    8 * PAGE_SIZE,
                    8 * PAGE_SIZE,
                    rustix::mm::MremapFlags::MAYMOVE,
                    to as *mut _,
                )
            };
            assert!(r.is_ok(), "{r:?}");
            // SAFETY: `to` is the mapping we moved there, unreferenced.
            unsafe { rustix::mm::munmap(to as *mut _, 8 * PAGE_SIZE) }.unwrap();
        });
        // The kernel reports the move, then the old range as unmapped (so a
        // pager must re-key entries on Remap before that Unmap arrives),
        // then our munmap of the new range.
        match next_event(&u) {
            Event::Remap { from, to: t, len } => assert_eq!((from, t, len), (base, to, 8 * 4096)),
            e => panic!("expected Remap, got {e:?}"),
        }
        match next_event(&u) {
            Event::Unmap { start, end } => assert_eq!((start, end), (base, base + 8 * 4096)),
            e => panic!("expected the old range's Unmap, got {e:?}"),
        }
        match next_event(&u) {
            Event::Unmap { start, end } => assert_eq!((start, end), (to, to + 8 * 4096)),
            e => panic!("expected Unmap of the new range, got {e:?}"),
        }
        t.join().unwrap();
    });
}

/// Sends `fd` over the unix socket `sock` (SCM_RIGHTS).
fn send_fd(sock: &std::os::fd::OwnedFd, fd: std::os::fd::BorrowedFd<'_>) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut ctl = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    assert!(ctl.push(SendAncillaryMessage::ScmRights(&fds)));
    let n = rustix::net::sendmsg(sock, &[std::io::IoSlice::new(b"u")], &mut ctl, SendFlags::empty()).unwrap();
    assert_eq!(n, 1);
}

/// Receives a descriptor sent by [`send_fd`]. No allocation: it runs in a
/// forked child.
fn recv_fd(sock: &std::os::fd::OwnedFd) -> Option<std::os::fd::OwnedFd> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut ctl = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    let r = rustix::net::recvmsg(sock, &mut [std::io::IoSliceMut::new(&mut byte)], &mut ctl, RecvFlags::CMSG_CLOEXEC);
    if r.ok()?.bytes != 1 {
        return None;
    }
    let fd = ctl.drain().find_map(|m| match m {
        RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
        _ => None,
    });
    fd
}

/// The kernel behaviour that fork without load-back would stand on (see
/// ARCHITECTURE.md, *fork*): with `EVENT_FORK`, a child keeps the parent's
/// registrations under a context of its own, which the parent's
/// userfaultfd hands to the parent, fork waiting until it is read. The
/// parent can serve the child's faults through it (the child touches memory
/// before any code of ours runs in it) and then pass it to the child, which
/// serves its own memory through it from then on.
///
/// The parent's reader must not allocate before it has read the FORK event:
/// glibc's fork holds every malloc arena's lock across the fork syscall,
/// which waits for that read (a first version of this test hung there).
#[test]
fn a_forked_childs_faults_reach_the_parent_which_serves_them_and_hands_the_context_over() {
    let _wd = watchdog("a_forked_childs_faults_reach_the_parent_which_serves_them_and_hands_the_context_over", 60);
    let u = uffd(Features::EVENT_FORK);
    let m = Mapping::new(4 * PAGE_SIZE).unwrap();
    u.register(m.addr(), m.len() as u64, MISSING).unwrap();
    // Page i holds 10 + i; pages 1 and 2 are then "evicted": their bytes
    // live only in `pages` (the parent's tier, so to speak).
    let pages: Vec<Vec<u8>> = (0..4).map(|i| page_of(10 + i)).collect();
    for (i, p) in pages.iter().enumerate() {
        // SAFETY: registered mapping, atomics only; p is a page.
        unsafe { u.copy(m.addr() + (i * PAGE_SIZE) as u64, p.as_ptr(), PAGE_SIZE as u64, false) }.unwrap();
    }
    m.dontneed(PAGE_SIZE, 2 * PAGE_SIZE).unwrap();
    let mine = page_of(99);
    let (ours, theirs) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let page = |i: usize| m.addr() + (i * PAGE_SIZE) as u64;
    let ready = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            // Nothing here may allocate until the FORK event is read: the
            // forking thread holds every malloc arena's lock meanwhile (a
            // thread still starting up, which allocates, would hang too).
            ready.store(true, Ordering::Release);
            assert!(u.wait(Some(Duration::from_secs(10))).unwrap(), "no FORK event within 10 s");
            let child = match u.read_event().unwrap() {
                Some(Event::Fork { uffd }) => u.forked(uffd),
                e => panic!("expected Fork, got {e:?}"),
            };
            // The child touches page 1 before it holds its context.
            match next_event(&child) {
                Event::PageFault { addr, .. } => assert_eq!(addr, page(1)),
                e => panic!("expected the child's fault, got {e:?}"),
            }
            // SAFETY: the destination is the child's registered page; the
            // copy goes into the child's memory, not ours.
            unsafe { child.copy(page(1), pages[1].as_ptr(), PAGE_SIZE as u64, false) }.unwrap();
            send_fd(&ours, child.as_fd());
            // Our copy closes; the child's keeps the context alive.
        });
        while !ready.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        // SAFETY: the child runs only the code below (no return, no
        // unwinding) and ends in _exit; glibc's fork leaves malloc usable.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let w = m.words();
            let word = |i: usize| w[i * PAGE_SIZE / 8].load(Ordering::Relaxed);
            let mut code = 0;
            // Served by the parent through the child's context.
            if word(1) != 11 {
                code = 1;
            }
            let Some(fd) = recv_fd(&theirs) else {
                // SAFETY: ends the child.
                unsafe { libc::_exit(2) }
            };
            let cu = u.forked(zmem_common::host::fds::KeptFd::new(fd));
            // Page 2: filled by the child itself, through its context.
            // SAFETY: our registered page; pages[2] is our copy of the
            // parent's bytes.
            if unsafe { cu.copy(page(2), pages[2].as_ptr(), PAGE_SIZE as u64, false) }.is_err() || word(2) != 12 {
                code = 3;
            }
            if word(0) != 10 || word(3) != 13 {
                code = 4;
            }
            // The child evicts and fills a page of its own: its memory only.
            let dropped = m.dontneed(3 * PAGE_SIZE, PAGE_SIZE).is_ok();
            // SAFETY: as above.
            let refilled = dropped && unsafe { cu.copy(page(3), mine.as_ptr(), PAGE_SIZE as u64, false) }.is_ok();
            if !refilled || word(3) != 99 {
                code = 5;
            }
            // SAFETY: ends the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        assert!(pid > 0, "fork: {}", std::io::Error::last_os_error());
        server.join().unwrap();
        let mut status = 0;
        // SAFETY: pid is our child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "child status {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "the child's check {} failed", libc::WEXITSTATUS(status));
    });
    // The parent's memory is its own: pages 1 and 2 still missing here
    // (a COPY goes in), page 3 still 13.
    let w = m.words();
    for i in [1, 2] {
        // SAFETY: registered mapping, atomics only.
        unsafe { u.copy(page(i), pages[i].as_ptr(), PAGE_SIZE as u64, false) }.unwrap();
        assert_eq!(w[i * PAGE_SIZE / 8].load(Ordering::Relaxed), 10 + i as u64);
    }
    assert_eq!(w[3 * PAGE_SIZE / 8].load(Ordering::Relaxed), 13);
}
