//! The pool's share of the limit, balanced by what misses cost.
//!
//! The limit bounds resident folios and the pool together, so every byte
//! the pool may take is a byte less for resident pages. Moving one step
//! (`BALANCE_STEP` points of the limit, Δ bytes) either way trades misses
//! of one kind for the other, and each kind is counted where it happens,
//! within Δ (ARC's ghost lists, by distance):
//! - a *refault* within Δ: a fault on a folio evicted fewer folio
//!   evictions before than Δ holds folios (the refault distance of
//!   mm/workingset.c): its first fault back, and each later one on a page a
//!   partial load left in the tier (`note_swapped_refault`). Δ more
//!   resident bytes would have kept it;
//! - a *swap refault* within Δ: a page loaded from the swap file fewer
//!   pages after its writeback than Δ more pool keeps in memory (the
//!   tier's `swap_refaults`, with its window set here: `step_keeps`). Δ
//!   more pool would have kept it. It costs a read and a decryption besides
//!   the decompression;
//! - a *cold pool load*: a page loaded from the pool's oldest window of
//!   that size (the tier's `cold_pool_loads`, by its place among the
//!   entries still there, which loads take from anywhere). Δ
//!   less pool would have written it back, and it would have been a swap
//!   refault.
//!
//! Each kind is weighed by what it costs, all counted in faults: a refault, one
//! fault from the pool where a resident page cost nothing; a swap refault or a
//! cold pool load, a fault from the swap file where one from the pool would do,
//! `swap_fault_extra` pool faults more, as the handlers time the two. The share
//! moves one step at a time between the configured bounds: up, every
//! `BALANCE_INTERVAL`, when the swap refaults weigh more than the refaults and
//! the pool fills its share to within a step or wrote back since the last look
//! (`fills`); down, at most every `SHRINK_INTERVAL`, when the refaults weigh
//! more than the swap refaults and cold pool loads together since the last time
//! it could. Misses from further back count for no side: a walk over several
//! times what memory holds reads it all back, whatever the share. A step down
//! starts from what the pool holds, not from its share: a share the pool does
//! not fill gives resident pages nothing; but it goes to no less than half the
//! share in one look, since a pool still filling holds far less than it will
//! (`step_down`).
//!
//! zswap has no such knob because cgroup v1 does not charge its pool to
//! the cgroup; under cgroup v2 with `memory.zswap.max` the pool and the
//! anon LRU share one limit too, and the kernel's balance is reclaim's own
//! (anon pages go to zswap while that frees memory, and the zswap shrinker
//! writes back in proportion to pressure).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Inner;
use zmem_common::PAGE_SIZE;

/// How often the share is looked at, and may grow.
pub(super) const BALANCE_INTERVAL: Duration = Duration::from_millis(50);
/// How often it may shrink, judged on the misses since the last time. A
/// step down writes back what the pool held beyond its new share, and
/// whether that was cold shows only as the swap refaults that follow; at
/// every 50 ms (and without the cold pool loads), a perl hash under 96M
/// went from 50% to 20% before any showed, and took 85 s against 49 s.
pub(super) const SHRINK_INTERVAL: Duration = Duration::from_secs(1);
/// How far it moves in one step, percentage points of the limit.
pub(super) const BALANCE_STEP: u32 = 5;
/// Misses below which the share stays where it is.
const QUIET: u64 = 8;
/// What a fault that reads the swap file costs over one served from the
/// pool, in faults from the pool, until the handlers have timed both
/// kinds (`swap_fault_extra`): `zmem bench fault` puts the two at ~18 and
/// ~5 µs per 4 KiB of a 64 KiB load.
const SWAP_FAULT_EXTRA: f64 = 3.0;
/// Bounds of the timed weight: a fault from the swap file costs at least
/// one from the pool more (it decompresses too), and a disk stalled for
/// a moment must not make the pool look worth any price.
const EXTRA_MIN: f64 = 1.0;
const EXTRA_MAX: f64 = 32.0;

/// What a fault from the swap file costs over one from the pool, in
/// faults from the pool, from the handlers' timings since the start
/// (`pool`, `swap`: faults and their nanoseconds; `pool_load_fault_ns`
/// and `swap_load_fault_ns` in the stats): (swap − pool) / pool. A page
/// a fault, ~20 against ~150 µs on `xz -9` under 64M, ~13 against ~150 µs
/// on `scripts/node-random.js` under 200M, ~21 against ~107 µs on
/// `scripts/mariadb-load` under 395M. [`SWAP_FAULT_EXTRA`] until each kind
/// has been timed `QUIET` times.
pub(super) fn swap_fault_extra(pool: (u64, u64), swap: (u64, u64)) -> f64 {
    if pool.0 < QUIET || swap.0 < QUIET || pool.1 == 0 {
        return SWAP_FAULT_EXTRA;
    }
    let per = |(n, ns): (u64, u64)| ns as f64 / n as f64;
    (per(swap) / per(pool) - 1.0).clamp(EXTRA_MIN, EXTRA_MAX)
}

/// Whether the share should grow after `refaults` refaults and
/// `swap_faults` faults that read swap refaults within a step, at `extra`
/// (`swap_fault_extra`): a step up turns each of those into a fault from
/// the pool, saving `extra` pool faults, and each refault into a fault
/// from the pool where a resident page cost nothing. Before, swap
/// refaults were counted in pages and refaults once a folio, and the rule
/// wanted four times the refaults: with the net window that left the
/// pager's uniform random reads at a ratio of 1.43, where a read from the
/// swap file costs ~10 of the pool's, at 50% (docs/experiments.md).
pub(super) fn grows(refaults: u64, swap_faults: u64, extra: f64) -> bool {
    swap_faults >= QUIET && extra * swap_faults as f64 > refaults as f64
}

/// Whether the pool, filling `used` percent of the limit, fills its share of
/// `percent` to within a step, or wrote back since the last look
/// (`wrote_back`): a step up gives it room only then. A pool that writes back
/// sits below its share by what loads took out since: 40% under a 50% share in
/// the pager's uniform random reads, whose share then never grew without the
/// second clause. Swap refaults while it holds less are of pages written back
/// before, when the share was lower, and a share raised above what the pool
/// holds takes nothing from resident pages until the pool grows into it, but
/// then the rule down must bring it back a step a second. On
/// `scripts/node-random.js` under 200M the share went from 10% to 65-80% in the
/// first second (V8's collections read back what the build had written back),
/// while the pool reached 34%, and came back to the floor only 5-7 s later,
/// near the run's end; the cut to the pool's level took the run from 15.2 to
/// 11.4 s on average over six alternated pairs (docs/benchmarks.md,
/// 2026-12-07).
pub(super) fn fills(percent: u32, used: u32, wrote_back: bool) -> bool {
    wrote_back || used + BALANCE_STEP >= percent
}

/// Whether it should shrink, after `refaults` refaults and, of the misses
/// a step less pool would cost, `swap_faults` and `cold_faults` (faults
/// that loaded from the swap file, or from the step of the pool next to be
/// written back), at `extra` (`swap_fault_extra`). All three count faults,
/// not pages: the tier counts the last two in pages, and with a folio
/// loaded a fault they read 14 times the refaults they stood for
/// (`scripts/node-random.js` under 200M: 314k cold pool loads in 22k
/// faults, beside ~215k refaults within a step, and the share never
/// moved). Each of them would cost `extra` more than the refault's
/// decompression.
pub(super) fn shrinks(refaults: u64, swap_faults: u64, cold_faults: u64, extra: f64) -> bool {
    refaults >= QUIET && refaults as f64 > extra * (swap_faults + cold_faults) as f64
}

/// The pages that one step of pool (`step` bytes) keeps in memory at the
/// pool's `ratio` (bytes of pages stored over bytes of pool), at least 1:
/// the window of `swap_refaults` and `cold_pool_loads`. The step holds
/// `step × ratio` bytes of pages, but it is taken from resident pages,
/// and those go into the pool first: memory holds `step × (ratio − 1)`
/// bytes of pages more, not `step × ratio`. At a ratio of 1.25 (InnoDB's
/// pages under lz4) the step keeps a fifth of what `step × ratio` says,
/// and counted so the share went to 80% of the limit and left MariaDB a
/// third of the kernel's resident pages (docs/benchmarks.md, 2026-12-05).
pub(super) fn step_keeps(step: usize, ratio: f64) -> u64 {
    ((step as f64 * (ratio - 1.0).max(0.0)) as u64 / PAGE_SIZE as u64).max(1)
}

/// `pages` loaded from the tier as faults, at the `loads` pages that
/// `faults` faults loaded over the same time (at least a page a fault).
pub(super) fn as_faults(pages: u64, loads: u64, faults: u64) -> u64 {
    if loads <= faults {
        return pages;
    }
    (u128::from(pages) * u128::from(faults)).div_ceil(u128::from(loads)) as u64
}

/// The share one step down from `percent` when the pool fills `used`
/// percent of the limit: from what it fills, since a share the pool does
/// not fill gives resident pages nothing, but to no less than half of
/// `percent` in one look. A pool still filling holds far less than it
/// will: `scripts/redis-hotset` under 80M stepped from 50% to the 10%
/// floor at once while it loaded its keys (the pool at 12%), wrote back
/// 10-19k pages that its digest then read from the disk at ~110 µs each,
/// and those reads held the codec at zstd:1 for 14 s (up to 15% slower).
/// That came in 3 runs of 7; with the cut at half, in none of 7: the pool
/// settled at ~27% of the limit. Node, sort, redis' digest and memcached,
/// whose shares step down from a full pool, did not change beyond their
/// noise (docs/benchmarks.md, 2026-12-05).
pub(super) fn step_down(percent: u32, used: u32, min: u32) -> u32 {
    percent.min(used).saturating_sub(BALANCE_STEP).max(percent / 2).max(min)
}

/// The reclaim thread's state for the balance: the counters at the start
/// of the look up (and when it started), and at the last time the share
/// could shrink.
#[derive(Debug)]
pub(super) struct Balance {
    at: Instant,
    last: Misses,
    last_at: Instant,
    shrink_at: Instant,
    shrink_last: Misses,
    /// The tier's `written_back_pages` at the last look.
    written_back: u64,
}

/// The counters the balance reads: refaults within a step, swap refaults
/// and cold pool loads (pages), pages loaded from the tier, and the faults
/// that loaded them.
#[derive(Debug, Clone, Copy, Default)]
struct Misses {
    refaults: u64,
    swap_refaults: u64,
    cold_pool_loads: u64,
    loads: u64,
    /// Timed faults of each kind, and their time: (faults, ns).
    pool: (u64, u64),
    swap: (u64, u64),
    /// Pages reclaim stored, and its time storing them: (pages, ns).
    stores: (u64, u64),
}

impl Misses {
    /// The faults that loaded `loads`: every timed fault, a folio's first
    /// and those on pages a partial load left in the tier alike (the
    /// folios' first alone, `load_faults`, are a tenth of them under 4 KiB
    /// random reads, and scaled the swap refaults of the pager's uniform
    /// reads to a tenth of the faults they were).
    fn load_faults(&self) -> u64 {
        self.pool.0 + self.swap.0
    }

    fn since(self, then: Misses) -> Misses {
        Misses {
            refaults: self.refaults - then.refaults,
            swap_refaults: self.swap_refaults - then.swap_refaults,
            cold_pool_loads: self.cold_pool_loads - then.cold_pool_loads,
            loads: self.loads - then.loads,
            pool: (self.pool.0 - then.pool.0, self.pool.1 - then.pool.1),
            swap: (self.swap.0 - then.swap.0, self.swap.1 - then.swap.1),
            stores: (self.stores.0 - then.stores.0, self.stores.1 - then.stores.1),
        }
    }
}

impl Balance {
    pub(super) fn new() -> Balance {
        Balance {
            at: Instant::now(),
            last: Misses::default(),
            last_at: Instant::now(),
            shrink_at: Instant::now(),
            shrink_last: Misses::default(),
            written_back: 0,
        }
    }
}

impl Inner {
    /// The pool's share of the limit now, percent.
    pub(super) fn pool_percent(&self) -> u32 {
        self.acct.pool_percent.load(Ordering::Relaxed)
    }

    /// Folios in one balance step: the refault distance under which a
    /// refault counts for the balance.
    pub(super) fn balance_step_folios(&self) -> usize {
        self.limit() / 100 * BALANCE_STEP as usize / self.cfg.folio_size
    }

    /// Sets the pool's limit to its share of the limit that applies now,
    /// unless the configuration fixed it in bytes.
    pub(super) fn apply_pool_share(&self) {
        if self.cfg.tier.max_pool_bytes.is_none() {
            self.tier.set_max_pool_bytes(self.limit() / 100 * self.pool_percent() as usize);
        }
    }

    /// Called by the reclaim thread on every wake-up: once an interval,
    /// moves the pool's share one step towards the side that missed more.
    pub(super) fn balance_pool(&self, b: &mut Balance) {
        let Some((min, max)) = self.cfg.pool_balance else { return };
        if b.at.elapsed() < BALANCE_INTERVAL {
            return;
        }
        b.at = Instant::now();
        let s = self.tier.stats();
        let step = self.limit() / 100 * BALANCE_STEP as usize;
        // Pages a pool byte holds: same-filled pages are markers, no pool
        // bytes. Counted in, `xz -9` of hex lines under 64M (two thirds of
        // its stored pages markers) had a window of 4.7k pages in a pool
        // of 2.7k entries, and every load from the pool counted as cold.
        let in_pool = s.stored_pages.saturating_sub(s.same_filled_pages);
        let ratio = in_pool as f64 * PAGE_SIZE as f64 / s.pool_total_size.max(1) as f64;
        self.tier.set_swap_refault_window(step_keeps(step, ratio));
        let (c, r) = (&self.counters, |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed));
        let now = Misses {
            refaults: self.acct.balance_refaults.load(Ordering::Relaxed),
            swap_refaults: s.swap_refaults,
            cold_pool_loads: s.cold_pool_loads,
            loads: s.zswpin,
            pool: (r(&c.pool_load_faults), r(&c.pool_load_fault_ns)),
            swap: (r(&c.swap_load_faults), r(&c.swap_load_fault_ns)),
            stores: (r(&c.reclaim_store_pages), r(&c.reclaim_store_ns)),
        };
        // The look up spans 50 ms, or as long as it takes for `QUIET`
        // swap faults, up to `SHRINK_INTERVAL`: a small limit's step
        // keeps few pages (16M at a ratio of 1.4: 90), and 50 ms of random
        // reads over 24 MiB found fewer than 8 swap refaults in it at most
        // looks, so the share never moved.
        let short = now.since(b.last);
        let swap_faults = as_faults(short.swap_refaults, short.loads, short.load_faults());
        if swap_faults >= QUIET || b.last_at.elapsed() >= SHRINK_INTERVAL {
            (b.last, b.last_at) = (now, Instant::now());
        }
        let percent = self.pool_percent();
        let extra = swap_fault_extra(now.pool, now.swap);
        let used = (s.pool_total_size as usize * 100 / self.limit().max(1)) as u32;
        let wrote_back = s.written_back_pages > b.written_back;
        b.written_back = s.written_back_pages;
        let next = if fills(percent, used, wrote_back) && grows(short.refaults, swap_faults, extra) {
            (b.shrink_at, b.shrink_last) = (Instant::now(), now);
            (percent + BALANCE_STEP).min(max)
        } else if b.shrink_at.elapsed() >= SHRINK_INTERVAL {
            let long = now.since(b.shrink_last);
            (b.shrink_at, b.shrink_last) = (Instant::now(), now);
            let faults = |pages| as_faults(pages, long.loads, long.load_faults());
            log::debug!(
                "pool share {percent}% (pool {used}%), over 1 s in faults: refaults {} swap {} cold {} (pages: {} {}; loads {} in {} faults); µs a fault: pool {:.1} swap {:.1} (a swap fault weighs {extra:.1}); µs a page stored {:.1}",
                long.refaults,
                faults(long.swap_refaults),
                faults(long.cold_pool_loads),
                long.swap_refaults,
                long.cold_pool_loads,
                long.loads,
                long.load_faults(),
                long.pool.1 as f64 / long.pool.0.max(1) as f64 / 1e3,
                long.swap.1 as f64 / long.swap.0.max(1) as f64 / 1e3,
                long.stores.1 as f64 / long.stores.0.max(1) as f64 / 1e3,
            );
            if shrinks(long.refaults, faults(long.swap_refaults), faults(long.cold_pool_loads), extra) {
                step_down(percent, used, min)
            } else {
                percent
            }
        } else {
            percent
        };
        if next != percent {
            self.acct.pool_percent.store(next, Ordering::Relaxed);
            self.apply_pool_share();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swap_faults_grow_the_pool_when_they_cost_more_than_the_refaults() {
        // A swap fault 4 pool faults dearer: 100 of them outweigh 399
        // refaults, not 400.
        assert!(grows(0, 100, 4.0));
        assert!(grows(399, 100, 4.0));
        assert!(!grows(400, 100, 4.0));
        assert!(!grows(250, 100, 2.0));
        assert!(grows(250, 100, 9.0));
        assert!(!grows(0, QUIET - 1, 32.0));
    }

    #[test]
    fn the_share_grows_only_when_the_pool_fills_it_to_within_a_step() {
        assert!(fills(10, 10, false));
        assert!(fills(10, 5, false));
        assert!(!fills(10, 4, false));
        assert!(!fills(65, 34, false));
        assert!(fills(5, 0, false), "at the floor a step is all the pool could want");
        assert!(fills(30, 40, false), "a pool over its share");
        assert!(fills(50, 40, true), "a pool that wrote back, loads having taken entries out since");
    }

    #[test]
    fn refaults_shrink_it_when_they_outweigh_what_less_pool_would_cost() {
        assert!(shrinks(100, 0, 0, 3.0));
        assert!(shrinks(100, 16, 16, 3.0));
        assert!(!shrinks(100, 17, 17, 3.0));
        assert!(!shrinks(100, 34, 0, 3.0));
        assert!(!shrinks(100, 0, 34, 3.0));
        // The dearer the disk, the fewer of its faults hold the share.
        assert!(shrinks(100, 10, 0, 9.0));
        assert!(!shrinks(100, 12, 0, 9.0));
        assert!(!shrinks(QUIET - 1, 0, 0, 1.0));
    }

    #[test]
    fn a_swap_fault_weighs_its_timed_cost_over_a_pool_fault() {
        // ~107 µs against ~21 µs a fault: 4.1 pool faults more.
        let w = swap_fault_extra((1000, 21_000_000), (500, 53_500_000));
        assert!((w - 4.095).abs() < 0.01, "{w}");
        // Untimed, or barely: the benchmark's ratio.
        assert_eq!(swap_fault_extra((0, 0), (500, 53_500_000)), SWAP_FAULT_EXTRA);
        assert_eq!(swap_fault_extra((1000, 21_000_000), (QUIET - 1, 1_000_000)), SWAP_FAULT_EXTRA);
        // Bounded both ways.
        assert_eq!(swap_fault_extra((1000, 21_000_000), (1000, 20_000_000)), EXTRA_MIN);
        assert_eq!(swap_fault_extra((1000, 1_000_000), (1000, 1_000_000_000)), EXTRA_MAX);
    }

    #[test]
    fn a_step_of_pool_keeps_what_it_holds_less_what_it_takes_from_resident_pages() {
        let step = 10 << 20;
        // 3:1: the step holds 30 MiB of pages, 10 of them the resident
        // pages it displaced.
        assert_eq!(step_keeps(step, 3.0), (20 << 20) / PAGE_SIZE as u64);
        assert_eq!(step_keeps(step, 1.25), (step as u64 / 4) / PAGE_SIZE as u64);
        // Pages that do not compress: a larger pool keeps nothing more.
        assert_eq!(step_keeps(step, 1.0), 1);
        assert_eq!(step_keeps(step, 0.0), 1, "an empty pool");
    }

    #[test]
    fn pages_count_as_the_faults_that_loaded_them() {
        // 14 pages a fault: 314k pages are 22.4k faults.
        assert_eq!(as_faults(314_000, 14_000, 1_000), 22_429);
        assert_eq!(as_faults(7, 0, 0), 7);
        assert_eq!(as_faults(7, 5, 5), 7);
        assert_eq!(as_faults(1, 16, 1), 1);
    }

    #[test]
    fn a_step_down_starts_from_what_the_pool_fills_and_stops_at_the_bound() {
        assert_eq!(step_down(50, 50, 20), 45);
        // A pool filling 30% of the limit under a 50% share: one step
        // below what it holds, or the step would give resident pages
        // nothing.
        assert_eq!(step_down(50, 30, 20), 25);
        assert_eq!(step_down(22, 22, 20), 20);
        assert_eq!(step_down(20, 20, 20), 20);
        assert_eq!(step_down(12, 8, 10), 10);
    }

    #[test]
    fn a_step_down_takes_at_most_half_the_share_in_one_look() {
        // A pool still filling (12% of the limit, growing) under a 50%
        // share: half the share, not the floor, and nothing written back
        // yet; the next look may cut again from there.
        assert_eq!(step_down(50, 12, 10), 25);
        assert_eq!(step_down(25, 12, 10), 12);
        assert_eq!(step_down(12, 12, 10), 10);
        assert_eq!(step_down(50, 0, 20), 25);
        assert_eq!(step_down(80, 30, 10), 40);
    }
}
