//! zmem's `lz4` (C liblz4) against lz4_flex, a second, independent lz4
//! implementation: each decodes the other's blocks of every corpus page, and
//! the ignored report times both in the same run.

use std::time::Instant;

use zmem_common::PAGE_SIZE;
use zmem_compress::CodecSpec;

use crate::util::corpus;

#[test]
fn liblz4_and_lz4_flex_read_each_other() {
    let mut ours = "lz4".parse::<CodecSpec>().unwrap().build();
    let mut out = vec![0u8; PAGE_SIZE];
    let mut back = vec![0u8; PAGE_SIZE];
    for (i, page) in corpus().pages().enumerate() {
        let theirs = lz4_flex::block::compress(page);
        ours.decompress_exact(&theirs, &mut back).unwrap();
        assert!(back == page, "lz4_flex page {i} decodes differently with liblz4");
        if let Ok(n) = ours.compress(page, &mut out) {
            let m = lz4_flex::block::decompress_into(&out[..n], &mut back).unwrap();
            assert!(m == PAGE_SIZE && back == page, "liblz4 page {i} decodes differently with lz4_flex");
        }
    }
}

#[test]
#[ignore = "a timing report; run with --release -- --ignored lz4_speed --nocapture"]
fn lz4_speed_liblz4_against_lz4_flex() {
    let mut ours = "lz4".parse::<CodecSpec>().unwrap().build();
    let mb = (corpus().len() * PAGE_SIZE) as f64 / 1e6;
    let best = |f: &mut dyn FnMut()| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                f();
                mb / t.elapsed().as_secs_f64()
            })
            .fold(0f64, f64::max)
    };
    let mut out = vec![0u8; PAGE_SIZE];
    let objs: Vec<Vec<u8>> = corpus().pages().map(lz4_flex::block::compress).collect();
    let c_comp = best(&mut || {
        for p in corpus().pages() {
            let _ = ours.compress(p, &mut out);
        }
    });
    let mut big = vec![0u8; lz4_flex::block::get_maximum_output_size(PAGE_SIZE)];
    let f_comp = best(&mut || {
        for p in corpus().pages() {
            lz4_flex::block::compress_into(p, &mut big).unwrap();
        }
    });
    let c_dec = best(&mut || {
        for o in &objs {
            ours.decompress(o, &mut out).unwrap();
        }
    });
    let f_dec = best(&mut || {
        for o in &objs {
            lz4_flex::block::decompress_into(o, &mut out).unwrap();
        }
    });
    eprintln!(
        "liblz4: compress {c_comp:.0} MB/s, decompress {c_dec:.0} MB/s; lz4_flex: compress {f_comp:.0} MB/s ({:.2}x), decompress {f_dec:.0} MB/s ({:.2}x)",
        f_comp / c_comp,
        f_dec / c_dec
    );
}
