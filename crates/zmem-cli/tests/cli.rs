//! The `zmem` binary, run as a user would run it.

use std::process::Command;

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zmem")).args(args).output().expect("run zmem");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn bench_compress_json_reports_every_codec_and_batch() {
    let (ok, out, err) = run(&[
        "bench",
        "compress",
        "--codec",
        "lz4,zstd:1,lzo-rle",
        "--batch",
        "1,8",
        "--secs",
        "0.02",
        "--repeat",
        "1",
        "--engines",
        "2",
        "--json",
    ]);
    assert!(ok, "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 6);
    for r in rows {
        let ratio = r["ratio"].as_f64().unwrap();
        assert!(ratio > 1.5 && ratio < 10.0, "{r}");
        for k in ["seq_compress_mbps", "seq_decompress_mbps", "eng_compress_mbps", "eng_decompress_mbps"] {
            assert!(r[k].as_f64().unwrap() > 1.0, "{k} in {r}");
        }
        assert_eq!(r["verify_failures"], 0);
    }
}

#[test]
fn bad_flags_are_clear_errors() {
    let (ok, _, err) = run(&["bench", "compress", "--codec", "lz5"]);
    assert!(!ok);
    assert!(err.contains("unknown codec") && err.contains("lzo-rle"), "{err}");
    let (ok, _, err) = run(&["bench", "compress", "--codec", "zstd:40"]);
    assert!(!ok && err.contains("out of range"), "{err}");
    let (ok, _, err) = run(&["bench", "compress", "--batch", "64"]);
    assert!(!ok && err.contains("1..=32"), "{err}");
    let (ok, _, err) = run(&["bench", "compress", "--wq-mode", "diagonal"]);
    assert!(!ok && err.contains("per-cpu"), "{err}");
    let (ok, _, err) = run(&["bench", "compress", "--corpus", "/nonexistent/pages.bin"]);
    assert!(!ok && err.contains("/nonexistent/pages.bin"), "{err}");
    // Refused before anything runs (the program would print "ran").
    let (ok, out, err) = run(&["compare", "--limit", "8M", "--no-kernel", "--", "echo", "ran"]);
    assert!(!ok && err.contains("at least 16M") && !out.contains("ran") && !err.contains("ran\n"), "{out} {err}");
}

#[test]
fn corpus_capture_of_a_live_process_feeds_the_bench() {
    // Capture this test process: the child zmem runs as the same user, and
    // CI runs as root, so it has ptrace rights over us.
    let dir = std::env::temp_dir().join(format!("zmem-cli-capture-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("self.bin.zst");
    let heap: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
    let pid = std::process::id().to_string();
    let (ok, out, err) = run(&["corpus", "capture", "--pid", &pid, "-o", file.to_str().unwrap(), "--max-pages", "512"]);
    std::hint::black_box(&heap);
    assert!(ok, "capture failed: {err}");
    assert!(out.contains("captured"), "{out}");
    let (ok, _, err) = run(&[
        "bench",
        "compress",
        "--corpus",
        file.to_str().unwrap(),
        "--codec",
        "lz4",
        "--batch",
        "8",
        "--secs",
        "0.01",
        "--repeat",
        "1",
    ]);
    assert!(ok, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_zsmalloc_meets_its_overhead_goals() {
    let (ok, out, err) = run(&["bench", "zsmalloc", "--objects", "65536", "--chain", "8", "--repeat", "1", "--json"]);
    assert!(ok, "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    for r in rows.as_array().unwrap() {
        let steady = r["steady_ratio"].as_f64().unwrap();
        let compact = r["after_compact_ratio"].as_f64().unwrap();
        let after_free = r["after_free_ratio"].as_f64().unwrap();
        // The goals: <= 1.05 steady, <= 1.10 after free + compact.
        assert!((1.0..=1.05).contains(&steady), "{r}");
        assert!(compact <= 1.10 && compact < after_free, "{r}");
        assert!(r["compact_pages_freed"].as_u64().unwrap() > 0, "{r}");
        assert!(r["zs_mops"].as_f64().unwrap() > 0.0);
    }
    let (ok, _, err) = run(&["bench", "zsmalloc", "--chain", "17"]);
    assert!(!ok && err.contains("1..=16"), "{err}");
}

#[test]
fn bench_tier_verifies_and_reports_both_modes() {
    let (ok, out, err) = run(&["bench", "tier", "--mib", "16", "--json"]);
    assert!(ok, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    for k in ["store_mbps_wb_off", "load_mbps_wb_off", "store_mbps_wb_on", "load_mbps_wb_on", "writeback_mbps_plain"] {
        assert!(r[k].as_f64().unwrap() > 1.0, "{k} in {r}");
    }
    assert!(r["written_back_pages"].as_u64().unwrap() > 0, "{r}");
    let overhead = r["pool_overhead"].as_f64().unwrap();
    assert!((1.0..1.2).contains(&overhead), "{r}");
    let (ok, _, err) = run(&["bench", "tier", "--compressor", "lz9"]);
    assert!(!ok && err.contains("unknown codec"), "{err}");
}

/// `--device engines`: liblz4 folio by folio, then the engines through
/// `store_many` passes, in one run; every page is loaded back and checked
/// by the bench itself. Without a GPU, `--device nvcomp` names what is
/// missing.
#[test]
fn bench_tier_measures_a_device_against_liblz4_in_the_same_run() {
    let (ok, out, err) = run(&["bench", "tier", "--mib", "16", "--device", "engines", "--pass", "16", "--json"]);
    assert!(ok, "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{out}");
    assert_eq!((rows[0]["compressor"].as_str(), rows[0]["pass"].as_u64()), (Some("lz4"), Some(1)), "{out}");
    assert!(rows[1]["compressor"].as_str().unwrap().contains("engines"), "{out}");
    assert_eq!(rows[1]["pass"].as_u64(), Some(16), "{out}");
    assert_eq!(rows[0]["store_speedup"].as_f64(), Some(1.0), "{out}");
    for r in rows {
        assert!(r["store_mbps"].as_f64().unwrap() > 1.0 && r["load_mbps"].as_f64().unwrap() > 1.0, "{r}");
    }
    // The same codec on the same pages: the same objects, the same pool.
    assert_eq!(rows[0]["pool_total_size"], rows[1]["pool_total_size"], "{out}");
    let (ok, _, err) =
        run(&["bench", "tier", "--mib", "1", "--device", "nvcomp", "--nvcomp-lib", "/nonexistent/libnvcomp.so.6"]);
    assert!(!ok && err.contains("cannot load /nonexistent/libnvcomp.so.6"), "{err}");
    let (ok, _, err) = run(&["bench", "tier", "--device", "tpu"]);
    assert!(!ok && err.contains("valid devices are"), "{err}");
    let (ok, _, err) = run(&["bench", "tier", "--pass", "0"]);
    assert!(!ok && err.contains("--pass in 1..=64"), "{err}");
}

#[test]
fn bench_fault_measures_every_kind_of_fault() {
    let (ok, out, err) = run(&["bench", "fault", "--limit-mib", "16", "--json"]);
    assert!(ok, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    for k in ["zero_fill", "pool", "swap"] {
        assert!(r[k]["faults"].as_u64().unwrap() > 10, "{k} in {r}");
        let (p50, p99) = (r[k]["p50_us_per_4k"].as_f64().unwrap(), r[k]["p99_us_per_4k"].as_f64().unwrap());
        assert!(p50 > 0.0 && p99 >= p50, "{k} in {r}");
    }
    assert!(r["evicted_mib"].as_u64().unwrap() > 0, "{r}");
    let (ok, _, err) = run(&["bench", "fault", "--folio-kib", "48"]);
    assert!(!ok && err.contains("power of two"), "{err}");
}

/// Both designs serve every fault, and every page reads back as the corpus
/// page that was compressed (the bench checks the bytes and the SIGBUS
/// handler's fault count, and fails otherwise).
#[test]
fn bench_sigbus_serves_every_fault_both_ways() {
    let (ok, out, err) = run(&["bench", "sigbus", "--mib", "4", "--folio-kib", "16", "--rounds", "2", "--json"]);
    assert!(ok, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let modes = r["modes"].as_array().unwrap();
    let names: Vec<&str> = modes.iter().map(|m| m["mode"].as_str().unwrap()).collect();
    assert_eq!(names, ["thread", "thread-same-cpu", "sigbus"], "{r}");
    for m in modes {
        // 4 MiB of 16 KiB folios, twice.
        assert_eq!(m["faults"].as_u64(), Some(512), "{m}");
        let (p50, p99) = (m["p50_us_per_4k"].as_f64().unwrap(), m["p99_us_per_4k"].as_f64().unwrap());
        assert!(p50 > 0.0 && p99 >= p50, "{m}");
    }
    assert!(r["sigbus_vs_thread_p50"].as_f64().unwrap() > 0.0, "{r}");
    let (ok, _, err) = run(&["bench", "sigbus", "--mib", "3", "--folio-kib", "2048"]);
    assert!(!ok && err.contains("multiple of the folio size"), "{err}");
}
