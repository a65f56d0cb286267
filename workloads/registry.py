"""Build a workload from its ``[workloads.<name>]`` table."""

from __future__ import annotations

from kvbench.core.errors import UserError
from kvbench.workloads.specs import (
    AgentSpec,
    ChatSpec,
    HogwildSpec,
    LongctxSpec,
    MixSpec,
    RagSpec,
    TraceSpec,
)
from kvbench.workloads.tokenizer import get_tokenizer


def _generator(name: str, spec, tokenizer, seed: int, n_requests: int | None = None):
    if spec.working_set is not None and not isinstance(spec, (RagSpec, LongctxSpec,
                                                              AgentSpec)):
        raise UserError(f"workloads.{name}.working_set: sizing applies to rag, longctx and "
                        f"agent workloads, not {spec.kind}; remove working_set")
    if isinstance(spec, RagSpec):
        from kvbench.workloads.rag import RagWorkload
        return RagWorkload(name, spec, tokenizer, seed, n_requests)
    if isinstance(spec, AgentSpec):
        from kvbench.workloads.agent import AgentWorkload
        return AgentWorkload(name, spec, tokenizer, seed, n_requests)
    if isinstance(spec, LongctxSpec):
        from kvbench.workloads.longctx import LongctxWorkload
        return LongctxWorkload(name, spec, tokenizer, seed, n_requests)
    if isinstance(spec, ChatSpec):
        from kvbench.workloads.chat import ChatWorkload
        return ChatWorkload(name, spec, tokenizer, seed, n_requests)
    if isinstance(spec, HogwildSpec):
        from kvbench.workloads.hogwild import HogwildWorkload
        return HogwildWorkload(name, spec, tokenizer, seed, n_requests)
    if isinstance(spec, TraceSpec):
        from kvbench.workloads.traces import open_trace
        if n_requests is not None and (spec.limit is None or spec.limit > n_requests):
            spec = spec.model_copy(update={"limit": n_requests})
        return open_trace(name, spec, tokenizer, seed)
    raise UserError(f"workloads.{name}: kind {spec.kind!r} cannot be built here")


def build_spec(name: str, spec, tokenizer, seed: int, n_requests: int | None = None):
    """A workload from a spec outside any config (tests, trace files given on the command
    line); a mix needs its config, use ``make_workload``."""
    if isinstance(spec, MixSpec):
        raise UserError(f"workloads.{name}: a mix needs the config that defines its parts")
    return _generator(name, spec, tokenizer, seed, n_requests)


def make_workload(name: str, cfg, tokenizer=None):
    """The workload of ``[workloads.<name>]`` in ``cfg`` (a ``kvbench.config.BenchConfig``).

    Tokenizer: ``get_tokenizer(cfg.suite.tokenizer)`` unless given; seed: the table's
    ``seed`` or ``suite.seed``.
    """
    if name not in cfg.workloads:
        raise UserError(f"workload {name!r} is not defined in the config; use one of "
                        f"{sorted(cfg.workloads)}")
    tok = tokenizer if tokenizer is not None else get_tokenizer(cfg.suite.tokenizer)
    spec = cfg.workloads[name]

    def seed_of(s) -> int:
        return s.seed if s.seed is not None else cfg.suite.seed

    if isinstance(spec, MixSpec):
        from kvbench.workloads.mix import MixWorkload

        def build(cname: str, n: int):
            return _generator(cname, cfg.workloads[cname], tok, seed_of(cfg.workloads[cname]),
                              n)

        if spec.working_set is not None:
            raise UserError(f"workloads.{name}.working_set: set working_set on the mix's "
                            "parts, not on the mix; remove it")
        return MixWorkload(name, spec, seed_of(spec), build)
    return _generator(name, spec, tok, seed_of(spec))
