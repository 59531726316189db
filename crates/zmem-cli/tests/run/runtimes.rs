//! Language runtimes with heaps and collectors of their own, each over a heap
//! several times its limit, every value checked.

use std::path::Path;
use std::process::Command;

use crate::common::*;

#[test]
fn python_allocating_4x_its_limit_reads_everything_back() {
    run_checked("py", "32M", &["python3", "-c", PY, "128"], &[], "ok 128", 300);
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
    assert_tree_peak_within(&stats, 0, 32 << 20, &text(&o));
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
