//! The check behind the `swapfile_read` fuzz target, shared with the test
//! that replays its corpus (`tests/fuzz_replay.rs`).

use std::sync::{Arc, OnceLock};

use zmem_common::PAGE_SIZE;
use zmem_zsmalloc::{Mempool, MempoolConfig};

use crate::{SwapError, SwapFile, SwapFileConfig};

/// Writes a known page to slot 0 of a fresh swap file (encrypted when the
/// input's first byte is odd), replaces the slot's bytes with the rest of
/// `data` (zero-padded, or the file cut short when `data` is short), and
/// reads it back.
///
/// # Panics
/// If the read returns bytes other than the page written, or an error other
/// than a checksum failure or a short read.
pub fn check_slot_read(data: &[u8]) {
    static MEMPOOL: OnceLock<Arc<Mempool>> = OnceLock::new();
    let mp = MEMPOOL
        .get_or_init(|| Arc::new(Mempool::new(MempoolConfig { min_nr: 1, ..Default::default() }).expect("mempool")));
    let encrypt = data.first().is_some_and(|b| b & 1 == 1);
    let body = data.get(1..).unwrap_or(&[]);
    let sf =
        SwapFile::create(&SwapFileConfig { dir: std::env::temp_dir(), encrypt, max_bytes: 1 << 20 }, Arc::clone(mp))
            .expect("create swap file");
    let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i * 31 % 251) as u8).collect();
    let slot = sf.write_batch(&[&page]).expect("write")[0];
    assert_eq!(slot, 0);
    use std::os::unix::fs::FileExt;
    let mut on_disk = vec![0u8; PAGE_SIZE];
    sf.file().read_exact_at(&mut on_disk, 0).expect("read back");
    if body.len() < PAGE_SIZE {
        sf.file().set_len(body.len() as u64).expect("truncate");
    }
    sf.file().write_all_at(&body[..body.len().min(PAGE_SIZE)], 0).expect("overwrite");
    // An object read (compressed writeback) of part of the slot fails or
    // succeeds exactly as the whole-slot read below.
    let mut obj = vec![0u8; 1000];
    let obj_result = sf.read_objs(&mut [(slot, 77, &mut obj[..])]).pop().expect("one result");
    // The same through swap-in read-ahead (`SwapFile::prefetch`): a block
    // read ahead is checked as a read is, and a bad one is read again.
    sf.prefetch(&[slot]);
    let mut ahead = vec![0u8; 1000];
    let ahead_result = sf.read_objs(&mut [(slot, 77, &mut ahead[..])]).pop().expect("one result");
    let mut dst = vec![0u8; PAGE_SIZE];
    let page_result = sf.read(slot, &mut dst);
    assert_eq!(obj_result.is_ok(), page_result.is_ok(), "{obj_result:?} against {page_result:?}");
    assert_eq!(ahead_result.is_ok(), page_result.is_ok(), "read ahead: {ahead_result:?} against {page_result:?}");
    if ahead_result.is_ok() {
        assert!(ahead[..] == page[77..1077], "a read-ahead read returned bytes that were never written");
    }
    if obj_result.is_ok() {
        assert!(obj[..] == page[77..1077], "an object read returned bytes that were never written");
    }
    match page_result {
        Ok(()) => {
            assert!(dst == page, "read returned bytes that were never written");
            assert!(body.len() >= PAGE_SIZE && body[..PAGE_SIZE] == on_disk[..], "a changed slot passed its checksum");
        }
        Err(SwapError::Corrupt { .. }) => assert!(body.len() < PAGE_SIZE || body[..PAGE_SIZE] != on_disk[..]),
        Err(SwapError::Io { source, .. }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof, "{source}");
            assert!(body.len() < PAGE_SIZE);
        }
        Err(e) => panic!("unexpected error {e}"),
    }
}
