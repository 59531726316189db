//! The stats files of processes under `zmem run`: `DIR/zmem-PID.json`,
//! written whole (to `DIR/.zmem-PID.json.tmp`, then renamed), and gone once
//! their process is.
//!
//! A process removes its own file as it exits (the shim's exit handler);
//! one that cannot (killed by a signal, `_exit`) leaves it behind, and the
//! next process to start in the directory, or `zmem run` as it ends,
//! sweeps the files whose process is gone.

use std::fs::{DirBuilder, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The stats file of process `pid` in `dir`.
pub fn path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("zmem-{pid}.json"))
}

fn tmp_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!(".zmem-{pid}.json.tmp"))
}

/// The process a file of a stats directory belongs to, if it is one.
pub fn owner(name: &str) -> Option<u32> {
    let pid = name.strip_prefix("zmem-").and_then(|n| n.strip_suffix(".json"));
    let pid = pid.or_else(|| name.strip_prefix(".zmem-").and_then(|n| n.strip_suffix(".json.tmp")))?;
    pid.parse().ok().filter(|&p| p > 0)
}

/// Makes `dir` (and its parents), `0700` where it creates it. With
/// `owner_uid`, a directory that exists must belong to that user and be
/// writable by no one else: a default directory in `/tmp`, whose name
/// another user could have taken first.
///
/// # Errors
/// Creating it, or a directory that is not the user's own.
pub fn prepare_dir(dir: &Path, owner_uid: Option<u32>) -> std::io::Result<()> {
    DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    if let Some(uid) = owner_uid {
        let m = std::fs::symlink_metadata(dir)?;
        if !m.is_dir() || m.uid() != uid || m.mode() & 0o022 != 0 {
            return Err(std::io::Error::other(format!(
                "{} is not a directory of uid {uid}'s own (owner {}, mode {:o})",
                dir.display(),
                m.uid(),
                m.mode() & 0o7777
            )));
        }
    }
    Ok(())
}

/// Replaces process `pid`'s stats file with `json`. The temporary file is
/// made anew (`O_EXCL`: a link planted under its name is never followed),
/// and `rename` replaces the file in one step, so a reader sees a whole one.
///
/// # Errors
/// Creating, writing or renaming the file.
pub fn write(dir: &Path, pid: u32, json: &str) -> std::io::Result<()> {
    let tmp = tmp_path(dir, pid);
    let _ = std::fs::remove_file(&tmp);
    // Kept (`fds`): the program may close every descriptor meanwhile.
    let busy = std::io::ErrorKind::WouldBlock.into();
    let mut f = crate::host::fds::open_kept(crate::host::fds::Wait::Yes, busy, || {
        OpenOptions::new().write(true).create_new(true).mode(0o644).open(&tmp).map(std::os::fd::OwnedFd::from)
    })?;
    let r = std::io::Write::write_all(&mut f, json.as_bytes());
    drop(f);
    let r = r.and_then(|()| std::fs::rename(&tmp, path(dir, pid)));
    if r.is_err() {
        // A full disk, or a file this process may no longer replace (a
        // sticky directory after a change of user): no half-written
        // temporary file stays behind.
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// The effective uid of process `pid` (the `Uid:` line of its status):
/// whose default stats directory it writes to.
pub fn effective_uid(pid: u32) -> Option<u32> {
    let status =
        crate::host::fds::read_to_string(crate::host::fds::Wait::Yes, Path::new(&format!("/proc/{pid}/status")))
            .ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Removes the stats files (and temporary files) in `dir` of processes
/// that no longer exist, but never `keep`'s. Returns how many went.
/// A process is alive while `/proc/PID` exists (a zombie included).
pub fn sweep(dir: &Path, keep: u32) -> usize {
    // Listed through a kept descriptor: the stats thread sweeps while the
    // program runs, and may close every descriptor.
    let Ok(names) = crate::host::fds::dir_names(crate::host::fds::Wait::Yes, dir) else { return 0 };
    let mut gone = 0;
    for name in names {
        let Some(pid) = name.to_str().and_then(owner) else { continue };
        if pid != keep && !Path::new(&format!("/proc/{pid}")).exists() && std::fs::remove_file(dir.join(&name)).is_ok()
        {
            gone += 1;
        }
    }
    gone
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("zmem-stats-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn names_of_stats_files_and_only_those_have_an_owner() {
        assert_eq!(owner("zmem-42.json"), Some(42));
        assert_eq!(owner(".zmem-42.json.tmp"), Some(42));
        for other in ["zmem-.json", "zmem-0.json", "zmem-42.json.tmp", "zmem-4x.json", "notes.json", ".zmem-42.json"] {
            assert_eq!(owner(other), None, "{other}");
        }
    }

    #[test]
    fn a_sweep_removes_the_files_of_dead_processes_only() {
        let d = scratch("sweep");
        prepare_dir(&d, None).unwrap();
        // A pid that exists (this one), and one that cannot (past pid_max,
        // 2^22 at most on 64-bit Linux).
        let (live, dead) = (std::process::id(), 9_999_999);
        write(&d, live, "{}").unwrap();
        write(&d, dead, "{}").unwrap();
        std::fs::write(tmp_path(&d, dead), "").unwrap();
        std::fs::write(d.join("unrelated.json"), "").unwrap();
        assert_eq!(sweep(&d, 0), 2);
        assert!(path(&d, live).exists());
        assert!(!path(&d, dead).exists() && !tmp_path(&d, dead).exists());
        assert!(d.join("unrelated.json").exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_write_never_follows_a_link_planted_as_its_temporary_file() {
        let d = scratch("link");
        prepare_dir(&d, None).unwrap();
        let victim = d.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        std::os::unix::fs::symlink(&victim, tmp_path(&d, 7)).unwrap();
        write(&d, 7, "{\"pid\":7}").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(std::fs::read_to_string(path(&d, 7)).unwrap(), "{\"pid\":7}");
        // A link as the file itself is replaced, not written through.
        std::fs::remove_file(path(&d, 7)).unwrap();
        std::os::unix::fs::symlink(&victim, path(&d, 7)).unwrap();
        write(&d, 7, "{}").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(!std::fs::symlink_metadata(path(&d, 7)).unwrap().file_type().is_symlink());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_write_that_fails_leaves_no_temporary_file() {
        let d = scratch("fail");
        prepare_dir(&d, None).unwrap();
        // The file's name taken by a directory: the rename fails (EISDIR),
        // as it does for a file this process may no longer replace.
        std::fs::create_dir_all(path(&d, 7).join("x")).unwrap();
        assert!(write(&d, 7, "{}").is_err());
        assert!(!tmp_path(&d, 7).exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_default_directory_must_be_the_users_own() {
        let d = scratch("own");
        let uid = effective_uid(std::process::id()).unwrap();
        prepare_dir(&d, Some(uid)).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        // Someone else's (here: a uid no one has), or writable by others.
        assert!(prepare_dir(&d, Some(uid.wrapping_add(12345))).is_err());
        std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        assert!(prepare_dir(&d, Some(uid)).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
