//! A tmpfs of a few KiB for ENOSPC tests, mounted for one test and removed
//! after it, even on panic. Shared by the swap-file and tier tests (the tier
//! includes this file by path).

use std::path::PathBuf;
use std::process::Command;

pub struct SmallFs(pub PathBuf);

impl SmallFs {
    /// Mounts a `kib`-KiB tmpfs, or returns `None` when this process may not
    /// mount. It says so loudly, and fails the test if it runs as root (CI
    /// does), so that a broken mount never passes as a skip.
    pub fn mount(kib: usize, test: &str) -> Option<SmallFs> {
        let dir = std::env::temp_dir().join(format!("zmem-enospc-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(SmallFs(dir));
        }
        let _ = std::fs::remove_dir(&dir);
        eprintln!("SKIPPED {test}: cannot mount a tmpfs (not root?)");
        assert_ne!(rustix::process::geteuid().as_raw(), 0, "root could not mount a tmpfs");
        None
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}
