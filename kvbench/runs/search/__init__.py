"""The capacity search (``[profiles.*] pacing = "search"``): for one endpoint x workload, the
highest offered Poisson rate at which every class with an SLO meets its attainment target, or
with ``search.loop = "closed"`` the highest number of closed-loop users (each probe a stage of
that many users, ``loadgen.pacing.ClosedLoopStages``; the plan in whole users).

``kvbench run`` drives it (``run``): one Locust child for the whole search, fed one probe at a
time through a control file in the run directory. Each probe is an ordinary stage of the run
(records, metrics, report and gate see stages); its role in the search, its verdict and why
it stopped land in run.json's stage entries. One module per concern:

- ``control``: the control file (its path, its typed content, the probe as planned);
- ``feed``: the load process's side, reading the probes between stages (``ProbeFeed``);
- ``plan``: where to probe next, and how a verdict settles (``Planner``, pure);
- ``watch``: one probe judged as its records arrive (``Watch``);
- ``backend``: the Locust child and the records it leaves (``LocustBackend``);
- ``driver``: the state machine over plan, watch and backend (``Search``, ``drive``, ``run``);
- ``console``: what it says; ``annotate``: its notes on run.json's stages.

The load process imports this package for ``ProbeFeed``: nothing here imports pandas,
pyarrow or pydantic at import time.
"""

from kvbench.runs.search.annotate import annotate
from kvbench.runs.search.backend import LocustBackend
from kvbench.runs.search.control import Control, Probe, ProbeEntry, control_path
from kvbench.runs.search.driver import POLL_S, Result, Search, drive, run
from kvbench.runs.search.feed import FEED_WAIT_S, ProbeFeed
from kvbench.runs.search.plan import STEADY_RESIDENCES, Planner
from kvbench.runs.search.watch import Watch

__all__ = ["Control", "FEED_WAIT_S", "LocustBackend", "POLL_S", "Planner", "Probe", "ProbeEntry",
           "ProbeFeed", "Result", "STEADY_RESIDENCES", "Search", "Watch", "annotate",
           "control_path", "drive", "run"]
