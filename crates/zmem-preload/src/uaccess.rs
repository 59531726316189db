//! The program's I/O calls on managed memory, where the pager's
//! userfaultfd serves faults from user mode only.
//!
//! A user without privileges gets only that on a default kernel
//! (`vm.unprivileged_userfaultfd=0`, `/dev/userfaultfd` root's). Then the
//! kernel's own access to a page zmem has not mapped (never touched,
//! evicted, dropped) is not handed to the pager: the system call fails
//! with EFAULT, or returns a short count. Python's `open(f, 'rb').read()`
//! of a 6 MB file failed so under `zmem run` as `nobody`, and so did
//! `sort`, node's `readFileSync` and Ruby's `File.binread`.
//!
//! So in that mode, and only then, the C library's I/O calls are wrapped
//! here: before the call, the pages of its buffers that lie in managed
//! memory and may not be mapped (`Pager::unmapped_run`) are touched from
//! user mode, a fault the pager serves; a system call that still fails
//! with EFAULT (a page evicted again meanwhile) is made again, at most
//! `RETRIES` times. An EFAULT leaves the data where it was (a pipe, a
//! stream socket, a file's offset), so the call is the one the program
//! made. The stdio calls that read or write through a stream's buffer
//! (`fread`, `fgets`, `getline`, `fwrite`, `fflush`, `fclose`, ...) and
//! `readdir` fault in the stream's or directory's buffer first, when the
//! call may go to the kernel; the C library makes their system calls
//! itself, past this shim, so they are not made again.
//!
//! Left out: the calls the C library makes inside other calls
//! (`printf`'s flush of a full buffer, `opendir`'s first read), calls
//! made with `syscall(2)`, io_uring, futexes, and the calls with small
//! structures (`stat`, `accept`'s address), which programs keep on the
//! stack, never managed. docs/limitations.md says what a user can do instead.
//!
//! Everywhere else (a full userfaultfd, a zmem thread, inside the shim)
//! each wrapper is the C library's call and one load of a flag.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use std::mem::size_of;

use libc::{
    epoll_event, fd_set, iovec, mmsghdr, mode_t, msghdr, nfds_t, off_t, pollfd, sigset_t, size_t, sockaddr, socklen_t,
    ssize_t, timespec, timeval, DIR, FILE,
};

use crate::stdio::{c_len, clear_failure, directory, standard_output, stream, stream_failed, Each, Stdio};
use zmem_common::PAGE_SIZE;

/// The pager's userfaultfd serves faults from user mode only. Set at its
/// start, never cleared: a forked child's pager takes over its parent's
/// descriptor, of the same mode, and keeps the flag it inherited.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Times a system call that failed with EFAULT is made again after its
/// buffers' pages were faulted in once more.
const RETRIES: usize = 8;

/// The most bytes of one buffer faulted in for one call: a larger `read`
/// or `write` on a file, `fread` or `fwrite` goes in pieces (see
/// [`in_pieces`]).
const PIECE: usize = 1 << 20;

/// Wraps the I/O calls from now on (see the module's doc).
pub(crate) fn activate() {
    ACTIVE.store(true, Ordering::Relaxed);
}

fn active() -> bool {
    ACTIVE.load(Ordering::Relaxed) && !crate::guard::in_zmem()
}

/// Touches, from user mode, the pages of `[p, p + n)` that lie in managed
/// memory and may not be mapped; returns whether there were any. A range
/// the calling thread found with none at the pager's present epoch is not
/// looked at again (`flags::mapped_ranges`): the look costs two system
/// calls (`guarded` blocks signals and puts them back), where the I/O call
/// may cost less.
fn fault_in(p: usize, n: usize) -> bool {
    touch(p, n, false)
}

/// As [`fault_in`], for a call that failed with EFAULT: every page of the
/// range in managed memory is touched, whatever the pager's state says,
/// and nothing is remembered.
fn fault_in_every(p: usize, n: usize) -> bool {
    touch(p, n, true)
}

/// [`fault_in`] (`every` false) or [`fault_in_every`] (true).
fn touch(p: usize, n: usize, every: bool) -> bool {
    if p == 0 || n == 0 || !crate::state::is_shim_process() {
        return false;
    }
    let Some(shim) = crate::state::current() else {
        return false;
    };
    let (start, end) = (p as u64, (p as u64).saturating_add(n as u64));
    // Read before the look: if it moves meanwhile, what is remembered is
    // stale at once.
    let epoch = shim.pager.epoch();
    if !every && remembered(start, end, epoch) {
        return false;
    }
    let mut at = start;
    let mut any = false;
    // The look takes the pager's locks: with signals blocked (`guarded`),
    // so that no handler of the program's faults while they are held. The
    // touch does not: it is the program's own access.
    let look = |at| if every { shim.pager.managed_run(at, end) } else { shim.pager.unmapped_run(at, end) };
    while let Some((a, b)) = crate::guard::guarded(|| look(at)).flatten() {
        for page in (a..b).step_by(PAGE_SIZE) {
            // SAFETY: a page of a region the pager manages, outside the
            // program's holes in it: mapped readable (private, anonymous,
            // read-write when managed), the program's buffer for this call.
            // A volatile read of one byte changes nothing; the fault it
            // takes is served by the pager's handler, not this thread.
            unsafe { std::ptr::read_volatile(page as *const u8) };
        }
        any = true;
        at = b;
    }
    if !any && !every {
        remember(start, end, epoch);
    }
    any
}

/// Whether the calling thread found `[start, end)` with no unmapped page
/// at `epoch`, the pager's present one.
fn remembered(start: u64, end: u64, epoch: u64) -> bool {
    let table = crate::flags::mapped_ranges();
    (0..crate::flags::MAPPED_RANGES).any(|i| {
        // SAFETY: the calling thread's own table, entry i < its length;
        // read whole, with the epoch last (see `remember`).
        let [s, e, at] = unsafe { std::ptr::read_volatile(table.cast::<[u64; 3]>().wrapping_add(i)) };
        at == epoch && s <= start && end <= e
    })
}

/// Remembers that `[start, end)` had no unmapped page at `epoch`, in the
/// entry its first page picks. A handler of the program's signals that
/// runs meanwhile on this thread and reads the table sees the entry as
/// none (epoch 0) until it is whole.
fn remember(start: u64, end: u64, epoch: u64) {
    let slot = (start / PAGE_SIZE as u64) as usize % crate::flags::MAPPED_RANGES;
    let entry = crate::flags::mapped_ranges().cast::<u64>().wrapping_add(slot * 3);
    for (i, v) in [(2, 0), (0, start), (1, end), (2, epoch)] {
        // SAFETY: field i of entry `slot` of the calling thread's own
        // table, written whole.
        unsafe { std::ptr::write_volatile(entry.wrapping_add(i), v) };
    }
}

/// Faults in every buffer `ranges` names, as [`touch`] does one (`every`:
/// each managed page, after EFAULT); returns whether any page was.
fn touch_all(ranges: &impl Fn(Each<'_>), every: bool) -> bool {
    let mut any = false;
    ranges(&mut |p, n| any |= touch(p, n, every));
    any
}

/// A system call's result: -1 is a failure, with errno.
trait Ret: Copy {
    fn failed(self) -> bool;
}

impl Ret for ssize_t {
    fn failed(self) -> bool {
        self == -1
    }
}

impl Ret for c_int {
    fn failed(self) -> bool {
        self == -1
    }
}

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// A system call's wrapper: its buffers faulted in first, and the call
/// made again after an EFAULT while there are pages to fault in.
fn retried<R: Ret>(ranges: impl Fn(Each<'_>), call: impl Fn() -> R) -> R {
    if !active() {
        return call();
    }
    touch_all(&ranges, false);
    let mut r = call();
    for _ in 0..RETRIES {
        if !r.failed() || errno() != libc::EFAULT {
            break;
        }
        if !touch_all(&ranges, true) {
            crate::errno::set_errno(libc::EFAULT);
            break;
        }
        r = call();
    }
    r
}

/// A stdio or directory call's wrapper: its buffers faulted in first (the
/// C library makes the system call, and reports its failure itself).
fn prepared<R>(ranges: impl Fn(Each<'_>), call: impl FnOnce() -> R) -> R {
    if active() {
        let e = errno();
        touch_all(&ranges, false);
        crate::errno::set_errno(e);
    }
    call()
}

/// Whether `fd` is a regular file or a block device: a `read` or `write`
/// on it in pieces moves the same bytes as in one call.
fn seekable(fd: c_int) -> bool {
    // SAFETY: an all-zero `stat` is a valid value of it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one `stat` into `st`, on this stack.
    let r = unsafe { libc::syscall(libc::SYS_fstat, fd, &mut st as *mut libc::stat) };
    let kind = st.st_mode & libc::S_IFMT;
    r == 0 && (kind == libc::S_IFREG || kind == libc::S_IFBLK)
}

/// What a call on one buffer goes to.
#[derive(Clone, Copy)]
enum Target {
    /// A descriptor (`read`, `write` ...).
    Fd(c_int),
    /// A stdio stream (`fread`, `fwrite`), which loops over its own system
    /// calls until done, EOF or an error.
    Stream,
}

impl Target {
    /// Whether the call moves the same bytes when made in parts: on a
    /// stream, or a regular file or block device (`fstat`).
    fn in_parts(self) -> bool {
        match self {
            Target::Fd(fd) => seekable(fd),
            Target::Stream => true,
        }
    }
}

/// A call on the `n` bytes at `buf` (`read`, `write`, `fread` ...), made
/// by `call(offset, len)` over `[buf + offset, buf + offset + len)`;
/// returns the bytes moved, or the first part's failure.
///
/// Where the call may be made in parts ([`Target::in_parts`]):
/// - more than `PIECE` bytes go piece by piece, each faulted in just
///   before its call: faulted in whole, the first pages of a buffer larger
///   than the limit were evicted again before the kernel reached them, and
///   every try stopped there (Python's read of a 160 MB file under 64M);
/// - a `read` or `write` that comes back short, with pages of the rest of
///   its piece unmapped again (the kernel stops at the first one and
///   returns what it moved; `sort` under 32M lost that race), goes on from
///   there, at most `RETRIES` times in a row.
fn in_pieces(buf: usize, n: usize, to: Target, call: impl Fn(usize, usize) -> ssize_t) -> ssize_t {
    if !active() {
        return call(0, n);
    }
    let piece = if n > PIECE && to.in_parts() { PIECE } else { n };
    let mut done = 0;
    let mut short = 0;
    while done < n {
        let len = (n - done).min(piece);
        let r = retried(|each: Each<'_>| each(buf + done, len), || call(done, len));
        if r < 0 {
            return if done > 0 { done as ssize_t } else { r };
        }
        done += r as usize;
        if (r as usize) < len {
            let again = matches!(to, Target::Fd(_))
                && r > 0
                && short < RETRIES
                && fault_in(buf + done, len - r as usize)
                && to.in_parts();
            if !again {
                break;
            }
            short += 1;
        } else {
            short = 0;
        }
    }
    done as ssize_t
}

/// The C library's `name` (NUL-terminated), looked up once into `slot`;
/// 0 if it has none.
fn lookup(slot: &AtomicUsize, name: &'static str) -> usize {
    let mut f = slot.load(Ordering::Relaxed);
    if f == 0 {
        // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds the
        // definition after the shim's.
        f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) } as usize;
        slot.store(f, Ordering::Relaxed);
    }
    f
}

/// As [`lookup`], for a call the program makes: its C library has it (a
/// program linked against one without it does not call it).
fn next(slot: &AtomicUsize, name: &'static str) -> usize {
    let f = lookup(slot, name);
    if f == 0 {
        crate::errno::keeping_errno(|| log::error!("the C library has no {}", name.trim_end_matches('\0')));
        std::process::abort();
    }
    f
}

/// `name(args) -> ret`, the C library's after `$how` (`retried` or
/// `prepared`) with the buffers `$ranges` names (calling `$each`).
macro_rules! wrap {
    ($resolve:ident, $how:ident: $($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty, |$each:ident| $ranges:expr;)*) => {
        slots!($resolve: $($name),*);
        $(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            let f = next_fn!($name: unsafe extern "C" fn($($ty),*) -> $ret);
            $how(
                |$each: Each<'_>| $ranges,
                // SAFETY: the caller's arguments, as the C library takes them.
                || unsafe { f($($arg),*) },
            )
        }
        )*
    };
}

/// The C library's `name`, of type `F` (a function pointer type).
macro_rules! next_fn {
    ($name:ident: $f:ty) => {{
        let f = next(&$name::NEXT, concat!(stringify!($name), "\0"));
        // SAFETY: f is the C library's function of this name, of this type.
        unsafe { std::mem::transmute::<usize, $f>(f) }
    }};
}

/// For each wrapper `name`, a module `name` holding the C library's
/// function (looked up by `next`), and `$resolve`, which looks them all up
/// as the shim loads: a first call from a signal handler would otherwise
/// run `dlsym` there.
macro_rules! slots {
    ($resolve:ident: $($name:ident),*) => {
        $(
            #[allow(non_snake_case)]
            mod $name {
                pub(super) static NEXT: super::AtomicUsize = super::AtomicUsize::new(0);
            }
        )*
        fn $resolve() {
            $( lookup(&$name::NEXT, concat!(stringify!($name), "\0")); )*
        }
    };
}

/// Looks up the C library's functions the wrappers call.
pub(crate) fn resolve() {
    resolve_buffers();
    resolve_streams();
    resolve_retried();
    resolve_prepared();
}

/// `read`, `pread`, `write` and `pwrite` and their checked forms: the
/// buffer `$buf` of `$n` bytes, and the call on `(offset, len)` of it.
macro_rules! on_buffer {
    ($resolve:ident: $($name:ident($($arg:ident: $ty:ty),*) -> ssize_t, ($fd:ident, $buf:ident, $n:ident), |$off:ident, $len:ident| ($($call:expr),*);)*) => {
        slots!($resolve: $($name),*);
        $(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> ssize_t {
            let f = next_fn!($name: unsafe extern "C" fn($($ty),*) -> ssize_t);
            in_pieces($buf as usize, $n, Target::Fd($fd), |$off, $len| {
                // SAFETY: the caller's call, on a part of its buffer.
                unsafe { f($($call),*) }
            })
        }
        )*
    };
}

on_buffer! { resolve_buffers:
    read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t, (fd, buf, n), |o, l| (fd, buf.wrapping_byte_add(o), l);
    __read_chk(fd: c_int, buf: *mut c_void, n: size_t, size: size_t) -> ssize_t, (fd, buf, n),
        |o, l| (fd, buf.wrapping_byte_add(o), l, size.saturating_sub(o));
    pread(fd: c_int, buf: *mut c_void, n: size_t, at: off_t) -> ssize_t, (fd, buf, n),
        |o, l| (fd, buf.wrapping_byte_add(o), l, at + o as off_t);
    pread64(fd: c_int, buf: *mut c_void, n: size_t, at: off_t) -> ssize_t, (fd, buf, n),
        |o, l| (fd, buf.wrapping_byte_add(o), l, at + o as off_t);
    __pread_chk(fd: c_int, buf: *mut c_void, n: size_t, at: off_t, size: size_t) -> ssize_t, (fd, buf, n),
        |o, l| (fd, buf.wrapping_byte_add(o), l, at + o as off_t, size.saturating_sub(o));
    __pread64_chk(fd: c_int, buf: *mut c_void, n: size_t, at: off_t, size: size_t) -> ssize_t, (fd, buf, n),
        |o, l| (fd, buf.wrapping_byte_add(o), l, at + o as off_t, size.saturating_sub(o));
    write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t, (fd, buf, n), |o, l| (fd, buf.wrapping_byte_add(o), l);
    pwrite(fd: c_int, buf: *const c_void, n: size_t, at: off_t) -> ssize_t, (fd, buf, n),
        |o, l| (fd, buf.wrapping_byte_add(o), l, at + o as off_t);
    pwrite64(fd: c_int, buf: *const c_void, n: size_t, at: off_t) -> ssize_t, (fd, buf, n),
        |o, l| (fd, buf.wrapping_byte_add(o), l, at + o as off_t);
}

/// `fread` and `fwrite`: the stream's buffer faulted in as for the other
/// stdio calls, and a large request made in pieces, as `in_pieces` says
/// (the stream moves the same bytes: it loops over its own reads or
/// writes until done, EOF or an error).
macro_rules! stdio_buffer {
    ($resolve:ident: $($name:ident($p:ident: $pt:ty), $op:ident;)*) => {
        slots!($resolve: $($name),*);
        $(
        #[no_mangle]
        pub unsafe extern "C" fn $name($p: $pt, size: size_t, n: size_t, fp: *mut FILE) -> size_t {
            let f = next_fn!($name: unsafe extern "C" fn($pt, size_t, size_t, *mut FILE) -> size_t);
            let bytes = size.saturating_mul(n);
            if !active() || size == 0 {
                // SAFETY: the caller's call.
                return unsafe { f($p, size, n, fp) };
            }
            let piece = |o: usize, l: usize| {
                let mut e: Each<'_> = &mut |a, b| {
                    fault_in(a, b);
                };
                stream(&mut e, fp, Stdio::$op(l));
                let mut moved = 0;
                for _ in 0..RETRIES {
                    // SAFETY: the caller's call, on a part of its buffer,
                    // by bytes.
                    moved += unsafe { f($p.wrapping_byte_add(o + moved), 1, l - moved, fp) };
                    // The stream's own system call failed with EFAULT on a
                    // page evicted again meanwhile: its error is cleared
                    // and the rest made again. Nothing moved past it.
                    if moved == l || errno() != libc::EFAULT || !stream_failed(fp) {
                        break;
                    }
                    if !fault_in_every($p as usize + o + moved, l - moved) {
                        break;
                    }
                    clear_failure(fp);
                }
                moved as ssize_t
            };
            let done = in_pieces($p as usize, bytes, Target::Stream, piece);
            done.max(0) as size_t / size
        }
        )*
    };
}

stdio_buffer! { resolve_streams:
    fread(p: *mut c_void), Read;
    fread_unlocked(p: *mut c_void), Read;
    fwrite(p: *const c_void), Write;
    fwrite_unlocked(p: *const c_void), Write;
}

/// The buffers of `n` iovecs at `iov`, and the array itself. `iov` is
/// the program's argument to the call wrapped, which requires it to point
/// at `n` iovecs (the kernel would read them all).
fn iovecs(each: Each<'_>, iov: *const iovec, n: c_int) {
    // The kernel refuses more than IOV_MAX (EINVAL); nothing to read then.
    if iov.is_null() || !(1..=1024).contains(&n) {
        return;
    }
    let n = n as usize;
    each(iov as usize, n * std::mem::size_of::<iovec>());
    for i in 0..n {
        // SAFETY: i < n, within the caller's array (above).
        let v = unsafe { iov.wrapping_add(i).read() };
        each(v.iov_base as usize, v.iov_len);
    }
}

/// The buffers of a message header: itself, its address, data and
/// control buffers. `m` is the program's argument to `sendmsg` or
/// `recvmsg`, which require it to point at a `msghdr`.
fn message(each: Each<'_>, m: *const msghdr) {
    if m.is_null() {
        return;
    }
    each(m as usize, std::mem::size_of::<msghdr>());
    // SAFETY: the caller's header (above).
    let h = unsafe { m.read() };
    each(h.msg_name as usize, h.msg_namelen as usize);
    iovecs(each, h.msg_iov, h.msg_iovlen.min(1025) as c_int);
    each(h.msg_control as usize, h.msg_controllen);
}

/// The buffers of `n` messages (`sendmmsg`, `recvmmsg`): `m` is the
/// program's argument, which the call requires to point at `n` of them.
fn messages(each: Each<'_>, m: *const mmsghdr, n: c_uint) {
    if m.is_null() {
        return;
    }
    let n = n.min(1024) as usize;
    each(m as usize, n * std::mem::size_of::<mmsghdr>());
    for i in 0..n {
        // Its first field: the address of message i, within the array.
        message(each, m.wrapping_add(i).cast::<msghdr>());
    }
}

/// `max` events at `ev` (`epoll_wait`), which the kernel writes.
fn events(each: Each<'_>, ev: *mut epoll_event, max: c_int) {
    if max > 0 {
        each(ev as usize, max as usize * size_of::<epoll_event>());
    }
}

/// The three sets of `select` (each may be null).
fn fd_sets(each: Each<'_>, sets: [*mut fd_set; 3]) {
    for s in sets {
        each(s as usize, size_of::<fd_set>());
    }
}

/// An address buffer and its length, which the kernel reads and writes
/// (`accept`, `getsockname`, `getsockopt`).
fn address(each: Each<'_>, addr: *mut sockaddr, len: *mut socklen_t) {
    if len.is_null() {
        return;
    }
    each(len as usize, size_of::<socklen_t>());
    // SAFETY: the caller's length, as the call requires it (above).
    let n = unsafe { len.read() };
    each(addr as usize, n as usize);
}

/// A NUL-terminated string the kernel reads (a path): reading its length
/// from user mode faults it in already.
fn c_string(each: Each<'_>, s: *const c_char) {
    each(s as usize, c_len(s) + 1);
}

/// A path and the `size` bytes of a `stat` result at `buf`.
fn stat_of(each: Each<'_>, path: *const c_char, buf: *mut c_void, size: usize) {
    c_string(each, path);
    each(buf as usize, size);
}

wrap! { resolve_retried, retried:
    readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t, |each| iovecs(each, iov, n);
    preadv(fd: c_int, iov: *const iovec, n: c_int, off: off_t) -> ssize_t, |each| iovecs(each, iov, n);
    preadv64(fd: c_int, iov: *const iovec, n: c_int, off: off_t) -> ssize_t, |each| iovecs(each, iov, n);
    preadv2(fd: c_int, iov: *const iovec, n: c_int, off: off_t, flags: c_int) -> ssize_t,
        |each| iovecs(each, iov, n);
    preadv64v2(fd: c_int, iov: *const iovec, n: c_int, off: off_t, flags: c_int) -> ssize_t,
        |each| iovecs(each, iov, n);
    writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t, |each| iovecs(each, iov, n);
    pwritev(fd: c_int, iov: *const iovec, n: c_int, off: off_t) -> ssize_t, |each| iovecs(each, iov, n);
    pwritev64(fd: c_int, iov: *const iovec, n: c_int, off: off_t) -> ssize_t, |each| iovecs(each, iov, n);
    pwritev2(fd: c_int, iov: *const iovec, n: c_int, off: off_t, flags: c_int) -> ssize_t,
        |each| iovecs(each, iov, n);
    pwritev64v2(fd: c_int, iov: *const iovec, n: c_int, off: off_t, flags: c_int) -> ssize_t,
        |each| iovecs(each, iov, n);
    recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t, |each| each(buf as usize, n);
    __recv_chk(fd: c_int, buf: *mut c_void, n: size_t, len: size_t, flags: c_int) -> ssize_t,
        |each| each(buf as usize, n);
    recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, alen: *mut socklen_t)
        -> ssize_t, |each| each(buf as usize, n);
    __recvfrom_chk(fd: c_int, buf: *mut c_void, n: size_t, len: size_t, flags: c_int, addr: *mut sockaddr,
        alen: *mut socklen_t) -> ssize_t, |each| each(buf as usize, n);
    recvmsg(fd: c_int, m: *mut msghdr, flags: c_int) -> ssize_t, |each| message(each, m);
    recvmmsg(fd: c_int, m: *mut mmsghdr, n: c_uint, flags: c_int, t: *mut timespec) -> c_int,
        |each| messages(each, m, n);
    send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t, |each| each(buf as usize, n);
    sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, alen: socklen_t)
        -> ssize_t, |each| each(buf as usize, n);
    sendmsg(fd: c_int, m: *const msghdr, flags: c_int) -> ssize_t, |each| message(each, m);
    sendmmsg(fd: c_int, m: *mut mmsghdr, n: c_uint, flags: c_int) -> c_int, |each| messages(each, m, n);
    getrandom(buf: *mut c_void, n: size_t, flags: c_uint) -> ssize_t, |each| each(buf as usize, n);
    epoll_wait(ep: c_int, ev: *mut epoll_event, max: c_int, ms: c_int) -> c_int, |each| events(each, ev, max);
    epoll_pwait(ep: c_int, ev: *mut epoll_event, max: c_int, ms: c_int, sig: *const sigset_t) -> c_int,
        |each| events(each, ev, max);
    epoll_pwait2(ep: c_int, ev: *mut epoll_event, max: c_int, t: *const timespec, sig: *const sigset_t) -> c_int,
        |each| events(each, ev, max);
    poll(fds: *mut pollfd, n: nfds_t, ms: c_int) -> c_int, |each| each(fds as usize, n as usize * size_of::<pollfd>());
    ppoll(fds: *mut pollfd, n: nfds_t, t: *const timespec, sig: *const sigset_t) -> c_int,
        |each| each(fds as usize, n as usize * size_of::<pollfd>());
    select(n: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, t: *mut timeval) -> c_int,
        |each| fd_sets(each, [r, w, e]);
    pselect(n: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, t: *const timespec, sig: *const sigset_t)
        -> c_int, |each| fd_sets(each, [r, w, e]);
    accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int, |each| address(each, addr, len);
    accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int,
        |each| address(each, addr, len);
    getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int, |each| address(each, addr, len);
    getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int, |each| address(each, addr, len);
    getsockopt(fd: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int,
        |each| address(each, val.cast(), len);
    setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int,
        |each| each(val as usize, len as usize);
    connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int, |each| each(addr as usize, len as usize);
    bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int, |each| each(addr as usize, len as usize);
    pipe(fds: *mut c_int) -> c_int, |each| each(fds as usize, 2 * size_of::<c_int>());
    pipe2(fds: *mut c_int, flags: c_int) -> c_int, |each| each(fds as usize, 2 * size_of::<c_int>());
    socketpair(d: c_int, t: c_int, p: c_int, fds: *mut c_int) -> c_int,
        |each| each(fds as usize, 2 * size_of::<c_int>());
    stat(path: *const c_char, buf: *mut libc::stat) -> c_int, |each| stat_of(each, path, buf.cast(), size_of::<libc::stat>());
    lstat(path: *const c_char, buf: *mut libc::stat) -> c_int, |each| stat_of(each, path, buf.cast(), size_of::<libc::stat>());
    stat64(path: *const c_char, buf: *mut libc::stat64) -> c_int,
        |each| stat_of(each, path, buf.cast(), size_of::<libc::stat64>());
    lstat64(path: *const c_char, buf: *mut libc::stat64) -> c_int,
        |each| stat_of(each, path, buf.cast(), size_of::<libc::stat64>());
    fstat(fd: c_int, buf: *mut libc::stat) -> c_int, |each| each(buf as usize, size_of::<libc::stat>());
    fstat64(fd: c_int, buf: *mut libc::stat64) -> c_int, |each| each(buf as usize, size_of::<libc::stat64>());
    fstatat(dir: c_int, path: *const c_char, buf: *mut libc::stat, flags: c_int) -> c_int,
        |each| stat_of(each, path, buf.cast(), size_of::<libc::stat>());
    fstatat64(dir: c_int, path: *const c_char, buf: *mut libc::stat64, flags: c_int) -> c_int,
        |each| stat_of(each, path, buf.cast(), size_of::<libc::stat64>());
    statx(dir: c_int, path: *const c_char, flags: c_int, mask: c_uint, buf: *mut libc::statx) -> c_int,
        |each| stat_of(each, path, buf.cast(), size_of::<libc::statx>());
    access(path: *const c_char, mode: c_int) -> c_int, |each| c_string(each, path);
    faccessat(dir: c_int, path: *const c_char, mode: c_int, flags: c_int) -> c_int, |each| c_string(each, path);
    unlink(path: *const c_char) -> c_int, |each| c_string(each, path);
    unlinkat(dir: c_int, path: *const c_char, flags: c_int) -> c_int, |each| c_string(each, path);
    rmdir(path: *const c_char) -> c_int, |each| c_string(each, path);
    mkdir(path: *const c_char, mode: mode_t) -> c_int, |each| c_string(each, path);
    mkdirat(dir: c_int, path: *const c_char, mode: mode_t) -> c_int, |each| c_string(each, path);
    chdir(path: *const c_char) -> c_int, |each| c_string(each, path);
    rename(from: *const c_char, to: *const c_char) -> c_int, |each| {
        c_string(each, from);
        c_string(each, to)
    };
    renameat(fd: c_int, from: *const c_char, tfd: c_int, to: *const c_char) -> c_int, |each| {
        c_string(each, from);
        c_string(each, to)
    };
    readlink(path: *const c_char, buf: *mut c_char, n: size_t) -> ssize_t, |each| {
        c_string(each, path);
        each(buf as usize, n)
    };
    readlinkat(dir: c_int, path: *const c_char, buf: *mut c_char, n: size_t) -> ssize_t, |each| {
        c_string(each, path);
        each(buf as usize, n)
    };
    waitpid(pid: libc::pid_t, status: *mut c_int, options: c_int) -> libc::pid_t,
        |each| each(status as usize, size_of::<c_int>());
    uname(buf: *mut libc::utsname) -> c_int, |each| each(buf as usize, size_of::<libc::utsname>());
    sendfile(out: c_int, from: c_int, off: *mut off_t, n: size_t) -> ssize_t,
        |each| each(off as usize, size_of::<off_t>());
    getdents64(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t, |each| each(buf as usize, n);
}

wrap! { resolve_prepared, prepared:
    fgets(s: *mut c_char, n: c_int, fp: *mut FILE) -> *mut c_char, |each| stream(each, fp, Stdio::ReadTo(b'\n'));
    fgets_unlocked(s: *mut c_char, n: c_int, fp: *mut FILE) -> *mut c_char,
        |each| stream(each, fp, Stdio::ReadTo(b'\n'));
    getline(line: *mut *mut c_char, n: *mut size_t, fp: *mut FILE) -> ssize_t,
        |each| stream(each, fp, Stdio::ReadTo(b'\n'));
    getdelim(line: *mut *mut c_char, n: *mut size_t, delim: c_int, fp: *mut FILE) -> ssize_t,
        |each| stream(each, fp, Stdio::ReadTo(delim as u8));
    __getdelim(line: *mut *mut c_char, n: *mut size_t, delim: c_int, fp: *mut FILE) -> ssize_t,
        |each| stream(each, fp, Stdio::ReadTo(delim as u8));
    fgetc(fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Read(1));
    getc(fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Read(1));
    _IO_getc(fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Read(1));
    fgetc_unlocked(fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Read(1));
    getc_unlocked(fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Read(1));
    __uflow(fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Refill);
    __underflow(fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Refill);
    fputs(s: *const c_char, fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Write(c_len(s)));
    fputs_unlocked(s: *const c_char, fp: *mut FILE) -> c_int,
        |each| stream(each, fp, Stdio::Write(c_len(s)));
    puts(s: *const c_char) -> c_int, |each| stream(each, standard_output(), Stdio::Write(c_len(s) + 1));
    fputc(c: c_int, fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Write(1));
    putc(c: c_int, fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Write(1));
    _IO_putc(c: c_int, fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Write(1));
    fputc_unlocked(c: c_int, fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Write(1));
    putc_unlocked(c: c_int, fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Write(1));
    __overflow(fp: *mut FILE, c: c_int) -> c_int, |each| stream(each, fp, Stdio::Flush);
    fflush(fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Flush);
    fflush_unlocked(fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Flush);
    fclose(fp: *mut FILE) -> c_int, |each| stream(each, fp, Stdio::Flush);
    readdir(d: *mut DIR) -> *mut libc::dirent, |each| directory(each, d);
    readdir64(d: *mut DIR) -> *mut libc::dirent64, |each| directory(each, d);
}
