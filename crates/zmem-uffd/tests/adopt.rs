//! Adoption: memory the program mapped itself, managed where it lies, with
//! every byte checked through eviction, holes, a new mapping in a hole,
//! mremap, munmap and the pager's drop.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use zmem_common::PAGE_SIZE;
use zmem_compress::corpus::Corpus;
use zmem_uffd::{AdoptConfig, Pager, PagerConfig};
#[path = "common/child.rs"]
mod child;
mod common;
use common::watchdog;

const WORDS: usize = PAGE_SIZE / 8;
const MIB: usize = 1 << 20;

/// Word `i` of a page tagged `tag`: a real heap page, changed by tag.
fn word(tag: u64, i: usize) -> u64 {
    let c = Corpus::sample();
    let src = c.page(tag as usize % c.len());
    u64::from_ne_bytes(src[i * 8..i * 8 + 8].try_into().unwrap()) ^ tag.rotate_left(17)
}

/// Held while a test leaves a gap in its own mapping that it maps again
/// later at the same address, and while a pager is made. A pager's swap
/// file maps its io_uring (a page or two) and the kernel puts a small
/// mapping in the highest gap that fits: a test's 5-page gap, which the
/// test then mapped over with `MAP_FIXED`, taking the ring away from under
/// the other test's pager (a segfault, once in 20 runs of this binary).
static GAPS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn gaps() -> std::sync::MutexGuard<'static, ()> {
    GAPS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

// A test that leaves a gap in its mapping and maps it again runs `alone`
// (common/child.rs), in a process of its own: `GAPS` keeps other tests
// from making a pager meanwhile, but a running pager's pool maps pages
// too, and once in 8 runs of this binary one took a 5-page gap before the
// test could map it again.
use child::alone;

/// A pager, made while no test has a gap open (`GAPS`).
fn new_pager(cfg: PagerConfig) -> Pager {
    let _g = gaps();
    Pager::new(cfg).unwrap()
}

/// Plain private anonymous memory, made as a program makes it (not by zmem).
/// At a given address only where nothing is mapped (`MAP_FIXED_NOREPLACE`):
/// never over another thread's mapping.
fn mmap(addr: usize, len: usize) -> usize {
    let fixed = if addr == 0 { 0 } else { libc::MAP_FIXED_NOREPLACE };
    // SAFETY: a fresh anonymous mapping; with MAP_FIXED, over memory this
    // test owns and no reference covers.
    let p = unsafe {
        libc::mmap(
            addr as *mut _,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p as usize
}

/// A fresh anonymous mapping over `[addr, addr + len)`, which the test
/// maps already: one `mmap(MAP_FIXED)`, so the old pages go (an UNMAP
/// event, as `munmap` raises) with no moment at which another thread's
/// mapping could take the range.
fn map_over(addr: usize, len: usize) {
    // SAFETY: a range of this test's own mapping, no reference to which
    // lives; MAP_FIXED replaces it atomically.
    let p = unsafe {
        libc::mmap(
            addr as *mut _,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    assert_eq!(p as usize, addr);
}

fn page(addr: usize) -> &'static [AtomicU64] {
    // SAFETY: addr is a page of a live mapping of this test, reached only
    // through atomics and the kernel; the test unmaps it only after its last
    // use.
    unsafe { std::slice::from_raw_parts(addr as *const AtomicU64, WORDS) }
}

fn write(addr: usize, tag: u64) {
    for (i, w) in page(addr).iter().enumerate() {
        w.store(word(tag, i), Ordering::Relaxed);
    }
}

fn bad_words(addr: usize, tag: u64) -> usize {
    page(addr).iter().enumerate().filter(|(i, w)| w.load(Ordering::Relaxed) != word(tag, *i)).count()
}

fn wait_evicted(p: &Pager, at_least: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.stats().evicted_folios < at_least && Instant::now() < deadline {
        p.reclaim_now();
    }
}

/// A pager under a 4 MiB limit that adopted a fresh `len`-byte mapping,
/// every page `p` of which is then written with tag `p`. Returns the pager,
/// the mapping's address and its pages.
fn adopted_and_written(len: usize) -> (Pager, usize, usize) {
    adopted_and_written_with(len, PagerConfig::with_limit(4 * MIB))
}

fn adopted_and_written_with(len: usize, cfg: PagerConfig) -> (Pager, usize, usize) {
    let pager = new_pager(cfg);
    let base = mmap(0, len);
    assert_eq!(pager.adopt(base as u64, len).unwrap(), len);
    let pages = len / PAGE_SIZE;
    for p in 0..pages {
        write(base + p * PAGE_SIZE, p as u64);
    }
    (pager, base, pages)
}

#[test]
fn a_mapping_the_program_made_is_managed_through_holes_a_new_mapping_mremap_and_munmap() {
    let _wd = watchdog("adopt", 120);
    let len = 32 * MIB;
    let pager = new_pager(PagerConfig::with_limit(8 * MIB));
    let base = mmap(0, len);
    let pages = len / PAGE_SIZE;
    // Half the pages are there before adoption, half come after.
    for p in (0..pages).step_by(2) {
        write(base + p * PAGE_SIZE, p as u64);
    }
    assert_eq!(pager.adopt(base as u64, len).unwrap(), len);
    let s = pager.stats();
    assert_eq!(s.adopted_regions, 1);
    assert!(s.resident_bytes >= 16 * MIB as u64, "present pages count as resident: {s:?}");
    for p in (1..pages).step_by(2) {
        write(base + p * PAGE_SIZE, p as u64);
    }
    wait_evicted(&pager, 64);
    let s = pager.stats();
    assert!(s.evicted_folios > 0 && s.usage_bytes <= 9 * MIB as u64, "{s:?}");
    let bad: usize = (0..pages).map(|p| bad_words(base + p * PAGE_SIZE, p as u64)).sum();
    assert_eq!(bad, 0, "words read back wrong after eviction");

    // The program unmaps 4 MiB in the middle, and maps something new there
    // (4 MiB is not a folio boundary of the old region's last folio: the
    // hole starts mid-folio).
    let hole = base + 12 * MIB + 3 * PAGE_SIZE;
    let hole_len = 4 * MIB;
    map_over(hole, hole_len);
    for p in 0..hole_len / PAGE_SIZE {
        write(hole + p * PAGE_SIZE, 1_000_000 + p as u64);
    }
    assert_eq!(pager.adopt(hole as u64, hole_len).unwrap(), hole_len);
    let tag = |a: usize| {
        if (hole..hole + hole_len).contains(&a) {
            1_000_000 + ((a - hole) / PAGE_SIZE) as u64
        } else {
            ((a - base) / PAGE_SIZE) as u64
        }
    };
    let before = pager.stats().evicted_folios;
    for round in 0..2 {
        // Touch everything twice over: the old region's folios next to the
        // hole and the new region's are evicted and loaded again.
        let bad: usize = (0..pages).map(|p| base + p * PAGE_SIZE).map(|a| bad_words(a, tag(a))).sum();
        assert_eq!(bad, 0, "round {round}: words read back wrong around a mapping in a hole");
    }
    assert!(pager.stats().evicted_folios > before);

    // mremap moves the new mapping (its own VMA: its pages have their own
    // anon_vma, so the kernel keeps it apart from its neighbours), and its
    // region with it.
    let to = mmap(0, hole_len);
    // SAFETY: moves this test's mapping onto another of its own.
    let moved = unsafe {
        libc::mremap(
            hole as *mut _,
            hole_len,
            hole_len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to as *mut libc::c_void,
        )
    };
    assert_eq!(moved as usize, to);
    wait_evicted(&pager, pager.stats().evicted_folios + 16);
    let bad: usize = (0..hole_len / PAGE_SIZE).map(|p| bad_words(to + p * PAGE_SIZE, 1_000_000 + p as u64)).sum();
    assert_eq!(bad, 0, "words read back wrong after mremap");
    let bad: usize = (0..pages)
        .map(|p| base + p * PAGE_SIZE)
        .filter(|a| !(hole..hole + hole_len).contains(a))
        .map(|a| bad_words(a, tag(a)))
        .sum();
    assert_eq!(bad, 0, "the old region lost words when the new one moved out of its hole: {:?}", pager.stats());

    // munmap of it all: both regions are forgotten, their entries freed.
    // Not `[base, base + len)` whole: the hole the mremap left is not the
    // test's any more, and the kernel may have put another test's memory
    // there since (a pool's next chunk, a Vec's buffer). Unmapping that
    // crashed this binary with SIGSEGV, once in ~50 runs.
    for (a, b) in [(base, hole), (hole + hole_len, base + len), (to, to + hole_len)] {
        // SAFETY: the test's own mappings, no longer used.
        assert_eq!(unsafe { libc::munmap(a as *mut _, b - a) }, 0);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while pager.stats().retired_regions < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let s = pager.stats();
    assert_eq!(s.retired_regions, 2, "{s:?}");
    assert_eq!(s.resident_bytes, 0, "{s:?}");
    let t = pager.tier().stats();
    assert_eq!(t.stored_pages + t.same_filled_pages, 0, "entries left: {t:?}");
}

/// A folio only partly present when it is adopted (the program touched
/// one page of it) gets the zero page over its other pages at once, as the
/// kernel would give them at their first touch: they read zeros and keep
/// what is written, and not one touch is a fault round trip to the handler
/// (Python took ~1,100 such faults a run, each 60-100 µs).
#[test]
fn never_touched_pages_of_a_folio_partly_present_at_adoption_cost_no_fault() {
    let _wd = watchdog("adopt-zero", 60);
    let len = 2 * MIB;
    let pager = new_pager(PagerConfig::with_limit(8 * MIB));
    let base = mmap(0, len);
    let (pages, ppf) = (len / PAGE_SIZE, (64 << 10) / PAGE_SIZE);
    for p in (0..pages).step_by(ppf) {
        write(base + p * PAGE_SIZE, p as u64);
    }
    assert_eq!(pager.adopt(base as u64, len).unwrap(), len);
    let before = pager.stats();
    assert_eq!(before.adopted_zero_pages, (pages - pages / ppf) as u64, "{before:?}");
    for p in 0..pages {
        let a = base + p * PAGE_SIZE;
        if p % ppf == 0 {
            assert_eq!(bad_words(a, p as u64), 0, "page {p}");
        } else {
            assert!(page(a).iter().all(|w| w.load(Ordering::Relaxed) == 0), "page {p} is not zeros");
            write(a, p as u64);
        }
    }
    let s = pager.stats();
    let faults = |s: &zmem_uffd::PagerStats| (s.zero_faults, s.load_faults, s.dropped_page_faults, s.stray_faults);
    assert_eq!(faults(&s), faults(&before), "touches reached the handler: {s:?}");
    let bad: usize = (0..pages).map(|p| bad_words(base + p * PAGE_SIZE, p as u64)).sum();
    assert_eq!(bad, 0);
}

/// A pager that adopted 1 MiB plus `tail` pages: the tail is registered,
/// but in no region. Returns the pager, the mapping and its length.
fn adopted_with_tail(tail: usize) -> (Pager, usize, usize) {
    let len = MIB + tail * PAGE_SIZE;
    let pager = new_pager(PagerConfig::with_limit(8 * MIB));
    let base = mmap(0, len);
    assert_eq!(pager.adopt(base as u64, len).unwrap(), MIB);
    (pager, base, len)
}

/// The tail of an adopted mapping past its last whole folio is registered
/// but in no region: a fault there is a stray one, served with the zero
/// page. The pages after it get one too, so a walk over the tail costs one
/// fault, not one per page; they read zeros and keep what is written.
#[test]
fn a_walk_over_an_adopted_mappings_tail_costs_one_fault() {
    let _wd = watchdog("adopt-tail", 60);
    let tail = 5;
    let (pager, base, len) = adopted_with_tail(tail);
    let before = pager.stats();
    for p in MIB / PAGE_SIZE..len / PAGE_SIZE {
        let a = base + p * PAGE_SIZE;
        assert!(page(a).iter().all(|w| w.load(Ordering::Relaxed) == 0), "page {p} is not zeros");
        write(a, p as u64);
    }
    let s = pager.stats();
    assert_eq!(s.stray_faults - before.stray_faults, 1, "{s:?}");
    assert_eq!(s.stray_zero_pages - before.stray_zero_pages, tail as u64 - 1, "{s:?}");
    for p in MIB / PAGE_SIZE..len / PAGE_SIZE {
        assert_eq!(bad_words(base + p * PAGE_SIZE, p as u64), 0, "page {p}");
    }
}

/// A forking thread holds zmem's table of its own ranges from the prepare
/// step of fork to its end (`owned::fork_lock`). A stray fault meanwhile,
/// the forking thread's own or another's, is still served: filling ahead
/// needs that table, so it is skipped. The handler used to wait for the
/// table before it woke the thread; with `UFFD_FEATURE_EVENT_FORK`, where
/// fork waits for the handler to read its event, that was a deadlock (the
/// likeliest cause of the forking-server test's one hang in CI).
#[test]
fn a_stray_fault_is_served_while_a_forking_thread_holds_zmems_ranges() {
    let _wd = watchdog("adopt-stray-fork", 60);
    let tail = 5;
    let (pager, base, _) = adopted_with_tail(tail);
    let before = pager.stats();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fork = zmem_common::host::owned::fork_lock();
    let toucher = {
        let done = done.clone();
        std::thread::spawn(move || {
            write(base + MIB, 7);
            done.store(true, Ordering::SeqCst);
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done.load(Ordering::SeqCst) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let served = done.load(Ordering::SeqCst);
    drop(fork);
    toucher.join().unwrap();
    assert!(served, "the stray fault waited for the forking thread's lock");
    let s = pager.stats();
    assert_eq!(s.stray_faults - before.stray_faults, 1, "{s:?}");
    assert_eq!(s.stray_zero_pages, before.stray_zero_pages, "nothing filled ahead under the lock: {s:?}");
    assert_eq!(bad_words(base + MIB, 7), 0);
    // The lock released, a fault on the next page fills ahead again.
    write(base + MIB + PAGE_SIZE, 8);
    let s2 = pager.stats();
    assert_eq!(s2.stray_zero_pages - s.stray_zero_pages, tail as u64 - 2, "{s2:?}");
    for p in 2..tail {
        assert!(page(base + MIB + p * PAGE_SIZE).iter().all(|w| w.load(Ordering::Relaxed) == 0), "tail page {p}");
    }
}

/// The zero pages a stray fault fills ahead stay in the mapping that took
/// it. The kernel's fills check only that a page is registered with *a*
/// userfaultfd: here the next mapping is another pager's, with its first
/// folio evicted, and filling into it once read 5,526 words of another
/// test as zeros.
#[test]
fn a_stray_faults_zero_pages_stay_out_of_another_pagers_mapping() {
    let _wd = watchdog("adopt-stray-neighbour", 60);
    let tail = 4;
    let (a_len, b_len) = (MIB + tail * PAGE_SIZE, 8 * MIB);
    // One mapping, cut in two by the two registrations.
    let base = mmap(0, a_len + b_len);
    let b_base = base + a_len;
    let a = new_pager(PagerConfig::with_limit(8 * MIB));
    let b = new_pager(PagerConfig::with_limit(4 * MIB));
    assert_eq!(a.adopt(base as u64, a_len).unwrap(), MIB);
    assert_eq!(b.adopt(b_base as u64, b_len).unwrap(), b_len);
    for p in 0..b_len / PAGE_SIZE {
        write(b_base + p * PAGE_SIZE, p as u64 + 1);
    }
    b.reclaim_now();
    // The coldest go first: B's first folio is out of memory now.
    assert!(b.stats().evicted_folios > 0, "{:?}", b.stats());
    let present = |addr: usize| {
        let mut v = 0u8;
        // SAFETY: mincore on a page of our mapping; it only reports.
        assert_eq!(unsafe { libc::mincore(addr as *mut _, PAGE_SIZE, &mut v) }, 0);
        v & 1 != 0
    };
    assert!(!present(b_base), "B's first page was evicted");
    // A stray fault on A's tail: the pages after it in A's mapping are
    // filled, never B's.
    // (The handler fills ahead before it wakes the faulting thread.)
    write(base + MIB, 9);
    let s = a.stats();
    assert_eq!((s.stray_faults, s.stray_zero_pages), (1, tail as u64 - 1), "{s:?}");
    assert!(!present(b_base), "A filled B's evicted page");
    let bad: usize = (0..b_len / PAGE_SIZE).map(|p| bad_words(b_base + p * PAGE_SIZE, p as u64 + 1)).sum();
    assert_eq!(bad, 0, "{:?}", b.stats());
    drop(b);
    drop(a);
    // SAFETY: the test's mapping, no longer used.
    assert_eq!(unsafe { libc::munmap(base as *mut _, a_len + b_len) }, 0);
}

#[test]
fn dropping_the_pager_gives_adopted_memory_back_whole() {
    let _wd = watchdog("adopt-drop", 60);
    let len = 16 * MIB;
    let base = mmap(0, len);
    {
        let pager = new_pager(PagerConfig::with_limit(4 * MIB));
        pager.adopt(base as u64, len).unwrap();
        for p in 0..len / PAGE_SIZE {
            write(base + p * PAGE_SIZE, p as u64 * 7);
        }
        wait_evicted(&pager, 32);
        assert!(pager.stats().evicted_folios >= 32);
    }
    // No pager: a page it had not loaded back would hang here (registered,
    // nobody serving) or read as zeros (unregistered).
    let bad: usize = (0..len / PAGE_SIZE).map(|p| bad_words(base + p * PAGE_SIZE, p as u64 * 7)).sum();
    assert_eq!(bad, 0);
    // SAFETY: the test's mapping, no longer used.
    assert_eq!(unsafe { libc::munmap(base as *mut _, len) }, 0);
}

/// Memory that is executable too (SBCL's heap is read, write and execute)
/// is evicted and loads back: UFFDIO_MOVE refuses to move pages between
/// mappings whose protections differ (EINVAL), so reclaim moves them to an
/// executable staging area. Plain memory beside it still uses the plain
/// one. Before, such a folio could not move and stayed resident for good.
#[test]
fn executable_memory_is_evicted_through_an_executable_staging_area() {
    let _wd = watchdog("adopt-exec", 60);
    let len = 8 * MIB;
    let (pager, plain, pages) = adopted_and_written(len);
    let rwx = mmap(0, len);
    let prot = libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC;
    // SAFETY: the test's own fresh mapping, reached only through atomics.
    assert_eq!(unsafe { libc::mprotect(rwx as *mut _, len, prot) }, 0);
    assert_eq!(pager.adopt(rwx as u64, len).unwrap(), len);
    for p in 0..pages {
        write(rwx + p * PAGE_SIZE, p as u64 + 5);
    }
    let folios = (2 * len / PagerConfig::with_limit(4 * MIB).folio_size) as u64;
    wait_evicted(&pager, folios / 2);
    let s = pager.stats();
    assert!(s.evicted_folios >= folios / 2, "{s:?}");
    assert_eq!(s.unevictable_folios, 0, "every folio could move: {s:?}");
    for round in 0..2 {
        let bad: usize = (0..pages).map(|p| bad_words(rwx + p * PAGE_SIZE, p as u64 + 5)).sum();
        let bad_plain: usize = (0..pages).map(|p| bad_words(plain + p * PAGE_SIZE, p as u64)).sum();
        assert_eq!((bad, bad_plain), (0, 0), "round {round}");
    }
    assert!(pager.stats().load_faults > 0);
    drop(pager);
    for m in [plain, rwx] {
        // SAFETY: the test's mappings, no longer used.
        assert_eq!(unsafe { libc::munmap(m as *mut _, len) }, 0);
    }
}

#[test]
fn zmems_own_mappings_are_recorded_while_they_live() {
    use zmem_common::host::owned::{overlapping, Kind};
    let m = zmem_uffd::Mapping::new(4 * MIB).unwrap();
    let (a, b) = (m.addr(), m.addr() + (4 * MIB) as u64);
    assert_eq!(overlapping(a + 100, a + 200), vec![(a, b, Kind::Zmem)]);
    drop(m);
    assert!(overlapping(a, b).iter().all(|&(s, _, _)| s != a), "forgotten once unmapped");
}

/// A folio that spans two of the kernel's mappings (the program mprotected
/// half of it) is filled page by page: the fault that hung a python run
/// (zero-fill of the whole folio failed with ENOENT, and nobody woke the
/// thread) is served, and evicted data still comes back.
#[test]
fn a_folio_split_by_mprotect_is_served_page_by_page() {
    let _wd = watchdog("adopt-mprotect", 60);
    let len = 8 * MIB;
    let (pager, base, pages) = adopted_and_written(len);
    wait_evicted(&pager, 16);
    // Pages 8..16 of the first folio become read-only: two mappings.
    let ro = base + 8 * PAGE_SIZE;
    // SAFETY: part of this test's mapping.
    assert_eq!(unsafe { libc::mprotect(ro as *mut _, 8 * PAGE_SIZE, libc::PROT_READ) }, 0);
    // Every page reads back, evicted or not, read-only or not.
    let bad: usize = (0..pages).map(|p| bad_words(base + p * PAGE_SIZE, p as u64)).sum();
    assert_eq!(bad, 0);
    // Dropped, the split folio is Never again: a read of each half is a
    // zero-fill that crosses the boundary.
    // SAFETY: as above; the test reads zeros after.
    assert_eq!(unsafe { libc::madvise(base as *mut _, 16 * PAGE_SIZE, libc::MADV_DONTNEED) }, 0);
    assert!(page(base).iter().all(|w| w.load(Ordering::Relaxed) == 0));
    assert!(page(ro).iter().all(|w| w.load(Ordering::Relaxed) == 0));
    write(base, 42);
    assert_eq!(bad_words(base, 42), 0);
    // SAFETY: the test's mapping, no longer used.
    assert_eq!(unsafe { libc::munmap(base as *mut _, len) }, 0);
}

/// A folio whose pages lie in two of the kernel's mappings (the program
/// madvised half of it DONTFORK, which splits the mapping with the same
/// protection) is evicted whole, no page left behind mapped (resident and
/// uncounted in an Evicted folio), and reads back.
#[test]
fn a_folio_across_two_mappings_is_evicted_whole() {
    let _wd = watchdog("adopt-two-vmas", 60);
    let len = 8 * MIB;
    let (pager, base, pages) = adopted_and_written(len);
    // SAFETY: part of this test's mapping; DONTFORK changes only what a
    // child would inherit.
    assert_eq!(unsafe { libc::madvise((base + 8 * PAGE_SIZE) as *mut _, 8 * PAGE_SIZE, libc::MADV_DONTFORK) }, 0);
    let pm = zmem_uffd::PageMap::open().unwrap();
    let mut evicted = false;
    for _ in 0..20 {
        // Everything else, written again: the first folio goes cold.
        for p in 16..pages {
            write(base + p * PAGE_SIZE, p as u64);
        }
        wait_evicted(&pager, pager.stats().evicted_folios + 32);
        let mapped = pm.mapped(base as u64, 16).unwrap();
        if !mapped[8..].contains(&true) {
            assert!(!mapped[..8].contains(&true), "pages before the boundary stayed behind: {mapped:?}");
            evicted = true;
            break;
        }
    }
    assert!(evicted, "the first folio was never evicted: {:?}", pager.stats());
    assert_eq!(pager.stats().unevictable_folios, 0);
    let bad: usize = (0..pages).map(|p| bad_words(base + p * PAGE_SIZE, p as u64)).sum();
    assert_eq!(bad, 0);
    // SAFETY: the test's mapping, no longer used.
    assert_eq!(unsafe { libc::munmap(base as *mut _, len) }, 0);
}

/// An mremap that moves part of an adopted region (as glibc's realloc of
/// one of several neighbouring mmapped chunks does, with its own syscall,
/// which no preload sees), from mid-folio to mid-folio, with nearly all
/// of it evicted: the moved part is managed at its new address, its
/// evicted pages come back from their entries there, the part that stayed
/// keeps its own, and neither loads or drops the other's pages. Then the
/// rest is moved again, and both are unmapped: every entry is freed.
#[test]
fn a_partial_mremap_of_an_evicted_region_keeps_every_page_where_it_went() {
    let _wd = watchdog("partial mremap", 120);
    let len = 24 * MIB;
    let cfg = PagerConfig { fault_around: 4 << 10, ..PagerConfig::with_limit(4 * MIB) };
    let (pager, base, pages) = adopted_and_written_with(len, cfg);
    wait_evicted(&pager, (16 * MIB / (64 << 10)) as u64);
    // Pages [from, from + n) move, starting 3 pages into a folio and ending
    // 5 pages into another.
    let (from, n) = (4 * MIB / PAGE_SIZE + 3, 8 * MIB / PAGE_SIZE + 2);
    // One page read in each of the two folios the move splits, on the side
    // that stays: each loads alone (`fault_around`), and the folio's
    // pages that move are still in the tier when they do.
    for p in [from - 2, from + n + 2] {
        assert_eq!(bad_words(base + p * PAGE_SIZE, p as u64), 0);
    }
    let to = mmap(0, n * PAGE_SIZE + 64 * PAGE_SIZE) + 7 * PAGE_SIZE;
    // SAFETY: moves part of this test's mapping onto another of its own.
    let r = unsafe {
        libc::mremap(
            (base + from * PAGE_SIZE) as *mut _,
            n * PAGE_SIZE,
            n * PAGE_SIZE,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to as *mut libc::c_void,
        )
    };
    assert_eq!(r as usize, to);
    // mremap returns once the handler has read the event, maybe before it
    // has handled it (seen once in 12 runs with the machine busy).
    let deadline = Instant::now() + Duration::from_secs(5);
    while pager.stats().split_regions < 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(pager.stats().split_regions, 1);
    let moved = |p: usize| (from..from + n).contains(&p);
    for round in 0..2 {
        // Twice over, under a limit a sixth of it: evicted and loaded again
        // on both sides.
        let bad: usize = (0..n).map(|i| bad_words(to + i * PAGE_SIZE, (from + i) as u64)).sum();
        assert_eq!(bad, 0, "round {round}: the moved part read back wrong: {:?}", pager.stats());
        let bad: usize = (0..pages).filter(|&p| !moved(p)).map(|p| bad_words(base + p * PAGE_SIZE, p as u64)).sum();
        assert_eq!(bad, 0, "round {round}: the part that stayed read back wrong: {:?}", pager.stats());
    }
    // Writes on both sides, evicted and read back.
    for i in (0..n).step_by(3) {
        write(to + i * PAGE_SIZE, 5_000_000 + i as u64);
    }
    let tag = |i: usize| if i % 3 == 0 { 5_000_000 + i as u64 } else { (from + i) as u64 };
    wait_evicted(&pager, pager.stats().evicted_folios + 64);
    let bad: usize = (0..n).map(|i| bad_words(to + i * PAGE_SIZE, tag(i))).sum();
    assert_eq!(bad, 0, "the moved part lost writes made after the move");

    // The two pieces left of the test's mapping, and the moved part. Not
    // `[base, base + len)` whole: the hole the mremap left is not the
    // test's any more, and the kernel may have put the pager's own memory
    // there since (its mempool's next chunk). Unmapping that crashed
    // reclaim in its pool (SIGSEGV in `ZsPage::write`), or left entries.
    let hole = (base + from * PAGE_SIZE, base + (from + n) * PAGE_SIZE);
    for (a, b) in [(base, hole.0), (hole.1, base + len), (to, to + n * PAGE_SIZE)] {
        // SAFETY: the test's own mappings, no longer used.
        assert_eq!(unsafe { libc::munmap(a as *mut _, b - a) }, 0);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while pager.stats().retired_regions < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let s = pager.stats();
    assert_eq!(s.retired_regions, 2, "{s:?}");
    // A folio reclaim was evicting when its pages were unmapped is
    // finished by its evictor, which drops their entries then: after the
    // region is retired (seen once in 7 runs, gone 5 ms later).
    let left = || {
        let t = pager.tier().stats();
        t.stored_pages + t.same_filled_pages
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while left() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let t = pager.tier().stats();
    assert_eq!(t.stored_pages + t.same_filled_pages, 0, "entries left: {t:?}");
}

/// A range the program unmaps and maps again (glibc trimming its brk heap
/// and growing it back) while reclaim is evicting it: the new mapping is
/// not a region, and its pages are the program's alone. UFFDIO_MOVE takes
/// pages from any anonymous mapping, registered or not, so an eviction
/// that looked at the holes before the UNMAP was read and moved after the
/// program wrote its new pages took them: they read as zeros (Python's
/// collector died on such a page under `zmem run`). Eight 256 KiB ranges
/// are adopted, go cold under a writer that keeps reclaim busy, and are
/// unmapped, mapped again, written and checked, round after round.
#[test]
fn a_range_unmapped_and_mapped_again_keeps_its_new_pages_while_reclaim_runs() {
    let _wd = watchdog("adopt-remap-race", 120);
    // Each MOVE waits 1 ms after looking up the holes: without the lock
    // that closes the window, nearly every round lost pages.
    let cfg = PagerConfig { inject_move_delay: Duration::from_millis(1), ..PagerConfig::with_limit(4 * MIB) };
    let pager = new_pager(cfg);
    // Pressure: a 16 MiB region written over and over.
    let hot_len = 16 * MIB;
    let hot = mmap(0, hot_len);
    assert_eq!(pager.adopt(hot as u64, hot_len).unwrap(), hot_len);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for p in 0..hot_len / PAGE_SIZE {
                    page(hot + p * PAGE_SIZE)[0].store(n, Ordering::Relaxed);
                }
                n += 1;
            }
        })
    };
    const SLOTS: usize = 8;
    const SLOT: usize = 256 << 10;
    let area = mmap(0, SLOTS * SLOT);
    let pages = SLOT / PAGE_SIZE;
    let tag = |round: usize, s: usize, p: usize| ((round * SLOTS + s) * pages + p) as u64;
    let deadline = Instant::now() + Duration::from_secs(6);
    let mut round = 0;
    let mut bad = 0;
    while Instant::now() < deadline && bad == 0 {
        for s in 0..SLOTS {
            let a = area + s * SLOT;
            map_over(a, SLOT);
            for p in 0..pages {
                write(a + p * PAGE_SIZE, tag(round, s, p));
            }
            bad += (0..pages).map(|p| bad_words(a + p * PAGE_SIZE, tag(round, s, p))).sum::<usize>();
            // Managed from here: reclaim evicts it while the other slots go
            // round.
            assert_eq!(pager.adopt(a as u64, SLOT).unwrap(), SLOT);
        }
        for s in 0..SLOTS {
            let a = area + s * SLOT;
            bad += (0..pages).map(|p| bad_words(a + p * PAGE_SIZE, tag(round, s, p))).sum::<usize>();
        }
        round += 1;
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let st = pager.stats();
    assert_eq!(bad, 0, "words lost after {round} rounds: {st:?}");
    assert!(st.evicted_folios > 0 && round > 10, "{round} rounds, {st:?}");
    // SAFETY: the test's mapping, no longer used.
    assert_eq!(unsafe { libc::munmap(area as *mut _, SLOTS * SLOT) }, 0);
    // SAFETY: as above; the writer that used it has been joined.
    assert_eq!(unsafe { libc::munmap(hot as *mut _, hot_len) }, 0);
}

/// The program unmaps the end of a range just as it is adopted and maps it
/// again (glibc trimming its brk heap and growing it back): the UNMAP the
/// registration makes the kernel report must find the region, so the new
/// mapping there is a hole of it, never moved out by eviction. (Registered
/// before it was in the table, the region missed that UNMAP, eviction took
/// the new pages from the unregistered mapping and no COPY could put them
/// back: Python's collector read zeros.)
#[test]
fn a_range_trimmed_as_it_is_adopted_keeps_what_is_mapped_there_next() {
    if !alone("a_range_trimmed_as_it_is_adopted_keeps_what_is_mapped_there_next") {
        return;
    }
    let _wd = watchdog("adopt-trim-race", 60);
    let cfg = PagerConfig { inject_adopt_delay: Duration::from_millis(50), ..PagerConfig::with_limit(4 * MIB) };
    let pager = new_pager(cfg);
    let (len, base, tail) = trimmable_mapping();
    // The last 5 pages: unmapped while the adoption sleeps, mapped again
    // and written.
    let trimmer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(15));
        let _g = gaps();
        // SAFETY: the end of this test's mapping, no reference to it.
        assert_eq!(unsafe { libc::munmap(tail as *mut _, 5 * PAGE_SIZE) }, 0);
        map_tail_again(tail);
    });
    assert_eq!(pager.adopt(base as u64, len).unwrap(), len);
    trimmer.join().unwrap();
    press_and_check_trimmed(&pager, base, len);
}

/// A range adopted as one mapping after the program unmapped its end (the
/// scan listed it before glibc trimmed its brk heap): UFFDIO_REGISTER steps
/// over the gap without an error, and the program then maps the end again
/// (unregistered: it cannot merge with the registered part) and writes
/// there. That end must stay the program's alone: evicting it would MOVE
/// its pages out where no COPY can bring them back.
#[test]
fn a_range_whose_end_went_before_it_was_registered_is_managed_only_where_it_is_mapped() {
    if !alone("a_range_whose_end_went_before_it_was_registered_is_managed_only_where_it_is_mapped") {
        return;
    }
    let _wd = watchdog("adopt-gap", 60);
    let pager = new_pager(PagerConfig::with_limit(4 * MIB));
    let (len, base, tail) = trimmable_mapping();
    let g = gaps();
    // SAFETY: the end of this test's mapping, no reference to it.
    assert_eq!(unsafe { libc::munmap(tail as *mut _, 5 * PAGE_SIZE) }, 0);
    let adopted = pager.adopt(base as u64, len).unwrap();
    assert_eq!(adopted, len, "registering over the gap succeeds; the region keeps its length");
    assert_eq!(pager.stats().adoption_cuts, 1, "{:?}", pager.stats());
    map_tail_again(tail);
    drop(g);
    // Less than a folio left mapped: nothing is adopted, the little there
    // is stays the program's and reads back.
    let small = mmap(0, 16 * PAGE_SIZE);
    write(small, 7);
    // SAFETY: the end of this test's mapping, no reference to it.
    assert_eq!(unsafe { libc::munmap((small + 3 * PAGE_SIZE) as *mut _, 13 * PAGE_SIZE) }, 0);
    assert_eq!(pager.adopt(small as u64, 16 * PAGE_SIZE).unwrap(), 0);
    assert_eq!(pager.stats().adoption_cuts, 2, "{:?}", pager.stats());
    press_and_check_trimmed(&pager, base, len);
    assert_eq!(bad_words(small, 7), 0);
    // SAFETY: what is left of that mapping, no longer used.
    assert_eq!(unsafe { libc::munmap(small as *mut _, 3 * PAGE_SIZE) }, 0);
}

/// A fresh 1 MiB mapping, page `p` written with tag `p`: (len, base, the
/// address of its last 5 pages).
fn trimmable_mapping() -> (usize, usize, usize) {
    let len = MIB;
    let base = mmap(0, len);
    for p in 0..len / PAGE_SIZE {
        write(base + p * PAGE_SIZE, p as u64);
    }
    (len, base, base + len - 5 * PAGE_SIZE)
}

/// Maps the 5 pages at `tail` again (unmapped before) and writes them.
fn map_tail_again(tail: usize) {
    assert_eq!(mmap(tail, 5 * PAGE_SIZE), tail);
    for i in 0..5 {
        write(tail + i * PAGE_SIZE, 1000 + i as u64);
    }
}

/// Evicts everything of `[base, base + len)` under an 8 MiB region written
/// twice, then checks it: page `p` tagged `p`, but the last 5 pages (mapped
/// again by the test) tagged `1000 + i`. Unmaps both.
fn press_and_check_trimmed(pager: &Pager, base: usize, len: usize) {
    let (pages, tail) = (len / PAGE_SIZE, base + len - 5 * PAGE_SIZE);
    let (hot, hot_len) = (mmap(0, 8 * MIB), 8 * MIB);
    assert_eq!(pager.adopt(hot as u64, hot_len).unwrap(), hot_len);
    for round in 0..2 {
        for p in 0..hot_len / PAGE_SIZE {
            write(hot + p * PAGE_SIZE, round);
        }
        wait_evicted(pager, pager.stats().evicted_folios + 64);
    }
    let bad: usize = (0..pages - 5).map(|p| bad_words(base + p * PAGE_SIZE, p as u64)).sum::<usize>()
        + (0..5).map(|i| bad_words(tail + i * PAGE_SIZE, 1000 + i as u64)).sum::<usize>();
    assert_eq!(bad, 0, "{:?}", pager.stats());
    assert!(pager.stats().evicted_folios > 64, "{:?}", pager.stats());
    // SAFETY: the test's mappings, no longer used.
    assert_eq!(unsafe { libc::munmap(base as *mut _, len) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::munmap(hot as *mut _, hot_len) }, 0);
}

/// A scan registers every mapping it adopts before it takes in the pages
/// already present in any: from then on, what the program writes in any of
/// them is managed, and what it unmaps meanwhile is not taken in. (One
/// mapping after another, a program filling its
/// large heap wrote it unmanaged while the scan read the pages of the
/// mappings before it: SBCL, started late under `zmem run --limit 32M`,
/// peaked at 41-46 MiB.)
#[test]
fn a_scan_manages_every_mapping_before_it_takes_in_the_pages_of_any() {
    if !alone("a_scan_manages_every_mapping_before_it_takes_in_the_pages_of_any") {
        return;
    }
    let _wd = watchdog("adopt-scan-order", 60);
    const LEN: usize = 128 * MIB;
    const WRITTEN: usize = 64;
    // Each range's pages are taken in 300 ms after the last registration.
    let cfg = PagerConfig { inject_adopt_delay: Duration::from_millis(300), ..PagerConfig::with_limit(64 * MIB) };
    let fs = cfg.folio_size;
    let pager = std::sync::Arc::new(new_pager(cfg));
    // Two mappings, kept apart by a guard page (side by side, the kernel
    // merges them into one).
    let first = mmap(0, 2 * LEN + PAGE_SIZE);
    let second = first + LEN + PAGE_SIZE;
    // SAFETY: a page of this test's own mapping, never referenced.
    assert_eq!(unsafe { libc::mprotect((first + LEN) as *mut _, PAGE_SIZE, libc::PROT_NONE) }, 0);
    for p in 0..WRITTEN {
        write(first + p * PAGE_SIZE, p as u64);
    }
    let scan = {
        let pager = std::sync::Arc::clone(&pager);
        // Only this test's mappings are as large: nothing of the test
        // harness's is adopted.
        let cfg = AdoptConfig { threshold: 100 * MIB, stacks: false, interval: Duration::from_secs(3600) };
        std::thread::spawn(move || pager.scan_mappings(&cfg).unwrap())
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while pager.stats().adopted_regions < 2 {
        assert!(Instant::now() < deadline, "{:?}", pager.stats());
        std::thread::sleep(Duration::from_micros(200));
    }
    let before = pager.stats();
    assert_eq!(before.resident_bytes, 0, "both registered before either's pages are taken in: {before:?}");
    // The program writes the second mapping meanwhile: the handler serves it.
    for p in 0..WRITTEN {
        write(second + p * PAGE_SIZE, 1000 + p as u64);
    }
    // And maps the first mapping's first folio anew, and writes it: a hole
    // of the region, whose pages (present, in a mapping not registered)
    // are not taken in.
    map_over(first, fs);
    for p in 0..fs / PAGE_SIZE {
        write(first + p * PAGE_SIZE, 2000 + p as u64);
    }
    let after = pager.stats();
    assert!(!scan.is_finished(), "the scan is still taking pages in");
    assert!(after.zero_faults > before.zero_faults, "{before:?} then {after:?}");
    assert_eq!(scan.join().unwrap(), 2 * LEN);
    let st = pager.stats();
    let taken_in = (WRITTEN * PAGE_SIZE - fs).div_ceil(fs) * fs;
    assert_eq!(st.resident_bytes - after.resident_bytes, taken_in as u64, "{after:?} then {st:?}");
    for p in 0..WRITTEN {
        let tag = if p * PAGE_SIZE < fs { 2000 } else { 0 } + p as u64;
        assert_eq!(bad_words(first + p * PAGE_SIZE, tag), 0, "page {p} of the first mapping");
        assert_eq!(bad_words(second + p * PAGE_SIZE, 1000 + p as u64), 0, "page {p} of the second mapping");
    }
}
