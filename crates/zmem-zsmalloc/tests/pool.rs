//! ZsPool against a HashMap model, bad handles, exhaustion, and a
//! multi-threaded stress with a concurrent compactor. Every byte is checked.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use zmem_common::PAGE_SIZE;
use zmem_zsmalloc::{Handle, Mempool, MempoolConfig, ZsError, ZsPool, ZsPoolConfig};

fn pool_with(cfg: ZsPoolConfig, max_pages: Option<usize>) -> ZsPool {
    let mp = Mempool::new(MempoolConfig { max_pages, wait_timeout: Duration::from_millis(1), ..Default::default() })
        .unwrap();
    ZsPool::new(cfg, Arc::new(mp)).unwrap()
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn read(pool: &ZsPool, h: Handle) -> Vec<u8> {
    pool.map(h, <[u8]>::to_vec).unwrap()
}

fn check_all(pool: &ZsPool, model: &HashMap<Handle, Vec<u8>>) {
    for (h, want) in model {
        assert!(read(pool, *h) == *want, "object {h:?} differs");
    }
    let (n, bytes) = pool.objects();
    assert_eq!(n, model.len());
    assert_eq!(bytes, model.values().map(Vec::len).sum::<usize>());
}

#[derive(Debug, Clone)]
enum Op {
    Malloc(usize),
    Free(prop::sample::Index),
    Rewrite(prop::sample::Index),
    Compact,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop_oneof![1usize..64, 64usize..2048, 2048usize..=PAGE_SIZE].prop_map(Op::Malloc),
        4 => any::<prop::sample::Index>().prop_map(Op::Free),
        1 => any::<prop::sample::Index>().prop_map(Op::Rewrite),
        1 => Just(Op::Compact),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_sequences_match_a_hashmap(ops in prop::collection::vec(op(), 1..400), chain in 1usize..=16, merge: bool) {
        let pool = pool_with(ZsPoolConfig { chain_size: chain, merge_classes: merge }, None);
        let mut model: HashMap<Handle, Vec<u8>> = HashMap::new();
        let mut order: Vec<Handle> = Vec::new();
        for (k, op) in ops.into_iter().enumerate() {
            match op {
                Op::Malloc(size) => {
                    let data = pattern(k as u64, size);
                    let h = pool.malloc_copy(&data).unwrap();
                    prop_assert!(model.insert(h, data).is_none(), "handle reused while live");
                    order.push(h);
                }
                Op::Free(i) if !order.is_empty() => {
                    let h = order.swap_remove(i.index(order.len()));
                    prop_assert!(read(&pool, h) == model.remove(&h).unwrap());
                    pool.free(h).unwrap();
                }
                Op::Rewrite(i) if !order.is_empty() => {
                    let h = order[i.index(order.len())];
                    let data = pattern(k as u64 ^ 0xabc, model[&h].len());
                    pool.map_mut(h, |o| o.copy_from_slice(&data)).unwrap();
                    model.insert(h, data);
                }
                Op::Compact => {
                    pool.compact();
                    check_all(&pool, &model);
                }
                _ => {}
            }
        }
        check_all(&pool, &model);
        for h in order {
            pool.free(h).unwrap();
        }
        prop_assert_eq!(pool.pool_total_size(), 0);
        prop_assert_eq!(pool.mempool().stats().pages_in_use, 0);
    }
}

/// Whether strict_assert! panics in this build (debug, or the strict feature).
const STRICT: bool = cfg!(any(debug_assertions, feature = "strict"));

/// Runs `f`, expecting the bad-handle error in release builds and a
/// strict_assert! panic in debug (or strict) builds.
fn expect_bad<T: std::fmt::Debug>(
    f: impl FnOnce() -> Result<T, ZsError> + std::panic::UnwindSafe,
    want: fn(&ZsError) -> bool,
) {
    match std::panic::catch_unwind(f) {
        Ok(r) => {
            if STRICT {
                panic!("strict builds must panic, got {r:?}");
            }
            let e = r.unwrap_err();
            assert!(want(&e), "{e}");
        }
        Err(_) => {
            if !STRICT {
                panic!("release builds must return an error, not panic");
            }
        }
    }
}

#[test]
fn bad_sizes_stale_handles_and_double_frees_are_caught() {
    let pool = Arc::new(pool_with(ZsPoolConfig::default(), None));
    let p = Arc::clone(&pool);
    expect_bad(move || p.malloc(0), |e| matches!(e, ZsError::InvalidSize { size: 0 }));
    let p = Arc::clone(&pool);
    expect_bad(move || p.malloc(PAGE_SIZE + 1), |e| matches!(e, ZsError::InvalidSize { .. }));

    let a = pool.malloc_copy(&[1u8; 100]).unwrap();
    let b = pool.malloc_copy(&[2u8; 100]).unwrap();
    pool.free(a).unwrap();
    let p = Arc::clone(&pool);
    expect_bad(move || p.free(a), |e| matches!(e, ZsError::DoubleFree { .. }));
    // The slot is reused by the next malloc of this class: the old handle is
    // now stale and must not reach the new object.
    let c = pool.malloc_copy(&[3u8; 100]).unwrap();
    let p = Arc::clone(&pool);
    expect_bad(move || p.map(a, <[u8]>::to_vec), |e| matches!(e, ZsError::StaleHandle { .. }));
    let p = Arc::clone(&pool);
    expect_bad(move || p.free(Handle::from_raw(0xdead_beef_0000_1234)), |e| matches!(e, ZsError::StaleHandle { .. }));
    assert_eq!(read(&pool, b), vec![2u8; 100]);
    assert_eq!(read(&pool, c), vec![3u8; 100]);
    assert_eq!(pool.write(c, &[0u8; 99]), Err(ZsError::SizeMismatch { size: 100, len: 99 }));
}

#[test]
fn exhausted_mempool_is_alloc_failed_and_corrupts_nothing() {
    // 16 normal pages plus the reserve of 64.
    let pool = pool_with(ZsPoolConfig::default(), Some(16));
    let mut live = Vec::new();
    let err = loop {
        let data = pattern(live.len() as u64, 3000);
        match pool.malloc_copy(&data) {
            Ok(h) => live.push((h, data)),
            Err(e) => break e,
        }
    };
    assert!(matches!(err, ZsError::AllocFailed { .. }), "{err}");
    assert!(pool.mempool().stats().partial_allocs > 0);
    for (h, d) in &live {
        assert!(read(&pool, *h) == *d);
    }
    // Freeing makes room again.
    let (h, _) = live.pop().unwrap();
    pool.free(h).unwrap();
    assert!(pool.malloc(3000).is_ok());
}

#[test]
fn compaction_frees_pages_and_keeps_handles() {
    let pool = pool_with(ZsPoolConfig::default(), None);
    let mut live: Vec<(Handle, Vec<u8>)> = (0..4000)
        .map(|i| {
            let d = pattern(i, 200 + (i as usize * 37) % 1500);
            (pool.malloc_copy(&d).unwrap(), d)
        })
        .collect();
    let full = pool.pool_total_size();
    // Free every other object: zspages are left half-empty.
    let mut keep = Vec::new();
    for (i, x) in live.drain(..).enumerate() {
        if i % 2 == 0 {
            pool.free(x.0).unwrap()
        } else {
            keep.push(x)
        }
    }
    let before = pool.pool_total_size();
    let freed = pool.compact();
    assert!(freed > 0);
    assert_eq!(pool.pool_total_size(), before - freed * PAGE_SIZE);
    assert!(pool.pool_total_size() < full * 6 / 10, "{} of {full}", pool.pool_total_size());
    for (h, d) in &keep {
        assert!(read(&pool, *h) == *d);
    }
}

#[test]
fn threads_and_a_compactor_never_see_a_wrong_byte() {
    let pool = Arc::new(pool_with(ZsPoolConfig::default(), None));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let compactor = {
        let (pool, stop) = (Arc::clone(&pool), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n += pool.compact();
                std::thread::yield_now();
            }
            n
        })
    };
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let pool = Arc::clone(&pool);
            s.spawn(move || {
                let mut live: Vec<(Handle, Vec<u8>)> = Vec::new();
                for i in 0..20_000u64 {
                    let r = pattern(t * 1_000_003 + i, 8);
                    if live.len() < 300 || r[0] < 110 {
                        let d = pattern(t << 32 | i, 1 + (r[1] as usize * 16 + r[2] as usize) % PAGE_SIZE);
                        live.push((pool.malloc_copy(&d).unwrap(), d));
                    } else {
                        let (h, d) = live.swap_remove(r[3] as usize % live.len());
                        assert!(pool.map(h, |o| o == &d[..]).unwrap(), "thread {t} op {i}: wrong bytes");
                        pool.free(h).unwrap();
                    }
                }
                for (h, d) in live {
                    assert!(pool.map(h, |o| o == &d[..]).unwrap());
                    pool.free(h).unwrap();
                }
            });
        }
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    compactor.join().unwrap();
    assert_eq!(pool.pool_total_size(), 0);
    assert_eq!(pool.objects(), (0, 0));
}
