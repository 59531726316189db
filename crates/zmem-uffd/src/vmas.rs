//! The process's mappings, as the kernel sees them: the `PROCMAP_QUERY`
//! ioctl on `/proc/self/maps` (Linux 6.11), one call per mapping, with the
//! text of `/proc/self/maps` as the fallback on older kernels; and which of
//! them is a loaded ELF object's .bss ([`static_data`]).

use std::os::fd::{AsFd, BorrowedFd};

use rustix::io::Errno;
use rustix::ioctl::Opcode;
use zmem_common::host::fds::Wait;

use crate::sys::call;

/// `_IOWR('f', 17, struct procmap_query)` (104 bytes): Debian's headers
/// predate it, so it is spelled out from the kernel's uapi.
pub const PROCMAP_QUERY: Opcode = 0xC068_6611;
const QUERY_COVERING_OR_NEXT_VMA: u64 = 0x10;
const VMA_READABLE: u64 = 0x01;
const VMA_WRITABLE: u64 = 0x02;
const VMA_EXECUTABLE: u64 = 0x04;
const VMA_SHARED: u64 = 0x08;

/// `struct procmap_query`.
#[repr(C)]
#[derive(Debug, Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// One mapping.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Vma {
    pub start: u64,
    pub end: u64,
    pub readable: bool,
    pub writable: bool,
    pub shared: bool,
    /// Backed by a file (or a device, or hugetlbfs).
    pub file: bool,
    /// The file's device and inode, and where in it the mapping starts
    /// (zeros for anonymous memory): the mappings of one loaded object
    /// share the first two.
    pub dev: (u32, u32),
    pub inode: u64,
    pub offset: u64,
    /// The kernel's name for an anonymous mapping: `[heap]`, `[stack]`, or
    /// empty.
    pub name: String,
}

impl Vma {
    /// Private, anonymous, readable and writable: what the pager can
    /// manage. The main thread's stack is left to the caller's policy.
    pub fn is_private_anon_rw(&self) -> bool {
        self.readable
            && self.writable
            && !self.shared
            && !self.file
            && (self.name.is_empty() || self.name == "[heap]" || self.is_stack())
    }

    pub fn is_stack(&self) -> bool {
        self.name == "[stack]"
    }

    fn same_file(&self, o: &Vma) -> bool {
        self.file && o.file && self.dev == o.dev && self.inode == o.inode
    }
}

/// Opens this process's maps file, kept from the program's `close` family
/// (`zmem_common::host::fds`): a program's `closefrom(3)` would otherwise close
/// it, and the program's next file could take its number, to be queried by
/// us. A pager opens it at its start and keeps it (`Inner::maps`), before
/// the program runs on (in a forked child, in the fork handler), so that
/// its scans still read it after the program has changed its root (`chroot`
/// into a directory without `/proc`: OpenSSH's pre-authentication child, a
/// DNS or FTP server). Opened at every scan, it failed there (ENOENT), at
/// every `mmap` of the program. A file, not `/proc` as a directory: a
/// directory descriptor that outlives a `chroot` is a way out of it
/// (`fchdir`), for the program and for whoever takes it over.
///
/// Opened as `/proc/thread-self/maps`, as are the other per-process files
/// zmem reads (`statm`, `status`, `pagemap`, `fd/`): `/proc/self` is the
/// main thread, which has no memory of its own once it has ended
/// (`pthread_exit` from `main`, while other threads run on). Opening it
/// then failed (ESRCH). A maps file holds the process's memory, not a
/// thread: opened before, it reads on.
///
/// # Errors
/// Opening the file, or `AGAIN` where the program's closes kept it from
/// being opened for a second.
pub fn open_maps() -> Result<zmem_common::host::fds::KeptFd, Errno> {
    use rustix::fs::{Mode, OFlags};
    zmem_common::host::fds::open_kept(Wait::Yes, Errno::AGAIN, || {
        rustix::fs::open("/proc/thread-self/maps", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
    })
}

/// `/proc/self/maps` as text (kernels before `PROCMAP_QUERY`, 6.11), read
/// from the start of the process's maps file.
fn read_maps(fd: BorrowedFd<'_>) -> Result<String, Errno> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match rustix::io::pread(fd, &mut buf, out.len() as u64) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(Errno::INTR) => {}
            Err(e) => return Err(e),
        }
    }
    String::from_utf8(out).map_err(|_| Errno::IO)
}

/// The process's mappings, in address order.
///
/// # Errors
/// Neither `PROCMAP_QUERY` nor `/proc/self/maps` could be read.
pub fn mappings() -> Result<Vec<Vma>, Errno> {
    mappings_in(open_maps()?.as_fd())
}

/// [`mappings`], read from `fd`, a maps file of this process's
/// ([`open_maps`]).
///
/// # Errors
/// Neither `PROCMAP_QUERY` nor reading `fd` worked.
pub fn mappings_in(fd: BorrowedFd<'_>) -> Result<Vec<Vma>, Errno> {
    match query_all(fd) {
        Ok(v) => Ok(v),
        Err(Errno::NOTTY | Errno::INVAL) => parse_maps(&read_maps(fd)?),
        Err(e) => Err(e),
    }
}

fn query_all(fd: BorrowedFd<'_>) -> Result<Vec<Vma>, Errno> {
    let mut out = Vec::new();
    let mut at = 0u64;
    while let Some(mut v) = query(fd, at, QUERY_COVERING_OR_NEXT_VMA)? {
        // A mapping that grew down over what was listed already (the
        // program changes its mappings as we read them) starts where the
        // last one ended: the list never overlaps itself.
        v.start = v.start.max(at);
        at = v.end;
        out.push(v);
    }
    Ok(out)
}

/// The mapping that covers `addr` (`PROCMAP_QUERY`; with
/// `QUERY_COVERING_OR_NEXT_VMA` in `flags`, or else the next one); `None`
/// where there is none.
fn query(fd: BorrowedFd<'_>, at: u64, flags: u64) -> Result<Option<Vma>, Errno> {
    let mut name = [0u8; 64];
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_flags: flags,
        query_addr: at,
        vma_name_size: name.len() as u32,
        vma_name_addr: name.as_mut_ptr() as u64,
        ..ProcmapQuery::default()
    };
    // SAFETY: PROCMAP_QUERY reads and writes one procmap_query, and
    // writes at most vma_name_size bytes at vma_name_addr (`name`,
    // alive across the call); build_id_size is 0, so no build id.
    let n = match unsafe { call::<PROCMAP_QUERY, _>(fd, &mut q) } {
        Ok(()) => (q.vma_name_size as usize).saturating_sub(1).min(name.len()),
        Err(Errno::NOENT) => return Ok(None),
        // A name longer than the buffer is a file's path (a program or
        // library installed deep, a clone in a long directory): the
        // mapping is listed all the same, without it. Skipped, it hid
        // the file mapping an ELF object's .bss follows, and the .bss
        // was taken for the program's own memory.
        Err(Errno::NAMETOOLONG) => {
            q = ProcmapQuery {
                size: std::mem::size_of::<ProcmapQuery>() as u64,
                query_flags: flags,
                query_addr: at,
                ..ProcmapQuery::default()
            };
            // SAFETY: as above, with no name and no build id asked for.
            match unsafe { call::<PROCMAP_QUERY, _>(fd, &mut q) } {
                Ok(()) => 0,
                Err(Errno::NOENT) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Err(e) => return Err(e),
    };
    Ok(Some(Vma {
        start: q.vma_start,
        end: q.vma_end,
        readable: q.vma_flags & VMA_READABLE != 0,
        writable: q.vma_flags & VMA_WRITABLE != 0,
        shared: q.vma_flags & VMA_SHARED != 0,
        file: q.inode != 0 || q.dev_major != 0 || q.dev_minor != 0,
        dev: (q.dev_major, q.dev_minor),
        inode: q.inode,
        offset: q.vma_offset,
        name: String::from_utf8_lossy(&name[..n]).into_owned(),
    }))
}

/// The mapping that covers `addr`, from `fd` ([`open_maps`]) by
/// `PROCMAP_QUERY` alone: one ioctl, where [`mappings_in`] lists them all.
///
/// # Errors
/// The query's (ENOTTY on a kernel without it, before 6.11).
pub fn mapping_at(fd: BorrowedFd<'_>, addr: u64) -> Result<Option<Vma>, Errno> {
    Ok(query(fd, addr, 0)?.filter(|v| v.start <= addr && addr < v.end))
}

/// The kernel's mapping that covers `addr`, as `(start, end)`, read from
/// `fd` ([`open_maps`]); `None` where nothing is mapped there.
///
/// # Errors
/// Neither `PROCMAP_QUERY` nor reading `fd` worked.
pub fn covering(fd: BorrowedFd<'_>, addr: u64) -> Result<Option<(u64, u64)>, Errno> {
    let mut q =
        ProcmapQuery { size: std::mem::size_of::<ProcmapQuery>() as u64, query_addr: addr, ..ProcmapQuery::default() };
    // SAFETY: as in query_all, with no name and no build id asked for.
    match unsafe { call::<PROCMAP_QUERY, _>(fd, &mut q) } {
        Ok(()) => Ok(Some((q.vma_start, q.vma_end))),
        Err(Errno::NOENT) => Ok(None),
        Err(Errno::NOTTY | Errno::INVAL) => {
            let text = read_maps(fd)?;
            for line in text.lines() {
                let Some((a, b)) = line.split_ascii_whitespace().next().and_then(|r| r.split_once('-')) else {
                    continue;
                };
                let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else { continue };
                if a <= addr && addr < b {
                    return Ok(Some((a, b)));
                }
            }
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Where the run of mappings that starts with the one covering `addr`
/// ends, with no gap between them, at most `end`; `addr` where nothing is
/// mapped there. A region the program split (an `mprotect` or a `madvise`
/// on part of it) is such a run.
pub fn mapped_through(fd: BorrowedFd<'_>, addr: u64, end: u64) -> Result<u64, Errno> {
    let mut at = addr;
    while at < end {
        match covering(fd, at)? {
            Some((s, e)) if s <= at && e > at => at = e,
            _ => break,
        }
    }
    Ok(at.min(end))
}

/// The mappings a forked child does not get as they are: `MADV_DONTFORK`
/// (`dc` among the `VmFlags` of `/proc/thread-self/smaps`: the child has
/// none there) and `MADV_WIPEONFORK` (`wf`: the child's is empty). Read
/// in full (the kernel counts each mapping's pages for `smaps`), so only
/// where a fork needs it.
pub fn not_inherited() -> Result<Vec<(u64, u64)>, Errno> {
    let text = zmem_common::host::fds::read_to_string(Wait::Yes, "/proc/thread-self/smaps".as_ref())
        .map_err(|e| Errno::from_io_error(&e).unwrap_or(Errno::IO))?;
    Ok(parse_not_inherited(&text))
}

/// [`not_inherited`] of an `smaps` text.
pub fn parse_not_inherited(text: &str) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut range = None;
    for line in text.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(r) = range.take().filter(|_| flags.split_ascii_whitespace().any(|f| f == "wf" || f == "dc")) {
                out.push(r);
            }
            continue;
        }
        // A mapping's first line: `start-end perms offset dev inode [name]`;
        // every other line is `Key: value`.
        let Some(first) = line.split_ascii_whitespace().next().filter(|w| !w.ends_with(':')) else { continue };
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                range = Some((a, b));
            }
        }
    }
    out
}

/// Whether the mapping that covers `addr` is executable, read from `fd`
/// ([`open_maps`]); `None` where nothing is mapped there or
/// `PROCMAP_QUERY` cannot answer.
pub fn executable(fd: BorrowedFd<'_>, addr: u64) -> Option<bool> {
    let mut q =
        ProcmapQuery { size: std::mem::size_of::<ProcmapQuery>() as u64, query_addr: addr, ..ProcmapQuery::default() };
    // SAFETY: as in query_all, with no name and no build id asked for.
    unsafe { call::<PROCMAP_QUERY, _>(fd, &mut q) }.ok()?;
    Some(q.vma_flags & VMA_EXECUTABLE != 0)
}

/// The mappings in the text of `/proc/self/maps`.
///
/// # Errors
/// EINVAL for a line that does not parse.
pub fn parse_maps(text: &str) -> Result<Vec<Vma>, Errno> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut f = line.split_ascii_whitespace();
        let (Some(range), Some(perms), Some(off), Some(dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            return Err(Errno::INVAL);
        };
        let name = f.collect::<Vec<_>>().join(" ");
        let (a, b) = range.split_once('-').ok_or(Errno::INVAL)?;
        let hex = |s: &str| u64::from_str_radix(s, 16).map_err(|_| Errno::INVAL);
        let p = perms.as_bytes();
        if p.len() < 4 {
            return Err(Errno::INVAL);
        }
        let (major, minor) = dev.split_once(':').ok_or(Errno::INVAL)?;
        let dev = (hex(major)? as u32, hex(minor)? as u32);
        let inode = inode.parse::<u64>().map_err(|_| Errno::INVAL)?;
        let file = inode != 0 || dev != (0, 0);
        out.push(Vma {
            start: hex(a)?,
            end: hex(b)?,
            readable: p[0] == b'r',
            writable: p[1] == b'w',
            shared: p[3] == b's',
            file,
            dev,
            inode,
            offset: hex(off)?,
            name: if file { String::new() } else { name },
        });
    }
    Ok(out)
}

/// What of an anonymous mapping is a loaded object's static data.
#[derive(Debug, PartialEq, Eq)]
pub enum StaticData {
    /// None of it: it does not follow a file's mapping, or the file is not
    /// an ELF object (SBCL's core, mapped at the start of its 4 GiB
    /// dynamic space).
    None,
    /// The object's .bss, `[a, b)`: the rest of the mapping is not.
    Bss(u64, u64),
    /// It follows an object's mapping whose headers could not be read: all
    /// of it may be.
    Unknown,
}

const ELF_HEADER: usize = 64;
const PHDR: usize = 56;
const PT_LOAD: u32 = 1;

/// Which part of `vmas[i]` is the .bss of the ELF object mapped right
/// before it: the zero-filled tail of a segment (`p_memsz` past
/// `p_filesz`), which the loader maps anonymous after the segment's
/// file-backed pages. The object's headers are read from its first
/// mapping (the same file's, at offset 0), through `process_vm_readv`, so
/// that an object unmapped meanwhile is an error rather than a fault.
pub fn static_data(vmas: &[Vma], i: usize) -> StaticData {
    let v = &vmas[i];
    let Some(prev) = i.checked_sub(1).map(|j| &vmas[j]) else { return StaticData::None };
    if !prev.file || prev.end != v.start {
        return StaticData::None;
    }
    // The object's mappings lie together: walk down them to its first.
    let mut head = None;
    for m in vmas[..i].iter().rev().take_while(|m| m.same_file(prev)) {
        if m.offset == 0 {
            head = Some(m);
        }
    }
    let Some(head) = head else { return StaticData::None };
    let mut eh = [0u8; ELF_HEADER];
    if !read_own(head.start, &mut eh) {
        return StaticData::Unknown;
    }
    // 64-bit ELF, little-endian, as on every target zmem builds for.
    if &eh[..4] != b"\x7fELF" {
        return StaticData::None;
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let (phoff, phentsize, phnum) = (u64_at(&eh, 32), u16_at(&eh, 54), u16_at(&eh, 56));
    if eh[4] != 2 || eh[5] != 1 || phentsize != PHDR || phnum == 0 || phnum > 256 {
        return StaticData::Unknown;
    }
    let mut ph = vec![0u8; phnum * PHDR];
    if phoff + ph.len() as u64 > head.end - head.start || !read_own(head.start + phoff, &mut ph) {
        return StaticData::Unknown;
    }
    let loads = ph.chunks_exact(PHDR).filter(|p| u32::from_le_bytes(p[..4].try_into().unwrap()) == PT_LOAD);
    // (p_offset, p_vaddr, p_filesz, p_memsz)
    let loads: Vec<_> = loads.map(|p| (u64_at(p, 8), u64_at(p, 16), u64_at(p, 32), u64_at(p, 40))).collect();
    let page = zmem_common::PAGE_SIZE as u64;
    let down = |x: u64| x & !(page - 1);
    let up = |x: u64| x.saturating_add(page - 1) & !(page - 1);
    // The segment at file offset 0 is the one mapped at `head.start`.
    let Some(&(_, first, _, _)) = loads.iter().find(|l| down(l.0) == 0) else { return StaticData::Unknown };
    let base = head.start.wrapping_sub(down(first));
    for &(_, vaddr, filesz, memsz) in &loads {
        let at = base.wrapping_add(vaddr);
        if memsz > filesz && up(at.wrapping_add(filesz)) == v.start {
            return StaticData::Bss(v.start, up(at.wrapping_add(memsz)).min(v.end));
        }
    }
    StaticData::None
}

/// Reads `buf.len()` bytes of this process's memory at `addr`; false if
/// any of it is not mapped readable.
fn read_own(addr: u64, buf: &mut [u8]) -> bool {
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: buf.len() };
    let pid = std::process::id() as libc::pid_t;
    // SAFETY: the kernel writes at most `buf.len()` bytes into `buf`, which
    // is alive and exclusively borrowed across the call; the remote side is
    // only read, and an unmapped address there is EFAULT, not a fault.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    n == buf.len() as isize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaps_mappings_marked_dontfork_or_wipeonfork_are_not_inherited() {
        let text = "\
7f0000000000-7f0000200000 rw-p 00000000 00:00 0 \n\
Size:               2048 kB\n\
VmFlags: rd wr mr mw me ac wf \n\
7f0000200000-7f0000400000 rw-p 00000000 00:00 0 \n\
VmFlags: rd wr mr mw me ac \n\
7f0000400000-7f0000600000 rw-p 00000000 00:00 0                          [heap]\n\
Rss:                  12 kB\n\
VmFlags: rd wr mr mw me dc ac \n\
7f0000600000-7f0000800000 rw-p 00000000 00:00 0 \n\
VmFlags: rd wr mr mw me ac wfx \n";
        assert_eq!(
            parse_not_inherited(text),
            vec![(0x7f00_0000_0000, 0x7f00_0020_0000), (0x7f00_0040_0000, 0x7f00_0060_0000)]
        );
    }

    #[test]
    fn a_mapping_split_in_two_is_mapped_through_to_its_end_and_a_gap_ends_it() {
        let page = 4096usize;
        // SAFETY: a fresh anonymous mapping of ours, split by mprotect and
        // cut by munmap; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        } as u64;
        // SAFETY: as above.
        assert_eq!(unsafe { libc::mprotect((base + 2 * page as u64) as *mut _, page, libc::PROT_READ) }, 0);
        // SAFETY: as above.
        assert_eq!(unsafe { libc::munmap((base + 6 * page as u64) as *mut _, page) }, 0);
        let fd = open_maps().unwrap();
        let at = |p: usize| base + (p * page) as u64;
        assert_eq!(mapped_through(fd.as_fd(), at(0), at(8)).unwrap(), at(6));
        assert_eq!(mapped_through(fd.as_fd(), at(0), at(4)).unwrap(), at(4));
        assert_eq!(mapped_through(fd.as_fd(), at(6), at(8)).unwrap(), at(6));
        // SAFETY: as above.
        unsafe { libc::munmap(base as *mut _, 8 * page) };
    }

    #[test]
    fn the_query_and_the_text_agree_on_a_fresh_mapping() {
        let m = crate::Mapping::new(3 << 20).unwrap();
        let (a, b) = (m.addr(), m.addr() + (3 << 20));
        let q = mappings().unwrap();
        let t = parse_maps(&std::fs::read_to_string("/proc/thread-self/maps").unwrap()).unwrap();
        for v in [&q, &t] {
            let hit = v.iter().find(|v| v.start <= a && b <= v.end).expect("the mapping is listed");
            assert!(hit.is_private_anon_rw(), "{hit:?}");
        }
        let heap = q.iter().find(|v| v.name == "[heap]");
        if let Some(h) = heap {
            assert!(h.is_private_anon_rw() && !h.is_stack());
        }
        assert!(q.iter().any(|v| v.is_stack()), "the main stack is named");
        assert!(q.windows(2).all(|w| w[0].end <= w[1].start), "in address order");
    }

    /// A file whose path is longer than the name buffer is listed, as a
    /// file, where the text lists it: a clone in `mktemp -d` put this test
    /// binary's own path past 64 bytes, and its .bss lost its neighbour.
    #[test]
    fn a_file_mapped_from_a_long_path_is_listed_as_a_file() {
        use std::os::fd::AsRawFd;
        let dir = std::env::temp_dir().join(format!("zmem-vmas-long-{}-{}", std::process::id(), "d".repeat(80)));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("data");
        std::fs::write(&path, vec![7u8; 8192]).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        // SAFETY: a new read-only private mapping of our file, at an
        // address the kernel picks: it aliases nothing.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), 8192, libc::PROT_READ, libc::MAP_PRIVATE, f.as_raw_fd(), 0) };
        assert_ne!(p, libc::MAP_FAILED);
        let a = p as u64;
        let q = mappings().unwrap();
        let t = parse_maps(&std::fs::read_to_string("/proc/thread-self/maps").unwrap()).unwrap();
        for v in [&q, &t] {
            let hit = v.iter().find(|v| v.start <= a && a < v.end).expect("the file's mapping is listed");
            assert!(hit.file && !hit.writable, "{hit:?}");
        }
        // SAFETY: the mapping made above, no reference into it left.
        unsafe { libc::munmap(p, 8192) };
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// 1 MiB of this test binary's .bss.
    #[repr(align(4096))]
    struct Big([u8; 1 << 20]);
    static BSS: std::sync::Mutex<Big> = std::sync::Mutex::new(Big([0; 1 << 20]));

    fn index_of(all: &[Vma], addr: u64) -> usize {
        all.iter().position(|v| v.start <= addr && addr < v.end).expect("mapped")
    }

    #[test]
    fn an_elf_objects_bss_is_static_data_and_what_follows_another_file_is_not() {
        // This binary's .bss, as the loader mapped it.
        let bss = { std::ptr::from_ref(&BSS.lock().unwrap().0) as u64 };
        let all = mappings().unwrap();
        let i = index_of(&all, bss);
        assert!(!all[i].file && all[i - 1].file, "{:?}", &all[i - 1..=i]);
        match static_data(&all, i) {
            StaticData::Bss(a, b) => assert!(a == all[i].start && a <= bss && bss + (1 << 20) <= b, "{a:#x}..{b:#x}"),
            other => panic!("{other:?} for {:?}", all[i]),
        }
        // A file mapped over the start of an anonymous reservation, as SBCL
        // maps its core over its heap: the rest is the program's. Once a
        // file that is not ELF, once an ELF file (this binary) whose
        // segments do not end there.
        let exe = std::env::current_exe().unwrap();
        let dir = std::env::temp_dir().join(format!("zmem-vmas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let core = dir.join("core");
        std::fs::write(&core, vec![0x5au8; 64 << 10]).unwrap();
        for path in [core.as_path(), exe.as_path()] {
            let f = std::fs::File::open(path).unwrap();
            let len = 1usize << 20;
            // SAFETY: a fresh reservation at an address the kernel picks:
            // it aliases nothing.
            let r = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            assert_ne!(r, libc::MAP_FAILED);
            use std::os::fd::AsRawFd;
            let (prot, flags) = (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_FIXED);
            // SAFETY: this test's file mapped over the first 64 KiB of the
            // reservation above (MAP_FIXED over our own range), never read
            // or written here; both are unmapped below.
            assert_eq!(unsafe { libc::mmap(r, 64 << 10, prot, flags, f.as_raw_fd(), 0) }, r);
            let base = r as u64;
            let all = mappings().unwrap();
            let i = index_of(&all, base + (64 << 10));
            assert_eq!((all[i - 1].start, all[i - 1].offset, all[i].start), (base, 0, base + (64 << 10)));
            assert_eq!(static_data(&all, i), StaticData::None, "{}", path.display());
            // SAFETY: the mapping made above, no longer used.
            assert_eq!(unsafe { libc::munmap(base as *mut _, len) }, 0);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn maps_lines_parse_into_their_fields() {
        let text = "7f00-8000 rw-p 00000000 00:00 0 \n\
                    8000-9000 r--p 00000000 08:01 1234 /usr/lib/x.so\n\
                    9000-a000 rw-s 00000000 00:05 77 /dev/zero (deleted)\n\
                    a000-b000 rw-p 00000000 00:00 0 [stack]\n";
        let v = parse_maps(text).unwrap();
        assert_eq!(v.len(), 4);
        assert!(v[0].is_private_anon_rw() && v[0].writable);
        assert!(v[1].file && !v[1].writable && !v[1].is_private_anon_rw());
        assert_eq!((v[1].dev, v[1].inode, v[1].offset), ((8, 1), 1234, 0));
        assert!(v[2].shared && v[2].file && !v[2].is_private_anon_rw());
        assert!(v[3].is_stack());
        assert!(parse_maps("zz").is_err());
    }
}
