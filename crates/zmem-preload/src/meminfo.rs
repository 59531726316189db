//! `/proc/meminfo`, with `ZMEM_SHOW_LIMIT=1`: the limit as the machine's
//! memory, as `sysmem.rs` shows it to `sysconf` and `sysinfo`.
//!
//! Node sizes its default V8 heap from libuv's `uv_get_total_memory`,
//! which reads `MemTotal` here (a quarter of 24 GiB: a 4 GiB heap under a
//! 256 MiB limit); `free`, psutil and many runtimes' "how much may I
//! cache" read `MemAvailable`. In a memory cgroup they find the cgroup's
//! limit in its files; under zmem they find it here.
//!
//! A read-only open of `/proc/meminfo` gets a copy of the real file, made
//! at the open, with these lines rewritten:
//! - `MemTotal`: the limit (the process tree's);
//! - `MemFree`, `MemAvailable`: what is left of it (the tree's limit less
//!   its usage);
//! - `Buffers`, `Cached`, `SReclaimable`: 0. The page cache and the
//!   kernel's caches are the machine's, not the tree's; `free` counts
//!   them in its buff/cache column, which would otherwise be larger than
//!   the total.
//!
//! Each figure is at most the machine's own; every other line is the
//! machine's. The copy is a sealed-off memfd reopened read-only, so a
//! program gets a plain file it can read, seek and `fstat`.
//!
//! Interposed: `open`, `open64`, `__open_2`, `__open64_2` (what a
//! fortified `open` calls), `fopen` and `fopen64` (glibc's `fopen` opens
//! with an internal call no shim sees). Not `openat`, whose pass-through
//! would need `dlsym`; nothing we know of reads the file that way. Go
//! programs make their system calls themselves and see the real file.
//! Anything that fails on the way (the real file unreadable, a line too
//! long) gives the real file, unchanged.

use std::ffi::{c_char, c_int, CStr};
use std::io::Write;
use std::os::fd::{AsRawFd, IntoRawFd};

use rustix::fs::{MemfdFlags, Mode, OFlags};
use zmem_common::host::fds::{open_kept, Wait};

use crate::guard::{guarded, in_zmem};

const MEMINFO: &CStr = c"/proc/meminfo";

/// Room for the real file (1.6 KiB on Linux 6.18) and for the copy, each
/// on the stack: `open` may run where allocating is unsafe (the child of
/// a fork, a signal handler), and a small thread stack has room for this.
const ROOM: usize = 8192;

extern "C" {
    /// glibc's `open`, under its exported internal name.
    fn __open64(path: *const c_char, flags: c_int, ...) -> c_int;
    /// glibc's `fopen`, under its exported internal name.
    fn _IO_fopen(path: *const c_char, mode: *const c_char) -> *mut libc::FILE;
}

/// Whether `path` is `/proc/meminfo`.
///
/// # Safety
/// `path` is null or a NUL-terminated string.
unsafe fn is_meminfo(path: *const c_char) -> bool {
    if path.is_null() {
        return false;
    }
    let p = path.cast::<u8>();
    // The comparison stops at the first byte that differs: a shorter path
    // differs at its NUL, so no byte past it is read.
    MEMINFO.to_bytes_with_nul().iter().enumerate().all(|(i, &b)| {
        // SAFETY: bytes 0..i of `path` were equal to MEMINFO's and so not
        // NUL: byte i is within the caller's string.
        unsafe { p.wrapping_add(i).read() == b }
    })
}

/// The shown copy of `/proc/meminfo`, for an `open` of `path` with
/// `flags`: a descriptor, or `None` to open the real file.
///
/// # Safety
/// `path` is null or a NUL-terminated string.
unsafe fn shown_fd(path: *const c_char, flags: c_int) -> Option<c_int> {
    // SAFETY: the caller's contract.
    if !unsafe { is_meminfo(path) } || in_zmem() {
        return None;
    }
    // A plain read-only open; anything else (O_PATH, O_DIRECTORY, a write
    // that fails as it should) goes to the real file.
    let other = libc::O_ACCMODE | libc::O_CREAT | libc::O_TRUNC | libc::O_DIRECTORY | libc::O_PATH | libc::O_TMPFILE;
    if flags & other != libc::O_RDONLY {
        return None;
    }
    let (limit, free) = crate::sysmem::limit_and_free()?;
    guarded(|| shown_copy(limit, free, flags & libc::O_CLOEXEC != 0)).flatten()
}

/// Makes the copy: the real file, rewritten, in a memfd reopened
/// read-only.
fn shown_copy(limit: u64, free: u64, cloexec: bool) -> Option<c_int> {
    let mut real = [0u8; ROOM];
    let n = {
        // zmem's own descriptors, kept (`zmem_common::host::fds`): another
        // thread of the program may be closing every descriptor.
        let open = || rustix::fs::open(MEMINFO, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty());
        let fd = open_kept(Wait::Yes, rustix::io::Errno::AGAIN, open).ok()?;
        let mut n = 0;
        loop {
            match rustix::io::read(&fd, &mut real[n..]) {
                Ok(0) => break n,
                Ok(k) => n += k,
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => return None,
            }
            if n == real.len() {
                return None; // longer than we know it to be: the real file
            }
        }
    };
    let mut out = [0u8; ROOM];
    let len = rewrite(&real[..n], limit >> 10, free >> 10, &mut out)?;
    let create = || rustix::fs::memfd_create(c"meminfo", MemfdFlags::CLOEXEC);
    let memfd = open_kept(Wait::Yes, rustix::io::Errno::AGAIN, create).ok()?;
    let mut done = 0;
    while done < len {
        match rustix::io::write(&memfd, &out[done..len]) {
            Ok(k) => done += k,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return None,
        }
    }
    // Reopened read-only: a write fails, as on the real file, and the
    // offset starts at 0.
    let mut path = [0u8; 40];
    write!(&mut path[..], "/proc/thread-self/fd/{}\0", memfd.as_raw_fd()).ok()?;
    let path = CStr::from_bytes_until_nul(&path).ok()?;
    let flags = if cloexec { OFlags::RDONLY | OFlags::CLOEXEC } else { OFlags::RDONLY };
    let fd = rustix::fs::open(path, flags, Mode::empty()).ok()?;
    Some(fd.into_raw_fd())
}

/// Rewrites `real` (the text of `/proc/meminfo`) into `out` for a
/// machine of `total_kb` with `free_kb` left (see the module's doc), and
/// returns its length; `None` if `out` is too small or a line is not
/// `Name: value kB`-shaped where it must be.
fn rewrite(real: &[u8], total_kb: u64, free_kb: u64, out: &mut [u8]) -> Option<usize> {
    let total_kb = total_kb.min(field(real, b"MemTotal")?);
    let free_kb = free_kb.min(total_kb);
    let mut w = &mut out[..];
    let room = w.len();
    for line in real.split_inclusive(|&c| c == b'\n') {
        let colon = line.iter().position(|&c| c == b':');
        let name = colon.map(|c| &line[..c]);
        let shown = match name {
            Some(b"MemTotal") => Some(total_kb),
            Some(b"MemFree") | Some(b"MemAvailable") => Some(free_kb.min(value(line)?)),
            Some(b"Buffers") | Some(b"Cached") | Some(b"SReclaimable") => Some(0),
            _ => None,
        };
        match (shown, colon) {
            (Some(v), Some(c)) => {
                // The number ends where it did: the spaces after the colon
                // and the digits keep their width.
                let rest = &line[c + 1..];
                let digits_end = rest
                    .iter()
                    .position(|&b| !b.is_ascii_whitespace())
                    .and_then(|s| rest[s..].iter().position(|b| !b.is_ascii_digit()).map(|e| s + e))?;
                w.write_all(&line[..=c]).ok()?;
                write!(w, "{v:>digits_end$}").ok()?;
                w.write_all(&rest[digits_end..]).ok()?;
            }
            _ => w.write_all(line).ok()?,
        }
    }
    Some(room - w.len())
}

/// The value of line `name` in `text`, in kB.
fn field(text: &[u8], name: &[u8]) -> Option<u64> {
    let line =
        text.split(|&c| c == b'\n').find(|l| l.len() > name.len() && l.starts_with(name) && l[name.len()] == b':')?;
    value(line)
}

/// The number of a `Name:   value kB` line.
fn value(line: &[u8]) -> Option<u64> {
    let c = line.iter().position(|&c| c == b':')?;
    let rest = line[c + 1..].trim_ascii_start();
    let end = rest.iter().position(|b| !b.is_ascii_digit()).unwrap_or(rest.len());
    std::str::from_utf8(&rest[..end]).ok()?.parse().ok()
}

/// glibc's `__open_2` would fail a call that creates without a mode; so
/// does this one, in its words.
fn invalid_open() -> ! {
    let msg = b"*** invalid open call: O_CREAT without mode ***: terminated\n";
    // SAFETY: a write of a static buffer to stderr.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    // SAFETY: no preconditions.
    unsafe { libc::abort() }
}

fn needs_mode(flags: c_int) -> bool {
    flags & libc::O_CREAT != 0 || flags & libc::O_TMPFILE == libc::O_TMPFILE
}

/// # Safety
/// As open(2). Declared with the mode, which the variadic C function reads
/// only when `flags` creates; it is passed on as glibc would read it.
#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: libc::mode_t) -> c_int {
    // SAFETY: the caller's path, as open(2) takes it.
    if let Some(fd) = unsafe { shown_fd(path, flags) } {
        return fd;
    }
    // SAFETY: the caller's arguments.
    unsafe { __open64(path, flags, mode) }
}

/// # Safety
/// As open(2).
#[no_mangle]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: libc::mode_t) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { open(path, flags, mode) }
}

/// # Safety
/// As glibc's `__open_2`: open(2) without a mode.
#[no_mangle]
pub unsafe extern "C" fn __open_2(path: *const c_char, flags: c_int) -> c_int {
    if needs_mode(flags) {
        invalid_open();
    }
    // SAFETY: the caller's arguments; no mode is read for these flags.
    unsafe { open(path, flags, 0) }
}

/// # Safety
/// As glibc's `__open64_2`.
#[no_mangle]
pub unsafe extern "C" fn __open64_2(path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { __open_2(path, flags) }
}

/// # Safety
/// As fopen(3).
#[no_mangle]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut libc::FILE {
    // SAFETY: the caller's mode, a NUL-terminated string, or null.
    let m = (!mode.is_null()).then(|| unsafe { CStr::from_ptr(mode) }.to_bytes());
    if let Some(m) = m.filter(|m| m.first() == Some(&b'r') && !m.contains(&b'+')) {
        let flags = if m.contains(&b'e') { libc::O_RDONLY | libc::O_CLOEXEC } else { libc::O_RDONLY };
        // SAFETY: the caller's path.
        if let Some(fd) = unsafe { shown_fd(path, flags) } {
            // SAFETY: a descriptor of ours, open for reading, and the
            // caller's mode, which asks for reading.
            let f = unsafe { libc::fdopen(fd, mode) };
            if f.is_null() {
                // SAFETY: our descriptor, not handed out.
                unsafe { libc::close(fd) };
            }
            return f;
        }
    }
    // SAFETY: the caller's arguments.
    unsafe { _IO_fopen(path, mode) }
}

/// # Safety
/// As fopen(3).
#[no_mangle]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut libc::FILE {
    // SAFETY: the caller's arguments.
    unsafe { fopen(path, mode) }
}

#[cfg(test)]
mod tests {
    use super::{is_meminfo, rewrite, value};

    const REAL: &[u8] = b"MemTotal:       24684092 kB\nMemFree:        23607060 kB\n\
MemAvailable:   24259004 kB\nBuffers:            9024 kB\nCached:           805904 kB\n\
SwapCached:            0 kB\nHugePages_Total:       0\nHugepagesize:       2048 kB\n";

    fn shown(total_kb: u64, free_kb: u64) -> String {
        let mut out = [0u8; 4096];
        let n = rewrite(REAL, total_kb, free_kb, &mut out).expect("fits");
        String::from_utf8(out[..n].to_vec()).unwrap()
    }

    #[test]
    fn the_limit_is_the_total_and_what_is_left_of_it_free_in_the_kernels_columns() {
        let s = shown(262144, 200000);
        let want = "MemTotal:         262144 kB\nMemFree:          200000 kB\nMemAvailable:     200000 kB\n\
Buffers:               0 kB\nCached:                0 kB\nSwapCached:            0 kB\n\
HugePages_Total:       0\nHugepagesize:       2048 kB\n";
        assert_eq!(s, want);
    }

    #[test]
    fn no_figure_is_raised_above_the_machines() {
        let s = shown(1 << 40, 1 << 40);
        let line = |n: &str| s.lines().find(|l| l.starts_with(n)).map(|l| value(l.as_bytes()).unwrap()).unwrap();
        assert_eq!(line("MemTotal:"), 24684092);
        assert_eq!(line("MemFree:"), 23607060);
        assert_eq!(line("MemAvailable:"), 24259004);
        // Free is never above total, whatever the tree reports.
        let s = shown(1000, 5000);
        assert!(s.contains("MemFree:            1000 kB"), "{s}");
    }

    #[test]
    fn too_little_room_or_no_total_gives_the_real_file() {
        let mut out = [0u8; 64];
        assert_eq!(rewrite(REAL, 1, 1, &mut out), None);
        let mut out = [0u8; 4096];
        assert_eq!(rewrite(b"Cached: 5 kB\n", 1, 1, &mut out), None);
    }

    #[test]
    fn only_the_exact_path_is_meminfo() {
        let meminfo = |p: &std::ffi::CStr| {
            // SAFETY: a NUL-terminated string.
            unsafe { is_meminfo(p.as_ptr()) }
        };
        assert!(meminfo(c"/proc/meminfo"));
        assert!(!meminfo(c"/proc/meminfo2"));
        assert!(!meminfo(c"/proc/mem"));
        assert!(!meminfo(c""));
        // SAFETY: null is allowed.
        assert!(!unsafe { is_meminfo(std::ptr::null()) });
    }
}
