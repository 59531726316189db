//! What the program sees of the machine's memory, with `ZMEM_SHOW_LIMIT=1`:
//! the limit, as a program in a memory cgroup sees the cgroup's limit.
//! Runtimes size themselves from it: DuckDB takes 80% of
//! `sysconf(_SC_PHYS_PAGES)` for its buffer manager, the JVM a quarter for
//! its default heap. Under a cgroup they read the cgroup's files first and
//! size themselves to its limit; under zmem, without this, to the whole
//! machine, and then page through the limit. Interposed: `sysconf`
//! (`_SC_PHYS_PAGES`, `_SC_AVPHYS_PAGES`; every other name passes through
//! untouched), `get_phys_pages`, `get_avphys_pages` and `sysinfo`; the same
//! figures in `/proc/meminfo` are `meminfo.rs`'s.
//!
//! The limit is the process tree's once the shim runs (what is left of it:
//! the tree's limit less its usage, for the available pages), and
//! `ZMEM_LIMIT` before. Each figure is at most the machine's own.

use std::ffi::{c_int, c_long};
use std::sync::OnceLock;

use zmem_settings::Settings;

use crate::guard::guarded;

/// `ZMEM_LIMIT` if `ZMEM_SHOW_LIMIT=1` (and the shim is not disabled),
/// read once.
fn shown_limit() -> Option<u64> {
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        // Inside the shim: the parse allocates from zmem's heap.
        guarded(|| {
            let s = Settings::from_env().ok()?;
            (s.show_limit && !s.disable).then_some(s.limit as u64)
        })
        .flatten()
    })
}

/// (limit, available) in bytes, if the program is to see the limit.
pub(crate) fn limit_and_free() -> Option<(u64, u64)> {
    let limit = shown_limit()?;
    let tree = match crate::state::current() {
        Some(s) => s.pager.tree().map(|t| (t.limit() as u64, t.usage())),
        None => crate::guard::guarded(crate::waiting::tree_figures).flatten(),
    };
    Some(match tree {
        Some((limit, usage)) => (limit, limit.saturating_sub(usage)),
        None => (limit, limit),
    })
}

extern "C" {
    /// glibc's own `sysconf`, under its exported internal name: the
    /// pass-through needs no `dlsym`, which may allocate, and `sysconf`
    /// is called early (an allocator's start-up asks for the page size).
    fn __sysconf(name: c_int) -> c_long;
}

fn real_sysconf(name: c_int) -> c_long {
    // SAFETY: glibc's sysconf, with the caller's argument.
    unsafe { __sysconf(name) }
}

/// `pages` (the machine's own figure), at most `bytes`.
fn clamp_pages(pages: c_long, bytes: u64) -> c_long {
    let page = zmem_common::PAGE_SIZE as u64;
    if pages < 0 {
        return pages;
    }
    (pages as u64).min(bytes / page) as c_long
}

#[no_mangle]
pub extern "C" fn sysconf(name: c_int) -> c_long {
    let r = real_sysconf(name);
    if name != libc::_SC_PHYS_PAGES && name != libc::_SC_AVPHYS_PAGES {
        return r;
    }
    match limit_and_free() {
        Some((limit, _)) if name == libc::_SC_PHYS_PAGES => clamp_pages(r, limit),
        Some((_, free)) => clamp_pages(r, free),
        None => r,
    }
}

#[no_mangle]
pub extern "C" fn get_phys_pages() -> c_long {
    sysconf(libc::_SC_PHYS_PAGES)
}

#[no_mangle]
pub extern "C" fn get_avphys_pages() -> c_long {
    sysconf(libc::_SC_AVPHYS_PAGES)
}

/// # Safety
/// As sysinfo(2): `info` is writable.
#[no_mangle]
pub unsafe extern "C" fn sysinfo(info: *mut libc::sysinfo) -> c_int {
    // The system call itself, as glibc's sysinfo is (errno set on failure).
    // SAFETY: the caller's argument, as sysinfo(2) takes it.
    let r = unsafe { libc::syscall(libc::SYS_sysinfo, info) } as c_int;
    if r != 0 || info.is_null() {
        return r;
    }
    if let Some((limit, free)) = limit_and_free() {
        // SAFETY: the call above filled in *info.
        let i = unsafe { &mut *info };
        let unit = u64::from(i.mem_unit.max(1));
        let (limit, free) = (limit / unit, free / unit);
        i.totalram = i.totalram.min(limit as _);
        i.freeram = i.freeram.min(free as _);
        i.bufferram = i.bufferram.min(i.freeram);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::clamp_pages;

    #[test]
    fn a_figure_is_clamped_to_the_limit_and_never_raised() {
        let page = zmem_common::PAGE_SIZE as u64;
        assert_eq!(clamp_pages(1 << 20, 256 * page), 256);
        assert_eq!(clamp_pages(100, 256 * page), 100);
        assert_eq!(clamp_pages(-1, 256 * page), -1);
    }
}
