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

use std::sync::atomic::Ordering;

use zmem_tier::{StoreOutcome, StoreRequest, Tier, TierError};

// The claim protocol's atomics, lock and yield, swapped for loom's under
// `cfg(loom)` so that `loom_model` below checks the real code.
#[cfg(loom)]
use loom::{
    sync::{atomic::AtomicUsize, Mutex},
    thread::yield_now,
};
#[cfg(not(loom))]
use std::{
    sync::{atomic::AtomicUsize, Mutex},
    thread::yield_now,
};

type Outcome = Result<StoreOutcome, TierError>;

/// The lock of `m`; a poisoned lock is taken as it is (a slot a panicking
/// store left empty is reported by `finish`).
fn lock<T>(m: &Mutex<T>) -> impl std::ops::DerefMut<Target = T> + '_ {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

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
    outcomes: Mutex<Vec<Option<Outcome>>>,
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
        self.store_next_with(&mut |r| tier.store_many(&[r]).into_iter().next())
    }

    /// [`store_next`](Self::store_next) with `store` in place of the
    /// tier's: the claim protocol alone, which `loom_model` checks.
    fn store_next_with(&self, store: &mut dyn FnMut(StoreRequest<'_>) -> Option<Outcome>) -> bool {
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
        let out = store(StoreRequest { key: r.key, folio, reuse: r.reuse });
        lock(&self.outcomes)[i] = out;
        true
    }

    /// Stores what nobody claimed on this thread, waits for the claims of
    /// others (each at most one folio's store), and returns one outcome
    /// per request, in order.
    ///
    /// # Panics
    /// If a store another thread claimed panicked.
    pub(super) fn finish(&self, tier: &Tier) -> Vec<Outcome> {
        self.finish_with(&mut |r| tier.store_many(&[r]).into_iter().next())
    }

    /// [`finish`](Self::finish) with `store` in place of the tier's.
    fn finish_with(&self, store: &mut dyn FnMut(StoreRequest<'_>) -> Option<Outcome>) -> Vec<Outcome> {
        while self.store_next_with(store) {}
        while self.left.load(Ordering::Acquire) > 0 {
            yield_now();
        }
        std::mem::take(&mut *lock(&self.outcomes))
            .into_iter()
            .map(|o| o.expect("a store that a waiting fault took on panicked"))
            .collect()
    }
}

#[cfg(all(test, not(loom)))]
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

    /// A helper whose store panics still counts its claim done: `finish`
    /// does not wait for it forever, and says so rather than return a
    /// pass with a folio missing.
    #[test]
    #[should_panic(expected = "a store that a waiting fault took on panicked")]
    fn a_helper_that_panics_mid_store_does_not_hang_the_pass() {
        let data = vec![7u8; 2 * PAGE];
        let reqs: Vec<StoreRequest<'_>> = data
            .chunks_exact(PAGE)
            .enumerate()
            .map(|(i, folio)| StoreRequest { key: i as u64, folio, reuse: false })
            .collect();
        // SAFETY: `data` outlives the pass (the helper is joined) and
        // nobody writes it.
        let pass = Arc::new(unsafe { PassStores::new(&reqs) });
        let helper = Arc::clone(&pass);
        let r = std::thread::spawn(move || helper.store_next_with(&mut |_| panic!("the helper's store fails")));
        assert!(r.join().is_err());
        pass.finish_with(&mut |_| Some(Ok(StoreOutcome::Stored { same_filled: 0, incompressible: 0 })));
    }
}

/// Loom model of the claim protocol: the reclaim thread's `finish` against
/// waiting faults' `store_next`, on the real code with a store that only
/// reads its folio. Whatever the interleaving, every request is stored once,
/// its outcome comes back in its place, and `finish` returns only after
/// every helper's last read of a folio (the reclaim thread then reuses the
/// staging under it: loom reports the race if the ordering is missing). Run
/// with `RUSTFLAGS="--cfg loom" cargo test -p zmem-uffd --release --lib loom_model`.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    const PAGE: usize = zmem_common::PAGE_SIZE;

    /// The folios' bytes, as loom sees them: a store reads a folio's cell,
    /// and the owner writes every cell once `finish` returns.
    struct Staging {
        folios: Vec<Vec<u8>>,
        cells: Vec<UnsafeCell<u32>>,
        /// How many times each request was stored.
        stores: Vec<loom::sync::atomic::AtomicUsize>,
    }

    fn pass(n: usize) -> (Arc<Staging>, Arc<PassStores>) {
        let staging = Arc::new(Staging {
            folios: (0..n).map(|i| vec![i as u8; PAGE]).collect(),
            cells: (0..n).map(|_| UnsafeCell::new(0)).collect(),
            stores: (0..n).map(|_| loom::sync::atomic::AtomicUsize::new(0)).collect(),
        });
        let reqs: Vec<StoreRequest<'_>> = staging
            .folios
            .iter()
            .enumerate()
            .map(|(i, f)| StoreRequest { key: 100 + i as u64, folio: f, reuse: false })
            .collect();
        // SAFETY: `staging` is kept alive by the caller past `finish`, and
        // its folios are never written (the cells stand in for them).
        let pass = Arc::new(unsafe { PassStores::new(&reqs) });
        (staging, pass)
    }

    /// A store that reads the folio (through its cell) and reports which
    /// request it stored in the outcome.
    fn store(staging: &Staging) -> impl FnMut(StoreRequest<'_>) -> Option<Outcome> + '_ {
        move |r| {
            let i = (r.key - 100) as usize;
            assert_eq!(r.folio, &staging.folios[i][..]);
            // SAFETY: loom's cell; a read, checked against the owner's
            // write after `finish`.
            let stored = staging.cells[i].with(|p| unsafe { *p });
            assert_eq!(stored, 0, "request {i} stored after its pass finished");
            staging.stores[i].fetch_add(1, Ordering::Relaxed);
            Some(Ok(StoreOutcome::Stored { same_filled: i, incompressible: 0 }))
        }
    }

    fn check(helpers: usize, n: usize) {
        loom::model(move || {
            let (staging, pass) = pass(n);
            let threads: Vec<_> = (0..helpers)
                .map(|_| {
                    let (staging, pass) = (Arc::clone(&staging), Arc::clone(&pass));
                    loom::thread::spawn(move || {
                        let mut stored = 0;
                        while pass.store_next_with(&mut store(&staging)) {
                            stored += 1;
                        }
                        stored
                    })
                })
                .collect();
            let outcomes = pass.finish_with(&mut store(&staging));
            // The reclaim thread reuses the staging: loom's race check.
            for c in &staging.cells {
                // SAFETY: loom's cell; the write that must follow every read.
                c.with_mut(|p| unsafe { *p = 1 });
            }
            assert_eq!(outcomes.len(), n);
            for (i, o) in outcomes.iter().enumerate() {
                assert!(matches!(o, Ok(StoreOutcome::Stored { same_filled, .. }) if *same_filled == i), "{i}: {o:?}");
            }
            let helped: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
            assert!(helped <= n);
            for (i, c) in staging.stores.iter().enumerate() {
                assert_eq!(c.load(Ordering::Relaxed), 1, "request {i} stored once");
            }
        });
    }

    #[test]
    fn one_waiting_fault_helps_a_pass_of_two() {
        check(1, 2);
    }

    #[test]
    fn two_waiting_faults_help_a_pass_of_two() {
        check(2, 2);
    }
}
