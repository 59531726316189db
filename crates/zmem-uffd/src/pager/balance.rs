//! The pool's share of the limit, balanced by what misses cost.
//!
//! The limit bounds resident folios and the pool together, so every byte
//! the pool may take is a byte less for resident pages. Moving one step
//! (`BALANCE_STEP` points of the limit, Δ bytes) either way trades misses
//! of one kind for the other, and each kind is counted where it happens:
//! - a *refault* within Δ: a folio loaded back from the tier fewer folio
//!   evictions after its own than Δ holds folios (the refault distance of
//!   mm/workingset.c). Δ more resident bytes would have kept it;
//! - a *swap refault* within Δ: a page loaded from the swap file fewer
//!   pages after its writeback than Δ of pool holds entries at the pool's
//!   ratio (the tier's `swap_refaults`, with its window set here). Δ more
//!   pool would have kept it. It costs a read and a decryption besides the
//!   decompression.
//!
//! Every `BALANCE_INTERVAL`, the share moves one step towards the side
//! that missed more (towards the pool only on `GROW_MARGIN` times the
//! refaults), between the configured bounds.
//! Misses from further back count for neither side: a walk over several
//! times what memory holds reads it all back, whatever the share. A step
//! down starts from what the pool holds, not from its share: a share the
//! pool does not fill gives resident pages nothing.
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

/// How often the share is looked at.
pub(super) const BALANCE_INTERVAL: Duration = Duration::from_millis(50);
/// How far it moves in one look, percentage points of the limit.
pub(super) const BALANCE_STEP: u32 = 5;
/// Misses in one interval below which the share stays where it is.
const QUIET: u64 = 8;
/// Swap refaults are counted in pages, refaults in faults (one a folio,
/// where the pages after the first fault again: `swapped_page_faults`),
/// and a step towards the pool takes room from every resident page: the
/// pool grows only on this many times the refaults.
const GROW_MARGIN: u64 = 4;

/// The next share, in percent, from `percent` (the pool filling `used`
/// percent of the limit), after an interval with `refaults` refaults and
/// `swap_refaults` swap refaults within a step; `None`: no change.
pub(super) fn next_share(
    percent: u32,
    used: u32,
    refaults: u64,
    swap_refaults: u64,
    (min, max): (u32, u32),
) -> Option<u32> {
    let next = if swap_refaults >= QUIET && swap_refaults > GROW_MARGIN * refaults {
        (percent + BALANCE_STEP).min(max)
    } else if refaults >= QUIET && refaults > swap_refaults {
        percent.min(used).saturating_sub(BALANCE_STEP).max(min)
    } else {
        percent
    };
    (next != percent).then_some(next)
}

/// The reclaim thread's state for the balance: the counters at the last
/// look.
#[derive(Debug)]
pub(super) struct Balance {
    at: Instant,
    refaults: u64,
    swap_refaults: u64,
}

impl Balance {
    pub(super) fn new() -> Balance {
        Balance { at: Instant::now(), refaults: 0, swap_refaults: 0 }
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
        let Some(bounds) = self.cfg.pool_balance else { return };
        if b.at.elapsed() < BALANCE_INTERVAL {
            return;
        }
        b.at = Instant::now();
        let s = self.tier.stats();
        // A step of pool holds this many entries at the pool's ratio.
        let step = self.limit() / 100 * BALANCE_STEP as usize;
        let ratio = (s.stored_pages as f64 * PAGE_SIZE as f64 / s.pool_total_size.max(1) as f64).max(1.0);
        self.tier.set_swap_refault_window(((step as f64 * ratio) as u64 / PAGE_SIZE as u64).max(1));
        let refaults = self.balance_refaults.load(Ordering::Relaxed);
        let (dr, ds) = (refaults - b.refaults, s.swap_refaults - b.swap_refaults);
        (b.refaults, b.swap_refaults) = (refaults, s.swap_refaults);
        let used = (s.pool_total_size as usize * 100 / self.limit().max(1)) as u32;
        if let Some(p) = next_share(self.pool_percent(), used, dr, ds, bounds) {
            self.pool_percent.store(p, Ordering::Relaxed);
            self.apply_pool_share();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: (u32, u32) = (20, 90);

    #[test]
    fn swap_refaults_grow_the_pool_up_to_its_bound() {
        assert_eq!(next_share(50, 50, 0, 100, B), Some(55));
        assert_eq!(next_share(50, 50, 20, 100, B), Some(55));
        assert_eq!(next_share(88, 88, 0, 100, B), Some(90));
        assert_eq!(next_share(90, 90, 0, 100, B), None);
    }

    #[test]
    fn refaults_shrink_it_from_what_it_holds_down_to_its_bound() {
        assert_eq!(next_share(50, 50, 100, 0, B), Some(45));
        assert_eq!(next_share(50, 50, 100, 99, B), Some(45));
        // A pool filling 30% of the limit under a 50% share: one step
        // below what it holds, or the step would give resident pages
        // nothing.
        assert_eq!(next_share(50, 30, 100, 0, B), Some(25));
        assert_eq!(next_share(22, 22, 100, 0, B), Some(20));
        assert_eq!(next_share(20, 20, 100, 0, B), None);
    }

    #[test]
    fn few_or_even_misses_leave_it_alone() {
        assert_eq!(next_share(50, 50, 0, 0, B), None);
        assert_eq!(next_share(50, 50, QUIET - 1, 0, B), None);
        assert_eq!(next_share(50, 50, 0, QUIET - 1, B), None);
        // Swap refaults above the refaults but not four times them: no
        // move either way.
        assert_eq!(next_share(50, 50, 100, 100, B), None);
        assert_eq!(next_share(50, 50, 30, 100, B), None);
    }
}
