"""``kvbench run``'s progress line while a Locust child runs: per stage, elapsed / planned time,
requests done, the current TTFT p50 and the error count, redrawn in place about once a second.

The load processes tell it through ``live-<host>-<pid>.json`` in the run directory (written by
``kvbench.loadgen.liveview.live`` once a second under kvbench run, removed when the process closes its
records): counts per stage, the stage now open and its recent TTFTs, so the p50 is exact over
the processes' last requests. Quiet when stdout is not a terminal (CI logs stay readable: the
per-job lines are all they get).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kvbench.core.contract import StageEntry
from kvbench.core.rows import shard_stem

LIVE_PREFIX = "live-"
POLL_S = 0.5
BAR = 20  # characters of the bar


def live_path(run_dir: Path | str) -> Path:
    """This process's live file in ``run_dir``."""
    return Path(run_dir) / f"{LIVE_PREFIX}{shard_stem()}.json"


def read_live(run_dir: Path | str) -> list[dict]:
    """Every load process's live file (one being replaced, or half gone, is skipped)."""
    out = []
    for p in sorted(Path(run_dir).glob(f"{LIVE_PREFIX}*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict):
            out.append(d)
    return out


def line(job, lives: list[dict], now_ns: int | None = None,
         ended: StageEntry | None = None) -> str | None:
    """The progress line of ``job`` from its processes' live files (None before any);
    ``ended``: a stage that has just ended (its line once more, with the latest counts)."""
    if not lives:
        return None
    now_ns = now_ns or time.time_ns()
    st = ended or _open(lives)
    if st is None:
        return None
    index = st.index
    planned = float(st.duration_s or 0.0)
    elapsed = max(0.0, (now_ns - (st.t_start_ns or now_ns)) / 1e9)
    if ended is not None:
        elapsed = min(elapsed, planned)
    done = errors = 0
    for d in lives:
        c = (d.get("stages") or {}).get(str(index)) or {}
        done += int(c.get("done", 0))
        errors += int(c.get("errors", 0))
    ttft = np.asarray([v for d in lives for v in d.get("ttft_ms_recent") or ()], float)
    p50 = f"{np.quantile(ttft, 0.5):.0f} ms" if len(ttft) else "-"
    n_stages = len(job.stages) if job.pacing != "closed" else 1
    k = index + 1 if job.pacing != "closed" else 1
    long_stage = planned >= 24 * 3600  # a trace stage without an end: no bar
    frac = min(1.0, elapsed / planned) if planned > 0 and not long_stage else 0.0
    bar = "#" * int(round(frac * BAR)) + "." * (BAR - int(round(frac * BAR)))
    plan = "" if long_stage else f"/{planned:.0f}"
    what = f"{st.rate_rps} req/s" if st.rate_rps else f"{st.users} users"
    return (f"  stage {k}/{n_stages} ({what}) [{bar}] {elapsed:.0f}{plan} s  {done} done  "
            f"TTFT p50 {p50}  {errors} errors")


class Progress:
    """Redraws the job's progress line in a thread while its Locust child runs; a finished
    stage's line stays on screen. Does nothing when ``stream`` is not a terminal."""

    def __init__(self, job, run_dir: Path | str, stream=None, poll_s: float = POLL_S) -> None:
        self.job = job
        self.run_dir = Path(run_dir)
        self.stream = stream or sys.stdout
        self.poll_s = poll_s
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread = None
        self._last = ""
        self._stage = None  # the open stage of the line on screen

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, name="kvbench-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            if self._last:
                self._write("\n")
        for p in self.run_dir.glob(f"{LIVE_PREFIX}*.json"):  # the job's processes are gone
            p.unlink(missing_ok=True)

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed terminal: progress is not worth an error
            self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                lives = read_live(self.run_dir)
                text = line(self.job, lives)
                if text is None:
                    continue
                st = _open(lives)  # there is one: the line was drawn
                if self._stage is not None and st.index != self._stage.index:
                    self._draw(line(self.job, lives, ended=self._stage) or self._last)
                    self._write("\n")  # the stage that ended keeps its line
                    self._last = ""
                self._stage = st
                self._draw(text)
            except Exception:  # noqa: BLE001 - a progress line must never fail the run
                continue

    def _draw(self, text: str) -> None:
        if text != self._last:
            self._write("\r" + text + " " * max(0, len(self._last) - len(text)))
            self._last = text


def _open(lives: list[dict]) -> StageEntry | None:
    """The latest stage open in any process (the live files carry it as its JSON object)."""
    opened = [StageEntry.from_dict(d["state"]["open_stage"]) for d in lives
              if isinstance(d.get("state"), dict)
              and isinstance(d["state"].get("open_stage"), dict)]
    return max(opened, key=lambda s: s.index) if opened else None
