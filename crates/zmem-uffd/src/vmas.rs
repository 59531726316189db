//! The process's mappings, as the kernel sees them: the `PROCMAP_QUERY`
//! ioctl on `/proc/self/maps` (Linux 6.11), one call per mapping, with the
//! text of `/proc/self/maps` as the fallback on older kernels.

use std::os::fd::{AsFd, OwnedFd};

use rustix::io::Errno;
use rustix::ioctl::Opcode;

use crate::sys::call;

/// `_IOWR('f', 17, struct procmap_query)` (104 bytes): Debian's headers
/// predate it, so it is spelled out from the kernel's uapi.
pub const PROCMAP_QUERY: Opcode = 0xC068_6611;
const QUERY_VMA_WRITABLE: u64 = 0x02;
const QUERY_COVERING_OR_NEXT_VMA: u64 = 0x10;
const VMA_READABLE: u64 = 0x01;
const VMA_WRITABLE: u64 = 0x02;
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

/// One writable mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vma {
    pub start: u64,
    pub end: u64,
    pub readable: bool,
    pub shared: bool,
    /// Backed by a file (or a device, or hugetlbfs).
    pub file: bool,
    /// The kernel's name for an anonymous mapping: `[heap]`, `[stack]`, or
    /// empty.
    pub name: String,
}

impl Vma {
    /// Private, anonymous, readable and writable: what the pager can
    /// manage. The main thread's stack is left to the caller's policy.
    pub fn is_private_anon_rw(&self) -> bool {
        self.readable
            && !self.shared
            && !self.file
            && (self.name.is_empty() || self.name == "[heap]" || self.is_stack())
    }

    pub fn is_stack(&self) -> bool {
        self.name == "[stack]"
    }
}

/// `/proc/self/maps`, kept from the program's `close` family while it is
/// open (`zmem_common::fds`): a program's `closefrom(3)` on another thread
/// would otherwise close it under a scan (EBADF), and the program's next
/// file could take its number, to be queried and closed by us.
fn open_maps() -> Result<zmem_common::fds::KeptFd, Errno> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open("/proc/self/maps", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    Ok(zmem_common::fds::KeptFd::new(fd))
}

/// The process's writable mappings, in address order.
///
/// # Errors
/// Neither `PROCMAP_QUERY` nor `/proc/self/maps` could be read.
pub fn writable_vmas() -> Result<Vec<Vma>, Errno> {
    let fd = open_maps()?;
    match query_all(&fd) {
        Ok(v) => Ok(v),
        Err(Errno::NOTTY | Errno::INVAL) => {
            parse_maps(&std::fs::read_to_string("/proc/self/maps").map_err(|_| Errno::IO)?)
        }
        Err(e) => Err(e),
    }
}

fn query_all(fd: &OwnedFd) -> Result<Vec<Vma>, Errno> {
    let mut out = Vec::new();
    let mut name = [0u8; 64];
    let mut at = 0u64;
    loop {
        let mut q = ProcmapQuery {
            size: std::mem::size_of::<ProcmapQuery>() as u64,
            query_flags: QUERY_COVERING_OR_NEXT_VMA | QUERY_VMA_WRITABLE,
            query_addr: at,
            vma_name_size: name.len() as u32,
            vma_name_addr: name.as_mut_ptr() as u64,
            ..ProcmapQuery::default()
        };
        // SAFETY: PROCMAP_QUERY reads and writes one procmap_query, and
        // writes at most vma_name_size bytes at vma_name_addr (`name`,
        // alive across the call); build_id_size is 0, so no build id.
        match unsafe { call::<PROCMAP_QUERY, _>(fd.as_fd(), &mut q) } {
            Ok(()) => {}
            Err(Errno::NOENT) => return Ok(out),
            // A name longer than the buffer: the mapping is named by a
            // file path, so not ours to manage anyway; step over it.
            Err(Errno::NAMETOOLONG) => {
                at = next_after(fd, at)?;
                continue;
            }
            Err(e) => return Err(e),
        }
        let n = (q.vma_name_size as usize).saturating_sub(1).min(name.len());
        out.push(Vma {
            // A mapping that grew down over what was listed already (the
            // program changes its mappings as we read them) starts where
            // the last one ended: the list never overlaps itself.
            start: q.vma_start.max(at),
            end: q.vma_end,
            readable: q.vma_flags & VMA_READABLE != 0,
            shared: q.vma_flags & VMA_SHARED != 0,
            file: q.inode != 0 || q.dev_major != 0 || q.dev_minor != 0,
            name: String::from_utf8_lossy(&name[..n]).into_owned(),
        });
        debug_assert!(q.vma_flags & VMA_WRITABLE != 0);
        at = q.vma_end;
    }
}

/// The kernel's mapping that covers `addr`, as `(start, end)`; `None`
/// where nothing is mapped there.
///
/// # Errors
/// Neither `PROCMAP_QUERY` nor `/proc/self/maps` could be read.
pub fn covering(addr: u64) -> Result<Option<(u64, u64)>, Errno> {
    let fd = open_maps()?;
    let mut q =
        ProcmapQuery { size: std::mem::size_of::<ProcmapQuery>() as u64, query_addr: addr, ..ProcmapQuery::default() };
    // SAFETY: as in query_all, with no name and no build id asked for.
    match unsafe { call::<PROCMAP_QUERY, _>(fd.as_fd(), &mut q) } {
        Ok(()) => Ok(Some((q.vma_start, q.vma_end))),
        Err(Errno::NOENT) => Ok(None),
        Err(Errno::NOTTY | Errno::INVAL) => {
            let text = std::fs::read_to_string("/proc/self/maps").map_err(|_| Errno::IO)?;
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

/// The end of the writable mapping at or after `at`, asked without its name.
fn next_after(fd: &OwnedFd, at: u64) -> Result<u64, Errno> {
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_flags: QUERY_COVERING_OR_NEXT_VMA | QUERY_VMA_WRITABLE,
        query_addr: at,
        ..ProcmapQuery::default()
    };
    // SAFETY: as in query_all, with no name and no build id asked for.
    unsafe { call::<PROCMAP_QUERY, _>(fd.as_fd(), &mut q) }?;
    Ok(q.vma_end)
}

/// The writable mappings in the text of `/proc/self/maps`.
///
/// # Errors
/// EINVAL for a line that does not parse.
pub fn parse_maps(text: &str) -> Result<Vec<Vma>, Errno> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut f = line.split_ascii_whitespace();
        let (Some(range), Some(perms), Some(_off), Some(dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            return Err(Errno::INVAL);
        };
        let name = f.collect::<Vec<_>>().join(" ");
        let (a, b) = range.split_once('-').ok_or(Errno::INVAL)?;
        let hex = |s: &str| u64::from_str_radix(s, 16).map_err(|_| Errno::INVAL);
        let p = perms.as_bytes();
        if p.len() < 4 || p[1] != b'w' {
            continue;
        }
        let file = inode != "0" || dev != "00:00";
        out.push(Vma {
            start: hex(a)?,
            end: hex(b)?,
            readable: p[0] == b'r',
            shared: p[3] == b's',
            file,
            name: if file { String::new() } else { name },
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_and_the_text_agree_on_a_fresh_mapping() {
        let m = crate::Mapping::new(3 << 20).unwrap();
        let (a, b) = (m.addr(), m.addr() + (3 << 20));
        let q = writable_vmas().unwrap();
        let t = parse_maps(&std::fs::read_to_string("/proc/self/maps").unwrap()).unwrap();
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

    #[test]
    fn maps_lines_parse_into_their_fields() {
        let text = "7f00-8000 rw-p 00000000 00:00 0 \n\
                    8000-9000 r--p 00000000 08:01 1234 /usr/lib/x.so\n\
                    9000-a000 rw-s 00000000 00:05 77 /dev/zero (deleted)\n\
                    a000-b000 rw-p 00000000 00:00 0 [stack]\n";
        let v = parse_maps(text).unwrap();
        assert_eq!(v.len(), 3);
        assert!(v[0].is_private_anon_rw());
        assert!(v[1].shared && v[1].file && !v[1].is_private_anon_rw());
        assert!(v[2].is_stack());
        assert!(parse_maps("zz").is_err());
    }
}
