//! The shrinker: one per tier, shared by every pool, with the kernel's
//! `count_objects`/`scan_objects` split. A store that finds the pool full
//! runs it (there is no kswapd here), as does anyone who wants memory back
//! (`Tier::writeback` is `scan` without the count).

use std::sync::atomic::Ordering;

use crate::Tier;

/// `Shrinker::{count, scan}`, as the kernel's shrinker API names them.
#[derive(Debug)]
pub struct Shrinker<'a> {
    pub(crate) tier: &'a Tier,
}

impl Shrinker<'_> {
    /// Entries that writeback could free: pool entries (not same-filled,
    /// not already in the swap file). Lock-free: two counters.
    pub fn count(&self) -> usize {
        let c = &self.tier.counters;
        let stored = c.stored_pages.load(Ordering::Relaxed);
        stored.saturating_sub(c.same_filled_pages.load(Ordering::Relaxed)) as usize
    }

    /// Writes back up to `nr` of the coldest entries; returns how many went.
    /// Zero when writeback is off or the swap file refuses (ENOSPC, EIO).
    pub fn scan(&self, nr: usize) -> usize {
        self.tier.writeback(nr)
    }

    /// How many entries to scan to bring the pool from its size now down
    /// to `target` bytes, assuming entries of the average size.
    pub fn nr_to_scan(&self, target: usize) -> usize {
        let total = self.tier.pool_total_size();
        let count = self.count();
        if total <= target || count == 0 {
            return 0;
        }
        (count as u128 * (total - target) as u128).div_ceil(total as u128) as usize
    }

    /// Scans until the pool is at most `target` bytes, or nothing more can
    /// go; compacts the pools as it goes (freed objects leave holes in
    /// zspages, and only whole free pages shrink the pool). Returns how
    /// many entries were written back.
    pub fn shrink_to(&self, target: usize) -> usize {
        let mut done = 0;
        let most = self.count();
        // Each round writes back what the average object size says is
        // enough (at least one writeback batch); rounds go on until the
        // pool fits, nothing more goes, or every entry there was has gone.
        while done < most && self.tier.pool_total_size() > target {
            let nr = self.nr_to_scan(target).max(32).min(most - done);
            let n = self.scan(nr);
            done += n;
            if self.tier.pool_total_size() > target {
                self.tier.compact();
            }
            if n == 0 {
                break;
            }
        }
        done
    }
}
