"""The results store: where a run's files live and how they are read back; one import for
the store's parts, each in its own module:

* ``kvbench.core.contract``: run.json, the sidecars, stages, endpoints, SLOs as typed classes;
* ``kvbench.core.runjson``: run.json and sidecars on disk (written whole, read checked);
* ``kvbench.core.shards``: the tables' shards and Parquet files, read (``scan``, ``ShardTail``)
  and written (``ShardWriter``);
* ``kvbench.core.compact``: shards folded into Parquet, a finished run read whole;
* ``kvbench.core.layout``: the compacted files (layout 2: requests as a Hive-partitioned
  dataset, ``requests/endpoint=<e>/workload=<w>/part-<n>.parquet``), listed and written;
* ``kvbench.core.rows``: what a load process writes, without pyarrow.

``<results_dir>/<run_id>/`` holds the tables of ``kvbench.core.schema`` and ``run.json``
(``RunMeta``; ``runs.finalize`` is its one writer). Live shards are written one per process
and table, append-only: the collectors' by ``ShardWriter`` (Arrow IPC, ``.arrows``), the load
processes' by ``core.rows.RowShardWriter`` (msgpack rows, ``.rows``), which also write each
request's start, ``STARTS``, that ``compact`` folds in.
"""

from kvbench.core.compact import (ALIGNED, KILLED_IN_FLIGHT, Results,  # noqa: F401
                                  align_worker_clocks, cancelled_records, compact,
                                  load_results, read_starts, unfinished_starts)
from kvbench.core.contract import RunMeta  # noqa: F401
from kvbench.core.layout import LAYOUT, PARTITIONED, dataset, table_files  # noqa: F401
from kvbench.core.rows import (START_COLUMNS, new_run_id, shard_files,  # noqa: F401
                               shard_stem, worker_name, write_proc_meta)
from kvbench.core.runjson import (check_run_json, git_commit, read_meta,  # noqa: F401
                                  read_proc_meta, run_meta, versions, write_run_json)
from kvbench.core.shards import (NOT_NULL, REQUIRED, SHARD_SCHEMAS, STARTS,  # noqa: F401
                                 ShardTail, ShardWriter, check_schema, read_shards,
                                 read_table, scan)
