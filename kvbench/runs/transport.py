"""Records that travel from Locust workers to their master, with no shared disk (issue 15): the
pure parts, free of Locust, gevent and pyarrow (``kvbench.loadgen.fleet.distributed`` does the
messaging).

A worker's sink writes each batch to its own local spool as before and also hands it to an
``Outbox``: the batch's column lists, packed as a one-batch rows stream (``kvbench.core.rows``:
a msgpack header naming the columns, then the batch), get the next sequence number and stay in
memory until the master acknowledges that number. The master's ``Inbox`` checks each batch it
has not seen and appends it, as it came, to the run's rows shards (one per worker:
``requests-<master>-<worker>.rows``, through ``RowShardWriter``), each sidecar a worker sends as
that worker's ``proc-<worker>.json``, and answers with the numbers it holds. Finalize then reads
the master's run directory alone, converting the rows to Parquet.

A worker that falls silent (killed, its host gone) is declared lost by the master: its sidecar
is closed with a ``lost`` account, ``missing`` = the requests it had started by its last sidecar
less the records that reached the master (at most its last unacknowledged second, the sink
flushing every half second), and run.json's ``workers`` names it.

Clock offsets: the master pings each worker with its own time ``t0``; the worker answers with
its clock ``t_w``; at ``t1`` the master has ``offset_add = (t0 + t1) / 2 - t_w`` (the round trip
of smallest RTT wins), as the collectors do with their remote agents.
"""

from __future__ import annotations

import collections
import copy
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.core import rows
from kvbench.core.contract import Incomplete, ProcMeta

RECORDS_MSG = "kvbench_records"  # worker -> master: {w, seq, kind, data}
ACK_MSG = "kvbench_ack"  # master -> worker: {seqs: [...]}
PING_MSG = "kvbench_clock"  # master -> worker: {t0}
PONG_MSG = "kvbench_clock_reply"  # worker -> master: {w, t0, t_w}
KINDS = ("requests", "starts", "meta")
RESEND_AFTER_S = 5.0  # an unacknowledged batch is sent again after this long
SILENT_LOST_S = 5.0  # a worker that sent nothing for this long (sidecars come every 0.5 s) is lost


def encode(kind: str, cols) -> bytes:
    """One batch (its column lists, in ``rows.COLUMNS[kind]`` order) as a rows stream."""
    return rows.pack(kind, rows.COLUMNS[kind], cols)


def decode(kind: str, data: bytes) -> tuple[list[str], bytes, int]:
    """A batch's rows stream, checked: (its column names, the batch as packed, its rows). The
    batch is walked, not unpacked (a third of the cost): one list of the header's columns,
    each a list of one length, every value whole msgpack. A stream that is not one such batch
    of ``kind`` is a ``ValueError``."""
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"a {kind} batch that is not bytes")
    unpacker = rows.unpacker()
    unpacker.feed(data)
    try:
        head = unpacker.unpack()
        problem = rows.header_problem(head, kind)
        if problem:
            raise ValueError(problem)
        start = unpacker.tell()
        if unpacker.read_array_header() != len(head["columns"]):
            raise ValueError(f"a batch that is not a list of its {len(head['columns'])} columns")
        lengths = set()
        for _ in head["columns"]:
            n = unpacker.read_array_header()
            lengths.add(n)
            for _ in range(n):
                unpacker.skip()
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack's errors: OutOfData, FormatError, ...
        raise ValueError(f"a {kind} batch that does not unpack ({type(exc).__name__})") from None
    if len(lengths) > 1:
        raise ValueError("a batch whose columns are not lists of one length")
    if unpacker.tell() != len(data):
        raise ValueError("a batch with bytes after it")
    return head["columns"], bytes(data[start:]), lengths.pop() if lengths else 0


def stem_of(worker: str) -> str:
    """A worker name ``host:pid`` as a file-name part, as ``rows.shard_stem`` makes it."""
    host, _, pid = str(worker).rpartition(":")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{host}-{pid}" if host else str(worker))


# --------------------------------------------------------------------------- worker side


class Outbox:
    """A worker's batches not yet acknowledged by the master. ``put`` may be called from any
    thread (the sink writes on gevent's native thread pool); ``take`` and ``ack`` from the
    event loop."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self._new: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.unacked: dict[int, dict] = {}  # seq -> message
        self._sent_at: dict[int, float] = {}
        self.seq = 0
        self.sent = 0
        self.acked = 0
        self.bytes_sent = 0

    def put(self, kind: str, payload) -> None:
        """A batch (``requests``, ``starts``: its column lists in ``rows.COLUMNS[kind]``
        order, packed here, off the loop) or a sidecar (``meta``: a dict)."""
        if kind not in KINDS:
            raise ValueError(f"unknown record kind {kind!r}")
        data = copy.deepcopy(payload) if kind == "meta" else encode(kind, payload)
        with self._lock:
            self._new.append((kind, data))

    def take(self, now: float | None = None, resend_after_s: float = RESEND_AFTER_S
             ) -> list[dict]:
        """Messages to send now: every new item (numbered here, in order), and any sent
        ``resend_after_s`` ago and still not acknowledged."""
        now = time.monotonic() if now is None else now
        out = []
        with self._lock:
            while self._new:
                kind, data = self._new.popleft()
                self.seq += 1
                msg = {"w": self.worker, "seq": self.seq, "kind": kind, "data": data}
                self.unacked[self.seq] = msg
                self._sent_at[self.seq] = now
                out.append(msg)
        for seq, msg in self.unacked.items():
            if msg not in out and now - self._sent_at[seq] >= resend_after_s:
                self._sent_at[seq] = now
                out.append(msg)
        self.sent += len(out)
        self.bytes_sent += sum(len(m["data"]) for m in out if isinstance(m["data"], bytes))
        return out

    def ack(self, seqs) -> None:
        for seq in seqs:
            if self.unacked.pop(int(seq), None) is not None:
                self._sent_at.pop(int(seq), None)
                self.acked += 1

    def pending(self) -> int:
        """Items not yet acknowledged (queued or sent)."""
        with self._lock:
            return len(self._new) + len(self.unacked)

    def resend_all(self) -> list[dict]:
        """Every unacknowledged message now (the close: a last chance to get them across)."""
        return self.take(resend_after_s=0.0)


# --------------------------------------------------------------------------- master side


@dataclass
class ClockEstimate:
    """NTP-style offset of one remote clock: the round trip of smallest RTT wins."""

    offset_add_ns: int | None = None
    rtt_ns: int | None = None
    samples: int = 0

    def add(self, t0_ns: int, t_remote_ns: int, t1_ns: int) -> None:
        rtt = t1_ns - t0_ns
        if rtt < 0:
            return
        self.samples += 1
        if self.rtt_ns is None or rtt < self.rtt_ns:
            self.rtt_ns = rtt
            self.offset_add_ns = (t0_ns + t1_ns) // 2 - t_remote_ns


@dataclass
class WorkerState:
    name: str
    node: str | None = None  # Locust's client id
    seqs: set = field(default_factory=set)
    batches: int = 0
    records: int = 0
    starts: int = 0
    duplicates: int = 0
    bytes: int = 0
    last_seen: float = 0.0
    meta: ProcMeta | None = None  # the last sidecar it sent
    closed: bool = False
    lost: dict | None = None
    clock: ClockEstimate = field(default_factory=ClockEstimate)
    writers: dict = field(default_factory=dict)


class Inbox:
    """The master's side: writes what its workers send into ``run_dir``, once each."""

    def __init__(self, run_dir: Path | str, master_host: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.master_host = master_host
        self.workers: dict[str, WorkerState] = {}

    def worker(self, name: str, node: str | None = None) -> WorkerState:
        if node and node != name and node in self.workers:  # its placeholder (see drain)
            del self.workers[node]
        st = self.workers.get(name)
        if st is None:
            st = self.workers[name] = WorkerState(name)
        if node:
            st.node = node
        return st

    def receive(self, msg: dict, node: str | None = None, now: float | None = None) -> int:
        """Write one message's batch or sidecar (unless already held); returns its sequence
        number, to acknowledge. A malformed message is a ``ValueError``."""
        try:
            name, seq, kind, data = str(msg["w"]), int(msg["seq"]), msg["kind"], msg["data"]
        except (KeyError, TypeError, ValueError):
            raise ValueError("a records message without worker, seq, kind and data") from None
        if kind not in KINDS:
            raise ValueError(f"a records message of unknown kind {kind!r}")
        st = self.worker(name, node)
        st.last_seen = time.monotonic() if now is None else now
        if seq in st.seqs:
            st.duplicates += 1
            return seq
        if st.lost is not None:  # it came back after all: take what it sends
            st.lost = None
            st.writers = {}  # those were closed: new ones append to the same shards
        if kind == "meta":
            self._meta(st, ProcMeta.from_dict(data))
        else:
            columns, batch, n = decode(kind, data)
            w = st.writers.get(kind)
            if w is None:
                w = st.writers[kind] = rows.RowShardWriter(self.run_dir, kind, tag=stem_of(name),
                                                           columns=columns)
            elif list(w.columns) != columns:
                raise ValueError(f"a {kind} batch of other columns than this worker's before")
            n = w.write_packed(batch, n)
            if kind == "requests":
                st.records += n
            else:
                st.starts += n
            st.batches += 1
            st.bytes += len(data)
        st.seqs.add(seq)
        return seq

    def _meta(self, st: WorkerState, meta: ProcMeta) -> None:
        st.meta = meta
        if meta.closed:
            st.closed = True
            for w in st.writers.values():
                w.close()
        self._write_sidecar(st)

    def _write_sidecar(self, st: WorkerState) -> None:
        if st.meta is None:
            return
        meta = copy.deepcopy(st.meta)
        meta.worker = st.name  # the name its records carry
        meta.transport = self.account(st)
        if st.lost is not None:
            meta.closed, meta.lost = True, st.lost
            meta.incomplete.append(Incomplete(f"worker {st.name}", (
                f"lost mid-run ({st.lost['why']}): {st.lost['missing']} of its requests "
                "missing (started by its last report, no record reached the master)")))
            if meta.open_stage is not None and meta.updated_ns:
                meta.stages.append(meta.open_stage.cut(meta.updated_ns))
                meta.open_stage = None
        rows.write_proc_meta(self.run_dir, meta, stem=stem_of(st.name))

    def account(self, st: WorkerState) -> dict:
        """run.json ``workers[<name>]``."""
        host = st.name.rpartition(":")[0]
        out = {"batches": st.batches, "records": st.records, "starts": st.starts,
               "duplicates": st.duplicates, "bytes": st.bytes, "closed": st.closed,
               "lost": st.lost is not None, "clock_offset_ns": self.offset(st),
               "clock_rtt_ns": st.clock.rtt_ns,
               "clock_estimate_ns": st.clock.offset_add_ns, "clock_samples": st.clock.samples,
               "host": host}
        if st.lost is not None:
            out.update(missing=st.lost["missing"], lost_why=st.lost["why"])
        return out

    def offset(self, st: WorkerState) -> int | None:
        """ns to add to the worker's times (None: never measured): the estimate, or 0 where
        it is within its error bound (half the round trip), as for workers on the master's
        own host, whose clock is the master's."""
        est, rtt = st.clock.offset_add_ns, st.clock.rtt_ns
        if est is None:
            return None
        return est if abs(est) > (rtt or 0) // 2 else 0

    def pong(self, msg: dict, t1_ns: int) -> None:
        try:
            self.worker(str(msg["w"])).clock.add(int(msg["t0"]), int(msg["t_w"]), t1_ns)
        except (KeyError, TypeError, ValueError):
            pass

    def open_workers(self) -> list[WorkerState]:
        return [st for st in self.workers.values() if not st.closed and st.lost is None]

    def declare_lost(self, st: WorkerState, why: str) -> None:
        if st.meta is None:  # lost before its sink sent its first sidecar
            host = st.name.rpartition(":")[0] or st.name
            st.meta = ProcMeta(counts={"requests_started": 0, "records_written": 0,
                                       "dropped_at_cap": 0}, worker=st.name, host=host,
                               closed=False)
        started = st.meta.count("requests_started")
        st.lost = {"why": why, "missing": max(0, started - st.records),
                   "requests_started_last_report": started, "records_received": st.records}
        for w in st.writers.values():
            w.close()
        self._write_sidecar(st)

    def close(self, now: float | None = None) -> None:
        """The end: every worker not closed is lost (silent since its last message)."""
        now = time.monotonic() if now is None else now
        for st in self.open_workers():
            self.declare_lost(st, f"silent for {now - st.last_seen:.1f} s at the end of the run"
                              if st.last_seen else "never sent its records")
        for st in self.workers.values():
            for w in st.writers.values():
                w.close()
            if st.closed and st.meta is not None:
                self._write_sidecar(st)  # the final account (offsets measured since)
