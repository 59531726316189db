//! Replays the `swapfile_read` fuzz corpus through the same check.

#[test]
fn swapfile_read_corpus_replays_cleanly() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/swapfile_read");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let data = std::fs::read(e.unwrap().path()).unwrap();
        zmem_swapfile::fuzz::check_slot_read(&data);
        n += 1;
    }
    assert!(n >= 5, "{} holds {n} inputs", dir.display());
}
