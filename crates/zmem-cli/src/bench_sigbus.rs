//! `zmem bench sigbus`: the same-thread design measured against zmem's
//! handler thread, on the same work. A touch of a folio not yet mapped
//! decompresses its pages (lz4, the embedded corpus) and maps them with
//! one `UFFDIO_COPY`:
//! - `thread`: a handler thread waits in poll(2), reads the fault message,
//!   decompresses and COPYs, which wakes the faulting thread (the pager's
//!   design);
//! - `thread-same-cpu`: the same with both threads pinned to CPU 0;
//! - `sigbus`: with `UFFD_FEATURE_SIGBUS` the kernel raises SIGBUS in the
//!   faulting thread instead of queueing a message (as ExtMem serves
//!   faults); its handler decompresses and COPYs, and the access retries on
//!   return. No second thread and no wake-up.
//!
//! Each round maps a fresh region per mode, in turn, and touches its folios
//! in one random order; latencies are per 4 KiB, measured on the touching
//! thread. Every page is compared with what was compressed afterwards.
//!
//! Only the cost of serving one fault is measured here. What the design
//! would cost zmem is written in ARCHITECTURE.md: a SIGBUS handler must be
//! async-signal-safe (this one only decompresses into a buffer it owns and
//! makes one ioctl), the program's own SIGBUS handlers would have to be
//! chained, and a kernel access to a missing page (a `read(2)` into it)
//! fails with EFAULT instead of faulting.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use zmem_common::PAGE_SIZE;
use zmem_compress::codec::{CodecSpec, Compressor};
use zmem_compress::corpus::Corpus;
use zmem_uffd::{Event, Features, Mapping, OpenMode, RegisterMode, Uffd};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Region size per mode and round, MiB.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Folio size (what one fault maps), KiB.
    #[arg(long, default_value_t = 64)]
    folio_kib: usize,
    /// Rounds (each maps a fresh region per mode).
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Mode {
    mode: &'static str,
    faults: usize,
    p50_us_per_4k: f64,
    p99_us_per_4k: f64,
    mean_us_per_4k: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    folio_kib: usize,
    mib: usize,
    rounds: usize,
    modes: Vec<Mode>,
    /// sigbus's p50 over thread's (below 1: the same thread is faster).
    sigbus_vs_thread_p50: f64,
}

/// The compressed pages the faults decompress: page `i` of a region is
/// corpus page `i % len`.
struct Pages {
    blobs: Vec<Vec<u8>>,
}

impl Pages {
    fn new(c: &Corpus) -> Result<Pages> {
        let mut lz4 = lz4()?;
        let mut dst = vec![0u8; PAGE_SIZE];
        let blobs = (0..c.len())
            .map(|i| match lz4.compress(c.page(i), &mut dst) {
                Ok(n) => dst[..n].to_vec(),
                // Kept as it is: `fill` copies a blob of a page's length.
                Err(_) => c.page(i).to_vec(),
            })
            .collect();
        Ok(Pages { blobs })
    }

    /// Decompresses pages `[first, first + n)` into `buf`. Allocates
    /// nothing (a SIGBUS handler calls it).
    fn fill(&self, lz4: &mut dyn Compressor, first: usize, buf: &mut [u8]) -> bool {
        buf.chunks_exact_mut(PAGE_SIZE).enumerate().all(|(i, page)| {
            let blob = &self.blobs[(first + i) % self.blobs.len()];
            if blob.len() == PAGE_SIZE {
                page.copy_from_slice(blob);
                true
            } else {
                lz4.decompress(blob, page).is_ok_and(|n| n == PAGE_SIZE)
            }
        })
    }
}

fn lz4() -> Result<Box<dyn Compressor>> {
    Ok("lz4".parse::<CodecSpec>().context("lz4")?.build())
}

/// What the SIGBUS handler serves: one region, from the one thread that
/// touches it (the handler runs on that thread, so nothing else uses this).
struct SigState {
    base: u64,
    len: u64,
    folio: usize,
    pages: Arc<Pages>,
    lz4: std::cell::UnsafeCell<Box<dyn Compressor>>,
    buf: std::cell::UnsafeCell<Vec<u8>>,
    uffd: Uffd,
    faults: AtomicU64,
    failed: AtomicBool,
}

static SIG_STATE: AtomicPtr<SigState> = AtomicPtr::new(std::ptr::null_mut());

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let info = unsafe { &*info };
    // SAFETY: a SIGBUS's siginfo carries the faulting address.
    let addr = unsafe { info.si_addr() } as u64;
    let st = SIG_STATE.load(Ordering::Acquire);
    // SAFETY: SIG_STATE is null or points to the live SigState that `sigbus`
    // publishes before its touches and takes back after them.
    let Some(st) = (unsafe { st.as_ref() }).filter(|s| (s.base..s.base + s.len).contains(&addr)) else {
        // Not ours: the default action (the process dies with SIGBUS) on
        // the access's retry.
        // SAFETY: resetting a disposition is async-signal-safe.
        unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
        return;
    };
    let off = (addr - st.base) & !(st.folio as u64 - 1);
    // SAFETY: only this handler touches `lz4` and `buf`, and it runs on the
    // one thread that touches the region, never nested (it touches no
    // region page itself).
    let lz4 = unsafe { &mut *st.lz4.get() };
    // SAFETY: as for `lz4`.
    let buf = unsafe { &mut *st.buf.get() };
    if !st.pages.fill(lz4.as_mut(), off as usize / PAGE_SIZE, buf) {
        st.failed.store(true, Ordering::Relaxed);
    }
    // SAFETY: `buf` holds `folio` bytes; [base + off, + folio) lies in the
    // registered region, which no Rust reference covers.
    let r = unsafe { st.uffd.copy(st.base + off, buf.as_ptr(), st.folio as u64, true) };
    if r.is_err() {
        st.failed.store(true, Ordering::Relaxed);
        // SAFETY: as above; the retry then dies with SIGBUS, not loops.
        unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
    }
    st.faults.fetch_add(1, Ordering::Relaxed);
}

/// One random order of `n` folios (xorshift; the same for every mode).
fn order(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// Touches the folios of `m` in `order`, returning each touch's time.
fn touch(m: &Mapping, folio: usize, order: &[usize]) -> Vec<u64> {
    order
        .iter()
        .map(|&f| {
            let p = (m.addr() + (f * folio) as u64) as *const u8;
            let t = Instant::now();
            // SAFETY: inside the mapping; a volatile read, so it faults.
            std::hint::black_box(unsafe { std::ptr::read_volatile(p) });
            t.elapsed().as_nanos() as u64
        })
        .collect()
}

/// Every page of `m` is the corpus page it should be.
fn verify(m: &Mapping, c: &Corpus, mode: &str) -> Result<()> {
    // SAFETY: the whole mapping is mapped now (every folio was touched)
    // and nothing writes it.
    let bytes = unsafe { std::slice::from_raw_parts(m.addr() as *const u8, m.len()) };
    for (i, page) in bytes.chunks_exact(PAGE_SIZE).enumerate() {
        if page != c.page(i % c.len()) {
            bail!("{mode}: page {i} differs from what was compressed");
        }
    }
    Ok(())
}

fn region(len: usize, uffd: &Uffd) -> Result<Mapping> {
    let m = Mapping::new(len)?;
    uffd.register(m.addr(), len as u64, RegisterMode { missing: true, wp: false })?;
    Ok(m)
}

fn handler_thread(pages: &Arc<Pages>, folio: usize, order: &[usize], len: usize, same_cpu: bool) -> Result<Vec<u64>> {
    let uffd = Arc::new(Uffd::open(OpenMode::Auto, Features::default())?);
    let m = region(len, &uffd)?;
    let stop = Arc::new(AtomicBool::new(false));
    let pin = |cpu: usize| -> Result<()> {
        let mut set = rustix::thread::CpuSet::new();
        set.set(cpu);
        Ok(rustix::thread::sched_setaffinity(None, &set)?)
    };
    let handler = {
        let (uffd, pages, stop, base) = (Arc::clone(&uffd), Arc::clone(pages), Arc::clone(&stop), m.addr());
        let mut lz4 = lz4()?;
        std::thread::spawn(move || -> Result<()> {
            let mut serve = || -> Result<()> {
                if same_cpu {
                    pin(0)?;
                }
                let mut buf = vec![0u8; folio];
                let mut events = Vec::with_capacity(64);
                while !stop.load(Ordering::Acquire) {
                    if !uffd.wait(Some(Duration::from_millis(10)))? {
                        continue;
                    }
                    uffd.read_events_into(&mut events)?;
                    for e in &events {
                        let Event::PageFault { addr, .. } = *e else { continue };
                        let off = (addr - base) & !(folio as u64 - 1);
                        if !pages.fill(lz4.as_mut(), off as usize / PAGE_SIZE, &mut buf) {
                            bail!("a page failed to decompress");
                        }
                        // SAFETY: `buf` holds `folio` bytes; the destination
                        // lies in the registered region, which no Rust
                        // reference covers.
                        unsafe { uffd.copy(base + off, buf.as_ptr(), folio as u64, false) }?;
                    }
                }
                Ok(())
            };
            let r = serve();
            if r.is_err() {
                // The touching thread must not wait forever: unregistering
                // wakes it, and its pages are then plain zero pages, which
                // `verify` reports.
                let _ = uffd.unregister(base, len as u64);
            }
            r
        })
    };
    // The touching thread's own mask, given back after a pinned run.
    let mask = rustix::thread::sched_getaffinity(None)?;
    if same_cpu {
        pin(0)?;
    }
    let ns = touch(&m, folio, order);
    stop.store(true, Ordering::Release);
    handler.join().map_err(|_| anyhow::anyhow!("the handler thread panicked"))??;
    if same_cpu {
        rustix::thread::sched_setaffinity(None, &mask)?;
    }
    verify(&m, Corpus::sample(), "thread")?;
    Ok(ns)
}

fn sigbus(pages: &Arc<Pages>, folio: usize, order: &[usize], len: usize) -> Result<Vec<u64>> {
    let uffd = Uffd::open(OpenMode::Auto, Features::SIGBUS)?;
    let m = region(len, &uffd)?;
    let st = Box::new(SigState {
        base: m.addr(),
        len: len as u64,
        folio,
        pages: Arc::clone(pages),
        lz4: std::cell::UnsafeCell::new(lz4()?),
        buf: std::cell::UnsafeCell::new(vec![0u8; folio]),
        uffd,
        faults: AtomicU64::new(0),
        failed: AtomicBool::new(false),
    });
    let st = Box::into_raw(st);
    SIG_STATE.store(st, Ordering::Release);
    // SAFETY: an all-zero sigaction is a valid value (no handler, empty
    // mask, no flags).
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = on_sigbus as *const () as usize;
    sa.sa_flags = libc::SA_SIGINFO;
    // SAFETY: as above.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: the handler has the SA_SIGINFO signature and only does what
    // `on_sigbus` says; both structs are valid for the call.
    if unsafe { libc::sigaction(libc::SIGBUS, &sa, &mut old) } != 0 {
        bail!("sigaction(SIGBUS): {}", std::io::Error::last_os_error());
    }
    let ns = touch(&m, folio, order);
    // SAFETY: puts back the disposition saved above.
    unsafe { libc::sigaction(libc::SIGBUS, &old, std::ptr::null_mut()) };
    SIG_STATE.store(std::ptr::null_mut(), Ordering::Release);
    // SAFETY: made by Box::into_raw above; the handler is gone and no
    // touch is left that could raise it.
    let st = unsafe { Box::from_raw(st) };
    if st.failed.load(Ordering::Relaxed) {
        bail!("sigbus: a fault failed to decompress or COPY");
    }
    let faults = st.faults.load(Ordering::Relaxed) as usize;
    if faults != order.len() {
        bail!("sigbus: {faults} faults for {} folios", order.len());
    }
    verify(&m, Corpus::sample(), "sigbus")?;
    Ok(ns)
}

fn summarize(mode: &'static str, mut ns: Vec<u64>, ppf: usize) -> Mode {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() as f64 * q) as usize).min(ns.len() - 1)];
    let per = |v: f64| v / 1000.0 / ppf as f64;
    let mean = ns.iter().sum::<u64>() as f64 / ns.len() as f64;
    Mode {
        mode,
        faults: ns.len(),
        p50_us_per_4k: per(at(0.50) as f64),
        p99_us_per_4k: per(at(0.99) as f64),
        mean_us_per_4k: per(mean),
    }
}

pub fn run(args: &Args) -> Result<()> {
    let folio = args.folio_kib << 10;
    if !folio.is_power_of_two() || !(4..=2048).contains(&args.folio_kib) {
        bail!("--folio-kib must be a power of two in 4..=2048");
    }
    let len = args.mib << 20;
    if args.mib == 0 || len % folio != 0 || args.rounds == 0 {
        bail!("--mib must be a positive multiple of the folio size, and --rounds at least 1");
    }
    if !Uffd::offered(OpenMode::Auto)?.contains(Features::SIGBUS) {
        bail!("this kernel's userfaultfd does not offer UFFD_FEATURE_SIGBUS");
    }
    let c = Corpus::sample();
    let pages = Arc::new(Pages::new(c)?);
    let (mut thread, mut same, mut sig) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let order = order(len / folio, 0x9E37_79B9_7F4A_7C15 ^ round as u64);
        thread.extend(handler_thread(&pages, folio, &order, len, false)?);
        same.extend(handler_thread(&pages, folio, &order, len, true)?);
        sig.extend(sigbus(&pages, folio, &order, len)?);
    }
    let ppf = folio / PAGE_SIZE;
    let modes =
        vec![summarize("thread", thread, ppf), summarize("thread-same-cpu", same, ppf), summarize("sigbus", sig, ppf)];
    let report = Report {
        folio_kib: args.folio_kib,
        mib: args.mib,
        rounds: args.rounds,
        sigbus_vs_thread_p50: modes[2].p50_us_per_4k / modes[0].p50_us_per_4k,
        modes,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "fault service, {} KiB folios (lz4 decompress + one UFFDIO_COPY), {} rounds x {} MiB; µs per 4 KiB",
        report.folio_kib, report.rounds, report.mib
    );
    println!("{:<16} {:>8} {:>8} {:>8} {:>8}", "mode", "faults", "p50", "p99", "mean");
    for m in &report.modes {
        println!(
            "{:<16} {:>8} {:>8.2} {:>8.2} {:>8.2}",
            m.mode, m.faults, m.p50_us_per_4k, m.p99_us_per_4k, m.mean_us_per_4k
        );
    }
    println!("sigbus / thread, p50: {:.2}x", report.sigbus_vs_thread_p50);
    Ok(())
}
