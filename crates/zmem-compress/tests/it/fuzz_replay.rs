//! Replays the cargo-fuzz corpora (`fuzz/corpus/<target>/`) through the same
//! checks as the fuzz targets, so that every input that once found a bug (and
//! every seed) is run by `cargo test`.

use std::path::PathBuf;

use crate::util::{all_specs, decode_guarded};

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target)
}

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut v: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let p = e.unwrap().path();
            let data = std::fs::read(&p).unwrap();
            (p, data)
        })
        .collect();
    v.sort();
    assert!(!v.is_empty(), "{} has no inputs", dir.display());
    v
}

#[test]
fn decoder_corpora_replay_cleanly() {
    for spec in all_specs() {
        let target = format!("decompress_{}", spec.kind.name().replace('-', "_"));
        let mut c = spec.build();
        let mut decoded = 0;
        for (path, data) in inputs(&target) {
            // Seeds are valid compressed pages of the corpus; mutations may be
            // anything. Both must come back without panic or overrun.
            if decode_guarded(c.as_mut(), &data).is_ok() {
                decoded += 1;
            }
            let _ = path;
        }
        assert!(decoded > 0, "{target}: no seed decodes; the corpus is stale");
    }
}

/// Writes the seed corpora: a few real compressed pages per codec, plus a
/// truncated and a bit-flipped copy of each. Run by hand (see fuzz/README.md).
#[test]
#[ignore = "rewrites fuzz/corpus; run by hand"]
fn regenerate_fuzz_seeds() {
    use zmem_common::PAGE_SIZE;
    let corpus = crate::util::corpus();
    for name in ["lz4", "zstd", "deflate", "lzo", "lzo-rle"] {
        let spec: zmem_compress::CodecSpec = name.parse().unwrap();
        let dir = corpus_dir(&format!("decompress_{}", name.replace('-', "_")));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = spec.build();
        for (k, i) in [5usize, 300, 600, 900, 1100, 1500, 1700, 2000].into_iter().enumerate() {
            let mut out = vec![0u8; PAGE_SIZE];
            let Ok(n) = c.compress(corpus.page(i), &mut out) else { continue };
            std::fs::write(dir.join(format!("page-{k}")), &out[..n]).unwrap();
            std::fs::write(dir.join(format!("page-{k}-cut")), &out[..n * 2 / 3]).unwrap();
            let mut flip = out[..n].to_vec();
            flip[n / 3] ^= 0x40;
            std::fs::write(dir.join(format!("page-{k}-flip")), &flip).unwrap();
        }
    }
}
