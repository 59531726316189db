use zmem_common::PAGE_SIZE;
use zmem_compress::corpus::Corpus;
use zmem_compress::CodecSpec;

/// Every codec, at the levels the suite covers.
pub fn all_specs() -> Vec<CodecSpec> {
    ["lz4", "zstd:-5", "zstd:1", "zstd:3", "deflate:1", "deflate:6", "lzo", "lzo-rle"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect()
}

pub fn corpus() -> &'static Corpus {
    Corpus::sample()
}

/// xorshift bytes: incompressible, reproducible.
pub fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Decompresses into a page-sized window of a larger buffer whose tail is a
/// guard, and checks the guard: the decoder must never write past `dst`.
pub fn decode_guarded(
    c: &mut dyn zmem_compress::Compressor,
    src: &[u8],
) -> Result<Vec<u8>, zmem_compress::DecompressError> {
    let mut buf = vec![0xA5u8; PAGE_SIZE + 256];
    let r = c.decompress_exact(src, &mut buf[..PAGE_SIZE]);
    assert!(buf[PAGE_SIZE..].iter().all(|&b| b == 0xA5), "{} wrote past dst", c.name());
    r.map(|()| buf[..PAGE_SIZE].to_vec())
}
