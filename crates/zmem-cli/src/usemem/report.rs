//! The report: one table with ratios against the kernel, and an SVG chart.

use std::io::Write;
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

#[derive(Debug, Serialize)]
pub(super) struct RunReport {
    pub(super) config: String,
    pub(super) workers: usize,
    pub(super) bytes_per_worker: usize,
    pub(super) limit: usize,
    pub(super) elapsed_secs: f64,
    pub(super) write_mbps: f64,
    pub(super) read_mbps: f64,
    /// usemem's throughput: bytes written and read back per second, all workers.
    pub(super) total_kbps: f64,
    pub(super) avg_kbps_per_worker: f64,
    pub(super) sys_secs: f64,
    pub(super) user_secs: f64,
    /// Pages stored and loaded over the whole run.
    pub(super) zswpout: u64,
    pub(super) zswpin: u64,
    /// zmem: pages evicted again unchanged since their load, whose kept
    /// entry was reused (not compressed, not counted in zswpout).
    pub(super) cached_reused: u64,
    /// zmem: the pager's metadata (folio tables, lists, tier entries) per
    /// managed page, at the end of writing (the most of any worker).
    pub(super) metadata_bytes_per_page: Option<f64>,
    pub(super) rejects: u64,
    pub(super) written_back_pages: u64,
    /// Swap-file bytes written per page written back, at the end of writing
    /// (4096 would be raw writeback).
    pub(super) writeback_bytes_per_page: Option<f64>,
    /// Uncompressed bytes in the pool over pool bytes, at the end of writing.
    pub(super) pool_ratio: Option<f64>,
    pub(super) mismatched_pages: u64,
    /// Peak memory as the OS sees it, all workers: for zmem, peak RSS
    /// (pages, pool, metadata) plus the swap file's page cache; for the
    /// kernel, the cgroup's max_usage_in_bytes plus zswap's pool, which
    /// cgroup v1 does not charge; for none, peak RSS.
    pub(super) peak_footprint_bytes: u64,
    /// Total throughput over the kernel config's of the same run (the
    /// first `kernel:*`), where there was one.
    pub(super) vs_kernel: Option<f64>,
    /// Elapsed time over the `none` config's of the same run, where there
    /// was one.
    pub(super) elapsed_vs_none: Option<f64>,
}

/// Fills each report's ratios against the run's baselines: the first
/// kernel config (throughput) and `none` (elapsed).
pub(super) fn compare_with_baselines(reports: &mut [RunReport]) {
    let kernel = reports.iter().find(|r| r.config.starts_with("kernel")).map(|r| r.total_kbps);
    let none = reports.iter().find(|r| r.config == "none").map(|r| r.elapsed_secs);
    for r in reports {
        r.vs_kernel = kernel.filter(|&k| k > 0.0).map(|k| r.total_kbps / k);
        r.elapsed_vs_none = none.filter(|&n| n > 0.0).map(|n| r.elapsed_secs / n);
    }
}

pub(super) fn print_table(reports: &[RunReport]) -> Result<()> {
    let base = reports.iter().find(|r| r.config.starts_with("kernel"));
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:<16} {:>8} {:>9} {:>9} {:>11} {:>11} {:>7} {:>9} {:>9} {:>7} {:>6} {:>10}  {}",
        "config",
        "elapsed",
        "write MB/s",
        "read MB/s",
        "total KB/s",
        "avg KB/s",
        "sys s",
        "zswpout",
        "zswpin",
        "rejects",
        "ratio",
        "peak MiB",
        base.map_or(String::new(), |b| format!("vs {}", b.config))
    )?;
    for r in reports {
        let vs = base.map_or(String::new(), |b| {
            format!(
                "total {:.2}x (write {:.2}x, read {:.2}x), elapsed {:.2}x",
                r.total_kbps / b.total_kbps,
                r.write_mbps / b.write_mbps,
                r.read_mbps / b.read_mbps,
                r.elapsed_secs / b.elapsed_secs
            )
        });
        writeln!(
            out,
            "{:<16} {:>7.2}s {:>10.0} {:>9.0} {:>11.0} {:>11.0} {:>7.2} {:>9} {:>9} {:>7} {:>6} {:>10}  {}",
            r.config,
            r.elapsed_secs,
            r.write_mbps,
            r.read_mbps,
            r.total_kbps,
            r.avg_kbps_per_worker,
            r.sys_secs,
            r.zswpout,
            r.zswpin,
            r.rejects,
            r.pool_ratio.map_or("-".into(), |x| format!("{x:.2}")),
            r.peak_footprint_bytes >> 20,
            vs
        )?;
    }
    Ok(())
}

/// Write and read-back MB/s per configuration, as grouped bars.
pub(super) fn chart(reports: &[RunReport], path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let max = reports.iter().map(|r| r.write_mbps.max(r.read_mbps)).fold(1.0, f64::max) * 1.15;
    let root = SVGBackend::new(path, (200 + 160 * reports.len() as u32, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let n = reports.len();
    let mut c = ChartBuilder::on(&root)
        .caption("zmem usemem: write and read-back MB/s", ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..n as f64, 0.0..max)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = (*x - 0.5).round() as usize;
            reports.get(i).map_or(String::new(), |r| r.config.clone())
        })
        .y_desc("MB/s")
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let bars = |get: fn(&RunReport) -> f64, off: f64, color: RGBColor| {
        reports
            .iter()
            .enumerate()
            .map(move |(i, r)| Rectangle::new([(i as f64 + off, 0.0), (i as f64 + off + 0.35, get(r))], color.filled()))
    };
    c.draw_series(bars(|r| r.write_mbps, 0.12, RGBColor(66, 133, 244)))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .label("write")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], RGBColor(66, 133, 244).filled()));
    c.draw_series(bars(|r| r.read_mbps, 0.53, RGBColor(234, 67, 53)))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .label("read back")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], RGBColor(234, 67, 53).filled()));
    c.configure_series_labels().border_style(BLACK).draw().map_err(|e| anyhow::anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}
