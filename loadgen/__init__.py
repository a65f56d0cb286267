"""The load generator: Locust users and locustfiles, and the parts a load process runs.

* the locustfiles (``agent``, ``chat``, ``job``, ``longctx``, ``mix``, ``rag``, ``trace``) and
  ``user`` (``KVBenchUser``, the base of every kvbench Locust user);
* ``wiring``: the Locust integration: the load context a run shares, the event hooks, the web
  UI's kvbench tab, sessions built ahead;
* ``fleet``: a distributed run, records sent from workers to the master over Locust's messages;
* ``liveview``: the live figures (the web tab, ``kvbench run``'s progress line), from the same
  metric definitions as the report;
* ``plan``: what a load process sends and when: its job from Locust's options, arrival pacing;
* ``timing``: the streaming OpenAI client and its clocks, SSE, token checks, the event loop's
  lag, and the record sink.

Each imports only those below it in this list (pyproject.toml's import-linter contracts).
The modules' old paths (``kvbench.loadgen.client``, ...) import as the same modules.
"""

from kvbench.core.moved import keep_old_paths

keep_old_paths(__name__, {
    "client": "timing.client", "sse": "timing.sse", "openai": "timing.openai",
    "tokcheck": "timing.tokcheck", "looplag": "timing.looplag", "sink": "timing.sink",
    "context": "wiring.context", "hooks": "wiring.hooks", "webtab": "wiring.webtab",
    "prefetch": "wiring.prefetch", "distributed": "fleet.distributed", "live": "liveview.live",
    "options": "plan.options", "pacing": "plan.pacing",
})
