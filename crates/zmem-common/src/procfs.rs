//! The `/proc` text readers: one parser a file format, shared by every
//! crate (the descriptors they read through are `host::fds`'s).

/// The value of a `KEY: N kB` line of a `/proc` file (`/proc/PID/status`,
/// a `smaps_rollup`), in bytes; `None` if there is no such line. `key`
/// ends with its colon, so that `Pss:` is not taken for `Pss_Anon:`.
pub fn kb_field(t: &str, key: &str) -> Option<u64> {
    let v = t.lines().find_map(|l| l.strip_prefix(key))?;
    Some(v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()? << 10)
}

/// Field `n` (from 1, as proc(5) numbers them) of a `/proc/PID/stat` line.
/// The name (field 2) is in parentheses and may hold anything, spaces and
/// parentheses included: fields from 3 on are counted after the last `)`.
pub fn stat_field(stat: &str, n: usize) -> Option<&str> {
    stat[stat.rfind(')')? + 1..].split_whitespace().nth(n.checked_sub(3)?)
}

/// Field `n` (from 0: size, resident, shared, text, lib, data, dirty) of a
/// `/proc/PID/statm` line, in pages.
pub fn statm_field(statm: &str, n: usize) -> Option<usize> {
    statm.split_ascii_whitespace().nth(n)?.parse().ok()
}

/// The first pid of the `NSpid:` line of a `/proc/PID/status`: the
/// process's pid in the outermost pid namespace that the `/proc` it was read
/// from shows (a sandbox's process, pid 2 in its own namespace, is pid
/// 12345 there). `None` without such a line.
pub fn outer_pid(status: &str) -> Option<u32> {
    status.lines().find_map(|l| l.strip_prefix("NSpid:"))?.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outer_pid_is_the_first_of_nspid() {
        let status = "Name:\tpython3\nTgid:\t2\nPid:\t2\nNSpid:\t48213\t2\nNStgid:\t48213\t2\n";
        assert_eq!(outer_pid(status), Some(48213));
        assert_eq!(outer_pid("Pid:\t7\nNSpid:\t7\n"), Some(7));
        assert_eq!(outer_pid("Pid:\t7\n"), None);
    }

    #[test]
    fn a_stat_field_is_counted_after_the_name_whatever_it_holds() {
        let t = "42 (a) b (c) 7) S 1 42 42 0 -1";
        assert_eq!(stat_field(t, 3), Some("S"));
        assert_eq!(stat_field(t, 4), Some("1"));
        assert_eq!(stat_field(t, 8), Some("-1"));
        assert_eq!(stat_field(t, 9), None);
        assert_eq!(stat_field(t, 2), None);
    }

    #[test]
    fn a_kb_line_reads_as_bytes_and_only_under_its_own_key() {
        let t = "Name:\tjava\nVmRSS:\t  2048 kB\nRssShmem:\t 512 kB\nPss_Anon: 3 kB\n";
        assert_eq!(kb_field(t, "VmRSS:"), Some(2 << 20));
        assert_eq!(kb_field(t, "RssShmem:"), Some(512 << 10));
        assert_eq!(kb_field(t, "Pss:"), None, "Pss_Anon is not Pss");
        assert_eq!(kb_field(t, "Name:"), None, "not a kB line");
    }

    #[test]
    fn a_statm_field_is_a_count_of_pages() {
        let t = "2592 1024 512 1 0 300 0\n";
        assert_eq!(statm_field(t, 1), Some(1024));
        assert_eq!(statm_field(t, 2), Some(512));
        assert_eq!(statm_field(t, 7), None);
    }
}
