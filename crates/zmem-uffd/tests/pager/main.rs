//! The pager on real userfaultfd, real threads and the real tier: every byte
//! of every page is checked. One file a family of tests.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use zmem_tier::TierConfig;
#[path = "../common/child.rs"]
mod child;
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/pages.rs"]
mod pages;

mod ahead;
mod events;
mod hotness;
mod integrity;
mod staging;

use child::{alone, in_child, run_child};
use common::watchdog;
use pages::{check_page, write_page, WORDS};
use zmem_common::PAGE_SIZE;
use zmem_uffd::{Pager, PagerConfig, Region};

/// A pager under `cfg` with a 32 MiB region written with `v`, evicted down
/// to the low watermark: where the read-ahead tests walk.
fn filled_and_reclaimed(cfg: PagerConfig, v: u32) -> (Pager, Region) {
    let p = Pager::new(cfg).unwrap();
    let r = p.map(32 << 20).unwrap();
    for pg in 0..r.len() / PAGE_SIZE {
        write_page(&r, pg, v);
    }
    p.reclaim_now();
    (p, r)
}

fn pager(limit: usize) -> Pager {
    Pager::new(PagerConfig::with_limit(limit)).expect("pager")
}

/// A page dropped with MADV_DONTNEED: it must read as zeros.
const DROPPED: u32 = u32::MAX;

fn check_or_zero(r: &Region, pg: usize, v: u32) -> usize {
    if v == DROPPED {
        r.words()[pg * WORDS..(pg + 1) * WORDS].iter().filter(|w| w.load(Ordering::Relaxed) != 0).count()
    } else {
        check_page(r, pg, v)
    }
}

/// The pager's counters once `ready` holds of them, or after 2 s: the
/// handler counts a fault just after the ioctl that wakes the faulting
/// thread, so a count may trail the thread for a moment.
fn stats_when(p: &Pager, ready: impl Fn(&zmem_uffd::PagerStats) -> bool) -> zmem_uffd::PagerStats {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        let s = p.stats();
        if ready(&s) || std::time::Instant::now() >= deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The words that differ, over every page written (version above 0), from
/// its last version: zeros where it was dropped (`DROPPED`).
fn mismatched_words(r: &Region, versions: &[AtomicU32]) -> usize {
    (0..versions.len())
        .map(|pg| match versions[pg].load(Ordering::Relaxed) {
            0 => 0,
            v => check_or_zero(r, pg, v),
        })
        .sum()
}

/// Drops `r` (the region, or the last handle on it) and checks that the
/// tier keeps no entry of it: none was leaked by `what` or by the drop.
fn drop_and_check_no_entries<R>(p: &Pager, r: R, what: &str) {
    drop(r);
    let t = p.tier().stats();
    assert_eq!((t.stored_pages, t.swap_pages), (0, 0), "entries leaked {what}: {t:?}");
}

/// How a [`random_walk`] worker treats the pages it picks.
struct Walk {
    /// The xorshift state it starts from.
    seed: u64,
    rounds: usize,
    /// One pick in this many drops its page (`MADV_DONTNEED`).
    drop_one_in: u64,
    /// Whether a page never written may be dropped too.
    drop_unwritten: bool,
    /// A pick not dropped writes the page's next version where
    /// `x & write_mask == 0` (and where it was never written), else checks it.
    write_mask: u64,
}

/// A random walk by thread `t` of `threads` over its own pages of `r`
/// (every `threads`th), as `w` says, recording each page's last version in
/// `versions` (`DROPPED`: it reads as zeros). Returns the words it found
/// different from what was last written.
fn random_walk(r: &Region, versions: &[AtomicU32], t: usize, threads: usize, w: &Walk) -> usize {
    let pages = versions.len();
    let (mut x, mut mismatches) = (w.seed, 0);
    for _ in 0..w.rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let pg = ((x as usize >> 8) % (pages / threads)) * threads + t;
        let v = versions[pg].load(Ordering::Relaxed);
        if x % w.drop_one_in == 0 && (w.drop_unwritten || v != 0) {
            let a = r.addr() as usize + pg * PAGE_SIZE;
            // SAFETY: one page of our region, reached only through
            // atomics; its owner thread is this one.
            unsafe { rustix::mm::madvise(a as *mut _, PAGE_SIZE, rustix::mm::Advice::LinuxDontNeed) }.unwrap();
            versions[pg].store(DROPPED, Ordering::Relaxed);
        } else if x & w.write_mask == 0 || v == 0 {
            let nv = if v == DROPPED { 1 } else { v + 1 };
            write_page(r, pg, nv);
            versions[pg].store(nv, Ordering::Relaxed);
        } else {
            mismatches += check_or_zero(r, pg, v);
        }
    }
    mismatches
}

/// `threads` workers each on a [`random_walk`] of their own pages of `r`,
/// walked as `walk(t)` says, all to the end. Returns each page's last
/// version and the words the workers found wrong.
fn random_walks(r: &Region, threads: usize, walk: impl Fn(usize) -> Walk + Sync) -> (Vec<AtomicU32>, usize) {
    let versions: Vec<AtomicU32> = (0..r.len() / PAGE_SIZE).map(|_| AtomicU32::new(0)).collect();
    let mismatches = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (versions, mismatches, walk) = (&versions, &mismatches, &walk);
            s.spawn(move || mismatches.fetch_add(random_walk(r, versions, t, threads, &walk(t)), Ordering::Relaxed));
        }
    });
    (versions, mismatches.into_inner())
}
