//! Process trees: fork, vfork, daemons, exec with environments of the
//! program's making, and one limit shared by the whole tree.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// fork three ways: a child that checks and changes its copy, a
/// multiprocessing pool (fork) reading the parent's blocks, and a daemon
/// that double-forks and checks everything after its first parent exited.
/// Its imports, then [`PY_BLOCKS`], then the checks.
const PY_FORK: &str = r#"
import ctypes, hashlib, json, os, sys, time, multiprocessing as mp
"#;
const PY_FORK_CHECKS: &str = r#"
def check(i):
    return blocks[i][:8] == i.to_bytes(8, 'little') and blocks[i][8:] == text[8:]
# A forked process's pager adopts what it inherited from its reclaim
# thread's first scan: wait (bounded) until its own stats say so.
stats = ctypes.CDLL(None).zmem_stats_json
stats.argtypes, stats.restype = [ctypes.c_char_p, ctypes.c_size_t], ctypes.c_ssize_t
def adopted():
    buf = ctypes.create_string_buffer(1 << 16)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        n = stats(buf, len(buf))
        assert 0 < n < len(buf), n
        if json.loads(buf.value)['pager']['adopted_bytes'] >= mib << 20:
            return True
        time.sleep(0.01)
    return False
worker_adopted = None
def worker_init():
    global worker_adopted
    worker_adopted = adopted()
def worker_check(i):
    return worker_adopted and check(i)
pid = os.fork()
if pid == 0:
    if not adopted():
        os._exit(4)
    ok = all(check(i) for i in range(mib))
    for b in blocks:
        b[8:16] = b'childxxx'
    ok = ok and all(b[8:16] == b'childxxx' for b in blocks)
    os._exit(0 if ok else 3)
for b in blocks[::2]:
    b[16:24] = b'parentxx'
_, st = os.waitpid(pid, 0)
assert st == 0, ('child', st)
for i, b in enumerate(blocks):
    b[16:24] = text[16:24]
    assert check(i), ('parent', i)
with mp.get_context('fork').Pool(2, initializer=worker_init) as pool:
    assert all(pool.map(worker_check, range(mib), chunksize=8)), 'pool'
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    if os.fork() == 0:
        os.close(r)
        time.sleep(0.3)
        ok = os.getppid() != pid and adopted() and all(check(i) for i in range(mib))
        os.write(w, b'ok' if ok else b'bad')
        os._exit(0)
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
got = os.read(r, 8)
assert got == b'ok', got
print("fork ok", mib)
"#;

/// Python with 128 MiB of blocks under 32M (4x) forks a child that checks
/// and rewrites them, a `multiprocessing` fork pool whose workers check
/// them, and a double-forking daemon that checks them after its first
/// parent has exited. Every forked process runs a pager of its own: the
/// child, each pool worker and the daemon wait (through
/// `zmem_stats_json`) until theirs has adopted what they inherited before
/// they check it, and fail if it never does (the parent evicted:
/// `run_managed` checks). Both ways a fork can go: loading every evicted
/// page back first (the default), and with `ZMEM_FORK_EVENT=1`, where no
/// fork loads anything back and each child takes its evicted pages over
/// from its parent.
#[test]
fn forked_children_pools_and_daemons_see_the_parents_memory() {
    let py = [PY_FORK, PY_BLOCKS, PY_FORK_CHECKS].concat();
    for (name, event) in [("py-fork", "0"), ("py-fork-event", "1")] {
        let cmd = ["python3", "-c", &py, "128"];
        let o = run_managed_env(name, "32M", &cmd, &[("ZMEM_FORK_EVENT", event)], "fork ok 128", 300);
        let stats = tmpdir(&format!("{name}-stats"));
        let (loads, handed, imported) = (
            pager_max(&stats, "fork_loads"),
            pager_max(&stats, "fork_handovers"),
            pager_max(&stats, "fork_imported_pages"),
        );
        if event == "1" {
            assert!(loads == 0 && handed > 0 && imported > 0, "{loads} {handed} {imported}: {}", text(&o));
        } else {
            assert!(loads > 0 && handed == 0, "{loads} {handed}: {}", text(&o));
        }
    }
}

/// With `ZMEM_FORK_EVENT=1`, a child's new pager starts its threads while
/// the child's evicted pages are not in place yet. glibc's start_thread
/// reads the locale the program set (Python's `setlocale`: its data is in
/// the heap) before any zmem code runs on the new thread, and a fault there
/// once the parent had handed over waited for the very handler being
/// started: the child hung, its creating thread spinning in
/// pthread_create. And the child's pages past a region's last whole folio
/// (the heap's end, cut mid-folio by glibc's trim) read as zeros there:
/// glibc aborted on a corrupt heap. Python with 64 MiB under 32M, after
/// threads came and went, forks ten times; each child reads everything.
#[test]
fn forked_children_with_the_fork_event_start_their_pagers_and_keep_their_heap() {
    let py = r#"
import os, sys, threading
def deep(n):
    return 0 if n == 0 else 1 + deep(n - 1)
blob = [bytearray(os.urandom(64)) * (1 << 14) for _ in range(int(sys.argv[1]))]
sums = [hash(bytes(b)) for b in blob]
for rnd in range(10):
    ts = [threading.Thread(target=deep, args=(500,)) for _ in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    for b in blob:
        b[5] ^= 1
    sums = [hash(bytes(b)) for b in blob]
    pid = os.fork()
    if pid == 0:
        os._exit(0 if [hash(bytes(b)) for b in blob] == sums else 3)
    _, st = os.waitpid(pid, 0)
    assert st == 0, ('child', rnd, st)
print("event forks ok")
"#;
    let env = [("ZMEM_FORK_EVENT", "1"), ("LC_ALL", "C.UTF-8")];
    run_managed_env("py-fork-event-threads", "32M", &["python3", "-c", py, "64"], &env, "event forks ok", 120);
}

/// A forking server with `ZMEM_FORK_EVENT=1`, ten children at a time, far
/// under its limit: what a child inherited is its parent's too, and is
/// charged to the parent only. Each child was charged for all of it until
/// its reclaim first tried those folios; with ten at once every child's
/// share of the tree's limit shrank to a few MiB, reclaim found nothing it
/// could evict, and 17 of the 40 children warned that their limit turned
/// soft, under a 512M limit with ~100 MiB in use. Every answer is checked
/// against the parent's own.
#[test]
fn a_forking_servers_children_are_not_charged_for_what_they_inherit() {
    let py = r#"
import socketserver, socket, threading, hashlib
big = [hashlib.sha1(str(i).encode()).hexdigest() * 4 for i in range(300000)]
def answer(n):
    h = hashlib.sha256()
    for s in big[n::97]:
        h.update(s.encode())
    return h.hexdigest()
class H(socketserver.StreamRequestHandler):
    def handle(self):
        self.wfile.write((answer(int(self.rfile.readline())) + "\n").encode())
class S(socketserver.ForkingMixIn, socketserver.TCPServer):
    allow_reuse_address = True
srv = S(("127.0.0.1", 0), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
out = {}
def ask(n):
    with socket.create_connection(("127.0.0.1", srv.server_address[1])) as c:
        c.sendall(f"{n}\n".encode())
        out[n] = c.makefile().readline().strip()
for batch in range(4):
    ts = [threading.Thread(target=ask, args=(batch * 10 + i,)) for i in range(10)]
    [t.start() for t in ts]
    [t.join() for t in ts]
srv.shutdown()
bad = [n for n in range(40) if out.get(n) != answer(n)]
assert not bad, bad
print("forking server ok", len(out))
"#;
    let o = zmem(&["run", "--limit", "512M", "--", "python3", "-c", py], &[("ZMEM_FORK_EVENT", "1")], 120);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("forking server ok 40"), "{}", text(&o));
    assert!(!err.contains("cannot get down"), "a child turned soft far under the limit: {err}");
}

/// Python's `multiprocessing` pools under 32M, with a parent that holds
/// most of the limit: each worker hashes its part of the parent's list
/// (inherited, charged to the parent) and fills 16 MiB of its own. Workers
/// got shares of 2-3 MiB, a few MiB of pool and metadata over them and
/// nothing to evict, and one of them warned that its limit turned soft (4
/// runs in 5), while the tree as a whole kept to its limit. Both ways a
/// pool starts its workers: forked from the program, and from a fork server.
#[test]
fn multiprocessing_pools_under_a_tight_limit_run_without_a_soft_limit_warning() {
    let py = r#"
import multiprocessing as mp, hashlib, sys
data = [("key%09d" % i) * 3 for i in range(int(sys.argv[2]))]
def digest(k):
    h = hashlib.sha256()
    for s in data[k::8]:
        h.update(s.encode())
    return h.hexdigest()
def work(k):
    big = bytearray(16 << 20)
    for j in range(0, len(big), 4096):
        big[j] = (j // 4096 + k) & 255
    return k, digest(k), sum(big[::4096])
if __name__ == "__main__":
    with mp.get_context(sys.argv[1]).Pool(4) as p:
        got = sorted(p.map(work, range(8)))
    want = [(k, digest(k), sum((j + k) & 255 for j in range(4096))) for k in range(8)]
    assert got == want, (got, want)
    print("pool ok", len(got))
"#;
    // A file, not `-c`: a fork server's workers import the main module.
    let script = tmpdir("mp-pool").join("pool.py");
    std::fs::write(&script, py).unwrap();
    let script = script.to_str().unwrap();
    for how in ["fork", "forkserver"] {
        let o = zmem(&["run", "--limit", "32M", "--", "python3", script, how, "600000"], &[], 180);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("pool ok 8"), "{how}: {}", text(&o));
        assert!(!err.contains("cannot get down"), "{how}: a worker warned of a soft limit: {err}");
    }
}

/// vfork (CPython's subprocess) and posix_spawn run no atfork handlers:
/// while 96 MiB of blocks are evicted under 32M, the program starts 40
/// children each way, and every block reads back.
#[test]
fn vfork_and_posix_spawn_children_run_while_memory_is_evicted() {
    let py = r#"
import os, subprocess, sys
mib = int(sys.argv[1])
blocks = [bytearray(os.urandom(64)) * (1 << 14) for _ in range(mib)]
sums = [hash(bytes(b)) for b in blocks]
for i in range(40):
    assert subprocess.run(["true"]).returncode == 0
    pid = os.posix_spawn("/bin/true", ["true"], os.environ)
    assert os.waitpid(pid, 0)[1] == 0
    b = blocks[(i * 7) % mib]
assert all(hash(bytes(b)) == s for b, s in zip(blocks, sums))
print("spawned ok", mib)
"#;
    run_managed("spawn", "32M", &["python3", "-c", py, "96"], "spawned ok 96", 300);
}

/// A C daemon (tests/data/daemon.c) that fills 4x the limit, double-forks
/// (its first parent exits at once, so `zmem run` returns), and from the
/// grandchild checks what it inherited, rewrites all of it and checks
/// again. The daemon's memory is managed by a pager of its own (it evicts,
/// with the limit a quarter of what it rewrites) and it reads back every
/// word.
#[test]
fn a_double_forking_daemon_keeps_its_data_and_its_memory_stays_managed() {
    let exe = compile_c("daemon");
    // Both ways a fork can go; with the FORK event, a first parent that
    // exits at once took the child's userfaultfd with it (13.7M bad words)
    // until the parent's fork waited for the hand-over.
    for (name, event) in [("daemon", "0"), ("daemon-event", "1")] {
        let (swap, stats) = (tmpdir(&format!("{name}-swap")), tmpdir(&format!("{name}-stats")));
        let out = tmpdir(name).join("result");
        let _ = std::fs::remove_file(&out);
        let o = zmem(
            &["run", "--limit", "32M", "--swapfile", swap.to_str().unwrap(), "--", exe.to_str().unwrap(), "128"]
                .into_iter()
                .chain([out.to_str().unwrap()])
                .collect::<Vec<_>>(),
            &[
                ("ZMEM_STATS_DIR", stats.to_str().unwrap()),
                ("ZMEM_STATS_INTERVAL_MS", "50"),
                ("ZMEM_FORK_EVENT", event),
            ],
            120,
        );
        assert!(o.status.success(), "{}", text(&o));
        let first = o.status;
        // About 10 s alone; several times that beside the other real-program
        // tests on two cores.
        let deadline = Instant::now() + Duration::from_secs(300);
        while !out.exists() {
            assert!(Instant::now() < deadline, "the daemon wrote no result; zmem run exited {first}");
            std::thread::sleep(Duration::from_millis(100));
        }
        let result = std::fs::read_to_string(&out).unwrap();
        assert_eq!(result.trim(), "128 MiB checked twice, 0 bad words", "ZMEM_FORK_EVENT={event}");
        // The daemon's stats file (the last to be written) shows its own pager
        // adopted what it inherited and evicted.
        std::thread::sleep(Duration::from_millis(200));
        let daemon = std::fs::read_dir(&stats)
            .unwrap()
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
            .filter_map(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .max_by_key(|v| v["pager"]["load_faults"].as_u64())
            .unwrap();
        let p = &daemon["pager"];
        assert!(
            p["evicted_folios"].as_u64() > Some(0) && p["adopted_bytes"].as_u64() >= Some(64 << 20),
            "ZMEM_FORK_EVENT={event}: {daemon}\nstderr: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// Each process's pool is bounded by its share of the tree's limit, not by
/// the whole limit: two exec'd Python children each hold 96 MiB of text
/// (it compresses, so most of it ends in the pools) under one 64M limit.
/// With every pool allowed half the tree's limit, the pools alone filled
/// the tree, nothing was left to evict, and the limit went soft (node's
/// `child_process.fork` workers did this).
#[test]
fn each_pool_follows_its_share_of_the_tree_limit() {
    let stats = tmpdir("pool-share-stats");
    let swap = tmpdir("pool-share-swap");
    let parent = format!(
        "import subprocess, sys\n\
         ps = [subprocess.Popen([sys.executable, '-c', {PY:?}, '96'], env=dict(__import__('os').environ, HOLD='1'), \
         stdout=subprocess.PIPE) for _ in range(2)]\n\
         outs = [p.communicate()[0].decode() for p in ps]\n\
         assert all(p.returncode == 0 for p in ps), outs\n\
         print('children:', ' '.join(o.strip() for o in outs))\n"
    );
    let o = zmem(
        &["run", "--limit", "64M", "--swapfile", swap.to_str().unwrap(), "--", "python3", "-c", &parent],
        &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "50")],
        300,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("children: ok 96 ok 96"), "{}", text(&o));
    assert!(pager_max(&stats, "evicted_folios") > 1000, "{}", text(&o));
    let written = stats_max(&stats, |v| v["tier"]["written_back_pages"].as_u64());
    assert!(written > 0, "the pools wrote back to stay within their shares; {}", text(&o));
    assert_eq!(pager_max(&stats, "limit_soft_events"), 0, "the limit never went soft; {}", text(&o));
    assert_tree_peak_within(&stats, 0, 64 << 20, &text(&o));
}

/// stress-ng's vm stressor: two forked workers, each filling and verifying
/// 96 MiB, under one 64M limit for the whole tree. Each process runs a
/// pager of its own (a forked child starts one); the limit is shared
/// through the tree's segment. Checked: stress-ng's own verification, that
/// the workers evicted, that the tree's summed usage (as the processes
/// published it) stayed within the limit plus slack, and that what the
/// kernel counts (RssAnon over every process of the tree, sampled every
/// 20 ms) did too: the limit plus zmem's own memory outside the limit in
/// each process (its heap, the mempool's free pages, staging, stacks),
/// 28 MiB for three. It peaked at 83–85 MiB; 87–88 MiB while each mempool
/// kept 4.25 MiB of free pages whatever its pool's limit.
/// Without a tree limit each worker took the whole limit (2x).
#[test]
fn stress_ng_vm_workers_share_one_limit_for_the_whole_tree() {
    let stats = tmpdir("stress-stats");
    let swap = tmpdir("stress-swap");
    let child = Command::new(zmem_exe())
        .args(["run", "--limit", "64M", "--swapfile", swap.to_str().unwrap(), "--"])
        .args(["stress-ng", "--vm", "2", "--vm-bytes", "96M", "--verify", "--timeout", "8s"])
        .env("ZMEM_PRELOAD", preload())
        .env("ZMEM_STATS_DIR", &stats)
        .env("ZMEM_STATS_INTERVAL_MS", "50")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("stress-ng (Debian's; .ci/run installs it)");
    let (o, rss_peak) = output_with_rss_peak(child, Duration::from_millis(20), 120);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("successful run completed"), "{}", text(&o));
    let evicted = pager_max(&stats, "evicted_folios");
    assert!(evicted > 0, "{}", text(&o));
    let tree_peak = assert_tree_peak_within(&stats, 32 << 20, 64 << 20, &text(&o));
    eprintln!("evicted {evicted} folios; tree usage peak {} MiB; RssAnon peak {} MiB", tree_peak >> 20, rss_peak >> 20);
    assert!(rss_peak <= (64 + 28) << 20, "RssAnon over the tree peaked at {} MiB", rss_peak >> 20);
}

/// A child started with an environment its parent made (Python's
/// `subprocess.run(env=...)`, through vfork and execve; `env -i` and `env
/// LD_PRELOAD=...`, through execvp; `os.posix_spawn`) keeps the shim and
/// the tree's settings, so it stays under the tree's limit, as a child of
/// a process in a memory cgroup stays in the cgroup. Before, each such
/// child ran unmanaged, 160 MiB under a 64M limit. A child given
/// `ZMEM_DISABLE` is let go.
#[test]
fn a_child_with_an_environment_of_its_parents_making_stays_under_the_limit() {
    let jemalloc = jemalloc();
    let jemalloc = jemalloc.to_str().unwrap();
    let script = r#"
import os, subprocess, sys
child = r"""
import os, re, sys
blocks = []
for i in range(160):
    seed = os.urandom(64)
    blocks.append((seed, bytearray(seed) * (1 << 14)))
ok = all(b == bytearray(s) * (1 << 14) for s, b in blocks)
rss = int(re.search(r'VmRSS:\s+(\d+)', open('/proc/self/status').read()).group(1)) >> 10
pre = os.environ.get('LD_PRELOAD', '').split()
print('child', sys.argv[1], 'ok', ok, 'rss', rss, 'shim', bool(pre) and pre[0].endswith('libzmem_preload.so'),
      'others', ' '.join(pre[1:]) or '-', 'tree', 'ZMEM_TREE' in os.environ, flush=True)
"""
py = sys.executable
subprocess.run([py, "-c", child, "subprocess-env"], env={"PATH": "/usr/bin:/bin"}, check=True)
subprocess.run(["env", "-i", py, "-c", child, "env-i"], check=True)
subprocess.run(["env", "LD_PRELOAD=" + sys.argv[1], py, "-c", child, "env-preload"], check=True)
pid = os.posix_spawn(py, [py, "-c", child, "posix_spawn"], {"PATH": "/usr/bin"})
assert os.waitpid(pid, 0)[1] == 0
subprocess.run([py, "-c", child, "disabled"], env={"ZMEM_DISABLE": "1"}, check=True)
print("parent done")
"#;
    let o = run_checked("exec-env", "64M", &["python3", "-c", script, jemalloc], &[], "parent done", 240);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let child = |label: &str| -> Vec<String> {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("child {label} ")))
            .unwrap_or_else(|| panic!("{label}: {}", text(&o)));
        line.split_whitespace().map(str::to_string).collect()
    };
    // child LABEL ok X rss N shim X others X tree X
    for label in ["subprocess-env", "env-i", "env-preload", "posix_spawn"] {
        let f = child(label);
        let rss: u64 = f[5].parse().unwrap();
        assert_eq!((f[3].as_str(), f[7].as_str(), f[11].as_str()), ("True", "True", "True"), "{label}: {}", text(&o));
        assert!(rss < 100, "{label}: {rss} MiB resident under a 64M limit; {}", text(&o));
    }
    assert_eq!(child("env-preload")[9], jemalloc, "the program's own preload is kept, after the shim");
    let off = child("disabled");
    let rss: u64 = off[5].parse().unwrap();
    assert_eq!((off[3].as_str(), off[7].as_str(), off[11].as_str()), ("True", "False", "False"), "{}", text(&o));
    assert!(rss > 150, "ZMEM_DISABLE lets the child go: {rss} MiB; {}", text(&o));
}

/// A fork gives the child what the kernel would, whatever the program
/// advised on part of a managed mapping, in both ways zmem forks (a
/// load-back and a hand-over, `ZMEM_FORK_EVENT=1`). With a hand-over the
/// child read the parent's evicted pages where `MADV_WIPEONFORK` gave it
/// an empty mapping (a random generator's state, with BoringSSL), and
/// zeros past any split of the mapping (a `madvise` or `mprotect` on
/// part of it: `MADV_HUGEPAGE` here), about 21 MB of 32; after a
/// `MADV_DONTFORK` half it adopted its own pager's mappings there and hung.
#[test]
fn a_forked_child_gets_what_the_kernel_gives_where_part_of_a_mapping_is_wiped_not_copied_or_split() {
    let exe = compile_c("fork_advice");
    for event in ["0", "1"] {
        for advice in ["18", "10", "14"] {
            let o = zmem(
                &["run", "--limit", "32M", "--", exe.to_str().unwrap(), advice],
                &[("ZMEM_FORK_EVENT", event)],
                60,
            );
            let what = format!("ZMEM_FORK_EVENT={event}, advice {advice}: {}", text(&o));
            assert_eq!(o.status.code(), Some(0), "{what}");
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(out.contains("child: 0 nonzero bytes wiped, 0 bad bytes"), "{what}");
            assert!(out.contains("parent: 0 bad bytes, child ok"), "{what}");
            assert!(!String::from_utf8_lossy(&o.stderr).contains("could not"), "{what}");
        }
    }
}
