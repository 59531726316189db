//! Faults on folios in the middle of eviction: in staging, waiting for a
//! pass, split by a move, and where faults come from in user mode only.

use super::*;

/// The words of the page at `addr` that differ from page `p` at version
/// `v` (a page a partial mremap moved out of its region).
fn check_page_at(addr: u64, p: usize, v: u32) -> usize {
    // SAFETY: `addr` is a page of a live mapping of this test, reached only
    // through atomics and the kernel while this borrow lives.
    let w = unsafe { std::slice::from_raw_parts(addr as *const std::sync::atomic::AtomicU64, WORDS) };
    (0..WORDS).filter(|&i| w[i].load(Ordering::Relaxed) != pages::word(p, v, i)).count()
}

/// A fresh mapping of `n` pages, forgotten (an mremap moves over it).
fn fresh(n: usize) -> u64 {
    let m = zmem_uffd::Mapping::new(n * PAGE_SIZE).unwrap();
    let a = m.addr();
    std::mem::forget(m);
    a
}

/// Moves `n` pages at `from` over the mapping at `to` (mremap).
fn move_to(from: u64, n: usize, to: u64) {
    let len = n * PAGE_SIZE;
    // SAFETY: moves pages of this test's region, reached only through
    // atomics, over its own forgotten mapping.
    let new =
        unsafe { rustix::mm::mremap_fixed(from as *mut _, len, len, rustix::mm::MremapFlags::MAYMOVE, to as *mut _) };
    assert_eq!(new.unwrap() as u64, to);
}

/// A pager whose stores sleep `store` and whose MOVEs sleep `mv` (before
/// they move), with an 8 MiB region written under 4 MiB, and folio 0
/// evicted and then its page 0 alone loaded back: pages 1..16 stay in the
/// tier. Returns how long a pass takes at least, too.
fn folio_0_partly_back(store: Duration, mv: Duration) -> (Pager, Region, Duration) {
    let ppf = 16;
    let cfg = PagerConfig {
        folio_size: ppf * PAGE_SIZE,
        fault_around: PAGE_SIZE,
        read_ahead: 0,
        inject_store_delay: store,
        inject_move_delay: mv,
        ..PagerConfig::with_limit(4 << 20)
    };
    let p = Pager::new(cfg).unwrap();
    let r = p.map(8 << 20).unwrap();
    for pg in 0..r.len() / PAGE_SIZE {
        write_page(&r, pg, 1);
    }
    bring_back_page_0(&p, &r, store + mv);
    (p, r, store + mv)
}

/// Evicts folio 0 (reads elsewhere make it the coldest), waits for its pass
/// (`pass`, twice over), and loads its page 0 alone back. Should the pass
/// still be under way, the read takes the whole folio back from staging;
/// the tests then try again.
fn bring_back_page_0(p: &Pager, r: &Region, pass: Duration) {
    push_out_folio_0(p, r);
    std::thread::sleep(2 * pass + Duration::from_millis(50));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !r.is_resident(0) && std::time::Instant::now() < deadline {
        assert_eq!(check_page(r, 0, 1), 0);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(r.is_resident(0), "{:?}", p.stats());
}

/// Reads the other folios until folio 0 (the coldest, once they have all
/// been read since) is isolated for eviction, and returns at once. (Those
/// reads may wait for passes too.) At once if it is not resident.
fn push_out_folio_0(p: &Pager, r: &Region) {
    let (ppf, pages) = (16, r.len() / PAGE_SIZE);
    let mut rounds = 0;
    while r.is_resident(0) && rounds < 20 * pages {
        let pg = ppf + rounds % (pages - ppf);
        assert_eq!(check_page(r, pg, 1), 0, "page {pg}");
        rounds += 1;
    }
    assert!(!r.is_resident(0), "folio 0 was never evicted again: {:?}", p.stats());
}

/// A fault on a folio whose pass is being stored is served from its
/// staging slot (`rescue`), as the kernel's swap cache serves a fault on a
/// folio under writeback: no wait for the pass (a 150 ms store here), the
/// folio resident again, and every page as written, the ones a partial load
/// left in the tier included. Before, such a fault waited for the whole pass
/// (1.4 ms a fault under `xz`, ARCHITECTURE.md).
#[test]
fn a_fault_on_a_folio_being_stored_takes_it_back_from_staging() {
    let _wd = watchdog("rescue", 90);
    let delay = Duration::from_millis(150);
    let (p, r, pass) = folio_0_partly_back(delay, Duration::ZERO);
    let mut rescued = None;
    for _attempt in 0..5 {
        push_out_folio_0(&p, &r);
        let before = p.stats();
        let t = std::time::Instant::now();
        // Page 0 is mapped until the MOVE (microseconds after the
        // isolation); a read after it faults.
        while p.stats().rescued_folios == before.rescued_folios && t.elapsed() < delay / 2 {
            assert_eq!(check_page(&r, 0, 1), 0, "page 0");
        }
        let s = p.stats();
        if s.rescued_folios > before.rescued_folios {
            rescued = Some((before, s, t.elapsed()));
            break;
        }
        // The pass ended first (this thread was off its CPU): again.
        bring_back_page_0(&p, &r, pass);
    }
    let (before, s, took) = rescued.expect("no read of five found folio 0 being stored");
    assert_eq!(s.rescued_folios - before.rescued_folios, 1, "{s:?}");
    assert!(took < delay / 2, "the read took {took:?}: it waited for the pass");
    assert!(r.is_resident(0), "{s:?}");
    for pg in 0..16 {
        assert_eq!(check_page(&r, pg, 1), 0, "page {pg}");
    }
    // Once the pass is over (its entries for folio 0 dropped), every page
    // still reads right.
    std::thread::sleep(2 * delay);
    for pg in 0..r.len() / PAGE_SIZE {
        assert_eq!(check_page(&r, pg, 1), 0, "page {pg}");
    }
}

/// A fault that cannot be served from staging (here: the region has a hole,
/// which the rescue leaves to `finish`) waits for its folio's pass to be
/// stored. `eviction_waits` counts it once, however often it was looked at
/// again (it counted every look: over a thousand for one fault), and
/// `eviction_wait_ns` holds how long it waited. The page read is one a
/// partial load left in the tier, so it faults whether or not the MOVE has
/// run yet.
#[test]
fn a_fault_that_waits_for_a_pass_counts_one_wait_and_how_long() {
    let _wd = watchdog("eviction wait", 90);
    let delay = Duration::from_millis(150);
    let (p, r, pass) = folio_0_partly_back(delay, Duration::ZERO);
    // The region's last page unmapped: a hole.
    let last = r.addr() + (r.len() - PAGE_SIZE) as u64;
    // SAFETY: a page of this test's region, reached only through atomics
    // and never again after this.
    assert_eq!(unsafe { libc::munmap(last as *mut _, PAGE_SIZE) }, 0);
    let mut waited = None;
    for _attempt in 0..5 {
        push_out_folio_0(&p, &r);
        let before = p.stats();
        assert_eq!(check_page(&r, 1, 1), 0, "page 1");
        // The handler adds the wait once its COPY (which woke this thread)
        // has returned.
        let s = stats_when(&p, |s| {
            s.eviction_waits == before.eviction_waits || s.eviction_wait_ns > before.eviction_wait_ns
        });
        let (n, ns) = (s.eviction_waits - before.eviction_waits, s.eviction_wait_ns - before.eviction_wait_ns);
        if n > 0 {
            waited = Some((n, ns, before, s));
            break;
        }
        // The pass had ended before the read (this thread was off its CPU
        // for the whole delay): again.
        bring_back_page_0(&p, &r, pass);
    }
    let (n, ns, before, s) = waited.expect("no read of five found its folio being stored");
    // One read, one fault; a thread woken before its page is there (a
    // signal, a wake for a neighbouring page) faults again, and that is a
    // fault too.
    assert!((1..=3).contains(&n), "{n} waits for one read: {s:?}");
    assert!(ns >= 1_000_000 && ns < 10 * n * delay.as_nanos() as u64, "waited {ns} ns: {s:?}");
    assert_eq!(s.rescued_folios, before.rescued_folios, "a region with a hole is not rescued: {s:?}");
    for pg in 0..r.len() / PAGE_SIZE - 1 {
        assert_eq!(check_page(&r, pg, 1), 0, "page {pg}");
    }
}

/// Two mremaps that each move part of one folio while reclaim is evicting
/// it (two vectors glibc grows side by side, whose ends share a folio,
/// moved at once): each part is a region of its own, whose folio waits
/// for the evictor (Evicting) and is passed on when it finishes. The pager
/// kept one such forward per folio, so the second mremap's replaced the
/// first's: that part stayed Evicting for good, and the first fault on a
/// page of it that had been evicted hung the program (`zmem run` of
/// tests/data/mremap.c, once in CI). Here the parts are pages the tier
/// still holds (a partial load left them there), so reading them faults.
/// Also: a page of the first part moved on again while it waits (its
/// forward is passed on in turn; it hung too), and a page of the second
/// dropped while it waits (its entry went nowhere: it read back its old
/// bytes instead of zeros). The eviction is slowed (`inject_store_delay`)
/// so that all of it lands inside one. Checked: each of the three fails
/// with the build before.
#[test]
fn two_parts_of_a_folio_moved_while_it_is_evicted_both_load_where_they_went() {
    let _wd = watchdog("two forwards", 90);
    let ppf = 16;
    let cfg = PagerConfig {
        folio_size: ppf * PAGE_SIZE,
        // A fault loads its page alone: the rest of the folio stays in the tier.
        fault_around: PAGE_SIZE,
        read_ahead: 0,
        inject_store_delay: Duration::from_millis(150),
        ..PagerConfig::with_limit(4 << 20)
    };
    let p = Arc::new(Pager::new(cfg).unwrap());
    let r = p.map(8 << 20).unwrap();
    let pages = r.len() / PAGE_SIZE;
    for pg in 0..pages {
        write_page(&r, pg, 1);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while r.is_resident(0) && std::time::Instant::now() < deadline {
        p.reclaim_now();
    }
    assert!(!r.is_resident(0), "folio 0 was never evicted: {:?}", p.stats());
    // Page 0 alone comes back; pages 1..16 stay in the tier. (Reclaim
    // may still be at work, and take the folio again.)
    p.reclaim_now();
    // Until it is Resident: while Evicting, page 0 may still be mapped
    // (the evictor sleeps before its MOVE) and reads without a fault.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !r.is_resident(0) && std::time::Instant::now() < deadline {
        assert_eq!(check_page(&r, 0, 1), 0);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(r.is_resident(0), "{:?}", p.stats());
    // Folio 0 is now the coldest resident folio: reads elsewhere push it
    // out, and the eviction that takes it sleeps with it Evicting.
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            for f in (1..pages / ppf).cycle().take(20 * pages / ppf) {
                if let Some(pg) = (f * ppf..(f + 1) * ppf).find(|&pg| check_page(&r, pg, 1) != 0) {
                    return Err(format!("page {pg} read back wrong"));
                }
                if !r.is_resident(0) {
                    return Ok(());
                }
            }
            Err(format!("folio 0 was never evicted again: {:?}", p.stats()))
        });
        while r.is_resident(0) && !reader.is_finished() {
            std::hint::spin_loop();
        }
        assert!(!r.is_resident(0), "{:?}", reader.join());
        // The mremaps while the evictor sleeps before its store, each
        // returning once the handler has read its event (so the part is a
        // region of its own by then). The first part's thread then moves
        // on a page of it: a folio waiting for its forward, moved on in
        // turn. The second's drops a page of its part (its entry must go
        // when the forward is passed on: read, it is zeros).
        let (x, y, z) = (fresh(3), fresh(3), fresh(1));
        let base = r.addr();
        let movers = [
            s.spawn(move || {
                move_to(base + 2 * PAGE_SIZE as u64, 3, x);
                move_to(x + PAGE_SIZE as u64, 1, z);
            }),
            s.spawn(move || {
                move_to(base + 9 * PAGE_SIZE as u64, 3, y);
                // SAFETY: a page of this test's, reached only through atomics.
                let rc = unsafe { libc::madvise((y + PAGE_SIZE as u64) as *mut _, PAGE_SIZE, libc::MADV_DONTNEED) };
                assert_eq!(rc, 0);
            }),
        ];
        movers.into_iter().for_each(|m| m.join().unwrap());
        reader.join().unwrap().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while p.stats().split_regions < 3 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(p.stats().split_regions, 3, "{:?}", p.stats());
        // Every moved page where it went: these faults hung.
        let page = |a: u64, i: usize| a + (i * PAGE_SIZE) as u64;
        for (at, pg) in [(page(x, 0), 2), (page(z, 0), 3), (page(x, 2), 4), (page(y, 0), 9), (page(y, 2), 11)] {
            assert_eq!(check_page_at(at, pg, 1), 0, "page {pg}, moved to {at:#x}: {:?}", p.stats());
        }
        // SAFETY: as in `check_page_at`.
        let dropped = unsafe { std::slice::from_raw_parts(page(y, 1) as *const std::sync::atomic::AtomicU64, WORDS) };
        let nonzero = dropped.iter().filter(|w| w.load(Ordering::Relaxed) != 0).count();
        let old = (0..WORDS).filter(|&i| dropped[i].load(Ordering::Relaxed) == pages::word(10, 1, i)).count();
        assert_eq!(nonzero, 0, "a dropped page came back ({old} words as before): {:?}", p.stats());
        // The rest of folio 0 stayed, and the rest of the region.
        for pg in (0..pages).filter(|&pg| !(2..5).contains(&pg) && !(9..12).contains(&pg)) {
            assert_eq!(check_page_at(page(base, pg), pg, 1), 0, "page {pg}");
        }
        for (a, n) in [(x, 3), (y, 3), (z, 1)] {
            // SAFETY: the moved pages (and the hole in x), no longer used.
            unsafe { rustix::mm::munmap(a as *mut _, n * PAGE_SIZE) }.unwrap();
        }
    });
}

/// A userfaultfd for faults from user mode only (what a user without
/// privileges gets on a default kernel): the kernel's own copy into an
/// evicted page fails, so a pipe's `read(2)` into it returns EFAULT. The
/// pages `unmapped_run` names are exactly the ones to touch from user mode
/// first: once they are, the same read lands, and every other byte of the
/// region is what was written.
#[test]
fn where_faults_come_from_user_mode_only_the_unmapped_runs_are_what_a_read_needs_touched() {
    let _wd = watchdog("user-mode-only", 120);
    let cfg = PagerConfig { open_mode: zmem_uffd::OpenMode::UserModeOnly, ..PagerConfig::with_limit(8 << 20) };
    let p = Pager::new(cfg).unwrap();
    assert!(p.user_mode_only());
    let r = p.map(32 << 20).unwrap();
    let (start, end) = (r.addr(), r.addr() + r.len() as u64);
    assert_eq!(p.unmapped_run(start, end), Some((start, end)), "never touched: all of it");
    assert_eq!(p.unmapped_run(start + 10, start + 11), Some((start, start + PAGE_SIZE as u64)));
    let pages = r.len() / PAGE_SIZE;
    // Taken before the writes: reclaim runs behind them, 4x the limit.
    let epoch = p.epoch();
    for pg in 0..pages {
        write_page(&r, pg, 5);
    }
    p.reclaim_now();
    assert!(p.epoch() > epoch, "evictions move the epoch");
    // The last page, read once, is resident; the first ones were evicted.
    let last = end - PAGE_SIZE as u64;
    assert_eq!(check_page(&r, pages - 1, 5), 0);
    assert_eq!(p.unmapped_run(last, end), None);
    let (a, b) = p.unmapped_run(start, end).expect("evicted pages");
    assert!(b > a && (b - a) as usize % PAGE_SIZE == 0);
    assert!(p.unmapped_run(b, end).is_none_or(|(c, _)| c > b), "a run ends at a mapped page");

    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into fds.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let data: Vec<u8> = (0..PAGE_SIZE).map(|i| (i * 7 % 251) as u8).collect();
    // SAFETY: a write of data's bytes.
    assert_eq!(unsafe { libc::write(fds[1], data.as_ptr().cast(), PAGE_SIZE) }, PAGE_SIZE as isize);
    let read = || {
        // SAFETY: page `a` of our region, reached only through atomics and
        // the kernel; the pipe holds one page.
        let n = unsafe { libc::read(fds[0], a as *mut libc::c_void, PAGE_SIZE) };
        (n, std::io::Error::last_os_error().raw_os_error())
    };
    assert_eq!(read(), (-1, Some(libc::EFAULT)), "the kernel reached an evicted page");
    // Touched from user mode, as the preload shim does before an I/O call.
    let mut landed = false;
    for _ in 0..8 {
        let mut at = a;
        while let Some((x, y)) = p.unmapped_run(at, a + PAGE_SIZE as u64) {
            for pg in (x..y).step_by(PAGE_SIZE) {
                // SAFETY: a page of our region, mapped readable.
                unsafe { std::ptr::read_volatile(pg as *const u8) };
            }
            at = y;
        }
        match read() {
            (n, _) if n == PAGE_SIZE as isize => {
                landed = true;
                break;
            }
            // Evicted again between the touch and the read.
            (-1, Some(libc::EFAULT)) => continue,
            other => panic!("read: {other:?}"),
        }
    }
    assert!(landed, "the read never landed");
    for fd in fds {
        // SAFETY: one of the pipe's descriptors, closed once.
        unsafe { libc::close(fd) };
    }
    let first = ((a - start) as usize) / PAGE_SIZE;
    let words = &r.words()[first * WORDS..(first + 1) * WORDS];
    let got: Vec<u8> = words.iter().flat_map(|w| w.load(Ordering::Relaxed).to_ne_bytes()).collect();
    assert_eq!(got, data, "the page the read filled");
    for pg in (0..pages).filter(|&pg| pg != first) {
        assert_eq!(check_page(&r, pg, 5), 0, "page {pg}");
    }
}
