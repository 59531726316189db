//! `zmem bench start`: what a short program pays to start and exit under
//! `zmem run`, while memory is plentiful, against the same program run as
//! is, alternated in one run.

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
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("{} runs each, alternated: {}", args.runs, cmd.join(" "));
        println!("{:<18} {:>12} {:>10}", "", "median ms", "min ms");
        println!("{:<18} {n:>12.2} {n_min:>10.2}", "native");
        println!("{:<18} {z:>12.2} {z_min:>10.2}", format!("zmem run {}", args.limit));
        println!("start and exit cost: {:+.2} ms a run (median), {:.2}x native", z - n, z / n);
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
