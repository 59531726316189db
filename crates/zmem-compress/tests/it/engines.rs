//! The multi-engine device: same bytes as the sequential path on every route
//! (engines, submit-time fallback, completion-timeout fallback), verify
//! catches a corrupting codec, async tickets, and a multi-threaded stress.

use std::sync::Arc;
use std::time::Duration;

use zmem_common::PAGE_SIZE;
use zmem_compress::engines::{Engines, EnginesConfig, WqMode};
use zmem_compress::{
    Batch, BatchCompressor, CodecSpec, CompressError, Compressor, DecompressError, EngineStats, ItemError, Sequential,
};

use crate::util::corpus;

fn spec(s: &str) -> CodecSpec {
    s.parse().unwrap()
}

/// Compresses every corpus page through `bc` in batches of its batch size.
fn compress_all(bc: &dyn BatchCompressor) -> Vec<Result<Vec<u8>, CompressError>> {
    let pages: Vec<&[u8]> = corpus().pages().collect();
    let mut all = Vec::new();
    for chunk in pages.chunks(bc.batch_size()) {
        let mut outs = vec![vec![0u8; PAGE_SIZE]; chunk.len()];
        let mut dsts: Vec<&mut [u8]> = outs.iter_mut().map(|o| &mut o[..]).collect();
        let mut res = vec![Ok(0); chunk.len()];
        bc.compress_batch(chunk, &mut dsts, &mut res).unwrap();
        for (o, r) in outs.into_iter().zip(res) {
            all.push(r.map(|n| o[..n].to_vec()));
        }
    }
    all
}

fn decompress_all(bc: &dyn BatchCompressor, objs: &[Result<Vec<u8>, CompressError>]) {
    let idx: Vec<usize> = (0..objs.len()).filter(|&i| objs[i].is_ok()).collect();
    for chunk in idx.chunks(bc.batch_size()) {
        let srcs: Vec<&[u8]> = chunk.iter().map(|&i| objs[i].as_ref().unwrap().as_slice()).collect();
        let mut outs = vec![vec![0u8; PAGE_SIZE]; chunk.len()];
        let mut dsts: Vec<&mut [u8]> = outs.iter_mut().map(|o| &mut o[..]).collect();
        let mut res = vec![Ok(0); chunk.len()];
        bc.decompress_batch(&srcs, &mut dsts, &mut res).unwrap();
        for ((&i, o), r) in chunk.iter().zip(&outs).zip(res) {
            assert_eq!(r, Ok(PAGE_SIZE), "page {i}");
            assert!(o[..] == *corpus().page(i), "page {i} differs after the engine round-trip");
        }
    }
}

fn total(e: &Engines) -> EngineStats {
    EngineStats::sum(&e.stats())
}

#[test]
fn engine_outputs_equal_sequential_outputs() {
    for name in ["lz4", "zstd:1", "lzo-rle", "deflate:1"] {
        let want = compress_all(&Sequential::from_spec(spec(name)));
        for mode in [WqMode::Global, WqMode::PerCpu] {
            let cfg = EnginesConfig { engines: 2, wq_mode: mode, ..Default::default() };
            let e = Engines::new(cfg, spec(name).factory()).unwrap();
            let got = compress_all(&e);
            assert!(got == want, "{name} {mode}: engine output differs from sequential");
            decompress_all(&e, &got);
            let s = total(&e);
            let poor = want.iter().filter(|r| r.is_err()).count() as u64;
            assert_eq!(s.compress_calls, corpus().len() as u64, "{name} {mode}");
            assert_eq!(s.poor_outputs, poor, "{name} {mode}");
            assert_eq!(s.decompress_calls, corpus().len() as u64 - poor, "{name} {mode}");
        }
    }
}

#[test]
fn timeout_paths_give_the_same_bytes_as_engines() {
    let want = compress_all(&Sequential::from_spec(spec("lz4")));
    let cfg = EnginesConfig {
        engines: 2,
        wq_depth: 1,
        submit_timeout: Duration::ZERO,
        completion_timeout: Duration::from_millis(2),
        help_on_wait: false,
        ..Default::default()
    };
    let e = Engines::new(cfg, spec("lz4").factory()).unwrap();
    e.set_paused(true);
    let got = compress_all(&e);
    assert!(got == want, "fallback output differs from the engine path");
    let s = total(&e);
    // Every item ran on a software path: at submit (queue full) or in wait
    // (completion timeout); engines ran none of them.
    assert_eq!(s.sw_fallback_calls, corpus().len() as u64);
    assert!(s.completion_timeouts > 0, "{s:?}");
    e.set_paused(false);
    decompress_all(&e, &got);
}

/// lz4 that flips one bit of every output: a broken accelerator.
struct Corrupting(Box<dyn Compressor>);

impl Compressor for Corrupting {
    fn name(&self) -> &str {
        "lz4"
    }
    fn compress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, CompressError> {
        let n = self.0.compress(src, dst)?;
        dst[n / 2] ^= 0x10;
        Ok(n)
    }
    fn decompress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, DecompressError> {
        self.0.decompress(src, dst)
    }
}

#[test]
fn verify_catches_a_corrupting_codec() {
    let factory: zmem_compress::Factory = Arc::new(|| Box::new(Corrupting(spec("lz4").build())));
    for verify in [false, true] {
        let cfg = EnginesConfig { engines: 2, verify_compress: verify, ..Default::default() };
        let e = Engines::new(cfg, factory.clone()).unwrap();
        let got = compress_all(&e);
        let failed = got.iter().filter(|r| matches!(r, Err(CompressError::VerifyFailed { .. }))).count();
        let s = total(&e);
        if verify {
            let compressible = got.iter().filter(|r| !matches!(r, Err(CompressError::Poor))).count();
            // A flipped bit can land where lz4 ignores it only by chance;
            // nearly every page must be caught.
            assert!(failed as f64 > 0.95 * compressible as f64, "{failed} of {compressible} caught");
            assert_eq!(s.verify_failures, failed as u64);
        } else {
            assert_eq!(failed, 0);
            assert_eq!(s.verify_failures, 0);
        }
    }
}

#[test]
fn async_tickets_complete_in_any_order() {
    let e = Engines::new(EnginesConfig { engines: 2, ..Default::default() }, spec("zstd:1").factory()).unwrap();
    let pages: Vec<&[u8]> = corpus().pages().take(64).collect();
    let tickets: Vec<_> = pages.chunks(8).map(|c| e.submit(Batch::compress(c.iter().copied())).unwrap()).collect();
    let mut seq = spec("zstd:1").build();
    for (k, t) in tickets.into_iter().enumerate().rev() {
        while !e.poll(&t) {
            std::thread::yield_now();
        }
        let b = e.wait(t);
        for (j, item) in b.items.iter().enumerate() {
            let page = pages[k * 8 + j];
            let mut want = vec![0u8; PAGE_SIZE];
            match (item.output().expect("completed"), seq.compress(page, &mut want)) {
                (Ok(got), Ok(n)) => assert_eq!(got, &want[..n]),
                (Err(ItemError::Compress(a)), Err(b)) => assert_eq!(*a, b),
                (a, b) => panic!("page {}: engine {a:?}, sequential {b:?}", k * 8 + j),
            }
        }
    }
}

#[test]
fn eight_threads_share_one_device() {
    for mode in [WqMode::Global, WqMode::PerCpu] {
        let cfg = EnginesConfig { engines: 2, wq_depth: 4, wq_mode: mode, ..Default::default() };
        let e = Arc::new(Engines::new(cfg, spec("lz4").factory()).unwrap());
        std::thread::scope(|s| {
            for t in 0..8 {
                let e = Arc::clone(&e);
                s.spawn(move || {
                    let mut batch = Batch::new(zmem_compress::Op::Compress);
                    for round in 0..24 {
                        let first = (t * 97 + round * 8) % (corpus().len() - 8);
                        let pages: Vec<&[u8]> = (first..first + 8).map(|i| corpus().page(i)).collect();
                        batch.refill(zmem_compress::Op::Compress, pages.iter().copied(), |s| s.len());
                        let done = e.wait(e.submit(batch).unwrap());
                        let objs: Vec<Vec<u8>> =
                            done.items.iter().filter_map(|i| i.output()?.ok().map(<[u8]>::to_vec)).collect();
                        let back =
                            e.wait(e.submit(Batch::decompress(objs.iter().map(Vec::as_slice), PAGE_SIZE)).unwrap());
                        let mut k = 0;
                        for (i, item) in done.items.iter().enumerate() {
                            if item.output().unwrap().is_ok() {
                                assert!(
                                    back.items[k].output().unwrap().unwrap() == pages[i],
                                    "thread {t} round {round} page {i}"
                                );
                                k += 1;
                            }
                        }
                        batch = done;
                    }
                });
            }
        });
        assert_eq!(total(&e).verify_failures, 0);
    }
}

/// A ticket handed to the wrong compressor: `Sequential::wait` panicked on
/// an engines' ticket. Now what the engines started completes with the
/// engines' codec, and the rest comes back as `ForeignTicket`, never run
/// with the wrong codec.
#[test]
fn a_foreign_ticket_never_panics_and_never_runs_with_the_wrong_codec() {
    // The engine may have started some items by the time lz4 waits.
    let e = Engines::new(
        EnginesConfig { engines: 1, completion_timeout: Duration::from_secs(60), ..Default::default() },
        spec("zstd:1").factory(),
    )
    .unwrap();
    let lz4 = Sequential::new(spec("lz4").factory(), 8).unwrap();
    let pages: Vec<&[u8]> = corpus().pages().take(8).collect();
    let t = e.submit(Batch::compress(pages.iter().copied())).unwrap();
    let b = lz4.wait(t);
    let mut zstd = spec("zstd:1").build();
    for (item, page) in b.items.iter().zip(&pages) {
        match item.output().expect("every item has a result") {
            Err(ItemError::ForeignTicket) => {}
            Ok(got) => {
                // Run by the engines, with their codec.
                let mut want = vec![0u8; PAGE_SIZE];
                let n = zstd.compress(page, &mut want).unwrap();
                assert_eq!(got, &want[..n]);
            }
            Err(other) => panic!("{other:?}"),
        }
    }
}

/// A device outside the crate, as a hardware backend is: each batch runs on
/// a thread of its own and is handed back through `Ticket::pending`.
#[derive(Debug)]
struct ThreadDevice(CodecSpec);

#[derive(Debug)]
struct OnThread(std::thread::JoinHandle<Batch>);

impl zmem_compress::PendingBatch for OnThread {
    fn is_done(&self) -> bool {
        self.0.is_finished()
    }
    fn finish(self: Box<Self>) -> Batch {
        self.0.join().expect("the device thread does not panic")
    }
}

impl ThreadDevice {
    fn submit(&self, b: Batch) -> zmem_compress::Ticket {
        let spec = self.0;
        zmem_compress::Ticket::pending(Box::new(OnThread(std::thread::spawn(move || {
            let seq = Sequential::from_spec(spec);
            let t = seq.submit(b).unwrap();
            seq.wait(t)
        }))))
    }
}

/// Every item of a pending batch was started by its device, so whichever
/// compressor waits on its ticket gets the device's real results, never
/// `ForeignTicket`.
#[test]
fn a_pending_ticket_from_another_device_completes_with_that_devices_results() {
    let dev = ThreadDevice(spec("zstd:1"));
    let lz4 = Sequential::new(spec("lz4").factory(), 8).unwrap();
    let eng = Engines::new(EnginesConfig { engines: 1, ..Default::default() }, spec("lz4").factory()).unwrap();
    let pages: Vec<&[u8]> = corpus().pages().take(8).collect();
    let mut zstd = spec("zstd:1").build();
    let waiters: [&dyn BatchCompressor; 2] = [&lz4, &eng];
    for waiter in waiters {
        let t = dev.submit(Batch::compress(pages.iter().copied()));
        while !waiter.poll(&t) {
            std::thread::yield_now();
        }
        let b = waiter.wait(t);
        for (item, page) in b.items.iter().zip(&pages) {
            let got = item.output().expect("every item has a result").expect("compressed");
            let mut want = vec![0u8; PAGE_SIZE];
            let n = zstd.compress(page, &mut want).unwrap();
            assert_eq!(got, &want[..n], "{}: the device's codec, not the waiter's", waiter.name());
        }
    }
}

/// lz4 that stalls on an engine thread while `stall` is set: an engine
/// descheduled in the middle of an item, as it is on a busy 2-core machine.
struct StallsOnEngines {
    inner: Box<dyn Compressor>,
    stall: Arc<std::sync::atomic::AtomicBool>,
}

impl Compressor for StallsOnEngines {
    fn name(&self) -> &str {
        "lz4"
    }
    fn compress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, CompressError> {
        let on_engine = std::thread::current().name().is_some_and(|n| n.starts_with("zmem-engine"));
        while on_engine && self.stall.load(std::sync::atomic::Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.inner.compress(src, dst)
    }
    fn decompress(&mut self, src: &[u8], dst: &mut [u8]) -> Result<usize, DecompressError> {
        self.inner.decompress(src, dst)
    }
}

/// Before, the waiter ran past its completion timeout only the items no
/// engine had started, and waited for the rest: a reclaim pass waited for
/// milliseconds on an engine the scheduler had put aside (one of two
/// `zmem usemem` workers then compressed every page it read back twice).
/// Now it runs every unfinished item itself; the engine's late output is
/// dropped, and the bytes are the codec's either way.
#[test]
fn a_stalled_engine_does_not_hold_a_batch_past_the_completion_timeout() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stall = Arc::new(AtomicBool::new(true));
    let s2 = Arc::clone(&stall);
    let factory: zmem_compress::batch::Factory =
        Arc::new(move || Box::new(StallsOnEngines { inner: spec("lz4").build(), stall: Arc::clone(&s2) }));
    let cfg = EnginesConfig {
        engines: 1,
        pin: false,
        completion_timeout: Duration::from_millis(5),
        idle_spin: Duration::from_secs(1),
        ..Default::default()
    };
    let e = Engines::new(cfg, factory).unwrap();
    // The engine comes back after 3 s, as a descheduled thread would.
    let s3 = Arc::clone(&stall);
    let _release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(3));
        s3.store(false, Ordering::Release);
    });
    let pages: Vec<&[u8]> = corpus().pages().take(8).collect();
    let t0 = std::time::Instant::now();
    let t = e.submit(Batch::compress(pages.iter().copied())).unwrap();
    // Let the (spinning) engine start an item and stall in it.
    while total(&e).compress_calls == 0 {
        std::thread::yield_now();
    }
    let b = e.wait(t);
    let waited = t0.elapsed();
    stall.store(false, Ordering::Release);
    assert!(waited < Duration::from_secs(2), "the batch waited {waited:?} for a stalled engine");
    let mut lz4 = spec("lz4").build();
    for (item, page) in b.items.iter().zip(&pages) {
        let mut want = vec![0u8; PAGE_SIZE];
        let n = lz4.compress(page, &mut want).unwrap();
        assert_eq!(item.output().unwrap().unwrap(), &want[..n]);
        assert_eq!(item.src, *page, "the input comes back with the batch");
    }
    let s = total(&e);
    assert!(s.completion_timeouts > 0 && s.sw_fallback_calls > 0, "{s:?}");
}

/// With `sync_on_caller`, the synchronous calls run on the calling thread
/// (no engine runs an item, nothing waits for a wake-up) and give the
/// codec's bytes; submitted batches still go to the engines.
#[test]
fn sync_calls_run_on_the_caller_and_submitted_batches_on_the_engines() {
    let want = compress_all(&Sequential::from_spec(spec("lz4")));
    let cfg = EnginesConfig { engines: 2, sync_on_caller: true, help_on_wait: false, ..Default::default() };
    let e = Engines::new(cfg, spec("lz4").factory()).unwrap();
    let got = compress_all(&e);
    assert!(got == want, "the caller's path gave other bytes");
    decompress_all(&e, &got);
    let s = total(&e);
    let n = corpus().len() as u64;
    assert_eq!((s.compress_calls, s.decompress_calls), (0, 0), "{s:?}");
    assert!(s.caller_calls >= n, "{s:?}");
    let pages: Vec<&[u8]> = corpus().pages().take(8).collect();
    let b = e.wait(e.submit(Batch::compress(pages.iter().copied())).unwrap());
    for (item, w) in b.items.iter().zip(&want) {
        assert_eq!(item.output().unwrap().ok(), w.as_deref().ok());
    }
    assert_eq!(total(&e).compress_calls, 8, "help_on_wait is off: the engines ran the submitted batch");
}

/// `min_offload_percent`: while the engines run too few of the items (here
/// none: they are paused and the waiter runs everything), `runs_beside`
/// says no but for one probe in 32; once they run them again it says yes.
#[test]
fn runs_beside_follows_the_share_the_engines_ran() {
    let cfg = EnginesConfig { engines: 1, pin: false, min_offload_percent: 50, ..Default::default() };
    let e = Engines::new(cfg, spec("lz4").factory()).unwrap();
    assert!(e.runs_beside(), "no items yet: yes");
    let pages: Vec<&[u8]> = corpus().pages().take(8).collect();
    e.set_paused(true);
    for _ in 0..200 {
        e.wait(e.submit(Batch::compress(pages.iter().copied())).unwrap());
    }
    let yes = (0..64).filter(|_| e.runs_beside()).count();
    assert_eq!(yes, 2, "only the probes say yes while the waiter runs everything");
    e.set_paused(false);
    for _ in 0..300 {
        let t = e.submit(Batch::compress(pages.iter().copied())).unwrap();
        // Not pinned: nothing is kept for this thread, and polling runs
        // nothing, so the engine runs every item.
        while !e.poll(&t) {
            std::thread::yield_now();
        }
        e.wait(t);
    }
    assert!((0..64).all(|_| e.runs_beside()), "{:?}", total(&e));
}
