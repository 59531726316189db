//! Descriptors zmem keeps open for as long as a pager lives: its
//! userfaultfd, its swap file, and its `/proc/self/pagemap` and `statm`
//! readers.
//!
//! A program that closes every descriptor it did not open (a daemon's
//! `closefrom(3)`, Python's `os.closerange`) would close them under the
//! pager. The kernel would then drop the userfaultfd's registrations
//! (evicted pages would read as zeros), and the numbers would go to the
//! program's next files, which zmem would then read and write. Python
//! crashed at once (SIGSEGV) after `os.closerange(3, 4096)`. So the shim's
//! `close`, `close_range` and `closefrom` step over the descriptors kept
//! here, as if the program had never had them.
//!
//! A fixed table of atomics: `close` looks here on every call, from any
//! thread, before the shim has started too.
//!
//! # Opening and closing beside the program's close
//!
//! A descriptor zmem opens while the program runs (the handler's
//! `/proc/self/task/TID/stat`, a scan's `/proc/self/maps`, the stats
//! thread's temporary file) is not in the table between `open` and
//! [`keep`], nor between [`forget`] and `close`. A `close_range` of the
//! program's in that window closed it: zmem then read the program's next
//! file under that number, or closed it, and a debug build aborted ("owned
//! file descriptor already closed", 1 run in 6 or so of the `run` test
//! `closing_every_descriptor_keeps_zmems_own_and_every_block`). So zmem
//! opens and closes only inside a *section* ([`open_kept`], [`KeptFd`]'s
//! drop, [`read_to_string`]) and the shim's `close` family runs inside
//! [`closing`]: a section is entered only while no close runs, and a close
//! waits for the sections under way to end. Both are short (a syscall or
//! two). Neither side waits for the other to make progress it cannot make:
//! the handler waits at most 20 µs to enter (a section it cannot enter is
//! skipped or left to later, see [`Wait::No`]), so a program thread that
//! faults inside [`closing`] is still served.

use std::cell::Cell;
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Descriptors kept at once: a pager keeps about five.
pub const SLOTS: usize = 64;

static KEPT: [AtomicI32; SLOTS] = [const { AtomicI32::new(-1) }; SLOTS];

/// Keeps `fd` from the program's `close` family until [`forget`]. Each
/// keep takes a slot, and each forget frees one: a number is listed as
/// often as it was kept.
pub fn keep(fd: RawFd) {
    if fd < 0 {
        return;
    }
    if KEPT.iter().any(|s| s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed).is_ok()) {
        return;
    }
    log::warn!("more than {SLOTS} descriptors kept: descriptor {fd} is not protected from the program's close");
}

/// Descriptors kept for the process's whole life, pager or not: the
/// process tree's segment, inherited from `zmem run`. A forked child that
/// abandons its parent's pager ([`take_all`]) keeps these.
static FOR_GOOD: [AtomicI32; 4] = [const { AtomicI32::new(-1) }; 4];

/// Keeps `fd` from the program's `close` family for good (see
/// `FOR_GOOD`); a no-op if it is kept already.
pub fn keep_for_good(fd: RawFd) {
    if fd < 0 || is_kept(fd) {
        return;
    }
    if !FOR_GOOD.iter().any(|s| s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed).is_ok()) {
        log::warn!("descriptor {fd} is not protected from the program's close");
    }
}

/// Lets the program's `close` family reach `fd` again (zmem is about to
/// close it itself).
pub fn forget(fd: RawFd) {
    for s in &KEPT {
        if s.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            return;
        }
    }
}

/// Whether `fd` is one zmem keeps.
pub fn is_kept(fd: RawFd) -> bool {
    fd >= 0 && KEPT.iter().chain(&FOR_GOOD).any(|s| s.load(Ordering::Acquire) == fd)
}

/// The kept descriptors, sorted, in `out`; returns how many.
pub fn kept(out: &mut [RawFd; SLOTS]) -> usize {
    let mut n = 0;
    for s in KEPT.iter().chain(&FOR_GOOD) {
        let fd = s.load(Ordering::Acquire);
        if fd >= 0 && n < out.len() {
            out[n] = fd;
            n += 1;
        }
    }
    out[..n].sort_unstable();
    n
}

/// Empties the table (not the descriptors kept for good) into `out` and
/// returns how many there were: in a
/// forked child, the parent's pager's descriptors, which the child closes
/// as it abandons that pager (the program's own files may get those
/// numbers next, and must be its to close).
pub fn take_all(out: &mut [RawFd; SLOTS]) -> usize {
    // The deferred ones are in the table too: they go with it.
    for s in &DEFERRED {
        s.store(-1, Ordering::Release);
    }
    let mut n = 0;
    for s in &KEPT {
        let fd = s.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            out[n] = fd;
            n += 1;
        }
    }
    n
}

/// zmem's sections under way (see the module's doc): the pid of the
/// process they run in (high 32 bits) and their count (low 32 bits). A
/// count under another pid is not this process's to wait for: in a child
/// forked with the raw syscall (no atfork handler, so no
/// [`reset_in_child`]) it is the parent's, which none of the child's threads
/// will ever take back; in a vfork child (memory shared, descriptor table
/// not) it is the parent's live one, whose descriptors the child's closes
/// cannot reach.
static OPENING: AtomicU64 = AtomicU64::new(0);
/// The program's closes under way.
static CLOSING: AtomicU32 = AtomicU32::new(0);

fn pid_of(v: u64) -> i32 {
    (v >> 32) as i32
}

fn count_of(v: u64) -> u32 {
    v as u32
}

fn packed(pid: i32, count: u32) -> u64 {
    (u64::from(pid as u32) << 32) | u64::from(count)
}

fn getpid() -> i32 {
    // SAFETY: getpid has no preconditions and touches no memory.
    unsafe { libc::getpid() }
}

/// This process's pid as its sections tag their count: asked once (a
/// syscall: the handler enters a section for every read of its events
/// when FORK events are on), and again in a child by [`reset_in_child`].
/// A child forked without atfork handlers tags with its parent's pid,
/// which its closes do not wait for: it loses the exclusion, never hangs.
static SECTION_PID: AtomicI32 = AtomicI32::new(0);

fn section_pid() -> i32 {
    match SECTION_PID.load(Ordering::Relaxed) {
        0 => {
            let me = getpid();
            SECTION_PID.store(me, Ordering::Relaxed);
            me
        }
        me => me,
    }
}

thread_local! {
    /// This thread's sections: a `close` it makes inside one (a std
    /// `File` dropped there) must not wait for its own section to end.
    static IN_SECTION: Cell<u32> = const { Cell::new(0) };
}

/// Kept descriptors whose owner was dropped while a close of the program's
/// ran: the next section closes them.
static DEFERRED: [AtomicI32; 16] = [const { AtomicI32::new(-1) }; 16];

/// How long a section waits to be entered with [`Wait::Yes`].
const WAIT_FOR: Duration = Duration::from_secs(1);
/// ... and with [`Wait::No`]: a close's syscall, not a close that faults.
const WAIT_BRIEFLY: Duration = Duration::from_micros(20);

/// Whether to wait for the program's closes under way to end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Up to a second (background threads).
    Yes,
    /// Only a few microseconds, spinning (the handler: the closing thread
    /// may be waiting for it to serve a fault).
    No,
}

/// A section entered: no close of the program's runs until it is dropped.
/// Inside one, make descriptors and [`keep`] them, or close kept ones and
/// [`forget`] them; nothing else (no fault on the program's memory, no
/// wait for another thread).
#[derive(Debug)]
pub struct Section {
    pid: i32,
}

impl Section {
    /// Enters a section, waiting as `wait` says for the program's closes
    /// under way to end; `None` if they did not in time.
    ///
    /// A section claims its place first and then waits; a close that
    /// finds a claim backs off (`closing`). So a program that closes
    /// descriptors one by one in a tight loop (a daemon's `for fd in 3..N`)
    /// lets zmem in between two closes: it waits at most for one.
    pub fn enter(wait: Wait) -> Option<Section> {
        let me = section_pid();
        // SeqCst on both sides (here and in `closing`): of a section and a
        // close that start together, at least one sees the other's claim.
        let _ = OPENING.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
            Some(if pid_of(v) == me { v + 1 } else { packed(me, 1) })
        });
        let section = Section { pid: me };
        if IN_SECTION.get() == 0 {
            let limit = match wait {
                Wait::Yes => WAIT_FOR,
                Wait::No => WAIT_BRIEFLY,
            };
            // The clock is read only once a close is seen: a section is
            // entered on every read of the userfaultfd, and mostly finds none.
            let mut start = None;
            let mut spins = 0u32;
            while CLOSING.load(Ordering::SeqCst) != 0 {
                if start.get_or_insert_with(Instant::now).elapsed() >= limit {
                    section.release();
                    std::mem::forget(section);
                    return None;
                }
                spins += 1;
                if spins < 64 || wait == Wait::No {
                    std::hint::spin_loop();
                } else if spins < 256 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
        }
        IN_SECTION.set(IN_SECTION.get() + 1);
        close_deferred();
        Some(section)
    }

    /// Enters a section only if no close of the program's runs now.
    pub fn try_enter() -> Option<Section> {
        Section::enter(Wait::No)
    }

    /// Takes this section's claim back, if the count is still this
    /// process's (a vfork child's section may have taken it over).
    fn release(&self) {
        let me = self.pid;
        let _ = OPENING.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
            (pid_of(v) == me).then(|| packed(me, count_of(v).saturating_sub(1)))
        });
    }
}

impl Drop for Section {
    fn drop(&mut self) {
        IN_SECTION.set(IN_SECTION.get() - 1);
        self.release();
    }
}

/// Runs `f`, the program's close of descriptors (the shim's `close`
/// family), once zmem's sections under way in this process have ended,
/// and keeps new ones from starting until it returns. `f` must not wait
/// for zmem.
pub fn closing<R>(f: impl FnOnce() -> R) -> R {
    if IN_SECTION.get() != 0 {
        // zmem's own close inside one of its sections: nothing to wait for.
        return f();
    }
    let mut me = None;
    let mut spins = 0u32;
    loop {
        CLOSING.fetch_add(1, Ordering::SeqCst);
        let v = OPENING.load(Ordering::SeqCst);
        // Only with a claim seen: no syscall on the way of every close.
        if count_of(v) == 0 || pid_of(v) != *me.get_or_insert_with(getpid) {
            break;
        }
        // A section of this process has claimed its place: it goes first.
        dec(&CLOSING);
        loop {
            let v = OPENING.load(Ordering::SeqCst);
            if count_of(v) == 0 || Some(pid_of(v)) != me {
                break;
            }
            spins += 1;
            if spins < 128 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
    let r = f();
    dec(&CLOSING);
    r
}

/// Takes one from the count of closes, never below 0 (a child's reset
/// must not make it wrap, and keep every section waiting).
fn dec(count: &AtomicU32) {
    let _ = count.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| Some(v.saturating_sub(1)));
}

/// In a forked child, whose only thread is the one that forked: the
/// sections and closes that other threads of the parent had under way are
/// not in it.
pub fn reset_in_child() {
    SECTION_PID.store(getpid(), Ordering::Relaxed);
    OPENING.store(0, Ordering::SeqCst);
    CLOSING.store(0, Ordering::SeqCst);
    IN_SECTION.set(0);
}

/// Closes `fd` with the syscall, not the shim's `close` (which would see it
/// kept, or wait for this thread's own section).
/// `fd` moved above the standard streams' numbers (0, 1 and 2) if it got
/// one of them. A program makes one of them free and expects it back
/// from its next open or `dup2` (dash, for a background job, does
/// `close(0)` then opens `/dev/null`, and `close(1)` then `dup2(3, 1)`;
/// a daemon closes all three and opens `/dev/null` thrice). A zmem thread
/// that opened a file in between held that number for good: in the `run`
/// tests (CI, once) a forked shell's `dup2` went over such a descriptor,
/// zmem later closed what was the job's stdout, and the `head` it then
/// started found zmem's read-only file at its descriptor 1 ("head: write
/// error: Bad file descriptor"). Moved at once, inside the section (the
/// shim's `dup2` waits for it, as its `close` does), the number is free
/// again two system calls later.
fn above_std_streams(fd: OwnedFd) -> OwnedFd {
    use std::os::fd::{FromRawFd, IntoRawFd};
    let raw = fd.as_raw_fd();
    if raw > 2 {
        return fd;
    }
    // SAFETY: a new descriptor for the open file `raw` (ours), close on
    // exec, at 3 or above; no memory is touched.
    let high = unsafe { libc::fcntl(raw, libc::F_DUPFD_CLOEXEC, 3) };
    if high < 0 {
        // Out of descriptors: the low number is better than none.
        return fd;
    }
    close_raw(fd.into_raw_fd());
    // SAFETY: `high` was just made, and nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(high) }
}

fn close_raw(fd: RawFd) {
    // SAFETY: fd is a descriptor zmem owns and closes once (the caller's);
    // close(2) touches no memory.
    unsafe { libc::syscall(libc::SYS_close, fd) };
}

fn close_deferred() {
    // Looked at before it is taken: every section (the handler's reads of
    // its events among them) passes here, and the slots are nearly always
    // empty.
    for s in DEFERRED.iter().filter(|s| s.load(Ordering::Relaxed) >= 0) {
        let fd = s.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            forget(fd);
            close_raw(fd);
        }
    }
}

/// Opens a descriptor with `open` and keeps it, with no close of the
/// program's in between; `busy` where the program's closes kept the
/// section from starting (`wait`).
///
/// # Errors
/// `open`'s, or `busy`.
pub fn open_kept<E>(wait: Wait, busy: E, open: impl FnOnce() -> Result<OwnedFd, E>) -> Result<KeptFd, E> {
    let Some(_s) = Section::enter(wait) else { return Err(busy) };
    open().map(KeptFd::new)
}

/// Opens `path` read-only and keeps the descriptor for the rest of the
/// process's life ([`keep_for_good`]), with no close of the program's in
/// between: a `/proc` file read after the program changed its root, when
/// its path leads nowhere. A forked child inherits it as it is (close on
/// exec): it is still the parent's file.
///
/// # Errors
/// Opening the file, or [`std::io::ErrorKind::WouldBlock`] if the
/// program's closes kept it from being opened.
pub fn open_for_good(path: &std::path::Path) -> std::io::Result<RawFd> {
    let Some(_s) = Section::enter(Wait::Yes) else { return Err(std::io::ErrorKind::WouldBlock.into()) };
    let fd = std::os::fd::IntoRawFd::into_raw_fd(above_std_streams(std::fs::File::open(path)?.into()));
    keep_for_good(fd);
    Ok(fd)
}

/// Reads what a file kept open (`open_for_good`) holds now, from its
/// start (`pread`, which moves no file position: any zmem thread may read
/// it), as text.
///
/// # Errors
/// Reading the file.
pub fn pread_to_string(fd: RawFd) -> std::io::Result<String> {
    read_text(fd, true)
}

/// What `fd` reads as, to its end, as text: from its start with `pread`
/// where `positioned`, else from where it is with `read`.
fn read_text(fd: RawFd, positioned: bool) -> std::io::Result<String> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = if positioned {
            // SAFETY: buf is writable for its length; fd is open (the
            // caller's contract).
            unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), out.len() as libc::off_t) }
        } else {
            // SAFETY: as above.
            unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) }
        };
        match n {
            0 => break,
            n if n > 0 => out.extend_from_slice(&buf[..n as usize]),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    String::from_utf8(out).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// A whole file as text, read through a kept descriptor: for the files
/// zmem's threads read while the program runs (`/proc/self/statm`,
/// `/proc/PID/stat`).
///
/// # Errors
/// Opening or reading the file, or [`std::io::ErrorKind::WouldBlock`] if
/// the program's closes kept it from being opened (`wait`).
pub fn read_to_string(wait: Wait, path: &std::path::Path) -> std::io::Result<String> {
    let busy = std::io::ErrorKind::WouldBlock.into();
    let fd = open_kept(wait, busy, || std::fs::File::open(path).map(OwnedFd::from))?;
    read_text(fd.as_raw_fd(), false)
}

/// The names in a directory (`.` and `..` left out), read through a kept
/// descriptor with `getdents64`, which opens nothing more: for the
/// directories zmem's threads list while the program runs
/// (`/proc/self/task`, a stats directory). `std::fs::read_dir`'s
/// descriptor was the program's to close: the BEAM closed it under the
/// stats thread, whose `closedir` then failed with EBADF, and std
/// panics at that; with the number reused, it would have closed the
/// program's file.
///
/// # Errors
/// Opening or reading the directory, or
/// [`std::io::ErrorKind::WouldBlock`] if the program's closes kept it from
/// being opened (`wait`).
pub fn dir_names(wait: Wait, path: &std::path::Path) -> std::io::Result<Vec<std::ffi::OsString>> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::OpenOptionsExt;
    let busy = std::io::ErrorKind::WouldBlock.into();
    let fd = open_kept(wait, busy, || {
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY).open(path).map(OwnedFd::from)
    })?;
    let mut names = Vec::new();
    // 8-byte aligned, as `struct linux_dirent64` is.
    let mut buf = vec![0u64; 1024];
    loop {
        // SAFETY: buf is writable for its length in bytes; fd is open
        // (kept) and a directory.
        let n = unsafe { libc::syscall(libc::SYS_getdents64, fd.as_raw_fd(), buf.as_mut_ptr(), buf.len() * 8) };
        if n == 0 {
            return Ok(names);
        }
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: the kernel filled n bytes of buf, which lives on.
        let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), n as usize) };
        let mut at = 0;
        // Each record: d_ino (8), d_off (8), d_reclen (2), d_type (1),
        // then the name, NUL-terminated, within d_reclen.
        while at + 19 <= bytes.len() {
            let reclen = u16::from_ne_bytes([bytes[at + 16], bytes[at + 17]]) as usize;
            let Some(rec) = bytes.get(at + 19..at + reclen) else { break };
            let name = &rec[..rec.iter().position(|&b| b == 0).unwrap_or(rec.len())];
            if name != b"." && name != b".." {
                names.push(std::ffi::OsStr::from_bytes(name).to_os_string());
            }
            at += reclen.max(1);
        }
    }
}

/// An [`OwnedFd`] kept ([`keep`]) for as long as it lives; dropping it
/// closes it in a section (or leaves it to the next one, kept until then).
#[derive(Debug)]
pub struct KeptFd(ManuallyDrop<OwnedFd>);

impl KeptFd {
    /// Keeps `fd`, opened where no close of the program's can run (the
    /// shim's start-up, a forked child's only thread, inside a
    /// [`Section`]); elsewhere use [`open_kept`].
    pub fn new(fd: OwnedFd) -> KeptFd {
        let fd = above_std_streams(fd);
        keep(fd.as_raw_fd());
        KeptFd(ManuallyDrop::new(fd))
    }

    /// The descriptor, no longer kept: the program's `close` reaches it
    /// again. Only where no close of the program's can run (a forked
    /// child's only thread).
    pub fn into_owned(self) -> OwnedFd {
        let mut me = ManuallyDrop::new(self);
        forget(me.0.as_raw_fd());
        // SAFETY: `me` is never dropped (ManuallyDrop), so the OwnedFd is
        // taken out exactly once.
        unsafe { ManuallyDrop::take(&mut me.0) }
    }
}

/// Makes a pair of descriptors with `open` (a socketpair) and keeps both,
/// as [`open_kept`] does one.
///
/// # Errors
/// `open`'s, or `busy`.
pub fn open_kept_pair<E>(
    wait: Wait,
    busy: E,
    open: impl FnOnce() -> Result<(OwnedFd, OwnedFd), E>,
) -> Result<(KeptFd, KeptFd), E> {
    let Some(_s) = Section::enter(wait) else { return Err(busy) };
    open().map(|(a, b)| (KeptFd::new(a), KeptFd::new(b)))
}

impl Drop for KeptFd {
    fn drop(&mut self) {
        let fd = self.0.as_raw_fd();
        // Not the OwnedFd's drop: the shim's close would refuse a kept fd.
        // Never waits long: the handler drops these too.
        if let Some(_s) = Section::enter(Wait::No) {
            // Forgotten first: once closed, the number may go at once to
            // another zmem thread's open, in a section of its own, and be
            // kept by it.
            forget(fd);
            close_raw(fd);
            return;
        }
        // A close of the program's runs: still kept, closed by the next
        // section.
        if DEFERRED.iter().any(|s| s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed).is_ok()) {
            return;
        }
        // Every slot taken (16 drops during one close of the program's):
        // close now, with the window this module is there to shut open
        // again, rather than leak the descriptor.
        forget(fd);
        close_raw(fd);
    }
}

impl std::ops::Deref for KeptFd {
    type Target = OwnedFd;
    fn deref(&self) -> &OwnedFd {
        &self.0
    }
}

impl AsFd for KeptFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Writes go straight to the descriptor (wrap it in a `BufWriter`).
impl std::io::Write for KeptFd {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        // SAFETY: bytes is readable for its length; the descriptor is open
        // (kept) while self lives.
        let n = unsafe { libc::write(self.0.as_raw_fd(), bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for KeptFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dir_names_lists_a_directory_as_read_dir_does() {
        let d = std::env::temp_dir().join(format!("zmem-fds-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir(&d).unwrap();
        // Enough entries, with long names, to take several getdents64 calls.
        let mut want: Vec<std::ffi::OsString> =
            (0..600).map(|i| format!("{i:04}-{}", "x".repeat(i % 200)).into()).collect();
        for n in &want {
            std::fs::write(d.join(n), b"").unwrap();
        }
        let mut got = dir_names(Wait::Yes, &d).unwrap();
        got.sort();
        want.sort();
        assert_eq!(got, want);
        std::fs::remove_dir_all(&d).unwrap();
        assert!(dir_names(Wait::Yes, &d).is_err());
        let tasks = dir_names(Wait::Yes, std::path::Path::new("/proc/self/task")).unwrap();
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        assert!(tasks.contains(&me.to_string().into()), "{tasks:?}");
    }

    /// The table is the process's: `take_all` in one test empties what
    /// another test kept (12 runs in 40 failed with the tests in parallel).
    static TABLE: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn table() -> std::sync::MutexGuard<'static, ()> {
        TABLE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    #[test]
    fn a_kept_descriptor_is_listed_until_it_is_dropped() {
        let _t = table();
        let fd: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let raw = fd.as_raw_fd();
        assert!(!is_kept(raw));
        let k = KeptFd::new(fd);
        assert!(is_kept(raw));
        let mut out = [0; SLOTS];
        let n = kept(&mut out);
        assert!(out[..n].contains(&raw));
        drop(k);
        assert!(!is_kept(raw));
    }

    #[test]
    fn a_descriptor_kept_for_good_outlives_take_all() {
        let _t = table();
        let fd: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let raw = fd.as_raw_fd();
        keep_for_good(raw);
        let mut out = [0; SLOTS];
        let n = take_all(&mut out);
        assert!(!out[..n].contains(&raw));
        assert!(is_kept(raw));
        let n = kept(&mut out);
        assert!(out[..n].contains(&raw));
        for s in &FOR_GOOD {
            let _ = s.compare_exchange(raw, -1, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    fn is_dev_zero(fd: RawFd) -> bool {
        let zero = std::fs::metadata("/dev/zero").map(|m| std::os::unix::fs::MetadataExt::rdev(&m)).unwrap();
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: st is writable for one stat; fstat only writes it.
        let r = unsafe { libc::fstat(fd, st.as_mut_ptr()) };
        // SAFETY: fstat filled st when it returned 0.
        r == 0 && unsafe { st.assume_init() }.st_rdev == zero
    }

    /// What the shim's `close_range` does, against zmem threads that open
    /// and drop kept descriptors all the while: no descriptor of theirs is
    /// ever closed under them (it was, between open and keep, before
    /// sections), and none they drop is left open.
    #[test]
    fn a_program_closing_every_descriptor_never_closes_one_zmem_is_opening_or_dropping() {
        let _t = table();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let openers: Vec<_> = (0..2)
            .map(|_| {
                let stop = std::sync::Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        // Open, then give the CPU away before the keep: a
                        // handler preempted there, where the race was.
                        let open = || {
                            let f = std::fs::File::open("/dev/zero").map(OwnedFd::from);
                            std::thread::yield_now();
                            f
                        };
                        let busy = std::io::ErrorKind::WouldBlock.into();
                        let fd = open_kept(Wait::Yes, busy, open).expect("a section within a second");
                        std::thread::yield_now();
                        assert!(is_dev_zero(fd.as_raw_fd()), "a kept descriptor was closed under its owner");
                        drop(fd);
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let mut closed = 0;
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(1500) {
            closing(|| {
                for fd in 3..1024 {
                    if !is_kept(fd) && is_dev_zero(fd) {
                        close_raw(fd);
                        closed += 1;
                    }
                }
            });
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        let opened: u64 = openers.into_iter().map(|t| t.join().unwrap()).sum();
        assert!(opened > 100, "the openers made progress: {opened}");
        // Deferred ones are closed by the next section.
        drop(Section::try_enter());
        assert_eq!(closed, 0, "the program's close found zmem's descriptors unkept {closed} times");
        for fd in 3..1024 {
            assert!(!is_dev_zero(fd), "descriptor {fd} was dropped but left open");
        }
    }

    #[test]
    fn a_kept_descriptor_dropped_during_a_close_is_closed_by_the_next_section() {
        let _t = table();
        let busy = std::io::ErrorKind::WouldBlock.into();
        let fd = open_kept(Wait::No, busy, || std::fs::File::open("/dev/zero").map(OwnedFd::from)).unwrap();
        let raw = fd.as_raw_fd();
        closing(|| {
            assert!(Section::try_enter().is_none(), "no section while a close runs");
            drop(fd);
            assert!(is_kept(raw), "deferred, and kept meanwhile");
            assert!(is_dev_zero(raw));
        });
        drop(Section::try_enter().unwrap());
        assert!(!is_kept(raw));
        assert!(!is_dev_zero(raw));
    }

    /// Another thread enters a section and stays in it until the sender
    /// sends (or goes).
    fn a_section_on_another_thread() -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let s = Section::enter(Wait::Yes).unwrap();
            tx.send(()).unwrap();
            let _ = done_rx.recv();
            drop(s);
        });
        rx.recv().unwrap();
        (done_tx, holder)
    }

    /// A child forked with the raw syscall while another thread of the
    /// parent is in a section: no atfork handler resets the count, and the
    /// child's first close must not wait for a section that is not there.
    #[test]
    fn a_child_forked_without_atfork_handlers_is_not_held_up_by_its_parents_section() {
        let _t = table();
        let (done_tx, holder) = a_section_on_another_thread();
        // SAFETY: the child runs only closing (no allocation, no lock) and
        // _exit.
        let pid = unsafe { libc::syscall(libc::SYS_fork) } as libc::pid_t;
        if pid == 0 {
            closing(|| ());
            // SAFETY: ends the child.
            unsafe { libc::_exit(0) }
        }
        assert!(pid > 0);
        let start = Instant::now();
        let mut status = 0;
        let ended = loop {
            // SAFETY: our child; status is writable.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                break true;
            }
            if start.elapsed() > Duration::from_secs(10) {
                // SAFETY: our child, stuck.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                // SAFETY: reaps it.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                break false;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        done_tx.send(()).unwrap();
        holder.join().unwrap();
        assert!(ended, "the child's close waited for its parent's section");
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "status {status:#x}");
    }

    extern "C" fn vfork_child(_: *mut libc::c_void) -> libc::c_int {
        // SAFETY: alarm has no preconditions: a child stuck in `closing`
        // dies of SIGALRM instead of hanging its parent.
        unsafe { libc::alarm(10) };
        closing(|| ());
        0
    }

    /// CPython's subprocess closes descriptors in a vfork child, which
    /// shares zmem's counts with its parent but not its descriptors: its
    /// close neither waits for the parent's section nor disturbs its count.
    #[test]
    fn a_vfork_childs_close_neither_waits_for_nor_disturbs_its_parents_section() {
        let _t = table();
        let (done_tx, holder) = a_section_on_another_thread();
        let before = OPENING.load(Ordering::SeqCst);
        let mut stack = vec![0u8; 256 << 10];
        let top = stack.as_mut_ptr().wrapping_add(stack.len());
        // SAFETY: the child runs vfork_child on its own stack (the top of
        // `stack`, which outlives it: the parent waits, CLONE_VFORK) and
        // exits when it returns.
        let pid = unsafe {
            libc::clone(
                vfork_child,
                top.cast(),
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                std::ptr::null_mut(),
            )
        };
        assert!(pid > 0);
        let mut status = 0;
        // SAFETY: our child; status is writable.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        let after = OPENING.load(Ordering::SeqCst);
        done_tx.send(()).unwrap();
        holder.join().unwrap();
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "status {status:#x}");
        assert_eq!(after, before, "the parent's count is as it was");
        assert_eq!(count_of(before), 1);
        assert_eq!(CLOSING.load(Ordering::SeqCst), 0);
    }
}
