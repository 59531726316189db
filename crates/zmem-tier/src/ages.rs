//! Where each pool entry stands by age: counts of the entries in the pool
//! by their store-clock id (`crate::store::id_clock`), in buckets of
//! `BUCKET` ids, so that the pool's oldest `w` entries can be told by id.
//!
//! Entries leave the pool from anywhere (a load takes whichever page the
//! program touched), not only from the old end, so an entry's age (pages
//! stored since) does not say where it stands: its place from the young
//! end is the entries stored after it that are still there. These counts
//! give that place, to within a bucket.
//!
//! The buckets are a ring over the last `SLOTS * BUCKET` ids. Each slot
//! holds its bucket's number beside the count, in one word; the first
//! change to a slot for a newer bucket moves what the slot held into
//! `older`, the entries older than the ring, which are counted but not
//! placed.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

/// Ids per bucket: 1 MiB of stored pages, finer than the balance's
/// smallest window (a step of the pool's share).
const BUCKET: u32 = 256;
/// Buckets in the ring: it places the last 4M pages stored (16 GiB).
const SLOTS: usize = 1 << 14;
/// Bucket numbers are ids / `BUCKET`: 24 bits, compared with wrapping.
const NUMBERS: u32 = u32::MAX / BUCKET + 1;

pub(crate) struct Ages {
    /// Slot `b % SLOTS` holds bucket `b`'s number (high half) and the
    /// entries in it (low half, signed).
    slots: Box<[AtomicU64]>,
    /// Entries in buckets that have left the ring.
    older: AtomicI64,
}

impl std::fmt::Debug for Ages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ages").field("older", &self.older.load(Relaxed)).finish_non_exhaustive()
    }
}

fn pack(bucket: u32, count: i32) -> u64 {
    (u64::from(bucket) << 32) | u64::from(count as u32)
}

fn unpack(w: u64) -> (u32, i32) {
    ((w >> 32) as u32, w as u32 as i32)
}

/// Whether bucket number `a` comes after `b` (24-bit, wrapping).
fn after(a: u32, b: u32) -> bool {
    let d = a.wrapping_sub(b) % NUMBERS;
    d != 0 && d < NUMBERS / 2
}

impl Ages {
    pub(crate) fn new() -> Self {
        Self { slots: (0..SLOTS).map(|_| AtomicU64::new(pack(0, 0))).collect(), older: AtomicI64::new(0) }
    }

    /// An entry with store-clock id `id` came into the pool.
    pub(crate) fn stored(&self, id: u32) {
        self.add(id, 1);
    }

    /// The entry with id `id` left the pool (loaded, invalidated, written
    /// back, or given a new id).
    pub(crate) fn removed(&self, id: u32) {
        self.add(id, -1);
    }

    fn add(&self, id: u32, delta: i32) {
        let bucket = id / BUCKET;
        let slot = &self.slots[bucket as usize % SLOTS];
        let mut cur = slot.load(Relaxed);
        loop {
            let (held, count) = unpack(cur);
            let (new, moved) = if held == bucket {
                (pack(bucket, count + delta), 0)
            } else if count == 0 || after(bucket, held) {
                // The ring came round (or the slot is empty): what the slot
                // held is older now.
                (pack(bucket, delta), count)
            } else {
                // This entry's bucket has left the ring.
                self.older.fetch_add(i64::from(delta), Relaxed);
                return;
            };
            match slot.compare_exchange_weak(cur, new, Relaxed, Relaxed) {
                Ok(_) => {
                    if moved != 0 {
                        self.older.fetch_add(i64::from(moved), Relaxed);
                    }
                    return;
                }
                Err(now) => cur = now,
            }
        }
    }

    /// The entries counted, placed or older.
    pub(crate) fn entries(&self) -> i64 {
        self.older.load(Relaxed) + self.slots.iter().map(|s| i64::from(unpack(s.load(Relaxed)).1)).sum::<i64>()
    }

    /// The age (pages stored since, at store clock `clock`) from which an
    /// entry lies among the pool's `w` oldest: the entries stored after
    /// the `n − w` youngest, to within a bucket (interpolated in it). 0
    /// when `w` is 0 or holds the whole pool. The counts are read one slot
    /// at a time, as stores and loads go on beside; what comes of that is
    /// a place off by the entries that moved meanwhile.
    pub(crate) fn cold_age(&self, clock: u32, w: u64) -> u64 {
        // Two passes over the slots, allocating nothing (the reclaim
        // thread calls this every 50 ms): the total, then the walk.
        let n = self.entries();
        if w == 0 || w as i64 >= n {
            return 0;
        }
        let warm = n - w as i64;
        let now = clock / BUCKET;
        let mut seen = 0;
        for k in 0..SLOTS as u32 {
            let b = now.wrapping_sub(k) % NUMBERS;
            let (held, count) = unpack(self.slots[b as usize % SLOTS].load(Relaxed));
            let count = i64::from(count);
            if held != b || count <= 0 {
                continue;
            }
            if seen + count >= warm {
                // The window starts in bucket `b`, (warm − seen) of its
                // `count` entries down from its young end (the clock, in
                // the bucket the clock is in).
                let into = (warm - seen) as f64 / count as f64;
                let (top, span) = match k {
                    0 => (0, clock % BUCKET),
                    k => (clock % BUCKET + (k - 1) * BUCKET, BUCKET),
                };
                return u64::from(top) + (into * f64::from(span)).round() as u64;
            }
            seen += count;
        }
        // The warm entries reach past the ring: only those older are cold.
        (SLOTS as u64) * u64::from(BUCKET)
    }
}

#[cfg(test)]
mod tests {
    use super::{Ages, BUCKET, SLOTS};
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    /// The exact answer: the age of the oldest of the `n − w` youngest ids.
    fn exact(ids: &BTreeSet<u32>, clock: u32, w: usize) -> u64 {
        if w == 0 || w >= ids.len() {
            return 0;
        }
        let start = *ids.iter().rev().nth(ids.len() - w - 1).expect("n − w youngest");
        u64::from(clock - start)
    }

    /// Ages holding the entries `ids`, stored in that order.
    fn holding(ids: impl IntoIterator<Item = u32>) -> Ages {
        let a = Ages::new();
        ids.into_iter().for_each(|id| a.stored(id));
        a
    }

    /// `age` is `want` to within a bucket.
    fn near(age: u64, want: u64) {
        assert!(age.abs_diff(want) <= u64::from(BUCKET), "{age} against {want}");
    }

    #[test]
    fn writeback_alone_places_the_window_at_its_age() {
        let a = holding(1..=10_000);
        // The 1000 oldest of 10000 start 9000 ids back.
        near(a.cold_age(10_001, 1000), 9000);
    }

    #[test]
    fn loads_from_anywhere_push_the_window_back_in_age() {
        let a = holding(1..=20_000);
        // Loads took every other young entry: the 5000 youngest left reach
        // twice as far back.
        for id in (10_001..=20_000).step_by(2) {
            a.removed(id);
        }
        near(a.cold_age(20_001, 10_000), 10_000);
    }

    #[test]
    fn no_window_or_a_window_as_large_as_the_pool_holds_every_entry() {
        assert_eq!(Ages::new().cold_age(1, 0), 0);
        let a = holding(1..=100);
        assert_eq!(a.cold_age(101, 0), 0);
        assert_eq!(a.cold_age(101, 100), 0);
        assert_eq!(a.cold_age(101, 5000), 0);
    }

    #[test]
    fn entries_older_than_the_ring_are_counted_not_placed() {
        let span = SLOTS as u32 * BUCKET;
        // The ring comes round: 1000 more, a whole ring later.
        let a = holding((1..=1000).chain(span + 1..=span + 1000));
        // The old 1000 are the cold half.
        near(a.cold_age(span + 1001, 1000), 1000);
        // Their leaving is counted, though their bucket is gone.
        for id in 1..=1000 {
            a.removed(id);
        }
        near(a.cold_age(span + 1001, 500), 500);
    }

    #[test]
    fn ids_that_wrap_keep_their_order() {
        let first = u32::MAX - 5000;
        let a = holding((0..10_000u32).map(|i| first.wrapping_add(i)));
        near(a.cold_age(first.wrapping_add(10_000), 2000), 8000);
    }

    proptest! {
        /// Stores in id order, removals from anywhere: the place is the
        /// exact one to within a bucket's entries.
        #[test]
        fn the_window_starts_within_a_bucket_of_the_exact_place(
            n in 1usize..6000,
            removals in prop::collection::vec(any::<prop::sample::Index>(), 0..3000),
            w in 0usize..6000,
        ) {
            let a = Ages::new();
            let mut ids = BTreeSet::new();
            for id in 1..=n as u32 {
                a.stored(id);
                ids.insert(id);
            }
            for r in removals {
                if ids.is_empty() {
                    break;
                }
                let id = *ids.iter().nth(r.index(ids.len())).expect("in range");
                ids.remove(&id);
                a.removed(id);
            }
            let clock = n as u32 + 1;
            let got = a.cold_age(clock, w as u64);
            let want = exact(&ids, clock, w);
            if want == 0 {
                prop_assert_eq!(got, 0);
            } else {
                prop_assert!(got.abs_diff(want) <= u64::from(BUCKET), "{} against {}", got, want);
            }
        }
    }
}
