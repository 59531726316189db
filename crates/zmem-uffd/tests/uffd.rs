//! The userfaultfd layer on real userfaultfds, real threads and real faults.

use std::sync::atomic::Ordering;
use std::time::Duration;

mod common;

use common::watchdog;
use zmem_uffd::mapping::PAGE_SIZE;
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
    v.to_ne_bytes().repeat(PAGE_SIZE / 8)
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
