//! `zmem compare --limit L -- CMD`: any program three ways, one after the
//! other: as is (`native`), under `zmem run --limit L`, and under the
//! kernel's zswap (a cgroup v1 limit of L, a swap file, zswap on; all of it
//! restored afterwards, as `zmem usemem` does). It prints each run's time
//! and peak footprint side by side, as a table and as JSON.
//!
//! The kernel's run has swap read-ahead off (`vm.page-cluster` 0, as
//! distributions set it for compressed swap; `--page-cluster`): with the
//! default of 3, each swap-in from zswap brings 8 pages into the swap cache,
//! charged to the cgroup, and a program paging its working set under a
//! cgroup v1 limit was OOM-killed (Python's strings under 150M, every run;
//! with 0 it finished in 6.4 s). A run the kernel's OOM killer ended in the
//! cgroup fails, whatever the program's exit status (a script whose server
//! was killed may still exit 0).
//!
//! zmem's runs show the program their limit as its machine's memory (`zmem
//! run --show-limit`), as the kernel's cgroup shows it its own: a program
//! that sizes itself from the memory it sees must size itself the same way
//! in both. DuckDB takes 80% of what it sees for its buffer manager: 240 MiB
//! in a 300M cgroup, 18.8 GiB under zmem without the flag, where its 8M-row
//! join then paged through the limit in 65 s against the kernel's 9.0 s;
//! with it, 6.9 s.
//!
//! With `--swap` the kernel runs the program once more with zswap off (the
//! `swap` row, and a `vs swap` ratio for every run): a baseline where the
//! cgroup's OOM killer ends zswap's run. Under cgroup v1 here, four of five
//! zswap runs of `scripts/redis-digest 1000000 100` (a 182 MiB dataset), at
//! limits from 48M to 128M and with `vm.page-cluster` 0 or 3, were killed
//! in 1-4 s, in the charge of a swap-in; plain swap finished under 128M in
//! 40-44 s.
//!
//! With `--equal-footprint` a fourth run follows the kernel's: zmem again,
//! with its limit moved by the difference between the two footprints, so
//! that it has the memory the kernel took. Equal limits are not equal
//! memory: zmem's limit holds its pool, and cgroup v1 does not charge the
//! kernel's, so at one limit the kernel uses more (Python's strings under
//! 150M: 186 MiB against zmem's 151 MiB).
//!
//! With `--max-slowdown P%` a last run follows: zmem with the limit moved
//! by its controller (`zmem run --max-slowdown`, `--limit` its ceiling if
//! given; without `--limit`, only the native run comes before it). A line
//! under the table gives its time over native's and its footprint against
//! native's, averaged over the run's time and at the peak: what the
//! controller saved, and what it cost.
//!
//! Footprint is the program's anonymous and shared memory, measured the
//! same way for every run: the peak of the process tree's summed
//! `Pss_Anon` and `Pss_Shmem`, sampled every 20 ms (`Sampler`), plus, for
//! the kernel's run, zswap's
//! `pool_total_size` sampled with it (cgroup v1 does not charge the pool to
//! the cgroup). PSS shares each page among the processes that
//! map it, so pages a fork left shared count once, as the cgroup counts
//! them; summed RSS counted them once per process (redis's BGSAVE child
//! doubled its footprint). zmem's pool and metadata are anonymous memory of
//! its processes; its swap file is written with O_DIRECT, so it holds no
//! page cache. Shared memory (a memfd, `/dev/shm`, `MAP_SHARED |
//! MAP_ANONYMOUS`) counts because the cgroup charges it and zmem does not
//! manage it: the JVM's ZGC keeps its heap in a memfd, and under `--limit
//! 300M` it ran in 5.0 s at 834 MiB where the kernel's cgroup held it to
//! 300M (664 MiB with the pool) and took 84 s; with anonymous memory alone
//! zmem's footprint read 97 MiB. File pages (the program's binary and libraries) are left
//! out: the cgroup charges them only to the first group that reads them
//! in, so they came and went from the kernel's figure with what an earlier
//! run had cached (redis-server's text and its `redis-cli` children's: 8-14
//! MiB). JSON has each run's whole PSS too, and the kernel's cgroup peak
//! (`memory.max_usage_in_bytes`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use zmem_common::procfs::kb_field;

use crate::usemem::kernel::{debugfs_zswap, vmstat, KernelSetup};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The memory limit for zmem and for the kernel's cgroup (K, M, G).
    /// With `--max-slowdown`, the controller's ceiling too.
    #[arg(long, required_unless_present = "max_slowdown")]
    limit: Option<String>,
    /// Run the program under `zmem run --max-slowdown P%` too (after the
    /// others): the footprint it saved against native, time-averaged and
    /// at the peak, and its slowdown. Without `--limit`, only native and
    /// this run.
    #[arg(long, value_name = "PERCENT")]
    max_slowdown: Option<String>,
    /// The kernel's zswap compressor.
    #[arg(long, default_value = "lzo")]
    zswap: String,
    /// Where both swap files go (a disk directory).
    #[arg(long, default_value = "/var/tmp")]
    swap_dir: PathBuf,
    /// The kernel's swap file size (default: 8 times the limit, at least 1G).
    #[arg(long)]
    swap_size: Option<String>,
    /// The kernel's swap read-ahead for its run, `vm.page-cluster`
    /// (2^N pages a swap-in), restored afterwards.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=10))]
    page_cluster: u32,
    /// Skip the kernel run (it needs root, cgroup v1 and zswap).
    #[arg(long, conflicts_with_all = ["equal_footprint", "swap"])]
    no_kernel: bool,
    /// After zswap's run, run the program under the kernel once more with
    /// zswap off (plain swap to the same kind of file, under the same
    /// cgroup limit): the `swap` row, and a `vs swap` ratio per run.
    #[arg(long)]
    swap: bool,
    /// After the kernel's run, run zmem once more with the kernel's
    /// footprint: its limit moved by the difference between the kernel's
    /// peak footprint and its own at `--limit`.
    #[arg(long)]
    equal_footprint: bool,
    #[arg(long)]
    json: bool,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    cmd: Vec<std::ffi::OsString>,
}

/// One run of the program.
#[derive(Debug, serde::Serialize)]
struct Outcome {
    config: String,
    elapsed_s: f64,
    peak_footprint_bytes: u64,
    /// The footprint averaged over the run's time.
    avg_footprint_bytes: u64,
    /// The peak of the tree's whole PSS, file pages included.
    peak_pss_bytes: u64,
    /// The program's own pages in memory: the footprint less the pool, and
    /// for zmem less its metadata too (`Own`), at the peak and averaged over
    /// the run's time.
    peak_resident_bytes: u64,
    avg_resident_bytes: u64,
    /// The kernel's run: the cgroup's `memory.max_usage_in_bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    cgroup_peak_bytes: Option<u64>,
    /// Pages brought back from the pool or the swap file: zswap's and
    /// swap's `zswpin` + `pswpin` from /proc/vmstat over the kernel's run,
    /// zmem's the same counters summed over its processes' stats files
    /// (`Loads`). None for the native run.
    #[serde(skip_serializing_if = "Option::is_none")]
    loads: Option<u64>,
    exit_ok: bool,
    exit_status: String,
}

pub fn run(args: &Args) -> Result<()> {
    // Bad values are refused here, before anything runs.
    let slowdown = args
        .max_slowdown
        .as_deref()
        .map(|p| zmem_settings::parse_slowdown("--max-slowdown", p))
        .transpose()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let Some(limit_text) = args.limit.as_deref() else {
        let slowdown = slowdown.context("--limit or --max-slowdown")?;
        return run_controlled_only(args, slowdown);
    };
    let limit = zmem_settings::parse_size(limit_text).map_err(|e| anyhow::anyhow!("--limit: {e}"))?;
    if limit < zmem_settings::Settings::MIN_LIMIT {
        // zmem run would refuse it only after the native run.
        bail!(
            "--limit {}: at least {}M (the smallest limit zmem run takes)",
            limit_text,
            zmem_settings::Settings::MIN_LIMIT >> 20
        );
    }
    zmem_settings::check_swapfile_dir(&args.swap_dir)?;
    let swap_bytes = match &args.swap_size {
        Some(s) => zmem_settings::parse_size(s).map_err(|e| anyhow::anyhow!("--swap-size: {e}"))?,
        None => (limit * 8).max(1 << 30),
    };
    let mut out = Vec::new();
    let mut native = Command::new(&args.cmd[0]);
    native.args(&args.cmd[1..]);
    out.push(measure("native", native, &Own::Nothing)?);

    let zmem = |config: &str, limit: &str| zmem_run(args, config, &["--limit", limit]);
    out.push(zmem("zmem", limit_text)?);

    if !args.no_kernel {
        out.push(kernel_run(args, Some(&args.zswap), limit, swap_bytes)?);
        if args.swap {
            out.push(kernel_run(args, None, limit, swap_bytes)?);
        } else if !out[2].exit_ok && out[2].exit_status.contains("OOM killer") {
            eprintln!(
                "zmem compare: the OOM killer ended the kernel's zswap run; `--swap` adds a run with zswap off \
                 (under cgroup v1, zswap's runs of redis below its dataset were OOM-killed where plain swap finished)"
            );
        }
    }
    if args.equal_footprint {
        let (z, k) = (&out[1], &out[2]);
        if !(z.exit_ok && k.exit_ok) {
            eprintln!("zmem compare: no run at the kernel's footprint: the runs at --limit did not both finish well");
        } else {
            let matched = equal_footprint_limit(limit as u64, z.peak_footprint_bytes, k.peak_footprint_bytes);
            let mib = format!("{}M", matched >> 20);
            out.push(zmem(&format!("zmem@{mib}"), &mib)?);
        }
    }
    if let Some(p) = slowdown {
        out.push(zmem_run(args, &format!("zmem:{p}%"), &["--limit", limit_text, "--max-slowdown", &format!("{p}%")])?);
    }
    report(&out, args.json);
    if let Some(bad) = out.iter().find(|o| !o.exit_ok) {
        bail!("the program failed under {} ({})", bad.config, bad.exit_status);
    }
    Ok(())
}

/// `--max-slowdown` without `--limit`: the program natively and under the
/// controller, with the machine's memory as its ceiling.
fn run_controlled_only(args: &Args, slowdown: f64) -> Result<()> {
    let mut native = Command::new(&args.cmd[0]);
    native.args(&args.cmd[1..]);
    let mut out = vec![measure("native", native, &Own::Nothing)?];
    out.push(zmem_run(args, &format!("zmem:{slowdown}%"), &["--max-slowdown", &format!("{slowdown}%")])?);
    report(&out, args.json);
    if let Some(bad) = out.iter().find(|o| !o.exit_ok) {
        bail!("the program failed under {} ({})", bad.config, bad.exit_status);
    }
    Ok(())
}

/// The program under `zmem run` with `flags`, its loads counted.
fn zmem_run(args: &Args, config: &str, flags: &[&str]) -> Result<Outcome> {
    let me = std::env::current_exe().context("the zmem binary")?;
    let loads = Loads::zmem()?;
    let mut c = Command::new(&me);
    c.arg("run").args(flags).args(["--show-limit", "--swapfile"]).arg(&args.swap_dir).arg("--").args(&args.cmd);
    loads.set_env(&mut c);
    let mut o = measure(config, c, &Own::Zmem(&loads, std::cell::Cell::new(None)))?;
    o.loads = loads.count();
    Ok(o)
}

/// The program under the kernel: a cgroup v1 limit of `limit`, a swap file
/// of `swap_bytes`, and zswap with `zswap` as its compressor, or off
/// (`None`: plain swap, the `swap` row); all of it restored before this
/// returns. A run the OOM killer ended in the cgroup fails.
fn kernel_run(args: &Args, zswap: Option<&str>, limit: usize, swap_bytes: usize) -> Result<Outcome> {
    let mut setup = KernelSetup::new(zswap, limit, swap_bytes, &args.swap_dir)?;
    setup.set_page_cluster(args.page_cluster)?;
    let procs = setup.cgroup_procs().context("the kernel run's cgroup")?;
    // Only the child joins the cgroup; this process stays outside it.
    let mut k = Command::new("sh");
    k.arg("-c").arg(format!("echo $$ > '{}' && exec \"$@\"", procs.display())).arg("sh").args(&args.cmd);
    let name = zswap.map_or("swap".to_string(), |c| format!("kernel:{c}"));
    let loads = Loads::kernel();
    let own = if zswap.is_some() { Own::Zswap } else { Own::Nothing };
    let mut o = measure(&name, k, &own)?;
    o.loads = loads.count();
    o.cgroup_peak_bytes = setup
        .cgroup
        .as_ref()
        .and_then(|cg| std::fs::read_to_string(cg.join("memory.max_usage_in_bytes")).ok())
        .and_then(|s| s.trim().parse::<u64>().ok());
    let kills = setup.oom_kills();
    if kills > 0 {
        o.exit_ok = false;
        o.exit_status = format!("{}; the OOM killer killed {kills} in the cgroup", o.exit_status);
    }
    Ok(o)
}

/// How often the processes of a zmem run write their stats files.
const STATS_INTERVAL: Duration = Duration::from_millis(200);

/// What of a run's footprint is the pager's own, not the program's pages.
enum Own<'a> {
    /// A native or plain-swap run: nothing.
    Nothing,
    /// The kernel's zswap: its pool (`pool_total_size`), outside the
    /// program's page tables and added to its footprint.
    Zswap,
    /// zmem: the pool and the metadata of each live process, from the
    /// stats files of the run (`Loads::StatsDir`); they are anonymous
    /// memory of the program's processes, so already in the sampled
    /// footprint. The files are written every 200 ms, and read as often:
    /// the last sum and when it was read.
    Zmem(&'a Loads, std::cell::Cell<Option<(Instant, u64)>>),
}

impl Own<'_> {
    /// (bytes to add to the sampled anonymous and shared pages for the
    /// footprint, bytes of the footprint that are not the program's pages).
    fn sample(&self) -> (u64, u64) {
        match self {
            Own::Nothing => (0, 0),
            Own::Zswap => {
                let pool = debugfs_zswap("pool_total_size");
                (pool, pool)
            }
            Own::Zmem(loads, last) => match last.get().filter(|(at, _)| at.elapsed() < STATS_INTERVAL) {
                Some((_, own)) => (0, own),
                None => {
                    let own = loads.sum_live(stats_file_own_bytes);
                    last.set(Some((Instant::now(), own)));
                    (0, own)
                }
            },
        }
    }
}

/// Runs `cmd` to the end, sampling the footprint every 20 ms: the process
/// tree's anonymous and shared PSS (`Sampler`), plus zswap's pool for a
/// kernel run. The program's resident pages are that footprint less what
/// `own` says is the pager's.
fn measure(config: &str, mut cmd: Command, own: &Own<'_>) -> Result<Outcome> {
    // The program's output goes to stderr: stdout is the report's.
    cmd.stdout(std::io::stderr());
    let t0 = Instant::now();
    let mut child = cmd.spawn().with_context(|| format!("start the program ({config})"))?;
    let root = child.id();
    let (mut peak, mut peak_pss, mut peak_resident) = (0u64, 0u64, 0u64);
    // The integrals over time (byte-seconds) of the footprint and of the
    // resident pages, each sample held until the next.
    let (mut area, mut resident_area, mut last) = (0f64, 0f64, None::<(Instant, u64, u64)>);
    let mut sampler = Sampler::new(root);
    let status: ExitStatus = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        let m = sampler.sample();
        let (pool, pagers) = own.sample();
        let now = Instant::now();
        let footprint = m.anon + m.shmem + pool;
        let resident = footprint.saturating_sub(pagers);
        peak_resident = peak_resident.max(resident);
        if let Some((t, f, r)) = last {
            let held = now.duration_since(t).as_secs_f64();
            area += f as f64 * held;
            resident_area += r as f64 * held;
        }
        last = Some((now, footprint, resident));
        peak = peak.max(footprint);
        peak_pss = peak_pss.max(m.all + pool);
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed_s = t0.elapsed().as_secs_f64();
    if let Some((t, f, r)) = last {
        let held = t.elapsed().as_secs_f64();
        area += f as f64 * held;
        resident_area += r as f64 * held;
    }
    let avg = |a: f64| if elapsed_s > 0.0 { (a / elapsed_s) as u64 } else { 0 };
    Ok(Outcome {
        config: config.to_string(),
        elapsed_s,
        peak_footprint_bytes: peak,
        avg_footprint_bytes: avg(area),
        peak_pss_bytes: peak_pss,
        peak_resident_bytes: peak_resident,
        avg_resident_bytes: avg(resident_area),
        cgroup_peak_bytes: None,
        loads: None,
        exit_ok: status.success(),
        exit_status: status.to_string(),
    })
}

/// Counts a run's loads: pages brought back from a compressed pool or a
/// swap file, the work a program pays for at a limit. With the run's
/// elapsed time over native's, they split the slowdown into how many loads
/// and what each cost (`report`'s `us/load`).
enum Loads {
    /// The kernel's: `/proc/vmstat` before the run (the machine's counters;
    /// nothing else should page meanwhile).
    Vmstat(u64),
    /// zmem's: a directory for the run's stats files (`ZMEM_STATS_DIR`),
    /// whose processes each leave their last counters there; removed once
    /// read.
    StatsDir(PathBuf),
}

impl Loads {
    fn kernel() -> Self {
        Loads::Vmstat(vmstat("zswpin") + vmstat("pswpin"))
    }

    fn zmem() -> Result<Self> {
        static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("zmem-compare-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).with_context(|| format!("stats directory {}", dir.display()))?;
        // Sticky and open to all, as /tmp is: a program that changes its
        // user (PostgreSQL's `runuser`) still leaves its counters.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o1777))?;
        Ok(Loads::StatsDir(dir))
    }

    fn set_env(&self, c: &mut Command) {
        if let Loads::StatsDir(dir) = self {
            // Each process writes its file last as it exits; every 200 ms
            // too, for one that ends without exit(3).
            c.env("ZMEM_STATS_DIR", dir).env("ZMEM_STATS_INTERVAL_MS", STATS_INTERVAL.as_millis().to_string());
        }
    }

    fn count(&self) -> Option<u64> {
        match self {
            Loads::Vmstat(before) => Some((vmstat("zswpin") + vmstat("pswpin")).saturating_sub(*before)),
            Loads::StatsDir(_) => Some(self.sum(stats_file_loads, |_| true)),
        }
    }

    /// `of` the stats files of the run's processes still alive, summed: a
    /// process that exited left its last counters, not its memory.
    fn sum_live(&self, of: fn(&str) -> u64) -> u64 {
        self.sum(of, |pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
    }

    /// `of` each stats file in the run's directory whose process `take`s,
    /// summed (0 for the kernel's).
    fn sum(&self, of: fn(&str) -> u64, take: impl Fn(u32) -> bool) -> u64 {
        let Loads::StatsDir(dir) = self else { return 0 };
        let Ok(files) = std::fs::read_dir(dir) else { return 0 };
        files
            .flatten()
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_str().filter(|n| n.starts_with("zmem-"));
                name.and_then(zmem_common::stats_files::owner).is_some_and(&take)
            })
            .filter_map(|e| std::fs::read_to_string(e.path()).ok())
            .map(|t| of(&t))
            .sum()
    }
}

impl Drop for Loads {
    fn drop(&mut self) {
        if let Loads::StatsDir(dir) = self {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// What one stats file's process holds of zmem's own: the tier's memory
/// (`tier.memory_bytes`: the pool, its free pages and the tier's tables) and
/// the pager's folio tables and reclaim lists (0 if it has none).
fn stats_file_own_bytes(json: &str) -> u64 {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else { return 0 };
    let get = |a: &str, b: &str| v[a][b].as_u64().unwrap_or(0);
    get("tier", "memory_bytes")
        + get("pager", "metadata_folio_table_bytes")
        + get("pager", "metadata_reclaim_list_bytes")
}

/// `tier.zswpin` + `tier.pswpin` of one stats file (0 if it has none).
fn stats_file_loads(json: &str) -> u64 {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else { return 0 };
    ["zswpin", "pswpin"].iter().filter_map(|k| v["tier"][k].as_u64()).sum()
}

/// A process tree's memory, bytes: all of it, its anonymous pages and its
/// shared memory (shmem: memfds, `/dev/shm`, shared anonymous mappings).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Pss {
    all: u64,
    anon: u64,
    shmem: u64,
}

/// Samples a process tree's PSS without slowing it down. `smaps_rollup`
/// walks a process's page tables under its mmap lock (4 ms for a JVM with a
/// 1 GiB heap): read every 20 ms, it took a fifth of a CPU and made zmem's
/// runs of the JVM and of Python's strings 8-18% slower than the same
/// command alone. So each sample reads the O(1) counters of
/// `/proc/PID/status` (`VmRSS`, `RssAnon`) and scales them by PSS over RSS
/// as the rollups gave it at most a second ago (pages a fork shares count
/// once, and a memfd the JVM maps three times counts once); the tree's
/// members are listed again every 200 ms.
struct Sampler {
    root: u32,
    members: Vec<u32>,
    listed_at: Option<Instant>,
    /// PSS over RSS, of file pages, of anonymous ones and of shmem ones, at
    /// `scaled_at`.
    scale: (f64, f64, f64),
    scaled_at: Option<Instant>,
}

impl Sampler {
    fn new(root: u32) -> Self {
        Sampler { root, members: Vec::new(), listed_at: None, scale: (1.0, 1.0, 1.0), scaled_at: None }
    }

    fn sample(&mut self) -> Pss {
        let due = |at: Option<Instant>, every: Duration| at.is_none_or(|t| t.elapsed() >= every);
        if due(self.listed_at, Duration::from_millis(200)) {
            self.members = tree_members(self.root);
            self.listed_at = Some(Instant::now());
        }
        let each: Vec<(u32, Pss)> = self.members.iter().filter_map(|&p| Some((p, rss_of(p)?))).collect();
        let rss = each.iter().fold(Pss::default(), |sum, (_, r)| sum.add(*r));
        if due(self.scaled_at, Duration::from_secs(1)) {
            // Over the members whose rollup reads too (not one that exits
            // meanwhile).
            let both = each.iter().filter_map(|&(p, r)| Some((pss_of(p)?, r)));
            let (pss, r) = both.fold((Pss::default(), Pss::default()), |(a, b), (p, r)| (a.add(p), b.add(r)));
            let ratio = |p: u64, r: u64| if r == 0 { 1.0 } else { (p as f64 / r as f64).min(1.0) };
            self.scale = (ratio(pss.file(), r.file()), ratio(pss.anon, r.anon), ratio(pss.shmem, r.shmem));
            self.scaled_at = Some(Instant::now());
        }
        let anon = (rss.anon as f64 * self.scale.1) as u64;
        let shmem = (rss.shmem as f64 * self.scale.2) as u64;
        Pss { all: anon + shmem + (rss.file() as f64 * self.scale.0) as u64, anon, shmem }
    }
}

impl Pss {
    fn add(self, o: Pss) -> Pss {
        Pss { all: self.all + o.all, anon: self.anon + o.anon, shmem: self.shmem + o.shmem }
    }

    /// File pages: what is neither anonymous nor shmem.
    fn file(self) -> u64 {
        self.all.saturating_sub(self.anon + self.shmem)
    }
}

/// `root` and all its descendants (from /proc).
fn tree_members(root: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return vec![root] };
    let mut parent: HashMap<u32, u32> = HashMap::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        let Some(ppid) = zmem_common::procfs::stat_field(&stat, 4).and_then(|p| p.parse().ok()) else { continue };
        parent.insert(pid, ppid);
    }
    let in_tree = |mut p: u32| {
        for _ in 0..64 {
            if p == root {
                return true;
            }
            match parent.get(&p) {
                Some(&pp) if pp != 0 => p = pp,
                _ => return false,
            }
        }
        false
    };
    parent.keys().copied().filter(|&p| in_tree(p)).collect()
}

/// A process's RSS, all pages, anonymous ones and shmem ones, from
/// `/proc/PID/status`.
fn rss_of(pid: u32) -> Option<Pss> {
    let t = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some(Pss { all: kb_field(&t, "VmRSS:")?, anon: kb_field(&t, "RssAnon:")?, shmem: kb_field(&t, "RssShmem:")? })
}

/// A process's PSS, all pages, anonymous ones and shmem ones, from its
/// `smaps_rollup`.
fn pss_of(pid: u32) -> Option<Pss> {
    parse_rollup(&std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?)
}

/// `Pss`, `Pss_Anon` and `Pss_Shmem` from a `smaps_rollup`.
fn parse_rollup(t: &str) -> Option<Pss> {
    Some(Pss { all: kb_field(t, "Pss:")?, anon: kb_field(t, "Pss_Anon:")?, shmem: kb_field(t, "Pss_Shmem:")? })
}

/// The limit that gives zmem the kernel's footprint: `limit`, moved by the
/// difference between the kernel's peak footprint and zmem's at `limit`
/// (what zmem holds outside its limit, its binary and the shim, stays the
/// same), in whole MiB and at least the smallest limit `zmem run` takes.
pub(crate) fn equal_footprint_limit(limit: u64, zmem_footprint: u64, kernel_footprint: u64) -> u64 {
    let l = (limit + kernel_footprint).saturating_sub(zmem_footprint);
    (l >> 20 << 20).max(zmem_settings::Settings::MIN_LIMIT as u64)
}

/// How many times faster than the kernel's zswap run `o` was: none unless
/// both finished well (a run killed early is quick, not fast).
fn vs_kernel(out: &[Outcome], o: &Outcome) -> Option<f64> {
    vs(out, o, |b| b.config.starts_with("kernel"))
}

/// The same against the plain swap run (`--swap`).
fn vs_swap(out: &[Outcome], o: &Outcome) -> Option<f64> {
    vs(out, o, |b| b.config == "swap")
}

/// How many times faster than the first run `base` picks `o` was, where
/// both finished well.
fn vs(out: &[Outcome], o: &Outcome, base: impl Fn(&Outcome) -> bool) -> Option<f64> {
    let b = out.iter().find(|b| base(b))?;
    (b.exit_ok && o.exit_ok).then(|| b.elapsed_s / o.elapsed_s)
}

/// Microseconds of the run's time over native's, per load: what a load
/// cost the program all in (the fault, the decompression, the reclaim
/// that made room), where the run had loads and both finished well.
fn us_per_load(out: &[Outcome], o: &Outcome) -> Option<f64> {
    let native = out.iter().find(|n| n.config == "native")?;
    let loads = o.loads.filter(|&l| l > 0)?;
    (native.exit_ok && o.exit_ok).then(|| (o.elapsed_s - native.elapsed_s).max(0.0) * 1e6 / loads as f64)
}

fn report(out: &[Outcome], json: bool) {
    let swap = out.iter().any(|o| o.config == "swap");
    if json {
        let rows: Vec<serde_json::Value> = out
            .iter()
            .map(|o| {
                let mut v = serde_json::to_value(o).unwrap_or_default();
                v["vs_kernel"] = serde_json::json!(vs_kernel(out, o));
                v["us_per_load"] = serde_json::json!(us_per_load(out, o));
                v["vs_native"] = serde_json::json!(saved_against_native(out, o));
                if swap {
                    v["vs_swap"] = serde_json::json!(vs_swap(out, o));
                }
                v
            })
            .collect();
        println!("{}", serde_json::Value::Array(rows));
        return;
    }
    let ratio = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{r:.2}x"));
    let vs_swap_head = if swap { format!(" {:>8}", "vs swap") } else { String::new() };
    println!(
        "{:<12} {:>10} {:>16} {:>12} {:>12} {:>10}{vs_swap_head} {:>10} {:>8}  exit",
        "config", "elapsed s", "peak footprint", "avg", "resident avg", "vs kernel", "loads", "us/load"
    );
    for o in out {
        let vs_swap_col = if swap { format!(" {:>8}", ratio(vs_swap(out, o))) } else { String::new() };
        println!(
            "{:<12} {:>10.2} {:>12} MiB {:>8} MiB {:>8} MiB {:>10}{vs_swap_col} {:>10} {:>8}  {}",
            o.config,
            o.elapsed_s,
            o.peak_footprint_bytes >> 20,
            o.avg_footprint_bytes >> 20,
            o.avg_resident_bytes >> 20,
            ratio(vs_kernel(out, o)),
            o.loads.map_or("-".to_string(), |l| l.to_string()),
            us_per_load(out, o).map_or("-".to_string(), |u| format!("{u:.1}")),
            o.exit_status
        );
    }
    for (o, s) in out.iter().filter_map(|o| Some((o, saved_against_native(out, o)?))) {
        println!(
            "{}: {:.2}x native's time ({:+.1}%); footprint {:.0}% of native's averaged over time \
             ({:.0}% saved), {:.0}% at the peak",
            o.config,
            s.time_ratio,
            (s.time_ratio - 1.0) * 100.0,
            s.avg_ratio * 100.0,
            (1.0 - s.avg_ratio) * 100.0,
            s.peak_ratio * 100.0
        );
    }
}

/// A controlled run (`zmem:P%`) against native: time, and footprint
/// averaged over time and at the peak, as ratios.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
struct Saved {
    time_ratio: f64,
    avg_ratio: f64,
    peak_ratio: f64,
}

fn saved_against_native(out: &[Outcome], o: &Outcome) -> Option<Saved> {
    let n = out.iter().find(|n| n.config == "native")?;
    let ok = o.config.ends_with('%') && o.exit_ok && n.exit_ok && n.elapsed_s > 0.0;
    (ok && n.avg_footprint_bytes > 0 && n.peak_footprint_bytes > 0).then(|| Saved {
        time_ratio: o.elapsed_s / n.elapsed_s,
        avg_ratio: o.avg_footprint_bytes as f64 / n.avg_footprint_bytes as f64,
        peak_ratio: o.peak_footprint_bytes as f64 / n.peak_footprint_bytes as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::{
        equal_footprint_limit, parse_rollup, pss_of, rss_of, saved_against_native, stats_file_loads,
        stats_file_own_bytes, us_per_load, vs_kernel, vs_swap, Outcome, Pss, Sampler,
    };
    use std::process::Command;

    fn run(config: &str, elapsed_s: f64, exit_ok: bool) -> Outcome {
        Outcome {
            config: config.into(),
            elapsed_s,
            peak_footprint_bytes: 0,
            avg_footprint_bytes: 0,
            peak_pss_bytes: 0,
            peak_resident_bytes: 0,
            avg_resident_bytes: 0,
            cgroup_peak_bytes: None,
            loads: None,
            exit_ok,
            exit_status: String::new(),
        }
    }

    #[test]
    fn only_runs_that_both_finished_well_get_a_ratio() {
        let out = [run("native", 1.0, true), run("zmem", 2.0, false), run("kernel:lzo", 4.0, true)];
        assert_eq!(vs_kernel(&out, &out[0]), Some(4.0));
        assert_eq!(vs_kernel(&out, &out[1]), None, "zmem failed");
        let killed = [run("native", 1.0, true), run("zmem", 2.0, true), run("kernel:lzo", 0.1, false)];
        assert!(killed.iter().all(|o| vs_kernel(&killed, o).is_none()), "the kernel was OOM-killed");
        let none = [run("native", 1.0, true), run("zmem", 2.0, true)];
        assert_eq!(vs_kernel(&none, &none[1]), None, "--no-kernel");
        // zswap's run killed, plain swap's finished: only `vs swap`.
        let swap =
            [run("native", 1.0, true), run("zmem", 2.0, true), run("kernel:lzo", 0.1, false), run("swap", 8.0, true)];
        assert_eq!(vs_kernel(&swap, &swap[1]), None);
        assert_eq!(vs_swap(&swap, &swap[1]), Some(4.0));
        assert_eq!(vs_swap(&swap, &swap[2]), None, "the killed run");
        assert_eq!(vs_swap(&killed, &killed[1]), None, "no --swap");
    }

    #[test]
    fn a_load_costs_the_time_over_native_shared_out() {
        let mut out = [run("native", 1.0, true), run("zmem", 3.0, true), run("kernel:lzo", 0.5, true)];
        out[1].loads = Some(100_000);
        out[2].loads = Some(10);
        assert_eq!(us_per_load(&out, &out[0]), None, "no loads");
        assert!((us_per_load(&out, &out[1]).unwrap() - 20.0).abs() < 1e-9);
        assert_eq!(us_per_load(&out, &out[2]), Some(0.0), "faster than native: no cost");
        out[1].exit_ok = false;
        assert_eq!(us_per_load(&out, &out[1]), None, "failed");
    }

    #[test]
    fn a_stats_file_gives_its_pool_and_swap_loads() {
        assert_eq!(stats_file_loads(r#"{"pid":1,"tier":{"zswpin":700,"pswpin":42,"zswpout":9}}"#), 742);
        assert_eq!(stats_file_loads(r#"{"pid":1}"#), 0, "no tier yet");
        assert_eq!(stats_file_loads("{\"pid\":1,\"ti"), 0, "cut short");
    }

    #[test]
    fn a_stats_file_gives_zmems_own_memory_apart_from_the_programs() {
        let t = r#"{"pid":1,"tier":{"memory_bytes":7000,"pool_total_size":6000},
                    "pager":{"metadata_bytes":900,"metadata_folio_table_bytes":300,
                             "metadata_reclaim_list_bytes":200,"metadata_tier_block_bytes":400,
                             "resident_bytes":99999}}"#;
        // The tier's tables are in both `memory_bytes` and `metadata_bytes`:
        // counted once.
        assert_eq!(stats_file_own_bytes(t), 7500);
        assert_eq!(stats_file_own_bytes(r#"{"pid":1}"#), 0, "no pager yet");
        assert_eq!(stats_file_own_bytes("{\"pid\":1,\"ti"), 0, "cut short");
    }

    #[test]
    fn a_rollup_gives_its_pss_anonymous_pss_and_shmem_pss() {
        let t = "55d0-7ffd ---p 00000000 00:00 0 [rollup]\nRss: 56940 kB\nPss: 54521 kB\n\
                 Pss_Dirty: 46121 kB\nPss_Anon: 46116 kB\nPss_File: 8400 kB\nPss_Shmem: 5 kB\n";
        let p = parse_rollup(t).unwrap();
        assert_eq!(p, Pss { all: 54521 << 10, anon: 46116 << 10, shmem: 5 << 10 });
        assert_eq!(p.file(), 8400 << 10);
        assert_eq!(parse_rollup("Pss: 1 kB\n"), None, "no Pss_Anon");
        // A key that only starts like another is not taken for it.
        assert_eq!(parse_rollup("Pss_Anon: 2 kB\nPss_File: 1 kB\nPss_Shmem: 0 kB\n"), None, "no Pss");
    }

    /// The JVM's ZGC maps its heap, a memfd, at three addresses: each page
    /// is counted in RSS once a view and in PSS once. The footprint takes
    /// shared memory at its PSS, as the cgroup charges it: here a Python
    /// that writes 32 MiB of a memfd and reads it through two more views.
    #[test]
    fn shared_memory_counts_in_the_footprint_once() {
        use std::io::BufRead;
        let script = "import mmap, os, sys\n\
                      n = 32 << 20\n\
                      fd = os.memfd_create('zgc-like')\n\
                      os.ftruncate(fd, n)\n\
                      views = [mmap.mmap(fd, n) for _ in range(3)]\n\
                      views[0].write(b'x' * n)\n\
                      assert all(v[i] == 120 for v in views[1:] for i in range(0, n, 4096))\n\
                      print('ready', flush=True)\n\
                      sys.stdin.read()\n";
        let mut child = Command::new("python3")
            .args(["-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        let (rss, pss) = (rss_of(child.id()).unwrap(), pss_of(child.id()).unwrap());
        let m = Sampler::new(child.id()).sample();
        drop(child.stdin.take());
        assert!(child.wait().unwrap().success());
        let mib = |b: u64| b >> 20;
        assert!((96..110).contains(&mib(rss.shmem)), "three views: {rss:?}");
        assert!((31..40).contains(&mib(pss.shmem)), "one copy: {pss:?}");
        assert!((31..40).contains(&mib(m.shmem)), "sampled at its PSS: {m:?}");
        assert!(m.all >= m.anon + m.shmem);
    }

    #[test]
    fn a_controlled_run_is_weighed_against_native_by_time_and_footprint() {
        let mut out = [run("native", 10.0, true), run("zmem", 12.0, true), run("zmem:5%", 10.5, true)];
        out[0].avg_footprint_bytes = 400;
        out[0].peak_footprint_bytes = 500;
        out[2].avg_footprint_bytes = 100;
        out[2].peak_footprint_bytes = 250;
        let s = saved_against_native(&out, &out[2]).unwrap();
        assert!((s.time_ratio - 1.05).abs() < 1e-12 && s.avg_ratio == 0.25 && s.peak_ratio == 0.5, "{s:?}");
        assert_eq!(saved_against_native(&out, &out[1]), None, "a fixed limit");
        assert_eq!(saved_against_native(&out, &out[0]), None, "native itself");
        out[2].exit_ok = false;
        assert_eq!(saved_against_native(&out, &out[2]), None, "failed");
    }

    #[test]
    fn the_equal_footprint_limit_moves_by_the_footprints_difference() {
        const M: u64 = 1 << 20;
        // The kernel took 187 MiB at 150M where zmem took 161 MiB.
        assert_eq!(equal_footprint_limit(150 * M, 161 * M, 187 * M), 176 * M);
        // A kernel smaller than zmem lowers the limit, in whole MiB.
        assert_eq!(equal_footprint_limit(150 * M, 170 * M + 5, 160 * M), 139 * M);
        // Never under what zmem run takes.
        let min = zmem_settings::Settings::MIN_LIMIT as u64;
        assert_eq!(equal_footprint_limit(min, 200 * M, M), min);
    }
}
