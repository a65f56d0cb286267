"""``[storage]``: how ``kvbench run`` reaches an object store named by ``suite.results_dir =
"s3://bucket/prefix"`` (``kvbench.core.objstore``). Every field may stay unset: AWS S3 with the
region and endpoint of the environment (``AWS_REGION``, ``AWS_ENDPOINT_URL``). Credentials are
never settings: the AWS SDK takes them from the environment or the profile chain."""

from __future__ import annotations

from pydantic import Field, field_validator

from kvbench.workloads.specs import Strict


class StorageSpec(Strict):
    # an S3-compatible server: MinIO, Ceph RGW, R2 ("http://127.0.0.1:9000"); None: AWS, or
    # AWS_ENDPOINT_URL(_S3) when set
    endpoint_url: str | None = Field(default=None, max_length=500)
    region: str | None = Field(default=None, max_length=64, pattern=r"^[a-z0-9-]+$")
    # True: https://host/bucket/key (MinIO, Ceph); False: https://bucket.host/key; None: the
    # SDK's default as kvbench builds it (path-style)
    path_style: bool | None = None

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        from kvbench.core.objstore import endpoint_problem

        why = v is not None and endpoint_problem(v)
        if why:
            raise ValueError(why)
        return v


class HistorySpec(Strict):
    """``[history]``: how much of the results store's history (``kvbench.core.manifest``) the
    gate keeps after recording a run; unset: all. A suite's newest passing or accepted run is
    always kept (``--baseline last-pass`` needs it); run folders are never removed here."""

    keep_runs: int | None = Field(default=None, ge=1, le=100_000)
    keep_days: float | None = Field(default=None, gt=0, le=36_500)
