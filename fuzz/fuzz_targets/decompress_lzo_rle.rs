//! Feeds arbitrary bytes to the lzo-rle decoder: it must return an error or a
//! page, never panic, and never write past its destination.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zmem_compress::CodecSpec;
use zmem_common::PAGE_SIZE;

fuzz_target!(|data: &[u8]| {
    let mut c = "lzo-rle".parse::<CodecSpec>().expect("codec name").build();
    let mut buf = vec![0xA5u8; PAGE_SIZE + 64];
    let _ = c.decompress_exact(data, &mut buf[..PAGE_SIZE]);
    assert!(buf[PAGE_SIZE..].iter().all(|&b| b == 0xA5), "decoder wrote past dst");
});
