//! Dev-only: zmem's clean-room lzo against liblzo2 (`apt-get install liblzo2-dev`).
//! liblzo2's lzo1x_1 output must decode with our decoder (both lzo and
//! lzo-rle accept version-0 streams), and our lzo output must decode with
//! `lzo1x_decompress_safe`. Also prints both sides' MB/s, measured in the same run.
//!
//! `cargo test -p zmem-compress --test it -- --ignored liblzo2` (CI runs it).

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use zmem_common::PAGE_SIZE;
use zmem_compress::{CodecSpec, CompressError};

use crate::util::corpus;

fn helper(dir: &std::path::Path) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/liblzo2/compat.c");
    let exe = dir.join("compat");
    let st = Command::new("cc").args(["-O2", "-o"]).arg(&exe).arg(&src).arg("-llzo2").status().expect("run cc");
    assert!(st.success(), "building the liblzo2 helper failed: is liblzo2-dev installed?");
    exe
}

#[test]
#[ignore = "needs liblzo2-dev; run with --ignored liblzo2"]
fn liblzo2_and_zmem_lzo_read_each_other() {
    let dir = std::env::temp_dir().join(format!("zmem-liblzo2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = helper(&dir);
    let pages = dir.join("pages.bin");
    std::fs::write(&pages, corpus().bytes()).unwrap();

    // liblzo2 -> zmem
    let objs = dir.join("lzo2.objs");
    assert!(Command::new(&exe).arg("c").arg(&pages).arg(&objs).status().unwrap().success());
    let data = std::fs::read(&objs).unwrap();
    let mut theirs = 0usize;
    for spec in ["lzo", "lzo-rle"] {
        let mut c = spec.parse::<CodecSpec>().unwrap().build();
        let (mut at, mut i) = (0, 0);
        while at < data.len() {
            let len = u32::from_le_bytes(data[at..at + 4].try_into().unwrap()) as usize;
            let obj = &data[at + 4..at + 4 + len];
            let mut out = vec![0u8; PAGE_SIZE];
            c.decompress_exact(obj, &mut out).unwrap_or_else(|e| panic!("{spec}: liblzo2 page {i}: {e}"));
            assert!(out == corpus().page(i), "{spec}: liblzo2 page {i} decodes differently");
            theirs += len;
            at += 4 + len;
            i += 1;
        }
        assert_eq!(i, corpus().len());
    }
    theirs /= 2;

    // zmem -> liblzo2
    let mut c = "lzo".parse::<CodecSpec>().unwrap().build();
    let (mut ours, mut expect, mut buf) = (Vec::new(), Vec::new(), vec![0u8; PAGE_SIZE]);
    let mut our_bytes = 0;
    for page in corpus().pages() {
        match c.compress(page, &mut buf) {
            Ok(n) => {
                ours.extend_from_slice(&(n as u32).to_le_bytes());
                ours.extend_from_slice(&buf[..n]);
                expect.extend_from_slice(page);
                our_bytes += n;
            }
            Err(CompressError::Poor) => our_bytes += PAGE_SIZE,
            Err(e) => panic!("{e}"),
        }
    }
    let (ours_f, back_f) = (dir.join("zmem.objs"), dir.join("back.bin"));
    std::fs::write(&ours_f, &ours).unwrap();
    let out = Command::new(&exe).arg("d").arg(&ours_f).arg(&back_f).output().unwrap();
    assert!(out.status.success(), "liblzo2 rejected zmem's lzo: {}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&back_f).unwrap() == expect, "liblzo2 decodes zmem's lzo differently");

    // Same-run speed: liblzo2 against ours.
    let c_rates = String::from_utf8(Command::new(&exe).arg("b").arg(&pages).output().unwrap().stdout).unwrap();
    let mut objs_ours: Vec<Vec<u8>> = Vec::new();
    let mut best = (0f64, 0f64);
    for _ in 0..5 {
        let t0 = Instant::now();
        objs_ours.clear();
        for page in corpus().pages() {
            let n = c.compress(page, &mut buf).unwrap_or(0);
            objs_ours.push(buf[..n].to_vec());
        }
        let t1 = Instant::now();
        for o in objs_ours.iter().filter(|o| !o.is_empty()) {
            c.decompress(o, &mut buf).unwrap();
        }
        let t2 = Instant::now();
        let mb = (corpus().len() * PAGE_SIZE) as f64 / 1e6;
        best.0 = best.0.max(mb / (t1 - t0).as_secs_f64());
        best.1 = best.1.max(mb / (t2 - t1).as_secs_f64());
    }
    eprintln!(
        "liblzo2 lzo1x_1: {} bytes, compress/decompress MB/s {}; zmem lzo: {our_bytes} bytes, {:.1} {:.1}",
        theirs,
        c_rates.trim(),
        best.0,
        best.1
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
