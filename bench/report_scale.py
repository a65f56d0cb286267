"""Wall time and peak RSS of the real ``kvbench report`` on N synthetic requests (issue 34: 1M
in at most 10 s; 10M in at most 60 s and 2 GB on 2 cores), each report in a child process
whose peak comes from ``os.wait4``'s ``ru_maxrss``; with ``--compare``, the in-memory path on
the same run too (``render(..., max_requests=huge)``: the request frame), and the ratios.

Synthesis (not timed) streams batches into one requests.parquet
(``bench/reports_columnar.synthesise``); its disk use is printed.

Usage: python bench/report_scale.py [--rows 1000000] [--format html|md] [--keep DIR]
       [--compare]

With ``--compare --format md`` the Summary tables of both reports (the figures the out-of-core
path computes over every request) are compared row by row and the differences printed: counts,
rates and exact percentiles must agree to the last printed digit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

_IN_MEMORY = ("import sys; from pathlib import Path; "
              "from kvbench.reports.rendering.render import render; "
              "t = render([Path(sys.argv[1])], sys.argv[2], history=0, max_requests=10**15); "
              "Path(sys.argv[3]).write_text(t)")


def measure(cmd: list[str]) -> tuple[float, float, int]:
    """(seconds, peak RSS GB, exit status) of ``cmd`` run as a child."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    secs = time.perf_counter() - t
    err = proc.stderr.read().decode(errors="replace")
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        print(err[-3000:], file=sys.stderr)
    return secs, usage.ru_maxrss * 1024 / 1e9, proc.returncode


def _summary(md: str) -> list[str]:
    """The rows of the Markdown report's first Summary table (header ``| metric |``): the
    figures the out-of-core path computes over every request."""
    rows, inside = [], False
    for line in md.splitlines():
        if line.startswith("| metric |") and not rows:
            inside = True
        if inside:
            if not line.startswith("|"):
                break
            rows.append(line.rstrip())
    return rows


def same_tables(ooc: str, mem: str) -> tuple[list[str], int]:
    """(the Summary rows that differ between the two Markdown reports, as "row vs row" lines;
    the rows compared)."""
    a, b = _summary(ooc), _summary(mem)
    diff = [f"{x!r} vs {y!r}" for x, y in zip(a, b) if x != y]
    if len(a) != len(b) or not a:
        diff.append(f"{len(a)} Summary rows out of core, {len(b)} in memory")
    return diff, max(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--format", choices=("html", "md"), default="html")
    ap.add_argument("--keep", type=Path, default=None, help="write the run here and keep it")
    ap.add_argument("--compare", action="store_true",
                    help="also time the in-memory path (needs ~1.2 GB per million requests)")
    args = ap.parse_args()
    from reports_columnar import synthesise

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.keep or Path(tmp) / "bench-report-scale"
        if not (run_dir / "run.json").exists():
            t = time.perf_counter()
            synthesise(run_dir, args.rows)
            print(f"synthesis took {time.perf_counter() - t:.1f} s (not timed)")
        out = Path(tmp) / f"report.{args.format}"
        secs, peak, rc = measure([sys.executable, "-m", "kvbench", "report", str(run_dir),
                                  "--format", args.format, "-o", str(out), "--history", "0"])
        size = out.stat().st_size / 1e6 if out.exists() else float("nan")
        print(f"kvbench report (out of core): {secs:7.2f} s, peak RSS {peak:.2f} GB, "
              f"exit {rc}, {size:.1f} MB {args.format}, {os.cpu_count()} CPUs")
        if args.compare:
            mem_out = Path(tmp) / f"report-mem.{args.format}"
            msecs, mpeak, mrc = measure([sys.executable, "-c", _IN_MEMORY, str(run_dir),
                                         args.format, str(mem_out)])
            print(f"in-memory report           : {msecs:7.2f} s, peak RSS {mpeak:.2f} GB, "
                  f"exit {mrc}")
            print(f"ratios in-memory/out-of-core: time {msecs / secs:.2f}x, "
                  f"peak RSS {mpeak / peak:.2f}x")
            if args.format == "md" and out.exists() and mem_out.exists():
                same, rows = same_tables(out.read_text(), mem_out.read_text())
                print(f"the Summary's figures over every request ({rows} rows): "
                      + ("identical to the in-memory path, to the last digit" if not same
                         else "DIFFER from the in-memory path:\n  " + "\n  ".join(same)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
