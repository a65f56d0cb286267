"""The shipped locustfiles are found without importing loadgen; ``kvbench locustfile NAME``
prints one's absolute path for ``locust -f``; the Locust command follows the job."""

import subprocess
import sys
from pathlib import Path

from kvbench.core.contract import StagePlan
from kvbench.runs import locust
from kvbench.runs.job import Job, JobEndpoint

ROOT = Path(__file__).resolve().parent.parent


def test_locustfiles_are_found_on_disk():
    files = locust.locustfiles()
    assert {"longctx", "rag", "agent", "mix", "trace", "job"} <= set(files)
    assert "user" not in files and "context" not in files
    assert files["longctx"] == ROOT / "loadgen" / "longctx.py"


def test_kvbench_locustfile_prints_the_path_or_names_the_choices():
    p = subprocess.run([sys.executable, "-m", "kvbench", "locustfile", "longctx"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    path = Path(p.stdout.strip())
    assert path.is_absolute() and path.exists() and "class LongContractUser" in path.read_text()
    p = subprocess.run([sys.executable, "-m", "kvbench", "locustfile", "nope"],
                       capture_output=True, text=True, timeout=60)
    msg = p.stderr.strip()
    assert p.returncode == 2 and "\n" not in msg and "'longctx'" in msg and "'nope'" in msg


def test_locust_command_follows_the_job(tmp_path):
    job = Job(endpoint=JobEndpoint(name="e", url="http://h:1"), workload="chat",
              pacing="closed", stages=[StagePlan(0, 2.5, None, 3), StagePlan(1, 9, None, 7)],
              stage_index=1, run_id="r")
    cmd, limit = locust.command(job, tmp_path / "j.json", processes=2)
    assert cmd[cmd.index("-u") + 1] == "7" and cmd[cmd.index("-t") + 1] == "9s"
    assert "--kvbench-job" in cmd and cmd[cmd.index("--processes") + 1] == "2"
    open_job = Job(endpoint=job.endpoint, workload="chat", pacing="poisson",
                   stages=[StagePlan(0, 2, 5.0), StagePlan(1, 3, 9.0)], timeout_s=10, run_id="r")
    cmd, limit = locust.command(open_job, tmp_path / "j.json", processes=1)
    assert cmd[cmd.index("-t") + 1] == "15s" and limit == 15 + locust.GRACE_S


def test_kvbench_locustfile_options_lists_every_option_locust_gets():
    """``locust -f ... --help`` prints before the locustfile is imported (Locust's order), so
    ``kvbench locustfile --options`` lists the ``--kvbench-*`` options: every one the
    locustfiles' listeners register with Locust's own parser, with its environment variable."""
    import argparse

    from locust import argument_parser

    import kvbench.loadgen.user  # noqa: F401 - every listener a shipped locustfile registers

    parser = argument_parser.get_parser()
    ours = {a.option_strings[0]: a for a in parser._actions
            if a.option_strings and a.option_strings[0].startswith("--kvbench-")
            and a.help != argparse.SUPPRESS}
    assert "--kvbench-model" in ours and "--kvbench-stop-after-failures" in ours
    p = subprocess.run([sys.executable, "-m", "kvbench", "locustfile", "--options"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    for name, action in ours.items():
        assert name in p.stdout, name
        env = getattr(action, "env_var", None)
        if env:
            assert f"[env var: {env}]" in text, (name, env)
