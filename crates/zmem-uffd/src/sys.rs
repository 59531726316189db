//! The userfaultfd uapi: one file descriptor, its ioctls and its events.
//!
//! # Safety model
//! A userfaultfd lets the kernel write into (COPY, ZEROPAGE) and take pages
//! out of (MOVE) ranges of our own address space. The ioctls that do so are
//! `unsafe fn`s whose callers promise that no Rust reference covers the
//! destination (and, for MOVE, the source) range: such memory is only ever
//! touched through raw pointers or atomics, as a pager's regions are.
//!
//! # Error handling (as firecracker's uffd handler does)
//! - `EAGAIN` with progress: the rest is retried. `EAGAIN` with none: an
//!   event is pending (`mmap_changing`) and every resolving ioctl fails until
//!   it is read, so the ioctl returns [`UffdError::Again`] and the caller
//!   drains events first. (Retrying in place deadlocks: the madvise that
//!   raised the event waits for the event to be read.)
//! - `EEXIST` on COPY/ZEROPAGE: a page is already there (another handler, or
//!   a racing fault already resolved it). The range is reported done and the
//!   waiters are woken: the faulting thread retries its access and finds it.
//! - Partial copies and moves are finished in a loop; the byte counts the
//!   kernel reports (`copy`, `zeropage`, `move`) drive it.

use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

use linux_raw_sys::general as uapi;
use linux_raw_sys::ioctl as nr;
use rustix::io::Errno;
use rustix::ioctl::{ioctl, Opcode, Updater};
use thiserror::Error;

/// `_IOWR(UFFDIO, _UFFDIO_MOVE, struct uffdio_move)`: Debian's headers (and
/// linux-raw-sys) predate it, so it is spelled out from the kernel's uapi.
pub const UFFDIO_MOVE: Opcode = 0xC028_AA05;
pub const UFFDIO_MOVE_MODE_DONTWAKE: u64 = 1;
pub const UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES: u64 = 2;
/// `_IOWR(UFFDIO, _UFFDIO_POISON, struct uffdio_poison)` (32 bytes).
pub const UFFDIO_POISON: Opcode = 0xC020_AA08;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1;
const UFFDIO_WRITEPROTECT_MODE_DONTWAKE: u64 = 2;
/// `_IO(0xAA, 0x00)` on `/dev/userfaultfd`.
pub const USERFAULTFD_IOC_NEW: Opcode = 0xAA00;
const UFFD_API: u64 = 0xAA;
/// `sizeof(struct uffd_msg)`.
const MSG_SIZE: usize = 32;

/// Feature bits of `UFFDIO_API` (`UFFD_FEATURE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Features(pub u64);

impl Features {
    pub const PAGEFAULT_FLAG_WP: Features = Features(uapi::UFFD_FEATURE_PAGEFAULT_FLAG_WP as u64);
    pub const EVENT_FORK: Features = Features(uapi::UFFD_FEATURE_EVENT_FORK as u64);
    pub const EVENT_REMAP: Features = Features(uapi::UFFD_FEATURE_EVENT_REMAP as u64);
    pub const EVENT_REMOVE: Features = Features(uapi::UFFD_FEATURE_EVENT_REMOVE as u64);
    pub const EVENT_UNMAP: Features = Features(uapi::UFFD_FEATURE_EVENT_UNMAP as u64);
    pub const THREAD_ID: Features = Features(uapi::UFFD_FEATURE_THREAD_ID as u64);
    pub const EXACT_ADDRESS: Features = Features(uapi::UFFD_FEATURE_EXACT_ADDRESS as u64);
    pub const WP_UNPOPULATED: Features = Features(uapi::UFFD_FEATURE_WP_UNPOPULATED as u64);
    pub const POISON: Features = Features(uapi::UFFD_FEATURE_POISON as u64);
    pub const WP_ASYNC: Features = Features(uapi::UFFD_FEATURE_WP_ASYNC as u64);
    pub const MOVE: Features = Features(uapi::UFFD_FEATURE_MOVE as u64);
    /// Faults in registered ranges raise SIGBUS in the faulting thread
    /// instead of queueing a message (`zmem bench sigbus` measures it).
    pub const SIGBUS: Features = Features(uapi::UFFD_FEATURE_SIGBUS as u64);

    pub fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Features {
    type Output = Features;
    fn bitor(self, o: Features) -> Features {
        Features(self.0 | o.0)
    }
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum UffdError {
    #[error(
        "userfaultfd is not allowed for this process: the syscall needs CAP_SYS_PTRACE or \
         vm.unprivileged_userfaultfd=1 (UFFD_USER_MODE_ONLY was tried too), and /dev/userfaultfd \
         is {dev}; as root run `sysctl vm.unprivileged_userfaultfd=1`, or give this user read-write \
         access to /dev/userfaultfd"
    )]
    NotPermitted { dev: String },
    #[error("userfaultfd is not supported by this kernel ({0})")]
    Unsupported(Errno),
    #[error("the kernel lacks userfaultfd features {missing:#x} (it offers {offered:#x})")]
    MissingFeatures { missing: u64, offered: u64 },
    #[error("{op} at {addr:#x}+{len:#x}: {errno}")]
    Ioctl { op: &'static str, addr: u64, len: u64, errno: Errno },
    /// EAGAIN: an event (remove, unmap, remap, fork) is pending and the mm is
    /// changing. The caller MUST read events before retrying, or it may wait
    /// forever for a madvise that waits on it. `done` bytes were handled.
    #[error("the address space is changing (an unread userfaultfd event): {done} bytes done")]
    Again { done: u64 },
    #[error("reading userfaultfd events: {0}")]
    Read(Errno),
    #[error("a short userfaultfd message of {0} bytes")]
    ShortMessage(usize),
}

/// How to obtain the file descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// The syscall, then the syscall with `UFFD_USER_MODE_ONLY`, then
    /// `/dev/userfaultfd`: whatever this process is allowed.
    Auto,
    Syscall,
    UserModeOnly,
    DevUserfaultfd,
}

/// Registration modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegisterMode {
    pub missing: bool,
    pub wp: bool,
}

/// One userfaultfd event.
#[derive(Debug)]
pub enum Event {
    /// A fault at `addr` (page-aligned unless EXACT_ADDRESS was asked for).
    PageFault { addr: u64, write: bool, wp: bool, minor: bool, thread_id: u32 },
    /// The process forked; the child's userfaultfd.
    Fork { uffd: zmem_common::host::fds::KeptFd },
    /// `mremap` moved `[from, from + len)` to `to`.
    Remap { from: u64, to: u64, len: u64 },
    /// `madvise(MADV_DONTNEED/REMOVE)` dropped `[start, end)`.
    Remove { start: u64, end: u64 },
    /// `munmap` unmapped `[start, end)`.
    Unmap { start: u64, end: u64 },
    /// An event this code does not know.
    Unknown(u8),
}

/// A userfaultfd, after the API handshake.
#[derive(Debug)]
pub struct Uffd {
    /// Kept from the program's `close` family (`zmem_common::host::fds`).
    fd: zmem_common::host::fds::KeptFd,
    features: Features,
    ioctls: u64,
    /// Made with `UFFD_USER_MODE_ONLY` ([`user_mode_only`](Self::user_mode_only)).
    user_mode_only: bool,
}

fn syscall_fd(flags: rustix::mm::UserfaultfdFlags) -> Result<OwnedFd, Errno> {
    // SAFETY: creating the descriptor affects no memory; what it can do to
    // this process's memory is done only through Uffd's unsafe methods.
    unsafe { rustix::mm::userfaultfd(flags) }
}

fn dev_fd(flags: u32) -> Result<OwnedFd, Errno> {
    use rustix::fs::{Mode, OFlags};
    let dev = rustix::fs::open("/dev/userfaultfd", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())?;
    // SAFETY: USERFAULTFD_IOC_NEW takes its flags by value (no pointer) and
    // returns a new descriptor, which NewFd's output keeps.
    let fd = unsafe { ioctl(&dev, NewFd { flags }) }?;
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `USERFAULTFD_IOC_NEW`, whose return value is the new descriptor.
struct NewFd {
    flags: u32,
}

// SAFETY: the opcode takes an integer argument (no pointer) and returns a
// descriptor as the ioctl's return value, which `output_from_ptr` keeps.
unsafe impl rustix::ioctl::Ioctl for NewFd {
    type Output = i32;
    const IS_MUTATING: bool = false;
    fn opcode(&self) -> Opcode {
        USERFAULTFD_IOC_NEW
    }
    fn as_ptr(&mut self) -> *mut std::ffi::c_void {
        self.flags as usize as *mut std::ffi::c_void
    }
    unsafe fn output_from_ptr(out: rustix::ioctl::IoctlOutput, _: *mut std::ffi::c_void) -> rustix::io::Result<i32> {
        Ok(out)
    }
}

/// A new descriptor, and whether it serves faults from user mode only.
/// `Auto` prefers what serves the kernel's own accesses too (a `read(2)`
/// into a registered page, a futex word there): the syscall, then
/// `/dev/userfaultfd`, and only then `UFFD_USER_MODE_ONLY`, under which
/// such an access fails with EFAULT (`vm.unprivileged_userfaultfd=0`, the
/// kernel's default, leaves an unprivileged process only that one).
fn open_raw(mode: OpenMode) -> Result<(OwnedFd, bool), UffdError> {
    use rustix::mm::UserfaultfdFlags as F;
    let base = F::CLOEXEC | F::NONBLOCK;
    let user = F::from_bits_retain(uapi::UFFD_USER_MODE_ONLY);
    let unsupported = |e: Errno| if e == Errno::NOSYS { UffdError::Unsupported(e) } else { not_permitted(e) };
    let full = |fd| (fd, false);
    let user_only = |fd| (fd, true);
    match mode {
        OpenMode::Syscall => syscall_fd(base).map(full).map_err(unsupported),
        OpenMode::UserModeOnly => syscall_fd(base | user).map(user_only).map_err(unsupported),
        OpenMode::DevUserfaultfd => dev_fd(base.bits()).map(full).map_err(unsupported),
        OpenMode::Auto => syscall_fd(base)
            .map(full)
            .or_else(|_| dev_fd(base.bits()).map(full))
            .or_else(|_| syscall_fd(base | user).map(user_only))
            .map_err(unsupported),
    }
}

fn not_permitted(e: Errno) -> UffdError {
    let dev = match std::fs::metadata("/dev/userfaultfd") {
        Ok(m) => {
            use std::os::unix::fs::MetadataExt;
            format!("mode {:o} owned by uid {} ({e})", m.mode() & 0o777, m.uid())
        }
        Err(err) => format!("not usable: {err}"),
    };
    UffdError::NotPermitted { dev }
}

/// Runs ioctl `OP`, whose argument is one `T` read and written in place.
///
/// # Safety
/// `T` MUST be the struct that ioctl `OP` takes, and the caller MUST satisfy
/// whatever the ioctl does to memory (see each caller's contract).
pub(crate) unsafe fn call<const OP: Opcode, T>(fd: BorrowedFd<'_>, v: &mut T) -> rustix::io::Result<()> {
    // SAFETY: the caller guarantees that T is OP's argument type.
    let u = unsafe { Updater::<OP, T>::new(v) };
    // SAFETY: as above; the caller covers the ioctl's effects on memory.
    unsafe { ioctl(fd, u) }
}

fn api(fd: &OwnedFd, features: u64) -> Result<uapi::uffdio_api, Errno> {
    let mut a = uapi::uffdio_api { api: UFFD_API, features, ioctls: 0 };
    // SAFETY: UFFDIO_API reads and writes exactly one struct uffdio_api.
    unsafe { call::<{ nr::UFFDIO_API }, _>(fd.as_fd(), &mut a) }?;
    Ok(a)
}

impl Uffd {
    /// Opens a userfaultfd with `want`, after probing which features the
    /// kernel offers (a feature it does not know fails the handshake, and a
    /// descriptor takes only one handshake, hence the probe descriptor).
    ///
    /// # Errors
    /// [`UffdError::NotPermitted`] (with what to change),
    /// [`UffdError::Unsupported`], or [`UffdError::MissingFeatures`].
    pub fn open(mode: OpenMode, want: Features) -> Result<Uffd, UffdError> {
        // Kept from the moment they exist (`zmem_common::host::fds`): a pager may
        // start while another thread of the program closes descriptors.
        let mut user_mode_only = false;
        let mut kept = || {
            let busy = UffdError::Unsupported(Errno::AGAIN);
            zmem_common::host::fds::open_kept(zmem_common::host::fds::Wait::Yes, busy, || {
                open_raw(mode).map(|(fd, user)| {
                    user_mode_only = user;
                    fd
                })
            })
        };
        let probe = kept()?;
        let offered = api(&probe, 0).map_err(UffdError::Unsupported)?.features;
        drop(probe);
        if offered & want.0 != want.0 {
            return Err(UffdError::MissingFeatures { missing: want.0 & !offered, offered });
        }
        let fd = kept()?;
        let a = api(&fd, want.0).map_err(UffdError::Unsupported)?;
        Ok(Uffd { fd, features: Features(a.features), ioctls: a.ioctls, user_mode_only })
    }

    /// Whether this descriptor serves faults from user mode only
    /// (`UFFD_USER_MODE_ONLY`): a system call that reads or writes a
    /// registered page not present then fails with EFAULT. False for a
    /// descriptor [`handed_over`](Self::handed_over), whose mode is not
    /// known here (its parent's pager reported it).
    pub fn user_mode_only(&self) -> bool {
        self.user_mode_only
    }

    /// The child's userfaultfd from a [`Event::Fork`] of this one. The
    /// kernel made it with this one's features, already past the API
    /// handshake (a second one fails), and copied every registration of
    /// the parent's mappings into it: the child's faults come to it from
    /// the moment of fork, whoever holds it.
    pub fn forked(&self, child: zmem_common::host::fds::KeptFd) -> Uffd {
        Uffd { fd: child, features: self.features, ioctls: self.ioctls, user_mode_only: self.user_mode_only }
    }

    /// A userfaultfd handed over by another process (a forked child gets
    /// its own from its parent, which read the FORK event), with the
    /// features and ioctls the parent's had.
    pub fn handed_over(fd: OwnedFd, features: Features, ioctls: u64) -> Uffd {
        // The parent's mode is not handed over; it warned, if it had to.
        Uffd { fd: zmem_common::host::fds::KeptFd::new(fd), features, ioctls, user_mode_only: false }
    }

    /// The features in force (what was asked for; the kernel may add more).
    pub fn features(&self) -> Features {
        self.features
    }

    /// What the kernel offers, probed on a throwaway descriptor.
    ///
    /// # Errors
    /// As [`Uffd::open`].
    pub fn offered(mode: OpenMode) -> Result<Features, UffdError> {
        let (probe, _) = open_raw(mode)?;
        Ok(Features(api(&probe, 0).map_err(UffdError::Unsupported)?.features))
    }

    pub fn api_ioctls(&self) -> u64 {
        self.ioctls
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn err(op: &'static str, addr: u64, len: u64) -> impl Fn(Errno) -> UffdError {
        move |errno| UffdError::Ioctl { op, addr, len, errno }
    }

    /// Registers `[addr, addr + len)` (page-aligned, an anonymous mapping).
    /// Returns the ioctls the range supports.
    ///
    /// # Errors
    /// The ioctl's error (EINVAL for a bad range or mode).
    pub fn register(&self, addr: u64, len: u64, mode: RegisterMode) -> Result<u64, UffdError> {
        let mut m = 0;
        if mode.missing {
            m |= u64::from(uapi::UFFDIO_REGISTER_MODE_MISSING);
        }
        if mode.wp {
            m |= u64::from(uapi::UFFDIO_REGISTER_MODE_WP);
        }
        let mut r = uapi::uffdio_register { range: uapi::uffdio_range { start: addr, len }, mode: m, ioctls: 0 };
        // SAFETY: UFFDIO_REGISTER reads and writes one struct uffdio_register;
        // registering changes how faults are served, not any memory.
        unsafe { call::<{ nr::UFFDIO_REGISTER }, _>(self.fd.as_fd(), &mut r) }.map_err(Self::err(
            "UFFDIO_REGISTER",
            addr,
            len,
        ))?;
        Ok(r.ioctls)
    }

    /// # Errors
    /// The ioctl's error.
    pub fn unregister(&self, addr: u64, len: u64) -> Result<(), UffdError> {
        let mut r = uapi::uffdio_range { start: addr, len };
        // SAFETY: UFFDIO_UNREGISTER reads one struct uffdio_range.
        unsafe { call::<{ nr::UFFDIO_UNREGISTER }, _>(self.fd.as_fd(), &mut r) }.map_err(Self::err(
            "UFFDIO_UNREGISTER",
            addr,
            len,
        ))
    }

    /// Copies `len` bytes from `src` into the registered, missing range at
    /// `dst`, and wakes the threads faulting there (unless `dontwake`).
    /// Returns the bytes the kernel copied; a page that is already present
    /// (EEXIST) ends the copy early and counts as resolved.
    ///
    /// # Errors
    /// [`UffdError::Again`] while an event is unread; the ioctl's error other
    /// than EEXIST.
    ///
    /// # Safety
    /// 1. `src` is valid for reads of `len` bytes;
    /// 2. no Rust reference covers `[dst, dst + len)` (the kernel writes it).
    pub unsafe fn copy(&self, dst: u64, src: *const u8, len: u64, dontwake: bool) -> Result<u64, UffdError> {
        // SAFETY: the caller's contract is copy_wp's.
        unsafe { self.copy_wp(dst, src, len, dontwake, false) }
    }

    /// [`Uffd::copy`], mapping the pages write-protected when `wp` (the
    /// range must be registered in WP mode); with `WP_ASYNC` the first write
    /// unprotects a page without a message, which write tracking then sees.
    ///
    /// # Errors
    /// As [`Uffd::copy`].
    ///
    /// # Safety
    /// As [`Uffd::copy`].
    pub unsafe fn copy_wp(
        &self,
        dst: u64,
        src: *const u8,
        len: u64,
        dontwake: bool,
        wp: bool,
    ) -> Result<u64, UffdError> {
        let mut mode = if dontwake { u64::from(uapi::UFFDIO_COPY_MODE_DONTWAKE) } else { 0 };
        if wp {
            mode |= u64::from(uapi::UFFDIO_COPY_MODE_WP);
        }
        self.fill("UFFDIO_COPY", dst, len, dontwake, |done| {
            let mut c = uapi::uffdio_copy { dst: dst + done, src: src as u64 + done, len: len - done, mode, copy: 0 };
            // SAFETY: one struct uffdio_copy in and out; the caller's
            // contract covers the memory the kernel reads and writes.
            let r = unsafe { call::<{ nr::UFFDIO_COPY }, _>(self.fd.as_fd(), &mut c) };
            (r, c.copy)
        })
    }

    /// The progress loop of COPY and ZEROPAGE: `step(done)` issues the ioctl
    /// for what is left and returns its result and the kernel's byte count.
    fn fill(
        &self,
        op: &'static str,
        dst: u64,
        len: u64,
        dontwake: bool,
        mut step: impl FnMut(u64) -> (rustix::io::Result<()>, i64),
    ) -> Result<u64, UffdError> {
        let mut done = 0;
        while done < len {
            let (r, n) = step(done);
            let progress = n > 0;
            if progress {
                done += n as u64;
            }
            match r {
                Ok(()) => {}
                Err(Errno::AGAIN) if progress => continue,
                Err(Errno::AGAIN) => return Err(UffdError::Again { done }),
                Err(Errno::EXIST) => {
                    if !dontwake {
                        self.wake(dst, len)?;
                    }
                    return Ok(done);
                }
                Err(e) => return Err(Self::err(op, dst + done, len - done)(e)),
            }
        }
        Ok(done)
    }

    /// Maps the zero page over `[dst, dst + len)` and wakes the faulting
    /// threads (unless `dontwake`). EEXIST counts as resolved, as for COPY.
    ///
    /// # Errors
    /// The ioctl's error, other than EAGAIN and EEXIST.
    ///
    /// # Safety
    /// No Rust reference covers `[dst, dst + len)`.
    pub unsafe fn zeropage(&self, dst: u64, len: u64, dontwake: bool) -> Result<u64, UffdError> {
        let mode = if dontwake { u64::from(uapi::UFFDIO_ZEROPAGE_MODE_DONTWAKE) } else { 0 };
        self.fill("UFFDIO_ZEROPAGE", dst, len, dontwake, |done| {
            let mut z = uapi::uffdio_zeropage {
                range: uapi::uffdio_range { start: dst + done, len: len - done },
                mode,
                zeropage: 0,
            };
            // SAFETY: one struct uffdio_zeropage in and out; the caller's
            // contract covers the range the kernel maps.
            let r = unsafe { call::<{ nr::UFFDIO_ZEROPAGE }, _>(self.fd.as_fd(), &mut z) };
            (r, z.zeropage)
        })
    }

    /// Moves the pages of `[src, src + len)` to the missing range at `dst`
    /// (registered with this userfaultfd), atomically and without copying;
    /// `src` then faults as missing. With `allow_holes`, unpopulated source
    /// pages are skipped (and the destination stays missing there).
    /// Returns the bytes moved.
    ///
    /// # Errors
    /// The ioctl's error other than EAGAIN: EBUSY for pages that are shared
    /// (after fork) or pinned, EEXIST if `dst` is populated.
    ///
    /// # Safety
    /// No Rust reference covers `[src, src + len)` or `[dst, dst + len)`.
    pub unsafe fn move_pages(&self, dst: u64, src: u64, len: u64, allow_holes: bool) -> Result<u64, UffdError> {
        // SAFETY: the caller's contract is this function's.
        unsafe { self.move_inner(dst, src, len, allow_holes, false) }
    }

    /// As [`move_pages`](Self::move_pages) without holes allowed, but a
    /// missing source page ends the move (ENOENT) and reports how far it got:
    /// the page at `src + returned` is a hole (if `returned < len`).
    ///
    /// # Errors
    /// As [`move_pages`](Self::move_pages).
    ///
    /// # Safety
    /// As [`move_pages`](Self::move_pages).
    pub unsafe fn move_until_hole(&self, dst: u64, src: u64, len: u64) -> Result<u64, UffdError> {
        // SAFETY: the caller's contract is this function's.
        unsafe { self.move_inner(dst, src, len, false, true) }
    }

    /// # Safety
    /// As [`move_pages`](Self::move_pages).
    unsafe fn move_inner(
        &self,
        dst: u64,
        src: u64,
        len: u64,
        allow_holes: bool,
        stop_at_hole: bool,
    ) -> Result<u64, UffdError> {
        let mode = if allow_holes { UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES } else { 0 };
        let mut done = 0;
        while done < len {
            let mut m = uapi::uffdio_move { dst: dst + done, src: src + done, len: len - done, mode, move_: 0 };
            // SAFETY: one struct uffdio_move in and out; the caller's
            // contract covers both ranges.
            let r = unsafe { call::<{ UFFDIO_MOVE }, _>(self.fd.as_fd(), &mut m) };
            let progress = m.move_ > 0;
            if progress {
                done += m.move_ as u64;
            }
            match r {
                Ok(()) => {}
                Err(Errno::AGAIN) if progress => continue,
                Err(Errno::AGAIN) => return Err(UffdError::Again { done }),
                Err(Errno::NOENT) if stop_at_hole => return Ok(done),
                Err(e) => return Err(Self::err("UFFDIO_MOVE", src + done, len - done)(e)),
            }
        }
        Ok(done)
    }

    /// Marks the missing range `[dst, dst + len)` poisoned: a thread that
    /// touches it gets SIGBUS (as for a hardware memory error), never data.
    /// Wakes the threads faulting there. Needs [`Features::POISON`].
    ///
    /// # Errors
    /// [`UffdError::Again`] while an event is unread; the ioctl's error
    /// other than EEXIST (a page already present counts as resolved).
    pub fn poison(&self, dst: u64, len: u64) -> Result<u64, UffdError> {
        self.fill("UFFDIO_POISON", dst, len, false, |done| {
            let mut p = uapi::uffdio_poison {
                range: uapi::uffdio_range { start: dst + done, len: len - done },
                mode: 0,
                updated: 0,
            };
            // SAFETY: one struct uffdio_poison in and out; poisoning installs
            // a marker in a missing page-table entry and writes no memory.
            let r = unsafe { call::<{ UFFDIO_POISON }, _>(self.fd.as_fd(), &mut p) };
            (r, p.updated)
        })
    }

    /// Write-protects (or unprotects) `[addr, addr + len)`; unprotecting
    /// wakes the threads blocked on it unless `dontwake`.
    ///
    /// # Errors
    /// The ioctl's error other than EAGAIN (retried).
    pub fn writeprotect(&self, addr: u64, len: u64, protect: bool, dontwake: bool) -> Result<(), UffdError> {
        let mut mode = 0;
        if protect {
            mode |= UFFDIO_WRITEPROTECT_MODE_WP;
        }
        if dontwake {
            mode |= UFFDIO_WRITEPROTECT_MODE_DONTWAKE;
        }
        loop {
            let mut w = uapi::uffdio_writeprotect { range: uapi::uffdio_range { start: addr, len }, mode };
            // SAFETY: one struct uffdio_writeprotect in; protection changes
            // no memory contents.
            match unsafe { call::<{ nr::UFFDIO_WRITEPROTECT }, _>(self.fd.as_fd(), &mut w) } {
                Ok(()) => return Ok(()),
                Err(Errno::AGAIN) => continue,
                Err(e) => return Err(Self::err("UFFDIO_WRITEPROTECT", addr, len)(e)),
            }
        }
    }

    /// Wakes the threads faulting in `[addr, addr + len)` (they retry).
    ///
    /// # Errors
    /// The ioctl's error.
    pub fn wake(&self, addr: u64, len: u64) -> Result<(), UffdError> {
        let mut r = uapi::uffdio_range { start: addr, len };
        // SAFETY: UFFDIO_WAKE reads one struct uffdio_range.
        unsafe { call::<{ nr::UFFDIO_WAKE }, _>(self.fd.as_fd(), &mut r) }.map_err(Self::err("UFFDIO_WAKE", addr, len))
    }

    /// Waits up to `timeout` (forever if `None`) for events to read.
    ///
    /// # Errors
    /// poll's error.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<bool, UffdError> {
        let mut fds = [rustix::event::PollFd::new(&self.fd, rustix::event::PollFlags::IN)];
        let ts = timeout
            .map(|d| rustix::event::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) });
        loop {
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(n) => return Ok(n > 0),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(UffdError::Read(e)),
            }
        }
    }

    /// Reads one pending event, if any (non-blocking), without allocating:
    /// the thread that reads a `UFFD_EVENT_FORK` must not, because fork
    /// waits for that read while glibc holds every malloc arena's lock
    /// (and a shim its own heap's) across the fork syscall.
    ///
    /// # Errors
    /// read's error, or a short message.
    pub fn read_event(&self) -> Result<Option<Event>, UffdError> {
        let _s = self.reading();
        let mut buf = [0u8; MSG_SIZE];
        match rustix::io::read(&self.fd, &mut buf) {
            Ok(MSG_SIZE) => Ok(Some(parse(&buf))),
            Ok(n) => Err(UffdError::ShortMessage(n)),
            Err(Errno::AGAIN) => Ok(None),
            Err(e) => Err(UffdError::Read(e)),
        }
    }

    /// Reads up to `out.capacity()` pending events into `out` (cleared
    /// first; non-blocking) with no allocation: a handler that may read a
    /// FORK event calls it with room made beforehand (see
    /// [`read_event`](Self::read_event) for why).
    ///
    /// # Errors
    /// read's error, or a short message.
    pub fn read_events_into(&self, out: &mut Vec<Event>) -> Result<(), UffdError> {
        const MAX: usize = 64;
        out.clear();
        let mut buf = [0u8; MSG_SIZE * MAX];
        let max = out.capacity().clamp(1, MAX);
        let _s = self.reading();
        let n = match rustix::io::read(&self.fd, &mut buf[..MSG_SIZE * max]) {
            Ok(n) => n,
            Err(Errno::AGAIN) => return Ok(()),
            Err(e) => return Err(UffdError::Read(e)),
        };
        if n % MSG_SIZE != 0 {
            return Err(UffdError::ShortMessage(n));
        }
        out.extend(buf[..n].chunks_exact(MSG_SIZE).map(parse));
        Ok(())
    }

    /// With FORK events on, a read may put a child's userfaultfd into this
    /// process's descriptor table: it is read inside a section
    /// (`zmem_common::host::fds`), so that the program's `close_range` cannot close
    /// it before the event is kept, where one can be entered at once (a
    /// handler never waits).
    fn reading(&self) -> Option<zmem_common::host::fds::Section> {
        if self.features.0 & Features::EVENT_FORK.0 == 0 {
            return None;
        }
        zmem_common::host::fds::Section::try_enter()
    }

    /// Reads the pending events (non-blocking: none pending is an empty vec).
    ///
    /// # Errors
    /// read's error, or a short message.
    pub fn read_events(&self, max: usize) -> Result<Vec<Event>, UffdError> {
        let mut buf = vec![0u8; MSG_SIZE * max.max(1)];
        let _s = self.reading();
        let n = match rustix::io::read(&self.fd, &mut buf) {
            Ok(n) => n,
            Err(Errno::AGAIN) => return Ok(Vec::new()),
            Err(e) => return Err(UffdError::Read(e)),
        };
        if n % MSG_SIZE != 0 {
            return Err(UffdError::ShortMessage(n));
        }
        Ok(buf[..n].chunks_exact(MSG_SIZE).map(parse).collect())
    }
}

fn u64_at(m: &[u8], off: usize) -> u64 {
    u64::from_ne_bytes(m[off..off + 8].try_into().expect("8 bytes"))
}

/// Decodes one `struct uffd_msg` (event at byte 0, the argument union at 8).
fn parse(m: &[u8]) -> Event {
    match u32::from(m[0]) {
        uapi::UFFD_EVENT_PAGEFAULT => {
            let flags = u64_at(m, 8);
            Event::PageFault {
                addr: u64_at(m, 16),
                write: flags & u64::from(uapi::UFFD_PAGEFAULT_FLAG_WRITE) != 0,
                wp: flags & u64::from(uapi::UFFD_PAGEFAULT_FLAG_WP) != 0,
                minor: flags & u64::from(uapi::UFFD_PAGEFAULT_FLAG_MINOR) != 0,
                thread_id: u32::from_ne_bytes(m[24..28].try_into().expect("4 bytes")),
            }
        }
        uapi::UFFD_EVENT_FORK => {
            let raw = u32::from_ne_bytes(m[8..12].try_into().expect("4 bytes")) as i32;
            // SAFETY: the kernel installed this descriptor in our table for
            // the child's userfaultfd and hands its ownership to the reader.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            // Kept at once, inside the reader's section where it has one
            // (`Uffd::reading`).
            Event::Fork { uffd: zmem_common::host::fds::KeptFd::new(fd) }
        }
        uapi::UFFD_EVENT_REMAP => Event::Remap { from: u64_at(m, 8), to: u64_at(m, 16), len: u64_at(m, 24) },
        uapi::UFFD_EVENT_REMOVE => Event::Remove { start: u64_at(m, 8), end: u64_at(m, 16) },
        uapi::UFFD_EVENT_UNMAP => Event::Unmap { start: u64_at(m, 8), end: u64_at(m, 16) },
        other => Event::Unknown(other as u8),
    }
}
