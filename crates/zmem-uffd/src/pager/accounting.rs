//! Accounting: what the limit bounds, the watermarks, and the throttle a
//! fault applies when usage is over the limit.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use zmem_common::{unpoison, LockExt};

use super::stats::inc;
use super::{Inner, RegionState};
use zmem_common::PAGE_SIZE;

impl Inner {
    pub(super) fn usage(&self) -> usize {
        // Pages shared with another process are charged to no one (see
        // `Lru::shared`); the count may run behind a folio dropped
        // meanwhile, until the next look.
        let shared = self.lists.shared_pages.load(Ordering::Relaxed) * PAGE_SIZE;
        // The pools' zspages. Not the free pages the mempool keeps for
        // reuse (a sixteenth of the pool's limit at most, `free_pages_kept`):
        // charged, their count swings by a reclaim batch as writeback frees
        // and stores take them, and reclaim chased it (a walk over 3x the
        // limit loaded 4-5% of its pages twice, not 2-3%, and compressed
        // twice as many).
        self.resident_bytes().saturating_sub(shared)
            + self.folios.held_bytes.load(Ordering::Relaxed)
            + self.tier.pool_total_size()
            + self.metadata()
    }

    /// Bytes of resident folios, less the pages partial loads left in the
    /// tier.
    pub(super) fn resident_bytes(&self) -> usize {
        let folios = self.acct.resident.load(Ordering::Relaxed) * self.cfg.folio_size;
        folios.saturating_sub(self.folios.swapped_pages.load(Ordering::Relaxed) * PAGE_SIZE)
    }

    pub(super) fn metadata(&self) -> usize {
        self.folios.tables.load(Ordering::Relaxed) + self.list_metadata() + self.tier.entry_metadata_bytes()
    }

    /// The reclaim lists' items.
    pub(super) fn list_metadata(&self) -> usize {
        self.lists.lru_len.load(Ordering::Relaxed) * std::mem::size_of::<(Arc<RegionState>, usize)>()
    }

    /// The limit that applies now (see `refresh_limit`).
    pub(super) fn limit(&self) -> usize {
        self.acct.limit_now.load(Ordering::Relaxed)
    }

    /// In a process tree: publishes this process's usage and takes its
    /// share of the tree's limit as its own (see `crate::tree`). The floor
    /// is the smallest limit a pager accepts.
    ///
    /// The pool's limit follows the share (`pool_percent` of it, as of a
    /// process's own limit): with the tree's whole limit as its bound,
    /// each process's pool could grow past its share, and with nothing
    /// left to evict, no store would come to write it back.
    pub(super) fn refresh_limit(&self) {
        if let Some(m) = &self.acct.member {
            let floor = self.share_floor();
            let share = m.publish(self.usage(), floor);
            m.publish_pool(self.tier.pool_total_size());
            let old = self.acct.limit_now.swap(share, Ordering::Relaxed);
            if share != old {
                self.apply_pool_share();
            }
        }
    }

    /// Whether a controller moves this pager's tree's limit (`zmem run
    /// --max-slowdown`).
    pub(super) fn limit_controlled(&self) -> bool {
        self.acct.member.as_ref().is_some_and(|m| m.tree().controller().is_some())
    }

    /// The smallest share of a tree's limit a process gets
    /// (`PagerConfig::share_floor`).
    pub(super) fn share_floor(&self) -> usize {
        self.cfg.share_floor()
    }

    pub(super) fn high(&self) -> usize {
        self.limit() / 100 * self.cfg.high_watermark_percent as usize
    }

    pub(super) fn low(&self) -> usize {
        self.limit() / 100 * self.cfg.low_watermark_percent as usize
    }

    /// Wakes the reclaim thread. A kick it has not seen yet was notified
    /// when it was set, so a second is not: each notify is a futex call,
    /// and a fault above the high watermark kicks (per fault).
    pub(super) fn kick_reclaim(&self) {
        let mut k = self.acct.kick.0.lock_ok();
        if !*k {
            *k = true;
            drop(k);
            self.acct.kick.1.notify_one();
        }
    }

    /// After a fault: kick reclaim above the high watermark, and above the
    /// limit wait for it a little (direct reclaim, bounded), unless the
    /// limit is soft. Where a controller moves the limit, the wait starts
    /// a [`CONTROLLED_OVERAGE_DIV`](crate::tree::CONTROLLED_OVERAGE_DIV)th
    /// over it: its probes are reclaim's to follow, in the background.
    pub(super) fn throttle(&self) {
        if self.fork.frozen.load(Ordering::Acquire) {
            return; // a fork is being prepared: reclaim waits for it
        }
        self.refresh_limit();
        if self.usage() > self.high() {
            self.kick_reclaim();
        }
        let bound = || {
            let limit = self.limit();
            if self.limit_controlled() {
                limit + limit / crate::tree::CONTROLLED_OVERAGE_DIV
            } else {
                limit
            }
        };
        if self.usage() > bound() && !self.acct.soft.load(Ordering::Relaxed) {
            // Direct reclaim, bounded: wait for the reclaimer a little,
            // storing folios of its pass meanwhile (`direct.rs`).
            inc(&self.counters.direct_reclaim_waits);
            let t = Instant::now();
            let deadline = t + self.cfg.direct_reclaim_wait;
            self.wait_for_reclaim_while(deadline, Duration::from_millis(1), true, || self.usage() > bound());
            let ns = t.elapsed().as_nanos() as u64;
            self.counters.throttle_ns.fetch_add(ns, Ordering::Relaxed);
            self.stalled(ns);
        }
    }

    /// Waits while `cond` holds, until `deadline`, woken by
    /// [`wake_reclaim_waiters`](Self::wake_reclaim_waiters) or every `step`.
    /// `cond` is checked under the lock the wake-up takes, so no wake-up
    /// falls between the check and the wait (one did: a fault waited out
    /// the whole timeout, 1-2 ms, for the 1% of `bench fault`'s loads that
    /// came after a pass's notify). With `help`, folios of the pass under
    /// way are stored on this thread while `cond` holds, rather than slept
    /// through (`direct.rs`); reclaim publishes a pass before it wakes
    /// waiters, so a waiter that found none is woken for the next.
    pub(super) fn wait_for_reclaim_while(
        &self,
        deadline: Instant,
        step: Duration,
        help: bool,
        cond: impl Fn() -> bool,
    ) {
        let mut g = self.acct.reclaimed.0.lock_ok();
        *g += 1;
        while cond() && Instant::now() < deadline {
            if let Some(pass) = help.then(|| self.acct.pass_stores.lock_ok().clone()).flatten() {
                drop(g);
                let mut stored = false;
                while cond() && pass.store_next(&self.tier) {
                    stored = true;
                    inc(&self.counters.direct_reclaim_stores);
                }
                g = self.acct.reclaimed.0.lock_ok();
                if stored {
                    continue;
                }
            }
            g = unpoison(self.acct.reclaimed.1.wait_timeout(g, step)).0;
        }
        *g -= 1;
    }

    /// Wakes whoever waits for reclaim (`throttle`, `Pager::reclaim_now`):
    /// usage or the reclaimer's state changed. The lock is taken first, so
    /// a waiter is either already asleep (and woken) or checks afterwards;
    /// with none counted under it, no futex call is made.
    pub(super) fn wake_reclaim_waiters(&self) {
        let waiters = *self.acct.reclaimed.0.lock_ok();
        if waiters > 0 {
            self.acct.reclaimed.1.notify_all();
        }
    }
}

/// Usage and the limit, and the wake-ups between faults and reclaim.
pub(super) struct Accounting {
    pub(super) resident: std::sync::atomic::AtomicUsize,
    /// The limit is soft (see [`PagerStats::limit_soft_events`]).
    pub(super) soft: std::sync::atomic::AtomicBool,
    /// The limit that applies now: `cfg.limit`, or this process's share of
    /// its tree's (refreshed by `refresh_limit`).
    pub(super) limit_now: std::sync::atomic::AtomicUsize,
    /// The pool's share of the limit, percent: `cfg.tier.max_pool_percent`,
    /// moved by `balance_pool` when `cfg.pool_balance` is on.
    pub(super) pool_percent: std::sync::atomic::AtomicU32,
    /// Refaults that a resident set one balance step larger would have
    /// saved (`balance.rs`).
    pub(super) balance_refaults: std::sync::atomic::AtomicU64,
    /// This process's slot in its tree's accounting (`PagerConfig::tree`).
    pub(super) member: Option<crate::tree::Member>,
    pub(super) kick: (std::sync::Mutex<bool>, std::sync::Condvar),
    /// The count of threads in `wait_for_reclaim_while`, and their wake-up.
    pub(super) reclaimed: (std::sync::Mutex<u32>, std::sync::Condvar),
    /// The stores of the reclaim pass under way, which a fault waiting in
    /// `throttle` helps with (`direct.rs`). A leaf lock, held only to
    /// publish, take or clear the pass.
    pub(super) pass_stores: std::sync::Mutex<Option<std::sync::Arc<super::direct::PassStores>>>,
    /// Rounds of the reclaim loop done (`Pager::reclaim_now` waits for the
    /// one after its kick).
    pub(super) reclaim_rounds: std::sync::atomic::AtomicU64,
}
