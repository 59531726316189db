//! The command itself: flags and variables, exit status and signals, `zmem
//! stats`, the stats files and the C API.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

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
        let mut c = Command::new(zmem_exe());
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
        (vec!["run", "--max-slowdown", "0"], vec![], "ZMEM_MAX_SLOWDOWN=0: expected a percent above 0"),
        (vec!["run", "--max-slowdown", "150%"], vec![], "ZMEM_MAX_SLOWDOWN=150%: expected a percent above 0"),
        (vec!["run", "--max-slowdown", "abc"], vec![], "ZMEM_MAX_SLOWDOWN=abc: expected a percent, such as 5%"),
        (vec!["run"], vec![("ZMEM_MAX_SLOWDOWN", "-1%")], "expected a percent above 0"),
        (vec!["compare", "--max-slowdown", "abc"], vec![], "--max-slowdown=abc: expected a percent"),
        (vec!["compare", "--max-slowdown", "0%", "--limit", "64M"], vec![], "--max-slowdown=0%"),
        (vec!["compare"], vec![], "--limit"),
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

#[test]
fn zmem_stats_reads_a_running_process() {
    let stats = tmpdir("stats");
    let swap = tmpdir("stats-swap");
    let mut child = Command::new(zmem_exe())
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
    check_exposition(&p, pid);
    // The process tree that shares the limit, with this process in it.
    assert_eq!(v["tree"]["limit"], 32 << 20, "{v}");
    let members = v["tree"]["processes"].as_array().unwrap();
    assert!(
        members.iter().any(|m| m["pid"].as_u64() == pid.parse().ok() && m["usage_bytes"].as_u64() > Some(0)),
        "{v}"
    );
    // No --dir: the directory the process started with (its environment).
    let o = Command::new(zmem_exe()).args(["stats", pid]).env_remove("ZMEM_STATS_DIR").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("tier.zswpout") && out.contains("process tree: limit 32.0 MiB"), "{}", text(&o));
    assert!(child.wait().unwrap().success());
    let o = zmem(&["stats", "999999999"], &[("ZMEM_STATS_DIR", dir)], 30);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("zmem run"), "{}", text(&o));
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
    let zmem_bin = zmem_exe();
    let zmem_bin = zmem_bin.display();
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
    let o = Command::new(zmem_exe())
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

/// In a directory `ZMEM_STATS_DIR` names, a process's file stays after it
/// exits with its last counters: the exit has the stats thread write once
/// more. The interval here is 60 s, so the file's only writes are the
/// first one, at the pager's start, and the one at the exit: a program that
/// fills 96 MiB under 32M and exits at once must show the ~1,000 folios it
/// evicted (64 KiB each), not the first write's none.
#[test]
fn a_process_leaves_its_last_counters_in_a_named_stats_directory() {
    let stats = tmpdir("stats-last");
    let script = "b = [bytearray((b'%d,' % i) * 300000)[:1 << 20] for i in range(96)]\n\
                  print('ok', sum(len(x) for x in b) >> 20)\n";
    let o = zmem(
        &["run", "--limit", "32M", "--", "/usr/bin/python3", "-c", script],
        &[("ZMEM_STATS_DIR", stats.to_str().unwrap()), ("ZMEM_STATS_INTERVAL_MS", "60000")],
        120,
    );
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).starts_with("ok "), "{}", text(&o));
    let evicted = pager_max(&stats, "evicted_folios");
    assert!(evicted > 800, "{evicted} folios in the last stats: {}", text(&o));
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
    let o = Command::new(zmem_exe())
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
    let o = Command::new(zmem_exe())
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

/// `zmem bench start` runs a short program as is and under `zmem run`,
/// alternated, and reports both times and the difference; a run count of
/// 0 is an error.
#[test]
fn bench_start_reports_the_cost_of_starting_under_zmem_against_native() {
    let o = zmem(&["bench", "start", "--runs", "2", "--json", "--", "/usr/bin/python3", "-c", "pass"], &[], 120);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert_eq!(v["runs"], 2, "{v}");
    for k in ["native_ms_median", "zmem_ms_median", "native_ms_min", "zmem_ms_min", "zmem_vs_native"] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "{k} in {v}");
    }
    let o = zmem(&["bench", "start", "--runs", "0"], &[], 30);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--runs"), "{}", text(&o));
}

/// `text` is Prometheus's text exposition format as a scraper reads it:
/// every family named as the format allows, with one HELP and one TYPE
/// line before its first sample and none after; every sample labelled with
/// `pid`; and a parser of the format reads the same samples, with the
/// tier's counters typed as counters.
fn check_exposition(text: &str, pid: &str) {
    use std::collections::HashMap;
    let valid = |n: &str| {
        n.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    let (mut help, mut kind) = (HashMap::new(), HashMap::new());
    let mut samples = 0;
    for line in text.lines() {
        let words: Vec<&str> = line.splitn(4, ' ').collect();
        match words.as_slice() {
            ["#", "HELP", name, _] => assert!(help.insert(*name, ()).is_none(), "a second HELP: {line}"),
            ["#", "TYPE", name, t] => {
                assert!(["counter", "gauge", "untyped"].contains(t), "{line}");
                assert!(kind.insert(*name, *t).is_none(), "a second TYPE: {line}");
            }
            _ => {
                let name = &line[..line.find('{').expect("labels")];
                assert!(valid(name), "metric name {name:?}");
                assert!(
                    help.contains_key(name) && kind.contains_key(name),
                    "a sample before its HELP and TYPE: {line}"
                );
                assert!(line.contains(&format!("pid=\"{pid}\"")), "{line}");
                samples += 1;
            }
        }
    }
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("it parses");
    assert_eq!(scrape.samples.len(), samples, "the parser read every sample");
    let zswpout = scrape.samples.iter().find(|s| s.metric == "zmem_tier_zswpout").expect("zmem_tier_zswpout");
    assert!(matches!(zswpout.value, prometheus_parse::Value::Counter(n) if n > 0.0), "{:?}", zswpout.value);
    assert_eq!(scrape.docs.get("zmem_tier_zswpout").map(String::as_str), Some("Pages stored"));
}
