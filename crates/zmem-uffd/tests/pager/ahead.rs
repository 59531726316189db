//! Sequential walks: folios loaded and the swap file read ahead, zeros
//! ahead of writes, eviction behind the walk.

use super::*;

/// A sequential read of an evicted region loads folios ahead of its
/// faults (with headroom under the limit), every byte intact; with
/// read-ahead off, every folio is a fault of its own.
#[test]
fn sequential_faults_load_folios_ahead_with_headroom() {
    let _wd = watchdog("readahead", 60);
    for window in [8, 0] {
        let limit = 8 << 20;
        let cfg = PagerConfig { read_ahead: window << 16, ..PagerConfig::with_limit(limit) };
        let p = Pager::new(cfg).unwrap();
        let r = p.map(32 << 20).unwrap();
        let pages = r.len() / PAGE_SIZE;
        for pg in 0..pages {
            write_page(&r, pg, 3);
        }
        // The first quarter, read back in order, fits under the limit.
        p.reclaim_now();
        let quarter = pages / 4;
        let bad: usize = (0..quarter).map(|pg| check_page(&r, pg, 3)).sum();
        let s = p.stats();
        assert_eq!(bad, 0, "{s:?}");
        if window > 0 {
            assert!(s.readahead_folios > 0, "{s:?}");
        } else {
            assert_eq!(s.readahead_folios, 0, "{s:?}");
        }
        let bad: usize = (0..pages).map(|pg| check_page(&r, pg, 3)).sum();
        assert_eq!(bad, 0, "{:?}", p.stats());
    }
}

/// A walk over memory written back to the swap file reads the file ahead
/// of its loads (`SwapFile::prefetch`, through io_uring): the loads find
/// their slots read already, and every byte is intact.
#[test]
fn a_walk_over_written_back_memory_reads_the_swap_file_ahead() {
    let _wd = watchdog("swap-readahead", 60);
    let mut cfg = PagerConfig::with_limit(8 << 20);
    cfg.tier.max_pool_percent = 10;
    let (p, r) = filled_and_reclaimed(cfg, 9);
    let pages = r.len() / PAGE_SIZE;
    let sf = p.tier().swap_file().expect("a swap file");
    let before = sf.stats();
    assert!(before.pages_written > 0, "nothing was written back: {before:?}");
    let bad: usize = (0..pages).map(|pg| check_page(&r, pg, 9)).sum();
    let after = sf.stats();
    assert_eq!(bad, 0, "{:?} {after:?}", p.stats());
    if !after.readahead {
        eprintln!("no swap-in read-ahead here (no O_DIRECT, or no io_uring): {after:?}");
    } else {
        let hits = after.readahead_hits - before.readahead_hits;
        let reads = after.pages_read - before.pages_read;
        // The walk's first folios come before it is known for one.
        assert!(hits * 10 >= reads * 8, "{hits} of {reads} slot reads were read ahead: {after:?}");
        // The tier's counters (`zmem stats`) are the file's.
        let t = p.tier().stats();
        assert_eq!((t.swap_readahead_blocks, t.swap_readahead_hits), (after.readahead_blocks, after.readahead_hits));
    }
}

/// A walk down an evicted region (Python's list_dealloc frees a list's
/// items last to first) and two walks up interleaved (a list's array and
/// the objects it points to) each load folios ahead: most folios come in
/// ahead of a fault, every byte intact.
#[test]
fn backward_and_interleaved_walks_load_folios_ahead() {
    let _wd = watchdog("readahead-streams", 60);
    let limit = 16 << 20;
    // Each walk starts at the low watermark (`reclaim_now`), low enough
    // that its 4 MiB and what it reads ahead stay under the high one: with
    // reclaim running during a walk, folios read ahead but not yet reached
    // are the first it evicts, and on a busy machine the count of faults
    // then measured the scheduler (32 faults for 64 folios, once in a
    // repeat run beside other builds). Under 8M that was not so: the pool
    // counts too, and loads keep their entries there, so 3.2 + 4 + 1 MiB
    // crossed the high watermark, and beside a CI run the interleaved walks
    // took 35 faults (63 direct reclaim waits). 16M leaves ~4 MiB to spare.
    let cfg = PagerConfig { read_ahead: 8 << 16, low_watermark_percent: 40, ..PagerConfig::with_limit(limit) };
    let (p, r) = filled_and_reclaimed(cfg, 5);
    let pages = r.len() / PAGE_SIZE;
    let ppf = (64 << 10) / PAGE_SIZE;
    // Down: 4 MiB, from its last page to its first.
    let before = p.stats();
    let n = (4 << 20) / PAGE_SIZE;
    let bad: usize = (0..n).rev().map(|pg| check_page(&r, pg, 5)).sum();
    let s = p.stats();
    assert_eq!(bad, 0, "{s:?}");
    let (faults, ahead) = (s.load_faults - before.load_faults, s.readahead_folios - before.readahead_folios);
    assert!(ahead > faults, "down: {faults} faults, {ahead} folios loaded ahead; {s:?}");
    // Up, two walks at once: 2 MiB from a quarter in and 2 MiB from half way.
    p.reclaim_now();
    let before = p.stats();
    let (a, b) = (pages / 4, pages / 2);
    let m = (2 << 20) / PAGE_SIZE;
    let bad: usize = (0..m).map(|i| check_page(&r, a + i, 5) + check_page(&r, b + i, 5)).sum();
    let s = p.stats();
    assert_eq!(bad, 0, "{s:?}");
    let (faults, ahead) = (s.load_faults - before.load_faults, s.readahead_folios - before.readahead_folios);
    assert!(faults < (2 * m / ppf) as u64 / 2, "interleaved: {faults} faults, {ahead} ahead; {s:?}");
    let bad: usize = (0..pages).map(|pg| check_page(&r, pg, 5)).sum();
    assert_eq!(bad, 0, "{:?}", p.stats());
}

/// A stride (one page read mid-folio from each of many adjacent evicted
/// folios, as sqlite's page cache is walked) is no stream: each fault loads
/// only the block around its page, and nothing is read ahead. Loading whole
/// folios and reading ahead there took sqlite under half its peak from 9 s
/// to 222 s.
#[test]
fn a_stride_over_adjacent_folios_loads_blocks_and_reads_nothing_ahead() {
    let _wd = watchdog("stride", 60);
    let limit = 8 << 20;
    let cfg = PagerConfig { low_watermark_percent: 40, ..PagerConfig::with_limit(limit) };
    let (p, r) = filled_and_reclaimed(cfg, 7);
    let pages = r.len() / PAGE_SIZE;
    let ppf = (64 << 10) / PAGE_SIZE;
    let before = p.stats();
    // Page 9 of each of 64 adjacent folios, from 1 MiB in.
    let first = (1 << 20) / PAGE_SIZE / ppf;
    let bad: usize = (first..first + 64).map(|f| check_page(&r, f * ppf + 9, 7)).sum();
    let s = p.stats();
    assert_eq!(bad, 0, "{s:?}");
    let faults = s.load_faults - before.load_faults;
    let partial = s.partial_load_faults - before.partial_load_faults;
    let ahead = s.readahead_folios - before.readahead_folios;
    assert!(faults >= 32, "the folios were evicted: {faults} load faults; {s:?}");
    // A folio whose store was rejected (`eviction_rejects`: on a busy
    // machine the pool can fill before its writeback catches up) is held
    // raw and mapped whole at its fault; once in a repeat run beside a
    // MariaDB load, 63 of 64 loads were blocks with one rejection.
    assert!(faults - partial <= s.eviction_rejects, "every load of an entry was a block; {s:?}");
    assert_eq!(ahead, 0, "nothing read ahead; {s:?}");
    let bad: usize = (0..pages).map(|pg| check_page(&r, pg, 7)).sum();
    assert_eq!(bad, 0, "{:?}", p.stats());
}

/// A walk that reads back more than the limit (usemem's read phase, a
/// scan, a copy) loads each evicted folio once and compresses nothing:
/// the folios it has gone past are the victims (`Lru::once`), and their
/// kept entries are reused. Under LRU it pushed out the written folios it
/// was about to read, compressing each, and then loaded them back.
#[test]
fn a_walk_over_more_than_the_limit_evicts_behind_itself() {
    let _wd = watchdog("walk", 120);
    walk_evicts_behind_itself(PagerConfig::with_limit(32 << 20));
}

/// The same through the multi-engine device, where a reclaim pass's pages
/// are submitted at once (`Tier::store_many`). With the pool's limit checked
/// for every folio before any was committed, each pass took the pool past its
/// limit and the next pass's `shrink_to_limit` dropped the walk's kept
/// entries: 18,628 and 19,200 of ~19,400 evicted pages were compressed again.
#[test]
fn a_walk_through_the_engines_evicts_behind_itself() {
    let _wd = watchdog("walk-engines", 120);
    let mut cfg = PagerConfig::with_limit(32 << 20);
    cfg.tier.engines = Some(zmem_compress::EnginesConfig {
        engines: 2,
        sync_on_caller: true,
        idle_spin: Duration::ZERO,
        completion_timeout: Duration::from_micros(200),
        wq_depth: 512,
        ..Default::default()
    });
    walk_evicts_behind_itself(cfg);
}

fn walk_evicts_behind_itself(cfg: PagerConfig) {
    let p = Pager::new(cfg).unwrap();
    let r = p.map(96 << 20).unwrap();
    let pages = r.len() / PAGE_SIZE;
    for pg in 0..pages {
        write_page(&r, pg, 11);
    }
    // Down to the low watermark: every eviction from here on is the walk's.
    p.reclaim_now();
    let (t0, s0) = (p.tier().stats(), p.stats());
    let evicted = pages as u64 - s0.resident_bytes / PAGE_SIZE as u64;
    let bad: usize = (0..pages).map(|pg| check_page(&r, pg, 11)).sum();
    let (t, s) = (p.tier().stats(), p.stats());
    assert_eq!(bad, 0, "{s:?}");
    let (stored, loaded) = (t.zswpout - t0.zswpout, t.zswpin - t0.zswpin);
    eprintln!("walk: {evicted} pages evicted, {stored} compressed, {loaded} loaded");
    assert!(s.walk_evictions > 0, "{s:?}");
    // What is left over comes from the walk's start (its first faults are
    // no walk yet: `CONFIRM`; reclaim leaves its newest folios alone) and
    // from clean copies the pool's shrinker dropped. Typically 2-5% are
    // stored and 2-3% loaded twice; before the once list, 10-15% and 10%.
    assert!(stored * 4 <= evicted, "{stored} pages compressed for {evicted} evicted: {t:?} {s:?}");
    assert!(loaded <= evicted + evicted / 20, "{loaded} pages loaded for {evicted} evicted: {t:?} {s:?}");
    // Staging is freed once several passes filled it (or a burst of
    // reclaim ends), not after every pass.
    eprintln!("walk: {} reclaim passes, {} staging frees", s.reclaim_passes, s.staging_frees);
    assert!(s.reclaim_passes > 0 && s.staging_frees * 3 <= s.reclaim_passes * 2, "{s:?}");
}

#[test]
fn sequential_writes_to_fresh_memory_get_zeros_ahead_and_reads_do_not() {
    let _wd = watchdog("zero-ahead", 60);
    for window in [8, 0] {
        let p = Pager::new(PagerConfig { read_ahead: window << 16, ..PagerConfig::with_limit(16 << 20) }).unwrap();
        let r = p.map(8 << 20).unwrap();
        let pages = r.len() / PAGE_SIZE;
        // Reading fresh memory maps the zero page: nothing ahead.
        let zero: u64 = (0..pages).map(|pg| r.words()[pg * WORDS].load(Ordering::Relaxed)).sum();
        assert_eq!(zero, 0);
        assert_eq!(p.stats().zero_ahead_folios, 0, "{:?}", p.stats());
        let r2 = p.map(8 << 20).unwrap();
        // Writing the second region in order: folios ahead get zeros, so
        // fewer faults, and every page still reads what was written (and
        // the untouched words of each page are zero).
        for pg in 0..pages {
            r2.words()[pg * WORDS + 1].store(pg as u64 + 1, Ordering::Relaxed);
        }
        let s = p.stats();
        if window > 0 {
            assert!(s.zero_ahead_folios > 0, "{s:?}");
            assert!(s.zero_faults < 2 * (pages / 16) as u64, "{s:?}");
        } else {
            assert_eq!(s.zero_ahead_folios, 0, "{s:?}");
        }
        for pg in 0..pages {
            let w = &r2.words()[pg * WORDS..(pg + 1) * WORDS];
            assert_eq!(w[1].load(Ordering::Relaxed), pg as u64 + 1, "page {pg}");
            assert!(w.iter().enumerate().all(|(i, x)| i == 1 || x.load(Ordering::Relaxed) == 0), "page {pg}");
        }
    }
}
