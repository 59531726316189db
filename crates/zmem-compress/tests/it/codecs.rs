//! Round-trips, Poor on incompressible pages, corrupt and truncated input.

use proptest::prelude::*;
use zmem_common::PAGE_SIZE;
use zmem_compress::CompressError;

use crate::util::{all_specs, corpus, decode_guarded, random_bytes};

#[test]
fn every_corpus_page_roundtrips_with_every_codec() {
    for spec in all_specs() {
        let mut c = spec.build();
        let mut out = vec![0u8; PAGE_SIZE];
        let (mut stored, mut poor) = (0usize, 0usize);
        for (i, page) in corpus().pages().enumerate() {
            match c.compress(page, &mut out) {
                Ok(n) => {
                    assert!(n < PAGE_SIZE);
                    let back = decode_guarded(c.as_mut(), &out[..n]).unwrap_or_else(|e| panic!("{spec} page {i}: {e}"));
                    assert!(back == page, "{spec} page {i} differs after round-trip");
                    stored += n;
                }
                Err(CompressError::Poor) => poor += 1,
                Err(e) => panic!("{spec} page {i}: {e}"),
            }
        }
        let ratio = (corpus().len() - poor) as f64 * PAGE_SIZE as f64 / stored as f64;
        assert!(ratio > 1.5, "{spec}: ratio {ratio:.2} is implausibly low for heap pages");
        assert!(poor < corpus().len() / 10, "{spec}: {poor} poor pages");
    }
}

#[test]
fn random_pages_are_poor() {
    for spec in all_specs() {
        let mut c = spec.build();
        for seed in 1..20 {
            let page = random_bytes(seed, PAGE_SIZE);
            let mut out = vec![0u8; PAGE_SIZE];
            assert_eq!(c.compress(&page, &mut out), Err(CompressError::Poor), "{spec} seed {seed}");
        }
    }
}

#[test]
fn dst_shorter_than_src_is_a_clear_error() {
    for spec in all_specs() {
        let mut c = spec.build();
        let mut out = vec![0u8; 100];
        assert_eq!(
            c.compress(corpus().page(0), &mut out),
            Err(CompressError::DstTooSmall { need: PAGE_SIZE, got: 100 })
        );
    }
}

#[test]
fn every_truncation_of_a_compressed_page_is_an_error() {
    for spec in all_specs() {
        let mut c = spec.build();
        let mut out = vec![0u8; PAGE_SIZE];
        for &i in &[3usize, 700, 1500, 2000] {
            let page = corpus().page(i);
            let Ok(n) = c.compress(page, &mut out) else { continue };
            for cut in 0..n {
                assert!(
                    decode_guarded(c.as_mut(), &out[..cut]).is_err(),
                    "{spec} page {i} cut at {cut}/{n} decoded as a whole page"
                );
            }
        }
    }
}

fn sample_pages() -> impl Strategy<Value = usize> {
    0..corpus().len()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random data of any length, with repeats so that matches happen.
    #[test]
    fn random_data_roundtrips(
        chunks in prop::collection::vec((prop::collection::vec(any::<u8>(), 0..300), 0usize..5), 0..40),
        spec_i in 0usize..8,
    ) {
        let mut data = Vec::new();
        for (chunk, reps) in &chunks {
            for _ in 0..=*reps {
                data.extend_from_slice(chunk);
            }
        }
        let spec = all_specs()[spec_i];
        let mut c = spec.build();
        let mut out = vec![0u8; data.len()];
        match c.compress(&data, &mut out) {
            Ok(n) => {
                prop_assert!(n < data.len());
                let mut back = vec![0u8; data.len()];
                prop_assert_eq!(c.decompress(&out[..n], &mut back), Ok(data.len()));
                prop_assert_eq!(back, data);
            }
            Err(CompressError::Poor) => {}
            Err(e) => prop_assert!(false, "{spec}: {e}"),
        }
    }

    /// Flipped and overwritten bytes: never a panic, never a write past dst.
    #[test]
    fn corrupt_input_never_panics_or_overruns(
        page_i in sample_pages(),
        spec_i in 0usize..8,
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let spec = all_specs()[spec_i];
        let mut c = spec.build();
        let mut out = vec![0u8; PAGE_SIZE];
        if let Ok(n) = c.compress(corpus().page(page_i), &mut out) {
            let mut bad = out[..n].to_vec();
            for (at, v) in &edits {
                let k = at.index(bad.len());
                bad[k] ^= v | 1;
            }
            let _ = decode_guarded(c.as_mut(), &bad);
        }
    }

    /// Arbitrary bytes fed to every decoder.
    #[test]
    fn garbage_never_panics_or_overruns(bytes in prop::collection::vec(any::<u8>(), 0..5000), spec_i in 0usize..8) {
        let mut c = all_specs()[spec_i].build();
        let _ = decode_guarded(c.as_mut(), &bytes);
    }
}
