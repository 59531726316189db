//! Sandboxes and credentials: user and mount namespaces, bubblewrap, setpriv,
//! capabilities, users with userfaultfd for user mode only, chroot, seccomp.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

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
    // It stays 0.3 s after its check, so that the stats file, written
    // every 50 ms and not at the exit, counts every eviction (it read
    // 454-477 folios in runs that ended at once).
    let script = "import os, time\n\
                  b = [bytearray(os.urandom(64) * 16384) for _ in range(96)]\n\
                  print('ok', all(len(x) == 1 << 20 and x[:64] == x[-64:] for x in b), os.getuid(), os.getgid())\n\
                  time.sleep(0.3)\n";
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
    assert_nobody_gets_user_mode_only();
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
        c.args(["-u", "nobody", "--"]).arg(zmem_exe());
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
    c.args(["-u", "nobody", "--"]).arg(zmem_exe());
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

/// Fails unless this test may run programs as `nobody` (it runs as root)
/// and `nobody` gets a userfaultfd for faults from user mode only (the
/// kernel's defaults: `vm.unprivileged_userfaultfd=0`, `/dev/userfaultfd`
/// root's), saying what to change: the tests never skip themselves.
fn assert_nobody_gets_user_mode_only() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    let dev_open = std::fs::metadata("/dev/userfaultfd")
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o006 != 0)
        .unwrap_or(false);
    assert!(root, "this test runs programs as nobody: run the tests as root (scripts/test)");
    assert!(
        sysctl.trim() == "0" && !dev_open,
        "this test needs the kernel's defaults, under which nobody gets userfaultfd for user mode only: \
         vm.unprivileged_userfaultfd=0 (it is {}) and /dev/userfaultfd closed to others (open: {dev_open})",
        sysctl.trim()
    );
}

/// A tree started by root whose program drops its privileges before it
/// execs (`runuser`, as init scripts start servers): the program then gets
/// user mode only, and the exec gives it `glibc.pthread.rseq=0` (see
/// `zmem-preload/src/exec.rs`), added to the tunables it has and never
/// over what it says of rseq itself. A program that keeps root gets none.
#[test]
fn a_program_that_drops_root_before_it_execs_gets_glibcs_rseq_off() {
    assert_nobody_gets_user_mode_only();
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
        let mut c = Command::new(zmem_exe());
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

/// bubblewrap makes its sandbox's first process with a raw `clone` through
/// glibc's `syscall` (Chromium its zygote's children too), which runs no
/// fork handlers. Two ways that went wrong:
/// - That child calls `pivot_root` through `syscall`, and with a pid
///   namespace forks (glibc's `fork`) the sandbox's program. Where the
///   parent waited to start its pager, the shim's `pivot_root` and the
///   fork's prepare step took the waiting state's lock, which the child had
///   copied held when the parent's stats thread was in a look: the child
///   waited for good, one sandbox in a few hundred (CI's bubblewrap test
///   hung so).
/// - The child of a managed process had its parent's memory without the
///   pages evicted at the clone: every one read as zeros.
///
/// The shim now makes the fork's three steps around such a call (the
/// prepare step takes zmem's locks and loads every evicted folio back;
/// with `ZMEM_FORK_EVENT` the parent copies them into the child), and the
/// child runs unmanaged.
#[test]
fn children_made_by_a_raw_clone_read_their_parents_memory_back_whole() {
    let exe = compile_c("rawclone");
    let exe = exe.to_str().unwrap();
    // Under half the limit the parent waits, with its stats thread
    // looking every millisecond or two.
    let o = zmem(&["run", "--limit", "32M", "--", exe, "3000", "10", "clone"], &[], 120);
    assert!(o.status.success(), "waiting: {}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("ok 3000"), "waiting: {}", text(&o));
    // Twice the limit: managed, with most of it evicted at each clone.
    let ways = [("clone", "0"), ("clone-files", "0"), ("clone3", "0"), ("fork", "0"), ("clone", "1"), ("clone3", "1")];
    for (how, env) in ways {
        let stats = tmpdir(&format!("rawclone-{how}-{env}-stats"));
        let o = zmem(
            &["run", "--limit", "32M", "--", exe, "40", "64", how],
            &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_FORK_EVENT", env)],
            120,
        );
        assert!(o.status.success(), "{how}, ZMEM_FORK_EVENT={env}: {}", text(&o));
        assert!(String::from_utf8_lossy(&o.stdout).contains("ok 40"), "{how}, ZMEM_FORK_EVENT={env}: {}", text(&o));
        assert!(!String::from_utf8_lossy(&o.stderr).contains("zmem:"), "{how}, ZMEM_FORK_EVENT={env}: {}", text(&o));
        let evicted = pager_max(&stats, "evicted_folios");
        assert!(evicted > 500, "{how}, ZMEM_FORK_EVENT={env}: {evicted} folios evicted; {}", text(&o));
    }
}

/// bubblewrap's `--unshare-pid` puts the program in a pid namespace of its
/// own, where it is pid 2. Its slot in the tree held that pid, which
/// `zmem run` and the other processes looked up as the kernel's
/// `kthreadd`: the slot of a sandboxed program killed with its usage in it
/// never looked gone. The rest of the tree was throttled to what that
/// usage left of the limit, and `zmem run` left the tree's segment behind.
/// Slots now hold the pid that `/proc` shows (`NSpid`).
#[test]
fn a_program_killed_in_a_pid_namespace_of_its_own_gives_its_slot_and_the_segment_back() {
    let dir = tmpdir("pidns");
    let killed = dir.join("killed.py");
    std::fs::write(
        &killed,
        "import os\n\
         b = [bytearray(os.urandom(64) * 16384) for _ in range(96)]\n\
         print('tree', os.environ['ZMEM_TREE'], 'pid', os.getpid(), flush=True)\n\
         os.kill(os.getpid(), 9)\n",
    )
    .unwrap();
    let after = dir.join("after.py");
    std::fs::write(
        &after,
        "import os\n\
         b = [bytearray(os.urandom(64) * 16384) for _ in range(96)]\n\
         print('ok', all(len(x) == 1 << 20 and x[:64] == x[-64:] for x in b), flush=True)\n",
    )
    .unwrap();
    // The second program is not pid 2 (its shell forks it), so it cannot
    // take the killed one's slot over as its own.
    let shell = format!(
        "bwrap --dev-bind / / --unshare-pid -- {SYSTEM_PYTHON} {};          bwrap --dev-bind / / --unshare-pid -- sh -c '{SYSTEM_PYTHON} {}; true'",
        killed.display(),
        after.display()
    );
    let stats = tmpdir("pidns-stats");
    let o =
        zmem(&["run", "--limit", "48M", "--", "sh", "-c", &shell], &[("ZMEM_STATS_DIR", stats.to_str().unwrap())], 120);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", text(&o));
    assert!(out.contains("pid 2\n"), "not pid 2 in its namespace: {}", text(&o));
    assert!(out.contains("ok True"), "{}", text(&o));
    let tree = out.split_whitespace().skip_while(|w| *w != "tree").nth(1).expect("the tree's path");
    assert!(!std::path::Path::new(tree).exists(), "zmem run left the tree's segment {tree} behind: {}", text(&o));
    assert!(pager_max(&stats, "evicted_folios") > 500, "{}", text(&o));
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
