"""Run a resolved job file, whatever workload it names (``kvbench run`` starts this one).

    locust -f loadgen/job.py --headless -u 1 -t 60s --kvbench-job results/<run>/job-....json
"""

from kvbench.loadgen.user import KVBenchUser


class JobUser(KVBenchUser):
    workload = ""  # the job file's
