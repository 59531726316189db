//! The pool's share of the limit, balanced by what misses cost.
//!
//! The limit bounds resident folios and the pool together, so every byte
//! the pool may take is a byte less for resident pages. Moving one step
//! (`BALANCE_STEP` points of the limit, Δ bytes) either way trades misses
//! of one kind for the other, and each kind is counted where it happens,
//! within Δ (ARC's ghost lists, by distance):
//! - a *refault* within Δ: a folio loaded back from the tier fewer folio
//!   evictions after its own than Δ holds folios (the refault distance of
//!   mm/workingset.c). Δ more resident bytes would have kept it;
//! - a *swap refault* within Δ: a page loaded from the swap file fewer
//!   pages after its writeback than Δ of pool holds entries at the pool's
//!   ratio (the tier's `swap_refaults`, with its window set here). Δ more
//!   pool would have kept it. It costs a read and a decryption besides the
//!   decompression;
//! - a *cold pool load*: a page loaded from the pool's oldest window of
//!   that size (the tier's `cold_pool_loads`). Δ less pool would have
//!   written it back, and it would have been a swap refault.
//!
//! The share moves one step at a time between the configured bounds:
//! up, every `BALANCE_INTERVAL`, when swap refaults are over
//! `GROW_MARGIN` times the refaults; down, at most every
//! `SHRINK_INTERVAL`, when refaults outnumber `SWAP_FAULT_EXTRA` times the
//! swap refaults and cold pool loads together since the last time it
//! could, all counted in faults. Misses from further back
//! count for no side: a walk over several times what memory holds reads it
//! all back, whatever the share. A step down starts from what the pool
//! holds, not from its share: a share the pool does not fill gives
//! resident pages nothing; but it goes to no less than half the share in
//! one look, since a pool still filling holds far less than it will
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
/// Swap refaults are counted in pages, refaults in faults (one a folio,
/// where the pages after the first fault again: `swapped_page_faults`),
/// and a step towards the pool takes room from every resident page: the
/// pool grows only on this many times the refaults.
const GROW_MARGIN: u64 = 4;

/// Whether the share should grow after `refaults` refaults and
/// `swap_refaults` swap refaults within a step.
pub(super) fn grows(refaults: u64, swap_refaults: u64) -> bool {
    swap_refaults >= QUIET && swap_refaults > GROW_MARGIN * refaults
}

/// What a fault that reads the swap file costs over one served from the
/// pool, in faults from the pool: `zmem bench fault` puts the two at ~18
/// and ~5 µs per 4 KiB of a 64 KiB load. The handlers time both kinds
/// (`pool_load_fault_ns`, `swap_load_fault_ns`): a page a fault, ~20
/// against ~150 µs on `xz -9` under 64M and ~13 against ~150 µs on
/// `scripts/node-random.js` under 200M. The timed ratio is not used:
/// weighed at it (xz 5-6, node 9-12), node's share stayed at 40-45% and
/// the run took 24.6-37.5 s against 18.9-22.8 s at the 10% it reaches at
/// 3, so the refaults undercount what resident room saves it. At 4, xz
/// of random hex lines gained 20-25% and xz of man pages lost ~11%
/// (docs/benchmarks.md, "The pool's share of the limit").
const SWAP_FAULT_EXTRA: u64 = 3;

/// Whether it should shrink, after `refaults` refaults and, of the misses
/// a step less pool would cost, `swap_faults` and `cold_faults` (faults
/// that loaded from the swap file, or from the step of the pool next to be
/// written back). All three count faults, not pages: the tier counts the
/// last two in pages, and with a folio loaded a fault they read 14 times
/// the refaults they stood for (`scripts/node-random.js` under 200M:
/// 314k cold pool loads in 22k faults, beside ~215k refaults within a
/// step, and the share never moved). Each of them would cost a read of
/// the swap file where the refault costs a decompression.
pub(super) fn shrinks(refaults: u64, swap_faults: u64, cold_faults: u64) -> bool {
    refaults >= QUIET && refaults > SWAP_FAULT_EXTRA * (swap_faults + cold_faults)
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

/// The reclaim thread's state for the balance: the counters at the last
/// look, and at the last time the share could shrink.
#[derive(Debug)]
pub(super) struct Balance {
    at: Instant,
    last: Misses,
    shrink_at: Instant,
    shrink_last: Misses,
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
    load_faults: u64,
    /// Timed faults of each kind, and their time: (faults, ns).
    pool: (u64, u64),
    swap: (u64, u64),
    /// Pages reclaim stored, and its time storing them: (pages, ns).
    stores: (u64, u64),
}

impl Misses {
    fn since(self, then: Misses) -> Misses {
        Misses {
            refaults: self.refaults - then.refaults,
            swap_refaults: self.swap_refaults - then.swap_refaults,
            cold_pool_loads: self.cold_pool_loads - then.cold_pool_loads,
            loads: self.loads - then.loads,
            load_faults: self.load_faults - then.load_faults,
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
            shrink_at: Instant::now(),
            shrink_last: Misses::default(),
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
        // A step of pool holds this many entries at the pool's ratio.
        let step = self.limit() / 100 * BALANCE_STEP as usize;
        let ratio = (s.stored_pages as f64 * PAGE_SIZE as f64 / s.pool_total_size.max(1) as f64).max(1.0);
        self.tier.set_swap_refault_window(((step as f64 * ratio) as u64 / PAGE_SIZE as u64).max(1));
        let (c, r) = (&self.counters, |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed));
        let now = Misses {
            refaults: self.acct.balance_refaults.load(Ordering::Relaxed),
            swap_refaults: s.swap_refaults,
            cold_pool_loads: s.cold_pool_loads,
            loads: s.zswpin,
            load_faults: r(&c.load_faults),
            pool: (r(&c.pool_load_faults), r(&c.pool_load_fault_ns)),
            swap: (r(&c.swap_load_faults), r(&c.swap_load_fault_ns)),
            stores: (r(&c.reclaim_store_pages), r(&c.reclaim_store_ns)),
        };
        let short = now.since(b.last);
        b.last = now;
        let percent = self.pool_percent();
        let next = if grows(short.refaults, short.swap_refaults) {
            (b.shrink_at, b.shrink_last) = (Instant::now(), now);
            (percent + BALANCE_STEP).min(max)
        } else if b.shrink_at.elapsed() >= SHRINK_INTERVAL {
            let long = now.since(b.shrink_last);
            (b.shrink_at, b.shrink_last) = (Instant::now(), now);
            let used = (s.pool_total_size as usize * 100 / self.limit().max(1)) as u32;
            let faults = |pages| as_faults(pages, long.loads, long.load_faults);
            log::debug!(
                "pool share {percent}% (pool {used}%), over 1 s in faults: refaults {} swap {} cold {} (pages: {} {}; loads {} in {} folio faults); µs a fault: pool {:.1} swap {:.1}; µs a page stored {:.1}",
                long.refaults,
                faults(long.swap_refaults),
                faults(long.cold_pool_loads),
                long.swap_refaults,
                long.cold_pool_loads,
                long.loads,
                long.load_faults,
                long.pool.1 as f64 / long.pool.0.max(1) as f64 / 1e3,
                long.swap.1 as f64 / long.swap.0.max(1) as f64 / 1e3,
                long.stores.1 as f64 / long.stores.0.max(1) as f64 / 1e3,
            );
            if shrinks(long.refaults, faults(long.swap_refaults), faults(long.cold_pool_loads)) {
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
    fn swap_refaults_grow_the_pool_only_on_four_times_the_refaults() {
        assert!(grows(0, 100));
        assert!(grows(20, 100));
        assert!(!grows(25, 100));
        assert!(!grows(0, QUIET - 1));
    }

    #[test]
    fn refaults_shrink_it_when_they_outnumber_what_less_pool_would_cost() {
        assert!(shrinks(100, 0, 0));
        assert!(shrinks(100, 16, 16));
        assert!(!shrinks(100, 17, 17));
        assert!(!shrinks(100, 34, 0));
        assert!(!shrinks(100, 0, 34));
        assert!(!shrinks(QUIET - 1, 0, 0));
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
