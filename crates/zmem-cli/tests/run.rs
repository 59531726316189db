//! `zmem run` and `zmem stats` on real programs: a C program and python3,
//! each allocating 4x its limit, every byte checked by the program itself.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The shim next to the zmem binary, built (same profile, a no-op when it is
/// up to date) since the test build does not produce the cdylib itself, and
/// a stale one would test old code.
fn preload() -> PathBuf {
    static SO: OnceLock<PathBuf> = OnceLock::new();
    SO.get_or_init(|| {
        let dir = Path::new(env!("CARGO_BIN_EXE_zmem")).parent().unwrap().to_path_buf();
        let so = dir.join("libzmem_preload.so");
        {
            let mut c = Command::new(env!("CARGO"));
            c.args(["build", "-p", "zmem-preload"]);
            if dir.ends_with("release") {
                c.arg("--release");
            }
            let target = dir.parent().unwrap();
            c.env("CARGO_TARGET_DIR", target).current_dir(env!("CARGO_MANIFEST_DIR"));
            assert!(c.status().expect("cargo build -p zmem-preload").success());
        }
        assert!(so.is_file(), "{} was not built", so.display());
        so
    })
    .clone()
}

/// This run's directory for the tests' files: removed as the test binary
/// exits (a run left ~100 directories behind in /tmp, 190 MiB over a few
/// hundred runs).
fn test_root() -> PathBuf {
    std::env::temp_dir().join(format!("zmem-run-test-{}", std::process::id()))
}

extern "C" fn remove_test_root() {
    let _ = std::fs::remove_dir_all(test_root());
}

/// `NAME`'s directory under [`test_root`].
fn tmpdir(name: &str) -> PathBuf {
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
fn tmpdir_for_all(name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let d = tmpdir(name);
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    d
}

/// Runs `zmem ARGS` with `env`, killing it after `secs` (a hang fails),
/// with every process it started: a hung program left behind would load a
/// core for the tests that follow.
fn zmem(args: &[&str], env: &[(&str, &str)], secs: u64) -> Output {
    zmem_in(Path::new("."), args, env, secs)
}

/// `zmem ARGS` with DIR as its working directory.
fn zmem_in(dir: &Path, args: &[&str], env: &[(&str, &str)], secs: u64) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zmem"));
    c.current_dir(dir);
    c.args(args).env("ZMEM_PRELOAD", preload());
    for (k, v) in env {
        c.env(k, v);
    }
    output_within(&mut c, secs, &format!("zmem {args:?}"))
}

/// `c`'s output, in a process group of its own, killed with the group
/// after `secs` (a hang fails, as `what`).
fn output_within(c: &mut Command, secs: u64, what: &str) -> Output {
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
fn wait_or_kill_group(child: &mut std::process::Child, secs: u64, what: &str) {
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
fn group_threads(pgid: u32) -> String {
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

fn text(o: &Output) -> String {
    format!("stdout: {}\nstderr: {}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// `tests/data/NAME.c`, compiled.
fn compile_c(name: &str) -> PathBuf {
    compile_c_with(name, &[])
}

/// `tests/data/NAME.c`, compiled with the extra flags `flags`.
fn compile_c_with(name: &str, flags: &[&str]) -> PathBuf {
    let exe = tmpdir(&format!("cc-{name}")).join(name);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/{name}.c"));
    let st =
        Command::new("cc").arg("-O2").args(flags).arg("-o").arg(&exe).arg(src).status().expect("a C compiler (cc)");
    assert!(st.success());
    exe
}

fn compile_alloc() -> PathBuf {
    compile_c("alloc")
}

#[test]
fn a_c_program_allocating_4x_its_limit_reads_everything_back() {
    let exe = compile_alloc();
    run_checked("c", "32M", &[exe.to_str().unwrap(), "128"], &[], "128 MiB checked, 0 bad words", 240);
}

/// A library constructor runs with the dynamic loader's lock held; this one
/// writes and reads back 3x the limit, so zmem evicts and loads while the
/// program holds that lock. The handler's first load used to register a
/// thread-local's destructor, which waits for that lock: the program hung
/// for good (as a Python import did, faulting on a folio reclaim was
/// evicting). Checked: it hangs with the build before `buffers.rs`.
#[test]
fn a_library_constructor_under_the_loaders_lock_pages_through_the_limit() {
    let dir = tmpdir("dlopen");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/dlopen.c");
    let (lib, exe) = (dir.join("libtouch.so"), dir.join("dlopen"));
    let st =
        Command::new("cc").args(["-O2", "-shared", "-fPIC", "-pthread", "-DLIB", "-o"]).arg(&lib).arg(&src).status();
    assert!(st.expect("a C compiler (cc)").success());
    let st = Command::new("cc").args(["-O2", "-o"]).arg(&exe).arg(&src).arg("-ldl").status().unwrap();
    assert!(st.success());
    let (exe, lib) = (exe.to_str().unwrap(), lib.to_str().unwrap());
    let o = run_checked("dlopen", "32M", &[exe, lib], &[], "constructor: its thread ran", 120);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("constructor: 96 MiB checked, 0 bad words") && out.contains("loaded"), "{}", text(&o));
}

const PY: &str = r#"
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

#[test]
fn python_allocating_4x_its_limit_reads_everything_back() {
    run_checked("py", "32M", &["python3", "-c", PY, "128"], &[], "ok 128", 300);
}

/// Relative directories name places under `zmem run`'s working directory,
/// not under whatever directory the program later moves to.
#[test]
fn relative_swap_and_stats_directories_survive_the_program_changing_directory() {
    let dir = tmpdir("relative");
    std::fs::create_dir_all(dir.join("swap")).unwrap();
    std::fs::create_dir_all(dir.join("stats")).unwrap();
    let o = zmem_in(
        &dir,
        &["run", "--limit", "16M", "--swapfile", "swap", "--", "sh", "-c", "cd / && exec python3 -c \"$0\" 48", PY],
        &[("ZMEM_STATS_DIR", "stats"), ("ZMEM_STATS_INTERVAL_MS", "50")],
        300,
    );
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok 48"), "{}", text(&o));
    assert!(!String::from_utf8_lossy(&o.stderr).contains("shim is off"), "{}", text(&o));
    assert!(pager_max(&dir.join("stats"), "evicted_folios") > 0, "{}", text(&o));
}

/// `argv[1]` MiB of distinct 1 MiB blocks of text (`blocks`, built from
/// `text`), for the Python programs below that check every block.
const PY_BLOCKS: &str = r#"
mib = int(sys.argv[1])
text = b''.join(hashlib.sha256(i.to_bytes(4, 'little')).hexdigest().encode() for i in range(16384))
blocks = []
for i in range(mib):
    b = bytearray(text)
    b[:8] = i.to_bytes(8, 'little')
    blocks.append(b)
"#;

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

/// A thread's stack, once the thread has exited, stays mapped for the next
/// thread (glibc's stack cache), which may be zmem's: it is never managed.
/// It was forgotten at exit, and the next scan adopted it. Python starts
/// four threads at once, joins them, and reads the kernel's userfaultfd
/// flag (`um` in smaps) on their stacks a second later.
#[test]
fn the_stacks_of_threads_that_exited_are_never_managed() {
    let py = r#"
import threading, time
def anon():
    # Thread stacks: anonymous, read-write, right above a one-page guard.
    out, guard = set(), None
    for l in open('/proc/self/maps'):
        f = l.split()
        a, b = (int(x, 16) for x in f[0].split('-'))
        if f[1] == 'rw-p' and len(f) == 5 and guard == a:
            out.add((a, b))
        guard = b if f[1] == '---p' and b - a == 4096 else None
    return out
bar = threading.Barrier(4)
def deep(n):
    if n == 0:
        bar.wait()
        return 0
    return 1 + deep(n - 1)
before = anon()
ts = [threading.Thread(target=deep, args=(500,)) for _ in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
stacks = sorted(anon() - before)
assert len(stacks) == 4, stacks
time.sleep(1)
flags, cur = {}, None
for l in open('/proc/self/smaps'):
    f = l.split()
    if '-' in f[0] and len(f) >= 5:
        cur = tuple(int(x, 16) for x in f[0].split('-'))
    elif f[0] == 'VmFlags:':
        flags[cur] = f[1:]
managed = [s for s in stacks if 'um' in flags.get(s, [])]
assert not managed, ('dead threads stacks managed', managed)
print("stacks ok", len(stacks))
"#;
    let o = zmem(&["run", "--limit", "64M", "--", "python3", "-c", py], &[], 120);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("stacks ok 4"), "{}", text(&o));
}

/// With `ZMEM_STACKS=1` a thread's stack is managed while the thread runs
/// (4 MiB of data on each of four, evicted under the limit, reads back),
/// and given back when it exits: glibc keeps the stack for its next
/// thread, which may be zmem's, and no stack may still be registered then.
/// Two rounds, so the second runs on the first's cached stacks. Before
/// `Pager::release`, all four stayed managed. Without the variable no
/// stack is managed at all.
#[test]
fn with_managed_stacks_an_exiting_thread_gives_its_stack_back() {
    let exe = compile_c("stacks");
    let exe = exe.to_str().expect("utf-8 path");
    let o = zmem(&["run", "--limit", "32M", "--", exe], &[("ZMEM_STACKS", "1")], 120);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success() && out.contains("stacks ok"), "{}", text(&o));
    let rounds: Vec<&str> = out.lines().filter(|l| l.starts_with("round")).collect();
    assert_eq!(rounds.len(), 2, "{out}");
    for r in rounds {
        assert!(r.contains("stacks managed while running 4,") && r.contains("managed after exit 0"), "{out}");
        let pages_out: u64 = r
            .split("stack pages out ")
            .nth(1)
            .and_then(|x| x.split(',').next())
            .and_then(|x| x.trim().parse().ok())
            .unwrap_or(0);
        assert!(pages_out > 0, "no stack page was evicted: {out}");
    }
    let o = zmem(&["run", "--limit", "32M", "--", exe], &[], 120);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success() && out.contains("stacks managed while running 0,"), "{}", text(&o));
}

/// A program that closes every descriptor it did not open (Python's
/// `os.closerange`, as a daemon's `closefrom(3)` does) with 4x its limit
/// evicted, then opens and writes files of its own and fills more memory:
/// the pager's userfaultfd and swap file stay open (the shim's `close`
/// family steps over them), its files are its own, and every block reads
/// back, before and after the pressure that follows. Python crashed at once
/// (SIGSEGV) before.
#[test]
fn closing_every_descriptor_keeps_zmems_own_and_every_block() {
    let py = r#"
def bad():
    return sum(1 for i, b in enumerate(blocks) if b[:8] != i.to_bytes(8, 'little') or b[8:] != text[8:])
os.closerange(3, 65536)
d = tempfile.mkdtemp()
for i in range(8):
    with open(os.path.join(d, str(i)), 'wb') as f:
        f.write(bytes([i]) * 100000)
assert bad() == 0, 'after closerange'
more = [bytearray(os.urandom(64)) * (1 << 14) for _ in range(mib // 2)]
assert bad() == 0, 'after more pressure'
for i in range(8):
    with open(os.path.join(d, str(i)), 'rb') as f:
        assert f.read() == bytes([i]) * 100000, i
    os.unlink(os.path.join(d, str(i)))
os.rmdir(d)
print("closed ok", mib)
"#;
    let py = ["import hashlib, os, sys, tempfile\n", PY_BLOCKS, py].concat();
    run_managed("closefds", "32M", &["python3", "-c", &py, "128"], "closed ok 128", 300);
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
        assert!(p["evicted_folios"].as_u64() > Some(0) && p["adopted_bytes"].as_u64() >= Some(64 << 20), "{daemon}");
    }
}

/// glibc grows a chunk it mmapped with mremap(MAYMOVE), a raw syscall no
/// interposed call sees: zmem learns of it from REMAP and UNMAP events.
/// tests/data/mremap.c grows 48 such vectors side by side (the kernel
/// merges their mappings, so one adopted region spans several, and each
/// move splits it), in place and moved, and checks every word. It caught
/// three ways to read zeros: a split-off region dropping entries that
/// were another region's (the parent's holes, lead and tail), and a scan
/// adopting the moved mapping before its REMAP was read.
#[test]
fn vectors_grown_by_mremap_keep_every_word_as_regions_split_and_move() {
    let exe = compile_c("mremap");
    for folio in ["64K", "16K"] {
        run_managed_env(
            &format!("mremap-{folio}"),
            "40M",
            &[exe.to_str().unwrap(), "600000"],
            &[("ZMEM_FOLIO", folio)],
            "600000 steps, 0 bad words",
            300,
        );
    }
}

/// A program whose executable defines the malloc family (rustc links
/// jemalloc in) gets glibc's own allocations too, the loader looking in the
/// executable first: among them the TLS vectors of zmem's threads. Adopted
/// and evicted with the program's memory, they hung it: the handler faulted
/// on its own vector, reclaim on one in the folio it was evicting (`cargo
/// build` hung in its first rustc). Each zmem thread's vector is now
/// pinned, never evicted (`zmem_common::tls`). Checked: 4 GiB hung with the build before,
/// and 256 MiB in 1 run of 2.
#[test]
fn a_program_whose_executable_defines_malloc_pages_through_the_limit() {
    // -rdynamic: the executable's malloc is what the loader finds first.
    let exe = compile_c_with("own_malloc", &["-rdynamic"]);
    run_checked("own-malloc", "32M", &[exe.to_str().unwrap(), "512"], &[], "8192 blocks, 0 bad words", 180);
}

/// The C code inside the shim (zstd's contexts) calls `calloc` from zmem's
/// threads. Resolved the loader's way, that is the executable's `calloc`
/// where the executable defines one, and the handler hung in rustc's
/// jemalloc, faulting on its evicted metadata, once new stores switched to
/// zstd. The shim is linked `-Bsymbolic-functions` (`build.rs`), so those
/// calls bind to its own malloc family, which serves zmem's threads from
/// zmem's heap: no dynamic relocation of the shim may name one of them.
#[test]
fn the_shims_own_calls_of_the_malloc_family_are_bound_to_the_shim() {
    let so = preload();
    let o = Command::new("readelf").args(["-rW"]).arg(&so).output().expect("readelf (binutils)");
    assert!(o.status.success());
    let relocs = String::from_utf8_lossy(&o.stdout);
    assert!(relocs.contains("R_X86_64") || !cfg!(target_arch = "x86_64"), "no relocations read: {relocs}");
    for line in relocs.lines() {
        let sym = line.split_whitespace().nth(4).unwrap_or("");
        let name = sym.split('@').next().unwrap_or("");
        assert!(
            !["malloc", "calloc", "realloc", "free", "posix_memalign", "aligned_alloc", "memalign"].contains(&name),
            "the shim resolves {name} at run time, where an executable's own would win: {line}"
        );
    }
}

/// glibc's main heap grows by an internal sbrk that no preload sees; a scan
/// every 100 ms found the growth only once the program had filled it, and
/// usage went far over the limit (Python: a 69 MiB peak under 40M). The
/// shim adopts the growth as glibc's malloc returns (`adopt_brk_growth`).
/// tests/data/brk.c fills 256 MiB of 64 KiB blocks from the heap under a
/// 32M limit: every word reads back, and the tree's usage never went more
/// than a few reclaim batches over the limit.
#[test]
fn the_heap_grown_by_sbrk_is_managed_as_it_grows_and_usage_stays_near_the_limit() {
    let exe = compile_c("brk");
    let swap = tmpdir("brk-swap");
    let stats = tmpdir("brk-stats");
    let args = ["run", "--limit", "32M", "--swapfile", swap.to_str().unwrap(), "--", exe.to_str().unwrap(), "256"];
    let o = zmem(&args, &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "20")], 120);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("4096 blocks, 0 bad words"), "{}", text(&o));
    let evicted = pager_max(&stats, "evicted_folios");
    assert!(evicted > 2048, "evicted {evicted} folios; {}", text(&o));
    let peak = tree_peak(&stats);
    assert!(peak > 16 << 20 && peak <= 40 << 20, "tree usage peak {} MiB under 32M; {}", peak >> 20, text(&o));
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
    let peak = tree_peak(&stats);
    assert!(peak <= (64 + 12) << 20, "tree usage peak {} MiB under 64M; {}", peak >> 20, text(&o));
}

/// A statically linked program never loads the shim (no dynamic loader
/// runs in it): `zmem run` says so rather than leave the user to find out
/// that nothing was managed (a pure Go binary is one), and still runs it,
/// passing its output and exit status through.
#[test]
fn a_statically_linked_program_runs_with_a_warning_that_it_is_not_managed() {
    let dir = tmpdir("static");
    let src = dir.join("s.c");
    std::fs::write(&src, "#include <stdio.h>\nint main(void) { puts(\"static ran\"); return 7; }\n").unwrap();
    let exe = dir.join("s");
    let st = Command::new("cc").arg("-static").arg("-o").arg(&exe).arg(&src).status().expect("cc");
    assert!(st.success(), "cc -static (glibc's static libraries, from libc6-dev)");
    let o = zmem(&["run", "--limit", "32M", "--", exe.to_str().unwrap()], &[], 60);
    assert_eq!(o.status.code(), Some(7), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("static ran"), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("is statically linked"), "{}", text(&o));
    // A dynamic one gets no such warning.
    let o = zmem(&["run", "--limit", "32M", "--", "true"], &[], 60);
    assert!(o.status.success() && !String::from_utf8_lossy(&o.stderr).contains("statically"), "{}", text(&o));
}

/// Under `ulimit -v` the program runs and is managed: zmem's heap holds
/// little address space (it reserved 128 GiB up front, so the shim's first
/// allocation under `ulimit -v 8000000` aborted every program, and a bash
/// script that ran `ulimit -v 4000000` failed its next allocation).
#[test]
fn a_limited_address_space_is_enough_for_the_program_and_zmem() {
    // bash lowers its own limit, then keeps allocating.
    let script = "ulimit -v 4000000; x=$(seq 1 200000); a=($x); y=; for i in $(seq 1 3000); do y=$y$i; done; \
                  echo ${#x} ${#a[@]} ${#y}";
    let o = zmem(&["run", "--limit", "32M", "--", "bash", "-c", script], &[], 120);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("1288894 200000 10893"), "{}", text(&o));
    // Python under 400 MB of address space, 96 MiB of it its own data.
    let py = "import os\n\
              b = [bytearray(os.urandom(64) * 16384) for _ in range(96)]\n\
              print('ok', all(len(x) == 1 << 20 and x[:64] == x[-64:] for x in b))\n";
    let shell = format!("ulimit -v 400000 && exec python3 -c \"{py}\"");
    run_managed("ulimit-v", "32M", &["sh", "-c", &shell], "ok True", 120);
}

/// `unshare(CLONE_NEWUSER)` needs a process with one thread, and zmem's
/// made every managed process one (EINVAL: `unshare -r` and bubblewrap
/// failed). Python holds 96 MiB under 32M, most of it evicted, enters a new
/// user namespace through libc's `unshare` (the shim's), reads it all back
/// and writes 96 MiB more, which a new pager evicts; `unshare -r` runs a
/// managed program in one.
#[test]
fn a_process_enters_a_user_namespace_and_stays_managed() {
    let stats = tmpdir("userns-stats");
    let script = "import ctypes, os, time\n\
                  b = [bytearray(os.urandom(64) * 16384) for _ in range(96)]\n\
                  libc = ctypes.CDLL(None, use_errno=True)\n\
                  r = libc.unshare(0x10000000)\n\
                  print('unshare', r, ctypes.get_errno(), 'at', time.time_ns() // 1000000, flush=True)\n\
                  c = [bytearray(os.urandom(64) * 16384) for _ in range(96)]\n\
                  print('ok', all(len(x) == 1 << 20 and x[:64] == x[-64:] for x in b + c))\n";
    let o = zmem(
        &["run", "--limit", "32M", "--", "python3", "-c", script],
        &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "50")],
        120,
    );
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("unshare 0 0") && out.contains("ok True"), "{}", text(&o));
    // Written after the unshare, the stats file is the new pager's (the
    // old one's stats thread was joined before): its counters start at 0.
    let at: u64 = out.split(" at ").nth(1).and_then(|t| t.split_whitespace().next()?.parse().ok()).unwrap_or(u64::MAX);
    let evicted = stats_max(&stats, |v| {
        (v["updated_unix_ms"].as_u64()? > at).then(|| v["pager"]["evicted_folios"].as_u64()).flatten()
    });
    assert!(evicted > 500, "{evicted} folios evicted after the unshare; {}", text(&o));
    run_managed("unshare-r", "32M", &["unshare", "-r", "python3", "-c", script], "ok True", 120);
}

/// `setns` into a mount namespace wants a caller that shares its
/// filesystem context with no other thread (`nsenter -m` failed with EINVAL
/// under `zmem run`): as for a user namespace, zmem's threads step out.
#[test]
fn nsenter_into_a_mount_namespace_runs_a_managed_program() {
    let mut holder = Command::new("unshare").args(["-m", "sleep", "120"]).spawn().expect("unshare -m sleep");
    let pid = holder.id();
    let ours = std::fs::read_link("/proc/self/ns/mnt").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_link(format!("/proc/{pid}/ns/mnt")).is_ok_and(|l| l == ours) {
        assert!(Instant::now() < deadline, "unshare -m never made its namespace");
        std::thread::sleep(Duration::from_millis(5));
    }
    let script = "import os\n\
                  b = [bytearray(os.urandom(64) * 16384) for _ in range(96)]\n\
                  print('ok', all(len(x) == 1 << 20 and x[:64] == x[-64:] for x in b))\n";
    let target = pid.to_string();
    let cmd = ["nsenter", "-t", &target, "-m", "/usr/bin/python3", "-c", script];
    let _ = run_managed("nsenter-m", "32M", &cmd, "ok True", 120);
    let _ = holder.kill();
    let _ = holder.wait();
}

/// `setpriv --reuid --regid` (a container's usual entrypoint) drops its
/// uid keeping its capabilities (`PR_SET_KEEPCAPS`, `capset`: its thread
/// alone), then sets its gids: glibc made zmem's threads, which had lost
/// theirs, make the same call, and aborted the process when theirs failed.
/// The program it starts runs as nobody, managed.
#[test]
fn setpriv_drops_to_another_user_and_what_it_starts_is_managed() {
    use std::os::unix::fs::PermissionsExt;
    let stats = tmpdir("setpriv-stats");
    std::fs::set_permissions(&stats, std::fs::Permissions::from_mode(0o777)).unwrap();
    let script = "import os\n\
                  b = [bytearray(os.urandom(64) * 16384) for _ in range(96)]\n\
                  print('ok', all(len(x) == 1 << 20 and x[:64] == x[-64:] for x in b), os.getuid(), os.getgid())\n";
    let args = ["--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3", "-c", script];
    let mut cmd = vec!["run", "--limit", "32M", "--", "setpriv"];
    cmd.extend(args);
    let o = zmem(&cmd, &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "50")], 120);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("ok True 65534 65534"), "{}", text(&o));
    assert!(pager_max(&stats, "evicted_folios") > 500, "{}", text(&o));
}

/// A root program that gives up every capability (`capset`, which changes
/// its thread alone) leaves zmem's threads, in its address space, with
/// none either: they are made again with its sets. (They kept all of
/// root's.) Its memory stays managed.
#[test]
fn a_root_program_that_gives_up_its_capabilities_leaves_zmem_none() {
    let script = r#"
import ctypes, os, time
b = [bytearray(os.urandom(64) * 16384) for _ in range(96)]
libc = ctypes.CDLL(None, use_errno=True)
class H(ctypes.Structure): _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class D(ctypes.Structure): _fields_ = [("e", ctypes.c_uint32), ("p", ctypes.c_uint32), ("i", ctypes.c_uint32)]
r = libc.capset(ctypes.byref(H(0x20080522, 0)), (D * 2)())
def capeff(t):
    return [l.split()[1] for l in open(f'/proc/self/task/{t}/status') if l.startswith('CapEff')][0]
tasks = os.listdir('/proc/self/task')
print('capset', r, 'threads', len(tasks), 'with capabilities', sum(int(capeff(t), 16) != 0 for t in tasks))
c = [bytearray(os.urandom(64) * 16384) for _ in range(96)]
print('ok', all(len(x) == 1 << 20 and x[:64] == x[-64:] for x in b + c))
"#;
    let o = run_managed("capset", "32M", &["/usr/bin/python3", "-c", script], "ok True", 120);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("capset 0 threads") && out.contains("with capabilities 0"), "{}", text(&o));
    assert!(!out.contains("threads 1 "), "zmem's threads run again: {}", text(&o));
}

/// Under bubblewrap, with `/` read-only and a `/dev` of its own: the swap
/// file's directory is read-only, so the pager runs without writeback (the
/// shim was off), and the tree's segment, not in the sandbox's `/dev/shm`,
/// is reached through the descriptor `zmem run` left open (the process took
/// the whole limit to itself).
#[test]
fn a_program_in_a_bubblewrap_sandbox_is_managed_in_the_tree_without_writeback() {
    let stats = tmpdir("bwrap-stats");
    let dir = stats.to_str().unwrap();
    let script = "import os\n\
                  b = [bytearray(os.urandom(64) * 16384) for _ in range(96)]\n\
                  print('ok', all(len(x) == 1 << 20 and x[:64] == x[-64:] for x in b))\n";
    let sandbox = ["bwrap", "--unshare-user", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"];
    let mut args = vec!["run", "--limit", "32M", "--"];
    args.extend(sandbox);
    args.extend(["--bind", dir, dir, "python3", "-c", script]);
    let o = zmem(&args, &[("ZMEM_STATS_DIR", dir), ("ZMEM_STATS_INTERVAL_MS", "50")], 120);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("ok True"), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("runs without writeback") && !err.contains("whole limit"), "{}", text(&o));
    assert!(pager_max(&stats, "evicted_folios") > 500, "{}", text(&o));
    assert!(tree_peak(&stats) > 0, "the tree's segment was joined: {}", text(&o));
}

/// Under Valgrind (its synthetic CPU runs one thread at a time, so a
/// thread that touched an evicted page would hold up the handler that it
/// waits for: it hung) the shim stays off, says so, and the program runs.
#[test]
fn a_program_under_valgrind_runs_unmanaged_with_a_warning() {
    let exe = compile_alloc();
    let o = zmem(
        &["run", "--limit", "32M", "--", "valgrind", "-q", "--error-exitcode=9", exe.to_str().unwrap(), "48"],
        &[],
        300,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("48 MiB checked, 0 bad words"), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.matches("runs under Valgrind").count(), 1, "{}", text(&o));
}

/// Shared memory (a memfd: the JVM's ZGC keeps its heap in one) is never
/// managed: UFFDIO_MOVE takes private anonymous pages only. It is outside
/// the limit, so the stats show it and the process says so once, while its
/// private memory pages through the limit as ever. Python holds 48 MiB of
/// a memfd and writes 96 MiB of bytearrays under 32M; it leaves with
/// `os._exit`, so that the memfd is still mapped when its last stats file
/// is written (Python's own exit unmaps it first).
#[test]
fn shared_memory_is_left_alone_counted_and_warned_about() {
    let stats = tmpdir("shmem-stats");
    let script = "import mmap, os, time\n\
                  n = 48 << 20\n\
                  fd = os.memfd_create('heap')\n\
                  os.ftruncate(fd, n)\n\
                  m = mmap.mmap(fd, n)\n\
                  m.write(bytes(range(256)) * (n // 256))\n\
                  b = [bytearray(os.urandom(64) * 16384) for _ in range(96)]\n\
                  time.sleep(0.5)\n\
                  ok = all(m[i] == i % 256 for i in range(0, n, 4093)) and all(len(x) == 1 << 20 for x in b)\n\
                  print('shared', ok, flush=True)\n\
                  os._exit(0)\n";
    let o = zmem(
        &["run", "--limit", "32M", "--", "python3", "-c", script],
        &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "50")],
        180,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("shared True"), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.matches("which zmem does not manage").count(), 1, "one warning: {}", text(&o));
    let shmem = stats_max(&stats, |v| v["footprint"]["shmem_bytes"].as_u64());
    assert!(shmem >= 48 << 20, "shmem_bytes {shmem}; {}", text(&o));
    assert!(pager_max(&stats, "evicted_folios") > 500, "the bytearrays paged; {}", text(&o));
}

/// Memory the program locks (`MAP_LOCKED`, `mlock`) is never managed, while
/// its malloc'd memory is (tests/data/mlock.c reads its own smaps).
#[test]
fn locked_memory_is_never_managed() {
    let exe = compile_c("mlock");
    let o = run_managed("mlock", "32M", &[exe.to_str().unwrap()], "locked mappings registered: 0; 0 bad words", 120);
    assert!(o.status.success(), "{}", text(&o));
}

/// A SIGALRM handler reads random pages of 64 MiB under a 32M limit (most
/// are evicted) 10,000 times a second, while the program maps and unmaps
/// memory the shim adopts and manages (tests/data/signals.c). A handler
/// that ran inside the shim, on a thread holding the pager's region table,
/// waited for good for its fault: bash did, on SIGCHLD, mid-`realloc`.
#[test]
fn a_signal_handler_reading_evicted_memory_never_runs_inside_the_shim() {
    let exe = compile_c("signals");
    let o = run_managed("signals", "32M", &[exe.to_str().unwrap(), "64", "40"], "signals ok 40", 180);
    let handled: u64 =
        String::from_utf8_lossy(&o.stdout).split_whitespace().nth(3).and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(handled > 1000, "{handled} signals handled; {}", text(&o));
}

/// libjemalloc.so.2, from Debian's libjemalloc2 (installed by `.ci/run`).
fn jemalloc() -> PathBuf {
    let found = ["/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file());
    found.expect("libjemalloc.so.2 (Debian's libjemalloc2; .ci/run installs it)")
}

#[test]
fn python_on_jemalloc_keeps_its_own_allocator_and_reads_everything_back() {
    // The program's allocator is jemalloc: the shim hands it the whole
    // malloc family and manages what jemalloc maps.
    let swap = tmpdir("py-je-swap");
    let je = jemalloc();
    let py =
        format!("{PY}\nimport resource\nprint('maxrss_mib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)");
    let o = zmem(
        &["run", "--limit", "32M", "--swapfile", swap.to_str().unwrap(), "--", "python3", "-c", &py, "128"],
        &[("LD_PRELOAD", je.to_str().unwrap())],
        300,
    );
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("ok 128"), "{}", text(&o));
    // 256 MiB went through jemalloc; what stayed resident is near the limit.
    let rss: u64 = out.split("maxrss_mib ").nth(1).and_then(|t| t.trim().parse().ok()).expect("maxrss line");
    assert!(rss < 110, "peak RSS {rss} MiB: jemalloc's memory was not managed; {}", text(&o));
}

/// redis-server on `port`, under zmem (`limit`) or as is, with its RDB in `dir`.
fn start_redis(port: u32, dir: &Path, limit: Option<&str>) -> std::process::Child {
    let swap = tmpdir("redis-swap");
    let mut c = match limit {
        Some(l) => {
            let mut c = Command::new(env!("CARGO_BIN_EXE_zmem"));
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
fn digest_as_is(port: u32, load: &[&str]) -> String {
    let mut native = start_redis(port, &tmpdir(&format!("redis-ref-{port}")), None);
    wait_for_redis(port, &mut native);
    assert_eq!(redis_cli(port, load), "OK");
    let want = redis_cli(port, &["debug", "digest"]);
    redis_cli(port, &["shutdown", "nosave"]);
    let _ = native.wait();
    want
}

fn redis_cli(port: u32, args: &[&str]) -> String {
    let o = Command::new("redis-cli").args(["-p", &port.to_string()]).args(args).output().expect("redis-cli");
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

fn wait_for_redis(port: u32, server: &mut std::process::Child) {
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

/// A PostgreSQL server under `zmem run`, as the `postgres` user when the
/// tests run as root (it refuses root); killed with its whole tree if a
/// check fails.
struct Postgres {
    bin: PathBuf,
    dir: PathBuf,
    /// `runuser …` or `zmem run` itself: the leader of the server's group.
    leader: std::process::Child,
    stats: PathBuf,
}

impl Postgres {
    /// `Command` for a PostgreSQL program, run as `postgres` under root
    /// (`runuser`, which is not set-uid: the shim loads in it).
    fn command(program: &Path) -> Command {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        }
    }

    fn start(limit: &str) -> Postgres {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL (Debian's postgresql; .ci/run installs it)")
            .flatten()
            .map(|e| e.path().join("bin"))
            .find(|b| b.join("postgres").is_file() && b.join("initdb").is_file())
            .expect("/usr/lib/postgresql/*/bin/postgres");
        let dir = tmpdir("postgres");
        let (swap, stats) = (dir.join("swap"), dir.join("stats"));
        for d in [&swap, &stats] {
            std::fs::create_dir_all(d).unwrap();
        }
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let st = Command::new("chown").args(["-R", "postgres"]).arg(&dir).status().unwrap();
            assert!(st.success(), "chown postgres {}", dir.display());
        }
        let data = dir.join("data");
        let o = Self::command(&bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .output()
            .unwrap();
        assert!(o.status.success(), "initdb: {}", text(&o));
        // As a root user starts a server that will not run as root: the
        // privileges drop inside the tree, which must still share one
        // limit (a process that could not open the tree's segment took the
        // whole limit to itself).
        let mut c = Command::new(env!("CARGO_BIN_EXE_zmem"));
        c.args(["run", "--limit", limit, "--swapfile", swap.to_str().unwrap(), "--"]);
        let server = Self::command(&bin.join("postgres"));
        c.arg(server.get_program()).args(server.get_args());
        // No TCP: a socket in the test's own directory.
        c.arg("-D").arg(&data).arg("-k").arg(&dir);
        c.args(["-c", "listen_addresses=", "-c", "shared_buffers=16MB", "-c", "fsync=off"]);
        c.env("ZMEM_PRELOAD", preload()).env("ZMEM_STATS_DIR", &stats).env("ZMEM_STATS_INTERVAL_MS", "50");
        // The server's log and zmem's warnings, in a file: a pipe nobody
        // reads would fill and stop the server.
        c.stdout(Stdio::null()).stderr(std::fs::File::create(dir.join("server.log")).unwrap());
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        let leader = c.spawn().unwrap();
        let mut pg = Postgres { bin, dir, leader, stats };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !pg.psql("select 1").status.success() {
            assert!(pg.leader.try_wait().unwrap().is_none(), "postgres exited at start");
            assert!(Instant::now() < deadline, "postgres did not start in 60 s");
            std::thread::sleep(Duration::from_millis(200));
        }
        pg
    }

    fn psql(&self, sql: &str) -> Output {
        Command::new("psql")
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-U", "postgres", "-h"])
            .arg(&self.dir)
            .args(["-c", sql])
            .output()
            .expect("psql")
    }

    /// `sql`'s output; a failed statement fails the test.
    fn query(&self, sql: &str) -> String {
        let o = self.psql(sql);
        assert!(o.status.success(), "{sql}: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// A fast shutdown; `zmem run` then ends with the server's status.
    /// Returns it.
    fn stop(&mut self) -> std::process::ExitStatus {
        let o = Self::command(&self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["stop", "-m", "fast"])
            .output()
            .unwrap();
        assert!(o.status.success(), "pg_ctl stop: {}", text(&o));
        exit_within(&mut self.leader, 30, || "zmem run did not end after the server stopped".into())
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        kill_group_if_running(&mut self.leader);
    }
}

/// `child`'s exit status, waited for up to `secs`; past that, fails with
/// `why`.
fn exit_within(child: &mut std::process::Child, secs: u64, why: impl Fn() -> String) -> std::process::ExitStatus {
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
fn kill_group_if_running(child: &mut std::process::Child) {
    if child.try_wait().ok().flatten().is_none() {
        // SAFETY: signals the process group the test made; kill(2) touches
        // no memory of ours.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        let _ = child.wait();
    }
}

/// PostgreSQL, a forking server (a process per connection, shared memory,
/// background workers), started as root does it (`zmem run -- runuser -u
/// postgres -- postgres …`), under one limit for the whole tree: a
/// backend sorts more than that limit in its private memory (`work_mem`),
/// and the result is what the same sort gives on disk (a 4 MB
/// `work_mem`: an external merge sort, little memory). A lost or stale
/// page changes the digest.
#[test]
fn postgres_sorts_past_the_tree_limit_and_agrees_with_a_sort_on_disk() {
    let mut pg = Postgres::start("48M");
    pg.query("create table t as select i, md5(i::text) as h from generate_series(1, 300000) i");
    let sort =
        |mem: &str| format!("set work_mem = '{mem}'; select count(*), md5(string_agg(h || i, ',' order by h)) from t");
    let on_disk = pg.query(&sort("4MB"));
    assert!(on_disk.starts_with("300000|"), "{on_disk}");
    assert_eq!(pg.query(&sort("256MB")), on_disk, "an in-memory sort under zmem disagrees with the sort on disk");
    let evicted = pager_max(&pg.stats, "evicted_folios");
    assert!(evicted > 500, "the backend's sort was not evicted ({evicted} folios)");
    // Every process of the tree joined it (a segment it could not open
    // would have left its peak at 0 in that process's stats).
    let peak = tree_peak(&pg.stats);
    assert!(peak > 0 && peak <= 52 << 20, "the tree's peak usage {peak} B is off its 48 MiB limit");
    let st = pg.stop();
    let log = std::fs::read_to_string(pg.dir.join("server.log")).unwrap();
    assert!(st.success(), "zmem run: {st:?}; {log}");
    assert!(!log.contains("takes the whole limit"), "{log}");
}

/// A user the kernel lets have userfaultfd for faults from user mode only
/// (`vm.unprivileged_userfaultfd=0`, its default, and no access to
/// `/dev/userfaultfd`): the kernel's own accesses to a page zmem has not
/// mapped, made for the program's system calls, fail with EFAULT there
/// rather than wait for zmem. The shim faults the buffers of the C
/// library's I/O calls in first, so that Python's `read`, `readinto`,
/// `write`, `send` and `recv_into` on 48 MiB buffers evicted under 16M
/// move every byte (each phase is checked by digest), and `sort` (stdio's
/// `fread` into a buffer of 64 MiB) sorts as it does without zmem. The
/// tree is told once what is left, with what to change. Run as `nobody`
/// from root (skipped otherwise, or where this machine gives `nobody`
/// more).
#[test]
fn a_user_with_userfaultfd_for_user_mode_only_reads_and_writes_evicted_buffers() {
    if !nobody_gets_user_mode_only() {
        return;
    }
    let dir = tmpdir_for_all("user-mode-only");
    let py = r#"
import hashlib, random, socket, threading
N = 48 << 20
b = bytearray(N)
r = random.Random(1)
for i in range(0, N, 4096):
    b[i:i + 64] = r.randbytes(64)
h = hashlib.md5(b).hexdigest()
with open('big', 'wb', buffering=0) as f:
    for off in range(0, N, 1 << 20):
        assert f.write(memoryview(b)[off:off + (1 << 20)]) == 1 << 20
assert hashlib.md5(open('big', 'rb').read()).hexdigest() == h, 'read'
c = bytearray(N)
for i in range(0, N, 4096):
    c[i] = 7
with open('big', 'rb', buffering=0) as f:
    got = 0
    while got < N:
        n = f.readinto(memoryview(c)[got:got + (3 << 20)])
        assert n > 0
        got += n
assert hashlib.md5(c).hexdigest() == h, 'readinto'
a, z = socket.socketpair()
def send():
    for off in range(0, N, 1 << 20):
        a.sendall(memoryview(b)[off:off + (1 << 20)])
t = threading.Thread(target=send)
t.start()
got = 0
while got < N:
    n = z.recv_into(memoryview(c)[got:], min(1 << 20, N - got))
    assert n > 0
    got += n
t.join()
assert hashlib.md5(c).hexdigest() == h, 'recv_into'
import os
print('moved', h, os.environ.get('GLIBC_TUNABLES'))
"#;
    let lines: String = (0..200_000u64).map(|i| format!("{:016x}\n", i.wrapping_mul(0x9e37_79b9_7f4a_7c15))).collect();
    std::fs::write(dir.join("lines"), &lines).unwrap();
    let mut sorted: Vec<&str> = lines.lines().collect();
    sorted.sort_unstable();
    let sorted = sorted.join("\n") + "\n";
    let zmem_as_nobody = |args: &[&str]| {
        let mut c = Command::new("runuser");
        c.args(["-u", "nobody", "--"]).arg(env!("CARGO_BIN_EXE_zmem"));
        c.args(["run", "--limit", "16M", "--swapfile"]).arg(&dir).arg("--").args(args);
        c.current_dir(&dir).env("ZMEM_PRELOAD", preload()).env("LC_ALL", "C");
        output_within(&mut c, 300, "zmem run as nobody")
    };
    let o = zmem_as_nobody(&["/usr/bin/python3", "-c", py]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("moved "), "{out}");
    // No rseq area the kernel would write to an evicted page (see
    // `tunables_for_user_mode_only`).
    assert!(String::from_utf8_lossy(&o.stdout).trim_end().ends_with("glibc.pthread.rseq=0"), "{out}");
    assert_eq!(
        String::from_utf8_lossy(&o.stderr).matches("faults from user mode").count(),
        1,
        "told once, with what to change: {out}"
    );
    assert!(out.contains("vm.unprivileged_userfaultfd=1") && out.contains("/dev/userfaultfd"), "{out}");
    let o = zmem_as_nobody(&["sort", "-S", "64M", "lines"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout) == sorted, "sort under zmem disagrees: {}", text(&o));

    // redis-server: its epoll events and its clients' buffers live in
    // jemalloc's memory (epoll_wait returned EFAULT at start), and 35 MiB
    // of keys go through read and write under 16M.
    let base = 20000 + std::process::id() % 20000;
    let load = ["debug", "populate", "100000", "key", "200"];
    let want = digest_as_is(base + 3, &load);
    let port = (base + 2).to_string();
    let mut c = Command::new("runuser");
    c.args(["-u", "nobody", "--"]).arg(env!("CARGO_BIN_EXE_zmem"));
    c.args(["run", "--limit", "16M", "--swapfile"]).arg(&dir).args(["--", "redis-server", "--port", &port]);
    c.args(["--save", "", "--appendonly", "no", "--enable-debug-command", "local", "--dir"]).arg(&dir);
    c.env("ZMEM_PRELOAD", preload()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut server = c.spawn().expect("redis-server (Debian's; .ci/run installs it)");
    wait_for_redis(base + 2, &mut server);
    let r = redis_cli(base + 2, &load);
    let got = redis_cli(base + 2, &["get", "key:77777"]);
    let digest = redis_cli(base + 2, &["debug", "digest"]);
    redis_cli(base + 2, &["shutdown", "nosave"]);
    let o = server.wait_with_output().unwrap();
    assert_eq!(r, "OK", "{}", text(&o));
    assert!(got.starts_with("value:77777"), "{got:?}; {}", text(&o));
    assert_eq!(digest, want, "the dataset differs from redis-server's as is; {}", text(&o));
}

/// Whether this test may run programs as `nobody` (it runs as root) and
/// `nobody` gets a userfaultfd for faults from user mode only (the
/// kernel's defaults: `vm.unprivileged_userfaultfd=0`, `/dev/userfaultfd`
/// root's). Says why where not.
fn nobody_gets_user_mode_only() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    let dev_open = std::fs::metadata("/dev/userfaultfd")
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o006 != 0)
        .unwrap_or(false);
    let ok = root && sysctl.trim() == "0" && !dev_open;
    if !ok {
        eprintln!("skipped: needs root, vm.unprivileged_userfaultfd=0 and /dev/userfaultfd closed to others");
    }
    ok
}

/// A tree started by root whose program drops its privileges before it
/// execs (`runuser`, as init scripts start servers): the program then gets
/// user mode only, and the exec gives it `glibc.pthread.rseq=0` (see
/// `zmem-preload/src/exec.rs`), added to the tunables it has and never
/// over what it says of rseq itself. A program that keeps root gets none.
#[test]
fn a_program_that_drops_root_before_it_execs_gets_glibcs_rseq_off() {
    if !nobody_gets_user_mode_only() {
        return;
    }
    let dir = tmpdir_for_all("rseq-after-runuser");
    let d = dir.to_str().unwrap();
    let py = "import os; print(os.environ.get('GLIBC_TUNABLES'))";
    let cases: [(&[&str], &str); 4] = [
        (&["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", py], "glibc.pthread.rseq=0"),
        (&["/usr/bin/python3", "-c", py], "None"),
        (
            &[
                "runuser",
                "-u",
                "nobody",
                "--",
                "env",
                "GLIBC_TUNABLES=glibc.malloc.arena_max=2",
                "/usr/bin/python3",
                "-c",
                py,
            ],
            "glibc.malloc.arena_max=2:glibc.pthread.rseq=0",
        ),
        (
            &[
                "runuser",
                "-u",
                "nobody",
                "--",
                "env",
                "-i",
                "GLIBC_TUNABLES=glibc.pthread.rseq=1",
                "/usr/bin/python3",
                "-c",
                py,
            ],
            "glibc.pthread.rseq=1",
        ),
    ];
    for (cmd, want) in cases {
        let args: Vec<&str> = ["run", "--limit", "64M", "--swapfile", d, "--"].iter().chain(cmd).copied().collect();
        let o = zmem_in(&dir, &args, &[], 60);
        assert!(o.status.success(), "{cmd:?}: {}", text(&o));
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), want, "{cmd:?}: {}", text(&o));
    }
}

/// A MariaDB server (`mariadbd`), under `zmem run` or as is; killed if a
/// check fails.
struct Mariadb {
    dir: PathBuf,
    server: std::process::Child,
}

impl Mariadb {
    /// A new data directory in `dir` (`mariadb-install-db`, as is).
    fn install(dir: &Path) {
        let o = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .args(Self::user())
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg("--auth-root-authentication-method=normal")
            .output()
            .expect("mariadb-install-db (Debian's mariadb-server; .ci/run installs it)");
        assert!(o.status.success(), "mariadb-install-db: {}", text(&o));
    }

    /// `mariadbd`: on the path, or where Debian puts it (a PATH without
    /// `/usr/sbin`).
    fn server() -> PathBuf {
        std::env::var_os("PATH")
            .iter()
            .flat_map(std::env::split_paths)
            .chain([PathBuf::from("/usr/sbin")])
            .map(|d| d.join("mariadbd"))
            .find(|p| p.is_file())
            .expect("mariadbd (Debian's mariadb-server; .ci/run installs it)")
    }

    /// `--user=root` under root: mariadbd refuses root without it.
    fn user() -> Option<&'static str> {
        // SAFETY: geteuid has no preconditions.
        (unsafe { libc::geteuid() } == 0).then_some("--user=root")
    }

    /// Starts the server on `dir`'s data, with InnoDB's buffer pool of
    /// `pool` and its own I/O: `O_DIRECT` reads and writes through io_uring
    /// (or Linux AIO), into and out of that pool. Under `zmem run --limit
    /// LIMIT` if `limit` is given.
    fn start(dir: &Path, pool: &str, limit: Option<&str>) -> Mariadb {
        let mut c = match limit {
            Some(limit) => {
                let (stats, swap) = (dir.join("stats"), dir.join("swap"));
                for d in [&stats, &swap] {
                    std::fs::create_dir_all(d).unwrap();
                }
                let mut c = Command::new(env!("CARGO_BIN_EXE_zmem"));
                c.args(["run", "--limit", limit, "--swapfile", swap.to_str().unwrap(), "--"]);
                c.arg(Self::server());
                c.env("ZMEM_PRELOAD", preload()).env("ZMEM_STATS_DIR", &stats).env("ZMEM_STATS_INTERVAL_MS", "50");
                c
            }
            None => Command::new(Self::server()),
        };
        c.arg("--no-defaults").args(Self::user());
        c.arg(format!("--datadir={}", dir.join("data").display()));
        c.arg(format!("--socket={}", dir.join("sock").display()));
        c.arg(format!("--log-error={}", dir.join("error.log").display()));
        c.arg(format!("--pid-file={}", dir.join("pid").display()));
        c.args(["--skip-networking", "--innodb-flush-method=O_DIRECT", "--innodb-use-native-aio=1"]);
        c.arg(format!("--innodb-buffer-pool-size={pool}"));
        c.stdout(Stdio::null()).stderr(std::fs::File::create(dir.join("stderr.log")).unwrap());
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        let server = c.spawn().expect("start mariadbd");
        let mut db = Mariadb { dir: dir.to_path_buf(), server };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !db.client("select 1").status.success() {
            if db.server.try_wait().unwrap().is_some() || Instant::now() > deadline {
                panic!("mariadbd did not start: {}", db.log());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        db
    }

    fn client(&self, sql: &str) -> Output {
        Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", self.dir.join("sock").display()))
            // A database for `seq_1_to_N` (MariaDB's Sequence engine).
            .args(["-uroot", "-D", "mysql", "-N", "-B", "-e", sql])
            .output()
            .expect("mariadb (Debian's mariadb-client; .ci/run installs it)")
    }

    /// `sql`'s output; a failed statement fails the test.
    fn query(&self, sql: &str) -> String {
        let o = self.client(sql);
        assert!(o.status.success(), "{sql}: {}; {}", text(&o), self.log());
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    fn log(&self) -> String {
        Self::log_in(&self.dir)
    }

    /// The server's log and stderr in `dir`, for a failure.
    fn log_in(dir: &Path) -> String {
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        format!("error.log:\n{}\nstderr:\n{}", read("error.log"), read("stderr.log"))
    }

    /// A clean shutdown (SIGTERM: InnoDB writes every dirty page of its
    /// pool out); returns how the server (or `zmem run`) ended.
    fn stop(&mut self) -> std::process::ExitStatus {
        let pid: i32 = std::fs::read_to_string(self.dir.join("pid")).unwrap().trim().parse().unwrap();
        // SAFETY: signals the server this test started (its pid file);
        // kill(2) touches no memory of ours.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let dir = self.dir.clone();
        exit_within(&mut self.server, 60, || format!("mariadbd did not stop in 60 s: {}", Self::log_in(&dir)))
    }
}

impl Drop for Mariadb {
    fn drop(&mut self) {
        kill_group_if_running(&mut self.server);
    }
}

/// MariaDB's InnoDB moves its pages between disk and its buffer pool by
/// itself: `O_DIRECT` reads and writes through io_uring, which the kernel
/// does on the pool's memory (pinning its pages), not a load or store of
/// the program. Under a limit below the pool, those reads land
/// in frames zmem had evicted and the writes read from them. The table
/// then reads back as the same rows computed anew (`seq_1_to_N` touches
/// no table), and, after a clean shutdown, a server run as is finds the
/// same rows on disk: what InnoDB wrote from evicted frames was the data.
#[test]
fn mariadb_innodb_reads_and_writes_its_pool_by_o_direct_and_keeps_every_row() {
    let dir = tmpdir("mariadb");
    Mariadb::install(&dir);
    let rows = 100_000;
    let a = "concat(if(seq % 7 = 3, 'u', ''), sha2(seq, 256), '-', seq)";
    let b = "unhex(concat(sha2(seq * 7, 512), sha2(seq * 3, 256)))";
    let want = format!("select count(*), sum(crc32({a})), sum(crc32({b})) from seq_1_to_{rows}");
    let got = "select count(*), sum(crc32(a)), sum(crc32(b)) from z.t";
    let mut db = Mariadb::start(&dir, "32M", Some("24M"));
    db.query("create database z");
    db.query("create table z.t (id int primary key, a varchar(100), b varbinary(200), key(a(12))) engine=InnoDB");
    db.query(&format!("insert into z.t select seq, concat(sha2(seq, 256), '-', seq), {b} from seq_1_to_{rows}"));
    db.query("update z.t set a = concat('u', a) where id % 7 = 3");
    let expected = db.query(&want);
    assert!(expected.starts_with(&format!("{rows}\t")), "{expected}");
    assert_eq!(db.query(got), expected, "the table under zmem differs from its rows computed anew");
    // Through the secondary index: a lookup of each row in the clustered one.
    assert_eq!(
        db.query("select count(*) from z.t force index(a) where a like 'u%'"),
        db.query(&format!("select count(*) from seq_1_to_{rows} where seq % 7 = 3"))
    );
    let reads: u64 = db
        .query("show global status like 'Innodb_buffer_pool_reads'")
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    let st = db.stop();
    assert!(st.success(), "zmem run: {st:?}; {}", db.log());
    // The table is larger than the pool: InnoDB read pages back from disk.
    assert!(reads > 1000, "InnoDB read {reads} pages from disk");
    let evicted = pager_max(&dir.join("stats"), "evicted_folios");
    assert!(evicted > 5000, "mariadbd was not evicted ({evicted} folios)");
    let cow = pager_max(&dir.join("stats"), "cow_breaks");
    eprintln!("InnoDB read {reads} pages; zmem evicted {evicted} folios, broke {cow} pinned pages' COW");

    let mut db = Mariadb::start(&dir, "64M", None);
    assert_eq!(db.query(got), expected, "the table written under zmem differs on disk");
    let check = db.query("check table z.t");
    assert!(check.ends_with("status\tOK"), "{check}");
    assert!(db.stop().success(), "{}", db.log());
}

/// Debian's redis-server (jemalloc inside) under a limit of a fraction of
/// what it loads: it starts, takes 200k keys, saves them in the background
/// (a fork) while it serves reads, and its whole dataset is then bit for
/// bit what the same load gives a redis-server run as is (`DEBUG DIGEST`).
#[test]
fn redis_server_on_jemalloc_loads_saves_in_the_background_and_reads_back_its_keys() {
    let base = 20000 + std::process::id() % 20000;
    let load = ["debug", "populate", "200000", "key", "200"];
    // The reference: the same load, as is.
    let want = digest_as_is(base + 1, &load);

    let dir = tmpdir("redis");
    let port = base;
    let mut server = start_redis(port, &dir, Some("24M"));
    wait_for_redis(port, &mut server);
    // About 70 MiB of keys and values: several times the limit.
    let r = redis_cli(port, &load);
    let bgsave = redis_cli(port, &["bgsave"]);
    // Serve while the child writes the RDB.
    let got: Vec<String> =
        [0, 777, 123_456, 199_999].iter().map(|k| redis_cli(port, &["get", &format!("key:{k}")])).collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut info = String::new();
    while Instant::now() < deadline {
        info = redis_cli(port, &["info", "persistence"]);
        if info.contains("rdb_bgsave_in_progress:0") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let digest = redis_cli(port, &["debug", "digest"]);
    let size = redis_cli(port, &["dbsize"]);
    redis_cli(port, &["shutdown", "nosave"]);
    let o = server.wait_with_output().unwrap();
    assert_eq!(r, "OK", "{}", text(&o));
    assert!(bgsave.contains("Background saving started"), "{bgsave}; {}", text(&o));
    assert!(info.contains("rdb_last_bgsave_status:ok"), "{info}; {}", text(&o));
    let rdb = std::fs::metadata(dir.join("dump.rdb")).map(|m| m.len()).unwrap_or(0);
    assert!(rdb > 1 << 20, "dump.rdb is {rdb} bytes");
    for (k, v) in [0, 777, 123_456, 199_999].iter().zip(&got) {
        assert!(v.starts_with(&format!("value:{k}")), "key:{k} read back as {v:?}; {}", text(&o));
    }
    assert_eq!(size, "200000", "{}", text(&o));
    assert_eq!(digest, want, "the dataset differs from redis-server's as is; {}", text(&o));
    assert!(o.status.success(), "{}", text(&o));
    // zmem managed it: redis-server evicted, and the BGSAVE child ran a
    // pager of its own, which adopted the dataset it inherited.
    let stats = tmpdir("redis-stats");
    let (adopted, evicted) = (pager_max(&stats, "adopted_bytes"), pager_max(&stats, "evicted_folios"));
    assert!(adopted >= 32 << 20 && evicted > 0, "adopted {adopted} B, evicted {evicted} folios");
    assert!(std::fs::read_dir(&stats).unwrap().count() >= 2, "no stats file from the BGSAVE child");
}

/// memcached's value for key `i`: 72 to 423 bytes, so that consecutive keys
/// land in different slab classes.
fn memcached_value(i: usize) -> Vec<u8> {
    format!("v{}:", i * 7919 % 1_000_003).repeat(8 + i % 40).into_bytes()
}

/// Keys `keys` set (pipelined, `noreply`), or got back and checked byte for
/// byte, on one connection to memcached on `port`.
fn memcached_client(port: u32, keys: std::ops::Range<usize>, set: bool) -> Result<(), String> {
    use std::io::{BufRead, BufReader, Read, Write};
    let s = std::net::TcpStream::connect(("127.0.0.1", port as u16)).map_err(|e| format!("connect: {e}"))?;
    let io = |e: std::io::Error| e.to_string();
    s.set_read_timeout(Some(Duration::from_secs(120))).map_err(io)?;
    let (mut w, mut r) = (std::io::BufWriter::new(s.try_clone().map_err(io)?), BufReader::new(s));
    if set {
        for i in keys {
            let v = memcached_value(i);
            write!(w, "set key:{i} 0 0 {} noreply\r\n", v.len()).map_err(io)?;
            w.write_all(&v).map_err(io)?;
            w.write_all(b"\r\n").map_err(io)?;
        }
        // A command with a reply: every set before it was served.
        w.write_all(b"version\r\n").and_then(|()| w.flush()).map_err(io)?;
        let mut line = String::new();
        r.read_line(&mut line).map_err(io)?;
        return if line.starts_with("VERSION") { Ok(()) } else { Err(format!("after the sets: {line:?}")) };
    }
    let ids: Vec<usize> = keys.collect();
    for chunk in ids.chunks(100) {
        let names: Vec<String> = chunk.iter().map(|i| format!("key:{i}")).collect();
        write!(w, "get {}\r\n", names.join(" ")).and_then(|()| w.flush()).map_err(io)?;
        for &i in chunk {
            let mut line = String::new();
            r.read_line(&mut line).map_err(io)?;
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() != 4 || f[0] != "VALUE" || f[1] != format!("key:{i}") {
                return Err(format!("key:{i}: got {line:?}"));
            }
            let mut v = vec![0u8; f[3].parse::<usize>().map_err(|e| e.to_string())? + 2];
            r.read_exact(&mut v).map_err(io)?;
            if v[..v.len() - 2] != memcached_value(i)[..] {
                return Err(format!("key:{i} read back wrong ({} bytes)", v.len() - 2));
            }
        }
        let mut end = String::new();
        r.read_line(&mut end).map_err(io)?;
        if end != "END\r\n" {
            return Err(format!("after {} values: {end:?}", chunk.len()));
        }
    }
    Ok(())
}

/// memcached (Debian's: its own slab allocator over malloc, four worker
/// threads, a thread that grows the hash table by moving every item, and
/// LRU threads) under a limit of a third of what it holds: four clients set
/// 200k keys at once, then read them all back at once, every byte checked.
/// The hash table grows twice while the items page, so its thread walks
/// what was evicted.
#[test]
fn memcached_threads_store_and_serve_every_value_under_a_third_of_their_size() {
    let port = 20000 + (std::process::id() + 7) % 20000;
    let (swap, stats) = (tmpdir("memcached-swap"), tmpdir("memcached-stats"));
    let mut c = Command::new(env!("CARGO_BIN_EXE_zmem"));
    c.args(["run", "--limit", "24M", "--swapfile", swap.to_str().unwrap(), "--", "memcached"])
        .args(["-U", "0", "-l", "127.0.0.1", "-p", &port.to_string(), "-m", "1024", "-t", "4", "-u", "root", "-A"])
        .env("ZMEM_PRELOAD", preload())
        .env("ZMEM_STATS_DIR", &stats)
        .env("ZMEM_STATS_INTERVAL_MS", "50")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    std::os::unix::process::CommandExt::process_group(&mut c, 0);
    let mut server = c.spawn().expect("zmem run memcached (Debian's; .ci/run installs it)");
    let n = 200_000;
    let mut run = || -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port as u16)).is_err() {
            if Instant::now() > deadline || !matches!(server.try_wait(), Ok(None)) {
                return Err("memcached did not start".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        for set in [true, false] {
            let quarter = n / 4;
            let clients: Vec<_> = (0..4)
                .map(|t| std::thread::spawn(move || memcached_client(port, t * quarter..(t + 1) * quarter, set)))
                .collect();
            for c in clients {
                c.join().map_err(|_| "a client panicked".to_string())??;
            }
        }
        Ok(())
    };
    let r = run();
    // `shutdown` (-A) ends it cleanly; the group kill below ends a hang.
    if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port as u16)) {
        let _ = std::io::Write::write_all(&mut s, b"shutdown\r\n");
    }
    wait_or_kill_group(&mut server, 60, "memcached under zmem after shutdown");
    let o = server.wait_with_output().unwrap();
    assert!(r.is_ok(), "{}; {}", r.unwrap_err(), text(&o));
    assert!(!text(&o).contains("zmem:"), "{}", text(&o));
    let evicted = pager_max(&stats, "evicted_folios");
    assert!(evicted > 1000, "evicted {evicted} folios: memcached's slabs were not managed; {}", text(&o));
    let peak = tree_peak(&stats);
    assert!(peak > 0 && peak <= 26 << 20, "the tree's peak usage {peak} B is off its 24 MiB limit");
}

/// The anonymous memory of every process in `root`'s tree (itself and its
/// descendants), in bytes, as the kernel counts it (`RssAnon`).
fn tree_rss_anon(root: u32) -> u64 {
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
    let child = Command::new(env!("CARGO_BIN_EXE_zmem"))
        .args(["run", "--limit", "64M", "--swapfile", swap.to_str().unwrap(), "--"])
        .args(["stress-ng", "--vm", "2", "--vm-bytes", "96M", "--verify", "--timeout", "8s"])
        .env("ZMEM_PRELOAD", preload())
        .env("ZMEM_STATS_DIR", &stats)
        .env("ZMEM_STATS_INTERVAL_MS", "50")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("stress-ng (Debian's; .ci/run installs it)");
    let root = child.id();
    let sampler = std::thread::spawn(move || {
        let mut peak = 0;
        let deadline = Instant::now() + Duration::from_secs(120);
        while Path::new(&format!("/proc/{root}")).exists() && Instant::now() < deadline {
            if std::fs::read_to_string(format!("/proc/{root}/stat")).is_ok_and(|s| s.contains(") Z")) {
                break;
            }
            peak = peak.max(tree_rss_anon(root));
            std::thread::sleep(Duration::from_millis(20));
        }
        peak
    });
    let o = child.wait_with_output().unwrap();
    let rss_peak = sampler.join().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("successful run completed"), "{}", text(&o));
    let evicted = pager_max(&stats, "evicted_folios");
    let tree_peak = tree_peak(&stats);
    eprintln!("evicted {evicted} folios; tree usage peak {} MiB; RssAnon peak {} MiB", tree_peak >> 20, rss_peak >> 20);
    assert!(evicted > 0, "{}", text(&o));
    assert!(tree_peak > 32 << 20 && tree_peak <= (64 + 8) << 20, "tree usage peak {tree_peak}");
    assert!(rss_peak <= (64 + 28) << 20, "RssAnon over the tree peaked at {} MiB", rss_peak >> 20);
}

#[test]
fn the_exit_status_and_signals_pass_through() {
    let o = zmem(&["run", "--", "sh", "-c", "exit 7"], &[], 30);
    assert_eq!(o.status.code(), Some(7), "{}", text(&o));
    let o = zmem(&["run", "--", "sh", "-c", "kill -TERM $$"], &[], 30);
    assert_eq!(o.status.code(), Some(128 + 15), "{}", text(&o));
}

/// A signal sent to `zmem run` (a service manager's SIGTERM, `kill`) goes on
/// to the program; `zmem run` waits for it, removes the tree's segment and
/// exits with its status. Killed by the signal instead, it left the program
/// running without its parent and `/dev/shm/zmem-tree-*` behind.
#[test]
fn a_signal_sent_to_zmem_run_reaches_the_program_and_zmem_cleans_up() {
    use std::io::BufRead;
    let start = |script: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_zmem"));
        c.args(["run", "--limit", "32M", "--", "sh", "-c", script]);
        c.env("ZMEM_PRELOAD", preload()).stdout(Stdio::piped()).stderr(Stdio::piped());
        // A process group of its own: a hang kills the program too.
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        let mut child = c.spawn().expect("start zmem");
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut tree = String::new();
        out.read_line(&mut tree).unwrap();
        let tree = PathBuf::from(tree.trim());
        assert!(tree.exists(), "the program sees its tree's segment: {tree:?}");
        (child, out, tree)
    };
    let finish = |mut child: std::process::Child, mut out: std::io::BufReader<std::process::ChildStdout>| {
        // SAFETY: kill(2) touches no memory of ours; the pid is our
        // child's, not yet waited for.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        wait_or_kill_group(&mut child, 30, "zmem run after SIGTERM");
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
        (child.wait().unwrap(), rest)
    };
    // A program that handles SIGTERM: its handler runs, its status is zmem's.
    let (child, mut out, tree) =
        start("echo $ZMEM_TREE; trap 'echo got TERM; exit 7' TERM; echo ready; while :; do sleep 0.05; done");
    let mut ready = String::new();
    out.read_line(&mut ready).unwrap();
    assert_eq!(ready.trim(), "ready");
    let (status, rest) = finish(child, out);
    assert_eq!(status.code(), Some(7), "{rest}");
    assert!(rest.contains("got TERM"), "{rest}");
    assert!(!tree.exists(), "the tree's segment is removed: {tree:?}");
    // One that does not: it dies of it, and zmem says so as a shell would.
    let (child, out, tree) = start("echo $ZMEM_TREE; exec sleep 60");
    let (status, _) = finish(child, out);
    assert_eq!(status.code(), Some(128 + 15));
    assert!(!tree.exists(), "the tree's segment is removed: {tree:?}");
}

#[test]
fn bad_flags_and_variables_are_errors_before_the_program_starts() {
    let marker = tmpdir("bad").join("started");
    let touch = format!("touch {}", marker.display());
    for (args, env, why) in [
        (vec!["run", "--limit", "lots"], vec![], "ZMEM_LIMIT=lots"),
        (vec!["run", "--compressor", "snappy"], vec![], "ZMEM_COMPRESSOR=snappy"),
        (vec!["run", "--folio", "3K"], vec![], "power of two"),
        (vec!["run", "--swapfile", "/nonexistent/zmem"], vec![], "not a directory"),
        (vec!["run"], vec![("ZMEM_MAX_POOL_PERCENT", "150")], "1..=100"),
        (vec!["run"], vec![("ZMEM_LIMTI", "1G")], "unknown setting"),
    ] {
        let mut a = args.clone();
        a.extend(["--", "sh", "-c", &touch]);
        let o = zmem(&a, &env, 30);
        assert!(!o.status.success(), "{a:?} {env:?} succeeded");
        assert!(String::from_utf8_lossy(&o.stderr).contains(why), "{a:?} {env:?}: {}", text(&o));
        assert!(!marker.exists(), "{a:?} {env:?}: the program started");
    }
    let o = zmem(&["run", "--", "/nonexistent/program"], &[], 30);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("/nonexistent/program"));
}

/// With `--show-limit` the program sees the limit as its machine's memory,
/// as one in a memory cgroup sees the cgroup's: Python's `os.sysconf`, a C
/// program's `sysinfo`, `get_phys_pages` and `/proc/meminfo` (through
/// `fopen` and `open`), Node's heap, sized from `/proc/meminfo`, and the
/// JVM, which takes a quarter of it for its default heap. Without it,
/// the machine's own, and a bad `ZMEM_SHOW_LIMIT` is refused up front.
#[test]
fn with_show_limit_the_program_sees_the_limit_as_its_memory() {
    let py = "import os; p = os.sysconf('SC_PAGE_SIZE'); \
              print('phys', os.sysconf('SC_PHYS_PAGES') * p, 'avail', os.sysconf('SC_AVPHYS_PAGES') * p)";
    let figures = |o: &Output| -> (u64, u64) {
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let w: Vec<&str> = out.split_whitespace().collect();
        assert!(w.len() == 4 && w[0] == "phys" && w[2] == "avail", "{}", text(o));
        (w[1].parse().unwrap(), w[3].parse().unwrap())
    };
    let o = zmem(&["run", "--limit", "64M", "--show-limit", "--", "python3", "-c", py], &[], 60);
    assert!(o.status.success(), "{}", text(&o));
    let (phys, avail) = figures(&o);
    assert_eq!(phys, 64 << 20, "{}", text(&o));
    assert!(avail > 0 && avail <= phys, "{}", text(&o));
    let o = zmem(&["run", "--limit", "64M", "--", "python3", "-c", py], &[], 60);
    assert!(o.status.success(), "{}", text(&o));
    let machine = figures(&o).0;
    assert!(machine > 64 << 20, "without the flag, the machine's memory: {}", text(&o));

    let exe = compile_c("sysmem");
    let c_figures = |args: &[&str]| -> Vec<u64> {
        let mut a = args.to_vec();
        a.extend(["--", exe.to_str().unwrap()]);
        let o = zmem(&a, &[], 60);
        assert!(o.status.success(), "{}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let w: Vec<u64> = out.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        assert_eq!(w.len(), 5, "{}", text(&o));
        w
    };
    // sysinfo, get_phys_pages, and /proc/meminfo through fopen and open.
    let w = c_figures(&["run", "--limit", "64M", "--show-limit"]);
    assert!(w[0] == 64 << 20 && w[1] <= w[0] && w[2] == 64 << 20, "sysinfo: {w:?}");
    assert!(w[3] == 64 << 20 && w[4] == 64 << 20, "/proc/meminfo: {w:?}");
    let w = c_figures(&["run", "--limit", "64M"]);
    assert!(w[3] > 64 << 20 && w[3] == w[4], "without the flag, the machine's /proc/meminfo: {w:?}");

    // /proc/meminfo read whole by Python: the limit, what is left of it,
    // the page cache not the tree's, every other line the machine's.
    let py = "import re; t = open('/proc/meminfo').read(); \
              f = {k: int(v) for k, v in re.findall(r'^(\\w+):\\s+(\\d+)', t, re.M)}; \
              print(f['MemTotal'], f['MemFree'], f['MemAvailable'], f['Cached'], 'SwapTotal' in f)";
    let o = zmem(&["run", "--limit", "64M", "--show-limit", "--", "python3", "-c", py], &[], 60);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let w: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(w.len(), 5, "{}", text(&o));
    let kb = |i: usize| -> u64 { w[i].parse().unwrap() };
    assert!(kb(0) == 64 << 10 && kb(1) <= kb(0) && kb(1) > 0 && kb(2) == kb(1) && kb(3) == 0, "{}", text(&o));
    assert_eq!(w[4], "True", "the other lines are kept: {}", text(&o));

    // Node sizes its V8 heap from /proc/meminfo (libuv's
    // uv_get_total_memory): with the flag, to the limit.
    let node = |args: &[&str]| -> (u64, u64) {
        let mut a = args.to_vec();
        let js = "console.log(require('os').totalmem(), require('v8').getHeapStatistics().heap_size_limit)";
        a.extend(["--", "node", "-e", js]);
        let o = zmem(&a, &[], 120);
        assert!(o.status.success(), "{}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let w: Vec<u64> = out.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        assert_eq!(w.len(), 2, "{}", text(&o));
        (w[0], w[1])
    };
    let (total, heap) = node(&["run", "--limit", "256M", "--show-limit"]);
    let (machine, machine_heap) = node(&["run", "--limit", "256M"]);
    assert_eq!(total, 256 << 20);
    assert!(machine > 256 << 20 && heap < machine_heap, "node: {total} {heap} against {machine} {machine_heap}");

    let heap = |args: &[&str]| -> u64 {
        let mut a = args.to_vec();
        a.extend(["--", "java", "-XX:+PrintFlagsFinal", "-version"]);
        let o = zmem(&a, &[], 120);
        assert!(o.status.success(), "{}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let line = out.lines().find(|l| l.split_whitespace().nth(1) == Some("MaxHeapSize")).expect("MaxHeapSize");
        line.split_whitespace().nth(3).unwrap().parse().unwrap()
    };
    assert_eq!(heap(&["run", "--limit", "512M", "--show-limit"]), 128 << 20, "a quarter of the limit");
    assert!(heap(&["run", "--limit", "512M"]) > 512 << 20, "a quarter of the machine's memory");

    let o = zmem(&["run", "--", "true"], &[("ZMEM_SHOW_LIMIT", "2")], 30);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("ZMEM_SHOW_LIMIT=2"), "{}", text(&o));
}

/// With the threshold at one folio, the pager's own buffers and the
/// tier's allocations would qualify; the reentrancy guard must keep them
/// out of managed memory, or the handler faults on itself and hangs.
#[test]
fn zmems_own_allocations_never_land_in_managed_memory() {
    let exe = compile_alloc();
    let swap = tmpdir("guard-swap");
    let o = zmem(
        &[
            "run",
            "--limit",
            "32M",
            "--threshold",
            "64K",
            "--swapfile",
            swap.to_str().unwrap(),
            "--",
            exe.to_str().unwrap(),
            "96",
        ],
        &[],
        240,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("0 bad words"), "{}", text(&o));
}

#[test]
fn zmem_stats_reads_a_running_process() {
    let stats = tmpdir("stats");
    let swap = tmpdir("stats-swap");
    let mut child = Command::new(env!("CARGO_BIN_EXE_zmem"))
        .args(["run", "--limit", "32M", "--swapfile", swap.to_str().unwrap(), "--", "python3", "-c", PY, "96"])
        .env("ZMEM_PRELOAD", preload())
        .env("ZMEM_STATS_DIR", &stats)
        .env("ZMEM_STATS_INTERVAL_MS", "100")
        .env("HOLD", "6")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // The python process is zmem's child.
    let deadline = Instant::now() + Duration::from_secs(60);
    let file = loop {
        let f = std::fs::read_dir(&stats).unwrap().flatten().map(|e| e.path()).find(|p| {
            p.file_name().unwrap().to_string_lossy().starts_with("zmem-")
                && std::fs::read_to_string(p)
                    .is_ok_and(|t| t.contains("\"evicted_folios\":") && !t.contains("\"evicted_folios\":0"))
        });
        if let Some(f) = f {
            break f;
        }
        assert!(Instant::now() < deadline, "no stats file with evictions in {}", stats.display());
        std::thread::sleep(Duration::from_millis(100));
    };
    let name = file.file_name().unwrap().to_string_lossy().to_string();
    let pid = name.trim_start_matches("zmem-").trim_end_matches(".json");
    let dir = stats.to_str().unwrap();
    let o = zmem(&["stats", pid, "--json"], &[("ZMEM_STATS_DIR", dir)], 30);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["limit"], 32 << 20);
    // The footprint as the OS sees it: RSS plus the swap file's page cache
    // (O_DIRECT keeps that near zero). Python holds 96 MiB of blocks; under
    // a 32 MiB limit its footprint is the limit plus the interpreter.
    let fp = &v["footprint"];
    eprintln!("footprint: {fp}");
    assert!(fp["swap_page_cache_bytes"].as_u64().unwrap() <= 1 << 20, "{v}");
    assert!(fp["footprint_bytes"].as_u64().unwrap() < 72 << 20, "{v}");
    assert!(v["pager"]["evicted_folios"].as_u64().unwrap() > 0, "{v}");
    assert!(v["tier"]["stored_pages"].is_u64(), "{v}");
    let o = zmem(&["stats", pid, "--prometheus"], &[("ZMEM_STATS_DIR", dir)], 30);
    let p = String::from_utf8_lossy(&o.stdout);
    assert!(p.contains(&format!("zmem_pager_evicted_folios{{pid=\"{pid}\"}}")), "{p}");
    // A bucketed counter: one series per bucket.
    assert!(p.contains(&format!("zmem_pager_refault_distance{{pid=\"{pid}\",bucket=\"6\"}}")), "{p}");
    // The process tree that shares the limit, with this process in it.
    assert_eq!(v["tree"]["limit"], 32 << 20, "{v}");
    let members = v["tree"]["processes"].as_array().unwrap();
    assert!(
        members.iter().any(|m| m["pid"].as_u64() == pid.parse().ok() && m["usage_bytes"].as_u64() > Some(0)),
        "{v}"
    );
    // No --dir: the directory the process started with (its environment).
    let o =
        Command::new(env!("CARGO_BIN_EXE_zmem")).args(["stats", pid]).env_remove("ZMEM_STATS_DIR").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("tier.zswpout") && out.contains("process tree: limit 32.0 MiB"), "{}", text(&o));
    assert!(child.wait().unwrap().success());
    let o = zmem(&["stats", "999999999"], &[("ZMEM_STATS_DIR", dir)], 30);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("zmem run"), "{}", text(&o));
}

/// A daemon's idiom: close 0, 1 and 2, then open `/dev/null` three times
/// and count on 0, 1 and 2 (dash does the same for a background job's
/// stdin). A zmem thread that opened a file while those numbers were free
/// kept one of them (the handler's `/proc/self/task/TID/stat`): the
/// program's opens got 1, 2 and 13, in 2 runs of 3. In CI it showed as a
/// forked shell's `head` finding a read-only file of zmem's at its
/// stdout. zmem's descriptors now move off those numbers at once.
#[test]
fn a_program_that_closes_its_standard_streams_gets_them_back_from_its_next_opens() {
    let exe = compile_c("stdclose");
    for _ in 0..3 {
        let o = zmem(&["run", "--limit", "16M", "--", exe.to_str().unwrap()], &[], 120);
        assert!(o.status.success(), "{}", text(&o));
        assert!(String::from_utf8_lossy(&o.stderr).contains("wrong 0 bad 0"), "{}", text(&o));
    }
}

/// In the default directory (`/tmp/zmem-stats-UID`, the user's own) a
/// stats file lives as long as its process: removed as it exits, swept
/// after one killed by a signal (by `zmem run` as it ends, and by the next
/// process to start), so the directory never fills up (the old shared
/// default had ~2,500 files of dead processes on a developer's machine).
/// `zmem stats` finds it by the process's user, and its output piped into
/// `head` ends quietly.
#[test]
fn stats_files_in_the_default_directory_live_as_long_as_their_process() {
    let uid = zmem_common::stats_files::effective_uid(std::process::id()).unwrap();
    let dir = zmem_settings::default_stats_dir(uid);
    zmem_common::stats_files::prepare_dir(&dir, Some(uid)).unwrap();
    // Left by a process that is gone (a pid past pid_max).
    let stale = zmem_common::stats_files::path(&dir, 9_999_999);
    std::fs::write(&stale, "{}").unwrap();
    let d = dir.display();
    let zmem_bin = env!("CARGO_BIN_EXE_zmem");
    // A child that exits when told (`head` reading a FIFO; it exits
    // through exit(3), as dash does not: `_exit`), and waits of up to
    // 20 s for each stats file to appear: a loaded machine is slow to
    // start a pager.
    let fifo = tmpdir("stats-default").join("go");
    let f = fifo.display();
    let script = format!(
        "wait_for() {{ i=0; until [ -s \"$1\" ] || [ $i -ge 400 ]; do sleep 0.05; i=$((i+1)); done; }}; \
         mkfifo {f}; head -c 1 {f} > /dev/null & p=$!; \
         wait_for {d}/zmem-$p.json; test -s {d}/zmem-$p.json && echo seen $p; \
         echo go > {f}; wait $p; test -e {d}/zmem-$p.json || echo gone $p; \
         wait_for {d}/zmem-$$.json; test -s {d}/zmem-$$.json && echo present; \
         {zmem_bin} stats $$ | head -1; echo pid $$; kill -9 $$"
    );
    let o = Command::new(zmem_bin)
        .args(["run", "--limit", "32M", "--", "sh", "-c", &script])
        .env("ZMEM_PRELOAD", preload())
        .env("ZMEM_STATS_INTERVAL_MS", "20")
        .env_remove("ZMEM_STATS_DIR")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(128 + 9), "{}", text(&o));
    let word = |w: &str| out.lines().find_map(|l| l.strip_prefix(w)).map(str::to_string);
    // A child that exited removed its own file while the tree ran.
    let child = word("seen ").unwrap_or_else(|| panic!("the child's stats file never appeared: {}", text(&o)));
    assert_eq!(word("gone ").as_deref(), Some(child.as_str()), "{}", text(&o));
    assert!(out.contains("present") && out.contains("zmem stats for pid"), "{}", text(&o));
    assert!(!String::from_utf8_lossy(&o.stderr).contains("panicked"), "{}", text(&o));
    // The shell was killed: `zmem run` swept its file, and the stale one
    // went with the first start.
    let pid: u32 = word("pid ").unwrap().parse().unwrap();
    assert!(!zmem_common::stats_files::path(&dir, pid).exists(), "{}", text(&o));
    assert!(!stale.exists());
}

/// `include/zmem.h` from C, linked against the shim (no LD_PRELOAD).
#[test]
fn the_c_header_api_maps_checks_and_reports() {
    let so = preload();
    let dir = so.parent().unwrap();
    let out = tmpdir("api").join("api");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let st = Command::new("cc")
        .arg("-O2")
        .arg("-I")
        .arg(root.join("include"))
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/api.c"))
        .arg("-o")
        .arg(&out)
        .arg(format!("-L{}", dir.display()))
        .arg("-lzmem_preload")
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .status()
        .expect("cc");
    assert!(st.success());
    let o = Command::new(&out).env("ZMEM_LIMIT", "32M").output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "api ok");
}

/// Issue 11, finding 2: a non-UTF-8 variable made the shim panic inside the
/// program's first mmap, which aborted every program. Arguments that are
/// not UTF-8 pass through too.
#[test]
fn a_non_utf8_environment_and_arguments_pass_through() {
    use std::os::unix::ffi::OsStrExt;
    let bad = std::ffi::OsStr::from_bytes(b"caf\xe9-\xff");
    let o = Command::new(env!("CARGO_BIN_EXE_zmem"))
        .args(["run", "--limit", "32M", "--", "python3", "-c"])
        .arg(format!("import os, sys\n{PY}\nassert os.environb[b'ZMEM_TEST_BAD'] == b'caf\\xe9-\\xff'\nassert os.fsencode(sys.argv[2]) == b'caf\\xe9-\\xff'"))
        .args(["64"])
        .arg(bad)
        .env("ZMEM_PRELOAD", preload())
        .env("ZMEM_TEST_BAD", bad)
        .env("ZMEM_STATS_DIR", tmpdir("utf8-stats"))
        .output()
        .unwrap();
    // ZMEM_TEST_BAD is a ZMEM_ name: it must be refused with a message, not a panic.
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not UTF-8"), "{}", text(&o));
    let o = Command::new(env!("CARGO_BIN_EXE_zmem"))
        .args(["run", "--limit", "32M", "--", "python3", "-c"])
        .arg(format!("import os, sys\n{PY}\nassert os.environb[b'LANG_BAD'] == b'caf\\xe9-\\xff'\nassert os.fsencode(sys.argv[2]) == b'caf\\xe9-\\xff'"))
        .args(["64"])
        .arg(bad)
        .env("ZMEM_PRELOAD", preload())
        .env("LANG_BAD", bad)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("ok 64"), "{}", text(&o));
}

/// The codec of new stores follows the swap file, end to end: text that
/// zstd packs far tighter than lz4, read at random over three times the
/// limit, sends most loads to the swap file, and new stores switch to
/// zstd:1; five quiet seconds later they are back on lz4. Every page
/// reads back the same after each switch, whichever codec stored it.
#[test]
fn new_stores_switch_to_zstd_under_random_disk_loads_and_back_when_quiet() {
    let stats = tmpdir("codec-switch-stats");
    let swap = tmpdir("codec-switch-swap");
    let py = r#"
import glob, hashlib, json, os, random, sys, time
rng = random.Random(1)
words = ['%010x' % rng.getrandbits(40) for _ in range(4096)]
base = []
while sum(map(len, base)) < (1 << 20) + 4096:
    base.append(' '.join(rng.choices(words, k=8)) + '\n')
blocks = []
for i in range(96):
    rng.shuffle(base)
    blocks.append(bytearray(''.join(base).encode()[:1 << 20]))
sums = [hashlib.sha256(b).digest() for b in blocks]
def switches():
    st = json.load(open(glob.glob(os.path.join(sys.argv[1], 'zmem-%d.json' % os.getpid()))[0]))
    return st['pager']['codec_switches'], st['tier']['pswpin']
def wait_for(n, read):
    t = time.time()
    while switches()[0] < n:
        assert time.time() - t < 120, ('no switch', n, switches())
        if read:
            for _ in range(20000):
                blocks[rng.randrange(96)][rng.randrange(1 << 20)]
        else:
            time.sleep(0.2)
wait_for(1, True)
for b, s in zip(blocks, sums):
    assert hashlib.sha256(b).digest() == s
wait_for(2, False)
for b, s in zip(blocks, sums):
    assert hashlib.sha256(b).digest() == s
n, pswpin = switches()
print('ok', n, pswpin > 0)
"#;
    let o = zmem(
        &[
            "run",
            "--limit",
            "32M",
            "--swapfile",
            swap.to_str().unwrap(),
            "--",
            "python3",
            "-c",
            py,
            stats.to_str().unwrap(),
        ],
        &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "50"), ("ZMEM_LOG", "info")],
        300,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("ok 2 True"), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("new stores use zstd:1") && err.contains("new stores use lz4"), "{}", text(&o));
}

/// Incompressible data 4x the limit with writeback off: the pool cannot
/// take it, so the limit turns soft (one warning) and the program runs on,
/// instead of reclaim spinning on rejections (issue 11, finding 3).
#[test]
fn with_writeback_off_a_full_pool_makes_the_limit_soft_not_a_livelock() {
    let stats = tmpdir("soft-stats");
    let py = r#"
import hashlib, os, sys, glob, json, time
blocks = [os.urandom(1 << 20) for _ in range(128)]
sums = [hashlib.sha256(b).digest() for b in blocks]
for _ in range(3):
    for b, s in zip(blocks, sums):
        assert hashlib.sha256(b).digest() == s
time.sleep(0.5)
st = json.load(open(glob.glob(os.path.join(sys.argv[1], 'zmem-%d.json' % os.getpid()))[0]))
print("ok", st["pager"]["limit_soft_events"], st["pager"]["eviction_rejects"])
"#;
    let o = zmem(
        &["run", "--limit", "32M", "--no-writeback", "--", "python3", "-c", py, stats.to_str().unwrap()],
        &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "50")],
        180,
    );
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let f: Vec<u64> = out.trim().split(' ').skip(1).map(|x| x.parse().unwrap()).collect();
    assert!(f[0] >= 1 && f[1] >= 1, "{}", text(&o));
    let warnings = String::from_utf8_lossy(&o.stderr).matches("the limit is soft").count();
    assert_eq!(warnings, 1, "{}", text(&o));
}

/// `zmem compare --swap --equal-footprint`: the same program as is, under
/// zmem, under the kernel's zswap and under plain swap, then under zmem
/// with the kernel's footprint, with the machine left as it was.
#[test]
fn compare_runs_a_program_five_ways_and_restores_the_machine() {
    let _one = kernel_runs();
    let zswap_before = std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok();
    let page_cluster_before = std::fs::read_to_string("/proc/sys/vm/page-cluster").unwrap();
    let swap = tmpdir("compare-swap");
    let o = zmem(
        &[
            "compare",
            "--limit",
            "32M",
            "--swap-dir",
            swap.to_str().unwrap(),
            "--equal-footprint",
            "--swap",
            "--json",
            "--",
            "python3",
            "-c",
            PY,
            "64",
        ],
        &[],
        300,
    );
    assert!(o.status.success(), "{}", text(&o));
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    let rows = rows.as_array().expect("one row per run");
    let fp = |i: usize| rows[i]["peak_footprint_bytes"].as_u64().unwrap();
    // The fourth run's limit: 32M moved by the kernel's footprint less
    // zmem's, in whole MiB, at least 16M.
    let matched = ((32u64 << 20) + fp(2)).saturating_sub(fp(1)) >> 20;
    let names: Vec<&str> = rows.iter().map(|r| r["config"].as_str().unwrap()).collect();
    assert_eq!(names, ["native", "zmem", "kernel:lzo", "swap", &format!("zmem@{}M", matched.max(16))], "{}", text(&o));
    for r in rows {
        assert_eq!(r["exit_ok"], true, "{r}");
        assert!(r["elapsed_s"].as_f64().unwrap() > 0.0 && r["peak_footprint_bytes"].as_u64().unwrap() > 0, "{r}");
        // The whole PSS has the file pages on top of the anonymous ones.
        assert!(r["peak_pss_bytes"].as_u64().unwrap() > r["peak_footprint_bytes"].as_u64().unwrap(), "{r}");
    }
    assert_eq!(rows[2]["vs_kernel"].as_f64(), Some(1.0));
    // Each run's ratio against plain swap, from this run's own times.
    for r in rows {
        let vs_swap = rows[3]["elapsed_s"].as_f64().unwrap() / r["elapsed_s"].as_f64().unwrap();
        assert!((r["vs_swap"].as_f64().unwrap() - vs_swap).abs() < 1e-9, "{r}");
    }
    // Plain swap: the cgroup held the program to its limit, with no pool.
    assert!(rows[3]["cgroup_peak_bytes"].as_u64().is_some_and(|b| b > 0 && b <= 32 << 20), "{}", rows[3]);
    assert!(rows[2]["cgroup_peak_bytes"].as_u64().is_some_and(|b| b > 0 && b <= 32 << 20), "{}", rows[2]);
    // The program held 128 MiB; under zmem far less of it was resident.
    let (native, zmem) = (fp(0), fp(1));
    assert!(zmem < native, "zmem {zmem} B against native {native} B");
    // Restored: no cgroup of ours, no swap file of ours, zswap as it was.
    let cgroups = std::fs::read_dir("/sys/fs/cgroup/memory").unwrap();
    assert!(!cgroups.flatten().any(|e| e.file_name().to_string_lossy().starts_with("zmem-usemem-")));
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
    assert!(!swaps.contains("zmem-usemem-"), "{swaps}");
    assert_eq!(std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok(), zswap_before);
    assert_eq!(std::fs::read_to_string("/proc/sys/vm/page-cluster").unwrap(), page_cluster_before);
}

/// `zmem usemem` (README's first command), small: zmem, the kernel's zswap
/// and no limit, every page read back as written, the ratios against the
/// run's kernel and `none` in the JSON, then (`--equal-footprint`) zmem
/// again with its limit moved by the two footprints' difference; the
/// machine left as it was.
#[test]
fn usemem_reads_back_every_page_and_compares_at_the_kernels_footprint() {
    let _one = kernel_runs();
    let zswap_before = std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok();
    let dir = tmpdir("usemem");
    let json = dir.join("u.json");
    let o = zmem(
        &[
            "usemem",
            "--quiet",
            "--workers",
            "2",
            "--size",
            "48M",
            "--limit",
            "48M",
            "--sleep-ms",
            "10",
            "--config",
            "zmem:lz4,kernel:lzo,none",
            "--equal-footprint",
            "--swap-dir",
            dir.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
            "--svg",
            dir.join("u.svg").to_str().unwrap(),
        ],
        &[],
        300,
    );
    assert!(o.status.success(), "{}", text(&o));
    let rows: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = rows.as_array().expect("one row per run");
    let f = |i: usize, k: &str| rows[i][k].as_f64().unwrap_or_else(|| panic!("{k} of {}", rows[i]));
    let fp = |i: usize| rows[i]["peak_footprint_bytes"].as_u64().unwrap();
    let matched = (((48u64 << 20) + fp(1)).saturating_sub(fp(0)) >> 20).max(16);
    let names: Vec<&str> = rows.iter().map(|r| r["config"].as_str().unwrap()).collect();
    assert_eq!(names, ["zmem:lz4", "kernel:lzo", "none", &format!("zmem:lz4/{matched}M")], "{}", text(&o));
    assert_eq!(rows[3]["limit"].as_u64(), Some(matched << 20));
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["mismatched_pages"].as_u64(), Some(0), "{r}");
        assert!(f(i, "elapsed_secs") > 0.0 && fp(i) > 0, "{r}");
        // Each ratio is against the baselines of this run.
        let vs_kernel = f(i, "total_kbps") / f(1, "total_kbps");
        assert!((f(i, "vs_kernel") - vs_kernel).abs() < 1e-9, "{r}");
        let vs_none = f(i, "elapsed_secs") / f(2, "elapsed_secs");
        assert!((f(i, "elapsed_vs_none") - vs_none).abs() < 1e-9, "{r}");
    }
    // 96 MiB through a 48M limit: zmem stored pages and loaded them back.
    for i in [0, 3] {
        assert!(rows[i]["zswpout"].as_u64().unwrap() > 0 && rows[i]["zswpin"].as_u64().unwrap() > 0, "{}", rows[i]);
    }
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("vs kernel:lzo") && out.contains("total "), "{out}");
    let cgroups = std::fs::read_dir("/sys/fs/cgroup/memory").unwrap();
    assert!(!cgroups.flatten().any(|e| e.file_name().to_string_lossy().starts_with("zmem-usemem-")));
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
    assert!(!swaps.contains("zmem-usemem-"), "{swaps}");
    assert_eq!(std::fs::read_to_string("/sys/module/zswap/parameters/enabled").ok(), zswap_before);
}

/// This binary's tests that make kernel runs, one at a time: each reads
/// the machine's settings before its run to check that they are restored,
/// and another's run in between has them changed. (`zmem` itself runs one
/// kernel run at a time per machine, under a lock of its own.)
fn kernel_runs() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A kernel run that the OOM killer ended fails in `zmem compare`, even
/// when the program is a script that exits 0 after its child was killed:
/// memory the program locks cannot be swapped, so the cgroup's limit kills
/// it. zmem keeps it in memory over the limit (the limit turns soft).
#[test]
fn compare_fails_a_kernel_run_the_oom_killer_ended_whatever_the_exit_status() {
    let _one = kernel_runs();
    let swap = tmpdir("compare-oom-swap");
    let py = "import ctypes; assert ctypes.CDLL(None).mlockall(3) == 0; b = bytearray(64 << 20); print('held')";
    let script = format!("python3 -c \"{py}\"; true");
    let o = zmem(
        &["compare", "--limit", "32M", "--swap-dir", swap.to_str().unwrap(), "--json", "--", "sh", "-c", &script],
        &[],
        300,
    );
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("the OOM killer killed") && err.contains("`--swap` adds a run"), "{}", text(&o));
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    let ok: Vec<bool> = rows.as_array().unwrap().iter().map(|r| r["exit_ok"].as_bool().unwrap()).collect();
    assert_eq!(ok, [true, true, false], "{}", text(&o));
    assert!(rows[2]["exit_status"].as_str().unwrap().starts_with("exit status: 0;"), "{}", text(&o));
    assert!(rows.as_array().unwrap().iter().all(|r| r["vs_kernel"].is_null()), "{}", text(&o));
}

/// The largest `pager` counters over the stats files a run left in `dir`
/// (one per process; the last update is at most one interval old).
fn pager_max(dir: &Path, key: &str) -> u64 {
    stats_max(dir, |v| v["pager"][key].as_u64())
}

/// The tree's peak usage, from the stats files in `dir`.
fn tree_peak(dir: &Path) -> u64 {
    stats_max(dir, |v| v["tree"]["peak_usage_bytes"].as_u64())
}

/// The largest value `get` reads from the stats files in `dir`.
fn stats_max(dir: &Path, get: impl Fn(&serde_json::Value) -> Option<u64>) -> u64 {
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
fn run_managed(name: &str, limit: &str, cmd: &[&str], want: &str, secs: u64) -> Output {
    run_managed_env(name, limit, cmd, &[], want, secs)
}

/// Runs `cmd` under `zmem run --limit LIMIT` with a swap file of its own,
/// and checks that it succeeds and prints `want`.
fn run_checked(name: &str, limit: &str, cmd: &[&str], env: &[(&str, &str)], want: &str, secs: u64) -> Output {
    let swap = tmpdir(&format!("{name}-swap"));
    let mut args = vec!["run", "--limit", limit, "--swapfile", swap.to_str().unwrap(), "--"];
    args.extend_from_slice(cmd);
    let o = zmem(&args, env, secs);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains(want), "{}", text(&o));
    o
}

fn run_managed_env(name: &str, limit: &str, cmd: &[&str], env: &[(&str, &str)], want: &str, secs: u64) -> Output {
    let stats = tmpdir(&format!("{name}-stats"));
    let mut env = env.to_vec();
    env.extend([("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "50")]);
    let o = run_checked(name, limit, cmd, &env, want, secs);
    let (adopted, evicted) = (pager_max(&stats, "adopted_bytes"), pager_max(&stats, "evicted_folios"));
    assert!(adopted >= 16 << 20 && evicted > 0, "adopted {adopted} B, evicted {evicted} folios; {}", text(&o));
    o
}

/// mimalloc (Debian's libmimalloc2.0, preloaded) makes its segments with
/// its own mmaps; small strings and 1 MiB blocks both live there, and are
/// managed by mapping, every byte checked by the program.
#[test]
fn python_on_mimalloc_is_managed_by_mapping() {
    let mi = ["/usr/lib/x86_64-linux-gnu/libmimalloc.so.2", "/usr/lib/aarch64-linux-gnu/libmimalloc.so.2"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .expect("libmimalloc.so.2 (Debian's libmimalloc2.0; .ci/run installs it)");
    let py = r#"
text = (open('/etc/services', 'rb').read() * 200)[:1 << 20]
blocks = []
for i in range(128):
    b = bytearray(text); b[:8] = i.to_bytes(8, 'little'); blocks.append(b)
xs = [(b"%08d" % i) * 64 for i in range(100000)]
for i, b in enumerate(blocks):
    assert b[:8] == i.to_bytes(8, 'little') and b[8:] == text[8:], i
assert all(xs[i] == (b"%08d" % i) * 64 for i in range(100000))
print("mimalloc ok")
"#;
    run_managed_env("mimalloc", "32M", &["python3", "-c", py], &[("LD_PRELOAD", mi)], "mimalloc ok", 300);
}

/// `import numpy` loads OpenBLAS, whose library constructor starts its
/// thread pool: `pthread_create` under the dynamic loader's lock. The
/// shim's `pthread_create` waits for the new thread to record its stack,
/// and that record took the same lock (a thread-local's destructor), so
/// the import hung for good. Then numpy's arrays, 6x the limit, sorted,
/// multiplied on the BLAS threads and checked.
#[test]
fn numpy_imports_with_openblas_threads_and_its_arrays_are_managed() {
    let py = "/usr/bin/python3";
    let ok = Command::new(py).args(["-c", "import numpy"]).status().is_ok_and(|s| s.success());
    assert!(ok, "Debian's python3-numpy with libopenblas0-pthread (.ci/run installs them)");
    let script = r#"
import numpy as np
n = 4 << 20
a = np.arange(n, dtype=np.int64) * 2654435761 % 1000003
b = a[::-1].copy()
c = np.sort(a)
assert np.all(c[1:] >= c[:-1]) and int(c.sum()) == int(a.sum())
m = (np.arange(512 * 512, dtype=np.float64) % 97).reshape(512, 512)
p = m @ m.T
mi = m.astype(np.int64)
for i, j in [(0, 0), (17, 300), (511, 1)]:
    assert int(p[i, j]) == int((mi[i] * mi[j]).sum()), (i, j)
big = [np.full(1 << 20, i, dtype=np.uint8) for i in range(96)]
assert all(int(x[::4096].sum()) == i * 256 for i, x in enumerate(big))
assert np.array_equal(b[::-1], a)
print("numpy ok")
"#;
    run_managed("numpy", "32M", &[py, "-c", script], "numpy ok", 240);
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

/// SBCL (Debian's) reserves its heap as one mapping, read, write and
/// execute, and maps its core file over the start of it: the anonymous
/// rest, right after a file's mapping, looked like an object's .bss and
/// was never adopted, and once adopted its pages could not MOVE to the
/// plain staging area (the protections differ). Each was checked with the
/// old code: 1M entries ran at 860 MiB under a 64M limit. Here a hash
/// table of 500k strings and 64-byte vectors, 5x the limit, every byte
/// checked.
#[test]
fn sbcls_executable_heap_after_its_core_is_managed() {
    let ok = Command::new("sbcl").arg("--version").output().is_ok_and(|o| o.status.success());
    assert!(ok, "sbcl (Debian's; .ci/run installs it)");
    let lisp = r#"
(defun key (i) (format nil "key-~D" i))
(defun run (n)
  (let ((h (make-hash-table :test 'equal)))
    (dotimes (i n)
      (setf (gethash (key i) h)
            (make-array 64 :element-type '(unsigned-byte 8) :initial-element (mod (* i 7) 251))))
    (sb-ext:gc :full t)
    (let ((bad 0))
      (dotimes (j n)
        (let* ((i (- n 1 j)) (v (gethash (key i) h)))
          (unless (and v (every (lambda (b) (= b (mod (* i 7) 251))) v)) (incf bad))))
      (format t "sbcl entries ~D bad ~D~%" (hash-table-count h) bad))))
(run 500000)
"#;
    let dir = tmpdir("sbcl");
    let script = dir.join("table.lisp");
    std::fs::write(&script, lisp).unwrap();
    let stats = tmpdir("sbcl-stats");
    let env = [("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "50")];
    let cmd = ["sbcl", "--script", script.to_str().unwrap()];
    let o = run_checked("sbcl", "32M", &cmd, &env, "sbcl entries 500000 bad 0", 240);
    let (evicted, unevictable) = (pager_max(&stats, "evicted_folios"), pager_max(&stats, "unevictable_folios"));
    assert!(evicted > 2048 && unevictable == 0, "evicted {evicted}, unevictable {unevictable}; {}", text(&o));
    let peak = tree_peak(&stats);
    assert!(peak <= 40 << 20, "peak {} MiB over a 32M limit; {}", peak >> 20, text(&o));
}

/// sqlite3 keeps an in-memory database in glibc's heap (brk and arenas),
/// which no interposed call ever sees: it is managed by mapping.
#[test]
fn sqlite_in_memory_database_in_glibcs_heap_is_managed_by_mapping() {
    let sql = "CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT);\n\
               WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<600000)\n\
               INSERT INTO t SELECT x, printf('%08d-%s', x, hex(zeroblob(40))) FROM c;\n\
               SELECT 'sum', count(*), sum(length(v)), sum(id) FROM t;\n\
               SELECT v FROM t WHERE id = 599999;";
    let dir = tmpdir("sqlite");
    let script = dir.join("load.sql");
    std::fs::write(&script, sql).unwrap();
    let o = run_managed(
        "sqlite",
        "24M",
        &["sh", "-c", &format!("sqlite3 :memory: < {}", script.display())],
        "sum|600000|53400000|180000300000",
        240,
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains(&format!("00599999-{}", "0".repeat(80))), "{}", text(&o));
}

/// gcc -O2 of a generated file: the driver execs cc1 (~120 MB of RSS
/// natively, in glibc's heap) and then as, all under one 24M limit, and
/// the object file is byte for byte the one compiled without zmem.
#[test]
fn gcc_compiles_under_a_fifth_of_its_memory_to_the_same_object_file() {
    let dir = tmpdir("gcc");
    let mut src = String::from("#include <stdint.h>\n");
    let mut x = 7u64;
    for f in 0..8 {
        src += &format!("uint64_t f{f}(uint64_t x, uint64_t y) {{\n");
        for _ in 0..1500 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let (a, b) = (x % (1 << 30) + 1, x % 63 + 1);
            src += &match x % 4 {
                0 => format!("  x = x * {a}u + (y >> {b});\n"),
                1 => format!("  y ^= (x << {b}) + {a}u;\n"),
                2 => format!("  if (x & {a}u) y += x; else x -= y ^ {a}u;\n"),
                _ => format!("  x = (x ^ y) * {a}u;\n"),
            };
        }
        src += "  return x ^ y;\n}\n";
    }
    let c = dir.join("gen.c");
    std::fs::write(&c, src).unwrap();
    let (native, managed) = (dir.join("native.o"), dir.join("managed.o"));
    let st = Command::new("gcc").args(["-O2", "-c"]).arg(&c).arg("-o").arg(&native).status().unwrap();
    assert!(st.success(), "gcc without zmem");
    let cmd = format!("gcc -O2 -c {} -o {} && echo compiled", c.display(), managed.display());
    run_managed("gcc", "24M", &["sh", "-c", &cmd], "compiled", 300);
    let (a, b) = (std::fs::read(&native).unwrap(), std::fs::read(&managed).unwrap());
    assert!(a.len() > 10_000 && a == b, "the object files differ ({} and {} bytes)", a.len(), b.len());
}

/// V8's heap (256 KiB pages committed in a reservation) and a Buffer, 4x
/// the limit, every object and every page of the buffer checked.
#[test]
fn a_node_heap_4x_the_limit_is_managed_and_checked() {
    let js = r#"
const n = 600000, objs = [];
for (let i = 0; i < n; i++) objs.push({ id: i, s: 'x'.repeat(16) + i, a: [i, i * 2, i * 3] });
const buf = Buffer.alloc(96 << 20);
for (let i = 0; i < buf.length; i += 4096) buf.writeUInt32LE((i ^ 0x5a5a5a5a) >>> 0, i);
for (let i = 0; i < n; i++) { const o = objs[i]; if (o.id !== i || o.a[2] !== i * 3 || o.s !== 'x'.repeat(16) + i) throw new Error('bad ' + i); }
for (let i = 0; i < buf.length; i += 4096) if (buf.readUInt32LE(i) !== ((i ^ 0x5a5a5a5a) >>> 0)) throw new Error('buf ' + i);
console.log('node ok', n);
"#;
    run_managed("node", "48M", &["node", "-e", js], "node ok 600000", 300);
}

/// A JVM heap (reserved, committed with mmap over the reservation) 4x the
/// limit, every element checked.
#[test]
fn a_jvm_heap_4x_the_limit_is_managed_and_checked() {
    let dir = tmpdir("jvm");
    let src = dir.join("Heap.java");
    std::fs::write(
        &src,
        r#"public class Heap { public static void main(String[] a) {
    int n = Integer.parseInt(a[0]); long[][] arrs = new long[n][]; long sum = 0;
    for (int i = 0; i < n; i++) { arrs[i] = new long[1 << 17]; for (int j = 0; j < arrs[i].length; j++) arrs[i][j] = (long) i * 1000003L + j * 7L; }
    for (int i = 0; i < n; i++) for (int j = 0; j < arrs[i].length; j++) { if (arrs[i][j] != (long) i * 1000003L + j * 7L) throw new RuntimeException("bad " + i + " " + j); sum += arrs[i][j]; }
    System.out.println("jvm ok " + sum); } }"#,
    )
    .unwrap();
    // Java 11+ runs a single source file as is.
    run_managed("jvm", "64M", &["java", "-Xmx1g", "-XX:+UseSerialGC", src.to_str().unwrap(), "256"], "jvm ok ", 300);
}

/// Go's heap (arenas reserved, then mapped over) in a cgo program, which
/// is dynamically linked, so the shim is loaded; 4x the limit, checked.
#[test]
fn a_go_heap_4x_the_limit_is_managed_and_checked() {
    let dir = tmpdir("go");
    std::fs::write(dir.join("go.mod"), "module heap\ngo 1.21\n").unwrap();
    std::fs::write(
        dir.join("main.go"),
        r#"package main

// #include <stdlib.h>
import "C"

import "fmt"

func main() {
	n := 256
	bufs := make([][]uint64, n)
	for i := range bufs {
		b := make([]uint64, 1<<17)
		for j := range b {
			b[j] = uint64(i)*1000003 + uint64(j)*7
		}
		bufs[i] = b
	}
	var sum uint64
	for i, b := range bufs {
		for j, v := range b {
			if v != uint64(i)*1000003+uint64(j)*7 {
				panic(fmt.Sprintf("bad %d %d", i, j))
			}
			sum += v
		}
	}
	C.free(C.malloc(16))
	fmt.Println("go ok", sum)
}
"#,
    )
    .unwrap();
    let go = ["/usr/local/go/bin/go", "/usr/bin/go"].into_iter().find(|p| Path::new(p).is_file()).unwrap_or("go");
    let exe = dir.join("heap");
    let st = Command::new(go)
        .args(["build", "-o"])
        .arg(&exe)
        .arg(".")
        .current_dir(&dir)
        .env("CGO_ENABLED", "1")
        .status()
        .expect("the Go toolchain");
    assert!(st.success(), "go build failed");
    run_managed("go", "64M", &[exe.to_str().unwrap()], "go ok ", 300);
}

/// Runs `cmd` once without zmem and once under `zmem run --limit LIMIT`,
/// and checks that both succeed and print the same bytes, which start
/// with `want`, and that zmem evicted at least `evicted` folios. (The
/// memory of a runtime that maps it after the shim starts is managed
/// from its mmap, not adopted, so adoption is not asked for.)
fn same_as_native(name: &str, limit: &str, cmd: &[&str], want: &str, evicted: u64, secs: u64) {
    let native = Command::new(cmd[0]).args(&cmd[1..]).output().unwrap_or_else(|e| panic!("{}: {e}", cmd[0]));
    assert!(native.status.success(), "{} without zmem: {}", cmd[0], text(&native));
    assert!(native.stdout.starts_with(want.as_bytes()), "{} without zmem: {}", cmd[0], text(&native));
    let stats = tmpdir(&format!("{name}-stats"));
    let env = [("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "50")];
    let o = run_checked(name, limit, cmd, &env, want, secs);
    assert_eq!(o.stdout, native.stdout, "{}", text(&o));
    // A panic on one of zmem's threads (the BEAM closed the stats
    // thread's directory under it) is not the program's output.
    assert!(!String::from_utf8_lossy(&o.stderr).contains("panicked"), "{}", text(&o));
    let n = pager_max(&stats, "evicted_folios");
    assert!(n >= evicted, "evicted {n} folios, want {evicted}; {}", text(&o));
}

/// Ruby's object heap (64 KiB pages it maps itself) and its malloc'd
/// string bodies, 4x the limit: a full GC, then `GC.compact`, which moves
/// objects between heap pages, then every string checked.
#[test]
fn ruby_compacts_a_heap_4x_the_limit_and_every_string_reads_back() {
    let rb = r#"
n = 250_000
a = Array.new(n) { |i| ("%08d" % i) * 48 }
h = {}
a.each_with_index { |s, i| h[i] = s.reverse }
GC.start(full_mark: true, immediate_sweep: true)
GC.compact
n.times { |i| raise "bad #{i}" unless a[i] == ("%08d" % i) * 48 && h[i] == a[i].reverse }
puts "ruby ok #{a.sum(&:bytesize)} #{h[n - 1][0, 16]}"
"#;
    same_as_native("ruby", "32M", &["ruby", "-e", rb], "ruby ok 96000000", 2000, 300);
}

/// PHP's Zend allocator (2 MiB chunks, aligned by mapping more and
/// unmapping the rest) holding arrays and a hash table 4x the limit,
/// every value checked after the cycle collector ran.
#[test]
fn php_zend_allocator_chunks_4x_the_limit_are_managed_and_checked() {
    let php = r#"
$n = 250000; $a = [];
for ($i = 0; $i < $n; $i++) { $a[] = str_repeat(sprintf("%08d", $i), 48); }
$h = [];
foreach ($a as $i => $s) { $h["k$i"] = strrev($s); }
gc_collect_cycles();
$t = 0;
for ($i = 0; $i < $n; $i++) {
    if ($a[$i] !== str_repeat(sprintf("%08d", $i), 48) || $h["k$i"] !== strrev($a[$i])) { echo "bad $i\n"; exit(1); }
    $t += strlen($a[$i]);
}
echo "php ok $t ", md5($h["k" . ($n - 1)]), "\n";
"#;
    same_as_native("php", "32M", &["php", "-n", "-d", "memory_limit=-1", "-r", php], "php ok 96000000", 2000, 300);
}

/// Lua's collector walks every object it holds (~5x the limit) at each
/// full cycle; every string checked after one.
#[test]
fn lua_collects_garbage_over_a_heap_5x_the_limit_and_reads_it_back() {
    let lua = r#"
local n, a, h = 60000, {}, {}
for i = 1, n do a[i] = string.rep(string.format("%08d", i), 48) end
for i = 1, n do h["k" .. i] = a[i]:reverse() end
collectgarbage("collect")
local t = 0
for i = 1, n do
  assert(a[i] == string.rep(string.format("%08d", i), 48) and h["k" .. i] == a[i]:reverse(), i)
  t = t + #a[i]
end
print("lua ok " .. t .. " " .. h["k" .. n]:sub(1, 16))
"#;
    same_as_native("lua", "24M", &["lua5.4", "-e", lua], "lua ok 23040000", 1000, 300);
}

/// The BEAM (Erlang): scheduler threads, carriers its allocators map, an
/// ETS table and binaries 5x the limit, every one checked. The BEAM
/// closes descriptors it did not open while zmem's stats thread lists its
/// directory: that thread panicked (EBADF from `closedir`) until
/// directories were read through kept descriptors (`fds::dir_names`).
#[test]
fn an_erlang_vm_with_an_ets_table_5x_the_limit_is_managed_and_checked() {
    let erl = r#"
N = 60000,
B = fun(I) -> binary:copy(list_to_binary(io_lib:format("~8..0B", [I])), 48) end,
T = ets:new(t, [set]),
[ets:insert(T, {I, B(I)}) || I <- lists:seq(1, N)],
L = [B(I) || I <- lists:seq(1, N)],
erlang:garbage_collect(),
S = lists:foldl(fun({I, X}, Acc) -> [{I, Y}] = ets:lookup(T, I), X = B(I), Y = X, Acc + byte_size(X) end, 0, lists:zip(lists:seq(1, N), L)),
io:format("erlang ok ~p ~p~n", [S, erlang:md5(lists:last(L))]),
halt().
"#;
    same_as_native("erlang", "24M", &["erl", "-noshell", "-eval", erl], "erlang ok 23040000", 1000, 300);
}

/// Guile's collector (Boehm's, conservative) stops the world with
/// signals and scans every thread's stack and the whole heap, 4x the
/// limit; every string checked after it.
#[test]
fn guile_with_boehms_collector_over_a_heap_4x_the_limit_reads_everything_back() {
    let scm = r#"
(define n 250000)
(define (s i) (let ((d (string-pad (number->string i) 8 #\0))) (string-concatenate (make-list 48 d))))
(define v (make-vector n))
(do ((i 0 (+ i 1))) ((= i n)) (vector-set! v i (s i)))
(gc)
(define t 0)
(do ((i 0 (+ i 1))) ((= i n))
  (unless (string=? (vector-ref v i) (s i)) (error "bad" i))
  (set! t (+ t (string-length (vector-ref v i)))))
(display "guile ok ") (display t) (newline)
"#;
    same_as_native("guile", "32M", &["guile", "--no-auto-compile", "-c", scm], "guile ok 96000000", 2000, 300);
}

/// `main` ends with `pthread_exit` and a worker thread writes 4x the limit:
/// with the main thread gone, `/proc/self` has no memory (every scan for
/// mappings failed, ESRCH, so nothing was adopted), and when the worker
/// returned, zmem's threads alone kept the process alive as a zombie with
/// threads: `zmem run` waited for good. Now the process is managed, and
/// it ends with the worker, with the status it would have without zmem.
#[test]
fn a_program_whose_main_thread_exits_first_is_managed_and_ends_with_its_last_thread() {
    let exe = compile_c_with("main_exits", &["-pthread"]);
    let stats = tmpdir("main-exits-stats");
    let o = zmem(
        &["run", "--limit", "32M", "--", exe.to_str().unwrap()],
        &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "50")],
        120,
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("worker: 0 bad words"), "{}", text(&o));
    assert!(!String::from_utf8_lossy(&o.stderr).contains("failed"), "{}", text(&o));
    assert!(pager_max(&stats, "evicted_folios") > 500, "{}", text(&o));
}

/// A program that changes its root to a directory without `/proc` (as
/// OpenSSH's pre-authentication child and chrooted servers do) stays
/// managed: what it maps after the `chroot` is paged through the limit.
/// Every scan for mappings to adopt failed there (`/proc/thread-self/maps`
/// was opened by its path), with a warning each time, hundreds in a run,
/// and the stats thread made its directory inside the new root, or said it
/// could not. A child forked after the change started a pager with no tree,
/// no swap file and no scans, warning of each; now it runs unmanaged, with
/// one warning, and sees its parent's memory.
#[test]
fn a_program_that_changes_its_root_stays_managed_and_leaves_nothing_there() {
    let exe = compile_c("chroot");
    let jail = tmpdir("chroot-jail");
    // 9 s in a release build, 52 s in CI's debug build alone, and past 120 s
    // once beside the other tests with a build running (CI at `e081470`).
    let o = zmem(&["run", "--limit", "64M", "--", exe.to_str().unwrap(), jail.to_str().unwrap(), "256"], &[], 300);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("\nok\n"), "{}", text(&o));
    let peak_kib: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("maxrss_kib="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no peak RSS: {}", text(&o)));
    // 512 MiB written; natively its peak is ~520 MiB.
    assert!(peak_kib < 160 << 10, "peak RSS {peak_kib} KiB under a 64 MiB limit: {}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.matches("was forked after its parent changed its root").count(), 1, "{}", text(&o));
    assert!(!err.contains("failed") && !err.contains("stats file"), "{}", text(&o));
    let left: Vec<_> = std::fs::read_dir(&jail).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(left.is_empty(), "zmem left {left:?} in the new root: {}", text(&o));
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

/// After a `chroot` (no `/proc` inside) a program's threads are counted
/// and zmem's own are known without `/proc`:
/// - `keep`: the main thread ends first (`pthread_exit`) and the process
///   ends with its worker. zmem read `/proc/self/stat` by its path to see
///   that only its own threads were left, and the process stayed, a
///   zombie with zmem's threads, deaf to every signal but SIGKILL.
/// - `drop`: the program gives up its capabilities with `capset` through
///   glibc's `syscall`. zmem's threads kept all of root's (they were
///   listed from `/proc/self/task`, and the shim's `syscall` did not look
///   at `capset`); now zmem gives the memory back, runs unmanaged with one
///   warning, and no thread of the process has a capability left.
#[test]
fn after_a_chroot_zmem_knows_its_threads_and_the_program_can_drop_its_capabilities_and_end() {
    use std::io::{BufRead, Write};
    let exe = compile_c_with("chroot_caps", &["-pthread"]);
    for mode in ["keep", "drop"] {
        let jail = tmpdir(&format!("chroot-caps-{mode}"));
        let mut c = Command::new(env!("CARGO_BIN_EXE_zmem"));
        c.args(["run", "--limit", "32M", "--", exe.to_str().unwrap(), jail.to_str().unwrap(), "64", mode])
            .env("ZMEM_PRELOAD", preload())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        let mut child = c.spawn().unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut stderr = child.stderr.take().unwrap();
        let err = std::thread::spawn(move || {
            let mut buf = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut buf);
            buf
        });
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in stdout.lines() {
                let _ = tx.send(l.unwrap_or_default());
            }
        });
        let ready = rx.recv_timeout(Duration::from_secs(60));
        let pid: u32 = match ready.as_deref().ok().and_then(|l| l.strip_prefix("ready ")) {
            Some(p) => p.parse().unwrap(),
            None => {
                // SAFETY: kills the group the test made.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
                panic!("{mode}: no ready line ({ready:?}): {}", err.join().unwrap());
            }
        };
        let mut threads = Vec::new();
        for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
            let eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap_or("?").trim().to_string();
            threads.push((comm.trim().to_string(), eff));
        }
        writeln!(stdin, "go").unwrap();
        drop(stdin);
        wait_or_kill_group(&mut child, 60, &format!("chroot_caps {mode}"));
        let status = child.wait().unwrap();
        let out: Vec<String> = rx.try_iter().collect();
        let err = err.join().unwrap();
        let what = format!("{mode}: {status:?}, threads {threads:?}\nstdout {out:?}\nstderr {err}");
        assert_eq!(status.code(), Some(0), "{what}");
        let worker = out.iter().find_map(|l| l.strip_prefix("worker: 0 bad words, maxrss_kib="));
        let peak_kib: u64 = worker.and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{what}"));
        let warning = "changes its credentials or namespaces after changing its root";
        if mode == "keep" {
            assert!(threads.iter().any(|(c, _)| c.starts_with("zmem-")), "{what}");
            // 128 MiB written; natively the peak is ~130 MiB.
            assert!(peak_kib < 96 << 10, "peak RSS {peak_kib} KiB under a 32 MiB limit: {what}");
            assert!(!err.contains(warning), "{what}");
        } else {
            assert!(threads.iter().all(|(c, eff)| !c.starts_with("zmem-") && eff == "0000000000000000"), "{what}");
            assert_eq!(err.matches(warning).count(), 1, "{what}");
        }
        let left: Vec<_> = std::fs::read_dir(&jail).unwrap().map(|e| e.unwrap().path()).collect();
        assert!(left.is_empty(), "zmem left {left:?} in the new root: {what}");
    }
}

/// Debian's python3 with libseccomp's bindings (python3-seccomp).
const SYSTEM_PYTHON: &str = "/usr/bin/python3";

/// A program that loads a seccomp filter with `TSYNC` puts zmem's threads
/// under it too: this one kills a thread at `ioctl` or `pwrite64`, so
/// zmem's handler died at its next `UFFDIO_COPY` and the program's next
/// fault waited for good. libseccomp installs it through glibc's `syscall`.
/// The shim gives the memory back first; the program reads back what it
/// wrote before and after, and says so with a warning.
#[test]
fn a_program_that_loads_a_seccomp_filter_for_all_its_threads_gets_its_memory_back_first() {
    let stats = tmpdir("tsync-stats");
    let py = "import os, seccomp\n\
              b = [bytearray(os.urandom(64) * 16384) for _ in range(96)]\n\
              f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)\n\
              for call in ('ioctl', 'pwrite64', 'unlink'):\n    f.add_rule(seccomp.KILL, call)\n\
              f.set_attr(seccomp.Attr.CTL_TSYNC, 1)\n\
              f.load()\n\
              c = [bytearray(os.urandom(64) * 16384) for _ in range(32)]\n\
              print('ok', all(len(x) == 1 << 20 and x[:64] == x[-64:] for x in b + c), flush=True)\n";
    let o = zmem(
        &["run", "--limit", "32M", "--", SYSTEM_PYTHON, "-c", py],
        &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "20")],
        120,
    );
    assert!(o.status.success(), "python3-seccomp (.ci/run installs it): {}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("ok True"), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("puts itself under a seccomp filter"), "{}", text(&o));
    // Managed before the filter: 96 MiB under 32M.
    assert!(pager_max(&stats, "evicted_folios") > 500, "{}", text(&o));
}

/// A filter installed with a raw `syscall` instruction goes past the shim,
/// and covers zmem's threads (`TSYNC`). Where it killed the handler at its
/// next `UFFDIO_COPY`, or refused the COPY (EPERM), the program's next
/// fault on evicted memory waited for good, silently. The process is now
/// stopped loudly (SIGABRT, with a line that says why) within a second or
/// two, never read back wrong.
#[test]
fn a_filter_installed_behind_the_shims_back_that_refuses_zmems_calls_stops_the_program_loudly() {
    let exe = compile_c("rawfilter");
    for action in ["kill", "errno"] {
        let started = Instant::now();
        let o = zmem(&["run", "--limit", "16M", "--", exe.to_str().unwrap(), action], &[], 60);
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(!out.contains("bad "), "{action}: the program went on: {}", text(&o));
        assert_eq!(o.status.code(), Some(128 + 6), "{action}: not stopped by SIGABRT: {}", text(&o));
        let why = if action == "kill" {
            "thread was killed (a seccomp filter"
        } else {
            "a seccomp filter that zmem did not see"
        };
        assert!(err.contains(why), "{action}: {}", text(&o));
        assert!(started.elapsed() < Duration::from_secs(30), "{action}: {:?}", started.elapsed());
    }
}

/// A program exec'd under a filter that kills at `userfaultfd` (bubblewrap's
/// `--seccomp`, as a systemd unit's `SystemCallFilter=` would) died of
/// SIGSYS at the shim's start, where it runs fine without zmem. Its shim
/// now probes the filter in a child first, and stays off with a warning.
/// Under a filter that returns EPERM there instead, the same program is
/// managed (`/dev/userfaultfd`). A filter that kills at `clone` for threads
/// only (`ENOSYS` for `clone3`, so that glibc falls back to `clone`) let the
/// probe's fork by, and the single-threaded program died of SIGSYS at the
/// pager's first thread: the probe makes a thread too now.
#[test]
fn a_program_started_under_a_filter_that_kills_userfaultfd_runs_unmanaged() {
    let dir = tmpdir("filtered");
    let make = "import errno, seccomp, sys\n\
                f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)\n\
                if sys.argv[1] == 'threads':\n    \
                f.add_rule(seccomp.KILL, 'clone', seccomp.Arg(0, seccomp.MASKED_EQ, 0x10000, 0x10000))\n    \
                f.add_rule(seccomp.ERRNO(errno.ENOSYS), 'clone3')\n\
                else:\n    \
                f.add_rule(seccomp.KILL_PROCESS if sys.argv[1] == 'kill' else seccomp.ERRNO(errno.EPERM), 'userfaultfd')\n\
                f.export_bpf(open(sys.argv[2], 'wb'))\n";
    let py = "b = [bytearray(1 << 20) for _ in range(96)]\n\
              for i, x in enumerate(b):\n    x[::4096] = bytes([i % 251]) * 256\n\
              print('ok', all(x[::4096] == bytes([i % 251]) * 256 for i, x in enumerate(b)), flush=True)\n";
    for (action, managed) in [("kill", false), ("errno", true), ("threads", false)] {
        let bpf = dir.join(format!("{action}.bpf"));
        let o = Command::new(SYSTEM_PYTHON).args(["-c", make, action]).arg(&bpf).output().unwrap();
        assert!(o.status.success(), "python3-seccomp (.ci/run installs it): {}", text(&o));
        let stats = tmpdir(&format!("filtered-{action}-stats"));
        // bubblewrap reads the filter from descriptor 9.
        let shell =
            format!("exec 9<{}; exec bwrap --dev-bind / / --seccomp 9 -- {SYSTEM_PYTHON} -c \"$0\"", bpf.display());
        let o = zmem(
            &["run", "--limit", "32M", "--", "sh", "-c", &shell, py],
            &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "20")],
            120,
        );
        assert!(o.status.success(), "{action}: {}", text(&o));
        assert!(String::from_utf8_lossy(&o.stdout).contains("ok True"), "{action}: {}", text(&o));
        let warned = String::from_utf8_lossy(&o.stderr).contains("runs under a seccomp filter that kills");
        assert_eq!(warned, !managed, "{action}: {}", text(&o));
        let evicted = pager_max(&stats, "evicted_folios");
        assert_eq!(evicted > 500, managed, "{action}: {evicted} folios evicted; {}", text(&o));
    }
}

/// A filter the shim does not see (installed through the C library's own
/// `syscall`, as a raw system call would be) kills the program's only
/// thread (`SECCOMP_RET_KILL` kills a thread): without zmem that ends the
/// process with SIGSYS. zmem's threads kept it alive, a zombie with
/// threads, and `zmem run` waited for good. Now the process ends as it
/// would have: killed by SIGSYS (`zmem run` exits with 128 + 31).
#[test]
fn a_thread_its_own_filter_kills_ends_the_process_as_it_would_without_zmem() {
    let py = "import ctypes, os, seccomp, tempfile\n\
              b = [bytearray(os.urandom(64) * 16384) for _ in range(64)]\n\
              f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)\n\
              f.add_rule(seccomp.KILL, 'getppid')\n\
              t = tempfile.TemporaryFile()\n\
              f.export_bpf(t)\n\
              t.seek(0)\n\
              code = t.read()\n\
              class Prog(ctypes.Structure):\n    _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]\n\
              buf = ctypes.create_string_buffer(code, len(code))\n\
              p = Prog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))\n\
              libc = ctypes.CDLL('libc.so.6')\n\
              print('filter', libc.syscall(317, 1, 0, ctypes.byref(p)), flush=True)\n\
              os.getppid()\n\
              print('not reached', flush=True)\n";
    let o = zmem(&["run", "--limit", "32M", "--", SYSTEM_PYTHON, "-c", py], &[], 120);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("filter 0") && !out.contains("not reached"), "{}", text(&o));
    assert_eq!(o.status.code(), Some(128 + libc::SIGSYS), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("killed by signal 31"), "{}", text(&o));
}

/// OpenSSH's server, a forking server that sandboxes its
/// pre-authentication child: `RLIMIT_FSIZE` and `RLIMIT_NOFILE` set to 0,
/// then a seccomp filter that kills the thread at any call it does not
/// list. The shim's `unlink` of its stats file at that child's exit was
/// such a call: zmem's threads kept the child alive, and every `ssh` hung
/// after authentication. Three logins each run python3, which writes 4x
/// the limit under the same tree and hashes it.
#[test]
fn ssh_logins_to_a_server_under_zmem_run_run_their_commands_and_end() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: sshd's privilege separation needs root");
        return;
    }
    let dir = tmpdir("sshd");
    for key in ["host", "user"] {
        let st = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(dir.join(key))
            .status()
            .expect("ssh-keygen (.ci/run installs openssh-client)");
        assert!(st.success());
    }
    std::fs::copy(dir.join("user.pub"), dir.join("authorized_keys")).unwrap();
    let port = 30000 + std::process::id() % 20000;
    let config = format!(
        "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host\nPermitRootLogin yes\n\
         AuthorizedKeysFile {d}/authorized_keys\nStrictModes no\nPasswordAuthentication no\nUsePAM no\n\
         PidFile {d}/sshd.pid\n",
        d = dir.display()
    );
    std::fs::write(dir.join("sshd_config"), config).unwrap();
    // sshd's privilege separation directory, made by its service otherwise.
    let privsep = Path::new("/run/sshd");
    let made = !privsep.exists();
    if made {
        std::fs::create_dir(privsep).unwrap();
    }
    let mut c = Command::new(env!("CARGO_BIN_EXE_zmem"));
    c.args(["run", "--limit", "64M", "--", "/usr/sbin/sshd", "-D", "-e", "-f"]).arg(dir.join("sshd_config"));
    // The stats in the user's default directory, where each file goes at
    // its process's exit (with `ZMEM_STATS_DIR` it stays, and the child's
    // exit made no call its filter forbids).
    c.env("ZMEM_PRELOAD", preload()).env_remove("ZMEM_STATS_DIR");
    let log = dir.join("sshd.log");
    c.stdout(Stdio::null()).stderr(std::fs::File::create(&log).unwrap());
    std::os::unix::process::CommandExt::process_group(&mut c, 0);
    let mut server = c.spawn().expect("zmem run -- /usr/sbin/sshd (.ci/run installs openssh-server)");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port as u16)).is_err() {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(server.try_wait().unwrap().is_none(), "sshd exited at start: {log}");
        assert!(Instant::now() < deadline, "sshd did not listen in 30 s: {log}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Its resident memory last: under the 64M limit, well below the 256 MiB
    // it wrote.
    let py = "import hashlib\n\
              b = bytearray(256 << 20)\n\
              for i in range(0, len(b), 4096): b[i] = i // 4096 % 251\n\
              print(\"sha\", hashlib.sha256(b).hexdigest())\n\
              print(\"rss\", [l.split()[1] for l in open(\"/proc/self/status\") if l.startswith(\"VmRSS\")][0])\n";
    // The same, without zmem.
    let native = Command::new("python3").args(["-c", py]).output().unwrap();
    let native = String::from_utf8_lossy(&native.stdout).to_string();
    let want = native.lines().next().unwrap_or_default().to_string();
    assert!(want.starts_with("sha "), "{native}");
    let mut outs = Vec::new();
    for _ in 0..3 {
        let mut ssh = Command::new("ssh");
        ssh.args(["-q", "-p", &port.to_string(), "-i"]).arg(dir.join("user"));
        ssh.args(["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]);
        ssh.arg("root@127.0.0.1").arg(format!("python3 -c '{py}'"));
        let Ok(o) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| output_within(&mut ssh, 120, "ssh")))
        else {
            outs.push(format!("hung; server: {}", group_threads(server.id())));
            break;
        };
        let (status, out, err) = (o.status, String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        outs.push(format!("{status}: {out}{err}"));
    }
    // SAFETY: signals the process group this test made; kill(2) touches no
    // memory of ours.
    unsafe { libc::kill(-(server.id() as i32), libc::SIGTERM) };
    let _ = server.wait();
    // And what is left of the group: a hung child (zmem's threads block
    // SIGTERM) would stay behind.
    // SAFETY: as above.
    unsafe { libc::kill(-(server.id() as i32), libc::SIGKILL) };
    // The sandboxed child chroots into it as root: zmem's stats thread made
    // its default directory there.
    let left: Vec<_> = std::fs::read_dir(privsep).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    if made {
        let _ = std::fs::remove_dir_all(privsep);
    }
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(left.is_empty(), "left in sshd's new root: {left:?}\n{log}");
    assert_eq!(outs.len(), 3, "{outs:?}\n{log}");
    for o in &outs {
        assert!(o.starts_with("exit status: 0") && o.contains(&want), "{outs:?}\n{log}");
        // What the sessions started was managed, under the server's limit.
        let rss: u64 = o.split("rss ").nth(1).and_then(|r| r.split_whitespace().next()?.parse().ok()).unwrap_or(0);
        assert!(rss > 0 && rss < 160 << 10, "VmRSS {rss} kB: {outs:?}\n{log}");
    }
}

/// A program built with AddressSanitizer starts, runs unmanaged with one
/// warning, and gets the user's `ASAN_OPTIONS` with the link-order check
/// off. Before, ASan refused to start behind the shim; told not to check,
/// it crashed in the shim's first `malloc` (its start-up `dlsym`, before
/// any constructor, reached a Rust thread-local through ASan's own
/// `__tls_get_addr`, not yet set up); and managed, it hung (ASan's
/// interceptors reached its evicted metadata from zmem's own threads).
#[test]
fn a_program_built_with_address_sanitizer_runs_unmanaged_with_a_warning() {
    let exe = compile_c_with("asan", &["-fsanitize=address", "-g"]);
    let o = zmem(&["run", "--limit", "32M", "--", exe.to_str().unwrap()], &[("ASAN_OPTIONS", "halt_on_error=1")], 120);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(out.contains("ok: 0 bad"), "{}", text(&o));
    assert!(out.contains("ASAN_OPTIONS=halt_on_error=1:verify_asan_link_order=0"), "{}", text(&o));
    assert_eq!(err.matches("runs with AddressSanitizer").count(), 1, "{}", text(&o));
    assert!(err.contains("runs unmanaged"), "{}", text(&o));
}

/// A program that crashes with most of its memory evicted dumps core with
/// every page of it, bit-identical (tests/data/coredump.c): a SIGSEGV on a
/// second thread, an `abort`, a SIGSEGV that a handler of the program's
/// passes on by putting back the action it found (as Python's
/// `faulthandler` does), and one whose handler ends with
/// `signal(sig, SIG_DFL)` and `raise`. Before, the kernel dumped after killing zmem's
/// threads and never waits for a userfaultfd while dumping: every evicted
/// page read as zeros in the dump. The program also sees `SIG_DFL` where
/// the shim's handler is. Needs `core_pattern` = `core` (the dump in the
/// working directory), which this test does not change.
#[test]
fn a_core_dump_holds_the_memory_zmem_had_evicted() {
    let pattern = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap_or_default();
    if pattern.trim() != "core" {
        eprintln!("skipped: kernel.core_pattern is {:?}, not `core`", pattern.trim());
        return;
    }
    const MUL: u64 = 2654435761;
    let exe = compile_c_with("coredump", &["-pthread"]);
    for (mode, code) in [("segv", 139), ("abort", 134), ("faulthandler", 139), ("signal", 139)] {
        let dir = tmpdir(&format!("core-{mode}"));
        let stats = tmpdir(&format!("core-{mode}-stats"));
        let mut c = Command::new("sh");
        c.current_dir(&dir)
            .args(["-c", "ulimit -c unlimited && exec \"$@\"", "sh", env!("CARGO_BIN_EXE_zmem")])
            .args(["run", "--limit", "16M", "--", exe.to_str().unwrap(), "64", mode])
            .env("ZMEM_PRELOAD", preload())
            .env("ZMEM_STATS_DIR", &stats)
            .env("ZMEM_STATS_INTERVAL_MS", "50");
        let o = output_within(&mut c, 120, &format!("coredump {mode}"));
        assert_eq!(o.status.code(), Some(code), "{mode}: {}", text(&o));
        assert!(pager_max(&stats, "evicted_folios") > 0, "{mode}: nothing evicted; {}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let w: Vec<&str> = out.split_whitespace().collect();
        assert!(w.len() >= 5 && w[0] == "buf" && w[4] == "1", "{mode}: {}", text(&o));
        assert!(mode != "signal" || out.contains("prev dfl 1"), "{mode}: {}", text(&o));
        let addr = u64::from_str_radix(w[1].trim_start_matches("0x"), 16).unwrap();
        let len: u64 = w[2].parse().unwrap();
        let core = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("core")))
            .unwrap_or_else(|| panic!("{mode}: no core file in {}; {}", dir.display(), text(&o)));
        let d = std::fs::read(&core).unwrap();
        let (u16at, u32at, u64at) = (
            |o: usize| u16::from_le_bytes(d[o..o + 2].try_into().unwrap()) as usize,
            |o: usize| u32::from_le_bytes(d[o..o + 4].try_into().unwrap()),
            |o: usize| u64::from_le_bytes(d[o..o + 8].try_into().unwrap()),
        );
        assert_eq!(&d[..4], b"\x7fELF", "{mode}");
        let (phoff, phentsize, phnum) = (u64at(0x20) as usize, u16at(0x36), u16at(0x38));
        // PT_LOAD segments: (vaddr, file offset, bytes in the file).
        let loads: Vec<(u64, u64, u64)> = (0..phnum)
            .map(|i| phoff + i * phentsize)
            .filter(|&h| u32at(h) == 1)
            .map(|h| (u64at(h + 16), u64at(h + 8), u64at(h + 32)))
            .collect();
        let mut bad = 0;
        for off in (0..len).step_by(4096) {
            let a = addr + off;
            let word = loads
                .iter()
                .find(|&&(va, _, filesz)| va <= a && a + 8 <= va + filesz)
                .map(|&(va, fo, _)| u64at((fo + a - va) as usize));
            if word != Some(off.wrapping_mul(MUL)) {
                bad += 1;
            }
        }
        assert_eq!(bad, 0, "{mode}: {bad} of {} pages wrong or missing in the dump", len / 4096);
        std::fs::remove_file(&core).unwrap();
    }
}
