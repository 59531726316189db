//! The reclaim lists: active and inactive, as vmscan keeps them for anon
//! pages, the folios a stream of loads went past, plus the unevictable
//! folios.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use zmem_common::LockExt;

use super::stats::inc;
use super::{Folio, Inner, RegionState};
use crate::pagemap::WriteTracker;
use crate::sys::UffdError;

/// The reclaim lists, generic over the item so that the policy is tested
/// without userfaultfd. The pager keeps each folio in at most one list, at
/// most once (`RegionState::queued`).
#[derive(Debug)]
pub(super) struct Lru<T> {
    pub(super) active: VecDeque<T>,
    pub(super) inactive: VecDeque<T>,
    /// Folios a sequential walk loaded back (`Inner::became_resident_once`),
    /// in load order: they go first, once the walk is past them. A walk
    /// over more than the limit (a second pass over a buffer, a scan, a
    /// copy) reads each page once; under LRU it would push out the pages it
    /// reads next, which were written and must be compressed to go, and
    /// load every one of them back (usemem's read phase: 232k loads and
    /// 91k stores per worker, against 191k and none this way). These go
    /// for free: a load keeps their entries (`Tier::retain_clean`).
    pub(super) once: VecDeque<T>,
    /// Victims taken from `once` so far.
    pub(super) once_victims: u64,
    /// Victims taken without a look (the look budget ran out) so far.
    pub(super) unlooked_victims: u64,
    /// Folios whose pages would not move (mlocked): not looked at until
    /// `UNEVICTABLE_RESCAN` has passed.
    pub(super) unevictable: Vec<T>,
    /// Folios at least half of whose present pages a fork left shared with
    /// another process, with how many are: evicting them would free little
    /// (the other process keeps the pages), so they are not evicted, and
    /// their shared pages are charged to no one (`ReclaimLists::shared_pages`:
    /// with N forked workers, half to each would count a page N+1 halves),
    /// until a look (`SHARED_RESCAN`) finds them mostly this process's own.
    pub(super) shared: Vec<(T, usize)>,
}

impl<T> Default for Lru<T> {
    fn default() -> Self {
        Lru {
            active: VecDeque::new(),
            inactive: VecDeque::new(),
            once: VecDeque::new(),
            once_victims: 0,
            unlooked_victims: 0,
            unevictable: Vec::new(),
            shared: Vec::new(),
        }
    }
}

/// What [`Lru::isolate`] learns of an item it looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Look {
    /// Evicted, dropped, or its region is gone: it leaves the lists.
    Gone,
    /// Faulted in or written since the last look.
    Accessed,
    Cold,
}

/// The fewest looks between two write-protect sweeps (`sweep_writes_if_due`).
const SWEEP_MIN_LOOKS: u64 = 64;

/// How often unevictable folios go back on the inactive list for a look.
pub(super) const UNEVICTABLE_RESCAN: Duration = Duration::from_secs(10);
/// How often shared folios are looked at again.
pub(super) const SHARED_RESCAN: Duration = Duration::from_millis(500);

impl<T> Lru<T> {
    #[cfg(test)]
    fn len(&self) -> usize {
        self.active.len() + self.inactive.len() + self.once.len() + self.unevictable.len() + self.shared.len()
    }

    /// Takes up to `batch` victims off the lists. `look` says what became
    /// of an item (and clears its accessed state); `left` is called for
    /// every item that leaves the lists, victim or gone.
    /// - The once list's head, while it holds more than `keep_once` (the
    ///   newest, loaded ahead of the walks and maybe not read yet): accessed
    ///   goes to the active tail, cold is a victim.
    /// - Inactive head: accessed goes to the active tail, cold is a victim.
    /// - Active head (while inactive is under a third of all): accessed goes
    ///   round again, cold goes down to the inactive tail.
    ///
    /// A folio written once (a stream) is evicted after one trip through
    /// each list; a folio written all the time stays in the active one.
    /// Each look may cost a PAGEMAP_SCAN, so looks are bounded (16 per
    /// victim wanted); past that, heads are taken as they come, inactive
    /// first, and only `live` is asked.
    pub(super) fn isolate(
        &mut self,
        batch: usize,
        keep_once: usize,
        mut look: impl FnMut(&T) -> Look,
        live: impl Fn(&T) -> bool,
        mut left: impl FnMut(&T),
    ) -> Vec<T> {
        let mut out = Vec::new();
        while out.len() < batch && self.once.len() > keep_once {
            let item = self.once.pop_front().expect("longer than keep_once");
            match look(&item) {
                Look::Accessed => self.active.push_back(item),
                Look::Gone => left(&item),
                Look::Cold => {
                    left(&item);
                    out.push(item);
                    self.once_victims += 1;
                }
            }
        }
        let mut budget = ((self.active.len() + self.inactive.len()) * 2).min(16 * batch);
        while out.len() < batch && budget > 0 {
            budget -= 1;
            let total = self.active.len() + self.inactive.len();
            let from_active = self.inactive.len() * 3 < total && !self.active.is_empty();
            let popped = if from_active { self.active.pop_front() } else { self.inactive.pop_front() };
            let Some(item) = popped else { break };
            match look(&item) {
                Look::Gone => left(&item),
                Look::Accessed => self.active.push_back(item),
                Look::Cold if from_active => self.inactive.push_back(item),
                Look::Cold => {
                    left(&item);
                    out.push(item);
                }
            }
        }
        while out.len() < batch {
            let next = self.inactive.pop_front().or_else(|| self.active.pop_front());
            let Some(item) = next.or_else(|| self.once.pop_front()) else { break };
            left(&item);
            if live(&item) {
                out.push(item);
                self.unlooked_victims += 1;
            }
        }
        out
    }
}

impl Inner {
    pub(super) fn lru_add(&self, st: &Arc<RegionState>, f: usize) {
        self.lru_add_to(st, f, false);
    }

    /// Puts folio `f` on the inactive list, or with `once` on the once
    /// list; a folio already on a list stays where it is.
    pub(super) fn lru_add_to(&self, st: &Arc<RegionState>, f: usize, once: bool) {
        if st.queued[f].swap(true, Ordering::AcqRel) {
            return;
        }
        let mut lru = self.lists.lru.lock_ok();
        let list = if once { &mut lru.once } else { &mut lru.inactive };
        list.push_back((Arc::clone(st), f));
        drop(lru);
        self.lists.lru_len.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether folio `f` was written since the last sweep
    /// (`sweep_writes_if_due`).
    /// Reads are not seen: a folio only read counts as cold. Only a look:
    /// the pages stay as they are until the next sweep.
    pub(super) fn written_since_sweep(&self, tracker: &mut WriteTracker, st: &RegionState, f: usize) -> bool {
        let fs = self.cfg.folio_size as u64;
        let start = st.start.load(Ordering::Acquire) + f as u64 * fs;
        inc(&self.counters.write_scans);
        let written = tracker.written(start, start + fs).unwrap_or_else(|e| {
            // A region being unmapped or remapped under us: treat as cold.
            if !matches!(e, UffdError::Ioctl { errno: rustix::io::Errno::INVAL | rustix::io::Errno::PERM, .. }) {
                log::warn!("write tracking scan failed: {e}");
            }
            false
        });
        if written {
            inc(&self.counters.written_folios);
        }
        written
    }

    /// Write-protects again the written pages of every folio on the
    /// lists, so that the looks after it see only the writes from here
    /// on. Due once the looks since the last sweep number the resident
    /// folios: each folio is looked at about once between two sweeps, as
    /// when each look protected its own folio again.
    ///
    /// A look that protected its folio cost a TLB flush for every written
    /// folio, sent to the CPU the program runs on. A sweep is one
    /// `PAGEMAP_SCAN` per region, over the span from its first listed
    /// folio to its last: one flush per 2 MiB page table with written
    /// pages (`WriteTracker::protect_written`). On Python's random reads
    /// (each writes a reference count) the looks flushed for 1.12M folios
    /// in 48 s (ARCHITECTURE, *Choosing victims*).
    fn sweep_writes_if_due(&self, tracker: &mut WriteTracker) {
        let scans = self.counters.write_scans.load(Ordering::Relaxed);
        let due = (self.acct.resident.load(Ordering::Relaxed) as u64).max(SWEEP_MIN_LOOKS);
        if scans.saturating_sub(self.lists.swept_at_scans.load(Ordering::Relaxed)) < due {
            return;
        }
        self.lists.swept_at_scans.store(scans, Ordering::Relaxed);
        let fs = self.cfg.folio_size;
        let mut spans: HashMap<u32, (Arc<RegionState>, usize, usize)> = HashMap::new();
        {
            let lru = self.lists.lru.lock_ok();
            for (st, f) in lru.once.iter().chain(&lru.inactive).chain(&lru.active) {
                let e = spans.entry(st.id).or_insert_with(|| (Arc::clone(st), *f, *f));
                (e.1, e.2) = (e.1.min(*f), e.2.max(*f));
            }
        }
        inc(&self.counters.write_sweeps);
        for (st, lo, hi) in spans.into_values() {
            // Read the address now: a REMAP may move the region (a range
            // protected in error is only aged early).
            let base = st.start.load(Ordering::Acquire);
            if let Err(e) = tracker.protect_written(base + (lo * fs) as u64, base + ((hi + 1) * fs) as u64) {
                log::debug!("a write-protect sweep: {e}");
            }
        }
    }

    /// Picks up to `batch_folios` victims (see [`Lru::isolate`]). A folio
    /// is accessed if it was faulted in or (with write tracking) written
    /// since the last sweep (`sweep_writes_if_due`); looking clears the
    /// first.
    pub(super) fn isolate_folios(&self, mut tracker: Option<&mut WriteTracker>) -> Vec<(Arc<RegionState>, usize)> {
        if let Some(t) = tracker.as_deref_mut() {
            self.sweep_writes_if_due(t);
        }
        let fs = self.cfg.folio_size;
        // A folio holding a zmem thread's TLS vector (in a program whose
        // executable has its own malloc) stays resident: off the lists for
        // good (`zmem_common::host::tls`).
        let live = |(st, f): &(Arc<RegionState>, usize)| {
            st.folio(*f) == Folio::Resident
                && !st.poisoned[*f].load(Ordering::Relaxed)
                && (st.adopted || st.mapping.lock().is_ok_and(|m| m.is_some()))
                && !zmem_common::host::tls::pinned(st.start.load(Ordering::Acquire) + (*f * fs) as u64, fs)
        };
        // Folios written since a load kept their entries: those entries are
        // stale now, and are dropped once the list's lock is let go.
        let mut dirtied = Vec::new();
        let look = |item: &(Arc<RegionState>, usize)| {
            if !live(item) {
                return Look::Gone;
            }
            let (st, f) = item;
            let referenced = st.referenced[*f].swap(false, Ordering::Relaxed);
            let written = tracker.as_deref_mut().is_some_and(|t| self.written_since_sweep(t, st, *f));
            if written && st.cached[*f].swap(false, Ordering::Relaxed) {
                dirtied.push((Arc::clone(st), *f));
            }
            if referenced || written {
                Look::Accessed
            } else if st.protect[*f].load(Ordering::Relaxed) > 0 {
                st.protect[*f].fetch_sub(1, Ordering::Relaxed);
                Look::Accessed
            } else {
                Look::Cold
            }
        };
        let left = |(st, f): &(Arc<RegionState>, usize)| {
            self.lists.lru_len.fetch_sub(1, Ordering::Relaxed);
            st.queued[*f].store(false, Ordering::Release);
        };
        let keep_once = self.cfg.keep_once_folios();
        let mut lru = self.lists.lru.lock_ok();
        let (before, unlooked) = (lru.once_victims, lru.unlooked_victims);
        let victims = lru.isolate(self.cfg.batch_folios(), keep_once, look, live, left);
        self.counters.walk_evictions.fetch_add(lru.once_victims - before, Ordering::Relaxed);
        self.counters.unlooked_evictions.fetch_add(lru.unlooked_victims - unlooked, Ordering::Relaxed);
        drop(lru);
        for (st, f) in dirtied {
            // Only cached entries go: a store under the same key (an
            // eviction since) is never touched.
            for p in self.folio_pages(&st, f) {
                self.tier.drop_cached(st.key(p));
            }
        }
        victims
    }
}

/// The reclaim lists and what counts the looks at them.
#[derive(Default)]
pub(super) struct ReclaimLists {
    pub(super) lru: std::sync::Mutex<Lru<(std::sync::Arc<super::RegionState>, usize)>>,
    /// Entries on the reclaim lists (some may be stale).
    pub(super) lru_len: std::sync::atomic::AtomicUsize,
    /// `write_scans` at the last write-protect sweep (`lru.rs`).
    pub(super) swept_at_scans: std::sync::atomic::AtomicU64,
    /// Folios evicted so far (wrapping): the clock of refault distances
    /// (`RegionState::evicted_at`).
    pub(super) evict_clock: std::sync::atomic::AtomicU32,
    /// Shared pages of the folios on the shared list (`Lru::shared`):
    /// resident, but charged to no one while another process maps them too.
    pub(super) shared_pages: std::sync::atomic::AtomicUsize,
    /// `reclaim_now` asks for a look at the shared folios; cleared once done.
    pub(super) rescan_shared_now: std::sync::atomic::AtomicBool,
}

#[cfg(test)]
mod tests {
    use super::{Look, Lru};
    use std::collections::HashSet;

    fn lru(n: u32) -> Lru<u32> {
        let mut l = Lru::default();
        l.inactive.extend(0..n);
        l
    }

    #[test]
    fn cold_inactive_folios_go_first_in_order() {
        let mut l = lru(10);
        let mut left = Vec::new();
        let v = l.isolate(4, 0, |_| Look::Cold, |_| true, |x| left.push(*x));
        assert_eq!(v, [0, 1, 2, 3]);
        assert_eq!(left, v);
        assert_eq!(l.len(), 6);
    }

    #[test]
    fn an_accessed_folio_is_promoted_and_a_stream_passes_through_once() {
        let mut l = lru(8);
        let hot: HashSet<u32> = [1, 3].into();
        // First pass: 1 and 3 go active; the cold ones are victims.
        let v = l.isolate(4, 0, |x| if hot.contains(x) { Look::Accessed } else { Look::Cold }, |_| true, |_| {});
        assert_eq!(v, [0, 2, 4, 5]);
        assert_eq!(l.active, [1, 3]);
        // Hot folios stay while they are accessed, however many passes.
        for _ in 0..5 {
            let v = l.isolate(1, 0, |x| if hot.contains(x) { Look::Accessed } else { Look::Cold }, |_| true, |_| {});
            assert!(v.iter().all(|x| !hot.contains(x)), "{v:?}");
            l.inactive.push_back(100);
        }
        assert!(l.active.contains(&1) && l.active.contains(&3));
    }

    #[test]
    fn a_walks_folios_go_first_less_the_newest_and_accessed_ones_are_promoted() {
        let mut l = lru(4);
        l.once.extend(10..20);
        // The 3 newest stay (loaded ahead, maybe not read yet); 12 was
        // written since its load, so it goes active, not out.
        let v = l.isolate(5, 3, |x| if *x == 12 { Look::Accessed } else { Look::Cold }, |_| true, |_| {});
        assert_eq!(v, [10, 11, 13, 14, 15]);
        assert_eq!(l.once_victims, 5);
        assert_eq!(l.active, [12]);
        // Past the kept ones, the other lists give the rest.
        let v = l.isolate(4, 3, |_| Look::Cold, |_| true, |_| {});
        assert_eq!(v, [16, 0, 1, 2]);
        assert_eq!(l.once, [17, 18, 19]);
        // With nothing else left, the kept ones go too.
        let v = l.isolate(8, 3, |_| Look::Cold, |_| true, |_| {});
        assert_eq!(v, [3, 12, 17, 18, 19]);
    }

    #[test]
    fn a_cold_active_folio_is_demoted_before_it_is_evicted() {
        let mut l = Lru::default();
        l.active.extend([7, 8, 9]);
        l.inactive.push_back(1);
        // Inactive is under a third: the active heads are looked at first,
        // and cold ones go down to the inactive tail rather than out.
        let v = l.isolate(1, 0, |_| Look::Cold, |_| true, |_| {});
        assert_eq!(v, [1]);
        assert_eq!(l.inactive, [7]);
        assert_eq!(l.active, [8, 9]);
    }

    #[test]
    fn gone_folios_leave_and_the_look_budget_is_bounded() {
        let mut l = lru(100);
        let mut looks = 0;
        let mut left = 0;
        // Everything is accessed: after 16 looks per victim wanted, heads
        // are taken as they come (only `live` is asked).
        let v = l.isolate(
            2,
            0,
            |_| {
                looks += 1;
                Look::Accessed
            },
            |x| x % 2 == 1,
            |_| left += 1,
        );
        assert_eq!(looks, 32);
        assert_eq!(v.len(), 2);
        assert!(v.iter().all(|x| x % 2 == 1));
        assert_eq!(l.unlooked_victims, 2, "both taken without a look");
        let mut l = lru(5);
        let v = l.isolate(3, 0, |x| if *x < 2 { Look::Gone } else { Look::Cold }, |_| true, |_| {});
        assert_eq!(v, [2, 3, 4]);
        assert_eq!(l.len(), 0);
        assert_eq!(l.unlooked_victims, 0, "each victim was looked at");
    }
}
