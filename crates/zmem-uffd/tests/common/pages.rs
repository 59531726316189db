//! Pages of real heap data, stamped with a version, written into and
//! checked in a region word by word (shared by `pager.rs` and `fork.rs`).

use std::sync::atomic::Ordering;

use zmem_common::PAGE_SIZE;
use zmem_compress::corpus::Corpus;
use zmem_uffd::Region;

pub const WORDS: usize = PAGE_SIZE / 8;

/// Word `i` of page `p` at version `v`: a real heap page, changed by version.
pub fn word(p: usize, v: u32, i: usize) -> u64 {
    let c = Corpus::sample();
    let src = c.page(p % c.len());
    let w = u64::from_ne_bytes(src[i * 8..i * 8 + 8].try_into().unwrap());
    if v == 0 {
        w
    } else {
        w ^ (u64::from(v) << 32 | p as u64)
    }
}

pub fn write_page(r: &Region, p: usize, v: u32) {
    let w = r.words();
    for i in 0..WORDS {
        w[p * WORDS + i].store(word(p, v, i), Ordering::Relaxed);
    }
}

/// The words of page `p` that differ from version `v`.
pub fn check_page(r: &Region, p: usize, v: u32) -> usize {
    let w = r.words();
    (0..WORDS).filter(|&i| w[p * WORDS + i].load(Ordering::Relaxed) != word(p, v, i)).count()
}
