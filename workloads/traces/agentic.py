"""Agentic-coding traces (kv-cache-tester's format): one JSON conversation a file,
``{"id", "block_size", "tool_tokens", "system_tokens", "requests": [...]}``, a request
``{"t", "type": "s"|"n", "in", "out", "hash_ids", ["think_time"], ["api_time"]}`` with one hash
id per full ``block_size``-token block (equal ids within a file are the same block), or a
``"type": "subagent"`` entry holding its own ``requests``. Over 400 lines, kept whole: reading,
checking and building prompts share the conversation structures, which a split would only
pass around.

Sessions. A conversation is a session; its sub-agent entries become ``Spawn``s of sub-sessions
(``parent_session_id`` and ``subagent_index``, the sub-agent's order in the conversation, set on
their requests). Consecutive sub-agent entries whose recorded runs overlap (an entry starting
before the group's last recorded end, ``t + duration_ms``) form one ``Spawn``; the parent waits
for all of it. ``conversation_offset_s`` counts from the session's start, which for a
sub-agent is its Spawn's start (a later sibling's requests keep its recorded stagger: its
entry's ``t`` less the first sibling's, plus its own ``t``, recorded from its own start);
``arrival_offset_s`` (the open-loop replay, every conversation from 0) from the
conversation's start. ``api_time_s`` is the session's previous answer's recorded
``api_time`` (None for a session's first request and the first after a ``Spawn``).

Users recycle the conversations in a seeded order (``sessions()``; ``conversations = N``
keeps the first N files).

Think times (``think_time_s``, divided by ``speedup``). The trace's ``think_time`` where present
(it is the gap from the previous answer's end, ``t - (t_prev + api_time_prev)``); where absent,
that gap computed from ``t`` and ``api_time`` (or ``t - t_prev`` without ``api_time``); after a
``Spawn`` always the gap from the last sub-agent's recorded end (the recorded ``think_time``
spans the sub-agents' run, which the replay already waits for), clipped at 0. ``notes`` count
each source.

Prompts. One user message whose rendered tokens, as the server tokenizes them, are cut into
``block_size`` blocks exactly where the trace's are: the template's own leading tokens count
towards block 0 (its content is shorter by them) and its trailing tokens towards the tail
(``prompt_tokens`` is ``in``, or up to the template's trailing tokens more where ``in`` leaves
less room after its last full block than they take). A block's text comes from its hash id
alone (keyed by the conversation under ``"hash_id_scope": "local"``, by the trace under
``"global"``), so equal ids give equal blocks and different ids different ones. The tool definitions and system prompt (``tool_tokens + system_tokens``, the full blocks
of it that the first request of the main agent, or of the first sub-agent, sends) are one
prefix shared by every conversation of the trace under ``shared_prefix = "shared"``, each
conversation's own under ``"per_conversation"``, or only its first fraction of blocks under a
number in [0, 1] (as kv-cache-tester's warm-prefix option); main agents and sub-agents have one
such prefix each. A block whose id differs from the first request's at that position (the
system prompt changed) is the conversation's own text.

``shared_prefix_tokens`` is the leading run of blocks sent before in the conversation or
shared by every conversation; past the shared prefix it holds the conversation's history
(``prefix_from_responses``), which a warm cache does not prime.

``out`` is ``max_tokens`` (``max_output_tokens`` clips it), and ``min_tokens`` too with
``min_tokens = true``; ``"type": "n"`` requests have ``stream = False``.

Reading all 244 public conversations takes about a second: files are parsed and checked once,
and prompt text is built per request when asked for (about 15 ms for a 57k-token prompt with
the built-in tokenizer).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import orjson

from kvbench.core.errors import UserError
from kvbench.workloads.base import Request, Spawn
from kvbench.workloads.common import rng_for
from kvbench.workloads.prompt import Piece
from kvbench.workloads.specs import MAX_SECONDS, MAX_TOKENS
from kvbench.workloads.text import key_seed
from kvbench.workloads.tokenizer import BuiltinTokenizer
from kvbench.workloads.traces import MAX_SPAN_S, TraceWorkload, shown

_CACHE_BLOCKS = 65536  # block texts kept (~400 B each at 64 tokens)
_POOL = 1 << 16  # words in the pool block texts are cut from (built-in tokenizer)
MAIN, SUB = "main", "sub"  # the two agents whose tool/system prefix is shared


class BadFile(Exception):
    """One malformed field of one file (the reader turns it into a UserError)."""


@dataclass(slots=True, eq=False)
class TraceRequest:
    t: float
    stream: bool
    n_in: int
    n_out: int
    ids: list
    think_s: float  # the wait before sending it (see the module docstring)
    api_s: float | None  # recorded server time of the session's previous answer
    offset_s: float  # from the conversation's start (the open-loop arrival)
    session_offset_s: float  # from the session's start (a sub-agent's: its Spawn's start)
    known: int = 0  # leading blocks the conversation sent before (file order)


@dataclass(slots=True)
class SubSession:
    agent: str  # MAIN or SUB
    index: int  # -1 for the main session, else the sub-agent's order in the conversation
    items: list = field(default_factory=list)  # TraceRequest | SpawnGroup


@dataclass(slots=True)
class SpawnGroup:
    think_s: float
    subs: list


@dataclass(slots=True)
class Conversation:
    cid: str
    file: Path
    block: int
    main: SubSession
    canon: dict  # hash id -> (agent, block position): the tool/system prefix blocks
    prefix_blocks: dict  # agent -> full prefix blocks (tool + system tokens) // block
    n_requests: int = 0
    n_subs: int = 0
    scope: str = ""  # what block ids are keyed by beside themselves: the id for "local" scope


def _num(v, where: str, lo: float = 0.0, hi: float = MAX_SPAN_S) -> float:
    if type(v) not in (int, float) or not lo <= v <= hi:
        raise BadFile(f"{where} is {shown(v)}, not a number of seconds from {lo:g} to {hi:g}")
    return float(v)


def _int(v, where: str, lo: int, hi: int = MAX_TOKENS) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise BadFile(f"{where} is {shown(v)}, not an integer from {lo} to {hi}")
    return v


def _get(rec: dict, key: str, where: str):
    if key not in rec:
        raise BadFile(f"{where}.{key} is missing" if where else f"field {key!r} is missing")
    return rec[key]


class _Parser:
    """Checks one file and builds its Conversation (raises BadFile naming the field)."""

    def __init__(self, path: Path):
        self.path = path
        self.n_requests = 0
        self.n_subs = 0
        self.think_sources = {"trace": 0, "gap_api_time": 0, "gap_t": 0, "after_spawn": 0}

    def conversation(self, doc) -> Conversation:
        if not isinstance(doc, dict):
            raise BadFile("the file is not a JSON object")
        cid = doc.get("id", self.path.stem)
        if not isinstance(cid, str) or not cid or len(cid) > 256:
            raise BadFile(f"id is {shown(cid)}, not a string of 1 to 256 characters")
        self.block = _int(doc.get("block_size", 64), "block_size", 1, 65536)
        scope = doc.get("hash_id_scope", "local")
        if scope not in ("local", "global"):
            raise BadFile(f"hash_id_scope is {shown(scope)}, not \"local\" (ids name blocks "
                          "within the file) or \"global\" (across the trace's files)")
        prefix = {MAIN: self._prefix(doc, "")}
        reqs = _get(doc, "requests", "")
        main = SubSession(MAIN, -1)
        self._session(reqs, "requests", main, 0.0, prefix)
        if not self.n_requests:
            raise BadFile("requests holds no request")
        canon: dict = {}
        conv = Conversation(cid, self.path, self.block, main, canon,
                            {a: p // self.block for a, p in prefix.items()},
                            self.n_requests, self.n_subs, cid if scope == "local" else "")
        self._canon_and_known(conv)
        return conv

    def _prefix(self, rec: dict, where: str) -> int:
        dot = f"{where}." if where else ""
        return (_int(_get(rec, "tool_tokens", where), f"{dot}tool_tokens", 0)
                + _int(_get(rec, "system_tokens", where), f"{dot}system_tokens", 0))

    def _session(self, reqs, where: str, sess: SubSession, base_s: float, prefix: dict,
                 rel_s: float = 0.0) -> None:
        """``base_s``: the session's start from the conversation's; ``rel_s``: from its
        Spawn's start (a later sibling's recorded stagger)."""
        if not isinstance(reqs, list) or not reqs:
            raise BadFile(f"{where} is {shown(reqs)}, not a non-empty list of requests")
        prev_end: float | None = None  # end of the previous answer (or spawn group)
        prev_t: float | None = None
        prev_api: float | None = None
        after_spawn = False
        group: SpawnGroup | None = None
        group_end = -math.inf
        for k, rec in enumerate(reqs):
            w = f"{where}[{k}]"
            if not isinstance(rec, dict):
                raise BadFile(f"{w} is {shown(rec)}, not a JSON object")
            t = _num(_get(rec, "t", w), f"{w}.t")
            kind = _get(rec, "type", w)
            if kind == "subagent":
                if sess.agent != MAIN:
                    raise BadFile(f"{w}.type is 'subagent' inside a sub-agent; only a "
                                  "conversation's own requests spawn sub-agents")
                dur = rec.get("duration_ms")
                dur_s = math.inf if dur is None else _num(dur, f"{w}.duration_ms",
                                                          hi=MAX_SECONDS * 1000) / 1000
                if prefix.get(SUB) is None:
                    prefix[SUB] = self._prefix(rec, w)
                else:
                    self._prefix(rec, w)
                sub = SubSession(SUB, self.n_subs)
                self.n_subs += 1
                if group is None or t >= group_end:
                    gap = t - (prev_end if prev_end is not None else prev_t or 0.0)
                    group = SpawnGroup(max(gap, 0.0), [])
                    group_t0 = t
                    sess.items.append(group)
                    group_end = -math.inf
                self._session(_get(rec, "requests", w), f"{w}.requests", sub, base_s + t, prefix,
                              t - group_t0)
                group.subs.append(sub)
                group_end = max(group_end, t + dur_s)
                prev_end = group_end if math.isfinite(group_end) else t
                prev_t = t
                prev_api = None
                after_spawn = True
                continue
            group = None
            if kind not in ("s", "n"):
                raise BadFile(f"{w}.type is {shown(kind)}, not \"s\", \"n\" or \"subagent\"")
            n_in = _int(_get(rec, "in", w), f"{w}.in", 1)
            n_out = _int(_get(rec, "out", w), f"{w}.out", 0)
            ids = _get(rec, "hash_ids", w)
            if not isinstance(ids, list) or not all(type(h) is int for h in ids):
                raise BadFile(f"{w}.hash_ids is not a list of integers")
            full = n_in // self.block
            if len(ids) not in (full, -(-n_in // self.block)):
                raise BadFile(f"{w}.hash_ids has {len(ids)} ids but in = {n_in} holds {full} "
                              f"full blocks of {self.block} tokens")
            api = rec.get("api_time")
            api_s = None if api is None else _num(api, f"{w}.api_time")
            think = rec.get("think_time")
            if after_spawn:
                think_s = max(t - prev_end, 0.0)
                self.think_sources["after_spawn"] += 1
            elif think is not None:
                think_s = _num(think, f"{w}.think_time")
                self.think_sources["trace"] += 1
            elif prev_t is None:
                think_s = 0.0
            else:
                think_s = max(t - (prev_end if prev_end is not None else prev_t), 0.0)
                self.think_sources["gap_api_time" if prev_end is not None else "gap_t"] += 1
            sess.items.append(TraceRequest(t, kind == "s", n_in, n_out, ids[:full], think_s,
                                           prev_api, base_s + t, rel_s + t))
            self.n_requests += 1
            prev_t = t
            prev_api = api_s
            prev_end = t + api_s if api_s is not None else None
            after_spawn = False

    def _canon_and_known(self, conv: Conversation) -> None:
        """The tool/system prefix blocks (first come: the main agent's first request, then
        the first sub-agent's), and per request the leading blocks sent before it."""
        seen: set = set()
        done: set = set()
        for sess, r in walk(conv.main):
            if sess.agent not in done:  # only the agent's first request names the prefix
                done.add(sess.agent)
                n = conv.prefix_blocks.get(sess.agent, 0)
                for j, h in enumerate(r.ids[:n]):
                    conv.canon.setdefault(h, (sess.agent, j))
            k = 0
            for h in r.ids:
                if h not in seen:
                    break
                k += 1
            r.known = k
            seen.update(r.ids)


def walk(sess: SubSession) -> Iterator[tuple[SubSession, TraceRequest]]:
    """(session, request) in file order, sub-agents where they are spawned."""
    for item in sess.items:
        if isinstance(item, SpawnGroup):
            for sub in item.subs:
                yield from walk(sub)
        else:
            yield sess, item


def files_of(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.glob("*.json") if p.is_file())
    return [path]


def _template_edges(asm, text, api: str) -> tuple[int, int]:
    """(H, F): the tokens the server sees before and after a user message's content, found by
    rendering two contents that differ in every token and comparing the token sequences."""
    tok = asm.tokenizer
    a, b = text.segment("agentic/probe-a", 8), text.segment("agentic/probe-b", 8)
    if api == "completions":
        enc = tok.tokens if isinstance(tok, BuiltinTokenizer) else tok.encode_prompt
        ta, tb = enc(a), enc(b)
    else:
        enc = tok.tokens if isinstance(tok, BuiltinTokenizer) else tok.encode
        ta = enc(tok.render_chat([{"role": "user", "content": a}]))
        tb = enc(tok.render_chat([{"role": "user", "content": b}]))
    head = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), 0)
    tail = next((i for i, (x, y) in enumerate(zip(reversed(ta), reversed(tb))) if x != y), 0)
    return head, tail


class AgenticSession:
    """One conversation (or sub-agent) replayed: requests, and ``Spawn``s of sub-agents."""

    def __init__(self, wl: "AgenticTrace", conv: Conversation, sess: SubSession,
                 parent: str = ""):
        self.wl, self.conv, self.sess = wl, conv, sess
        base = f"{wl.name}-{conv.cid}"
        self.session_id = base if sess.index < 0 else f"{base}-s{sess.index}"
        self.parent_session_id = parent
        self._i = 0
        self._turn = 0

    def next_request(self) -> Request | Spawn | None:
        items = self.sess.items
        if self._i >= len(items):
            return None
        item = items[self._i]
        self._i += 1
        if isinstance(item, SpawnGroup):
            return Spawn(tuple(AgenticSession(self.wl, self.conv, s, self.session_id)
                               for s in item.subs), item.think_s / self.wl.spec.speedup)
        self._turn += 1
        return self.wl.build(self.conv, self.sess, item, self._turn - 1, self.session_id,
                             self.parent_session_id)

    def feed_response(self, text: str) -> None:
        pass  # the trace's next prompt stands for the conversation with its real answers


class AgenticTrace(TraceWorkload):
    """The reader (see the module docstring)."""

    def __init__(self, name, spec, tokenizer, seed):
        super().__init__(name, spec, tokenizer, seed)
        files = files_of(self.path)
        if not files:
            raise UserError(f"workloads.{name}.path: {self.path} holds no .json conversation "
                            "files; point it at an agentic-coding trace folder or file")
        self.conversations: list[Conversation] = []
        self.think_sources = dict.fromkeys(("trace", "gap_api_time", "gap_t", "after_spawn"), 0)
        bad_first = None
        self.too_long = 0  # conversations left out by max_context_tokens
        n_req = 0
        seen_ids: set = set()
        for f in files:
            if spec.conversations is not None and len(self.conversations) >= spec.conversations:
                break
            if spec.limit is not None and n_req >= spec.limit:
                break
            p = _Parser(f)
            try:
                try:
                    doc = orjson.loads(f.read_bytes())
                except orjson.JSONDecodeError as exc:
                    raise BadFile(f"not valid JSON ({exc})") from None
                except OSError as exc:
                    raise BadFile(f"cannot be read ({exc.strerror})") from None
                conv = p.conversation(doc)
            except BadFile as exc:
                msg = f"{f}: {exc}"
                if not spec.skip_bad_lines:
                    raise UserError(f"{msg}; fix the file or set skip_bad_lines = true to "
                                    "skip such files") from None
                self.skipped_lines += 1
                bad_first = bad_first or msg
                continue
            if spec.max_context_tokens is not None and any(
                    r.n_in + self._max_tokens(r.n_out) > spec.max_context_tokens
                    for _, r in walk(conv.main)):
                self.too_long += 1
                continue
            for k, v in p.think_sources.items():
                self.think_sources[k] += v
            if conv.cid in seen_ids:  # two files, one id: each keeps its own sessions
                conv.cid = f"{conv.cid}~{f.stem}"
                conv.scope = conv.scope and conv.cid
            seen_ids.add(conv.cid)
            self.conversations.append(conv)
            n_req += conv.n_requests
        if self.skipped_lines:
            self.notes.append(f"skipped {self.skipped_lines} malformed file(s), the first: "
                              f"{bad_first}")
        if self.too_long:
            self.notes.append(f"left out {self.too_long} conversation(s) with a request over "
                              f"max_context_tokens ({spec.max_context_tokens:,})")
        self._require_requests(n_req, self.path, bad_first)
        src = self.think_sources
        self.notes.append(
            f"think times: {src['trace']} recorded, {src['gap_api_time']} from t minus the "
            f"previous t + api_time, {src['gap_t']} from t minus the previous t (no "
            f"api_time), {src['after_spawn']} after sub-agents from their recorded end")
        # send order of the open-loop replay: every conversation starts at 0
        self._flat = [(conv, sess, r) for conv in self.conversations
                      for sess, r in walk(conv.main)]
        offs = np.array([r.offset_s for _, _, r in self._flat], dtype=float)
        self.offsets_s, self.order = self._arrivals(offs)
        self.head, self.tail = _template_edges(self.asm, self.text, spec.api)
        self._blocks: OrderedDict = OrderedDict()
        self._pool: list[str] | None = None
        self._by_id: dict | None = None  # request id -> (conversation, request), when asked

    # -- prompts ---------------------------------------------------------------------------

    def _shared_blocks(self, conv: Conversation, agent: str) -> int:
        mode = self.spec.shared_prefix
        n = conv.prefix_blocks.get(agent, 0)
        if mode == "shared":
            return n
        if mode == "per_conversation":
            return 0
        return int(float(mode) * n * conv.block) // conv.block

    def block_key(self, conv: Conversation, h: int) -> tuple:
        """What names a block's text: the trace-wide prefix block, or the conversation's id."""
        c = conv.canon.get(h)
        if c is not None and c[1] < self._shared_blocks(conv, c[0]):
            return ("prefix", c[0], c[1])
        return (conv.scope, h)

    def block_text(self, conv: Conversation, j: int, h: int) -> str:
        """The content of block ``j`` (id ``h``): ``block`` tokens, less the template's
        leading tokens that fall inside it."""
        key = self.block_key(conv, h)
        n = max(0, (j + 1) * conv.block - max(j * conv.block, self.head))
        ck = (key, n)
        text = self._blocks.get(ck)
        if text is None:
            text = self._segment(f"{self.name}/{'/'.join(map(str, key))}", n)
            self._blocks[ck] = text
            if len(self._blocks) > _CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(ck)
        return text

    def _segment(self, key: str, n: int) -> str:
        """``n`` tokens of text for ``key``. The built-in tokenizer: three words hashed from
        the key (different keys differ from their first token on, as ``TextFactory``'s
        segments do), then a window of a seeded word pool at a hashed offset, some 30 times
        faster than a fresh segment (a 57k-token first prompt builds in milliseconds); other
        tokenizers: ``TextFactory.segment``."""
        if not self.asm.builtin or n <= 3 or n > _POOL // 2:
            return self.text.segment(key, n)
        if self._pool is None:
            self._pool = self.text.segment(f"{self.name}/block-pool", _POOL).split(" ")[1:]
        pool = self._pool
        h = key_seed(self.seed, self.name, key)
        v = len(self.text.words)
        words = self.text.words
        off = (h >> 40) % (_POOL - n)
        return (f" {words[h % v]} {words[(h // v) % v]} {words[(h // (v * v)) % v]} "
                + " ".join(pool[off:off + n - 3]))

    def _content_tokens(self, conv: Conversation, j: int) -> int:
        return max(0, (j + 1) * conv.block - max(j * conv.block, self.head))

    def build(self, conv: Conversation, sess: SubSession, r: TraceRequest, turn: int,
              sid: str, parent: str) -> Request:
        parts = [self.block_text(conv, j, h) for j, h in enumerate(r.ids)]
        ntok = [self._content_tokens(conv, j) for j in range(len(r.ids))]
        body = sum(ntok)
        rest = max(r.n_in - self.tail - self.head - body, 0 if parts else 1)
        tail = self.text.segment(f"{self.name}/{sid}/t{turn}/tail", rest) if rest else ""
        shared_run = next((j for j, h in enumerate(r.ids)
                           if self.block_key(conv, h)[0] != "prefix"), len(r.ids))
        k = max(r.known, shared_run)
        head_text, head_tok = "".join(parts[:k]), sum(ntok[:k])
        rest_text = "".join(parts[k:]) + tail
        pieces = [Piece(head_text, head_tok), Piece(rest_text, body - head_tok + rest)]
        if self.spec.api == "chat":
            messages, prompt, total, shared = self.asm.build([("user", pieces)], shared=(0, 1))
        else:
            text = head_text + rest_text
            messages, prompt = None, text
            if self.asm.builtin:
                total, shared = body + rest, head_tok
            else:
                tok = self.tokenizer
                total, shared = tok.count_prompt(text), tok.leading_special_tokens + head_tok
        if k == 0:
            shared = 0
        max_tokens = self._max_tokens(r.n_out)
        return Request(
            request_id=f"{sid}-t{turn:04d}", request_class="trace", max_tokens=max_tokens,
            prompt_tokens=total, shared_prefix_tokens=shared, session_id=sid, turn=turn,
            prompt=prompt, messages=messages,
            arrival_offset_s=r.offset_s / self.spec.speedup,
            think_time_s=r.think_s / self.spec.speedup, workload=self.name, stream=r.stream,
            prefix_from_responses=r.known > shared_run,
            parent_session_id=parent, subagent_index=sess.index,
            conversation_offset_s=r.session_offset_s, api_time_s=r.api_s,
            min_tokens=max_tokens if self.spec.min_tokens else 0)

    # -- the workload interface ------------------------------------------------------------

    def sessions(self) -> Iterator[AgenticSession]:
        """The conversations in a seeded order (the suite's or the table's seed), which
        users recycle."""
        order = rng_for(self.seed, self.name, "sessions").permutation(len(self.conversations))
        return (AgenticSession(self, self.conversations[i], self.conversations[i].main)
                for i in order.tolist())

    def build_request(self, i: int) -> Request:
        conv, sess, r = self._flat[i]
        base = f"{self.name}-{conv.cid}"
        sid = base if sess.index < 0 else f"{base}-s{sess.index}"
        turn = 0
        for x in sess.items:
            if x is r:
                break
            turn += isinstance(x, TraceRequest)
        return self.build(conv, sess, r, turn, sid, "" if sess.index < 0 else base)

    def requests(self) -> Iterator[Request]:
        """Every request in the open-loop order of the original timestamps (all conversations
        start at 0), built lazily."""
        turns = {}
        for i in self.order.tolist():
            conv, sess, r = self._flat[i]
            base = f"{self.name}-{conv.cid}"
            sid = base if sess.index < 0 else f"{base}-s{sess.index}"
            turn = turns.get(sid, 0)
            turns[sid] = turn + 1
            yield self.build(conv, sess, r, turn, sid, "" if sess.index < 0 else base)

    def describe_blocks(self, block_tokens: int | None = None) -> Iterator[tuple]:
        """(prompt tokens, max_tokens, block keys, block size) per request in ``requests()``
        order, straight from the hash ids (no text): keys name the trace-wide prefix blocks
        as one, every other block by (conversation, id)."""
        for i in self.order.tolist():
            conv, _, r = self._flat[i]
            yield (r.n_in, self._max_tokens(r.n_out),
                   [self.block_key(conv, h) for h in r.ids], conv.block)

    def sent_blocks(self, request_id: str, block_tokens: int):
        """What ``describe_sent`` needs of a sent request, from the hash ids and without its
        text: (prompt tokens, keys of its full ``block_tokens`` engine blocks, max_tokens,
        class, shared prefix tokens, arrival), or None for an id not of this trace. An
        engine block is named by the trace block holding its last token and its index (trace
        ids are chained, so that names its whole prefix); blocks past the last full trace
        block never hit (their text is the request's own)."""
        if self._by_id is None:
            self._by_id = {}
            for conv in self.conversations:
                turns: dict = {}
                for sess, r in walk(conv.main):
                    base = f"{self.name}-{conv.cid}"
                    sid = base if sess.index < 0 else f"{base}-s{sess.index}"
                    k = turns[sid] = turns.get(sid, -1) + 1
                    self._by_id[f"{sid}-t{k:04d}"] = (conv, r)
        got = self._by_id.get(request_id)
        if got is None:
            return None
        conv, r = got
        bt = conv.block
        keys64 = [self.block_key(conv, h) for h in r.ids]
        keys = [(keys64[((i + 1) * block_tokens - 1) // bt], i)
                for i in range(len(r.ids) * bt // block_tokens)]
        n = max(r.n_in, len(r.ids) * bt + self.tail, self.head + self.tail + 1)
        return (n, keys, self._max_tokens(r.n_out), self.request_class, 0,
                r.offset_s / self.spec.speedup)

    def describe_agentic(self) -> dict:
        """Conversations, requests, sub-agents, context growth and the theoretical
        within-conversation block hit ratio: a full block hits when its hash id appeared in an
        earlier request of its own session or, for a sub-agent, of its parent before the
        spawn; hit blocks over all full blocks, requests in file order. Beside it, the
        conversation-wide ratio also counts ids a sibling sub-agent sent earlier in the file
        (sub-agents of one kind share their tool/system blocks)."""
        blocks = hits = wide = 0
        first, last = [], []
        stream = {"s": 0, "n": 0}
        spawns = subs = 0
        for conv in self.conversations:
            seen_main: set = set()
            seen_all: set = set()

            def count(r: TraceRequest, own: set, parent: set) -> None:
                nonlocal blocks, hits, wide
                hits += sum(1 for x in r.ids if x in own or x in parent)
                wide += sum(1 for x in r.ids if x in seen_all)
                blocks += len(r.ids)
                own.update(r.ids)
                seen_all.update(r.ids)
                stream["s" if r.stream else "n"] += 1

            for item in conv.main.items:
                if isinstance(item, TraceRequest):
                    count(item, seen_main, set())
                    continue
                spawns += 1
                for sub in item.subs:
                    subs += 1
                    own: set = set()
                    for _, r in walk(sub):
                        count(r, own, seen_main)
            main = [x for x in conv.main.items if isinstance(x, TraceRequest)]
            first.append(main[0].n_in)
            last.append(main[-1].n_in)

        def p(x):
            return {"p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90))}

        return {
            "conversations": len(self.conversations),
            "requests": len(self._flat),
            "subagent_requests": sum(1 for _, s, _ in self._flat if s.index >= 0),
            "subagent_sessions": subs,
            "spawns": spawns,
            "streaming_requests": stream["s"],
            "non_streaming_requests": stream["n"],
            "block_size": self.conversations[0].block,
            "context_first_request": p(first),
            "context_last_request": p(last),
            "blocks": blocks,
            "block_hits": hits,
            "within_conversation_block_hit_ratio": hits / blocks if blocks else 0.0,
            "conversation_wide_block_hit_ratio": wide / blocks if blocks else 0.0,
            "think_time_sources": dict(self.think_sources),
            "definition": "a full block hits when its hash id appeared in an earlier request "
                          "of its own session or, for a sub-agent, of its parent before the "
                          "spawn (file order); hit blocks / full blocks",
        }

    def __len__(self) -> int:
        return len(self._flat)
