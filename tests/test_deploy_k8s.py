"""deploy/k8s (issue 15): every manifest is valid against the Kubernetes API schemas, checked
offline (kubernetes-validate ships the schemas), strictly (no unknown field); and the pieces fit:
the ConfigMap's bench.toml loads, workers reach the master's Service on its port, the pods run
kvbench's own flags and locustfile."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the test extra")
kv = pytest.importorskip("kubernetes_validate",
                         reason="kubernetes-validate (test extra) validates the manifests")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
K8S_VERSION = "1.30.0"  # a version every current cluster serves these API groups at


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def _by_kind(kind: str) -> list[dict]:
    return [d for _, d in _docs() if d["kind"] == kind]


def _pod(doc: dict) -> dict:
    spec = doc["spec"]
    if doc["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec["template"]


def test_every_manifest_is_valid_against_the_kubernetes_schemas():
    docs = _docs()
    assert {d["kind"] for _, d in docs} >= {"ConfigMap", "Deployment", "Service", "CronJob",
                                            "PersistentVolumeClaim"}
    for name, doc in docs:
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc.message} at "
                        f"{'.'.join(str(p) for p in exc.path)}")


def test_a_broken_manifest_is_caught():
    """The check can fail: a misspelt field and a wrong type are both refused."""
    dep = next(d for d in _by_kind("Deployment") if d["metadata"]["name"] == "kvbench-worker")
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["replica"] = bad["spec"].pop("replicas")
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["replicas"] = "four"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_the_pieces_fit(tmp_path):
    from kvbench.config import load_config

    (cm,) = _by_kind("ConfigMap")
    toml = tmp_path / "bench.toml"
    toml.write_text(cm["data"]["bench.toml"])
    cfg = load_config(toml)  # the suite the pods read is one kvbench accepts
    assert cfg.suite.results_dir == "/results"
    (svc,) = _by_kind("Service")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "locust-master")
    masters = [d for d in _by_kind("Deployment") + _by_kind("CronJob")
               if _pod(d)["metadata"]["labels"].get("app.kubernetes.io/component") == "master"]
    assert len(masters) == 2
    for m in masters:  # the Service reaches either form of the master
        labels = _pod(m)["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
        c = _pod(m)["spec"]["containers"][0]
        line = " ".join(c.get("command", []) + c.get("args", []))
        assert "--kvbench-ship-records" in line or "--expect-workers" in line
        assert f"{port}" in line
    worker = next(d for d in _by_kind("Deployment")
                  if d["metadata"]["name"] == "kvbench-worker")
    args = shlex.split(" ".join(_pod(worker)["spec"]["containers"][0]["args"]))
    assert args[args.index("--master-host") + 1] == svc["metadata"]["name"]
    assert args[args.index("--master-port") + 1].rstrip(";") == str(port)
    # the workers run the locustfile both masters run (Locust matches users by class name)
    assert '"$(kvbench' in " ".join(_pod(worker)["spec"]["containers"][0]["args"])
    for m in masters:
        c = _pod(m)["spec"]["containers"][0]
        line = " ".join(c.get("command", []) + c.get("args", []))
        assert "kvbench locustfile job" in line or line.startswith("kvbench run")
    # every kvbench run flag the nightly job gives exists
    from kvbench.cli import build_parser

    cron = _by_kind("CronJob")[0]
    c = _pod(cron)["spec"]["containers"][0]
    build_parser(c["command"][1:]).parse_args(c["command"][1:] + c["args"])
