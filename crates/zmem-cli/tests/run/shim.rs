//! The shim living inside a host process: loader locks, closed descriptors,
//! allocators of the program's own, signal handlers, programs it cannot manage.

use std::path::Path;
use std::process::Command;

use crate::common::*;

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

/// A program whose executable defines the malloc family (rustc links
/// jemalloc in) gets glibc's own allocations too, the loader looking in the
/// executable first: among them the TLS vectors of zmem's threads. Adopted
/// and evicted with the program's memory, they hung it: the handler faulted
/// on its own vector, reclaim on one in the folio it was evicting (`cargo
/// build` hung in its first rustc). Each zmem thread's vector is now
/// pinned, never evicted (`zmem_common::host::tls`). Checked: 4 GiB hung with the build before,
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
