//! `zmem bench soak`: threads read and write, verifying every page, a
//! managed region several times the limit, while another thread maps,
//! fills, partly unmaps, mremaps and drops regions of its own, switches the
//! compressor, forks (the child checks what it inherited, evicted pages
//! included, and changes its copy), and injects codec failures, pool
//! allocation failures, and swap-file write errors (EIO and ENOSPC).
//!
//! It prints the verified page-touches, mismatches and hangs. A hang is a
//! worker that makes no progress for `--hang-secs` (a fault nobody serves):
//! the soak then dumps every thread's state and exits with an error.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use zmem_common::PAGE_SIZE;
use zmem_compress::corpus::Corpus;
use zmem_compress::inject::FailEvery;
use zmem_compress::{CodecSpec, Sequential};
use zmem_tier::TierConfig;
use zmem_uffd::{Pager, PagerConfig, Region};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// How long to run.
    #[arg(long, default_value_t = 1.0)]
    minutes: f64,
    /// Threads reading and writing the main region.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// The pager's limit, MiB; the main region is `--region-x` times it.
    #[arg(long, default_value_t = 32)]
    limit_mib: usize,
    #[arg(long, default_value_t = 4)]
    region_x: usize,
    /// Where the swap file goes (a disk directory).
    #[arg(long, default_value = "/var/tmp")]
    swap_dir: std::path::PathBuf,
    /// A worker stuck this long is a hang.
    #[arg(long, default_value_t = 10)]
    hang_secs: u64,
    /// No chaos thread: reads and writes only.
    #[arg(long)]
    calm: bool,
    /// `PagerConfig::fault_around`, bytes: what a random fault loads of an
    /// evicted folio (0: whole folios).
    #[arg(long, default_value_t = zmem_common::defaults::FAULT_AROUND_BYTES)]
    fault_around: usize,
    /// Let the pool's share of the limit move with what misses cost
    /// (`PagerConfig::pool_balance`, as under `zmem run`), starting at 25%.
    #[arg(long)]
    pool_balance: bool,
    #[arg(long)]
    json: bool,
}

const WORDS: usize = PAGE_SIZE / 8;
/// A page dropped with MADV_DONTNEED: it reads as zeros.
const DROPPED: u32 = u32::MAX;

/// Word `i` of page `p` at version `v`: a real heap page, stamped.
fn word(c: &Corpus, p: usize, v: u32, i: usize) -> u64 {
    let src = c.page(p % c.len());
    let w = u64::from_ne_bytes(src[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    if i == 0 {
        w ^ (u64::from(v) << 32 | p as u64)
    } else {
        w
    }
}

fn write_page(c: &Corpus, r: &Region, p: usize, v: u32) {
    let w = r.words();
    for i in 0..WORDS {
        w[p * WORDS + i].store(word(c, p, v, i), Ordering::Relaxed);
    }
}

/// Words of page `p` that differ from version `v` (zeros for DROPPED).
fn check_page(c: &Corpus, r: &Region, p: usize, v: u32) -> u64 {
    let w = &r.words()[p * WORDS..(p + 1) * WORDS];
    let bad = if v == DROPPED {
        w.iter().filter(|x| x.load(Ordering::Relaxed) != 0).count()
    } else {
        w.iter().enumerate().filter(|(i, x)| x.load(Ordering::Relaxed) != word(c, p, v, *i)).count()
    };
    bad as u64
}

#[derive(Debug, Default)]
struct Totals {
    touches: AtomicU64,
    mismatches: AtomicU64,
    chaos_rounds: AtomicU64,
    forks: AtomicU64,
}

/// Every thread's name, kernel wait channel and (as root) kernel stack.
fn dump_threads() -> String {
    let mut out = String::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return out };
    for t in dir.flatten() {
        let p = t.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        out +=
            &format!("thread {} ({}): wchan {}\n", t.file_name().to_string_lossy(), read("comm").trim(), read("wchan"));
        for l in read("stack").lines().take(8) {
            out += &format!("    {l}\n");
        }
    }
    out
}

pub fn run(args: &Args) -> Result<()> {
    if args.threads == 0 || args.threads > 64 {
        bail!("--threads must be in 1..=64");
    }
    zmem_settings::check_swapfile_dir(&args.swap_dir)?;
    let c = Corpus::sample();
    let limit = args.limit_mib << 20;
    let mut cfg = PagerConfig::with_limit(limit);
    cfg.keep_on_fork = true;
    cfg.fault_around = args.fault_around;
    cfg.pool_balance = args.pool_balance.then_some(zmem_common::defaults::POOL_BALANCE_PERCENT);
    cfg.tier = TierConfig { memory_budget: limit, max_pool_percent: 25, ..TierConfig::default() }
        .with_swap_dir(args.swap_dir.clone(), true);
    let pager = Arc::new(Pager::new(cfg)?);
    let region = Arc::new(pager.map(args.region_x * limit)?);
    let pages = region.len() / PAGE_SIZE;
    let versions: Arc<Vec<AtomicU32>> = Arc::new((0..pages).map(|_| AtomicU32::new(0)).collect());
    let totals = Arc::new(Totals::default());
    let stop = Arc::new(AtomicBool::new(false));
    let progress: Arc<Vec<AtomicU64>> = Arc::new((0..args.threads).map(|_| AtomicU64::new(0)).collect());
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(args.minutes * 60.0);
    let mut hung = None;
    std::thread::scope(|s| {
        for t in 0..args.threads {
            let (region, versions, totals, stop, progress) = (&region, &versions, &totals, &stop, &progress);
            let n = args.threads;
            s.spawn(move || {
                let mut x = (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let mut since = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // A skewed choice: a hot tenth takes most touches.
                    let span = if x % 4 != 0 { pages / 10 } else { pages };
                    let pg = ((x as usize >> 8) % (span / n).max(1)) * n + t;
                    let v = versions[pg].load(Ordering::Relaxed);
                    if x % 97 == 0 && v != 0 {
                        let a = region.addr() as usize + pg * PAGE_SIZE;
                        // SAFETY: one page of our region, reached only
                        // through atomics; this thread owns it.
                        let r =
                            unsafe { rustix::mm::madvise(a as *mut _, PAGE_SIZE, rustix::mm::Advice::LinuxDontNeed) };
                        if r.is_ok() {
                            versions[pg].store(DROPPED, Ordering::Relaxed);
                        }
                    } else if x & 3 == 0 || v == 0 {
                        let nv = if v == DROPPED { 1 } else { v.wrapping_add(1).max(1) };
                        write_page(c, region, pg, nv);
                        versions[pg].store(nv, Ordering::Relaxed);
                    } else {
                        let bad = check_page(c, region, pg, v);
                        if bad > 0 {
                            totals.mismatches.fetch_add(1, Ordering::Relaxed);
                            eprintln!("soak: page {pg} version {v}: {bad} words differ");
                        }
                    }
                    since += 1;
                    if since == 64 {
                        totals.touches.fetch_add(since, Ordering::Relaxed);
                        progress[t].fetch_add(since, Ordering::Relaxed);
                        since = 0;
                    }
                }
                totals.touches.fetch_add(since, Ordering::Relaxed);
            });
        }
        if !args.calm {
            let (pager, totals, stop) = (&pager, &totals, &stop);
            s.spawn(move || chaos(c, pager, totals, stop));
        }
        // The watchdog and the clock.
        let mut last: Vec<(u64, Instant)> = (0..args.threads).map(|_| (0, Instant::now())).collect();
        let mut next_report = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
            for (t, l) in last.iter_mut().enumerate() {
                let p = progress[t].load(Ordering::Relaxed);
                if p != l.0 {
                    *l = (p, Instant::now());
                } else if l.1.elapsed() > Duration::from_secs(args.hang_secs) {
                    hung = Some(format!(
                        "worker {t} made no progress for {} s\n{:?}\n{}",
                        args.hang_secs,
                        pager.stats(),
                        dump_threads()
                    ));
                }
            }
            if hung.is_some() {
                break;
            }
            if !args.json && Instant::now() >= next_report {
                next_report += Duration::from_secs(10);
                let tt = totals.touches.load(Ordering::Relaxed);
                eprintln!("soak: {:>5.0} s, {tt} verified page-touches", t0.elapsed().as_secs_f64());
            }
        }
        if let Some(h) = &hung {
            // A hung fault never returns: report and leave.
            eprintln!("soak: HANG\n{h}");
            let _ = std::io::stderr().flush();
            std::process::exit(3);
        }
        stop.store(true, Ordering::Relaxed);
    });
    // A last full pass: every page as it should be.
    for pg in 0..pages {
        let v = versions[pg].load(Ordering::Relaxed);
        if v != 0 && check_page(c, &region, pg, v) > 0 {
            totals.mismatches.fetch_add(1, Ordering::Relaxed);
            eprintln!("soak: page {pg} version {v} wrong in the final pass");
        }
    }
    totals.touches.fetch_add(pages as u64, Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    let (touches, mismatches) = (totals.touches.load(Ordering::Relaxed), totals.mismatches.load(Ordering::Relaxed));
    let ps = pager.stats();
    let ts = pager.tier().stats();
    let report = serde_json::json!({
        "seconds": secs,
        "verified_page_touches": touches,
        "touches_per_sec": touches as f64 / secs,
        "mismatches": mismatches,
        "hangs": 0,
        "chaos_rounds": totals.chaos_rounds.load(Ordering::Relaxed),
        "forks": totals.forks.load(Ordering::Relaxed),
        "evicted_folios": ps.evicted_folios,
        "load_faults": ps.load_faults,
        "eviction_rejects": ps.eviction_rejects,
        "written_back_pages": ts.written_back_pages,
        "reject_reclaim_fail": ts.reject_reclaim_fail,
        "reject_compress_fail": ts.reject_compress_fail,
        "reject_alloc_fail": ts.reject_alloc_fail,
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "soak: {secs:.0} s, {touches} verified page-touches ({:.0}/s), {mismatches} mismatches, 0 hangs, \
             {} chaos rounds, {} forks",
            touches as f64 / secs,
            totals.chaos_rounds.load(Ordering::Relaxed),
            totals.forks.load(Ordering::Relaxed)
        );
        println!(
            "      evicted {} folios, loaded {}, {} rejected, {} pages fenced; {} pages written back, \
             {} writeback failures, {} injected codec failures, {} allocation failures",
            ps.evicted_folios,
            ps.load_faults,
            ps.eviction_rejects,
            ps.fenced_pages,
            ts.written_back_pages,
            ts.reject_reclaim_fail,
            ts.reject_compress_fail,
            ts.reject_alloc_fail
        );
    }
    if mismatches > 0 {
        bail!("{mismatches} pages read back wrong");
    }
    Ok(())
}

/// Regions of its own (fill, partial munmap, mremap, drop), compressor
/// switches, injected codec failures and swap write errors, round after
/// round.
fn chaos(c: &Corpus, pager: &Pager, totals: &Totals, stop: &AtomicBool) {
    let mut round = 0u32;
    while !stop.load(Ordering::Relaxed) {
        round += 1;
        let tier = pager.tier();
        match round % 4 {
            0 => {
                let spec: CodecSpec = if round % 8 == 0 { "zstd:1" } else { "lz4" }.parse().expect("a codec");
                if let Err(e) = tier.set_compressor(spec) {
                    eprintln!("soak: switching the compressor: {e}");
                }
            }
            1 => {
                let spec: CodecSpec = "lz4".parse().expect("a codec");
                match Sequential::new(spec.factory(), 8) {
                    Ok(inner) => {
                        let _ = tier.set_batch_compressor(Arc::new(FailEvery::new(inner, 53)));
                    }
                    Err(e) => eprintln!("soak: {e}"),
                }
            }
            2 => {
                if let Some(sf) = tier.swap_file() {
                    // EIO and ENOSPC in turn: writeback fails, entries stay.
                    sf.inject_write_errors(4, round % 8 == 2);
                }
            }
            _ => tier.inject_alloc_failures(6),
        }
        let Ok(b) = pager.map(4 << 20) else { continue };
        let n = b.len() / PAGE_SIZE;
        let v = 1000 + round;
        for pg in 0..n {
            write_page(c, &b, pg, v);
        }
        if round % 16 == 5 {
            fork_check(c, pager, &b, v, totals);
        }
        if round % 2 == 0 {
            // The program unmaps the second half: the first stays intact.
            let half = b.addr() as usize + b.len() / 2;
            // SAFETY: the second half of region b, which nothing touches
            // from here on (b is dropped below).
            let _ = unsafe { rustix::mm::munmap(half as *mut _, b.len() / 2) };
        } else {
            // The whole region moves; the pager follows the REMAP event.
            if let Ok(target) = zmem_uffd::Mapping::new(b.len()) {
                let to = target.addr();
                std::mem::forget(target);
                // SAFETY: moves our region b (reached only through atomics)
                // over our own forgotten target range.
                let r = unsafe {
                    rustix::mm::mremap_fixed(
                        b.addr() as *mut _,
                        b.len(),
                        b.len(),
                        rustix::mm::MremapFlags::MAYMOVE,
                        to as *mut _,
                    )
                };
                if r.is_ok() {
                    let deadline = Instant::now() + Duration::from_secs(5);
                    while b.addr() != to && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        }
        let upto = if round % 2 == 0 { n / 2 } else { n };
        for pg in 0..upto {
            let bad = check_page(c, &b, pg, v);
            if bad > 0 {
                totals.mismatches.fetch_add(1, Ordering::Relaxed);
                eprintln!("soak: chaos region page {pg}: {bad} words differ");
            }
        }
        totals.touches.fetch_add((n + upto) as u64, Ordering::Relaxed);
        drop(b);
        totals.chaos_rounds.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// fork while the workers run: the child must see region `b` at version
/// `v` (its evicted pages included), and what it writes stays its own (the
/// parent checks `b` at `v` afterwards).
fn fork_check(c: &Corpus, pager: &Pager, b: &Region, v: u32, totals: &Totals) {
    let n = b.len() / PAGE_SIZE;
    pager.fork_prepare();
    // SAFETY: the child reads and writes region b through atomics, takes no
    // lock, touches nothing of the pager's, and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let mut bad = 0;
        for pg in 0..n {
            bad += check_page(c, b, pg, v);
            write_page(c, b, pg, v + 7);
            bad += check_page(c, b, pg, v + 7);
        }
        // SAFETY: ends the child at once, running nothing of the parent's.
        unsafe { libc::_exit(i32::from(bad != 0)) };
    }
    pager.fork_parent();
    if pid < 0 {
        eprintln!("soak: fork failed: {}", std::io::Error::last_os_error());
        return;
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    if r != pid || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        totals.mismatches.fetch_add(1, Ordering::Relaxed);
        eprintln!("soak: a forked child saw its inherited region wrong (status {status:#x})");
    }
    totals.forks.fetch_add(1, Ordering::Relaxed);
}
