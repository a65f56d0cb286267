"""What the collectors of ``kvbench run`` write beside the records (engine KV usage, queue,
prefix hits; GPU SM and HBM by role), read for the live view as their shards grow, through the
store's tail (``core.shards.ShardTail``). pyarrow is imported only once a collector has written
a shard and a view of it is asked for: a plain locust run never does."""

from __future__ import annotations

import collections
from pathlib import Path

from kvbench.core.rows import shard_files


class TelemetryTail:
    """What the collectors of ``kvbench run`` (its own threads, another process) write to the
    run directory: ``engine-*.arrows`` and ``gpu-*.arrows``, read as they grow. A plain locust
    run starts no collectors, and this says so."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.tails: dict = {}  # table -> core.shards.ShardTail, once a collector wrote one
        self.engine: collections.deque = collections.deque(maxlen=200_000)  # (t, ep, m, v)
        self.gpu: dict[tuple, dict] = {}  # (host, gpu) -> latest row

    def poll(self) -> None:
        for table in ("engine", "gpu"):
            if table not in self.tails:
                if not shard_files(self.run_dir, table):
                    continue  # no collector: pyarrow stays out of the load process
                from kvbench.core.shards import ShardTail  # the store's one tail

                self.tails[table] = ShardTail(self.run_dir, table)
            for b in self.tails[table].new():
                if table == "engine":
                    t, ep, m, v = (b.column(c).to_pylist() for c in
                                   ("t_ns", "endpoint", "metric", "value"))
                    self.engine.extend(zip(t, ep, m, v))
                else:
                    for row in b.to_pylist():
                        self.gpu[(row["host"], row["gpu"])] = row

    def summary(self, window_s: float) -> dict:
        from kvbench.engines import detect

        self.poll()
        if not self.tails:
            return {"note": "collectors not running (kvbench run starts them; a plain locust "
                            "run has no engine or GPU figures)"}
        engines = {}
        by_ep: dict[str, dict] = {}
        for t, ep, m, v in self.engine:
            by_ep.setdefault(ep, {}).setdefault(m, []).append((t, v))
        for ep, series in by_ep.items():
            a = detect(series)
            if a is None:
                continue
            last = {m: sum(v for _, v in _latest_set(s)) for m, s in series.items()}
            hits = a.hit_counters()
            ratio = None
            if hits:
                inc = [_increase(series.get(n, []), window_s) for n in hits]
                ratio = a.hit_ratio(*inc) if None not in inc else None
            engines[ep] = {"engine": a.name, "kv_usage": last.get(a.kv_usage),
                           "waiting": last.get(a.waiting), "running": last.get(a.running),
                           "hit_ratio": ratio}
        roles: dict[str, dict] = {}
        for row in self.gpu.values():  # rows of the gpu schema: every column is there
            r = roles.setdefault(row["role"] or "unknown", {"gpus": 0, "sm": [],
                                                                "hbm_used": 0, "hbm_total": 0})
            r["gpus"] += 1
            sm = row["sm_active"]
            if sm is None and row["gpu_util_pct"] is not None:
                sm = row["gpu_util_pct"] / 100.0
            if sm is not None:
                r["sm"].append(sm)
            r["hbm_used"] += row["hbm_used_bytes"] or 0
            r["hbm_total"] += row["hbm_total_bytes"] or 0
        gpu = {k: {"gpus": v["gpus"], "sm_active": sum(v["sm"]) / len(v["sm"]) if v["sm"]
                   else None, "hbm_used_bytes": v["hbm_used"], "hbm_total_bytes": v["hbm_total"]}
               for k, v in roles.items()}
        return {"engines": engines, "gpu_by_role": gpu}


def _latest_set(points: list) -> list:
    """The samples of the last scrape of a series (several label sets share its time)."""
    t = points[-1][0]
    return [p for p in points if p[0] == t]


def _increase(points: list, window_s: float) -> float | None:
    """A counter's increase over the window (sum over its label sets at the first and last
    scrape inside it)."""
    if not points:
        return None
    t_end = points[-1][0]
    inside = [p for p in points if p[0] >= t_end - window_s * 1e9]
    t_first = inside[0][0]
    first = sum(v for t, v in inside if t == t_first)
    last = sum(v for t, v in inside if t == t_end)
    return max(last - first, 0.0)
