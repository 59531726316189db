//! What the system tests share: running `zmem` with a deadline, this run's
//! directories, compiling C, starting redis, and reading the stats files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The shim, built (same profile, a no-op when it is up to date) since the
/// test build does not produce the cdylib itself, and a stale one would test
/// old code; copied with `zmem` into [`bin_for_all`].
pub(crate) fn preload() -> PathBuf {
    bin_for_all().join("libzmem_preload.so")
}

/// The `zmem` binary the tests run: the one cargo built for them, copied
/// into [`bin_for_all`] beside the shim.
pub(crate) fn zmem_exe() -> PathBuf {
    bin_for_all().join("zmem")
}

/// A directory of this run, readable by every user, holding copies of
/// `zmem` and its shim: the tests that run programs as `nobody` or
/// `postgres` need them, and a clone in a private directory (`mktemp -d`,
/// mode 0700) keeps its `target/` from every user but its owner.
pub(crate) fn bin_for_all() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        use std::os::unix::fs::PermissionsExt;
        let exe = Path::new(env!("CARGO_BIN_EXE_zmem"));
        let dir = exe.parent().unwrap().to_path_buf();
        let mut c = Command::new(env!("CARGO"));
        c.args(["build", "-p", "zmem-preload"]);
        if dir.ends_with("release") {
            c.arg("--release");
        }
        let target = dir.parent().unwrap();
        c.env("CARGO_TARGET_DIR", target).current_dir(env!("CARGO_MANIFEST_DIR"));
        assert!(c.status().expect("cargo build -p zmem-preload").success());
        let so = dir.join("libzmem_preload.so");
        assert!(so.is_file(), "{} was not built", so.display());
        let bin = tmpdir("bin");
        for d in [test_root(), bin.clone()] {
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        for f in [exe, so.as_path()] {
            let to = bin.join(f.file_name().unwrap());
            std::fs::copy(f, &to).unwrap_or_else(|e| panic!("copy {} to {}: {e}", f.display(), to.display()));
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        bin
    })
    .clone()
}

/// This run's directory for the tests' files: removed as the test binary
/// exits (a run left ~100 directories behind in /tmp, 190 MiB over a few
/// hundred runs).
pub(crate) fn test_root() -> PathBuf {
    std::env::temp_dir().join(format!("zmem-run-test-{}", std::process::id()))
}

extern "C" fn remove_test_root() {
    let _ = std::fs::remove_dir_all(test_root());
}

/// `NAME`'s directory under [`test_root`].
pub(crate) fn tmpdir(name: &str) -> PathBuf {
    static CLEANUP: std::sync::Once = std::sync::Once::new();
    CLEANUP.call_once(|| {
        // SAFETY: registers a plain function with no arguments, which only
        // removes this run's directory.
        unsafe { libc::atexit(remove_test_root) };
    });
    let d = test_root().join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// [`tmpdir`], writable by every user (the tests that run as `nobody`).
pub(crate) fn tmpdir_for_all(name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let d = tmpdir(name);
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    d
}

/// Runs `zmem ARGS` with `env`, killing it after `secs` (a hang fails),
/// with every process it started: a hung program left behind would load a
/// core for the tests that follow.
pub(crate) fn zmem(args: &[&str], env: &[(&str, &str)], secs: u64) -> Output {
    zmem_in(Path::new("."), args, env, secs)
}

/// `zmem ARGS` with DIR as its working directory.
pub(crate) fn zmem_in(dir: &Path, args: &[&str], env: &[(&str, &str)], secs: u64) -> Output {
    let mut c = Command::new(zmem_exe());
    c.current_dir(dir);
    c.args(args).env("ZMEM_PRELOAD", preload());
    for (k, v) in env {
        c.env(k, v);
    }
    output_within(&mut c, secs, &format!("zmem {args:?}"))
}

/// `c`'s output, in a process group of its own, killed with the group
/// after `secs` (a hang fails, as `what`).
pub(crate) fn output_within(c: &mut Command, secs: u64, what: &str) -> Output {
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    // A process group of its own, for the kill below.
    std::os::unix::process::CommandExt::process_group(c, 0);
    let mut child = c.spawn().unwrap_or_else(|e| panic!("start {what}: {e}"));
    // Read both pipes while it runs: a program that wrote more than a pipe
    // holds would block in write(2) until the kill below, and read as hung.
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let err = drain(child.stderr.take().map(|p| Box::new(p) as _));
    wait_or_kill_group(&mut child, secs, what);
    let status = child.wait().unwrap();
    Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap() }
}

/// Waits up to `secs` for `child`, started as the leader of a process
/// group of its own; past that, kills the whole group (a hung program left
/// behind would load a core for the tests that follow) and fails.
pub(crate) fn wait_or_kill_group(child: &mut std::process::Child, secs: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let threads = group_threads(child.id());
            // SAFETY: signals the group the caller made (its leader's pid
            // is the child's id); kill(2) touches no memory of ours.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            panic!("{what} hung for {secs} s; its threads:\n{threads}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every thread of process group `pgid`: its name, state, where it sleeps
/// (`wchan`) and its kernel stack (root only), so that a hang can be read
/// from the failure alone.
pub(crate) fn group_threads(pgid: u32) -> String {
    let mut out = String::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // After the name: state, ppid, pgrp.
        let in_group = stat.rfind(')').and_then(|i| stat[i + 2..].split_whitespace().nth(2)?.parse::<u32>().ok());
        if in_group != Some(pgid) {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmd: String = String::from_utf8_lossy(&cmd).replace('\0', " ").chars().take(80).collect();
        out += &format!("process {pid}: {cmd}\n");
        for t in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
            let d = t.path();
            let read = |f: &str| std::fs::read_to_string(d.join(f)).unwrap_or_default();
            let st = read("stat");
            let state = st.rfind(')').map_or("?", |i| &st[i + 2..i + 3]);
            out += &format!(
                "  {} {} {state} {}\n",
                t.file_name().to_string_lossy(),
                read("comm").trim(),
                read("wchan").trim()
            );
            for l in read("stack").lines().take(12) {
                out += &format!("      {l}\n");
            }
        }
    }
    out
}

pub(crate) fn text(o: &Output) -> String {
    format!("stdout: {}\nstderr: {}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// `tests/data/NAME.c`, compiled.
pub(crate) fn compile_c(name: &str) -> PathBuf {
    compile_c_with(name, &[])
}

/// `tests/data/NAME.c`, compiled with the extra flags `flags`.
pub(crate) fn compile_c_with(name: &str, flags: &[&str]) -> PathBuf {
    let exe = tmpdir(&format!("cc-{name}")).join(name);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/{name}.c"));
    let st =
        Command::new("cc").arg("-O2").args(flags).arg("-o").arg(&exe).arg(src).status().expect("a C compiler (cc)");
    assert!(st.success());
    exe
}

pub(crate) fn compile_alloc() -> PathBuf {
    compile_c("alloc")
}

pub(crate) const PY: &str = r#"
import hashlib, os, sys, time, json
mib = int(sys.argv[1])
text = (open(sys.argv[0] if os.path.exists(sys.argv[0]) else '/etc/services', 'rb').read() * 200)[:1 << 20]
blocks = []
for i in range(mib):
    b = bytearray(text)
    b[:8] = i.to_bytes(8, 'little')
    blocks.append(b)
time.sleep(float(os.environ.get('HOLD', '0')))
for i, b in enumerate(blocks):
    assert b[:8] == i.to_bytes(8, 'little') and b[8:] == text[8:], i
big = bytearray(mib << 20)
big[::4096] = b'\x01' * (mib * 256)
assert sum(big[::4096]) == mib * 256
print("ok", mib)
"#;

/// `argv[1]` MiB of distinct 1 MiB blocks of text (`blocks`, built from
/// `text`), for the Python programs below that check every block.
pub(crate) const PY_BLOCKS: &str = r#"
mib = int(sys.argv[1])
text = b''.join(hashlib.sha256(i.to_bytes(4, 'little')).hexdigest().encode() for i in range(16384))
blocks = []
for i in range(mib):
    b = bytearray(text)
    b[:8] = i.to_bytes(8, 'little')
    blocks.append(b)
"#;

/// libjemalloc.so.2, from Debian's libjemalloc2 (installed by `.ci/run`).
pub(crate) fn jemalloc() -> PathBuf {
    let found = ["/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file());
    found.expect("libjemalloc.so.2 (Debian's libjemalloc2; .ci/run installs it)")
}

/// redis-server on `port`, under zmem (`limit`) or as is, with its RDB in `dir`.
pub(crate) fn start_redis(port: u32, dir: &Path, limit: Option<&str>) -> std::process::Child {
    let swap = tmpdir("redis-swap");
    let mut c = match limit {
        Some(l) => {
            let mut c = Command::new(zmem_exe());
            c.args(["run", "--limit", l, "--swapfile", swap.to_str().unwrap(), "--", "redis-server"]);
            c.env("ZMEM_PRELOAD", preload());
            c.env("ZMEM_STATS_DIR", tmpdir("redis-stats")).env("ZMEM_STATS_INTERVAL_MS", "50");
            c
        }
        None => Command::new("redis-server"),
    };
    c.args(["--port", &port.to_string(), "--save", "", "--appendonly", "no", "--enable-debug-command", "local"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("redis-server (Debian's; .ci/run installs it)")
}

/// The `DEBUG DIGEST` of a redis-server run as is on `port` after `load`.
pub(crate) fn digest_as_is(port: u32, load: &[&str]) -> String {
    let mut native = start_redis(port, &tmpdir(&format!("redis-ref-{port}")), None);
    wait_for_redis(port, &mut native);
    assert_eq!(redis_cli(port, load), "OK");
    let want = redis_cli(port, &["debug", "digest"]);
    redis_cli(port, &["shutdown", "nosave"]);
    let _ = native.wait();
    want
}

pub(crate) fn redis_cli(port: u32, args: &[&str]) -> String {
    let o = Command::new("redis-cli").args(["-p", &port.to_string()]).args(args).output().expect("redis-cli");
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

pub(crate) fn wait_for_redis(port: u32, server: &mut std::process::Child) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while redis_cli(port, &["ping"]) != "PONG" {
        if Instant::now() > deadline || server.try_wait().unwrap().is_some() {
            let _ = server.kill();
            let mut err = String::new();
            if let Some(mut e) = server.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            panic!("redis-server did not start: {err}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `child`'s exit status, waited for up to `secs`; past that, fails with
/// `why`.
pub(crate) fn exit_within(
    child: &mut std::process::Child,
    secs: u64,
    why: impl Fn() -> String,
) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        assert!(Instant::now() < deadline, "{}", why());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills the process group `child` leads (made with `process_group(0)`)
/// if it still runs: a server left behind by a failed check.
pub(crate) fn kill_group_if_running(child: &mut std::process::Child) {
    if child.try_wait().ok().flatten().is_none() {
        // SAFETY: signals the process group the test made; kill(2) touches
        // no memory of ours.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        let _ = child.wait();
    }
}

/// The largest `pager` counters over the stats files a run left in `dir`
/// (one per process; the last update is at most one interval old).
pub(crate) fn pager_max(dir: &Path, key: &str) -> u64 {
    stats_max(dir, |v| v["pager"][key].as_u64())
}

/// The most a tree's peak usage may pass its `limit` by in these tests: a
/// quarter. The limit is soft as memory.high is: a fault over it waits
/// for reclaim 20 ms at the most, and on a machine whose two CPUs are
/// busy (the test binary runs two tests at once, and CI builds beside
/// them) reclaim runs late. Measured: PostgreSQL under 48M peaked at
/// 49.2-50.9 MB alone and up to 58.1 MB beside two busy loops; memcached
/// under 24M at 27.4 MB beside a build.
pub(crate) fn tree_slack(limit: u64) -> u64 {
    limit + limit / 4
}

/// The tree's peak usage, from the stats files in `dir`.
pub(crate) fn tree_peak(dir: &Path) -> u64 {
    stats_max(dir, |v| v["tree"]["peak_usage_bytes"].as_u64())
}

/// The tree's peak usage from the stats files in `dir`, checked to lie
/// over `floor` (the program was managed) and within `limit` and its
/// [`tree_slack`]. A failure names reclaim's counters, then `context`
/// (the program's output, as `text` gives it).
pub(crate) fn assert_tree_peak_within(dir: &Path, floor: u64, limit: u64, context: &str) -> u64 {
    let peak = tree_peak(dir);
    assert!(
        peak > floor && peak <= tree_slack(limit),
        "the tree's peak usage {} KiB is off {} MiB (over {} KiB, within a quarter more); {}; {context}",
        peak >> 10,
        limit >> 20,
        floor >> 10,
        reclaim_counters(dir)
    );
    peak
}

/// What reclaim did, for the footprint checks' messages: the pager's and
/// the tier's counters that say why usage outran the limit (reclaim
/// starved, stores rejected, the limit soft, the pool full, writeback).
pub(crate) fn reclaim_counters(dir: &Path) -> String {
    const PAGER: [&str; 8] = [
        "reclaim_passes",
        "evicted_folios",
        "eviction_rejects",
        "limit_soft_events",
        "direct_reclaim_waits",
        "throttle_ns",
        "held_bytes",
        "mapping_scans",
    ];
    const TIER: [&str; 4] = ["pool_total_size", "pool_limit_hit", "written_back_pages", "reject_reclaim_fail"];
    let pager = PAGER.iter().map(|k| format!("{k} {}", pager_max(dir, k)));
    let tier = TIER.iter().map(|k| format!("{k} {}", stats_max(dir, |v| v["tier"][k].as_u64())));
    pager.chain(tier).collect::<Vec<_>>().join(", ")
}

/// The largest value `get` reads from the stats files in `dir`.
pub(crate) fn stats_max(dir: &Path, get: impl Fn(&serde_json::Value) -> Option<u64>) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
        .filter_map(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .filter_map(|v| get(&v))
        .max()
        .unwrap_or(0)
}

/// Runs CMD under `zmem run --limit LIMIT` with stats every 50 ms, checks
/// that it succeeded and printed `want`, and that zmem adopted and evicted
/// its memory. Returns the output.
pub(crate) fn run_managed(name: &str, limit: &str, cmd: &[&str], want: &str, secs: u64) -> Output {
    run_managed_env(name, limit, cmd, &[], want, secs)
}

/// Runs `cmd` under `zmem run --limit LIMIT` with a swap file of its own,
/// and checks that it succeeds and prints `want`.
pub(crate) fn run_checked(
    name: &str,
    limit: &str,
    cmd: &[&str],
    env: &[(&str, &str)],
    want: &str,
    secs: u64,
) -> Output {
    let swap = tmpdir(&format!("{name}-swap"));
    let mut args = vec!["run", "--limit", limit, "--swapfile", swap.to_str().unwrap(), "--"];
    args.extend_from_slice(cmd);
    let o = zmem(&args, env, secs);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains(want), "{}", text(&o));
    o
}

pub(crate) fn run_managed_env(
    name: &str,
    limit: &str,
    cmd: &[&str],
    env: &[(&str, &str)],
    want: &str,
    secs: u64,
) -> Output {
    let stats = tmpdir(&format!("{name}-stats"));
    let mut env = env.to_vec();
    env.extend([("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "50")]);
    let o = run_checked(name, limit, cmd, &env, want, secs);
    let (adopted, evicted) = (pager_max(&stats, "adopted_bytes"), pager_max(&stats, "evicted_folios"));
    assert!(adopted >= 16 << 20 && evicted > 0, "adopted {adopted} B, evicted {evicted} folios; {}", text(&o));
    o
}

/// The anonymous memory of every process in `root`'s tree (itself and its
/// descendants), in bytes, as the kernel counts it (`RssAnon`).
pub(crate) fn tree_rss_anon(root: u32) -> u64 {
    let mut children: std::collections::HashMap<u32, Vec<u32>> = std::collections::HashMap::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let Some(ppid) = stat.rfind(')').and_then(|i| stat[i + 2..].split_whitespace().nth(1)?.parse().ok()) else {
            continue;
        };
        children.entry(ppid).or_default().push(pid);
    }
    let (mut todo, mut total) = (vec![root], 0);
    while let Some(p) = todo.pop() {
        todo.extend(children.get(&p).into_iter().flatten());
        let status = std::fs::read_to_string(format!("/proc/{p}/status")).unwrap_or_default();
        let kb = status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok());
        total += kb.unwrap_or(0) << 10;
    }
    total
}

/// Waits for `child` (a `zmem run`) and its output, sampling the
/// anonymous memory of its whole tree ([`tree_rss_anon`]) every `every`
/// meanwhile, for `secs` at most; the output and the peak sampled.
pub(crate) fn output_with_rss_peak(child: std::process::Child, every: Duration, secs: u64) -> (Output, u64) {
    let root = child.id();
    let sampler = std::thread::spawn(move || {
        let mut peak = 0;
        let deadline = Instant::now() + Duration::from_secs(secs);
        while Path::new(&format!("/proc/{root}")).exists() && Instant::now() < deadline {
            if std::fs::read_to_string(format!("/proc/{root}/stat")).is_ok_and(|s| s.contains(") Z")) {
                break;
            }
            peak = peak.max(tree_rss_anon(root));
            std::thread::sleep(every);
        }
        peak
    });
    let o = child.wait_with_output().unwrap();
    (o, sampler.join().unwrap())
}
