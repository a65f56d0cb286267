"""Distributed runs on Locust's own master and workers with no shared disk (issue 15): each
worker's record sink keeps its shard in a local spool and sends every batch and sidecar to the
master over Locust's worker-to-master messages; the master writes them into its own run
directory (``kvbench.runs.transport.Inbox``), acknowledges each, and finalizes as for one
process. The master also pings each worker's clock once a second (run.json
``worker_clock_offsets_ns``). Over 400 lines, kept whole: both ends of one protocol.

Shipping is the default on a master (issue 33: a plain ``locust --master`` with workers on other
hosts lost every record unless its user knew to add a flag). The master decides and its
options travel to the workers: ``--kvbench-no-ship-records`` (``KVBENCH_NO_SHIP_RECORDS=1``)
lets workers that share its disk write into its results directory themselves; a ``--processes``
master's own forked workers share its disk by construction and write there unless
``--kvbench-ship-records`` (otherwise a no-op, kept for older command lines) asks for shipping.
A master whose workers sent requests of which no record reached its run directory exits
non-zero with one sentence (``check_records_arrived``).

Where the spool lives on a worker: ``$KVBENCH_SPOOL`` (default ``<tmp>/kvbench-spool``) /
``<run id>/<host>-<pid>``; removed once the master has acknowledged everything, kept otherwise.
A job file given to the master (``kvbench run``) travels inline, so workers need no copy.

Ordering at the end (Locust fires ``quitting`` in reverse): on a worker, Locust's own listener
tells the master it quits, then kvbench's closes the sink, which sends the last batches here
and waits for their acknowledgement, reading the socket itself once the runner's receive loop
is gone. On the master, the listener registered at init drains its workers' last messages
(the runner's loop is gone there too) before kvbench's finalizes.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import gevent
from locust import events
from locust.runners import MasterRunner, WorkerRunner

from kvbench.core.rows import shard_stem, worker_name
from kvbench.loadgen.timing import sink as sink_module
from kvbench.loadgen.plan import options
from kvbench.runs import transport as T

log = logging.getLogger("kvbench.loadgen")

SEND_INTERVAL_S = 0.2  # a batch waits at most this long before it is sent
ACK_WAIT_S = 20.0  # at its close, how long a worker waits for the master's last acknowledgement
PING_INTERVAL_S = 1.0
ACK_LINGER_S = 1.5  # the master serves this long after its last worker closed
DRAIN_WAIT_S = 15.0  # beyond the drain, how long the master waits for its workers' last batches


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    # neither is in the web UI's form: its unticked box would undo the master's choice
    parser.add_argument(
        "--kvbench-ship-records", env_var="KVBENCH_SHIP_RECORDS", action="store_true",
        default=False, include_in_web_ui=False,
        help="workers send their records to the master over Locust's messages: the default on "
             "a master; needed only for a --processes master (whose forked workers otherwise "
             "write to its disk)")
    parser.add_argument(
        "--kvbench-no-ship-records", env_var="KVBENCH_NO_SHIP_RECORDS", action="store_true",
        default=False, include_in_web_ui=False,
        help="workers write their records into the results directory the master names instead "
             "of sending them to it: only for workers that share the master's disk; set it on "
             "the master")
    for name in TRAVELLING.values():
        parser.add_argument(f"--{name.replace('_', '-')}", default="", include_in_web_ui=False,
                            help=argparse_suppress())


# option naming a file the master reads -> the option its text travels in to the workers
TRAVELLING = {"kvbench_job": "kvbench_job_text", "kvbench_config": "kvbench_config_text"}


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def spool_base() -> Path:
    """Where a worker keeps its own copy of its records: ``$KVBENCH_SPOOL``, else a folder of
    the temporary directory (never the master's results directory)."""
    return Path(os.environ.get("KVBENCH_SPOOL") or Path(tempfile.gettempdir()) / "kvbench-spool")


def shipping(environment) -> bool:
    """Whether this run's workers send their records to the master (the master's decision,
    ``resolve_shipping``, reaches the workers with its options)."""
    o = environment.parsed_options
    return bool(getattr(o, "kvbench_ship_records", False)) and not getattr(
        o, "kvbench_no_ship_records", False)


def resolve_shipping(options) -> bool:
    """On the master, before its options travel: ship unless told not to, or unless its workers
    are its own ``--processes`` children (on its disk) and shipping was not asked for."""
    if options is None:
        return False
    if getattr(options, "kvbench_no_ship_records", False):
        ship = False
    elif getattr(options, "kvbench_ship_records", False):
        ship = True
    else:
        ship = not getattr(options, "processes", None)
    options.kvbench_ship_records, options.kvbench_no_ship_records = ship, not ship
    return ship


# --------------------------------------------------------------------------- worker side


class Forwarder:
    """A worker's end: the sink hands it every batch (``put``) and its close."""

    def __init__(self, environment) -> None:
        self.environment = environment
        self.dir: Path | None = None
        self.outbox: T.Outbox | None = None
        self._sender = None

    def spool(self, run_dir) -> Path | None:
        if not shipping(self.environment):
            return None
        if self.dir is None:
            self.dir = spool_base() / Path(run_dir).name / shard_stem()
            self.outbox = T.Outbox(worker_name())
            self._sender = gevent.spawn(self._send_loop)
        return self.dir

    def put(self, kind: str, payload) -> None:
        if self.outbox is not None:
            self.outbox.put(kind, payload)

    def _send(self, msgs) -> None:
        runner = self.environment.runner
        for msg in msgs:
            try:
                runner.send_message(T.RECORDS_MSG, msg)
            except Exception as exc:  # noqa: BLE001 - kept; sent again after RESEND_AFTER_S
                log.warning("kvbench: records batch %s not sent to the master (%s); it is "
                            "kept and sent again", msg["seq"], exc)
                return

    def _send_loop(self) -> None:
        while True:
            gevent.sleep(SEND_INTERVAL_S)
            self._send(self.outbox.take())

    def on_ack(self, environment, msg, **kw) -> None:
        if self.outbox is not None:
            self.outbox.ack((msg.data or {}).get("seqs", ()))

    def close(self) -> None:
        """Send what is left and wait for the master to acknowledge it all; the spool goes
        once it has, and stays (named in the log) if it has not."""
        if self.outbox is None:
            return
        if self._sender is not None:
            self._sender.kill(block=False)
        runner = self.environment.runner
        deadline = time.monotonic() + ACK_WAIT_S
        self._send(self.outbox.take())
        resend = time.monotonic() + 0.5
        while self.outbox.pending() and time.monotonic() < deadline:
            if _listening(runner):
                gevent.sleep(0.05)
            else:
                _read_own(runner.client, 0.1, {T.ACK_MSG: self.on_ack,
                                               T.PING_MSG: _on_ping}, self.environment)
            if time.monotonic() >= resend:
                resend = time.monotonic() + 0.5
                self._send(self.outbox.resend_all())
        left = self.outbox.pending()
        if left:
            log.error("kvbench: the master did not acknowledge %d of this worker's record "
                      "batches; they are kept in %s", left, self.dir)
        elif self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            try:
                self.dir.parent.rmdir()  # the run's folder, once no other worker's is in it
            except OSError:
                pass


def _on_ping(environment, msg, **kw) -> None:
    """The master's clock probe: answer with this host's clock at once."""
    environment.runner.send_message(T.PONG_MSG, {"w": worker_name(), "t0": (msg.data or {}).get(
        "t0"), "t_w": time.time_ns()})


def _listening(runner) -> bool:
    """Whether the runner's own receive loop still runs (its greenlets are killed at quit)."""
    return len(runner.greenlet) > 0


def _read_own(sock, timeout_s: float, handlers: dict, environment) -> None:
    """Read the runner's socket ourselves (its loop is gone): dispatch our own messages,
    drop Locust's (stats, heartbeats: the run is over)."""
    try:
        if not sock.socket.poll(int(timeout_s * 1000)):
            return
        got = sock.recv_from_client() if hasattr(sock, "recv_from_client") and isinstance(
            environment.runner, MasterRunner) else (None, sock.recv())
    except Exception as exc:  # noqa: BLE001 - a broken socket: nothing more will come
        log.debug("kvbench: reading the runner's socket: %s", exc)
        gevent.sleep(timeout_s)
        return
    node, msg = got
    if node is not None:
        msg.node_id = node
    handler = handlers.get(msg.type)
    if handler is not None:
        handler(environment, msg)


# --------------------------------------------------------------------------- master side


class Receiver:
    """The master's end: an ``Inbox`` on its run directory, made at the first message."""

    def __init__(self, environment) -> None:
        self.environment = environment
        self.inbox: T.Inbox | None = None
        self._pinger = None

    def _inbox(self) -> T.Inbox:
        if self.inbox is None:
            self.inbox = T.Inbox(options.run_dir(self.environment.parsed_options),
                                 socket.gethostname())
        return self.inbox

    def on_records(self, environment, msg, **kw) -> None:
        try:
            seq = self._inbox().receive(msg.data, node=msg.node_id)
        except ValueError as exc:
            log.error("kvbench: a records message from %s dropped: %s", msg.node_id, exc)
            return
        except Exception as exc:  # noqa: BLE001 - not acknowledged: the worker sends it again
            log.error("kvbench: a records batch from %s not written (%s); waiting for it "
                      "again", msg.node_id, exc)
            return
        try:
            environment.runner.server.send_to_client(_message(T.ACK_MSG, {"seqs": [seq]},
                                                              msg.node_id))
        except Exception as exc:  # noqa: BLE001 - the worker sends it again
            log.warning("kvbench: acknowledgement to %s not sent: %s", msg.node_id, exc)

    def on_pong(self, environment, msg, **kw) -> None:
        self._inbox().pong(msg.data or {}, time.time_ns())

    def start_pings(self) -> None:
        if self._pinger is None:
            self._pinger = gevent.spawn(self._ping_loop)

    def _ping_loop(self) -> None:
        runner = self.environment.runner
        while True:
            for client in list(runner.clients.all):
                try:
                    runner.send_message(T.PING_MSG, {"t0": time.time_ns()}, client_id=client.id)
                except Exception:  # noqa: BLE001 - the next round tries again
                    pass
            gevent.sleep(PING_INTERVAL_S)

    def drain(self) -> None:
        """At the master's quit: take its workers' last batches until each has closed or
        fallen silent, then account for every worker (lost ones named)."""
        if self._pinger is not None:
            self._pinger.kill(block=False)
        runner = self.environment.runner
        if self.inbox is None and not runner.clients.all:
            return
        inbox = self._inbox()
        for client in list(runner.clients.all):  # connected, but no word from its sink yet
            if not any(st.node == client.id for st in inbox.workers.values()):
                inbox.worker(client.id, node=client.id).last_seen = time.monotonic()
        wait = DRAIN_WAIT_S + (self.environment.stop_timeout or 0)
        deadline = time.monotonic() + wait
        handlers = {T.RECORDS_MSG: self.on_records, T.PONG_MSG: self.on_pong}
        while self.inbox.open_workers() and time.monotonic() < deadline:
            now = time.monotonic()
            for st in self.inbox.open_workers():
                if now - st.last_seen > T.SILENT_LOST_S:
                    self.inbox.declare_lost(st, f"no message for {now - st.last_seen:.1f} s")
                    log.error("kvbench: worker %s lost: %d of its requests missing", st.name,
                              st.lost["missing"])
            self._serve(handlers, 0.1)
        # the last acknowledgements are queued in ZeroMQ's I/O thread, which an exit would drop:
        # keep serving a moment (a worker that missed one sends its batch again meanwhile)
        linger = time.monotonic() + ACK_LINGER_S
        while time.monotonic() < linger:
            self._serve(handlers, 0.1)
        self.inbox.close()

    def _serve(self, handlers: dict, timeout_s: float) -> None:
        if _listening(self.environment.runner):
            gevent.sleep(timeout_s / 2)
        else:
            _read_own(self.environment.runner.server, timeout_s, handlers, self.environment)


def _message(kind: str, data, node: str):
    from locust.rpc import Message

    return Message(kind, data, node)


# --------------------------------------------------------------------------- wiring


@events.init.add_listener
def on_init(environment, **kw) -> None:
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        fwd = Forwarder(environment)
        sink_module.FORWARD = fwd
        runner.register_message(T.ACK_MSG, fwd.on_ack)
        runner.register_message(T.PING_MSG, _on_ping)
    elif isinstance(runner, MasterRunner):
        recv = environment.kvbench_receiver = Receiver(environment)
        runner.register_message(T.RECORDS_MSG, recv.on_records)
        runner.register_message(T.PONG_MSG, recv.on_pong)
        o = environment.parsed_options
        resolve_shipping(o)
        if o is not None and not o.kvbench_config and not o.kvbench_job:
            here = options.config_path(o)  # ./bench.toml beside the master: the workers,
            if here:  # on other hosts or in other folders, take the master's, not theirs
                o.kvbench_config = str(Path(here).resolve())
        for opt, text_opt in TRAVELLING.items():
            if o is not None and shipping(environment) and getattr(o, opt, ""):
                try:  # workers on other hosts have no copy of the file: its text travels
                    setattr(o, text_opt, Path(getattr(o, opt)).read_text())
                except OSError:
                    pass  # the workers report the missing file
        # registered now, after kvbench's own (at import): fired before it (in reverse)
        environment.events.quitting.add_listener(_master_quitting)


@events.test_start.add_listener
def on_test_start(environment, **kw) -> None:
    runner = environment.runner
    if isinstance(runner, MasterRunner):
        recv = getattr(environment, "kvbench_receiver", None)
        if recv is not None:
            recv.start_pings()
    elif isinstance(runner, WorkerRunner) and shipping(environment):
        o = environment.parsed_options
        # what a worker writes of its own (its job file, spool) stays on its own disk: the
        # results directory the master named is the master's
        o.kvbench_results = str(spool_base() / "results")
        for opt, text_opt in TRAVELLING.items():
            text, given = getattr(o, text_opt, ""), getattr(o, opt, "")
            if text and given:  # the master's file, whether or not this host has one
                path = spool_base() / f"{shard_stem()}-{Path(given).name}"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                setattr(o, opt, str(path))


def _master_quitting(environment, **kw) -> None:
    recv = getattr(environment, "kvbench_receiver", None)
    if recv is not None and shipping(environment):
        recv.drain()


# --------------------------------------------------------------------------- the master's check


def requests_counted(environment) -> int:
    """The requests the workers reported to Locust's stats on the master: kvbench's one
    ``e2e`` entry per request, else (no such entry) every request event."""
    stats = environment.runner.stats
    e2e = [e for e in stats.entries.values() if str(e.name).startswith("e2e ")]
    if e2e:
        return sum(e.num_requests for e in e2e)
    return stats.total.num_requests


def check_records_arrived(environment, run_dir, rows: int | None) -> str | None:
    """A master whose workers sent requests but whose run holds none of their records: the
    sentence that says so (logged; the exit code becomes 1), else None."""
    sent = requests_counted(environment)
    if rows is None or rows or not sent:
        return None
    if shipping(environment):
        why = ("none of the workers' records reached the master (see the workers' logs: each "
               "keeps what was not acknowledged in its spool, $KVBENCH_SPOOL)")
    elif getattr(environment.parsed_options, "processes", None):
        why = "its --processes workers wrote none there (see their errors above)"
    else:
        why = ("--kvbench-no-ship-records (or KVBENCH_NO_SHIP_RECORDS) told the workers to "
               "write to the master's disk, which they do not share; run without it so they "
               "send their records to the master")
    msg = (f"the workers sent {sent} requests but the run directory {Path(run_dir).resolve()} "
           f"holds no record of them: {why}")
    log.error("kvbench: error: %s", msg)
    if not environment.process_exit_code:
        environment.process_exit_code = 1
    return msg
