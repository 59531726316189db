//! Write tracking with `PAGEMAP_SCAN` on `/proc/self/pagemap` (Linux 6.7):
//! which pages of a range were written since the last scan.

use std::os::fd::AsFd;
use std::os::fd::OwnedFd;

use linux_raw_sys::general as uapi;
use rustix::io::Errno;
use rustix::ioctl::Opcode;

use crate::sys::{call, UffdError};

/// `PAGEMAP_SCAN`: `_IOWR('f', 16, struct pm_scan_arg)`.
pub const PAGEMAP_SCAN: Opcode = 0xC060_6610;

/// Write tracking through `PAGEMAP_SCAN` on `/proc/self/pagemap`, for ranges
/// registered in WP mode on a uffd with `WP_ASYNC`: the kernel resolves a
/// write to a write-protected page by itself (no message), and a scan
/// reports the pages written since the last scan and protects them again,
/// atomically.
#[derive(Debug)]
pub struct WriteTracker {
    pagemap: OwnedFd,
    buf: Vec<uapi::page_region>,
}

impl WriteTracker {
    /// # Errors
    /// opening `/proc/self/pagemap`.
    pub fn open() -> Result<WriteTracker, UffdError> {
        use rustix::fs::{Mode, OFlags};
        let pagemap = rustix::fs::open("/proc/self/pagemap", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| UffdError::Ioctl { op: "open /proc/self/pagemap", addr: 0, len: 0, errno: e })?;
        Ok(WriteTracker { pagemap, buf: vec![uapi::page_region { start: 0, end: 0, categories: 0 }; 512] })
    }

    /// Calls `written(start, end)` for each run of pages of `[start, end)`
    /// written since the last scan, and write-protects them again.
    ///
    /// # Errors
    /// The ioctl's error (EPERM if the range is not WP_ASYNC-registered).
    pub fn scan_written(&mut self, start: u64, end: u64, mut written: impl FnMut(u64, u64)) -> Result<(), UffdError> {
        let mut at = start;
        while at < end {
            let mut a = uapi::pm_scan_arg {
                size: std::mem::size_of::<uapi::pm_scan_arg>() as u64,
                flags: u64::from(uapi::PM_SCAN_WP_MATCHING | uapi::PM_SCAN_CHECK_WPASYNC),
                start: at,
                end,
                walk_end: 0,
                vec: self.buf.as_mut_ptr() as u64,
                vec_len: self.buf.len() as u64,
                max_pages: 0,
                category_inverted: 0,
                // Present pages only: a scan that matched holes would put
                // uffd-wp markers in them, which turn their MISSING faults
                // into write-protect faults.
                category_mask: u64::from(uapi::PAGE_IS_WRITTEN | uapi::PAGE_IS_PRESENT),
                category_anyof_mask: 0,
                return_mask: u64::from(uapi::PAGE_IS_WRITTEN),
            };
            // SAFETY: PAGEMAP_SCAN reads one pm_scan_arg and writes it back
            // (walk_end), and writes at most vec_len page_regions into
            // self.buf, which outlives the call. Its only other effect is
            // write-protecting pages of [start, end), which the uffd then
            // unprotects on write by itself (WP_ASYNC).
            let r = unsafe { call::<PAGEMAP_SCAN, _>(self.pagemap.as_fd(), &mut a) };
            // The ioctl returns the number of regions filled, which rustix's
            // Updater discards: the buffer is zeroed after use, so the filled
            // regions are the non-empty prefix.
            r.map_err(Self::err(at, end - at))?;
            for reg in self.buf.iter_mut().take_while(|r| r.end > r.start) {
                written(reg.start, reg.end);
                *reg = uapi::page_region { start: 0, end: 0, categories: 0 };
            }
            if a.walk_end >= end || a.walk_end <= at {
                break;
            }
            at = a.walk_end;
        }
        Ok(())
    }

    fn err(addr: u64, len: u64) -> impl Fn(Errno) -> UffdError {
        move |errno| UffdError::Ioctl { op: "PAGEMAP_SCAN", addr, len, errno }
    }
}
