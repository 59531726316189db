//! `zmem run -- CMD`: CMD with `libzmem_preload.so` preloaded, its large
//! anonymous memory managed by zmem. `zmem stats PID`: what it is doing.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::{bail, Context, Result};
use zmem_settings::Settings;
use zmem_uffd::tree::Tree;

// The doc comments are `--help`'s text, where `zstd[:LEVEL]` is syntax, not a
// rustdoc link.
#[allow(rustdoc::broken_intra_doc_links)]
#[derive(Debug, clap::Args)]
#[command(after_help = "Every flag has a ZMEM_* environment variable (ZMEM_LIMIT, ZMEM_COMPRESSOR, \
ZMEM_RECOMPRESS, ZMEM_MAX_POOL_PERCENT, ZMEM_START_PERCENT, ZMEM_SWAPFILE_DIR, ZMEM_WRITEBACK, ZMEM_NO_ENCRYPT, ZMEM_THRESHOLD, ZMEM_FOLIO, ZMEM_FAULT_AROUND, ZMEM_READ_AHEAD, ZMEM_ADOPT, ZMEM_FORK_EVENT, ZMEM_SHOW_LIMIT, \
ZMEM_STACKS, ZMEM_MAX_SLOWDOWN, ZMEM_REPORT, ZMEM_SCAN_MS, ZMEM_HANDLER_FOLLOW, ZMEM_HANDLER_HOLD, ZMEM_STATS_DIR, ZMEM_STATS_INTERVAL_MS, ZMEM_DISABLE); flags win. ZMEM_PRELOAD names the shim library if it is not \
next to the zmem binary.")]
pub struct Args {
    /// Resident memory plus pool plus metadata of the managed memory.
    /// With `--max-slowdown`, the most the limit moves to [default: the
    /// machine's memory].
    #[arg(long)]
    limit: Option<String>,
    /// Move the limit while the program runs, so that the time its threads
    /// wait on zmem because of the limit (loads, eviction waits, the
    /// throttle) stays near this share of their CPU time: the least memory
    /// it runs in at that slowdown. `zmem stats PID` shows the limit and
    /// the stall.
    #[arg(long, value_name = "PERCENT")]
    max_slowdown: Option<String>,
    /// Write an SVG of the limit, usage, resident memory, pool and stall
    /// over time to FILE as the program exits (FILE.json: the figures, a
    /// JSON object a quarter second).
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// lz4, zstd[:LEVEL], deflate[:LEVEL], lzo, lzo-rle. Unset: lz4, and
    /// zstd:1 for new stores while the swap file serves a tenth of the
    /// loads or more (a smaller pool per page saves disk reads).
    #[arg(long)]
    compressor: Option<String>,
    /// Recompress idle pool entries with this stronger codec in the
    /// background (zstd[:LEVEL], ...), as zram's recompress does: a smaller
    /// pool, slower loads of what moved [default: off].
    #[arg(long)]
    recompress: Option<String>,
    /// The pool's share of the limit, percent, fixed [default: from 10%,
    /// moved between 5% and 80% by what misses cost, with a swap file].
    #[arg(long)]
    max_pool_percent: Option<String>,
    /// A process starts its pager once the tree's memory reaches this
    /// percent of the limit; until then it runs with no pager, and a short
    /// process pays nothing but the shim's load. 0: every process starts
    /// its pager as it loads [default: 50].
    #[arg(long)]
    start_percent: Option<String>,
    /// Write cold pages back to a swap file in this directory (on disk, not
    /// tmpfs) [default: /var/tmp].
    #[arg(long)]
    swapfile: Option<PathBuf>,
    /// No swap file: when the pool is full, the limit turns soft.
    #[arg(long, conflicts_with = "swapfile")]
    no_writeback: bool,
    /// Do not encrypt the swap file (AES-XTS by default).
    #[arg(long)]
    no_encrypt: bool,
    /// Mappings and allocations at least this large are managed.
    #[arg(long)]
    threshold: Option<String>,
    /// Eviction unit (4K..2M).
    #[arg(long)]
    folio: Option<String>,
    /// How much of an evicted folio a fault that continues no sequential
    /// stream loads, around the page (0: whole folios) [default: 4K].
    #[arg(long)]
    fault_around: Option<String>,
    /// The most a fault that continues a sequential stream loads ahead (0:
    /// no read-ahead) [default: 512K].
    #[arg(long)]
    read_ahead: Option<String>,
    /// Manage only the memory the shim sees mapped: no scan of the address
    /// space for the program's other mappings (its heap, its runtime's).
    #[arg(long)]
    no_adopt: bool,
    /// Manage the program's thread stacks too.
    #[arg(long)]
    stacks: bool,
    /// A fork loads nothing back: the child takes its evicted pages over
    /// from its parent, and the limit holds across fork (ZMEM_FORK_EVENT=1).
    #[arg(long)]
    fork_event: bool,
    /// The program sees the limit as its machine's memory (sysconf's
    /// _SC_PHYS_PAGES and _SC_AVPHYS_PAGES, sysinfo, /proc/meminfo), as a
    /// program in a memory cgroup sees the cgroup's limit: runtimes that
    /// size themselves from it (DuckDB, the JVM's default heap, Node's V8
    /// heap) size themselves to the limit rather than page through it
    /// (ZMEM_SHOW_LIMIT=1).
    #[arg(long)]
    show_limit: bool,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    cmd: Vec<std::ffi::OsString>,
}

/// Where the shim library is: `$ZMEM_PRELOAD`, or next to this binary.
fn preload_path() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("ZMEM_PRELOAD") {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("ZMEM_PRELOAD={}: no such file", p.display());
        }
        return Ok(p);
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    for d in [dir, dir.parent().unwrap_or(dir)] {
        let p = d.join("libzmem_preload.so");
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "libzmem_preload.so is not next to {} (build it with `cargo build --release -p zmem-preload`, or set ZMEM_PRELOAD)",
        exe.display()
    )
}

/// The tree's accounting segment, in `/dev/shm` (or the temporary
/// directory). Removed once no process of the tree holds a slot; one that
/// outlives `zmem run` (a daemon) leaves it behind, and a later `zmem run`
/// removes it once the daemon is gone.
struct TreeFile {
    path: PathBuf,
    tree: Tree,
    /// Open without close-on-exec: the program inherits it, and so do the
    /// processes it starts, which then join the tree through it even
    /// after dropping privileges (`Tree::open`).
    _inherited: rustix::fd::OwnedFd,
}

impl TreeFile {
    const PREFIX: &'static str = "zmem-tree-";

    fn dir() -> PathBuf {
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        }
    }

    fn create(limit: usize) -> Result<TreeFile> {
        let dir = Self::dir();
        Self::remove_stale(&dir);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let path = dir.join(format!("{}{}-{nanos:x}", Self::PREFIX, std::process::id()));
        let tree = Tree::create(&path, limit).with_context(|| "create the process tree's accounting segment")?;
        let _inherited = Tree::inheritable(&path).with_context(|| "open the process tree's accounting segment")?;
        Ok(TreeFile { path, tree, _inherited })
    }

    /// Segments of earlier runs whose processes are all gone.
    fn remove_stale(dir: &Path) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            if !e.file_name().to_string_lossy().starts_with(Self::PREFIX) {
                continue;
            }
            let old =
                e.metadata().and_then(|m| m.modified()).is_ok_and(|t| t.elapsed().unwrap_or_default().as_secs() > 10);
            if let Ok(t) = Tree::open(&p) {
                t.sweep();
                if old && t.members().is_empty() {
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
    }
}

impl Drop for TreeFile {
    fn drop(&mut self) {
        self.tree.sweep();
        if self.tree.members().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

pub fn run(args: &Args) -> Result<std::process::ExitCode> {
    // The environment's ZMEM_* settings, overridden by the flags.
    // Read as bytes: other variables may hold anything.
    let mut vars = zmem_settings::zmem_vars(std::env::vars_os())?;
    let mut set = |k: &str, v: Option<String>| {
        if let Some(v) = v {
            vars.retain(|(key, _)| key != k);
            vars.push((k.to_string(), v));
        }
    };
    set("ZMEM_LIMIT", args.limit.clone());
    set("ZMEM_COMPRESSOR", args.compressor.clone());
    set("ZMEM_RECOMPRESS", args.recompress.clone());
    set("ZMEM_MAX_POOL_PERCENT", args.max_pool_percent.clone());
    set("ZMEM_START_PERCENT", args.start_percent.clone());
    set("ZMEM_SWAPFILE_DIR", args.swapfile.as_ref().map(|p| p.display().to_string()));
    set("ZMEM_NO_ENCRYPT", args.no_encrypt.then(|| "1".to_string()));
    set("ZMEM_WRITEBACK", args.no_writeback.then(|| "0".to_string()));
    set("ZMEM_THRESHOLD", args.threshold.clone());
    set("ZMEM_FOLIO", args.folio.clone());
    set("ZMEM_FAULT_AROUND", args.fault_around.clone());
    set("ZMEM_READ_AHEAD", args.read_ahead.clone());
    set("ZMEM_ADOPT", args.no_adopt.then(|| "0".to_string()));
    set("ZMEM_STACKS", args.stacks.then(|| "1".to_string()));
    set("ZMEM_FORK_EVENT", args.fork_event.then(|| "1".to_string()));
    set("ZMEM_SHOW_LIMIT", args.show_limit.then(|| "1".to_string()));
    set("ZMEM_MAX_SLOWDOWN", args.max_slowdown.clone());
    set("ZMEM_REPORT", args.report.as_ref().map(|p| p.display().to_string()));
    // Directories are made absolute here: the program may change its
    // working directory (pyenv's shims do) before its pagers start.
    let cwd = std::env::current_dir().context("the working directory")?;
    for (k, v) in vars.iter_mut() {
        if (k == "ZMEM_SWAPFILE_DIR" || k == "ZMEM_STATS_DIR") && !v.is_empty() && Path::new(v.as_str()).is_relative() {
            *v = cwd.join(v.as_str()).display().to_string();
        }
    }
    // A bad value is an error here, before the program starts.
    let mut settings = Settings::from_vars(vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
    if settings.max_slowdown.is_some() && !settings.limit_given {
        // The controller's ceiling: the machine's memory, which the
        // program's processes see as their limit too.
        settings.limit = crate::controller::machine_memory()?;
        vars.retain(|(k, _)| k != "ZMEM_LIMIT");
        vars.push(("ZMEM_LIMIT".into(), settings.limit.to_string()));
    }
    // One limit for the whole process tree: every process the program
    // starts (fork, exec) joins this segment through ZMEM_TREE.
    let tree = TreeFile::create(settings.limit)?;
    let watch = (settings.max_slowdown.is_some() || settings.report.is_some()).then(|| {
        let controller = settings.max_slowdown.map(|p| {
            tree.tree.set_controller((p * 10_000.0) as u64, settings.limit);
            crate::controller::Controller::new(p, Settings::MIN_LIMIT, settings.limit)
        });
        crate::controller::Watch { controller, report: settings.report.clone() }
    });
    vars.retain(|(k, _)| k != "ZMEM_TREE");
    vars.push(("ZMEM_TREE".into(), tree.path.display().to_string()));
    let so = preload_path()?;
    let mut preload = so.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|o| !o.is_empty()) {
        preload.push(" ");
        preload.push(old);
    }
    if let Some(path) = find_program(&args.cmd[0]).filter(|p| is_static_elf(p)) {
        eprintln!(
            "zmem: {} is statically linked: the dynamic loader never runs in it, so the preloaded \
             shim cannot manage its memory (it runs unmanaged; programs it execs that are dynamically \
             linked are managed). For Go, build with cgo (CGO_ENABLED=1).",
            path.display()
        );
    }
    check_kernel()?;
    let mut cmd = Command::new(&args.cmd[0]);
    cmd.args(&args.cmd[1..]).env("LD_PRELOAD", preload).envs(vars);
    // AddressSanitizer refuses to start when another library comes before
    // its runtime, as the shim does; told not to check, it starts, and the
    // shim lets it run unmanaged with a warning (it cannot be managed).
    // Read by sanitizer runtimes only; what the user set is kept.
    let mut asan = std::env::var_os("ASAN_OPTIONS").filter(|o| !o.is_empty()).unwrap_or_default();
    if !asan.is_empty() {
        asan.push(":");
    }
    asan.push("verify_asan_link_order=0");
    cmd.env("ASAN_OPTIONS", asan);
    if let Some(t) = tunables_for_user_mode_only() {
        cmd.env("GLIBC_TUNABLES", t);
    }
    forward_signals();
    let mut child = cmd.spawn().with_context(|| format!("start {}", args.cmd[0].to_string_lossy()))?;
    started(i32::try_from(child.id()).context("the program's pid")?);
    let done = std::sync::atomic::AtomicBool::new(false);
    let status = std::thread::scope(|sc| {
        let watcher = watch.map(|w| sc.spawn(|| crate::controller::watch(&tree.tree, w, &done)));
        let status = child.wait();
        done.store(true, Ordering::Release);
        if let Some(w) = watcher {
            w.thread().unpark();
            let _ = w.join();
        }
        status
    })
    .context("wait for the program")?;
    drop(tree);
    // The stats files of the tree's processes that could not remove their
    // own (killed by a signal, `_exit`), in the default directory only (see
    // `zmem_common::stats_files`).
    if let (None, Some(uid)) = (&settings.stats_dir, zmem_common::stats_files::effective_uid(std::process::id())) {
        zmem_common::stats_files::sweep(&zmem_settings::default_stats_dir(uid), 0);
    }
    // The program's status, as a shell would report it.
    let code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    Ok(std::process::ExitCode::from(code as u8))
}

/// The program's pid once it runs (0 before): where [`forward`] sends.
static CHILD: AtomicI32 = AtomicI32::new(0);
/// A signal that came before the program ran, sent once it does.
static PENDING: AtomicI32 = AtomicI32::new(0);

/// Signals that end `zmem run` by default, forwarded to the program
/// instead. Killed by one, `zmem run` left the program running without
/// its parent and the tree's segment in `/dev/shm` (a service manager's
/// SIGTERM, `timeout`, `kill`); now the program gets it, and `zmem run`
/// waits for it, cleans up and exits with its status, as `timeout` and
/// `tini` do.
const FORWARDED: [libc::c_int; 6] =
    [libc::SIGHUP, libc::SIGINT, libc::SIGQUIT, libc::SIGTERM, libc::SIGUSR1, libc::SIGUSR2];

#[allow(unsafe_code)]
fn forward_signals() {
    for sig in FORWARDED {
        // SAFETY: sigaction is plain data; zeroed it is valid (an empty
        // mask, no flags).
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = forward as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        // SAFETY: `forward` has the SA_SIGINFO shape and is
        // async-signal-safe (atomics and kill only); sigaction only reads
        // `sa`.
        unsafe { libc::sigaction(sig, &sa, std::ptr::null_mut()) };
    }
}

/// Sends `sig` on to the program. Not a signal the terminal sent
/// (`si_code` > 0: ^C, ^\, a hangup): the program is in zmem's process
/// group and got that one itself, and a second ^C could cut its own
/// clean-up short. A `kill` (SI_USER, `si_code` <= 0) reached zmem only.
#[allow(unsafe_code)]
extern "C" fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: with SA_SIGINFO the kernel passes a valid siginfo.
    if info.is_null() || unsafe { (*info).si_code } > 0 {
        return;
    }
    let mut pid = CHILD.load(Ordering::SeqCst);
    if pid == 0 {
        // Not started yet: left for `run`, which swaps PENDING after it
        // stores CHILD. Whichever of the two swaps it out sends it, once.
        PENDING.store(sig, Ordering::SeqCst);
        pid = CHILD.load(Ordering::SeqCst);
        if pid == 0 || PENDING.swap(0, Ordering::SeqCst) == 0 {
            return;
        }
    }
    // SAFETY: kill is async-signal-safe and has no memory preconditions;
    // the child is not reaped until `run`'s wait returns, after which no
    // signal is forwarded that matters (zmem is exiting).
    unsafe { libc::kill(pid, sig) };
}

/// The program runs as `pid`: signals go to it from now on, and one that
/// came before is sent now.
#[allow(unsafe_code)]
fn started(pid: i32) {
    CHILD.store(pid, Ordering::SeqCst);
    let early = PENDING.swap(0, Ordering::SeqCst);
    if early != 0 {
        // SAFETY: kill has no memory preconditions; pid is our child's,
        // not yet waited for, so it names no other process.
        unsafe { libc::kill(pid, early) };
    }
}

/// `GLIBC_TUNABLES` with rseq off, where this user gets a userfaultfd for
/// faults from user mode only (none otherwise; what the user set is kept).
///
/// There the kernel cannot wait for zmem when it writes a thread's rseq
/// area (in the thread's TLS, at the top of its stack) on the way back to
/// user mode, and kills the thread's process with SIGSEGV instead:
/// redis-server run as `nobody` died so in `DEBUG DIGEST` (2 runs in 3
/// beside other tests), its jemalloc background thread asleep on a stack
/// the pager had adopted and evicted (jemalloc starts that thread with the
/// `pthread_create` after the shim's, so its stack is not known as one).
/// With `glibc.pthread.rseq=0` glibc registers no rseq area, and the
/// kernel writes none (4 runs in 4 passed).
fn tunables_for_user_mode_only() -> Option<std::ffi::OsString> {
    let uffd = zmem_uffd::Uffd::open(zmem_uffd::OpenMode::Auto, zmem_uffd::Features(0)).ok()?;
    if !uffd.user_mode_only() {
        return None;
    }
    let mut t = std::env::var_os("GLIBC_TUNABLES").filter(|o| !o.is_empty()).unwrap_or_default();
    if !t.to_string_lossy().contains("glibc.pthread.rseq") {
        if !t.is_empty() {
            t.push(":");
        }
        t.push("glibc.pthread.rseq=0");
    }
    Some(t)
}

/// Stops `zmem run` before the program starts, with what is missing, where
/// this kernel or this user cannot have a pager: every process of the tree
/// would otherwise run unmanaged, each with a warning of its own.
fn check_kernel() -> Result<()> {
    let offered = zmem_uffd::Uffd::offered(zmem_uffd::OpenMode::Auto)
        .map_err(|e| anyhow::anyhow!("{e}; zmem cannot manage memory here"))?;
    match missing_kernel_features(offered) {
        None => Ok(()),
        Some(what) => {
            let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
            anyhow::bail!("this kernel ({}) lacks {what}; zmem cannot manage memory here", release.trim())
        }
    }
}

/// The userfaultfd features a pager cannot start without, by the kernel
/// release that brought them, that `offered` lacks; `None` if it has them
/// all. (Write tracking, `UFFDIO_POISON` and `PROCMAP_QUERY` are used where
/// the kernel has them: see README, "Requirements".)
fn missing_kernel_features(offered: zmem_uffd::Features) -> Option<String> {
    use zmem_uffd::Features as F;
    let needed = [
        (F::MOVE, "UFFDIO_MOVE (Linux 6.8)"),
        (F::EVENT_REMOVE, "UFFD_FEATURE_EVENT_REMOVE (Linux 4.11)"),
        (F::EVENT_UNMAP, "UFFD_FEATURE_EVENT_UNMAP (Linux 4.11)"),
        (F::EVENT_REMAP, "UFFD_FEATURE_EVENT_REMAP (Linux 4.11)"),
    ];
    let missing: Vec<&str> = needed.iter().filter(|(f, _)| !offered.contains(*f)).map(|&(_, what)| what).collect();
    (!missing.is_empty()).then(|| missing.join(", "))
}

/// The file `Command::new(name)` would run: `name` itself if it has a
/// slash, else the first executable of that name on `PATH`.
fn find_program(name: &std::ffi::OsStr) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let runnable = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if name.as_encoded_bytes().contains(&b'/') {
        return Some(PathBuf::from(name)).filter(|p| runnable(p));
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| runnable(p))
}

/// Whether `path` is a 64-bit little-endian ELF executable with no
/// `PT_INTERP` program header: nothing loads `LD_PRELOAD` into it. Anything
/// else (a script, a dynamic executable, a file that cannot be read) is
/// not.
fn is_static_elf(path: &Path) -> bool {
    elf_head(path).is_some_and(|b| elf_lacks_interp(&b) == Some(true))
}

/// The start of the file at `path` through its ELF program headers (at
/// most 1 MiB): what [`elf_lacks_interp`] reads. Reading the whole file cost
/// a quarter of `zmem run`'s own time before a short program (python3's
/// 6.8 MB read and copied at every start).
fn elf_head(path: &Path) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut b = vec![0u8; 64];
    f.read_exact(&mut b).ok()?;
    if !b.starts_with(b"\x7fELF") {
        return Some(b);
    }
    let phoff = u64::from_le_bytes(b[0x20..0x28].try_into().ok()?);
    let table = u64::from(u16::from_le_bytes([b[0x36], b[0x37]])) * u64::from(u16::from_le_bytes([b[0x38], b[0x39]]));
    let end = phoff.checked_add(table)?.min(1 << 20);
    b.resize(usize::try_from(end).ok()?.max(64), 0);
    f.read_exact(&mut b[64..]).ok()?;
    Some(b)
}

/// For an ELF64 little-endian image: whether it has no `PT_INTERP`;
/// `None` if it is not one, or its program headers lie outside it.
fn elf_lacks_interp(b: &[u8]) -> Option<bool> {
    const PT_INTERP: u32 = 3;
    let u16_at = |o: usize| Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?));
    // Magic, ELFCLASS64, ELFDATA2LSB.
    if b.get(..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let (phentsize, phnum) = (usize::from(u16_at(0x36)?), usize::from(u16_at(0x38)?));
    if phentsize < 4 {
        return None;
    }
    let mut interp = false;
    for i in 0..phnum {
        interp |= u32_at(phoff.checked_add(i.checked_mul(phentsize)?)?)? == PT_INTERP;
    }
    Some(!interp)
}

#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    /// The process (started under `zmem run`).
    pid: u32,
    #[arg(long, conflicts_with = "prometheus")]
    json: bool,
    #[arg(long)]
    prometheus: bool,
    /// Where the stats files are; default: the ZMEM_STATS_DIR the process
    /// started with, else /tmp/zmem-stats-UID (UID: its effective user).
    #[arg(long, env = "ZMEM_STATS_DIR")]
    dir: Option<PathBuf>,
}

/// Numeric leaves of a JSON object, with their dotted paths.
fn leaves(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, serde_json::Value)>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let p = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                leaves(&p, v, out);
            }
        }
        other => out.push((prefix.to_string(), other.clone())),
    }
}

/// The Prometheus text exposition of a stats file's numeric leaves `l`:
/// one family per field, `zmem_` and its dotted path with `_`, each with a
/// HELP and a TYPE line before its samples, every sample labelled with the
/// process's pid. The tier's fields carry its counter or gauge type and
/// help (`zmem_tier::stats::describe`); the others are `untyped`, as the
/// format allows. A list of numbers (`pager.refault_distance`) is one
/// series per element, labelled with its index as `bucket`. Strings,
/// booleans and the pid itself are left out.
fn prometheus(l: &[(String, serde_json::Value)], pid: u32) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    for (k, v) in l {
        let samples: Vec<(String, f64)> = if let Some(n) = v.as_f64() {
            vec![(format!("pid=\"{pid}\""), n)]
        } else if let Some(a) = v.as_array() {
            a.iter()
                .enumerate()
                .filter_map(|(i, x)| Some((format!("pid=\"{pid}\",bucket=\"{i}\""), x.as_f64()?)))
                .collect()
        } else {
            Vec::new()
        };
        if samples.is_empty() || k == "pid" {
            continue;
        }
        let name = format!("zmem_{}", k.replace('.', "_"));
        let (kind, help) = match k.strip_prefix("tier.").and_then(zmem_tier::stats::describe) {
            Some((kind, help)) => (kind, help.to_string()),
            None => ("untyped", format!("zmem stats field {k}")),
        };
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, n) in samples {
            let _ = writeln!(out, "{name}{{{labels}}} {n}");
        }
    }
    out
}

/// The `ZMEM_STATS_DIR` process `pid` started with, if it had one and its
/// environment can be read (this user's process, or root): `zmem stats
/// PID` then needs no `--dir`. (`zmem run` makes the directory absolute.)
fn stats_dir_of(pid: u32) -> Option<PathBuf> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let v = env.split(|&b| b == 0).find_map(|kv| kv.strip_prefix(b"ZMEM_STATS_DIR="))?;
    let v = <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(v);
    (!v.is_empty()).then(|| PathBuf::from(v))
}

pub fn stats(args: &StatsArgs) -> Result<()> {
    let dir = match args.dir.clone().or_else(|| stats_dir_of(args.pid)) {
        Some(d) => d,
        None => {
            let uid = zmem_common::stats_files::effective_uid(args.pid)
                .with_context(|| format!("no process {} (is it running?)", args.pid))?;
            zmem_settings::default_stats_dir(uid)
        }
    };
    let path = zmem_common::stats_files::path(&dir, args.pid);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!("no stats for pid {} at {} (is it running under `zmem run`?)", args.pid, path.display())
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mut l = Vec::new();
    leaves("", &v, &mut l);
    if args.prometheus {
        print!("{}", prometheus(&l, args.pid));
        return Ok(());
    }
    let age = v["updated_unix_ms"].as_u64().map(|t| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        (now as u64).saturating_sub(t)
    });
    println!("zmem stats for pid {} (updated {} ms ago)", args.pid, age.unwrap_or(0));
    for (k, v) in &l {
        if k != "updated_unix_ms" && k != "pid" && !k.starts_with("tree.") {
            println!("  {k:<40} {}", v.to_string().trim_matches('"'));
        }
    }
    let tree = &v["tree"];
    if tree.is_object() {
        let mib = |v: &serde_json::Value| v.as_u64().unwrap_or(0) as f64 / f64::from(1 << 20);
        println!(
            "process tree: limit {:.1} MiB, usage {:.1} MiB, peak {:.1} MiB ({})",
            mib(&tree["limit"]),
            mib(&tree["usage_bytes"]),
            mib(&tree["peak_usage_bytes"]),
            tree["path"].as_str().unwrap_or("?")
        );
        if let Some(c) = tree["controller"].as_object() {
            println!(
                "  the limit moves to hold the stall near {}% of the program's CPU time (--max-slowdown), \
                 at most {:.1} MiB",
                c["max_slowdown_percent"].as_f64().unwrap_or(0.0),
                mib(&c["ceiling"])
            );
        }
        println!("  {:>8} {:>10} {:>10} {:>10} {:>12}", "pid", "usage MiB", "share MiB", "peak MiB", "evicted");
        for m in tree["processes"].as_array().into_iter().flatten() {
            println!(
                "  {:>8} {:>10.1} {:>10.1} {:>10.1} {:>12}",
                m["pid"],
                mib(&m["usage_bytes"]),
                mib(&m["share_bytes"]),
                mib(&m["peak_usage_bytes"]),
                m["evicted_folios"]
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dynamic_executable_has_an_interpreter_and_garbage_is_no_elf() {
        let me = std::fs::read("/proc/self/exe").unwrap();
        assert_eq!(elf_lacks_interp(&me), Some(false), "the test binary is dynamically linked");
        assert!(!is_static_elf(Path::new("/proc/self/exe")));
        assert_eq!(elf_lacks_interp(b"#!/bin/sh\necho hi\n"), None);
        assert_eq!(elf_lacks_interp(&me[..0x30]), None, "cut short");
        // The same image with its PT_INTERP header's type changed: static.
        let phoff = u64::from_le_bytes(me[0x20..0x28].try_into().unwrap()) as usize;
        let phentsize = u16::from_le_bytes(me[0x36..0x38].try_into().unwrap()) as usize;
        let phnum = u16::from_le_bytes(me[0x38..0x3a].try_into().unwrap()) as usize;
        let mut img = me.clone();
        for i in 0..phnum {
            let o = phoff + i * phentsize;
            if u32::from_le_bytes(img[o..o + 4].try_into().unwrap()) == 3 {
                img[o..o + 4].copy_from_slice(&1u32.to_le_bytes());
            }
        }
        assert_eq!(elf_lacks_interp(&img), Some(true));
        // What is read of a file: through its program headers, not more,
        // and all of a file shorter than that.
        let dir = std::env::temp_dir().join(format!("zmem-elf-head-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (stat, script) = (dir.join("static"), dir.join("script"));
        std::fs::write(&stat, &img).unwrap();
        std::fs::write(&script, b"#!/bin/sh\necho hi\n").unwrap();
        let head = elf_head(&stat).unwrap();
        assert_eq!(head.len(), phoff + phnum * phentsize);
        assert!(is_static_elf(&stat));
        assert!(!is_static_elf(&script) && !is_static_elf(&dir.join("missing")));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_kernel_without_move_is_named_with_the_release_that_brought_it() {
        use zmem_uffd::Features as F;
        let all = F::MOVE | F::EVENT_REMOVE | F::EVENT_UNMAP | F::EVENT_REMAP;
        assert_eq!(missing_kernel_features(all), None);
        let before_6_8 = F::EVENT_REMOVE | F::EVENT_UNMAP | F::EVENT_REMAP | F::POISON;
        assert_eq!(missing_kernel_features(before_6_8).as_deref(), Some("UFFDIO_MOVE (Linux 6.8)"));
        let none = missing_kernel_features(F(0)).unwrap();
        assert!(none.starts_with("UFFDIO_MOVE") && none.contains("EVENT_REMAP"), "{none}");
        // This machine's kernel runs the tests: it has them all.
        assert_eq!(missing_kernel_features(zmem_uffd::Uffd::offered(zmem_uffd::OpenMode::Auto).unwrap()), None);
    }

    #[test]
    fn programs_are_found_as_exec_finds_them() {
        assert!(find_program(std::ffi::OsStr::new("sh")).is_some_and(|p| p.is_absolute()));
        assert_eq!(find_program(std::ffi::OsStr::new("/nonexistent/x")), None);
        assert_eq!(find_program(std::ffi::OsStr::new("zmem-no-such-program")), None);
    }
}
