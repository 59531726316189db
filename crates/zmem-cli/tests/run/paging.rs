//! C programs paged through their limit: mremap, sbrk, stacks, shared and
//! locked memory, the codec switch, a soft limit, core dumps.

use std::process::Command;

use crate::common::*;

#[test]
fn a_c_program_allocating_4x_its_limit_reads_everything_back() {
    let exe = compile_alloc();
    run_checked("c", "32M", &[exe.to_str().unwrap(), "128"], &[], "128 MiB checked, 0 bad words", 240);
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

/// glibc's main heap grows by an internal sbrk that no preload sees; a scan
/// every 100 ms found the growth only once the program had filled it, and
/// usage went far over the limit (Python: a 69 MiB peak under 40M). The
/// shim adopts the growth as glibc's malloc returns (`adopt_brk_growth`).
/// tests/data/brk.c fills 256 MiB of 64 KiB blocks from the heap under a
/// 32M limit: every word reads back, and the tree's usage never went more
/// than a few reclaim batches over the limit.
#[test]
fn the_heap_grown_by_sbrk_is_managed_as_it_grows_and_usage_stays_near_the_limit() {
    let swap = tmpdir("brk-swap");
    fills_256m_under_32m("brk", &["--swapfile", swap.to_str().unwrap()], "4096 blocks, 0 bad words");
}

/// Runs `tests/data/NAME.c 256` (256 MiB filled, then every word checked)
/// under `zmem run --limit 32M` with `run_args`: it prints `want`, evicts
/// more than half of what it filled, and the tree's usage peaks within the
/// limit's slack.
fn fills_256m_under_32m(name: &str, run_args: &[&str], want: &str) {
    let exe = compile_c(name);
    let stats = tmpdir(&format!("{name}-stats"));
    let mut args = vec!["run", "--limit", "32M"];
    args.extend_from_slice(run_args);
    args.extend(["--", exe.to_str().unwrap(), "256"]);
    let o = zmem(&args, &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "20")], 120);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains(want), "{}", text(&o));
    let evicted = pager_max(&stats, "evicted_folios");
    assert!(evicted > 2048, "evicted {evicted} folios; {}", text(&o));
    assert_tree_peak_within(&stats, 16 << 20, 32 << 20, &text(&o));
}

/// A runtime that reserves its heap `PROT_NONE` and commits it piece by
/// piece with `mprotect` (V8, 256 KiB at a time) has each piece adopted as
/// it is committed (`Pager::adopt_committed`), not by a scan that finds it
/// filled: tests/data/commit.c commits and fills 256 MiB so under 32M, and
/// peaked at 174 MiB before.
#[test]
fn a_reservation_committed_by_mprotect_is_managed_as_it_is_committed() {
    fills_256m_under_32m("commit", &[], "1024 pieces, 0 bad words");
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

/// A program that crashes with most of its memory evicted dumps core with
/// every page of it, bit-identical (tests/data/coredump.c): a SIGSEGV on a
/// second thread, an `abort`, a SIGSEGV that a handler of the program's
/// passes on by putting back the action it found (as Python's
/// `faulthandler` does), and one whose handler ends with
/// `signal(sig, SIG_DFL)` and `raise`. Before, the kernel dumped after killing zmem's
/// threads and never waits for a userfaultfd while dumping: every evicted
/// page read as zeros in the dump. The program also sees `SIG_DFL` where
/// the shim's handler is. Needs `core_pattern` = `core` (the dump in the
/// working directory): set for the test where it is not, and put back.
#[test]
fn a_core_dump_holds_the_memory_zmem_had_evicted() {
    let _pattern = CorePattern::set("core");
    const MUL: u64 = 2654435761;
    let exe = compile_c_with("coredump", &["-pthread"]);
    for (mode, code) in [("segv", 139), ("abort", 134), ("faulthandler", 139), ("signal", 139)] {
        let dir = tmpdir(&format!("core-{mode}"));
        let stats = tmpdir(&format!("core-{mode}-stats"));
        let mut c = Command::new("sh");
        c.current_dir(&dir)
            .args(["-c", "ulimit -c unlimited && exec \"$@\"", "sh"])
            .arg(zmem_exe())
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

/// `kernel.core_pattern`, set to a value for as long as it lives, then put
/// back as it was.
struct CorePattern(Option<String>);

impl CorePattern {
    const PATH: &'static str = "/proc/sys/kernel/core_pattern";

    fn set(want: &str) -> CorePattern {
        let was = std::fs::read_to_string(Self::PATH).expect("kernel.core_pattern");
        if was.trim() == want {
            return CorePattern(None);
        }
        std::fs::write(Self::PATH, want).expect("set kernel.core_pattern (as root: scripts/test)");
        CorePattern(Some(was))
    }
}

impl Drop for CorePattern {
    fn drop(&mut self) {
        if let Some(was) = &self.0 {
            let _ = std::fs::write(Self::PATH, was.trim_end_matches('\n'));
        }
    }
}
