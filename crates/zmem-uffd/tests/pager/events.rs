//! The program's own changes to its memory while pages are evicted:
//! madvise, munmap, mremap and fork.

use super::*;

#[test]
fn madvise_dontneed_drops_evicted_entries() {
    let _wd = watchdog("madvise", 60);
    let p = pager(4 << 20);
    let r = p.map(16 << 20).unwrap();
    for pg in 0..r.len() / PAGE_SIZE {
        write_page(&r, pg, 3);
    }
    p.reclaim_now();
    let stored = p.tier().stats().stored_pages + p.tier().stats().swap_pages;
    assert!(stored > 0);
    // Drop the first 4 MiB: the kernel tells the handler, which drops the entries.
    // SAFETY: the range is our region's, reached only through atomics.
    unsafe { rustix::mm::madvise(r.addr() as *mut _, 4 << 20, rustix::mm::Advice::LinuxDontNeed) }.unwrap();
    // madvise returns once the event is read; the faults below are served
    // after it is handled. The dropped range reads as zeros without a single
    // load from the tier.
    let loads = p.tier().stats().zswpin;
    for pg in 0..1024 {
        assert!(r.words()[pg * WORDS..(pg + 1) * WORDS].iter().all(|w| w.load(Ordering::Relaxed) == 0), "page {pg}");
    }
    assert_eq!(p.tier().stats().zswpin, loads, "the dropped range was served from stale entries");
    for pg in 1024..r.len() / PAGE_SIZE {
        assert_eq!(check_page(&r, pg, 3), 0, "page {pg}");
    }
    // Region::drop frees the entries of evicted folios; those of the dropped
    // range must already be gone, or they would be left behind here.
    drop_and_check_no_entries(&p, r, "by MADV_DONTNEED or the drop");
}

#[test]
fn dropping_a_region_frees_its_entries_and_the_swap_file_serves_faults() {
    let _wd = watchdog("swap", 120);
    let limit = 4 << 20;
    let mut cfg = PagerConfig::with_limit(limit);
    cfg.tier = TierConfig { max_pool_bytes: Some(1 << 20), memory_budget: limit, ..TierConfig::default() };
    let p = Pager::new(cfg).unwrap();
    let r = p.map(16 << 20).unwrap();
    for pg in 0..r.len() / PAGE_SIZE {
        write_page(&r, pg, 9);
    }
    p.reclaim_now();
    for pg in 0..r.len() / PAGE_SIZE {
        assert_eq!(check_page(&r, pg, 9), 0, "page {pg}");
    }
    let t = p.tier().stats();
    assert!(t.written_back_pages > 0, "the small pool wrote back to the swap file: {t:?}");
    // Every fault that loaded is timed, as one of the two kinds.
    let s = p.stats();
    assert_eq!(s.pool_load_faults + s.swap_load_faults, s.load_faults + s.swapped_page_faults, "{s:?}");
    assert!(s.swap_load_faults > 0 && s.swap_load_fault_ns > s.swap_load_faults, "{s:?}");
    assert!(s.reclaim_store_pages >= t.zswpout && s.reclaim_store_ns > 0, "{s:?} {t:?}");
    drop_and_check_no_entries(&p, r, "with the swap file in use");
}

#[test]
fn a_whole_region_mremap_moves_its_resident_and_evicted_pages() {
    let _wd = watchdog("mremap", 60);
    let p = pager(4 << 20);
    let r = p.map(16 << 20).unwrap();
    for pg in 0..r.len() / PAGE_SIZE {
        write_page(&r, pg, 5);
    }
    p.reclaim_now();
    assert!(p.stats().evicted_folios > 0);
    let old = r.addr();
    // mremap waits until the handler has read the event; it updates the
    // region's address when it handles it, before any later fault.
    // A target range of our own, replaced by the move.
    let target = zmem_uffd::Mapping::new(r.len()).unwrap();
    let to = target.addr();
    std::mem::forget(target);
    // SAFETY: moves our region (reached only through atomics) over our own
    // forgotten target range; the pager follows via the Remap event.
    let new = unsafe {
        rustix::mm::mremap_fixed(old as *mut _, r.len(), r.len(), rustix::mm::MremapFlags::MAYMOVE, to as *mut _)
    }
    .unwrap() as u64;
    assert_ne!(new, old, "the region really moved");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while r.addr() != new && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(r.addr(), new, "the pager followed the region");
    for pg in 0..r.len() / PAGE_SIZE {
        assert_eq!(check_page(&r, pg, 5), 0, "page {pg} after the move");
    }
    drop_and_check_no_entries(&p, r, "after the move");
}

#[test]
fn munmap_and_madvise_in_the_middle_of_8_threads() {
    let _wd = watchdog("munmap-madvise", 300);
    let limit = 8 << 20;
    let p = Arc::new(pager(limit));
    let r = Arc::new(p.map(3 * limit).unwrap());
    let pages = r.len() / PAGE_SIZE;
    let versions: Arc<Vec<AtomicU32>> = Arc::new((0..pages).map(|_| AtomicU32::new(0)).collect());
    let mismatches = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..8usize {
            let (r, versions, mismatches) = (Arc::clone(&r), Arc::clone(&versions), &mismatches);
            s.spawn(move || {
                let w = Walk {
                    seed: (t as u64 + 7) * 0x9E37_79B9,
                    rounds: 1200,
                    drop_one_in: 29,
                    drop_unwritten: false,
                    write_mask: 3,
                };
                mismatches.fetch_add(random_walk(&r, &versions, t, 8, &w), Ordering::Relaxed);
            });
        }
        // Meanwhile a second region is filled (forcing eviction of both),
        // partly unmapped by the program and dropped, three times over.
        let p2 = Arc::clone(&p);
        s.spawn(move || {
            for round in 0..3u32 {
                let b = p2.map(8 << 20).unwrap();
                let n = b.len() / PAGE_SIZE;
                for pg in 0..n {
                    write_page(&b, pg, 100 + round);
                }
                // The program unmaps the second half (UNMAP event): its
                // entries go, and the first half is intact.
                let half = b.addr() as usize + b.len() / 2;
                // SAFETY: the second half of region b, which nothing
                // touches from here on (b is dropped below).
                unsafe { rustix::mm::munmap(half as *mut _, b.len() / 2) }.unwrap();
                for pg in 0..n / 2 {
                    assert_eq!(check_page(&b, pg, 100 + round), 0, "region b page {pg}");
                }
                drop(b);
            }
        });
    });
    mismatches.fetch_add(mismatched_words(&r, &versions), Ordering::Relaxed);
    let s = p.stats();
    assert_eq!(mismatches.load(Ordering::Relaxed), 0, "{s:?}");
    assert!(s.evicted_folios > 0 && s.load_faults > 0, "{s:?}");
    drop_and_check_no_entries(&p, r, "by madvise, munmap or the drop");
}

/// The program unmaps part of a region and the kernel hands the addresses
/// to a new mapping; dropping the region must leave that mapping alone (it
/// unmapped the whole original range, so the new mapping vanished and a
/// later touch was SIGSEGV: found by the 100-run loop, 4 crashes in 14).
#[test]
fn dropping_a_partly_unmapped_region_spares_what_now_lives_in_its_hole() {
    let _wd = watchdog("hole-reuse", 60);
    let p = pager(4 << 20);
    let r = p.map(4 << 20).unwrap();
    for pg in 0..r.len() / PAGE_SIZE {
        write_page(&r, pg, 3);
    }
    let half = r.addr() as usize + r.len() / 2;
    // SAFETY: the second half of our region, which nothing touches again.
    unsafe { rustix::mm::munmap(half as *mut _, r.len() / 2) }.unwrap();
    // Someone else's memory, exactly in the hole.
    // SAFETY: a fresh anonymous mapping at an address nothing else owns
    // (NOREPLACE fails rather than clobber).
    let other = unsafe {
        rustix::mm::mmap_anonymous(
            half as *mut _,
            r.len() / 2,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::FIXED_NOREPLACE,
        )
    }
    .expect("map the hole");
    assert_eq!(other as usize, half);
    // SAFETY: our fresh mapping of r.len() / 2 bytes.
    let words = unsafe { std::slice::from_raw_parts_mut(other.cast::<u64>(), r.len() / 16) };
    words.iter_mut().enumerate().for_each(|(i, w)| *w = i as u64 ^ 0xABCD);
    p.reclaim_now();
    for pg in 0..r.len() / PAGE_SIZE / 2 {
        assert_eq!(check_page(&r, pg, 3), 0, "page {pg}");
    }
    drop(r);
    assert!(words.iter().enumerate().all(|(i, w)| *w == i as u64 ^ 0xABCD), "the new mapping changed");
    // SAFETY: our mapping, no longer referenced.
    unsafe { rustix::mm::munmap(other, (4 << 20) / 2) }.unwrap();
}

/// fork with `keep_on_fork`: the child sees exactly the parent's memory at
/// the fork, evicted pages included; afterwards the two diverge.
#[test]
fn a_forked_child_sees_every_page_and_the_two_diverge() {
    let _wd = watchdog("fork", 120);
    let mut cfg = PagerConfig::with_limit(4 << 20);
    cfg.keep_on_fork = true;
    cfg.fault_around = 4 << 10;
    let p = Pager::new(cfg).unwrap();
    let r = p.map(16 << 20).unwrap();
    let pages = r.len() / PAGE_SIZE;
    for pg in 0..pages {
        write_page(&r, pg, 1);
    }
    p.reclaim_now();
    let evicted = (0..pages).step_by(16).filter(|&pg| !r.is_resident(pg * PAGE_SIZE)).count();
    assert!(evicted > 0, "the limit evicted folios before the fork: {:?}", p.stats());
    // A page here and there: folios loaded in part, the rest of each still
    // in the tier at the fork.
    for pg in (0..pages).step_by(16 * 7).map(|pg| pg + 5) {
        assert_eq!(check_page(&r, pg, 1), 0, "page {pg}");
    }
    assert!(p.stats().swapped_bytes > 0, "{:?}", p.stats());
    p.fork_prepare();
    // SAFETY: the child only reads and writes the region through atomics
    // and leaves with _exit; it never touches the pager.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let mut bad = 0;
        for pg in 0..pages {
            bad += check_page(&r, pg, 1);
            write_page(&r, pg, 7);
            bad += check_page(&r, pg, 7);
        }
        // SAFETY: leaves the child at once, running nothing of the parent's.
        unsafe { libc::_exit(i32::from(bad != 0)) };
    }
    p.fork_parent();
    // The parent goes on, under its limit, while the child checks.
    for pg in (0..pages).step_by(3) {
        write_page(&r, pg, 2);
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child saw wrong data: {status:#x}");
    for pg in 0..pages {
        assert_eq!(check_page(&r, pg, if pg % 3 == 0 { 2 } else { 1 }), 0, "page {pg}");
    }
    // Pages the fork left shared are the parent's own again (copy on write
    // broken), so the limit holds once more. While the child held them,
    // a pass may have found nothing it could evict and made the limit
    // soft; reclaim retries after a backoff (up to 2 s), and until then
    // `reclaim_now` returns at once (seen once in 15 runs beside a busy
    // machine).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    p.reclaim_now();
    while p.stats().limit_soft && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        p.reclaim_now();
    }
    let s = p.stats();
    assert!(s.fork_loads > 0, "{s:?}");
    // What the page tables hold of the region, not only what the pager
    // counts: pages the fork left shared were made the parent's own and
    // moved, none stayed behind uncounted.
    // A reclaim pass may still be in flight: its folios (8 of 64 KiB) are
    // no longer counted but still mapped.
    let held = zmem_uffd::PageMap::open().unwrap().mapped(r.addr(), pages).unwrap();
    let resident = held.iter().filter(|&&m| m).count() * PAGE_SIZE;
    let in_flight = 8 * (64 << 10);
    assert!(
        resident <= s.resident_bytes as usize + in_flight && resident <= (4 << 20) + in_flight,
        "{resident} B resident: {s:?}"
    );
    assert!(!s.limit_soft && s.usage_bytes <= (5 << 20), "the limit holds after the fork: {s:?}");
    for pg in 0..pages {
        assert_eq!(check_page(&r, pg, if pg % 3 == 0 { 2 } else { 1 }), 0, "page {pg} after reclaim");
    }
}

/// A fork's load-back keeps the loaded folios' pool entries (`Load::Fork`):
/// once the child is gone (most forks exec at once), the parent's pages are
/// its own again, over the limit, and go out first, into those entries,
/// without compressing. Dropped at load-back, every one of them was
/// compressed again.
#[test]
fn after_a_fork_that_execs_the_folios_loaded_back_go_out_again_without_compressing() {
    // Alone: another test's fork in this process shares these pages with a
    // child of its own, and they stay set aside as shared, uncharged and
    // never evicted, while it lives (1 run in 10 beside a build).
    if !alone("events::after_a_fork_that_execs_the_folios_loaded_back_go_out_again_without_compressing") {
        return;
    }
    let _wd = watchdog("fork-exec", 120);
    let mut cfg = PagerConfig::with_limit(4 << 20);
    cfg.keep_on_fork = true;
    let p = Pager::new(cfg).unwrap();
    let r = p.map(16 << 20).unwrap();
    let pages = r.len() / PAGE_SIZE;
    for pg in 0..pages {
        write_page(&r, pg, 1);
    }
    p.reclaim_now();
    let before = p.tier().stats();
    p.fork_prepare();
    let prog = c"/bin/true";
    let argv = [prog.as_ptr(), std::ptr::null()];
    // SAFETY: the child only execs (async-signal-safe) or leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: a NUL-terminated path and a null-terminated argv.
        unsafe { libc::execv(prog.as_ptr(), argv.as_ptr()) };
        // SAFETY: leaves the child at once, running nothing of the parent's.
        unsafe { libc::_exit(127) };
    }
    p.fork_parent();
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child: {status:#x}");
    let s = p.stats();
    let loaded = s.fork_loads * (64 << 10) / PAGE_SIZE as u64;
    assert!(loaded >= (8 << 20) / PAGE_SIZE as u64, "the fork loaded the evicted folios back: {s:?}");
    // Back under the limit (see `a_forked_child_sees_every_page_and_the_two_diverge`
    // for the soft limit's backoff).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    p.reclaim_now();
    while (p.stats().limit_soft || p.stats().usage_bytes > 4 << 20) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        p.reclaim_now();
    }
    let (s, after) = (p.stats(), p.tier().stats());
    assert!(s.usage_bytes <= 4 << 20, "{s:?}");
    let reused = after.cached_reused - before.cached_reused;
    let compressed = after.zswpout - before.zswpout;
    assert!(reused >= loaded / 2, "{reused} of {loaded} pages went out into their entries: {after:?} {s:?}");
    assert!(compressed < reused / 2, "{compressed} pages compressed again, {reused} not: {after:?}");
    for pg in 0..pages {
        assert_eq!(check_page(&r, pg, 1), 0, "page {pg}");
    }
}

/// A page the program drops while a fork's loads (on the forking thread,
/// not the handler) bring its folio back reads as zeros, and keeps what it
/// is written afterwards. The loads read the folio from the tier, then
/// COPY it (300 ms later here); the drop comes in between. The kernel zaps
/// the page once the handler has read the REMOVE, so a COPY after that put
/// the old bytes back: the program read them after its own MADV_DONTNEED,
/// and lost what it wrote next at the following eviction (the page was
/// remembered as dropped). `zmem bench soak --fault-around 4096` found it.
#[test]
fn a_page_dropped_while_a_fork_loads_its_folio_reads_zeros_and_keeps_what_is_written() {
    let _wd = watchdog("fork-drop", 120);
    let mut cfg = PagerConfig::with_limit(4 << 20);
    cfg.keep_on_fork = true;
    cfg.inject_copy_delay = Duration::from_millis(300);
    let p = Arc::new(Pager::new(cfg).unwrap());
    let r = p.map(16 << 20).unwrap();
    let (pages, ppf) = (r.len() / PAGE_SIZE, 16);
    for pg in 0..pages {
        write_page(&r, pg, 1);
    }
    p.reclaim_now();
    let f = (0..pages / ppf).find(|&f| !r.is_resident(f * ppf * PAGE_SIZE)).expect("an evicted folio");
    // Every other folio is dropped whole: the fork loads only folio f.
    let madvise = |pg: usize, n: usize| {
        let a = (r.addr() + (pg * PAGE_SIZE) as u64) as usize;
        // SAFETY: pages of our region, reached only through atomics.
        unsafe { rustix::mm::madvise(a as *mut _, n * PAGE_SIZE, rustix::mm::Advice::LinuxDontNeed) }.unwrap();
    };
    madvise(0, f * ppf);
    madvise((f + 1) * ppf, pages - (f + 1) * ppf);
    let dropped = f * ppf + 5;
    std::thread::scope(|s| {
        let fork = s.spawn(|| p.fork_prepare());
        std::thread::sleep(Duration::from_millis(100));
        madvise(dropped, 1);
        let w = r.words();
        let left = (0..WORDS).filter(|&i| w[dropped * WORDS + i].load(Ordering::Relaxed) != 0).count();
        assert_eq!(left, 0, "page {dropped} kept {left} words after MADV_DONTNEED");
        write_page(&r, dropped, 2);
        fork.join().unwrap();
    });
    p.fork_parent();
    // Evicted again and read back: the page written after the drop kept
    // what was written.
    p.reclaim_now();
    for pg in f * ppf..(f + 1) * ppf {
        assert_eq!(check_page(&r, pg, if pg == dropped { 2 } else { 1 }), 0, "page {pg}");
    }
}
