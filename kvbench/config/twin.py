"""``[twin]``: what ``kvbench calibrate`` learned about an endpoint, beside the ``[[endpoints]]``
table (kind "builtin") that carries the fitted options. Permissive: the calibration writes
what it found (its source run, residuals, notes) and a reader takes the fields below,
ignoring the rest.

    [twin]
    endpoint = "twin"                 # the built-in endpoint the fit is of (optional when
                                      # the config has one built-in endpoint)
    fitted = ["prefill_tok_per_ms", "kv_capacity_tokens"]   # option names fitted from a run
    [twin.fit.prefill_tok_per_ms]
    value = 38.7
    stderr = 0.6
    status = "fit"                    # "fit" (a value), "bound" (at least value: the limit
                                      # never bound in the run), "metrics" (read from the
                                      # engine's own metrics)

``kvbench predict`` lists every option of the built-in endpoint not in ``fitted`` as assumed
(its value, and "given" when the endpoint's options set it, else "default").
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvbench.workloads.specs import Name

MAX_FITTED = 1000  # parameters one twin names: the emulator has about fifty options


class TwinFit(BaseModel):
    """One parameter's fit: its value, standard error and how it was found."""

    model_config = ConfigDict(extra="allow", frozen=True)

    value: float | int | str | bool | None = None
    stderr: float | None = None
    status: str = "fit"  # "fit" | "bound" | "metrics" (a calibration may add its own)


class TwinSpec(BaseModel):
    """The ``[twin]`` table (see the module's docstring)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    endpoint: Name | None = None
    fitted: list[str] = Field(default_factory=list, max_length=MAX_FITTED)
    fit: dict[str, TwinFit] = Field(default_factory=dict, max_length=MAX_FITTED)
