//! nvCOMP on a real GPU. These need NVIDIA's driver, a CUDA device and
//! `libnvcomp.so.6` on the loader's path, which CI machines do not have, so
//! they are `#[ignore]`d: run them on a GPU machine with
//!
//! ```sh
//! LD_LIBRARY_PATH=…/nvidia/libnvcomp/lib64 cargo test -p zmem-nvcomp --test gpu -- --ignored
//! ```
//!
//! Every page that comes back is compared byte for byte with the page that
//! went in.

use std::sync::Arc;

use zmem_common::PAGE_SIZE;
use zmem_compress::corpus::Corpus;
use zmem_compress::{Batch, BatchCompressor, CodecSpec, CompressError, DecompressError, Op, Sequential};
use zmem_nvcomp::{NvcompConfig, NvcompLz4, Placement};
use zmem_tier::{LoadOutcome, RejectReason, StoreOutcome, StoreRequest, Tier, TierConfig};

fn device(decompress: Placement, streams: usize) -> NvcompLz4 {
    let cfg = NvcompConfig { decompress, streams, verify: true, ..NvcompConfig::default() };
    NvcompLz4::new(cfg).expect("a GPU with nvCOMP 6 (see this file's header)")
}

fn liblz4() -> Sequential {
    Sequential::new("lz4".parse::<CodecSpec>().unwrap().factory(), 32).unwrap()
}

fn random_page(seed: u64) -> Vec<u8> {
    zmem_compress::corpus::incompressible_page(seed)
}

/// Compresses `pages` on `dev`, 32 at a time; `None` for a Poor page.
fn compress_all(dev: &dyn BatchCompressor, pages: &[&[u8]]) -> Vec<Option<Vec<u8>>> {
    let mut objs = Vec::new();
    for chunk in pages.chunks(32) {
        let mut bufs = vec![vec![0u8; PAGE_SIZE]; chunk.len()];
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        let mut res = vec![Ok(0); chunk.len()];
        dev.compress_batch(chunk, &mut dsts, &mut res).unwrap();
        for (r, b) in res.into_iter().zip(bufs) {
            match r {
                Ok(n) => objs.push(Some(b[..n].to_vec())),
                Err(CompressError::Poor) => objs.push(None),
                Err(e) => panic!("compress: {e}"),
            }
        }
    }
    objs
}

/// Decompresses every object on `dev` and checks it against its page.
fn check_all(dev: &dyn BatchCompressor, pages: &[&[u8]], objs: &[Option<Vec<u8>>]) -> usize {
    let pairs: Vec<(&[u8], &[u8])> =
        pages.iter().zip(objs).filter_map(|(p, o)| o.as_deref().map(|o| (*p, o))).collect();
    for chunk in pairs.chunks(32) {
        let srcs: Vec<&[u8]> = chunk.iter().map(|(_, o)| *o).collect();
        let mut bufs = vec![vec![0u8; PAGE_SIZE]; chunk.len()];
        let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        let mut res = vec![Ok(0); chunk.len()];
        dev.decompress_batch(&srcs, &mut dsts, &mut res).unwrap();
        for ((r, b), (p, _)) in res.iter().zip(&bufs).zip(chunk) {
            assert_eq!(*r, Ok(PAGE_SIZE));
            assert!(b == p, "a page came back different");
        }
    }
    pairs.len()
}

#[test]
#[ignore = "needs a CUDA GPU and libnvcomp.so.6"]
fn gpu_objects_are_lz4_blocks_that_liblz4_and_the_gpu_read_back_bit_identical() {
    let corpus = Corpus::sample();
    let mut pages: Vec<Vec<u8>> = corpus.pages().map(<[u8]>::to_vec).collect();
    // Incompressible pages among them: each must be Poor, not an error.
    for i in 0..16u64 {
        pages.insert((i as usize) * 97, random_page(i));
    }
    pages.push(vec![0u8; PAGE_SIZE]);
    let refs: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
    let gpu = device(Placement::Gpu, 2);
    eprintln!("device: {} (nvCOMP {})", gpu.gpu().name(), gpu.gpu().nvcomp_version());
    let objs = compress_all(&gpu, &refs);
    assert_eq!(objs.len(), refs.len());
    let poor = objs.iter().filter(|o| o.is_none()).count();
    assert!((16..=40).contains(&poor), "{poor} Poor pages: the 16 random ones and few others");
    let stored: usize = objs.iter().flatten().map(Vec::len).sum();
    let cpu_stored: usize = compress_all(&liblz4(), &refs).iter().flatten().map(Vec::len).sum();
    eprintln!(
        "{} pages: GPU objects {} bytes, liblz4's {} bytes ({:.3}x)",
        refs.len(),
        stored,
        cpu_stored,
        stored as f64 / cpu_stored as f64
    );
    assert!(check_all(&liblz4(), &refs, &objs) > 2000);
    assert!(check_all(&gpu, &refs, &objs) > 2000);
    let st = gpu.stats();
    assert!(st.gpu_batches > 100 && st.gpu_errors == 0 && st.verify_failures == 0, "{st:?}");
    // And the other way: liblz4's objects on the GPU.
    let cpu_objs = compress_all(&liblz4(), &refs);
    assert!(check_all(&gpu, &refs, &cpu_objs) > 2000);
}

/// Corrupts `o` in one of three ways.
fn corrupt(kind: usize, o: &mut Vec<u8>, seed: u64) {
    match kind {
        0 => o.truncate(o.len() / 2),
        1 => o.iter_mut().step_by(7).for_each(|b| *b ^= 0xa5),
        _ => *o = random_page(seed)[..o.len()].to_vec(),
    }
}

/// Decompresses `srcs` (32 of them) on `dev`.
fn decompress_32(dev: &dyn BatchCompressor, srcs: &[&[u8]]) -> (Vec<Result<usize, DecompressError>>, Vec<Vec<u8>>) {
    let mut bufs = vec![vec![0u8; PAGE_SIZE]; srcs.len()];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let mut res = vec![Ok(0); srcs.len()];
    dev.decompress_batch(srcs, &mut dsts, &mut res).unwrap();
    (res, bufs)
}

#[test]
#[ignore = "needs a CUDA GPU and libnvcomp.so.6"]
fn corrupt_gpu_objects_fail_their_own_item_and_their_neighbours_come_back_whole() {
    let corpus = Corpus::sample();
    let pages: Vec<&[u8]> = corpus.pages().skip(64).take(32).collect();
    let objs: Vec<Vec<u8>> = compress_all(&device(Placement::Cpu, 1), &pages)
        .into_iter()
        .map(|o| o.expect("corpus page compresses"))
        .collect();
    for placement in [Placement::Cpu, Placement::Gpu] {
        let dev = device(placement, 1);
        for kind in 0..3 {
            let mut bad = objs.clone();
            // Every batch here holds a truncated object, which nvCOMP decodes
            // short: the GPU batch is then redone on liblz4 (`Placement::Gpu`).
            corrupt(0, &mut bad[5], 5);
            for (i, o) in bad.iter_mut().enumerate() {
                if i % 2 == 1 && i != 5 {
                    corrupt(kind, o, i as u64);
                }
            }
            let srcs: Vec<&[u8]> = bad.iter().map(Vec::as_slice).collect();
            let (res, bufs) = decompress_32(&dev, &srcs);
            for i in 0..32 {
                if i % 2 == 0 {
                    assert_eq!(res[i], Ok(PAGE_SIZE), "{placement:?} kind {kind}: sound object {i}");
                    assert!(bufs[i] == pages[i], "{placement:?} kind {kind}: sound object {i} came back different");
                } else {
                    assert!(res[i].is_err(), "{placement:?} kind {kind}: corrupt object {i} decoded: {:?}", res[i]);
                }
            }
        }
        let st = dev.stats();
        assert_eq!(st.gpu_errors, 0);
        if placement == Placement::Gpu {
            assert_eq!(st.gpu_redone, 3, "{st:?}");
        }
    }
    // A too-small output buffer is an error of that item alone.
    let gpu = device(Placement::Gpu, 1);
    let mut small = [0u8; 100];
    let mut full = vec![0u8; PAGE_SIZE];
    let mut res2 = vec![Ok(0); 2];
    gpu.decompress_batch(&[&objs[0], &objs[1]], &mut [&mut small[..], &mut full[..]], &mut res2).unwrap();
    assert!(res2[0].is_err(), "{:?}", res2[0]);
    assert_eq!(res2[1], Ok(PAGE_SIZE));
    assert!(full == pages[1]);
}

#[test]
#[ignore = "needs a CUDA GPU and libnvcomp.so.6"]
fn batches_in_flight_on_every_stream_all_complete_and_the_rest_run_on_the_cpu() {
    let corpus = Corpus::sample();
    let pages: Vec<&[u8]> = corpus.pages().collect();
    let gpu = device(Placement::Gpu, 4);
    let mut tickets = Vec::new();
    for chunk in pages.chunks(32).take(12) {
        tickets.push((chunk, gpu.submit(Batch::compress(chunk.iter().copied())).unwrap()));
    }
    let st = gpu.stats();
    assert_eq!(st.busy_fallbacks, 8, "4 streams in flight, 8 batches on liblz4: {st:?}");
    let mut objs = Vec::new();
    for (chunk, t) in tickets {
        while !gpu.poll(&t) {
            std::thread::yield_now();
        }
        let b = gpu.wait(t);
        assert_eq!(b.op, Op::Compress);
        for (item, page) in b.items.iter().zip(chunk) {
            let obj = item.output().unwrap().unwrap();
            objs.push((page, obj.to_vec()));
        }
    }
    // Decompress them back asynchronously too.
    let mut tickets = Vec::new();
    for chunk in objs.chunks(32) {
        let b = Batch::decompress(chunk.iter().map(|(_, o)| o.as_slice()), PAGE_SIZE);
        tickets.push((chunk, gpu.submit(b).unwrap()));
    }
    for (chunk, t) in tickets {
        let b = gpu.wait(t);
        for (item, (page, _)) in b.items.iter().zip(chunk) {
            assert_eq!(item.output().unwrap().unwrap(), **page);
        }
    }
    let st = gpu.stats();
    assert!(st.gpu_items >= 8 * 32 && st.verify_failures == 0 && st.gpu_errors == 0, "{st:?}");
}

#[test]
#[ignore = "needs a CUDA GPU and libnvcomp.so.6"]
fn four_threads_share_one_device_and_every_byte_comes_back() {
    let corpus = Corpus::sample();
    let gpu = Arc::new(device(Placement::Gpu, 3));
    std::thread::scope(|s| {
        for t in 0..4usize {
            let gpu = gpu.clone();
            s.spawn(move || {
                let pages: Vec<&[u8]> = corpus.pages().skip(t * 256).take(512).collect();
                for _ in 0..10 {
                    let objs = compress_all(&*gpu, &pages);
                    check_all(&*gpu, &pages, &objs);
                    check_all(&liblz4(), &pages, &objs);
                }
            });
        }
    });
    let st = gpu.stats();
    assert!(st.gpu_batches > 0 && st.gpu_errors == 0 && st.verify_failures == 0, "{st:?}");
}

#[test]
#[ignore = "needs a CUDA GPU and libnvcomp.so.6"]
fn the_tier_stores_folios_on_the_gpu_and_loads_every_page_on_the_cpu() {
    let corpus = Corpus::sample();
    let gpu = Arc::new(device(Placement::Cpu, 4));
    let cfg = TierConfig { max_pool_bytes: Some(64 << 20), ..TierConfig::without_writeback() };
    let t = Tier::with_compressor(cfg, gpu.clone()).unwrap();
    assert_eq!(t.compressor(), "lz4@nvcomp");
    let pages: Vec<&[u8]> = corpus.pages().collect();
    // Without writeback a folio with a page that does not compress is
    // rejected whole, as zswap rejects it; its keys then load nothing.
    // Passes of 8 folios of 16 pages, as the pager stores them: 4 GPU
    // batches of 32 in flight at once.
    let mut stored = vec![false; pages.len()];
    let folios: Vec<(usize, Vec<u8>)> = pages.chunks(16).map(|f| (f.len(), f.concat())).collect();
    for (pass, chunk) in folios.chunks(8).enumerate() {
        let reqs: Vec<StoreRequest<'_>> = chunk
            .iter()
            .enumerate()
            .map(|(i, (_, bytes))| StoreRequest { key: ((pass * 8 + i) * 16) as u64, folio: bytes, reuse: false })
            .collect();
        for (i, out) in t.store_many(&reqs).into_iter().enumerate() {
            let (f, n) = (pass * 8 + i, chunk[i].0);
            match out.unwrap() {
                StoreOutcome::Stored { .. } => stored[f * 16..f * 16 + n].fill(true),
                StoreOutcome::Rejected(RejectReason::CompressPoor) => {}
                other => panic!("folio {f}: {other:?}"),
            }
        }
    }
    let n_stored = stored.iter().filter(|s| **s).count();
    let pool = t.pool_total_size();
    assert!(n_stored > pages.len() * 9 / 10, "{n_stored} of {} pages stored", pages.len());
    let mut buf = vec![0u8; PAGE_SIZE];
    for (k, page) in pages.iter().enumerate() {
        if stored[k] {
            assert_eq!(t.load(k as u64, &mut buf).unwrap(), LoadOutcome::Loaded);
            assert!(buf == *page, "page {k} came back different");
        } else {
            assert_eq!(t.load(k as u64, &mut buf).unwrap(), LoadOutcome::NotFound);
        }
    }
    let st = gpu.stats();
    assert!(st.gpu_items as usize >= pages.len() / 2, "stores ran on the GPU: {st:?}");
    assert!(st.cpu_items as usize >= n_stored / 2, "loads ran on liblz4: {st:?}");
    assert_eq!((st.gpu_errors, st.verify_failures), (0, 0));
    eprintln!("pool {pool} bytes for {n_stored} stored pages; {st:?}");
}
