//! Servers: PostgreSQL, MariaDB, redis, memcached and sshd under `zmem run`,
//! their data checked against the same work without zmem.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// A PostgreSQL server under `zmem run`, as the `postgres` user when the
/// tests run as root (it refuses root); killed with its whole tree if a
/// check fails.
struct Postgres {
    bin: PathBuf,
    dir: PathBuf,
    /// `runuser …` or `zmem run` itself: the leader of the server's group.
    leader: std::process::Child,
    stats: PathBuf,
}

impl Postgres {
    /// `Command` for a PostgreSQL program, run as `postgres` under root
    /// (`runuser`, which is not set-uid: the shim loads in it).
    fn command(program: &Path) -> Command {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        }
    }

    fn start(limit: &str) -> Postgres {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL (Debian's postgresql; .ci/run installs it)")
            .flatten()
            .map(|e| e.path().join("bin"))
            .find(|b| b.join("postgres").is_file() && b.join("initdb").is_file())
            .expect("/usr/lib/postgresql/*/bin/postgres");
        let dir = tmpdir("postgres");
        let (swap, stats) = (dir.join("swap"), dir.join("stats"));
        for d in [&swap, &stats] {
            std::fs::create_dir_all(d).unwrap();
        }
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let st = Command::new("chown").args(["-R", "postgres"]).arg(&dir).status().unwrap();
            assert!(st.success(), "chown postgres {}", dir.display());
        }
        let data = dir.join("data");
        let o = Self::command(&bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .output()
            .unwrap();
        assert!(o.status.success(), "initdb: {}", text(&o));
        // As a root user starts a server that will not run as root: the
        // privileges drop inside the tree, which must still share one
        // limit (a process that could not open the tree's segment took the
        // whole limit to itself).
        let mut c = Command::new(zmem_exe());
        c.args(["run", "--limit", limit, "--swapfile", swap.to_str().unwrap(), "--"]);
        let server = Self::command(&bin.join("postgres"));
        c.arg(server.get_program()).args(server.get_args());
        // No TCP: a socket in the test's own directory.
        c.arg("-D").arg(&data).arg("-k").arg(&dir);
        c.args(["-c", "listen_addresses=", "-c", "shared_buffers=16MB", "-c", "fsync=off"]);
        // Dynamic shared memory in files of the data directory, which goes
        // with the test's: in /dev/shm a killed server's segments stayed.
        c.args(["-c", "dynamic_shared_memory_type=mmap"]);
        c.env("ZMEM_PRELOAD", preload()).env("ZMEM_STATS_DIR", &stats).env("ZMEM_STATS_INTERVAL_MS", "50");
        // The server's log and zmem's warnings, in a file: a pipe nobody
        // reads would fill and stop the server.
        c.stdout(Stdio::null()).stderr(std::fs::File::create(dir.join("server.log")).unwrap());
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        let leader = c.spawn().unwrap();
        let mut pg = Postgres { bin, dir, leader, stats };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !pg.psql("select 1").status.success() {
            assert!(pg.leader.try_wait().unwrap().is_none(), "postgres exited at start");
            assert!(Instant::now() < deadline, "postgres did not start in 60 s");
            std::thread::sleep(Duration::from_millis(200));
        }
        pg
    }

    fn psql(&self, sql: &str) -> Output {
        Command::new("psql")
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-U", "postgres", "-h"])
            .arg(&self.dir)
            .args(["-c", sql])
            .output()
            .expect("psql")
    }

    /// `sql`'s output; a failed statement fails the test.
    fn query(&self, sql: &str) -> String {
        let o = self.psql(sql);
        assert!(o.status.success(), "{sql}: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// A fast shutdown; `zmem run` then ends with the server's status.
    /// Returns it.
    fn stop(&mut self) -> std::process::ExitStatus {
        let o = Self::command(&self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["stop", "-m", "fast"])
            .output()
            .unwrap();
        assert!(o.status.success(), "pg_ctl stop: {}", text(&o));
        exit_within(&mut self.leader, 30, || "zmem run did not end after the server stopped".into())
    }
}

impl Drop for Postgres {
    /// A server still running (a check failed) is stopped at once by
    /// `pg_ctl stop -m immediate`, whose postmaster removes its shared
    /// memory (`/dev/shm/PostgreSQL.*` and its System V segment: a SIGKILL
    /// left them behind), then killed with its tree if it is still there.
    fn drop(&mut self) {
        if self.leader.try_wait().ok().flatten().is_none() {
            let _ = Self::command(&self.bin.join("pg_ctl"))
                .arg("-D")
                .arg(self.dir.join("data"))
                .args(["stop", "-m", "immediate", "-t", "20"])
                .output();
        }
        kill_group_if_running(&mut self.leader);
    }
}

/// PostgreSQL, a forking server (a process per connection, shared memory,
/// background workers), started as root does it (`zmem run -- runuser -u
/// postgres -- postgres …`), under one limit for the whole tree: a
/// backend sorts more than that limit in its private memory (`work_mem`),
/// and the result is what the same sort gives on disk (a 4 MB
/// `work_mem`: an external merge sort, little memory). A lost or stale
/// page changes the digest.
#[test]
fn postgres_sorts_past_the_tree_limit_and_agrees_with_a_sort_on_disk() {
    let mut pg = Postgres::start("48M");
    pg.query("create table t as select i, md5(i::text) as h from generate_series(1, 300000) i");
    let sort =
        |mem: &str| format!("set work_mem = '{mem}'; select count(*), md5(string_agg(h || i, ',' order by h)) from t");
    let on_disk = pg.query(&sort("4MB"));
    assert!(on_disk.starts_with("300000|"), "{on_disk}");
    assert_eq!(pg.query(&sort("256MB")), on_disk, "an in-memory sort under zmem disagrees with the sort on disk");
    let evicted = pager_max(&pg.stats, "evicted_folios");
    assert!(evicted > 500, "the backend's sort was not evicted ({evicted} folios)");
    // Every process of the tree joined it (a segment it could not open
    // would have left its peak at 0 in that process's stats). Besides the
    // slack of `tree_slack`, each process forked from the postmaster counts
    // what it inherited (~0.7-1 MiB) until its reclaim finds it shared.
    // The sorting backend maps ~85 MB.
    let peak = assert_tree_peak_within(&pg.stats, 0, 48 << 20, "");
    eprintln!(
        "evicted {evicted} folios; the tree's peak usage {} KiB; soft {} waits {}",
        peak >> 10,
        pager_max(&pg.stats, "limit_soft_events"),
        pager_max(&pg.stats, "direct_reclaim_waits")
    );
    let st = pg.stop();
    let log = std::fs::read_to_string(pg.dir.join("server.log")).unwrap();
    assert!(st.success(), "zmem run: {st:?}; {log}");
    assert!(!log.contains("takes the whole limit"), "{log}");
}

/// A MariaDB server (`mariadbd`), under `zmem run` or as is; killed if a
/// check fails.
struct Mariadb {
    dir: PathBuf,
    server: std::process::Child,
}

impl Mariadb {
    /// A new data directory in `dir` (`mariadb-install-db`, as is).
    fn install(dir: &Path) {
        let o = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .args(Self::user())
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg("--auth-root-authentication-method=normal")
            .output()
            .expect("mariadb-install-db (Debian's mariadb-server; .ci/run installs it)");
        assert!(o.status.success(), "mariadb-install-db: {}", text(&o));
    }

    /// `mariadbd`: on the path, or where Debian puts it (a PATH without
    /// `/usr/sbin`).
    fn server() -> PathBuf {
        std::env::var_os("PATH")
            .iter()
            .flat_map(std::env::split_paths)
            .chain([PathBuf::from("/usr/sbin")])
            .map(|d| d.join("mariadbd"))
            .find(|p| p.is_file())
            .expect("mariadbd (Debian's mariadb-server; .ci/run installs it)")
    }

    /// `--user=root` under root: mariadbd refuses root without it.
    fn user() -> Option<&'static str> {
        // SAFETY: geteuid has no preconditions.
        (unsafe { libc::geteuid() } == 0).then_some("--user=root")
    }

    /// Starts the server on `dir`'s data, with InnoDB's buffer pool of
    /// `pool` and its own I/O: `O_DIRECT` reads and writes through io_uring
    /// (or Linux AIO), into and out of that pool. Under `zmem run --limit
    /// LIMIT` if `limit` is given.
    fn start(dir: &Path, pool: &str, limit: Option<&str>) -> Mariadb {
        let mut c = match limit {
            Some(limit) => {
                let (stats, swap) = (dir.join("stats"), dir.join("swap"));
                for d in [&stats, &swap] {
                    std::fs::create_dir_all(d).unwrap();
                }
                let mut c = Command::new(zmem_exe());
                c.args(["run", "--limit", limit, "--swapfile", swap.to_str().unwrap(), "--"]);
                c.arg(Self::server());
                c.env("ZMEM_PRELOAD", preload()).env("ZMEM_STATS_DIR", &stats).env("ZMEM_STATS_INTERVAL_MS", "50");
                c
            }
            None => Command::new(Self::server()),
        };
        c.arg("--no-defaults").args(Self::user());
        c.arg(format!("--datadir={}", dir.join("data").display()));
        c.arg(format!("--socket={}", dir.join("sock").display()));
        c.arg(format!("--log-error={}", dir.join("error.log").display()));
        c.arg(format!("--pid-file={}", dir.join("pid").display()));
        c.args(["--skip-networking", "--innodb-flush-method=O_DIRECT", "--innodb-use-native-aio=1"]);
        c.arg(format!("--innodb-buffer-pool-size={pool}"));
        c.stdout(Stdio::null()).stderr(std::fs::File::create(dir.join("stderr.log")).unwrap());
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        let server = c.spawn().expect("start mariadbd");
        let mut db = Mariadb { dir: dir.to_path_buf(), server };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !db.client("select 1").status.success() {
            if db.server.try_wait().unwrap().is_some() || Instant::now() > deadline {
                panic!("mariadbd did not start: {}", db.log());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        db
    }

    fn client(&self, sql: &str) -> Output {
        Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", self.dir.join("sock").display()))
            // A database for `seq_1_to_N` (MariaDB's Sequence engine).
            .args(["-uroot", "-D", "mysql", "-N", "-B", "-e", sql])
            .output()
            .expect("mariadb (Debian's mariadb-client; .ci/run installs it)")
    }

    /// `sql`'s output; a failed statement fails the test.
    fn query(&self, sql: &str) -> String {
        let o = self.client(sql);
        assert!(o.status.success(), "{sql}: {}; {}", text(&o), self.log());
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    fn log(&self) -> String {
        Self::log_in(&self.dir)
    }

    /// The server's log and stderr in `dir`, for a failure.
    fn log_in(dir: &Path) -> String {
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        format!("error.log:\n{}\nstderr:\n{}", read("error.log"), read("stderr.log"))
    }

    /// A clean shutdown (SIGTERM: InnoDB writes every dirty page of its
    /// pool out); returns how the server (or `zmem run`) ended.
    fn stop(&mut self) -> std::process::ExitStatus {
        let pid: i32 = std::fs::read_to_string(self.dir.join("pid")).unwrap().trim().parse().unwrap();
        // SAFETY: signals the server this test started (its pid file);
        // kill(2) touches no memory of ours.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let dir = self.dir.clone();
        exit_within(&mut self.server, 60, || format!("mariadbd did not stop in 60 s: {}", Self::log_in(&dir)))
    }
}

impl Drop for Mariadb {
    fn drop(&mut self) {
        kill_group_if_running(&mut self.server);
    }
}

/// MariaDB's InnoDB moves its pages between disk and its buffer pool by
/// itself: `O_DIRECT` reads and writes through io_uring, which the kernel
/// does on the pool's memory (pinning its pages), not a load or store of
/// the program. Under a limit below the pool, those reads land
/// in frames zmem had evicted and the writes read from them. The table
/// then reads back as the same rows computed anew (`seq_1_to_N` touches
/// no table), and, after a clean shutdown, a server run as is finds the
/// same rows on disk: what InnoDB wrote from evicted frames was the data.
#[test]
fn mariadb_innodb_reads_and_writes_its_pool_by_o_direct_and_keeps_every_row() {
    let dir = tmpdir("mariadb");
    Mariadb::install(&dir);
    let rows = 100_000;
    let a = "concat(if(seq % 7 = 3, 'u', ''), sha2(seq, 256), '-', seq)";
    let b = "unhex(concat(sha2(seq * 7, 512), sha2(seq * 3, 256)))";
    let want = format!("select count(*), sum(crc32({a})), sum(crc32({b})) from seq_1_to_{rows}");
    let got = "select count(*), sum(crc32(a)), sum(crc32(b)) from z.t";
    let mut db = Mariadb::start(&dir, "32M", Some("24M"));
    db.query("create database z");
    db.query("create table z.t (id int primary key, a varchar(100), b varbinary(200), key(a(12))) engine=InnoDB");
    db.query(&format!("insert into z.t select seq, concat(sha2(seq, 256), '-', seq), {b} from seq_1_to_{rows}"));
    db.query("update z.t set a = concat('u', a) where id % 7 = 3");
    let expected = db.query(&want);
    assert!(expected.starts_with(&format!("{rows}\t")), "{expected}");
    assert_eq!(db.query(got), expected, "the table under zmem differs from its rows computed anew");
    // Through the secondary index: a lookup of each row in the clustered one.
    assert_eq!(
        db.query("select count(*) from z.t force index(a) where a like 'u%'"),
        db.query(&format!("select count(*) from seq_1_to_{rows} where seq % 7 = 3"))
    );
    let reads: u64 = db
        .query("show global status like 'Innodb_buffer_pool_reads'")
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    let st = db.stop();
    assert!(st.success(), "zmem run: {st:?}; {}", db.log());
    // The table is larger than the pool: InnoDB read pages back from disk.
    assert!(reads > 1000, "InnoDB read {reads} pages from disk");
    // zmem cycled the buffer pool through eviction: at least twice its
    // 32 MiB left as folios (runs here evict 9-12 times it; one under a
    // busy CI machine, 8.8 times).
    let evicted = pager_max(&dir.join("stats"), "evicted_folios");
    let pool_folios = (32 << 20) / zmem_common::defaults::FOLIO_SIZE as u64;
    assert!(evicted > 2 * pool_folios, "mariadbd's pool was not evicted ({evicted} folios)");
    let cow = pager_max(&dir.join("stats"), "cow_breaks");
    eprintln!("InnoDB read {reads} pages; zmem evicted {evicted} folios, broke {cow} pinned pages' COW");

    let mut db = Mariadb::start(&dir, "64M", None);
    assert_eq!(db.query(got), expected, "the table written under zmem differs on disk");
    let check = db.query("check table z.t");
    assert!(check.ends_with("status\tOK"), "{check}");
    assert!(db.stop().success(), "{}", db.log());
}

/// Debian's redis-server (jemalloc inside) under a limit of a fraction of
/// what it loads: it starts, takes 200k keys, saves them in the background
/// (a fork) while it serves reads, and its whole dataset is then bit for
/// bit what the same load gives a redis-server run as is (`DEBUG DIGEST`).
#[test]
fn redis_server_on_jemalloc_loads_saves_in_the_background_and_reads_back_its_keys() {
    let base = 20000 + std::process::id() % 20000;
    let load = ["debug", "populate", "200000", "key", "200"];
    // The reference: the same load, as is.
    let want = digest_as_is(base + 1, &load);

    let dir = tmpdir("redis");
    let port = base;
    let mut server = start_redis(port, &dir, Some("24M"));
    wait_for_redis(port, &mut server);
    // About 70 MiB of keys and values: several times the limit.
    let r = redis_cli(port, &load);
    let bgsave = redis_cli(port, &["bgsave"]);
    // Serve while the child writes the RDB.
    let got: Vec<String> =
        [0, 777, 123_456, 199_999].iter().map(|k| redis_cli(port, &["get", &format!("key:{k}")])).collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut info = String::new();
    while Instant::now() < deadline {
        info = redis_cli(port, &["info", "persistence"]);
        if info.contains("rdb_bgsave_in_progress:0") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let digest = redis_cli(port, &["debug", "digest"]);
    let size = redis_cli(port, &["dbsize"]);
    redis_cli(port, &["shutdown", "nosave"]);
    let o = server.wait_with_output().unwrap();
    assert_eq!(r, "OK", "{}", text(&o));
    assert!(bgsave.contains("Background saving started"), "{bgsave}; {}", text(&o));
    assert!(info.contains("rdb_last_bgsave_status:ok"), "{info}; {}", text(&o));
    let rdb = std::fs::metadata(dir.join("dump.rdb")).map(|m| m.len()).unwrap_or(0);
    assert!(rdb > 1 << 20, "dump.rdb is {rdb} bytes");
    for (k, v) in [0, 777, 123_456, 199_999].iter().zip(&got) {
        assert!(v.starts_with(&format!("value:{k}")), "key:{k} read back as {v:?}; {}", text(&o));
    }
    assert_eq!(size, "200000", "{}", text(&o));
    assert_eq!(digest, want, "the dataset differs from redis-server's as is; {}", text(&o));
    assert!(o.status.success(), "{}", text(&o));
    // zmem managed it: redis-server evicted, and the BGSAVE child ran a
    // pager of its own, which adopted the dataset it inherited.
    let stats = tmpdir("redis-stats");
    let (adopted, evicted) = (pager_max(&stats, "adopted_bytes"), pager_max(&stats, "evicted_folios"));
    assert!(adopted >= 32 << 20 && evicted > 0, "adopted {adopted} B, evicted {evicted} folios");
    assert!(std::fs::read_dir(&stats).unwrap().count() >= 2, "no stats file from the BGSAVE child");
}

/// memcached's value for key `i`: 72 to 423 bytes, so that consecutive keys
/// land in different slab classes.
fn memcached_value(i: usize) -> Vec<u8> {
    format!("v{}:", i * 7919 % 1_000_003).repeat(8 + i % 40).into_bytes()
}

/// Keys `keys` set (pipelined, `noreply`), or got back and checked byte for
/// byte, on one connection to memcached on `port`.
fn memcached_client(port: u32, keys: std::ops::Range<usize>, set: bool) -> Result<(), String> {
    use std::io::{BufRead, BufReader, Read, Write};
    let s = std::net::TcpStream::connect(("127.0.0.1", port as u16)).map_err(|e| format!("connect: {e}"))?;
    let io = |e: std::io::Error| e.to_string();
    s.set_read_timeout(Some(Duration::from_secs(120))).map_err(io)?;
    let (mut w, mut r) = (std::io::BufWriter::new(s.try_clone().map_err(io)?), BufReader::new(s));
    if set {
        for i in keys {
            let v = memcached_value(i);
            write!(w, "set key:{i} 0 0 {} noreply\r\n", v.len()).map_err(io)?;
            w.write_all(&v).map_err(io)?;
            w.write_all(b"\r\n").map_err(io)?;
        }
        // A command with a reply: every set before it was served.
        w.write_all(b"version\r\n").and_then(|()| w.flush()).map_err(io)?;
        let mut line = String::new();
        r.read_line(&mut line).map_err(io)?;
        return if line.starts_with("VERSION") { Ok(()) } else { Err(format!("after the sets: {line:?}")) };
    }
    let ids: Vec<usize> = keys.collect();
    for chunk in ids.chunks(100) {
        let names: Vec<String> = chunk.iter().map(|i| format!("key:{i}")).collect();
        write!(w, "get {}\r\n", names.join(" ")).and_then(|()| w.flush()).map_err(io)?;
        for &i in chunk {
            let mut line = String::new();
            r.read_line(&mut line).map_err(io)?;
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() != 4 || f[0] != "VALUE" || f[1] != format!("key:{i}") {
                return Err(format!("key:{i}: got {line:?}"));
            }
            let mut v = vec![0u8; f[3].parse::<usize>().map_err(|e| e.to_string())? + 2];
            r.read_exact(&mut v).map_err(io)?;
            if v[..v.len() - 2] != memcached_value(i)[..] {
                return Err(format!("key:{i} read back wrong ({} bytes)", v.len() - 2));
            }
        }
        let mut end = String::new();
        r.read_line(&mut end).map_err(io)?;
        if end != "END\r\n" {
            return Err(format!("after {} values: {end:?}", chunk.len()));
        }
    }
    Ok(())
}

/// memcached (Debian's: its own slab allocator over malloc, four worker
/// threads, a thread that grows the hash table by moving every item, and
/// LRU threads) under a limit of a third of what it holds: four clients set
/// 200k keys at once, then read them all back at once, every byte checked.
/// The hash table grows twice while the items page, so its thread walks
/// what was evicted.
#[test]
fn memcached_threads_store_and_serve_every_value_under_a_third_of_their_size() {
    let port = 20000 + (std::process::id() + 7) % 20000;
    let (swap, stats) = (tmpdir("memcached-swap"), tmpdir("memcached-stats"));
    let mut c = Command::new(zmem_exe());
    c.args(["run", "--limit", "24M", "--swapfile", swap.to_str().unwrap(), "--", "memcached"])
        .args(["-U", "0", "-l", "127.0.0.1", "-p", &port.to_string(), "-m", "1024", "-t", "4", "-u", "root", "-A"])
        .env("ZMEM_PRELOAD", preload())
        .env("ZMEM_STATS_DIR", &stats)
        .env("ZMEM_STATS_INTERVAL_MS", "50")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    std::os::unix::process::CommandExt::process_group(&mut c, 0);
    let mut server = c.spawn().expect("zmem run memcached (Debian's; .ci/run installs it)");
    let n = 200_000;
    let mut run = || -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port as u16)).is_err() {
            if Instant::now() > deadline || !matches!(server.try_wait(), Ok(None)) {
                return Err("memcached did not start".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        for set in [true, false] {
            let quarter = n / 4;
            let clients: Vec<_> = (0..4)
                .map(|t| std::thread::spawn(move || memcached_client(port, t * quarter..(t + 1) * quarter, set)))
                .collect();
            for c in clients {
                c.join().map_err(|_| "a client panicked".to_string())??;
            }
        }
        Ok(())
    };
    let r = run();
    // `shutdown` (-A) ends it cleanly; the group kill below ends a hang.
    if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port as u16)) {
        let _ = std::io::Write::write_all(&mut s, b"shutdown\r\n");
    }
    wait_or_kill_group(&mut server, 60, "memcached under zmem after shutdown");
    let o = server.wait_with_output().unwrap();
    assert!(r.is_ok(), "{}; {}", r.unwrap_err(), text(&o));
    assert!(!text(&o).contains("zmem:"), "{}", text(&o));
    let evicted = pager_max(&stats, "evicted_folios");
    assert!(evicted > 1000, "evicted {evicted} folios: memcached's slabs were not managed; {}", text(&o));
    assert_tree_peak_within(&stats, 0, 24 << 20, "");
}

/// OpenSSH's server, a forking server that sandboxes its
/// pre-authentication child: `RLIMIT_FSIZE` and `RLIMIT_NOFILE` set to 0,
/// then a seccomp filter that kills the thread at any call it does not
/// list. The shim's `unlink` of its stats file at that child's exit was
/// such a call: zmem's threads kept the child alive, and every `ssh` hung
/// after authentication. Three logins each run python3, which writes 4x
/// the limit under the same tree and hashes it.
#[test]
fn ssh_logins_to_a_server_under_zmem_run_run_their_commands_and_end() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(root, "sshd's privilege separation needs root: run the tests as root (scripts/test)");
    let dir = tmpdir("sshd");
    for key in ["host", "user"] {
        let st = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(dir.join(key))
            .status()
            .expect("ssh-keygen (.ci/run installs openssh-client)");
        assert!(st.success());
    }
    std::fs::copy(dir.join("user.pub"), dir.join("authorized_keys")).unwrap();
    let port = 30000 + std::process::id() % 20000;
    let config = format!(
        "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host\nPermitRootLogin yes\n\
         AuthorizedKeysFile {d}/authorized_keys\nStrictModes no\nPasswordAuthentication no\nUsePAM no\n\
         PidFile {d}/sshd.pid\n",
        d = dir.display()
    );
    std::fs::write(dir.join("sshd_config"), config).unwrap();
    // sshd's privilege separation directory, made by its service otherwise.
    let privsep = Path::new("/run/sshd");
    let made = !privsep.exists();
    if made {
        std::fs::create_dir(privsep).unwrap();
    }
    let mut c = Command::new(zmem_exe());
    c.args(["run", "--limit", "64M", "--", "/usr/sbin/sshd", "-D", "-e", "-f"]).arg(dir.join("sshd_config"));
    // The stats in the user's default directory, where each file goes at
    // its process's exit (with `ZMEM_STATS_DIR` it stays, and the child's
    // exit made no call its filter forbids).
    c.env("ZMEM_PRELOAD", preload()).env_remove("ZMEM_STATS_DIR");
    let log = dir.join("sshd.log");
    c.stdout(Stdio::null()).stderr(std::fs::File::create(&log).unwrap());
    std::os::unix::process::CommandExt::process_group(&mut c, 0);
    let mut server = c.spawn().expect("zmem run -- /usr/sbin/sshd (.ci/run installs openssh-server)");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port as u16)).is_err() {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(server.try_wait().unwrap().is_none(), "sshd exited at start: {log}");
        assert!(Instant::now() < deadline, "sshd did not listen in 30 s: {log}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Its resident memory last: under the 64M limit, well below the 256 MiB
    // it wrote.
    let py = "import hashlib\n\
              b = bytearray(256 << 20)\n\
              for i in range(0, len(b), 4096): b[i] = i // 4096 % 251\n\
              print(\"sha\", hashlib.sha256(b).hexdigest())\n\
              print(\"rss\", [l.split()[1] for l in open(\"/proc/self/status\") if l.startswith(\"VmRSS\")][0])\n";
    // The same, without zmem.
    let native = Command::new("python3").args(["-c", py]).output().unwrap();
    let native = String::from_utf8_lossy(&native.stdout).to_string();
    let want = native.lines().next().unwrap_or_default().to_string();
    assert!(want.starts_with("sha "), "{native}");
    let mut outs = Vec::new();
    for _ in 0..3 {
        let mut ssh = Command::new("ssh");
        ssh.args(["-q", "-p", &port.to_string(), "-i"]).arg(dir.join("user"));
        ssh.args(["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]);
        ssh.arg("root@127.0.0.1").arg(format!("python3 -c '{py}'"));
        let Ok(o) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| output_within(&mut ssh, 120, "ssh")))
        else {
            outs.push(format!("hung; server: {}", group_threads(server.id())));
            break;
        };
        let (status, out, err) = (o.status, String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        outs.push(format!("{status}: {out}{err}"));
    }
    // SAFETY: signals the process group this test made; kill(2) touches no
    // memory of ours.
    unsafe { libc::kill(-(server.id() as i32), libc::SIGTERM) };
    let _ = server.wait();
    // And what is left of the group: a hung child (zmem's threads block
    // SIGTERM) would stay behind.
    // SAFETY: as above.
    unsafe { libc::kill(-(server.id() as i32), libc::SIGKILL) };
    // The sandboxed child chroots into it as root: zmem's stats thread made
    // its default directory there.
    let left: Vec<_> = std::fs::read_dir(privsep).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    if made {
        let _ = std::fs::remove_dir_all(privsep);
    }
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(left.is_empty(), "left in sshd's new root: {left:?}\n{log}");
    assert_eq!(outs.len(), 3, "{outs:?}\n{log}");
    for o in &outs {
        assert!(o.starts_with("exit status: 0") && o.contains(&want), "{outs:?}\n{log}");
        // What the sessions started was managed, under the server's limit.
        let rss: u64 = o.split("rss ").nth(1).and_then(|r| r.split_whitespace().next()?.parse().ok()).unwrap_or(0);
        assert!(rss > 0 && rss < 160 << 10, "VmRSS {rss} kB: {outs:?}\n{log}");
    }
}
