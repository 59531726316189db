//! Real anonymous-memory pages for tests, benchmarks and the demo.
//!
//! The default data is a 2,048-page sample of the project corpus (512 evenly
//! spaced pages from each of redis, sqlite, perl and Java heaps; see
//! `data/README.md`), embedded in the binary so that a fresh clone needs no
//! outside file. Larger corpora come in through [`Corpus::load`], and users
//! can capture their own process's pages with [`capture`].

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use thiserror::Error;

use zmem_common::PAGE_SIZE;

static SAMPLE_ZST: &[u8] = include_bytes!("../../../data/corpus-sample.bin.zst");

/// Errors of loading or capturing a corpus.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CorpusError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: {len} bytes is not a whole number of {PAGE_SIZE}-byte pages (and not empty)")]
    NotPages { path: PathBuf, len: usize },
    #[error("{path}: zstd: {source}")]
    Zstd { path: PathBuf, source: io::Error },
    #[error("pid {pid}: no present, private, anonymous pages to capture")]
    NothingToCapture { pid: u32 },
}

/// A run of whole pages.
#[derive(Debug, Clone)]
pub struct Corpus {
    data: Vec<u8>,
    origin: String,
}

impl Corpus {
    /// The embedded sample (decompressed once per process).
    pub fn sample() -> &'static Corpus {
        static SAMPLE: OnceLock<Corpus> = OnceLock::new();
        SAMPLE.get_or_init(|| {
            let data = zstd::stream::decode_all(SAMPLE_ZST).expect("embedded corpus sample is valid zstd");
            assert_eq!(data.len() % PAGE_SIZE, 0, "embedded sample is whole pages");
            Corpus { data, origin: "embedded sample (2048 pages of redis, sqlite, perl, Java)".into() }
        })
    }

    /// Loads raw concatenated pages from `path`, zstd-compressed or not
    /// (detected by the zstd magic number).
    ///
    /// # Errors
    /// I/O errors, a corrupt zstd stream, or a length that is not a whole,
    /// non-zero number of pages.
    pub fn load(path: &Path) -> Result<Corpus, CorpusError> {
        let io_err = |source| CorpusError::Io { path: path.to_path_buf(), source };
        let mut raw = Vec::new();
        File::open(path).and_then(|mut f| f.read_to_end(&mut raw)).map_err(io_err)?;
        let data = if raw.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            zstd::stream::decode_all(&raw[..])
                .map_err(|source| CorpusError::Zstd { path: path.to_path_buf(), source })?
        } else {
            raw
        };
        if data.is_empty() || data.len() % PAGE_SIZE != 0 {
            return Err(CorpusError::NotPages { path: path.to_path_buf(), len: data.len() });
        }
        Ok(Corpus { data, origin: path.display().to_string() })
    }

    /// The embedded sample, or the file at `path` if one is given.
    ///
    /// # Errors
    /// As [`Corpus::load`].
    pub fn sample_or(path: Option<&Path>) -> Result<Corpus, CorpusError> {
        match path {
            Some(p) => Corpus::load(p),
            None => Ok(Corpus::sample().clone()),
        }
    }

    pub fn from_pages(data: Vec<u8>, origin: impl Into<String>) -> Corpus {
        assert_eq!(data.len() % PAGE_SIZE, 0, "a corpus is whole pages");
        Corpus { data, origin: origin.into() }
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    pub fn len(&self) -> usize {
        self.data.len() / PAGE_SIZE
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn page(&self, i: usize) -> &[u8] {
        &self.data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]
    }

    pub fn pages(&self) -> std::slice::ChunksExact<'_, u8> {
        self.data.chunks_exact(PAGE_SIZE)
    }

    pub fn bytes(&self) -> &[u8] {
        &self.data
    }
}

/// A page of xorshift bytes, the same for the same seed: no codec
/// compresses it (`CompressError::Poor`), for tests and benchmarks that
/// need such pages beside the corpus's.
pub fn incompressible_page(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..PAGE_SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// A page whose every other word is xorshift and every other its own index:
/// about half of it compresses, the same for the same seed (real pages are
/// neither random nor all alike).
pub fn half_compressible_page(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..PAGE_SIZE / 8)
        .flat_map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (if i % 2 == 0 { x } else { i as u64 }).to_le_bytes()
        })
        .collect()
}

/// A page of one word repeated: what the tier keeps as a same-filled
/// marker rather than in the pool.
pub fn filled_page(word: u64) -> Vec<u8> {
    word.to_ne_bytes().repeat(PAGE_SIZE / 8)
}

/// A page of one of the kinds a compressed tier treats differently, by
/// `kind % 8`: zeros, a same-filled page, an incompressible page, or (5 in
/// 8) a real heap page of the embedded sample, chosen by `seed`.
pub fn page_of_kind(kind: u8, seed: u64) -> Vec<u8> {
    match kind % 8 {
        0 => vec![0u8; PAGE_SIZE],
        1 => filled_page(seed | 1),
        2 => incompressible_page(seed),
        _ => {
            let c = Corpus::sample();
            c.page(seed as usize % c.len()).to_vec()
        }
    }
}

/// zstd-compresses a capture for storage (level 19: corpora are written once).
///
/// # Errors
/// zstd's own errors.
pub fn zstd_encode(data: &[u8]) -> io::Result<Vec<u8>> {
    zstd::stream::encode_all(data, 19)
}

// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PM_PRESENT: u64 = 1 << 63;
const PM_FILE_OR_SHARED_ANON: u64 = 1 << 61;
const PM_MMAP_EXCLUSIVE: u64 = 1 << 56;

/// A writable, private, anonymous mapping of the target process.
#[derive(Debug, Clone, Copy)]
struct AnonVma {
    start: u64,
    end: u64,
}

fn anon_vmas(pid: u32) -> Result<Vec<AnonVma>, CorpusError> {
    let path = PathBuf::from(format!("/proc/{pid}/maps"));
    let f = File::open(&path).map_err(|source| CorpusError::Io { path: path.clone(), source })?;
    let mut out = Vec::new();
    for line in BufReader::new(f).lines() {
        let line = line.map_err(|source| CorpusError::Io { path: path.clone(), source })?;
        let mut it = line.split_whitespace();
        let (Some(range), Some(perms)) = (it.next(), it.next()) else { continue };
        let name = it.nth(3).unwrap_or("");
        let anon = name.is_empty() || name == "[heap]";
        if !anon || !perms.starts_with("rw") || perms.as_bytes().get(3) != Some(&b'p') {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else { continue };
        if let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
            out.push(AnonVma { start, end });
        }
    }
    Ok(out)
}

/// Captures the present, exclusively mapped, private anonymous pages of
/// process `pid` (read through `/proc/PID/pagemap` and `/proc/PID/mem`), at
/// most `max_pages` of them sampled at even spacing, and writes them to
/// `out` as raw concatenated pages. Needs ptrace access to the process
/// (root, or the same user with `ptrace_scope` 0). Returns the number of
/// pages written.
///
/// # Errors
/// I/O errors on `/proc` or `out`, or [`CorpusError::NothingToCapture`].
/// Pages that vanish while being read are skipped, not reported.
pub fn capture(pid: u32, max_pages: usize, out: &mut dyn Write) -> Result<usize, CorpusError> {
    let pm_path = PathBuf::from(format!("/proc/{pid}/pagemap"));
    let mem_path = PathBuf::from(format!("/proc/{pid}/mem"));
    let pagemap = File::open(&pm_path).map_err(|source| CorpusError::Io { path: pm_path.clone(), source })?;
    let mem = File::open(&mem_path).map_err(|source| CorpusError::Io { path: mem_path.clone(), source })?;

    let mut eligible = Vec::new();
    let mut buf = vec![0u8; 8 * 512];
    for vma in anon_vmas(pid)? {
        let mut addr = vma.start;
        while addr < vma.end {
            let n = (((vma.end - addr) / PAGE_SIZE as u64) as usize).min(512);
            let bytes = &mut buf[..n * 8];
            let off = addr / PAGE_SIZE as u64 * 8;
            pagemap.read_exact_at(bytes, off).map_err(|source| CorpusError::Io { path: pm_path.clone(), source })?;
            for (i, e) in bytes.chunks_exact(8).enumerate() {
                let e = u64::from_le_bytes(e.try_into().unwrap_or_default());
                if e & PM_PRESENT != 0 && e & PM_MMAP_EXCLUSIVE != 0 && e & PM_FILE_OR_SHARED_ANON == 0 {
                    eligible.push(addr + (i * PAGE_SIZE) as u64);
                }
            }
            addr += (n * PAGE_SIZE) as u64;
        }
    }
    if eligible.is_empty() {
        return Err(CorpusError::NothingToCapture { pid });
    }
    let take = eligible.len().min(max_pages.max(1));
    let mut page = vec![0u8; PAGE_SIZE];
    let mut written = 0;
    for k in 0..take {
        let addr = eligible[k * eligible.len() / take];
        if mem.read_exact_at(&mut page, addr).is_err() {
            continue; // unmapped since the scan
        }
        out.write_all(&page).map_err(|source| CorpusError::Io { path: PathBuf::from("<output>"), source })?;
        written += 1;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_is_2048_real_pages() {
        let c = Corpus::sample();
        assert_eq!(c.len(), 2048);
        // Real heap pages: mostly not zero-filled.
        let zero = c.pages().filter(|p| p.iter().all(|&b| b == 0)).count();
        assert!(zero < 40, "{zero} zero pages");
    }

    #[test]
    fn capture_own_process_reads_back_a_known_page() {
        // A page with a recognisable pattern in our own heap.
        let mut marker = vec![0u8; PAGE_SIZE * 4];
        for (i, b) in marker.iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8 ^ 0x5a;
        }
        let mut out = Vec::new();
        let n = capture(std::process::id(), usize::MAX, &mut out).expect("capture self");
        assert!(n > 0);
        assert_eq!(out.len(), n * PAGE_SIZE);
        // Find the first page-aligned page inside the marker buffer.
        let aligned = marker.as_ptr() as usize % PAGE_SIZE;
        let first_full = if aligned == 0 { 0 } else { PAGE_SIZE - aligned };
        let probe = &marker[first_full..first_full + PAGE_SIZE];
        assert!(out.chunks_exact(PAGE_SIZE).any(|p| p == probe), "captured pages hold our marker page");
        std::hint::black_box(&marker);
    }

    #[test]
    fn load_rejects_partial_pages() {
        let dir = std::env::temp_dir().join(format!("zmem-corpus-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bad.bin");
        std::fs::write(&p, [1u8; 100]).unwrap();
        assert!(matches!(Corpus::load(&p), Err(CorpusError::NotPages { len: 100, .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
