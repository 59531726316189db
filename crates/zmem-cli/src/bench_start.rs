//! `zmem bench start`: what a short program pays to start and exit under
//! `zmem run`, while memory is plentiful, against the same program run as
//! is, alternated in one run: once as `zmem run`'s own program (zmem run's
//! start included), and once a process of a tree that is running already,
//! as each process of a build or a shell script is (`--chain` runs of the
//! program, one after the other, from one `sh`, native and under `zmem
//! run`; the difference over the count is what each process pays).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Runs of each, alternated (native, zmem, native, ...).
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// The limit `zmem run` gets: far above what the program uses, so that
    /// nothing is evicted and only the fixed cost is measured.
    #[arg(long, default_value = "1G")]
    limit: String,
    /// Runs of the program from one shell, for the cost a process pays
    /// inside a tree (0: not measured).
    #[arg(long, default_value_t = 20)]
    chain: usize,
    #[arg(long)]
    json: bool,
    /// The program [default: python3 -c pass].
    #[arg(last = true)]
    cmd: Vec<String>,
}

/// Runs `cmd` once, its output discarded; the wall time in milliseconds.
fn time_once(cmd: &mut Command) -> Result<f64> {
    let t = Instant::now();
    let st = cmd.stdin(Stdio::null()).stdout(Stdio::null()).status().context("start the program")?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if !st.success() {
        bail!("the program failed: {st}");
    }
    Ok(ms)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub fn run(args: &Args) -> Result<()> {
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let cmd: Vec<String> =
        if args.cmd.is_empty() { vec!["python3".into(), "-c".into(), "pass".into()] } else { args.cmd.clone() };
    let zmem: PathBuf = std::env::current_exe().context("the zmem binary")?;
    let (mut native, mut managed) = (Vec::new(), Vec::new());
    for _ in 0..args.runs {
        native.push(time_once(Command::new(&cmd[0]).args(&cmd[1..]))?);
        managed.push(time_once(Command::new(&zmem).args(["run", "--limit", &args.limit, "--"]).args(&cmd))?);
    }
    let (n, z) = (median(&mut native), median(&mut managed));
    let (n_min, z_min) = (native[0], managed[0]);
    // The same program `chain` times from one `sh`: "$@" is the command.
    let chained = (args.chain > 0).then(|| {
        let script = format!("i=0; while [ $i -lt {} ]; do \"$@\"; i=$((i+1)); done", args.chain);
        let sh = |c: &mut Command| {
            c.args(["sh", "-c", &script, "sh"]).args(&cmd);
        };
        let (mut native, mut managed) = (Vec::new(), Vec::new());
        for _ in 0..args.runs.div_ceil(4).max(3) {
            let mut c = Command::new("env");
            sh(&mut c);
            native.push(time_once(&mut c)?);
            let mut c = Command::new(&zmem);
            c.args(["run", "--limit", &args.limit, "--"]);
            sh(&mut c);
            managed.push(time_once(&mut c)?);
        }
        let per = |v: &mut Vec<f64>| median(v) / args.chain as f64;
        anyhow::Ok((per(&mut native), per(&mut managed)))
    });
    let chained = chained.transpose()?;
    if args.json {
        let v = serde_json::json!({
            "cmd": cmd,
            "runs": args.runs,
            "limit": args.limit,
            "native_ms_median": n,
            "zmem_ms_median": z,
            "native_ms_min": n_min,
            "zmem_ms_min": z_min,
            "extra_ms_median": z - n,
            "zmem_vs_native": z / n,
            "chain": args.chain,
            "chain_native_ms_per_process": chained.map(|c| c.0),
            "chain_zmem_ms_per_process": chained.map(|c| c.1),
            "chain_extra_ms_per_process": chained.map(|c| c.1 - c.0),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("{} runs each, alternated: {}", args.runs, cmd.join(" "));
        println!("{:<18} {:>12} {:>10}", "", "median ms", "min ms");
        println!("{:<18} {n:>12.2} {n_min:>10.2}", "native");
        println!("{:<18} {z:>12.2} {z_min:>10.2}", format!("zmem run {}", args.limit));
        println!("start and exit cost: {:+.2} ms a run (median), {:.2}x native", z - n, z / n);
        if let Some((cn, cz)) = chained {
            println!(
                "in a running tree ({} runs from one sh): native {cn:.2} ms, zmem {cz:.2} ms a process, {:+.2} ms",
                args.chain,
                cz - cn
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
