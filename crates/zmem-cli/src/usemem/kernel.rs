//! The kernel's side: a swap file, zswap's parameters and a cgroup v1
//! memory limit on the workers, all restored on drop; and the kernel's
//! counters (vmstat, debugfs).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

pub(crate) const ZSWAP: &str = "/sys/module/zswap/parameters";
pub(crate) const CGROUP_V1: &str = "/sys/fs/cgroup/memory";
pub(crate) const PAGE_CLUSTER: &str = "/proc/sys/vm/page-cluster";
/// Held (`flock`) by the one kernel run at a time on this machine.
const LOCK: &str = "/run/zmem-kernel-run.lock";

/// The machine changes a kernel run makes, undone on drop in reverse order.
#[derive(Debug, Default)]
pub(crate) struct KernelSetup {
    pub(crate) swapfile: Option<PathBuf>,
    pub(crate) swap_on: bool,
    /// Parameters changed (zswap's, `vm.page-cluster`) and their values
    /// before, restored in this order.
    pub(crate) saved: Vec<(String, String)>,
    pub(crate) cgroup: Option<PathBuf>,
    pub(crate) mounted_debugfs: bool,
    /// The machine's kernel-run lock ([`KernelSetup::lock`]), let go after
    /// `drop` has restored everything (fields drop after it).
    lock: Option<std::fs::File>,
}

pub(crate) fn write_param(path: &str, v: &str) -> Result<()> {
    std::fs::write(path, v).with_context(|| format!("write `{v}` to {path}"))
}

pub(crate) fn sh(cmd: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(cmd).args(args).output().with_context(|| format!("run {cmd}"))?;
    if !out.status.success() {
        bail!("{cmd} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

impl KernelSetup {
    pub(crate) fn new(zswap: Option<&str>, limit: usize, swap_bytes: usize, dir: &Path) -> Result<KernelSetup> {
        if !rustix::process::geteuid().is_root() {
            bail!("kernel and swap runs need root (swapon, zswap parameters, a memory cgroup)");
        }
        if !Path::new(CGROUP_V1).join("memory.limit_in_bytes").exists() {
            bail!("no cgroup v1 memory controller at {CGROUP_V1}");
        }
        if zswap.is_some() && !Path::new(ZSWAP).exists() {
            bail!("this kernel has no zswap ({ZSWAP} is missing)");
        }
        let mut k = KernelSetup::default();
        k.lock = Some(Self::lock()?);
        // Save every zswap parameter before touching one.
        for name in ["enabled", "compressor", "max_pool_percent", "accept_threshold_percent", "shrinker_enabled"] {
            let p = format!("{ZSWAP}/{name}");
            if let Ok(v) = std::fs::read_to_string(&p) {
                k.saved.push((p, v.trim().to_string()));
            }
        }
        let file = dir.join(format!("zmem-usemem-{}.swap", std::process::id()));
        k.swapfile = Some(file.clone());
        sh("fallocate", &["-l", &swap_bytes.to_string(), &file.to_string_lossy()])?;
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        sh("mkswap", &[&file.to_string_lossy()])?;
        sh("swapon", &[&file.to_string_lossy()]).context("no swap support here")?;
        k.swap_on = true;
        match zswap {
            Some(c) => {
                write_param(&format!("{ZSWAP}/compressor"), c)
                    .with_context(|| format!("the kernel has no `{c}` for zswap (lzo, lzo-rle, deflate)"))?;
                write_param(&format!("{ZSWAP}/enabled"), "Y")?;
            }
            None => write_param(&format!("{ZSWAP}/enabled"), "N").or_else(|e| {
                if Path::new(ZSWAP).exists() {
                    Err(e)
                } else {
                    Ok(())
                }
            })?,
        }
        if !Path::new("/sys/kernel/debug/zswap").exists() && zswap.is_some() {
            k.mounted_debugfs = sh("mount", &["-t", "debugfs", "none", "/sys/kernel/debug"]).is_ok();
        }
        let cg = Path::new(CGROUP_V1).join(format!("zmem-usemem-{}", std::process::id()));
        std::fs::create_dir(&cg).with_context(|| format!("mkdir {}", cg.display()))?;
        k.cgroup = Some(cg.clone());
        std::fs::write(cg.join("memory.limit_in_bytes"), limit.to_string()).context("set memory.limit_in_bytes")?;
        Ok(k)
    }

    /// Takes the machine's kernel-run lock, waiting for a run that holds
    /// it. Two runs at once (two `zmem compare`s, or one beside `zmem
    /// usemem`) each saved zswap's parameters as the other had set them,
    /// and the last to finish set them back to the other's: `enabled` stayed
    /// `Y` (two of `zmem run`'s tests ran side by side and caught it).
    ///
    /// The holder removes the file before it lets go (`drop`), so that a run
    /// leaves nothing behind; a run that waited on the removed file finds
    /// the name gone or another file's, and locks again by the name.
    fn lock() -> Result<std::fs::File> {
        use rustix::fs::{flock, FlockOperation};
        let mut said = false;
        loop {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(LOCK)
                .with_context(|| format!("open {LOCK}"))?;
            if flock(&f, FlockOperation::NonBlockingLockExclusive).is_err() {
                if !said {
                    eprintln!("zmem: another kernel run (zmem usemem or compare) holds {LOCK}; waiting for it to end");
                    said = true;
                }
                flock(&f, FlockOperation::LockExclusive).with_context(|| format!("lock {LOCK}"))?;
            }
            let held = rustix::fs::fstat(&f).with_context(|| format!("stat {LOCK}"))?;
            if rustix::fs::stat(LOCK).is_ok_and(|named| named.st_dev == held.st_dev && named.st_ino == held.st_ino) {
                return Ok(f);
            }
        }
    }

    /// Sets `vm.page-cluster` (swap read-ahead: 2^n pages a fault) until
    /// drop.
    pub(crate) fn set_page_cluster(&mut self, n: u32) -> Result<()> {
        let old = std::fs::read_to_string(PAGE_CLUSTER).with_context(|| format!("read {PAGE_CLUSTER}"))?;
        self.saved.push((PAGE_CLUSTER.to_string(), old.trim().to_string()));
        write_param(PAGE_CLUSTER, &n.to_string())
    }

    /// How many processes the kernel's OOM killer killed in the cgroup
    /// (`memory.oom_control`'s `oom_kill`).
    pub(crate) fn oom_kills(&self) -> u64 {
        let Some(t) = self.cgroup.as_ref().and_then(|cg| std::fs::read_to_string(cg.join("memory.oom_control")).ok())
        else {
            return 0;
        };
        t.lines().find_map(|l| l.strip_prefix("oom_kill ")).and_then(|n| n.trim().parse().ok()).unwrap_or(0)
    }

    pub(crate) fn cgroup_procs(&self) -> Option<PathBuf> {
        self.cgroup.as_ref().map(|c| c.join("cgroup.procs"))
    }
}

impl Drop for KernelSetup {
    fn drop(&mut self) {
        let warn = |what: String| eprintln!("zmem usemem: restoring: {what}");
        if let Some(cg) = self.cgroup.take() {
            // The workers have exited; their pages may still be charged for
            // a moment.
            let mut ok = false;
            for _ in 0..100 {
                if std::fs::remove_dir(&cg).is_ok() {
                    ok = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if !ok {
                warn(format!("could not remove {}", cg.display()));
            }
        }
        if self.swap_on {
            if let Some(f) = &self.swapfile {
                if let Err(e) = sh("swapoff", &[&f.to_string_lossy()]) {
                    warn(format!("{e:#}"));
                }
            }
        }
        if let Some(f) = self.swapfile.take() {
            let _ = std::fs::remove_file(&f);
        }
        // In the order they were saved: zswap's compressor before enabled,
        // then `vm.page-cluster`.
        for (p, v) in self.saved.drain(..) {
            if std::fs::read_to_string(&p).is_ok_and(|cur| cur.trim() != v) {
                if let Err(e) = std::fs::write(&p, &v) {
                    warn(format!("{p} back to {v}: {e}"));
                }
            }
        }
        if self.mounted_debugfs {
            let _ = sh("umount", &["/sys/kernel/debug"]);
        }
        // Removed while still held (see `lock`); the lock goes with the
        // field, after this.
        if self.lock.is_some() {
            let _ = std::fs::remove_file(LOCK);
        }
    }
}

pub(crate) fn vmstat(name: &str) -> u64 {
    std::fs::read_to_string("/proc/vmstat")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok()))
        .unwrap_or(0)
}

pub(crate) fn kernel_rejects() -> u64 {
    [
        "reject_alloc_fail",
        "reject_compress_fail",
        "reject_compress_poor",
        "reject_kmemcache_fail",
        "reject_reclaim_fail",
    ]
    .iter()
    .map(|n| debugfs_zswap(n))
    .sum()
}

pub(crate) fn debugfs_zswap(name: &str) -> u64 {
    std::fs::read_to_string(format!("/sys/kernel/debug/zswap/{name}"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::KernelSetup;
    use std::time::{Duration, Instant};

    /// A second kernel run waits for the first to let go of the machine
    /// (needs root, as kernel runs do: the lock is in /run).
    #[test]
    fn a_second_kernel_run_waits_for_the_first() {
        let first = KernelSetup::lock().expect("the lock (run as root)");
        let t = Instant::now();
        let second = std::thread::spawn(move || {
            let l = KernelSetup::lock();
            (l, t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(300));
        assert!(!second.is_finished(), "the second run took the lock while the first held it");
        // As `drop` lets go: the file removed first, then the lock.
        std::fs::remove_file(super::LOCK).unwrap();
        drop(first);
        let (held, waited) = second.join().unwrap();
        assert!(held.is_ok() && waited >= Duration::from_millis(300), "{waited:?}");
        // The second holds a new file by the name, which it removes as it ends.
        assert!(std::path::Path::new(super::LOCK).exists());
        std::fs::remove_file(super::LOCK).unwrap();
        drop(held);
    }
}
