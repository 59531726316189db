//! glibc's stdio streams and directory streams, as the wrappers of
//! `uaccess.rs` read them: the buffer a call may take to the kernel, the
//! stream's error flag.

use std::ffi::{c_char, c_int};

use libc::{size_t, DIR, FILE};

/// Where a call's buffers lie: it calls `each(address, length)` for each.
pub(crate) type Each<'a> = &'a mut dyn FnMut(usize, usize);

/// The start of glibc's `struct _IO_FILE` (`<bits/types/struct_FILE.h>`,
/// public and stable): the stream's buffer pointers.
#[repr(C)]
struct FileHead {
    flags: c_int,
    read_ptr: *mut c_char,
    read_end: *mut c_char,
    read_base: *mut c_char,
    write_base: *mut c_char,
    write_ptr: *mut c_char,
    write_end: *mut c_char,
    buf_base: *mut c_char,
    buf_end: *mut c_char,
}

/// What a stdio call is about to do with a stream's buffer.
#[derive(Clone, Copy)]
pub(crate) enum Stdio {
    /// Read `n` bytes: from the kernel unless the buffer holds that much.
    Read(usize),
    /// Read up to `delim` (a line), from the kernel unless it is buffered.
    ReadTo(u8),
    /// Write `n` bytes: through the kernel if the buffer has no room.
    Write(usize),
    /// Flush what the buffer holds (`fflush`, `fclose`, `__overflow`).
    Flush,
    /// Refill it (`__uflow`, `__underflow`).
    Refill,
}

/// The buffer of stream `fp`, if the call `op` may take it to the kernel.
/// `fp` is the program's argument: null (for `fflush`) or a stream of the
/// C library's, as the call requires.
pub(crate) fn stream(each: Each<'_>, fp: *mut FILE, op: Stdio) {
    if fp.is_null() {
        return;
    }
    // SAFETY: a stream's head (above), the fields glibc's own macros read.
    let h = unsafe { (fp as *const FileHead).read() };
    let (base, end) = (h.buf_base as usize, h.buf_end as usize);
    // No buffer yet (the first call allocates one and reads at once: a
    // fresh allocation of the program's heap, which its allocator wrote).
    if base == 0 || end <= base || end - base > 64 << 20 {
        return;
    }
    let buffered = (h.read_end as usize).saturating_sub(h.read_ptr as usize);
    let room = (h.write_end as usize).saturating_sub(h.write_ptr as usize);
    let to_kernel = match op {
        Stdio::Read(n) => buffered < n,
        Stdio::ReadTo(delim) => {
            // SAFETY: the stream's buffered bytes, [read_ptr, read_end).
            buffered == 0 || unsafe { libc::memchr(h.read_ptr.cast(), c_int::from(delim), buffered) }.is_null()
        }
        Stdio::Write(n) => n >= room,
        Stdio::Flush => h.write_ptr > h.write_base,
        Stdio::Refill => true,
    };
    if to_kernel {
        each(base, end - base);
    }
}

/// `_IO_ERR_SEEN`: the stream's error flag (`ferror`).
const STREAM_ERROR: c_int = 0x20;

/// Whether stream `fp` has its error flag set (`ferror_unlocked`: the
/// caller of the stdio call wrapped holds its lock, or needs none).
pub(crate) fn stream_failed(fp: *mut FILE) -> bool {
    // SAFETY: the flags of the caller's stream, its first field.
    !fp.is_null() && unsafe { (fp as *const c_int).read() } & STREAM_ERROR != 0
}

extern "C" {
    fn clearerr_unlocked(fp: *mut FILE);
}

/// Clears stream `fp`'s error flag.
pub(crate) fn clear_failure(fp: *mut FILE) {
    // SAFETY: the caller's stream, whose lock the stdio call wrapped holds
    // (or needs none).
    unsafe { clearerr_unlocked(fp) };
}

/// glibc's `struct __dirstream` (`sysdeps/unix/sysv/linux/dirstream.h`,
/// private): its buffer follows the head. Misread, the walk below only
/// faults in more of the program's managed pages than it needs.
#[repr(C)]
struct DirHead {
    fd: c_int,
    lock: c_int,
    allocation: size_t,
    size: size_t,
    offset: size_t,
}

/// Bytes of a directory stream's head, before its buffer.
const DIR_HEAD: usize = 48;

/// The buffer of directory stream `d`, when `readdir` is about to refill
/// it. `d` is the program's argument, a directory stream of the C
/// library's, as `readdir` requires.
pub(crate) fn directory(each: Each<'_>, d: *mut DIR) {
    if d.is_null() {
        return;
    }
    // SAFETY: the head of the caller's stream (above): its first bytes,
    // within glibc's allocation whatever its version.
    let h = unsafe { (d as *const DirHead).read() };
    if h.offset >= h.size {
        each(d as usize + DIR_HEAD, h.allocation.min(1 << 20));
    }
}

/// The length of the program's string `s` (for `fputs` and `puts`, which
/// require it NUL-terminated).
pub(crate) fn c_len(s: *const c_char) -> usize {
    if s.is_null() {
        return 0;
    }
    // SAFETY: the caller's NUL-terminated string (above).
    unsafe { libc::strlen(s) }
}

extern "C" {
    static stdout: *mut FILE;
}

/// glibc's `stdout`, for `puts`.
pub(crate) fn standard_output() -> *mut FILE {
    // SAFETY: a pointer-sized static of the C library's, set before any
    // program code runs.
    unsafe { stdout }
}
