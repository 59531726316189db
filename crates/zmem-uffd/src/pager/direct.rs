//! Direct reclaim that works: a fault waiting for reclaim stores folios of
//! the pass under way, on its handler's CPU, rather than sleep.
//!
//! Over the limit, a fault's handler waits in `throttle` until reclaim's
//! next pass isolates its victims, and that comes only once the pass under
//! way is stored. Meanwhile the faulting thread is blocked and its CPU
//! idle: on two vCPUs, half the machine, while the reclaim thread
//! compresses alone. The kernel has the allocating task reclaim for itself
//! rather than wait for kswapd; here the waiting handler takes the pass's
//! folios one at a time, as the reclaim thread does, until its fault may go
//! on or none is left.
//!
//! Only when the tier stores on the caller's thread
//! (`Tier::stores_on_caller`): with engines or a device beside it, the
//! pass already runs on every core.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use zmem_common::LockExt;
use zmem_tier::{StoreOutcome, StoreRequest, Tier, TierError};

/// A request whose folio is borrowed for the pass (see [`PassStores::new`]).
struct Req {
    key: u64,
    ptr: *const u8,
    len: usize,
    reuse: bool,
}

/// The store requests of one reclaim pass, which the reclaim thread and
/// waiting faults claim one at a time.
pub(super) struct PassStores {
    reqs: Vec<Req>,
    /// The next request to claim (past the end: none left).
    next: AtomicUsize,
    /// Requests not yet done: unclaimed, or claimed and being stored.
    left: AtomicUsize,
    outcomes: Mutex<Vec<Option<Result<StoreOutcome, TierError>>>>,
}

// SAFETY: the raw pointers are only read, and only while `new`'s contract
// keeps them valid and unchanged (a claim is done before `finish` returns).
unsafe impl Send for PassStores {}
// SAFETY: as for Send: shared access only reads the folios; the claim
// counter and the outcomes are atomics and a mutex.
unsafe impl Sync for PassStores {}

impl PassStores {
    /// # Safety
    /// Every request's folio stays mapped and unchanged until
    /// [`finish`](Self::finish) returns, whichever thread holds a clone.
    pub(super) unsafe fn new(reqs: &[StoreRequest<'_>]) -> PassStores {
        PassStores {
            reqs: reqs
                .iter()
                .map(|r| Req { key: r.key, ptr: r.folio.as_ptr(), len: r.folio.len(), reuse: r.reuse })
                .collect(),
            next: AtomicUsize::new(0),
            left: AtomicUsize::new(reqs.len()),
            outcomes: Mutex::new((0..reqs.len()).map(|_| None).collect()),
        }
    }

    /// Claims the next request and stores it on this thread; false when
    /// every request is claimed.
    pub(super) fn store_next(&self, tier: &Tier) -> bool {
        let i = self.next.fetch_add(1, Ordering::AcqRel);
        let Some(r) = self.reqs.get(i) else { return false };
        /// Counts the claim done however the store ends (a panic too), so
        /// that `finish` never waits for it forever.
        struct Done<'a>(&'a AtomicUsize);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Release);
            }
        }
        let _done = Done(&self.left);
        // SAFETY: `new`'s contract: the folio stays mapped and unchanged
        // until `finish` returns, and `finish` waits for `left`, which this
        // claim holds up until `_done` drops, after the last read.
        let folio = unsafe { std::slice::from_raw_parts(r.ptr, r.len) };
        let out = tier.store_many(&[StoreRequest { key: r.key, folio, reuse: r.reuse }]);
        self.outcomes.lock_ok()[i] = out.into_iter().next();
        true
    }

    /// Stores what nobody claimed on this thread, waits for the claims of
    /// others (each at most one folio's store), and returns one outcome
    /// per request, in order.
    ///
    /// # Panics
    /// If a store another thread claimed panicked.
    pub(super) fn finish(&self, tier: &Tier) -> Vec<Result<StoreOutcome, TierError>> {
        while self.store_next(tier) {}
        while self.left.load(Ordering::Acquire) > 0 {
            std::thread::yield_now();
        }
        std::mem::take(&mut *self.outcomes.lock_ok())
            .into_iter()
            .map(|o| o.expect("a store that a waiting fault took on panicked"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use zmem_compress::corpus::Corpus;
    use zmem_tier::TierConfig;

    const PAGE: usize = zmem_common::PAGE_SIZE;

    /// Helpers claim a pass's folios while its owner stores the rest: every
    /// folio is stored once, by someone, and loads back bit-identical.
    #[test]
    fn every_folio_of_a_shared_pass_is_stored_once_and_loads_back() {
        let tier = Arc::new(Tier::new(TierConfig { memory_budget: 256 << 20, ..TierConfig::default() }).unwrap());
        assert!(tier.stores_on_caller());
        let c = Corpus::sample();
        let (folios, ppf) = (64, 16);
        for round in 0..8u64 {
            let data: Vec<u8> =
                (0..folios * ppf).flat_map(|p| c.page((p * 7 + round as usize) % c.len()).to_vec()).collect();
            let key = |f: usize| (round << 32) + (f * ppf) as u64;
            let reqs: Vec<StoreRequest<'_>> = data
                .chunks_exact(ppf * PAGE)
                .enumerate()
                .map(|(f, folio)| StoreRequest { key: key(f), folio, reuse: false })
                .collect();
            // SAFETY: `data` outlives the pass and nobody writes it.
            let pass = Arc::new(unsafe { PassStores::new(&reqs) });
            let helped = AtomicUsize::new(0);
            let outcomes = std::thread::scope(|s| {
                for _ in 0..3 {
                    let (pass, tier, helped) = (Arc::clone(&pass), Arc::clone(&tier), &helped);
                    s.spawn(move || {
                        while pass.store_next(&tier) {
                            helped.fetch_add(1, Ordering::Relaxed);
                        }
                    });
                }
                pass.finish(&tier)
            });
            assert_eq!(outcomes.len(), folios);
            assert!(outcomes.iter().all(|o| matches!(o, Ok(StoreOutcome::Stored { .. }))), "{outcomes:?}");
            assert!(helped.load(Ordering::Relaxed) <= folios);
            // Each page went into the tier once.
            assert_eq!(tier.stats().zswpout, (round + 1) * (folios * ppf) as u64);
            // Claims past the end find nothing, and store nothing.
            assert!(!pass.store_next(&tier));
            let mut page = vec![0u8; PAGE];
            for (f, folio) in data.chunks_exact(ppf * PAGE).enumerate() {
                for (i, want) in folio.chunks_exact(PAGE).enumerate() {
                    tier.load(key(f) + i as u64, &mut page).unwrap();
                    assert!(page == want, "round {round}, folio {f}, page {i}");
                }
            }
        }
    }
}
