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
//! `SHRINK_INTERVAL`, when refaults outnumber swap refaults and cold pool
//! loads together since the last time it could. Misses from further back
//! count for no side: a walk over several times what memory holds reads it
//! all back, whatever the share. A step down starts from what the pool
//! holds, not from its share: a share the pool does not fill gives
//! resident pages nothing.
//!
//! zswap has no such knob because cgroup v1 does not charge its pool to
//! the cgroup; under cgroup v2 with `memory.zswap.max` the pool and the
//! anon LRU share one limit too, and the kernel's balance is reclaim's own
//! (anon pages go to zswap while that frees memory, and the zswap shrinker
//! writes back in proportion to pressure).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Inner;
use crate::mapping::PAGE_SIZE;

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

/// Whether it should shrink, after `refaults` refaults and, of the misses
/// a step less pool would cost, `swap_refaults` and `cold_pool_loads`
/// (loads from the step of the pool next to be written back).
pub(super) fn shrinks(refaults: u64, swap_refaults: u64, cold_pool_loads: u64) -> bool {
    refaults >= QUIET && refaults > swap_refaults + cold_pool_loads
}

/// The share one step down from `percent` when the pool fills `used`
/// percent of the limit: from what it fills, since a share the pool does
/// not fill gives resident pages nothing.
pub(super) fn step_down(percent: u32, used: u32, min: u32) -> u32 {
    percent.min(used).saturating_sub(BALANCE_STEP).max(min)
}

/// The reclaim thread's state for the balance: the counters at the last
/// look, and at the last time the share could shrink.
#[derive(Debug)]
pub(super) struct Balance {
    at: Instant,
    last: (u64, u64, u64),
    shrink_at: Instant,
    shrink_last: (u64, u64, u64),
}

impl Balance {
    pub(super) fn new() -> Balance {
        Balance { at: Instant::now(), last: (0, 0, 0), shrink_at: Instant::now(), shrink_last: (0, 0, 0) }
    }
}

impl Inner {
    /// The pool's share of the limit now, percent.
    pub(super) fn pool_percent(&self) -> u32 {
        self.pool_percent.load(Ordering::Relaxed)
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
        let now = (self.balance_refaults.load(Ordering::Relaxed), s.swap_refaults, s.cold_pool_loads);
        let short = (now.0 - b.last.0, now.1 - b.last.1);
        let long = (now.0 - b.shrink_last.0, now.1 - b.shrink_last.1, now.2 - b.shrink_last.2);
        b.last = now;
        let percent = self.pool_percent();
        let next = if grows(short.0, short.1) {
            (b.shrink_at, b.shrink_last) = (Instant::now(), now);
            (percent + BALANCE_STEP).min(max)
        } else if b.shrink_at.elapsed() >= SHRINK_INTERVAL {
            (b.shrink_at, b.shrink_last) = (Instant::now(), now);
            let used = (s.pool_total_size as usize * 100 / self.limit().max(1)) as u32;
            if shrinks(long.0, long.1, long.2) {
                step_down(percent, used, min)
            } else {
                percent
            }
        } else {
            percent
        };
        if next != percent {
            self.pool_percent.store(next, Ordering::Relaxed);
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
        assert!(shrinks(100, 49, 50));
        assert!(!shrinks(100, 100, 0));
        // Loads from the pool's cold end: a step down would send them to
        // the swap file.
        assert!(!shrinks(100, 0, 100));
        assert!(!shrinks(QUIET - 1, 0, 0));
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
        assert_eq!(step_down(50, 0, 20), 20);
    }
}
