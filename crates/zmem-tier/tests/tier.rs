//! The tier against a HashMap model, under threads, and with faults injected.
//! Every page that comes back is compared byte for byte.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

#[path = "../../zmem-swapfile/tests/common/small_fs.rs"]
mod small_fs;

use proptest::prelude::*;
use small_fs::SmallFs;
use zmem_common::PAGE_SIZE;
use zmem_compress::corpus::Corpus;
use zmem_compress::{CodecSpec, CompressError, Compressor, DecompressError, Sequential};
use zmem_tier::{LoadOutcome, RejectReason, StoreOutcome, Stored, Tier, TierConfig, TierError};
use zmem_zsmalloc::MempoolConfig;

fn corpus() -> &'static Corpus {
    Corpus::sample()
}

fn random_page(seed: u64) -> Vec<u8> {
    zmem_compress::corpus::incompressible_page(seed)
}

/// A page of one of the kinds the tier treats differently.
fn page(kind: u8, seed: u64) -> Vec<u8> {
    zmem_compress::corpus::page_of_kind(kind, seed)
}

fn cfg(limit: usize, writeback: bool) -> TierConfig {
    let base = if writeback { TierConfig::default() } else { TierConfig::without_writeback() };
    TierConfig { max_pool_bytes: Some(limit), ..base }
}

fn load(t: &Tier, key: u64) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; PAGE_SIZE];
    match t.load(key, &mut buf).unwrap() {
        LoadOutcome::Loaded => Some(buf),
        LoadOutcome::NotFound => None,
    }
}

#[derive(Debug, Clone)]
enum Op {
    Store { key: u64, kinds: Vec<(u8, u64)> },
    Load(u64),
    Invalidate(u64),
    Writeback(usize),
    Switch(u8),
    Compact,
    Recompress(usize, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..64, prop::collection::vec((any::<u8>(), any::<u64>()), 1..6)).prop_map(|(key, kinds)| Op::Store { key, kinds }),
        4 => (0u64..70).prop_map(Op::Load),
        2 => (0u64..70).prop_map(Op::Invalidate),
        1 => (1usize..40).prop_map(Op::Writeback),
        1 => (0u8..4).prop_map(Op::Switch),
        1 => Just(Op::Compact),
        1 => (1usize..40, any::<bool>()).prop_map(|(n, idle)| Op::Recompress(n, idle)),
    ]
}

const SPECS: [&str; 4] = ["lz4", "zstd:1", "lzo-rle", "deflate:1"];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_operations_match_a_hashmap(ops in prop::collection::vec(op(), 1..120), writeback: bool, limit_pages in 8usize..64) {
        let t = Tier::new(cfg(limit_pages * PAGE_SIZE, writeback)).unwrap();
        let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
        for op in ops {
            match op {
                Op::Store { key, kinds } => {
                    let pages: Vec<Vec<u8>> = kinds.iter().map(|&(k, s)| page(k, s)).collect();
                    match t.store(key, &pages.concat()).unwrap() {
                        StoreOutcome::Stored { .. } => {
                            for (i, p) in pages.into_iter().enumerate() {
                                model.insert(key + i as u64, p);
                            }
                        }
                        StoreOutcome::Rejected(r) => {
                            if writeback {
                                prop_assert_ne!(r, RejectReason::CompressPoor);
                            }
                            for i in 0..pages.len() as u64 {
                                model.remove(&(key + i));
                                prop_assert!(t.lookup(key + i).is_none(), "a rejected store left key {} behind", key + i);
                            }
                        }
                    }
                }
                Op::Load(key) => prop_assert_eq!(load(&t, key), model.remove(&key), "key {}", key),
                Op::Invalidate(key) => prop_assert_eq!(t.invalidate(key), model.remove(&key).is_some()),
                Op::Writeback(n) => {
                    let went = t.writeback(n);
                    prop_assert!(went <= n);
                    if !writeback { prop_assert_eq!(went, 0); }
                }
                Op::Switch(i) => t.set_compressor(SPECS[i as usize].parse().unwrap()).unwrap(),
                Op::Compact => { t.compact(); }
                Op::Recompress(n, idle) => {
                    let r = t.recompress("zstd:3".parse().unwrap(), n, idle).unwrap();
                    prop_assert!(r.moved <= n && r.moved <= r.scanned, "{:?}", r);
                }
            }
            let s = t.stats();
            let in_swap = (0..70).filter(|&k| matches!(t.lookup(k), Some(Stored::Swap { .. }))).count() as u64;
            prop_assert_eq!(s.stored_pages + in_swap, model.len() as u64);
            prop_assert_eq!(s.swap_pages, in_swap);
        }
        for (k, want) in model {
            prop_assert!(load(&t, k).as_ref() == Some(&want), "key {}", k);
        }
        let s = t.stats();
        prop_assert_eq!((s.stored_pages, s.swap_pages, s.pool_total_size), (0, 0, 0));
        prop_assert_eq!(s.pools, 1, "old pools are freed with their last entry");
        prop_assert_eq!(s.decompress_fail, 0);
    }
}

#[test]
fn same_filled_pages_use_no_pool_memory() {
    let t = Tier::new(cfg(1 << 20, false)).unwrap();
    let folio = [page(0, 0), page(1, 7), page(1, 9)].concat();
    assert_eq!(t.store(100, &folio).unwrap(), StoreOutcome::Stored { same_filled: 3, incompressible: 0 });
    assert_eq!(t.pool_total_size(), 0);
    assert_eq!(t.stats().same_filled_pages, 3);
    assert_eq!(load(&t, 101).unwrap(), page(1, 7));
    assert_eq!(t.stats().same_filled_pages, 2);
}

#[test]
fn incompressible_pages_are_raw_with_writeback_and_rejected_without() {
    let with = Tier::new(cfg(1 << 20, true)).unwrap();
    let folio = [corpus().page(5).to_vec(), random_page(1)].concat();
    assert_eq!(with.store(0, &folio).unwrap(), StoreOutcome::Stored { same_filled: 0, incompressible: 1 });
    assert_eq!(with.stats().stored_incompressible_pages, 1);
    assert_eq!(load(&with, 1).unwrap(), random_page(1));

    let without = Tier::new(cfg(1 << 20, false)).unwrap();
    without.store(1, corpus().page(9)).unwrap();
    assert_eq!(without.store(0, &folio).unwrap(), StoreOutcome::Rejected(RejectReason::CompressPoor));
    assert_eq!(without.stats().reject_compress_poor, 1);
    // All or nothing, and the older entry for key 1 is gone too.
    assert!(without.lookup(0).is_none() && without.lookup(1).is_none());
    assert_eq!(without.stats().stored_pages, 0);
}

#[test]
fn the_pool_limit_rejects_with_hysteresis_when_writeback_is_off() {
    let limit = 64 * PAGE_SIZE;
    let t = Tier::new(TierConfig { accept_threshold_percent: 50, ..cfg(limit, false) }).unwrap();
    let mut k = 0;
    let rejected = loop {
        match t.store(k, corpus().page(k as usize)).unwrap() {
            StoreOutcome::Stored { .. } => k += 1,
            StoreOutcome::Rejected(r) => break r,
        }
        assert!(k < 10_000);
    };
    assert_eq!(rejected, RejectReason::PoolLimit);
    assert!(t.stats().pool_limit_hit >= 1);
    // Freeing a little is not enough: below the accept threshold only.
    for key in 0..4 {
        t.invalidate(key);
    }
    assert_eq!(t.store(50_000, corpus().page(3)).unwrap(), StoreOutcome::Rejected(RejectReason::PoolLimit));
    for key in 4..k {
        t.invalidate(key);
    }
    t.compact();
    assert!(matches!(t.store(50_000, corpus().page(3)).unwrap(), StoreOutcome::Stored { .. }));
}

#[test]
fn the_shrinker_writes_back_cold_entries_and_they_load_from_the_file() {
    let limit = 128 * PAGE_SIZE;
    let t = Tier::new(cfg(limit, true)).unwrap();
    let n = 2000u64;
    for k in 0..n {
        assert!(matches!(t.store(k, corpus().page(k as usize)).unwrap(), StoreOutcome::Stored { .. }));
    }
    let s = t.stats();
    let before = s;
    assert!(s.written_back_pages > 0 && s.swap_pages > 0, "{s:?}");
    assert!(s.pool_total_size as usize <= limit + 16 * PAGE_SIZE, "{s:?}");
    assert!(t.swap_file().unwrap().encrypted());
    // The coldest went first.
    assert!(matches!(t.lookup(0), Some(Stored::Swap { .. })));
    // Compressed writeback: objects go as they are, several to a slot.
    assert!(s.swap_slots < s.swap_pages, "{s:?}");
    assert!(s.swap_written_bytes < s.written_back_pages * PAGE_SIZE as u64 * 3 / 4, "{s:?}");
    // A new compressor: entries written back by the old one still load (the
    // old pool stays for them).
    t.set_compressor("zstd:1".parse().unwrap()).unwrap();
    assert_eq!(t.stats().pools, 2);
    // The first page written back lies further back in the writeback
    // stream than the pool holds entries: a pool twice as large would not
    // have kept it.
    assert!(load(&t, 0).unwrap() == corpus().page(0));
    let first = t.stats();
    assert_eq!((first.pswpin, first.swap_refaults), (1, 0), "{first:?}");
    for k in 1..n {
        assert!(load(&t, k).unwrap() == corpus().page(k as usize), "key {k}");
    }
    let s = t.stats();
    assert_eq!((s.swap_pages, s.swap_slots, s.pools), (0, 0, 1), "{s:?}");
    // Every page that was in the file was read from it; the last ones
    // written back are swap refaults.
    assert_eq!(s.pswpin, before.swap_pages, "{s:?}");
    assert!(s.swap_refaults > 0 && s.swap_refaults < s.pswpin, "{s:?}");
    // With the default window (all the pool), every load from the pool is
    // from its cold end.
    assert!(s.cold_pool_loads > 0 && s.cold_pool_loads <= s.zswpin - s.pswpin, "{s:?}");
    assert_eq!(t.shrinker().count(), 0);
}

#[test]
fn a_lowered_pool_limit_writes_back_down_to_it_and_every_page_loads() {
    let t = Tier::new(cfg(4096 * PAGE_SIZE, true)).unwrap();
    let n = 1500u64;
    for k in 0..n {
        assert!(matches!(t.store(k, corpus().page(k as usize)).unwrap(), StoreOutcome::Stored { .. }));
    }
    assert_eq!(t.stats().written_back_pages, 0, "under the first limit nothing goes");
    assert!(t.shrink_to_limit(), "within its limit, nothing to do");
    let before = t.pool_total_size();
    // A share that shrank: a quarter of what the pool holds now.
    let limit = before / 4;
    t.set_max_pool_bytes(limit);
    assert_eq!(t.max_pool_bytes(), limit);
    assert!(t.shrink_to_limit(), "{:?}", t.stats());
    let s = t.stats();
    assert!(s.pool_total_size as usize <= limit && s.written_back_pages > 0, "{s:?}");
    for k in 0..n {
        assert!(load(&t, k).unwrap() == corpus().page(k as usize), "key {k}");
    }
    // Without writeback, nothing can go: the pool stays over the limit, and
    // says so.
    let t = Tier::new(cfg(1024 * PAGE_SIZE, false)).unwrap();
    for k in 0..200 {
        t.store(k, corpus().page(k as usize)).unwrap();
    }
    t.set_max_pool_bytes(PAGE_SIZE);
    assert!(!t.shrink_to_limit());
    for k in 0..200 {
        assert!(load(&t, k).unwrap() == corpus().page(k as usize), "key {k}");
    }
}

/// Keys are any u64: the last block of the key space (its end is 2^64) is
/// written back, cached, dropped and loaded like any other. Its end
/// overflowed in the writeback scan (a panic in a debug build).
#[test]
fn keys_at_the_end_of_the_key_space_are_written_back_and_load() {
    let t = Tier::new(TierConfig { exclusive_loads: false, ..cfg(4096 * PAGE_SIZE, true) }).unwrap();
    let keys: Vec<u64> = (0..64).map(|i| u64::MAX - i).collect();
    for (i, &k) in keys.iter().enumerate() {
        t.store(k, corpus().page(i)).unwrap();
    }
    // Half of them loaded and kept as clean copies.
    for (i, &k) in keys.iter().enumerate().step_by(2) {
        assert!(load(&t, k).unwrap() == corpus().page(i), "key {k:#x}");
        assert!(t.retain_clean(k, corpus().page(i), true));
    }
    t.set_max_pool_bytes(PAGE_SIZE);
    t.shrink_to_limit();
    let s = t.stats();
    assert!(s.written_back_pages > 0 && s.cached_dropped > 0, "{s:?}");
    for (i, &k) in keys.iter().enumerate().skip(1).step_by(2) {
        assert!(load(&t, k).unwrap() == corpus().page(i), "key {k:#x}");
    }
}

#[test]
fn a_compressor_switch_keeps_old_entries_loadable_and_frees_their_pool() {
    let t = Tier::new(cfg(64 << 20, false)).unwrap();
    for k in 0..100 {
        t.store(k, corpus().page(k as usize)).unwrap();
    }
    t.set_compressor("zstd:3".parse().unwrap()).unwrap();
    assert_eq!(t.compressor(), "zstd:3");
    for k in 100..200 {
        t.store(k, corpus().page(k as usize)).unwrap();
    }
    assert_eq!(t.stats().pools, 2);
    for k in 0..100 {
        assert!(load(&t, k).unwrap() == corpus().page(k as usize));
    }
    assert_eq!(t.stats().pools, 1, "the lz4 pool went with its last entry");
    for k in 100..200 {
        assert!(load(&t, k).unwrap() == corpus().page(k as usize));
    }
}

/// An entry has 15 bits for its pool's id, so ids wrap. After 2^15
/// switches the id of a pool that still has entries comes round again; it
/// must be skipped, or a new pool's entries would be expanded by the old
/// one's compressor (and freed into its zs pool).
#[test]
fn pool_ids_wrap_past_pools_that_still_have_entries() {
    let t = Tier::new(cfg(64 << 20, false)).unwrap();
    t.store(0, corpus().page(0)).unwrap();
    // The first pool's id is 0 and switches count up from 1: the last of
    // 2^15 switches comes round to 0. Without the skip, its entries and the
    // first pool's share an id (`DoubleFree` when they are loaded).
    let specs = ["lz4", "zstd:1"];
    for i in 0..1 << 15 {
        t.set_compressor(specs[i % 2].parse().unwrap()).unwrap();
    }
    assert_eq!(t.compressor(), "zstd:1");
    assert_eq!(t.stats().pools, 2, "the first pool lives on with its entry");
    // The first pool was lz4 and the current one is zstd:1: were their ids
    // the same, one of these would expand with the other's codec.
    for k in 1..64 {
        t.store(k, corpus().page(k as usize)).unwrap();
    }
    for k in 0..64 {
        assert!(load(&t, k).unwrap() == corpus().page(k as usize), "page {k}");
    }
    assert_eq!(t.stats().pools, 1);
}

#[test]
fn bad_folios_are_errors_that_change_nothing() {
    let t = Tier::new(cfg(1 << 20, false)).unwrap();
    for len in [0, 100, PAGE_SIZE + 1, 513 * PAGE_SIZE] {
        assert!(matches!(t.store(0, &vec![1u8; len]), Err(TierError::BadFolio { .. })), "{len}");
    }
    assert!(matches!(t.load(0, &mut [0u8; 100]), Err(TierError::BadFolio { .. })));
    assert_eq!(t.stats().zswpout, 0);
    let e = Tier::new(TierConfig { max_pool_percent: 0, ..TierConfig::default() }).unwrap_err();
    assert!(e.to_string().contains("1..=100"), "{e}");
    let e = Tier::new(TierConfig { writeback: true, swap: None, ..TierConfig::default() }).unwrap_err();
    assert!(e.to_string().contains("swap file"), "{e}");
}

/// lz4 that fails on every page after the first `ok` calls.
struct Failing {
    inner: Box<dyn Compressor>,
    ok: usize,
}

impl Compressor for Failing {
    fn name(&self) -> &str {
        "lz4"
    }
    fn compress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, CompressError> {
        if self.ok == 0 {
            return Err(CompressError::Codec { codec: "lz4", msg: "injected failure".into() });
        }
        self.ok -= 1;
        self.inner.compress(src, dst)
    }
    fn decompress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, DecompressError> {
        self.inner.decompress(src, dst)
    }
}

#[test]
fn a_failing_codec_rejects_the_whole_folio() {
    let factory: zmem_compress::Factory =
        Arc::new(|| Box::new(Failing { inner: "lz4".parse::<CodecSpec>().unwrap().build(), ok: 3 }));
    let t = Tier::with_compressor(cfg(1 << 20, true), Arc::new(Sequential::new(factory, 8).unwrap())).unwrap();
    t.store(10, corpus().page(1)).unwrap();
    let folio: Vec<u8> = corpus().pages().take(8).flatten().copied().collect();
    assert_eq!(t.store(10, &folio).unwrap(), StoreOutcome::Rejected(RejectReason::CompressFail));
    assert_eq!(t.stats().reject_compress_fail, 1);
    assert!((10..18).all(|k| t.lookup(k).is_none()), "nothing stays, the old entry neither");
    assert_eq!(t.pool_total_size(), 0, "objects of the pages that did compress were freed");
}

#[test]
fn a_pool_that_cannot_allocate_rejects_and_keeps_the_rest() {
    let mp = MempoolConfig { min_nr: 0, max_pages: Some(24), ..MempoolConfig::default() };
    let t = Tier::new(TierConfig { mempool: mp, ..cfg(64 << 20, false) }).unwrap();
    let mut stored = Vec::new();
    let mut k = 0u64;
    loop {
        match t.store(k, corpus().page(k as usize)).unwrap() {
            StoreOutcome::Stored { .. } => stored.push(k),
            StoreOutcome::Rejected(r) => {
                assert_eq!(r, RejectReason::AllocFail);
                break;
            }
        }
        k += 1;
        assert!(k < 5000);
    }
    assert_eq!(t.stats().reject_alloc_fail, 1);
    for k in stored {
        assert!(load(&t, k).unwrap() == corpus().page(k as usize));
    }
}

#[test]
fn enospc_during_writeback_keeps_every_entry() {
    let Some(fs) = SmallFs::mount(128, "enospc_during_writeback_keeps_every_entry") else { return };
    let t = Tier::new(cfg(64 << 20, true).with_swap_dir(fs.0.clone(), true)).unwrap();
    for k in 0..400 {
        t.store(k, corpus().page(k as usize)).unwrap();
    }
    let went = t.writeback(400);
    let s = t.stats();
    assert!((16..400).contains(&went), "a 128 KiB file takes some, not all: {went}");
    assert!(s.reject_reclaim_fail > 0, "{s:?}");
    for k in 0..400 {
        assert!(load(&t, k).unwrap() == corpus().page(k as usize), "key {k}");
    }
    drop(t);
}

#[test]
fn a_corrupt_slot_is_an_error_and_the_entry_stays() {
    let t = Tier::new(cfg(64 << 20, true)).unwrap();
    t.store(7, corpus().page(7)).unwrap();
    // One call gets past the second chance (`referenced` is set on store).
    assert_eq!(t.writeback(1), 1);
    let Some(Stored::Swap { slot, .. }) = t.lookup(7) else { panic!("written back") };
    let f = t.swap_file().unwrap().file();
    let off = u64::from(slot) * PAGE_SIZE as u64 + 99;
    let mut b = [0u8];
    f.read_exact_at(&mut b, off).unwrap();
    f.write_all_at(&[b[0] ^ 0x80], off).unwrap();
    let mut buf = vec![0u8; PAGE_SIZE];
    assert!(matches!(t.load(7, &mut buf), Err(TierError::Swap { key: 7, .. })));
    assert_eq!(t.stats().decompress_fail, 1);
    assert!(t.lookup(7).is_some(), "a failed load loses nothing");
    // Put the byte back: the page is intact.
    f.write_all_at(&b, off).unwrap();
    assert!(load(&t, 7).unwrap() == corpus().page(7));
}

#[test]
fn eight_threads_store_load_and_invalidate_with_writeback_switches_and_recompression() {
    let t = Arc::new(Tier::new(cfg(256 * PAGE_SIZE, true)).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bg = {
        let (t, stop) = (Arc::clone(&t), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                t.writeback(16);
                if i % 50 == 0 {
                    t.set_compressor(SPECS[(i / 50) % SPECS.len()].parse().unwrap()).unwrap();
                }
                if i % 3 == 0 {
                    t.recompress(SPECS[(i / 7) % SPECS.len()].parse().unwrap(), 32, i % 2 == 0).unwrap();
                }
                i += 1;
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        })
    };
    std::thread::scope(|s| {
        for th in 0..8u64 {
            let t = Arc::clone(&t);
            s.spawn(move || {
                let base = th << 32;
                let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
                let mut x = th * 7919 + 1;
                for _ in 0..3000 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let key = base + x % 300;
                    match x >> 60 {
                        0..=7 => {
                            let n = 1 + (x >> 20) as usize % 4;
                            let pages: Vec<Vec<u8>> = (0..n as u64).map(|i| page((x >> 8) as u8, x ^ i)).collect();
                            if let StoreOutcome::Stored { .. } = t.store(key, &pages.concat()).unwrap() {
                                for (i, p) in pages.into_iter().enumerate() {
                                    model.insert(key + i as u64, p);
                                }
                            } else {
                                for i in 0..n as u64 {
                                    model.remove(&(key + i));
                                }
                            }
                        }
                        8..=13 => assert_eq!(load(&t, key), model.remove(&key), "thread {th} key {key}"),
                        _ => assert_eq!(t.invalidate(key), model.remove(&key).is_some()),
                    }
                }
                for (k, v) in model {
                    assert!(load(&t, k).as_ref() == Some(&v), "thread {th} key {k}");
                }
            });
        }
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    bg.join().unwrap();
    let s = t.stats();
    assert_eq!((s.stored_pages, s.swap_pages, s.decompress_fail), (0, 0, 0), "{s:?}");
    assert!(s.written_back_pages > 0 && s.recompressed_pages > 0, "{s:?}");
    // Every entry placed by age left as it went, writeback and
    // recompression racing the loads.
    assert_eq!(t.aged_entries(), 0);
}

/// Real pages stored with lz4 and recompressed with zstd: the pool shrinks,
/// every page loads back bit for bit (from the pool, and from the swap
/// file once written back), incompressible pages stay as they are, and
/// the zstd pool goes with its last entry.
#[test]
fn recompressed_entries_take_less_pool_and_load_bit_for_bit() {
    let t = Tier::new(TierConfig { compressor: "lz4".parse().unwrap(), ..cfg(64 << 20, true) }).unwrap();
    let n = corpus().len().min(2048) as u64;
    let mut want: HashMap<u64, Vec<u8>> = HashMap::new();
    for k in 0..n {
        let p = if k % 97 == 0 { random_page(k) } else { corpus().page(k as usize).to_vec() };
        assert!(matches!(t.store(k, &p).unwrap(), StoreOutcome::Stored { .. }));
        want.insert(k, p);
    }
    let before = t.stats();
    // Stores are referenced: an idle-only pass takes none of them, but
    // clears the mark; a page stored again in between is skipped by the next.
    assert_eq!(t.recompress("zstd".parse().unwrap(), usize::MAX, true).unwrap().moved, 0);
    assert!(matches!(t.store(1, &want[&1]).unwrap(), StoreOutcome::Stored { .. }));
    let r = t.recompress("zstd".parse().unwrap(), usize::MAX, true).unwrap();
    t.compact();
    let after = t.stats();
    assert!(r.moved > (n as usize) / 2 && r.saved_bytes > 0, "{r:?}");
    assert_eq!(after.recompressed_pages, r.moved as u64);
    assert!(after.pool_total_size < before.pool_total_size, "{before:?} {after:?}");
    // Pages lz4 left raw that zstd compresses move too; random ones stay.
    assert!(after.stored_incompressible_pages < before.stored_incompressible_pages, "{before:?} {after:?}");
    for k in (0..n).step_by(97) {
        assert!(matches!(t.lookup(k), Some(Stored::Pool { len, .. }) if len as usize == PAGE_SIZE), "key {k}");
    }
    // The page stored again moves now; then everything that could has.
    let again = t.recompress("zstd".parse().unwrap(), usize::MAX, false).unwrap();
    assert_eq!(again.moved, 1, "{again:?}");
    assert_eq!(t.recompress("zstd".parse().unwrap(), usize::MAX, false).unwrap().moved, 0);
    assert_eq!(t.writeback(n as usize / 3), n as usize / 3);
    for (k, p) in &want {
        assert!(load(&t, *k).as_ref() == Some(p), "key {k}");
    }
    let s = t.stats();
    assert_eq!((s.stored_pages, s.swap_pages, s.pool_total_size, s.pools, s.decompress_fail), (0, 0, 0, 1, 0), "{s:?}");
    eprintln!(
        "recompressed {} of {n} pages: pool {} -> {} bytes ({:.2}x)",
        r.moved,
        before.pool_total_size,
        after.pool_total_size,
        before.pool_total_size as f64 / after.pool_total_size as f64
    );
}

#[test]
fn non_exclusive_loads_keep_the_entry_and_give_it_a_second_chance() {
    let t = Tier::new(TierConfig { exclusive_loads: false, ..cfg(64 << 20, true) }).unwrap();
    for k in 0..64 {
        t.store(k, corpus().page(k as usize)).unwrap();
    }
    // A first writeback pass clears `referenced` on everything it scans.
    assert_eq!(t.writeback(32), 32);
    for _ in 0..3 {
        assert!(load(&t, 40).unwrap() == corpus().page(40), "loads repeat");
    }
    assert!(matches!(t.lookup(40), Some(Stored::Pool { .. })));
    // Written-back entries load from the file and stay there too.
    let in_swap = (0..64).find(|&k| matches!(t.lookup(k), Some(Stored::Swap { .. }))).unwrap();
    for _ in 0..2 {
        assert!(load(&t, in_swap).unwrap() == corpus().page(in_swap as usize));
    }
    assert!(matches!(t.lookup(in_swap), Some(Stored::Swap { .. })));
    assert_eq!(t.stats().zswpin, 5);
    assert!(t.invalidate(40) && !t.invalidate(40));
}

/// `load_many` gives what page-by-page loads give for folios spread over
/// same-filled markers, the pool and the swap file, reads the swap file in
/// runs, and stays right while another thread invalidates and stores the
/// same keys again (its slot-reuse check).
#[test]
fn load_many_matches_load_and_reads_the_swap_file_in_runs() {
    let limit = 64 * PAGE_SIZE;
    let t = Tier::new(TierConfig { exclusive_loads: false, ..cfg(limit, true) }).unwrap();
    let folio = 16usize;
    let folios = 64u64;
    let page_of = move |f: u64, i: usize| -> Vec<u8> {
        if i % 5 == 0 {
            vec![(f as u8).wrapping_add(i as u8); PAGE_SIZE] // same-filled
        } else {
            corpus().page((f as usize * folio + i) % corpus().len()).to_vec()
        }
    };
    for f in 0..folios {
        let data: Vec<u8> = (0..folio).flat_map(|i| page_of(f, i)).collect();
        assert!(matches!(t.store(f * 1000, &data).unwrap(), StoreOutcome::Stored { .. }));
    }
    assert!(t.stats().written_back_pages > 0, "{:?}", t.stats());
    let calls0 = t.swap_file().unwrap().stats().read_calls;
    let mut swapped_pages = 0;
    for f in 0..folios {
        swapped_pages +=
            (0..folio).filter(|&i| matches!(t.lookup(f * 1000 + i as u64), Some(Stored::Swap { .. }))).count();
        let mut buf = vec![0u8; folio * PAGE_SIZE];
        for (i, r) in t.load_many(f * 1000, &mut buf).into_iter().enumerate() {
            assert_eq!(r.unwrap(), LoadOutcome::Loaded, "folio {f} page {i}");
            assert!(buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE] == page_of(f, i)[..], "folio {f} page {i}");
        }
    }
    let calls = t.swap_file().unwrap().stats().read_calls - calls0;
    assert!(swapped_pages > 0 && (calls as usize) < swapped_pages, "{calls} reads for {swapped_pages} pages");
    // Racing invalidations and new stores of the same keys: every page read
    // is either the old or the new version, never another page's bytes.
    let t = std::sync::Arc::new(t);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (t, stop) = (std::sync::Arc::clone(&t), std::sync::Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut f = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let k = (f % folios) * 1000;
                for i in 0..folio as u64 {
                    t.invalidate(k + i);
                }
                let data: Vec<u8> = (0..folio).flat_map(|i| page_of(f % folios, i)).collect();
                let _ = t.store(k, &data).unwrap();
                f += 7;
            }
        })
    };
    for round in 0..200u64 {
        let f = round % folios;
        let mut buf = vec![0u8; folio * PAGE_SIZE];
        for (i, r) in t.load_many(f * 1000, &mut buf).into_iter().enumerate() {
            if r.unwrap() == LoadOutcome::Loaded {
                assert!(buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE] == page_of(f, i)[..], "folio {f} page {i}");
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
}

/// A page loaded and kept (`retain_clean`) is stored again without
/// compressing if its bytes are unchanged, from the pool (compared byte for
/// byte) or the swap file (by its hash); a changed page is compressed anew,
/// and each loads back as its latest bytes.
#[test]
fn kept_entries_are_reused_only_for_unchanged_pages() {
    let t = Tier::new(TierConfig { exclusive_loads: false, ..cfg(64 << 20, true) }).unwrap();
    let n = 64u64;
    t.store(0, &(0..n).flat_map(|k| corpus().page(k as usize).to_vec()).collect::<Vec<u8>>()).unwrap();
    // Half of them go to the swap file.
    assert_eq!(t.writeback(32), 32);
    let mut pages: Vec<Vec<u8>> = (0..n).map(|k| load(&t, k).unwrap()).collect();
    for (k, p) in pages.iter().enumerate() {
        assert!(t.retain_clean(k as u64, p, true), "key {k}");
    }
    let s = t.stats();
    assert_eq!(s.cached_pages, n, "{s:?}");
    let (out, swapped) = (s.zswpout, s.swap_pages);
    assert!(swapped > 0, "{s:?}");
    // Every third page changes, by one byte.
    for (k, p) in pages.iter_mut().enumerate().filter(|(k, _)| k % 3 == 0) {
        p[k * 7 % PAGE_SIZE] ^= 0x5a;
    }
    let folio: Vec<u8> = pages.concat();
    assert!(matches!(t.store_reusing(0, &folio).unwrap(), StoreOutcome::Stored { .. }));
    let s = t.stats();
    let changed = n.div_ceil(3);
    assert_eq!(s.cached_reused, n - changed, "{s:?}");
    assert_eq!(s.zswpout - out, changed, "{s:?}");
    assert_eq!(s.cached_pages, 0, "{s:?}");
    for k in 0..n {
        assert!(load(&t, k).unwrap() == pages[k as usize], "key {k}");
    }
    // A plain store never reuses: a kept entry is replaced.
    assert!(t.retain_clean(5, &pages[5], true));
    t.store(5, &pages[5]).unwrap();
    assert_eq!(t.stats().cached_reused, n - changed);
    // A kept entry whose page was written is dropped by drop_cached, and
    // only a kept one.
    assert!(t.retain_clean(6, &pages[6], true));
    assert!(t.drop_cached(6) && t.lookup(6).is_none());
    assert!(!t.drop_cached(7) && t.lookup(7).is_some());
    for k in 0..n {
        t.invalidate(k);
    }
    let s = t.stats();
    assert_eq!((s.stored_pages, s.swap_pages, s.cached_pages), (0, 0, 0), "{s:?}");
}

/// Without writeback, kept entries are what a full pool frees first, so
/// stores go on being accepted.
#[test]
fn a_full_pool_without_writeback_frees_kept_entries_to_store() {
    let limit = 64 * PAGE_SIZE;
    let t = Tier::new(TierConfig { exclusive_loads: false, ..cfg(limit, false) }).unwrap();
    let mut k = 0u64;
    while matches!(t.store(k, corpus().page(k as usize)).unwrap(), StoreOutcome::Stored { .. }) {
        k += 1;
    }
    let full = k;
    assert!(full > 8, "{:?}", t.stats());
    for k in 0..full {
        let p = load(&t, k).unwrap();
        assert!(t.retain_clean(k, &p, true));
    }
    // Other pages fit now: the kept entries make room.
    for j in 0..full / 2 {
        let key = 1 << 20 | j;
        assert!(
            matches!(t.store(key, corpus().page((full + j) as usize)).unwrap(), StoreOutcome::Stored { .. }),
            "{:?}",
            t.stats()
        );
    }
    let s = t.stats();
    assert!(s.cached_dropped > 0, "{s:?}");
    for j in 0..full / 2 {
        assert!(load(&t, 1 << 20 | j).unwrap() == corpus().page((full + j) as usize));
    }
}

#[derive(Debug, Clone)]
enum KeepOp {
    /// Store pages at `key`; with `reuse`, through `store_reusing`, where
    /// `same` pages keep the bytes they had (if the model knows them).
    Store {
        key: u64,
        kinds: Vec<(u8, u64, bool)>,
        reuse: bool,
    },
    /// Load (non-exclusive) and keep as a clean copy (a pool entry only
    /// with the flag).
    Keep(u64, bool),
    DropCached(u64),
    Invalidate(u64),
    Writeback(usize),
}

fn keep_op() -> impl Strategy<Value = KeepOp> {
    prop_oneof![
        5 => (0u64..48, prop::collection::vec((any::<u8>(), any::<u64>(), any::<bool>()), 1..6), any::<bool>())
            .prop_map(|(key, kinds, reuse)| KeepOp::Store { key, kinds, reuse }),
        5 => (0u64..52, any::<bool>()).prop_map(|(k, pool)| KeepOp::Keep(k, pool)),
        1 => (0u64..52).prop_map(KeepOp::DropCached),
        1 => (0u64..52).prop_map(KeepOp::Invalidate),
        1 => (1usize..40).prop_map(KeepOp::Writeback),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Kept entries, reused or not, never give back anything but the bytes
    /// last stored or kept; the shrinker may free a kept entry, never
    /// another.
    #[test]
    fn kept_entries_load_as_the_bytes_last_stored(ops in prop::collection::vec(keep_op(), 1..120), writeback: bool, limit_pages in 8usize..64) {
        let t = Tier::new(TierConfig { exclusive_loads: false, ..cfg(limit_pages * PAGE_SIZE, writeback) }).unwrap();
        // key -> (bytes, kept)
        let mut model: HashMap<u64, (Vec<u8>, bool)> = HashMap::new();
        for op in ops {
            match op {
                KeepOp::Store { key, kinds, reuse } => {
                    let pages: Vec<Vec<u8>> = kinds
                        .iter()
                        .enumerate()
                        .map(|(i, &(k, s, same))| match model.get(&(key + i as u64)) {
                            Some((p, _)) if same => p.clone(),
                            _ => page(k, s),
                        })
                        .collect();
                    let folio = pages.concat();
                    let r = if reuse { t.store_reusing(key, &folio) } else { t.store(key, &folio) };
                    match r.unwrap() {
                        StoreOutcome::Stored { .. } => {
                            for (i, p) in pages.into_iter().enumerate() {
                                model.insert(key + i as u64, (p, false));
                            }
                        }
                        StoreOutcome::Rejected(_) => {
                            for i in 0..pages.len() as u64 {
                                model.remove(&(key + i));
                                prop_assert!(t.lookup(key + i).is_none());
                            }
                        }
                    }
                }
                KeepOp::Keep(key, keep_pool) => match model.get(&key).cloned() {
                    Some((p, false)) => {
                        prop_assert!(load(&t, key).as_ref() == Some(&p), "key {}", key);
                        if t.retain_clean(key, &p, keep_pool) {
                            model.insert(key, (p, true));
                        } else {
                            model.remove(&key);
                        }
                    }
                    Some((_, true)) => {}
                    None => prop_assert!(load(&t, key).is_none(), "key {}", key),
                },
                KeepOp::DropCached(key) => {
                    let dropped = t.drop_cached(key);
                    if dropped {
                        prop_assert!(model.get(&key).is_some_and(|(_, kept)| *kept));
                    }
                    if model.get(&key).is_some_and(|(_, kept)| *kept) {
                        model.remove(&key);
                    }
                }
                KeepOp::Invalidate(key) => {
                    let had = t.invalidate(key);
                    if let Some((_, kept)) = model.remove(&key) {
                        prop_assert!(had || kept, "key {}", key);
                    }
                }
                KeepOp::Writeback(n) => { t.writeback(n); }
            }
            // Kept entries the shrinker freed leave the model.
            model.retain(|&k, (_, kept)| !*kept || t.lookup(k).is_some());
            for (&k, _) in model.iter().filter(|(_, (_, kept))| !*kept) {
                prop_assert!(t.lookup(k).is_some(), "key {} lost", k);
            }
            // The pool's entries by age: those in the pool, not kept.
            let in_pool = model.iter().filter(|&(&k, &(_, kept))| !kept && matches!(t.lookup(k), Some(Stored::Pool { .. }))).count();
            prop_assert_eq!(t.aged_entries(), in_pool as i64);
        }
        for (k, (want, _)) in model {
            prop_assert!(load(&t, k).as_ref() == Some(&want), "key {}", k);
            t.invalidate(k);
        }
        let s = t.stats();
        prop_assert_eq!((s.stored_pages, s.swap_pages, s.cached_pages, s.pool_total_size), (0, 0, 0, 0), "{:?}", s);
        prop_assert_eq!(s.decompress_fail, 0);
        prop_assert_eq!(t.aged_entries(), 0);
    }
}

/// Past half of the swap file's size, a loaded page gives up its slot
/// rather than keep it (the kernel's `vm_swap_full()`).
#[test]
fn a_half_full_swap_file_keeps_no_entries() {
    let swap = zmem_swapfile::SwapFileConfig { max_bytes: 64 * PAGE_SIZE as u64, ..Default::default() };
    let t = Tier::new(TierConfig { exclusive_loads: false, swap: Some(swap), ..cfg(64 << 20, true) }).unwrap();
    // Random pages: one per slot, so that 40 pages take 40 of 64 slots.
    for k in 0..40u64 {
        t.store(k, &random_page(k)).unwrap();
    }
    assert_eq!(t.writeback(40), 40);
    assert!(t.swap_file().unwrap().half_full(), "{:?}", t.stats());
    let p = load(&t, 3).unwrap();
    assert!(!t.retain_clean(3, &p, true));
    assert!(t.lookup(3).is_none());
    // Below half, it is kept.
    for k in 4..30u64 {
        t.invalidate(k);
    }
    assert!(!t.swap_file().unwrap().half_full());
    let p = load(&t, 35).unwrap();
    assert!(t.retain_clean(35, &p, true));
    assert!(matches!(t.lookup(35), Some(Stored::Swap { .. })));
}

/// With room in the pool, a page loaded from the swap file gives up its
/// slot: kept, it would go back to the slot unchanged at its next eviction
/// and come from the disk again at its next load. A pool entry is kept
/// either way, and a full pool keeps written-back entries as before.
#[test]
fn a_written_back_entry_is_kept_only_where_the_pool_has_no_room() {
    let t = Tier::new(TierConfig { exclusive_loads: false, ..cfg(64 << 20, true) }).unwrap();
    for k in 0..8u64 {
        t.store(k, corpus().page(k as usize)).unwrap();
    }
    assert_eq!(t.writeback(4), 4);
    assert!(t.pool_has_room(), "{:?}", t.stats());
    let swapped: Vec<u64> = (0..8).filter(|&k| matches!(t.lookup(k), Some(Stored::Swap { .. }))).collect();
    assert_eq!(swapped.len(), 4, "{:?}", t.stats());
    let pooled: Vec<u64> = (0..8).filter(|k| !swapped.contains(k)).collect();
    // The pool has room: the slot goes, the pool entry stays.
    let (s, p) = (swapped[0], pooled[0]);
    assert!(!t.retain_clean_unless(s, &load(&t, s).unwrap(), true, true));
    assert!(t.lookup(s).is_none());
    assert!(t.retain_clean_unless(p, &load(&t, p).unwrap(), true, true));
    assert!(matches!(t.lookup(p), Some(Stored::Pool { .. })));
    // No room: the written-back entry stays as the page's clean copy.
    let s = swapped[1];
    assert!(t.retain_clean_unless(s, &load(&t, s).unwrap(), true, false));
    assert!(matches!(t.lookup(s), Some(Stored::Swap { .. })));
    assert_eq!(t.stats().cached_pages, 2);
    // A pool past its accept threshold has no room.
    t.set_max_pool_bytes(PAGE_SIZE);
    assert!(t.pool_total_size() >= PAGE_SIZE, "{:?}", t.stats());
    assert!(!t.pool_has_room(), "{:?}", t.stats());
}

/// A pool over its limit frees its kept pool entries to make room, never
/// the kept entries in the swap file, which take none: those stay, and the
/// unchanged pages go back into them without compressing.
#[test]
fn a_pool_over_its_limit_frees_kept_pool_entries_not_the_swap_files() {
    let t = Tier::new(TierConfig { exclusive_loads: false, ..cfg(64 << 20, true) }).unwrap();
    let n = 16u64;
    for k in 0..n {
        t.store(k, corpus().page(k as usize)).unwrap();
    }
    assert_eq!(t.writeback(8), 8);
    let pages: Vec<Vec<u8>> = (0..n).map(|k| load(&t, k).unwrap()).collect();
    for (k, p) in pages.iter().enumerate() {
        assert!(t.retain_clean_unless(k as u64, p, true, false), "key {k}");
    }
    let swapped: Vec<u64> = (0..n).filter(|&k| matches!(t.lookup(k), Some(Stored::Swap { .. }))).collect();
    assert_eq!((swapped.len(), t.stats().cached_pages), (8, n), "{:?}", t.stats());
    t.set_max_pool_bytes(PAGE_SIZE);
    t.shrink_to_limit();
    let s = t.stats();
    assert_eq!(s.cached_dropped, n - 8, "the kept pool entries went: {s:?}");
    assert!(swapped.iter().all(|&k| matches!(t.lookup(k), Some(Stored::Swap { .. }))), "{s:?}");
    let out = s.zswpout;
    for &k in &swapped {
        t.store_reusing(k, &pages[k as usize]).unwrap();
    }
    let s = t.stats();
    assert_eq!((s.cached_reused, s.zswpout - out), (8, 0), "{s:?}");
    for &k in &swapped {
        assert!(load(&t, k).unwrap() == pages[k as usize], "key {k}");
    }
}

/// A forked child takes its parent's pages by export and import: every
/// kind (same-filled, compressed, raw, written back, stored by an older
/// compressor) comes back bit for bit from the importing tier, objects of
/// the current compressor are copied as they are, and the exporting tier
/// keeps its entries.
#[test]
fn exported_pages_import_into_another_tier_bit_for_bit() {
    let from = Tier::new(cfg(64 << 20, true)).unwrap();
    let n = 96u64;
    let want: Vec<Vec<u8>> = (0..n).map(|k| page(k as u8, k)).collect();
    for k in 0..n / 2 {
        from.store(k, &want[k as usize]).unwrap();
    }
    // The first half goes to the swap file; the rest is stored by zstd.
    assert!(from.writeback(n as usize) > 0);
    from.set_compressor("zstd:3".parse().unwrap()).unwrap();
    for k in n / 2..n {
        from.store(k, &want[k as usize]).unwrap();
    }
    assert!(from.export(n + 7).unwrap().is_none(), "no entry, nothing to export");
    // In one call, written-back objects read together: the same as one by one.
    let keys: Vec<u64> = (0..n).chain([n + 7]).collect();
    let many = from.export_many(&keys);
    for (&k, e) in keys.iter().zip(&many) {
        assert_eq!(e.as_ref().unwrap(), &from.export(k).unwrap(), "key {k}");
    }
    let to = Tier::new(cfg(64 << 20, false)).unwrap();
    to.set_compressor(from.compressor().parse().unwrap()).unwrap();
    let (mut copied, mut raw) = (0, 0);
    for k in 0..n {
        let e = from.export(k).unwrap().expect("every key has an entry");
        if let zmem_tier::Exported::Object(b) = &e {
            if b.len() < PAGE_SIZE {
                copied += 1;
            } else {
                raw += 1;
            }
        }
        to.import(1000 + k, &e).unwrap();
    }
    assert!(copied > 0 && raw > 0, "copied {copied}, raw {raw}");
    for k in 0..n {
        assert!(load(&to, 1000 + k).unwrap() == want[k as usize], "page {k}");
        assert!(load(&from, k).unwrap() == want[k as usize], "the exporter's page {k}");
    }
    assert_eq!(to.stats().stored_pages, 0, "{:?}", to.stats());
    let bad = zmem_tier::Exported::Object(vec![0; PAGE_SIZE + 1]);
    assert!(matches!(to.import(5, &bad), Err(TierError::BadFolio { .. })));
    assert!(to.lookup(5).is_none());
}

/// A sample of the pool under another codec: it takes compressed entries
/// of the current pool only (raw pages and an old pool's entries are not
/// what the current codec made), sizes them as stored, goes round the
/// shards from where it stopped, and changes nothing.
#[test]
fn a_codec_sample_sizes_the_current_pools_entries_under_another_codec() {
    let t = Tier::new(TierConfig { compressor: "lz4".parse().unwrap(), ..cfg(64 << 20, true) }).unwrap();
    assert_eq!(t.sample_codec("zstd:1".parse().unwrap(), 64).unwrap().pages, 0, "an empty pool");
    let n = corpus().len().min(1024) as u64;
    let mut lens = 0;
    for k in 0..n {
        let p = if k % 10 == 0 { random_page(k) } else { corpus().page(k as usize).to_vec() };
        assert!(matches!(t.store(k, &p).unwrap(), StoreOutcome::Stored { .. }));
        if let Some(Stored::Pool { len, .. }) = t.lookup(k) {
            if (len as usize) < PAGE_SIZE {
                lens += len as usize;
            }
        }
    }
    let before = t.stats();
    let all = t.sample_codec("zstd:1".parse().unwrap(), usize::MAX).unwrap();
    assert!(all.pages > n as usize / 2 && all.pages < n as usize, "{all:?}");
    assert_eq!(all.bytes_now, lens, "the objects as stored");
    assert!(all.bytes_other < all.bytes_now, "zstd:1 packs real pages tighter than lz4: {all:?}");
    let some = t.sample_codec("zstd:1".parse().unwrap(), 16).unwrap();
    assert_eq!(some.pages, 16);
    // Entries of a pool before a switch are not sampled.
    t.set_compressor("zstd:1".parse().unwrap()).unwrap();
    assert_eq!(t.sample_codec("lz4".parse().unwrap(), 64).unwrap().pages, 0);
    let after = t.stats();
    assert_eq!((before.stored_pages, before.pool_total_size), (after.stored_pages, after.pool_total_size));
    for k in 0..n {
        assert!(load(&t, k).is_some(), "key {k}");
    }
}

/// A pool under its limit runs no writeback, which is what used to drop the
/// LRU's stale items: each store pushed one and each load left its own, so
/// a program paging the same pages in and out grew the list without bound
/// (redis under 64M: 6.6 MB of items for ~4,500 blocks, charged to the
/// limit). Stores now rebuild it once it doubles.
#[test]
fn stores_and_loads_that_never_fill_the_pool_keep_the_lru_small() {
    let t = Tier::new(cfg(64 << 20, true)).unwrap();
    let data = corpus().page(3).to_vec();
    let mut most = 0;
    for round in 0..20_000u64 {
        // Eight pages, each in a block of its own, stored and loaded back.
        let key = (round % 8) * 16;
        t.store(key, &data).unwrap();
        assert_eq!(load(&t, key).as_deref(), Some(&data[..]), "round {round}");
        most = most.max(t.entry_metadata_parts().1);
    }
    assert_eq!(t.stats().written_back_pages, 0, "the pool never filled");
    // The list is rebuilt past 4,096 items (8 bytes each) once it has
    // doubled; without that, 20,000 pushes hold 160 KB of items (256 KiB
    // of capacity).
    assert!(most <= 64 << 10, "the LRU held up to {most} bytes of items for 8 blocks");
}

/// `store_many` through the engines (each reclaim pass's pages submitted at
/// once) stores every folio as `store` does folio by folio: the same
/// outcomes, the same counters, every page loads bit for bit, and a bad
/// folio among them is an error of its own.
#[test]
fn store_many_through_engines_stores_each_folio_as_store_does() {
    use zmem_compress::EnginesConfig;
    use zmem_tier::StoreRequest;
    let engines = EnginesConfig {
        engines: 2,
        sync_on_caller: true,
        completion_timeout: std::time::Duration::from_micros(200),
        ..EnginesConfig::default()
    };
    let batched = Tier::new(TierConfig { engines: Some(engines), ..cfg(64 << 20, true) }).unwrap();
    let single = Tier::new(cfg(64 << 20, true)).unwrap();
    // 24 folios of 1 to 16 pages of every kind, one of them not whole pages.
    let folios: Vec<(u64, Vec<u8>)> = (0..24u64)
        .map(|f| {
            let n = 1 + (f * 7 % 16);
            let mut data: Vec<u8> = (0..n).flat_map(|p| page((f + p) as u8, f * 100 + p)).collect();
            if f == 9 {
                data.truncate(data.len() - 1);
            }
            (f << 8, data)
        })
        .collect();
    let reqs: Vec<StoreRequest<'_>> =
        folios.iter().map(|(key, data)| StoreRequest { key: *key, folio: data, reuse: false }).collect();
    let got = batched.store_many(&reqs);
    for ((key, data), got) in folios.iter().zip(&got) {
        let want = single.store(*key, data);
        match (got, want) {
            (Ok(g), Ok(w)) => assert_eq!(*g, w, "folio at {key}"),
            (Err(TierError::BadFolio { len: g }), Err(TierError::BadFolio { len: w })) => assert_eq!(*g, w),
            (g, w) => panic!("folio at {key}: {g:?} against {w:?}"),
        }
    }
    let (b, s) = (batched.stats(), single.stats());
    assert_eq!(
        (b.stored_pages, b.zswpout, b.same_filled_pages, b.stored_incompressible_pages),
        (s.stored_pages, s.zswpout, s.same_filled_pages, s.stored_incompressible_pages)
    );
    assert_eq!(b.pool_total_size, s.pool_total_size, "the same objects, byte for byte");
    for (key, data) in folios.iter().filter(|(_, d)| d.len() % PAGE_SIZE == 0) {
        for (p, want) in data.chunks_exact(PAGE_SIZE).enumerate() {
            assert!(load(&batched, key + p as u64).unwrap() == want, "page {p} of the folio at {key}");
        }
    }
}
