//! The swap file on real files: round-trips, encryption on disk, corruption,
//! a full file, and ENOSPC from a small tmpfs.

#[path = "common/small_fs.rs"]
mod small_fs;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use proptest::prelude::*;
use small_fs::SmallFs;
use zmem_common::PAGE_SIZE;
use zmem_swapfile::{SwapError, SwapFile, SwapFileConfig};
use zmem_zsmalloc::{Mempool, MempoolConfig};

fn mempool() -> Arc<Mempool> {
    Arc::new(Mempool::new(MempoolConfig { min_nr: 8, ..Default::default() }).unwrap())
}

fn page(seed: u64) -> Vec<u8> {
    zmem_compress::corpus::half_compressible_page(seed)
}

/// Flips the bits `mask` of byte `at` of slot `slot` on disk.
fn flip(sf: &SwapFile, slot: u32, at: u64, mask: u8) {
    let off = u64::from(slot) * PAGE_SIZE as u64 + at;
    let mut b = [0u8];
    sf.file().read_exact_at(&mut b, off).unwrap();
    sf.file().write_all_at(&[b[0] ^ mask], off).unwrap();
}

fn swap(encrypt: bool, max_bytes: u64) -> SwapFile {
    SwapFile::create(&SwapFileConfig { dir: std::env::temp_dir(), encrypt, max_bytes }, mempool()).unwrap()
}

#[test]
fn pages_roundtrip_and_are_encrypted_on_disk() {
    for encrypt in [false, true] {
        let sf = swap(encrypt, 1 << 30);
        let pages: Vec<Vec<u8>> = (0..100).map(page).collect();
        let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        let slots = sf.write_batch(&refs).unwrap();
        assert!(slots.windows(2).all(|w| w[1] == w[0] + 1), "a batch gets neighbouring slots");
        assert!(sf.stats().write_calls <= 2, "{:?}", sf.stats());
        let mut buf = vec![0u8; PAGE_SIZE];
        for (p, &s) in pages.iter().zip(&slots) {
            sf.read(s, &mut buf).unwrap();
            assert!(buf == *p);
            let mut raw = vec![0u8; PAGE_SIZE];
            sf.file().read_exact_at(&mut raw, u64::from(s) * PAGE_SIZE as u64).unwrap();
            assert_eq!(raw == *p, !encrypt, "on disk, encrypt={encrypt}");
        }
        // The same page in two slots encrypts differently (tweak = slot).
        let twice = sf.write_batch(&[&pages[0], &pages[0]]).unwrap();
        let mut a = vec![0u8; PAGE_SIZE];
        let mut b = vec![0u8; PAGE_SIZE];
        sf.file().read_exact_at(&mut a, u64::from(twice[0]) * PAGE_SIZE as u64).unwrap();
        sf.file().read_exact_at(&mut b, u64::from(twice[1]) * PAGE_SIZE as u64).unwrap();
        assert_eq!(a == b, !encrypt);
    }
}

#[test]
fn a_flipped_byte_is_corrupt_never_wrong_bytes() {
    for encrypt in [false, true] {
        let sf = swap(encrypt, 1 << 30);
        let p = page(7);
        let s = sf.write_batch(&[&p]).unwrap()[0];
        flip(&sf, s, 1234, 0x01);
        let mut buf = vec![0u8; PAGE_SIZE];
        assert!(matches!(sf.read(s, &mut buf), Err(SwapError::Corrupt { .. })));
        assert_eq!(sf.stats().checksum_failures, 1);
    }
}

#[test]
fn a_full_file_is_no_space_and_frees_its_slots() {
    let sf = swap(true, 16 * PAGE_SIZE as u64);
    let pages: Vec<Vec<u8>> = (0..20).map(page).collect();
    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
    assert!(matches!(sf.write_batch(&refs), Err(SwapError::NoSpace { .. })));
    assert_eq!(sf.stats().slots_in_use, 0);
    assert_eq!(sf.write_batch(&refs[..16]).unwrap().len(), 16);
    let mut buf = vec![0u8; PAGE_SIZE];
    assert!(matches!(sf.read(9999, &mut buf), Err(SwapError::NotInUse { slot: 9999 })));
    assert!(matches!(sf.free(9999), Err(SwapError::NotInUse { .. })));
}

#[test]
fn enospc_from_the_filesystem_loses_nothing() {
    let Some(fs) = SmallFs::mount(64, "enospc_from_the_filesystem_loses_nothing") else { return };
    let sf =
        SwapFile::create(&SwapFileConfig { dir: fs.0.clone(), encrypt: true, max_bytes: 1 << 30 }, mempool()).unwrap();
    let pages: Vec<Vec<u8>> = (0..64).map(page).collect();
    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
    let mut written = Vec::new();
    let err = loop {
        match sf.write_batch(&refs[..4]) {
            Ok(s) => written.extend(s),
            Err(e) => break e,
        }
        assert!(written.len() < 1000, "a 64 KiB tmpfs never filled");
    };
    let SwapError::Io { source, .. } = &err else { panic!("expected an I/O error, got {err}") };
    assert_eq!(source.raw_os_error(), Some(28), "ENOSPC: {err}");
    assert_eq!(sf.stats().slots_in_use as usize, written.len(), "the failed batch freed its slots");
    let mut buf = vec![0u8; PAGE_SIZE];
    for (k, &s) in written.iter().enumerate() {
        sf.read(s, &mut buf).unwrap();
        assert!(buf == pages[k % 4], "earlier pages survive the failed write");
    }
    drop(sf);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_writes_frees_and_reads_match_a_model(ops in prop::collection::vec((0u8..5, 1usize..20, any::<u64>()), 1..60)) {
        // A small file, so that freed slots are soon written again.
        const SLOTS: usize = 48;
        let sf = swap(true, (SLOTS * PAGE_SIZE) as u64);
        let mut model: HashMap<u32, u64> = HashMap::new();
        let mut buf = vec![0u8; PAGE_SIZE];
        for (op, n, seed) in ops {
            match op {
                0 => {
                    let pages: Vec<Vec<u8>> = (0..n as u64).map(|i| page(seed ^ i)).collect();
                    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
                    match sf.write_batch(&refs) {
                        Ok(slots) => for (i, s) in slots.into_iter().enumerate() {
                            prop_assert!(model.insert(s, seed ^ i as u64).is_none(), "slot handed out twice");
                        },
                        Err(SwapError::NoSpace { .. }) => prop_assert!(model.len() + n > SLOTS),
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                }
                1 => {
                    let victims: Vec<u32> = model.keys().copied().take(n).collect();
                    for s in victims {
                        sf.free(s).unwrap();
                        model.remove(&s);
                    }
                }
                2 => {
                    for (&s, &seed) in model.iter().take(n) {
                        sf.read(s, &mut buf).unwrap();
                        prop_assert!(buf == page(seed));
                    }
                }
                // Read-ahead of slots in use and of freed ones, in flight
                // or done by the time their slots are freed, written again
                // or read: never a stale block.
                3 => {
                    let mut slots: Vec<u32> = model.keys().copied().take(n).collect();
                    slots.extend((0..n as u32).map(|i| (seed as u32).wrapping_add(i) % SLOTS as u32));
                    sf.prefetch(&slots);
                }
                _ => {
                    let want: Vec<(u32, u64)> = model.iter().take(n).map(|(&s, &v)| (s, v)).collect();
                    let mut bufs = vec![vec![0u8; PAGE_SIZE]; want.len()];
                    let results = {
                        let mut reqs: Vec<(u32, &mut [u8])> =
                            want.iter().zip(bufs.iter_mut()).map(|(w, b)| (w.0, &mut b[..])).collect();
                        sf.read_batch(&mut reqs)
                    };
                    for ((r, b), &(s, v)) in results.iter().zip(&bufs).zip(&want) {
                        prop_assert!(r.is_ok(), "slot {}: {:?}", s, r);
                        prop_assert!(*b == page(v), "slot {} read back wrong", s);
                    }
                }
            }
        }
        prop_assert_eq!(sf.stats().slots_in_use as usize, model.len());
    }

    /// Packed objects of any size: each reads back as written, a slot lives
    /// exactly as long as one of its objects, and the slots in use are the
    /// distinct slots of the live objects.
    #[test]
    fn packed_objects_read_back_and_slots_live_while_an_object_does(
        ops in prop::collection::vec((0u8..3, prop::collection::vec(1usize..=PAGE_SIZE, 1..24), any::<u64>()), 1..40)
    ) {
        let sf = swap(true, 64 * PAGE_SIZE as u64);
        // object id -> (slot, offset, bytes)
        let mut model: HashMap<u64, (u32, u16, Vec<u8>)> = HashMap::new();
        let mut next = 0u64;
        for (op, lens, seed) in ops {
            match op {
                0 => {
                    let objs: Vec<Vec<u8>> =
                        lens.iter().enumerate().map(|(i, &l)| page(seed ^ i as u64)[..l].to_vec()).collect();
                    let refs: Vec<&[u8]> = objs.iter().map(Vec::as_slice).collect();
                    match sf.write_packed(&refs) {
                        Ok(at) => {
                            prop_assert_eq!(at.len(), objs.len());
                            for ((s, off), o) in at.into_iter().zip(objs) {
                                prop_assert!(usize::from(off) + o.len() <= PAGE_SIZE);
                                for (ms, moff, mo) in model.values() {
                                    let overlap = *ms == s && usize::from(off) < usize::from(*moff) + mo.len()
                                        && usize::from(*moff) < usize::from(off) + o.len();
                                    prop_assert!(!overlap, "objects overlap in slot {}", s);
                                }
                                model.insert(next, (s, off, o));
                                next += 1;
                            }
                        }
                        Err(SwapError::NoSpace { .. }) => {}
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                }
                1 => {
                    let victims: Vec<u64> = model.keys().copied().take(lens.len()).collect();
                    for id in victims {
                        let (s, _, _) = model.remove(&id).unwrap();
                        sf.free(s).unwrap();
                    }
                }
                _ => {
                    let ids: Vec<u64> = model.keys().copied().take(lens.len()).collect();
                    let mut bufs: Vec<Vec<u8>> = ids.iter().map(|id| vec![0u8; model[id].2.len()]).collect();
                    let mut reqs: Vec<(u32, u16, &mut [u8])> =
                        ids.iter().zip(bufs.iter_mut()).map(|(id, b)| (model[id].0, model[id].1, b.as_mut_slice())).collect();
                    for r in sf.read_objs(&mut reqs) {
                        prop_assert!(r.is_ok(), "{:?}", r);
                    }
                    for (id, b) in ids.iter().zip(&bufs) {
                        prop_assert!(*b == model[id].2);
                    }
                }
            }
            let mut live: Vec<u32> = model.values().map(|v| v.0).collect();
            live.sort_unstable();
            live.dedup();
            prop_assert_eq!(sf.stats().slots_in_use as usize, live.len());
        }
    }
}

/// Compressed writeback's packing: 3 objects of 1300 bytes share a slot,
/// and a flipped byte in it fails every object of that slot, never hands
/// out wrong bytes, and leaves the other slots readable.
#[test]
fn a_corrupt_packed_slot_fails_each_of_its_objects() {
    let sf = swap(true, 1 << 20);
    let objs: Vec<Vec<u8>> = (0..6).map(|i| page(i)[..1300].to_vec()).collect();
    let refs: Vec<&[u8]> = objs.iter().map(Vec::as_slice).collect();
    let at = sf.write_packed(&refs).unwrap();
    assert_eq!(at.iter().map(|a| a.0).collect::<Vec<_>>(), [at[0].0, at[0].0, at[0].0, at[3].0, at[3].0, at[3].0]);
    assert_ne!(at[0].0, at[3].0);
    let s = sf.stats();
    assert_eq!((s.pages_written, s.objects_written, s.slots_in_use), (2, 6, 2));
    flip(&sf, at[0].0, 2000, 1);
    let mut bufs = vec![vec![0u8; 1300]; 6];
    let mut reqs: Vec<(u32, u16, &mut [u8])> =
        at.iter().zip(bufs.iter_mut()).map(|(&(s, o), b)| (s, o, b.as_mut_slice())).collect();
    let r = sf.read_objs(&mut reqs);
    for (i, r) in r.iter().enumerate() {
        assert_eq!(matches!(r, Err(SwapError::Corrupt { .. })), i < 3, "object {i}: {r:?}");
    }
    for i in 3..6 {
        assert!(bufs[i] == objs[i]);
    }
    // The first slot goes once its three objects are dropped.
    for _ in 0..3 {
        assert_eq!(sf.stats().slots_in_use, 2);
        sf.free(at[0].0).unwrap();
    }
    assert_eq!(sf.stats().slots_in_use, 1);
    assert!(matches!(sf.free(at[0].0), Err(SwapError::NotInUse { .. })));
}

/// Issue 11, finding 5: written-back pages stayed in RAM as page cache.
/// On a disk filesystem the file is O_DIRECT and holds (almost) nothing in
/// the page cache after 8 MiB of writeback; every page still reads back.
#[test]
fn written_back_pages_leave_ram_with_o_direct() {
    let dir = std::path::Path::new("/var/tmp");
    let fs = rustix::fs::statfs(dir).unwrap().f_type as u64;
    // ext4, xfs, btrfs: the filesystems that take O_DIRECT.
    assert!([0xEF53, 0x5846_5342, 0x9123_683E].contains(&fs), "/var/tmp is not on a disk filesystem ({fs:#x})");
    let sf =
        SwapFile::create(&SwapFileConfig { dir: dir.into(), encrypt: true, max_bytes: 1 << 30 }, mempool()).unwrap();
    assert!(sf.stats().direct_io, "{:?}", sf.stats());
    let pages: Vec<Vec<u8>> = (0..2048).map(page).collect();
    let mut slots = Vec::new();
    for chunk in pages.chunks(64) {
        let refs: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
        slots.extend(sf.write_batch(&refs).unwrap());
    }
    let cached = sf.page_cache_bytes().expect("cachestat (Linux 6.5+)");
    assert!(cached <= 16 * PAGE_SIZE as u64, "{cached} bytes of the swap file are in the page cache");
    // Unaligned destinations go through a bounce page.
    let mut buf = vec![0u8; PAGE_SIZE + 1];
    for (s, p) in slots.iter().zip(&pages) {
        sf.read(*s, &mut buf[1..]).unwrap();
        assert_eq!(&buf[1..], &p[..]);
    }
}

/// A batch read gives what slot-by-slot reads give, in one preadv per run
/// of neighbouring slots, and a corrupt slot fails alone.
#[test]
fn read_batch_coalesces_neighbours_and_fails_only_the_corrupt_slot() {
    for encrypt in [false, true] {
        let sf = swap(encrypt, 1 << 30);
        let pages: Vec<Vec<u8>> = (0..48).map(|i| page(i + 1000)).collect();
        let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        let slots = sf.write_batch(&refs).unwrap();
        // Flip a byte of slot 5.
        flip(&sf, slots[5], 9, 0x10);
        // Ask in a shuffled order, with an unaligned destination too.
        let order: Vec<usize> = (0..48).rev().collect();
        let mut bufs: Vec<Vec<u8>> = order.iter().map(|_| vec![0u8; PAGE_SIZE + 1]).collect();
        let before = sf.stats().read_calls;
        let results = {
            let mut reqs: Vec<(zmem_swapfile::Slot, &mut [u8])> =
                order.iter().zip(bufs.iter_mut()).map(|(&i, b)| (slots[i], &mut b[1..])).collect();
            sf.read_batch(&mut reqs)
        };
        assert!(sf.stats().read_calls - before <= 2, "{:?}", sf.stats());
        for ((&i, r), b) in order.iter().zip(&results).zip(&bufs) {
            if i == 5 {
                assert!(matches!(r, Err(SwapError::Corrupt { .. })), "{r:?}");
            } else {
                assert!(r.is_ok(), "slot {i}: {r:?}");
                assert_eq!(&b[1..], &pages[i][..], "slot {i}");
            }
        }
        // A slot not in use is an error, not a read.
        sf.free(slots[7]).unwrap();
        let mut one = vec![0u8; PAGE_SIZE];
        let r = sf.read_batch(&mut [(slots[7], &mut one[..])]);
        assert!(matches!(r[0], Err(SwapError::NotInUse { .. })), "{r:?}");
    }
}

/// Reads a batch of `slots`, returning the results and the bytes.
fn read_all(sf: &SwapFile, slots: &[u32]) -> (Vec<Result<(), SwapError>>, Vec<Vec<u8>>) {
    let mut bufs = vec![vec![0u8; PAGE_SIZE]; slots.len()];
    let r = {
        let mut reqs: Vec<(u32, &mut [u8])> =
            slots.iter().zip(bufs.iter_mut()).map(|(&s, b)| (s, &mut b[..])).collect();
        sf.read_batch(&mut reqs)
    };
    (r, bufs)
}

/// Swap-in read-ahead (`SwapFile::prefetch`): the reads it started serve
/// the batch reads after them, and a slot freed and written again after
/// its read-ahead (done or still in flight) reads back its new bytes.
#[test]
fn read_ahead_serves_batch_reads_and_never_a_stale_slot() {
    let sf = swap(true, 64 * PAGE_SIZE as u64);
    assert!(sf.stats().direct_io, "{:?}", sf.stats());
    let pages: Vec<Vec<u8>> = (0..64).map(|i| page(i + 500)).collect();
    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
    let slots = sf.write_batch(&refs).unwrap();
    sf.prefetch(&slots);
    let calls = sf.stats().read_calls;
    let (r, bufs) = read_all(&sf, &slots);
    for (i, (r, b)) in r.iter().zip(&bufs).enumerate() {
        assert!(r.is_ok(), "slot {i}: {r:?}");
        assert!(*b == pages[i], "slot {i}");
    }
    let st = sf.stats();
    // Without io_uring (a seccomp filter refuses it) reads are synchronous,
    // and this test has nothing to check: it fails, saying so.
    assert!(st.readahead, "no io_uring here, so no swap read-ahead: {st:?}");
    assert_eq!(st.readahead_hits, 64, "{st:?}");
    assert_eq!(st.read_calls, calls, "read-ahead served every read: {st:?}");
    // Freed and written again: done read-ahead (half) and in flight (the
    // other half, asked for again just before the rewrite).
    sf.prefetch(&slots[32..]);
    for &s in &slots {
        sf.free(s).unwrap();
    }
    let newer: Vec<Vec<u8>> = (0..64).map(|i| page(i + 9000)).collect();
    let refs: Vec<&[u8]> = newer.iter().map(Vec::as_slice).collect();
    let again = sf.write_batch(&refs).unwrap();
    let mut sorted = again.clone();
    sorted.sort_unstable();
    let mut old = slots.clone();
    old.sort_unstable();
    assert_eq!(sorted, old, "a full file reuses every freed slot");
    let (r, bufs) = read_all(&sf, &again);
    for (i, (r, b)) in r.iter().zip(&bufs).enumerate() {
        assert!(r.is_ok(), "slot {i}: {r:?}");
        assert!(*b == newer[i], "slot {} read back its old bytes", again[i]);
    }
    // Read ahead again, then freed and rewritten before anyone reads.
    sf.prefetch(&again);
    for &s in &again {
        sf.free(s).unwrap();
    }
    let third: Vec<Vec<u8>> = (0..64).map(|i| page(i + 77_000)).collect();
    let refs: Vec<&[u8]> = third.iter().map(Vec::as_slice).collect();
    let last = sf.write_batch(&refs).unwrap();
    let (r, bufs) = read_all(&sf, &last);
    for (i, (r, b)) in r.iter().zip(&bufs).enumerate() {
        assert!(r.is_ok(), "slot {i}: {r:?}");
        assert!(*b == third[i], "slot {} read back stale bytes", last[i]);
    }
}

/// A slot corrupt on disk fails its read-ahead's check: the batch read
/// then reads it itself and reports it corrupt, never wrong bytes.
#[test]
fn a_corrupt_slot_read_ahead_is_still_corrupt() {
    let sf = swap(true, 1 << 30);
    let pages: Vec<Vec<u8>> = (0..16).map(|i| page(i + 3000)).collect();
    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
    let slots = sf.write_batch(&refs).unwrap();
    flip(&sf, slots[3], 100, 0x40);
    sf.prefetch(&slots);
    let (r, bufs) = read_all(&sf, &slots);
    for (i, (r, b)) in r.iter().zip(&bufs).enumerate() {
        if i == 3 {
            assert!(matches!(r, Err(SwapError::Corrupt { .. })), "{r:?}");
        } else {
            assert!(r.is_ok(), "slot {i}: {r:?}");
            assert!(*b == pages[i], "slot {i}");
        }
    }
}
