//! Loom model of the store / invalidate / writeback race, on the tier's own
//! `Tree` and `Shard` code: writeback picks an entry under the shard lock,
//! writes with no lock held, and commits only if the entry is still the one
//! it picked. Whatever the interleaving, the old object is freed exactly
//! once, the swap slot is either referenced by the final entry or freed
//! exactly once, and the shard holds the pool only while an entry needs it.
//! Recompression, which moves an entry's object to another pool between
//! writeback's pick and commit, is modelled against writeback too.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p zmem-tier --test loom --release`.
#![cfg(loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use zmem_tier::entry::{Entry, Stored};
use zmem_tier::tree::Tree;
use zmem_zsmalloc::Handle;

const KEY: u64 = 42;
const SLOT: u32 = 5;
/// Entry 1's object, written back compressed: it keeps the pool (for its
/// compressor) until it goes.
const SWAPPED: Stored = Stored::Swap { slot: SLOT, off: 300, len: 100 };

#[derive(Debug, Default)]
struct Freed {
    old_obj: AtomicUsize,
    new_obj: AtomicUsize,
    slot: AtomicUsize,
}

fn entry(id: u32, h: u64) -> Entry {
    Entry {
        id,
        pool: 0,
        stored: Stored::Pool { handle: Handle::from_raw(h), len: 100 },
        referenced: false,
        cached: false,
    }
}

fn free_obj(f: &Freed, e: &Entry) {
    match e.stored {
        Stored::Pool { handle, .. } if handle.to_raw() == 1 => f.old_obj.fetch_add(1, Ordering::SeqCst),
        Stored::Pool { .. } => f.new_obj.fetch_add(1, Ordering::SeqCst),
        _ => unreachable!(),
    };
}

fn free_slot(f: &Freed, e: &Entry) {
    assert_eq!(e.stored, SWAPPED);
    f.slot.fetch_add(1, Ordering::SeqCst);
}

fn model(third: fn(&Tree<Arc<()>>, &Freed, &Arc<()>)) {
    loom::model(move || {
        let tree: Arc<Tree<Arc<()>>> = Arc::new(Tree::default());
        let pool = Arc::new(());
        let freed = Arc::new(Freed::default());
        tree.lock(KEY).insert(KEY, entry(1, 1), &pool);

        let wb = {
            let (tree, freed) = (Arc::clone(&tree), Arc::clone(&freed));
            thread::spawn(move || {
                // Pick: still entry 1, in the pool?
                let picked = tree.lock(KEY).get(KEY).is_some_and(|e| e.id == 1 && e.in_pool());
                if !picked {
                    return;
                }
                // (the page is written to SLOT here, with no lock held)
                let mut shard = tree.lock(KEY);
                let r = shard.writeback_commit(KEY, 1, Handle::from_raw(1), SWAPPED, |_, e| free_obj(&freed, e));
                drop(shard);
                if r.is_err() {
                    freed.slot.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        let other = {
            let (tree, freed, pool) = (Arc::clone(&tree), Arc::clone(&freed), Arc::clone(&pool));
            thread::spawn(move || third(&tree, &freed, &pool))
        };
        wb.join().unwrap();
        other.join().unwrap();

        let mut shard = tree.lock(KEY);
        let fin = shard.get(KEY);
        assert_eq!(freed.old_obj.load(Ordering::SeqCst), 1, "the old object is freed exactly once");
        let slot_freed = freed.slot.load(Ordering::SeqCst);
        match fin {
            // SLOT holds entry 1's page: only entry 1 may point at it.
            Some(e @ Entry { stored: Stored::Swap { slot, .. }, .. }) => {
                assert_eq!((e.id, slot, slot_freed), (1, SLOT, 0), "key {KEY} points at another entry's page");
            }
            _ => assert!(slot_freed <= 1, "slot freed {slot_freed} times"),
        }
        // The newer entry's object is untouched while it is the entry.
        if fin.is_some_and(|e| e.id == 2) {
            assert_eq!(fin.unwrap().stored, Stored::Pool { handle: Handle::from_raw(2), len: 100 });
            assert_eq!(freed.new_obj.load(Ordering::SeqCst), 0);
        }
        // The shard holds the pool exactly while an entry needs it (in the
        // pool, or written back compressed).
        assert_eq!(shard.pool(0).is_some(), fin.is_some_and(|e| e.holds_pool()));
        if let Some(e) = shard.remove(KEY) {
            let _ = shard.release(e, |_, e| free_obj(&freed, e), |e| free_slot(&freed, e));
        }
        assert!(shard.pool(0).is_none());
    });
}

#[test]
fn writeback_races_invalidate() {
    model(|tree, freed, _| {
        let mut shard = tree.lock(KEY);
        if let Some(e) = shard.remove(KEY) {
            let _ = shard.release(e, |_, e| free_obj(freed, e), |e| free_slot(freed, e));
        }
    });
}

#[test]
fn writeback_races_a_new_store() {
    model(|tree, freed, pool| {
        let mut shard = tree.lock(KEY);
        if let Some(old) = shard.insert(KEY, entry(2, 2), pool) {
            let _ = shard.release(old, |_, e| free_obj(freed, e), |e| free_slot(freed, e));
        }
    });
}

/// Writeback and recompression both pick entry 1's object (handle 1, pool
/// 0), work with no lock held, and commit. Exactly one commit goes
/// through; the other's copy (slot or new object) is freed by its caller.
/// An entry left in the swap file holds the bytes of handle 1 under pool
/// 0's compressor, never pool 1's.
#[test]
fn writeback_races_a_recompression() {
    loom::model(|| {
        let tree: Arc<Tree<Arc<()>>> = Arc::new(Tree::default());
        let (pool0, pool1) = (Arc::new(()), Arc::new(()));
        let freed = Arc::new(Freed::default());
        tree.lock(KEY).insert(KEY, entry(1, 1), &pool0);
        let wb = {
            let (tree, freed) = (Arc::clone(&tree), Arc::clone(&freed));
            thread::spawn(move || {
                let mut shard = tree.lock(KEY);
                if shard.writeback_commit(KEY, 1, Handle::from_raw(1), SWAPPED, |_, e| free_obj(&freed, e)).is_err() {
                    freed.slot.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        let rc = {
            let (tree, freed, pool1) = (Arc::clone(&tree), Arc::clone(&freed), Arc::clone(&pool1));
            thread::spawn(move || {
                let to = Stored::Pool { handle: Handle::from_raw(3), len: 60 };
                let mut shard = tree.lock(KEY);
                let r =
                    shard.recompress_commit(KEY, 1, Handle::from_raw(1), (1, &pool1), to, |_, e| free_obj(&freed, e));
                drop(shard);
                if r.is_err() {
                    freed.new_obj.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        wb.join().unwrap();
        rc.join().unwrap();
        let mut shard = tree.lock(KEY);
        let fin = shard.get(KEY).expect("the entry stays");
        assert_eq!(freed.old_obj.load(Ordering::SeqCst), 1, "handle 1 is freed exactly once");
        match fin.stored {
            Stored::Swap { .. } => {
                assert_eq!((fin.pool, freed.slot.load(Ordering::SeqCst)), (0, 0), "the slot's object is pool 0's");
                assert_eq!(freed.new_obj.load(Ordering::SeqCst), 1, "the recompressed copy is freed");
                assert!(shard.pool(0).is_some() && shard.pool(1).is_none());
            }
            Stored::Pool { handle, .. } => {
                assert_eq!((handle.to_raw(), fin.pool), (3, 1));
                assert_eq!((freed.slot.load(Ordering::SeqCst), freed.new_obj.load(Ordering::SeqCst)), (1, 0));
                assert!(shard.pool(0).is_none() && shard.pool(1).is_some());
            }
            Stored::SameFilled(_) => unreachable!(),
        }
        if let Some(e) = shard.remove(KEY) {
            let _ = shard.release(e, |_, e| free_obj(&freed, e), |e| free_slot(&freed, e));
        }
        assert!(shard.pool(0).is_none() && shard.pool(1).is_none());
    });
}
