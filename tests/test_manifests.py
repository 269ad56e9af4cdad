"""The launch manifests: the Slurm template and the Kubernetes manifests, checked offline.

Kubernetes objects are validated against the Kubernetes OpenAPI schemas shipped in the
``kubernetes-validate`` package (strict: unknown fields fail); KEDA ScaledObjects, whose
CRD those schemas lack, against ``ops/k8s/keda-scaledobject.schema.json``. Every container
command must parse with the real CLI parser and config loader, so a renamed subcommand or
config field fails here. The Slurm template runs for real under bash; no Slurm exists on
this machine, so ``scontrol`` and ``srun`` are small stub scripts on PATH that echo their
arguments (``scontrol show hostnames`` answers with the fake node list).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pipeline import cli
from pipeline.config import load_config
from pipeline.keys import GENERATORS_GROUP, VERIFIERS_GROUP, Keys

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "ops" / "k8s"
SBATCH = ROOT / "ops" / "slurm" / "pipeline.sbatch"
K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
STAGE_COMMANDS = {"feed", "generate", "verify", "train", "exporter"}


# ----------------------------------------------------------------------------- helpers


def _subcommands() -> set[str]:
    parser = cli._parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return set(sub.choices)


def _documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def _of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in _documents() if doc["kind"] == kind]


def _run_config_text() -> str:
    (cm,) = [d for d in _of_kind("ConfigMap") if d["metadata"]["name"] == "rlpipe-config"]
    return cm["data"]["config.toml"]


def _keda_schema() -> dict:
    return json.loads((K8S / "keda-scaledobject.schema.json").read_text())


def _parse_stage(argv: list[str], config: Path):
    """Parse a stage's argv with the real CLI, its --config pointing at ``config``."""
    argv = list(argv)
    argv[argv.index("--config") + 1] = str(config)
    return cli.parse(argv)


# ----------------------------------------------------------------------------- Kubernetes


def test_the_kustomization_lists_every_manifest_file():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_kubernetes_object_is_valid_against_the_kubernetes_schemas(version):
    checked = 0
    for name, doc in _documents():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")
        checked += 1
    kinds = {doc["kind"] for _, doc in _documents()}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "PersistentVolumeClaim", "ScaledObject"} <= kinds
    assert checked >= 10


def test_the_kubernetes_schemas_catch_a_misspelled_field():
    (deployment,) = [d for d in _of_kind("Deployment") if d["metadata"]["name"] == "rlpipe-trainer"]
    bad = json.loads(json.dumps(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["comand"] = ["pipeline"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_there_is_one_deployment_per_stage_and_singletons_never_overlap():
    deployments = {d["metadata"]["name"]: d for d in _of_kind("Deployment")}
    assert set(deployments) == {f"rlpipe-{s}" for s in ("feeder", "generator", "verifier", "trainer", "exporter")}
    for name in ("rlpipe-trainer", "rlpipe-feeder", "rlpipe-exporter"):
        assert deployments[name]["spec"]["replicas"] == 1
        assert deployments[name]["spec"]["strategy"]["type"] == "Recreate", f"{name}: two replicas must never overlap"


def test_every_container_runs_a_real_pipeline_command_with_real_config_fields(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(_run_config_text())
    subcommands = _subcommands()
    seen = set()
    for d in _of_kind("Deployment"):
        pod = d["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            if c.get("command") != ["pipeline"]:
                assert c["command"][0] == "sh", f"{d['metadata']['name']}/{c['name']}: runs {c['command']}"
                continue
            args = c["args"]
            assert args[0] in subcommands, f"{c['name']}: `pipeline {args[0]}` is not a subcommand"
            # Kubernetes expands $(VAR) in args from the container's env: each must be defined there.
            env = {e["name"] for e in c.get("env", [])}
            for var in re.findall(r"\$\(([A-Z_]+)\)", " ".join(args)):
                assert var in env, f"{c['name']}: $({var}) is not in its env"
            expanded = [re.sub(r"\$\(POD_IP\)", "10.1.2.3", re.sub(r"\$\(POD_NAME\)", "rlpipe-generator-abc12", a))
                        for a in args]
            # Unknown subcommands, flags or --section.field names, or bad values, raise here.
            parsed, cfg = _parse_stage(expanded, config)
            assert parsed.command == args[0]
            if args[0] == "train":
                # Fixed ports behind the trainer's Service, advertised by its DNS name.
                w = cfg.weights
                assert (w.tcp_host, w.advertise_host) == ("0.0.0.0", "rlpipe-trainer"), "bind all, advertise the Service"
                svc = next(d for d in _of_kind("Service") if d["metadata"]["name"] == "rlpipe-trainer")
                assert {w.tcp_port, w.announce_port} <= {p["port"] for p in svc["spec"]["ports"]}
            if args[0] in ("generate", "verify"):
                assert parsed.worker_id == "rlpipe-generator-abc12", "the pod name is the consumer name"
            seen.add(args[0])
    assert STAGE_COMMANDS <= seen


def test_the_run_config_is_valid_and_made_for_several_hosts(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(_run_config_text())
    cfg = load_config(config)  # unknown fields or bad values raise
    assert cfg.weights.transport in ("tcp", "ucx"), "shm works on one host only"
    assert cfg.metrics.host == "0.0.0.0" and cfg.metrics.port > 0, "Prometheus scrapes every pod from outside"
    assert cfg.run_id and cfg.model.base_dir.startswith("/data/") and cfg.runs_dir.startswith("/data/")


def test_every_pod_carries_prometheus_scrape_annotations_matching_its_port():
    metrics_port = tomllib.loads(_run_config_text())["metrics"]["port"]
    pods = [(d["metadata"]["name"], d["spec"]["template"]) for d in _of_kind("Deployment") + _of_kind("StatefulSet")]
    assert len(pods) == 6
    for name, template in pods:
        ann = template["metadata"]["annotations"]
        assert {"prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"} <= set(ann), name
        assert ann["prometheus.io/path"] == "/metrics"
        if name == "rlpipe-redis":
            assert ann["prometheus.io/scrape"] == "false", "Redis serves no /metrics; the exporter reports it"
            continue
        assert ann["prometheus.io/scrape"] == "true"
        assert int(ann["prometheus.io/port"]) == metrics_port
        ports = [p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])]
        assert metrics_port in ports, name


def test_every_stage_gets_the_redis_url_from_the_config_map_and_the_password_from_a_secret():
    (cm,) = [d for d in _of_kind("ConfigMap") if d["metadata"]["name"] == "rlpipe-config"]
    assert cm["data"]["REDIS_URL"].startswith("redis://rlpipe-redis:6379/")
    for d in _of_kind("Deployment") + _of_kind("StatefulSet"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "rlpipe-redis", "key": "password"}
            if d["kind"] == "Deployment":
                assert env["REDIS_URL"]["valueFrom"]["configMapKeyRef"] == {"name": "rlpipe-config", "key": "REDIS_URL"}
    # No Secret is shipped: the password is created in the cluster, never committed.
    assert not _of_kind("Secret")


def test_redis_is_a_statefulset_with_a_volume_claim_aof_and_a_service():
    (sts,) = _of_kind("StatefulSet")
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    (conf_map,) = [d for d in _of_kind("ConfigMap") if d["metadata"]["name"] == "rlpipe-redis-conf"]
    conf = dict(line.split(None, 1) for line in conf_map["data"]["redis.conf"].splitlines() if line.strip())
    assert conf["appendonly"] == "yes" and conf["dir"] == "/data" and conf["maxmemory-policy"] == "noeviction"
    mounts = {m["mountPath"]: m["name"] for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/data"] == "data"
    services = {s["metadata"]["name"]: s for s in _of_kind("Service")}
    assert services["rlpipe-redis"]["spec"]["ports"][0]["port"] == 6379
    assert services["rlpipe-trainer"]["spec"]["selector"]["app.kubernetes.io/component"] == "trainer"


def test_scaled_objects_match_the_keda_schema_and_scale_on_the_right_streams_and_groups():
    schema = _keda_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    run_id = tomllib.loads(_run_config_text())["run_id"]
    keys = Keys(run_id)
    deployments = {d["metadata"]["name"] for d in _of_kind("Deployment")}
    expected = {"rlpipe-generator": (keys.shard(0).prompts, GENERATORS_GROUP), "rlpipe-verifier": (keys.shard(0).rollouts, VERIFIERS_GROUP)}
    scaled = _of_kind("ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == set(expected)
    for so in scaled:
        errors = sorted(validator.iter_errors(so), key=lambda e: list(e.path))
        assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
        target = so["spec"]["scaleTargetRef"]["name"]
        assert target in deployments
        stream, group = expected[target]
        metas = [t["metadata"] for t in so["spec"]["triggers"]]
        assert all(t["type"] == "redis-streams" for t in so["spec"]["triggers"])
        assert all(m["stream"] == stream and m["consumerGroup"] == group for m in metas)
        assert any("lagCount" in m for m in metas) and any("pendingEntriesCount" in m for m in metas)
        assert all(m["passwordFromEnv"] == "REDIS_PASSWORD" for m in metas)
        assert so["spec"]["minReplicaCount"] >= 1, "a stage scaled to zero would stall the run"


@pytest.mark.parametrize("change, why", [
    (lambda m: m.update(lagcount="5"), "a misspelled parameter"),
    (lambda m: m.pop("activationLagCount"), "lagCount without activationLagCount"),
    (lambda m: m.update(lagCount=64), "a number where KEDA wants a string"),
    (lambda m: m.pop("stream"), "no stream"),
    (lambda m: m.update(address="redis://rlpipe-redis:6379/0"), "a URL where KEDA wants host:port"),
])
def test_the_keda_schema_rejects_what_keda_would(change, why):
    validator = jsonschema.Draft202012Validator(_keda_schema())
    so = json.loads(json.dumps(_of_kind("ScaledObject")[0]))
    meta = next(t["metadata"] for t in so["spec"]["triggers"] if "lagCount" in t["metadata"])
    change(meta)
    assert list(validator.iter_errors(so)), why


def _cluster_scaled_objects() -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / "cluster" / "keda.yaml").read_text()) if d]


def test_cluster_scaled_objects_cover_every_shard_of_the_sharded_streams():
    """ops/k8s/cluster/keda.yaml: one redis-cluster-streams lag and pending trigger per shard,
    on exactly the keys pipeline.keys gives a sharded run of the manifests' run id."""
    from pipeline.config import RedisConfig

    validator = jsonschema.Draft202012Validator(_keda_schema())
    run_id = tomllib.loads(_run_config_text())["run_id"]
    base = {so["metadata"]["name"]: so["spec"]["scaleTargetRef"]["name"] for so in _of_kind("ScaledObject")}
    scaled = _cluster_scaled_objects()
    assert {so["metadata"]["name"]: so["spec"]["scaleTargetRef"]["name"] for so in scaled} == base
    for so in scaled:
        errors = sorted(validator.iter_errors(so), key=lambda e: list(e.path))
        assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
        metas = [t["metadata"] for t in so["spec"]["triggers"]]
        assert all(t["type"] == "redis-cluster-streams" for t in so["spec"]["triggers"])
        shards = len({m["stream"] for m in metas})
        assert shards >= 2
        keys = Keys.of(run_id, RedisConfig(cluster=True, shards=shards))
        name, group = {"rlpipe-generator": ("prompts", GENERATORS_GROUP),
                       "rlpipe-verifier": ("rollouts", VERIFIERS_GROUP)}[so["metadata"]["name"]]
        expected = {getattr(keys.shard(k), name) for k in range(shards)}
        assert {m["stream"] for m in metas if "lagCount" in m} == expected
        assert {m["stream"] for m in metas if "pendingEntriesCount" in m} == expected
        assert all(m["consumerGroup"] == group and m["passwordFromEnv"] == "REDIS_PASSWORD" for m in metas)
        assert so["spec"]["minReplicaCount"] >= 1


@pytest.mark.parametrize("change, why", [
    (lambda m: m.update(address=m.pop("addresses")), "the single-server address field"),
    (lambda m: m.update(databaseIndex="0"), "a database index (a cluster has only 0)"),
    (lambda m: m.update(addresses="redis://node:6379"), "a URL where KEDA wants host:port"),
    (lambda m: m.pop("activationLagCount"), "lagCount without activationLagCount"),
])
def test_the_keda_schema_checks_cluster_triggers_too(change, why):
    validator = jsonschema.Draft202012Validator(_keda_schema())
    so = json.loads(json.dumps(_cluster_scaled_objects()[0]))
    meta = next(t["metadata"] for t in so["spec"]["triggers"] if "lagCount" in t["metadata"])
    change(meta)
    assert list(validator.iter_errors(so)), why


# ----------------------------------------------------------------------------- Slurm


_SRUN_STUB = r"""#!/bin/sh
# Logs its arguments and the REDIS_URL/RUN_ID a step would inherit. With STUB_STEPS set, a
# stage step stays up until SIGTERM (logged), and the trainer step ends once STUB_STEPS
# steps have been logged, so the template's stop path runs against live steps.
name=$(for a in "$@"; do case $a in --job-name=*) echo "${a#--job-name=}";; esac; done)
trap 'kill $pid 2>/dev/null; echo "TERM $name" >> "$STUB_LOG"; exit 0' TERM
printf "REDIS_URL=%s RUN_ID=%s srun %s\n" "$REDIS_URL" "$RUN_ID" "$*" >> "$STUB_LOG"
[ -n "$STUB_STEPS" ] && [ "$name" != pretrain ] || exit 0
if [ "$name" = trainer ]; then
  i=0
  while [ "$(grep -c ' srun ' "$STUB_LOG")" -lt "$STUB_STEPS" ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
  exit 0
fi
sleep 60 & pid=$!
wait $pid
"""


def _stubs(tmp_path: Path) -> Path:
    """``scontrol`` and ``srun`` stand-ins on PATH that log their arguments and exit 0
    (``scontrol show hostnames`` answers with $FAKE_HOSTNAMES)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "scontrol $*" >> "$STUB_LOG"\n'
                                      'for n in $FAKE_HOSTNAMES; do echo "$n"; done\n')
    (bin_dir / "srun").write_text(_SRUN_STUB)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _sbatch(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin" if (tmp_path / "bin").exists() else _stubs(tmp_path)
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_LOG": str(tmp_path / "stub.log"), "HOME": str(tmp_path),
            "SLURM_JOB_NODELIST": "n[1-4]", "FAKE_HOSTNAMES": "n1 n2 n3 n4", "SLURM_JOB_ID": "4242"}
    return subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**base, **env})


def _pipeline_argv(line: str) -> list[str]:
    words = shlex.split(line)
    return words[words.index("pipeline") + 1:] if "pipeline" in words else words[words.index("pipeline.cli") + 1:]


def _srun_options(line: str) -> dict[str, str]:
    words = shlex.split(line)
    return dict(w[2:].split("=", 1) for w in words[words.index("srun") + 1:] if w.startswith("--") and "=" in w)


def test_the_slurm_template_is_valid_bash():
    p = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert os.access(SBATCH, os.X_OK)


def test_the_slurm_template_documents_every_variable_it_reads():
    text = SBATCH.read_text()
    header = text.split("set -euo pipefail", 1)[0]
    read = set(re.findall(r"^([A-Z_]+)=\$\{\1:-", text, re.M))
    assert len(read) >= 15
    for var in read:
        assert re.search(rf"^#\s+{var}\s", header, re.M), f"{var} is read but not documented in the header"


def test_a_dry_run_places_every_stage_on_its_node_with_one_run_id_server_and_tcp_weights(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[trainer]\nsteps = 10\n')
    p = _sbatch(tmp_path, DRY_RUN="1", CONFIG=str(config), REDIS_ADDR="10.0.0.1", TRAINER_ADDR="10.0.0.2",
                GENERATORS_PER_NODE="2", VERIFIERS_PER_NODE="1", GPUS_PER_GENERATOR="1",
                EXTRA_ARGS="--trainer.eval_every 5")
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stdout.splitlines() if x.startswith("srun ")]
    by_name = {_srun_options(x)["job-name"]: x for x in lines}
    assert set(by_name) == {"redis", "pretrain", "trainer", "feeder", "exporter",
                            "gen-0", "gen-1", "gen-2", "gen-3", "ver-0", "ver-1"}
    node = {name: _srun_options(x)["nodelist"] for name, x in by_name.items()}
    assert node["redis"] == node["feeder"] == node["exporter"] == "n1"
    assert node["trainer"] == node["pretrain"] == "n2"
    assert [node[f"gen-{i}"] for i in range(4)] == ["n3", "n3", "n4", "n4"]
    assert [node[f"ver-{i}"] for i in range(2)] == ["n3", "n4"]
    assert all("--gres=gpu:1" in by_name[f"gen-{i}"] for i in range(4)) and "--gres" not in by_name["ver-0"]
    # GPU steps get GPUs of their own; CPU-only steps share their node.
    assert all("--exact" in by_name[f"gen-{i}"] and "--overlap" not in by_name[f"gen-{i}"] for i in range(4))
    assert all("--overlap" in by_name[n] for n in ("redis", "trainer", "feeder", "exporter", "ver-0", "ver-1"))

    redis_argv = shlex.split(by_name["redis"])
    assert redis_argv[redis_argv.index("--bind") + 1] == "10.0.0.1"
    assert redis_argv[redis_argv.index("--appendonly") + 1] == "yes"

    subcommands = _subcommands()
    ports = set()
    for name, line in by_name.items():
        if name == "redis":
            continue
        argv = _pipeline_argv(line)
        assert argv[0] in subcommands, line
        parsed, cfg = _parse_stage(argv, config)  # unknown flags or config fields raise
        if name == "pretrain":
            continue
        assert cfg.run_id == "rlpipe-4242" and cfg.redis.url == "redis://10.0.0.1:6379/0", line
        assert cfg.weights.transport == "tcp" and cfg.trainer.steps == 10 and cfg.trainer.eval_every == 5
        ports.add(cfg.metrics.port)
        if name == "trainer":
            assert cfg.weights.tcp_host == "10.0.0.2", "the publisher binds the trainer node's address"
        else:
            assert cfg.weights.tcp_host == "127.0.0.1", "only the trainer is told an address"
        if name.startswith(("gen-", "ver-")):
            assert parsed.worker_id == name
    assert len(ports) == 9 and min(ports) == 9400, "one metrics port per process"


def test_a_torchrun_launcher_prefixes_the_trainer_step(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("")
    p = _sbatch(tmp_path, DRY_RUN="1", CONFIG=str(config), REDIS_URL="redis://redis.example:6379/0",
                TRAINER_ADDR="10.0.0.2", TRAINER_LAUNCHER="torchrun --nnodes=1 --nproc-per-node=8")
    assert p.returncode == 0, p.stderr
    (trainer,) = [x for x in p.stdout.splitlines() if "--job-name=trainer" in x]
    words = shlex.split(trainer)
    assert words[words.index("torchrun"):words.index("torchrun") + 5] == [
        "torchrun", "--nnodes=1", "--nproc-per-node=8", "-m", "pipeline.cli"]
    _, cfg = _parse_stage(_pipeline_argv(trainer), config)
    assert cfg.redis.url == "redis://redis.example:6379/0"
    assert "--job-name=redis" not in p.stdout, "an existing server: no Redis step"


def test_a_real_run_launches_the_steps_exports_the_run_and_stops_after_the_trainer(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("")
    p = _sbatch(tmp_path, CONFIG=str(config), REDIS_URL="redis://redis.example:6379/0", TRAINER_ADDR="10.0.0.2",
                RUN_ID="exp1", FAKE_HOSTNAMES="n1 n2", SLURM_JOB_NODELIST="n[1-2]", METRICS_PORT="0",
                STUB_STEPS="8")
    assert p.returncode == 0, p.stderr
    log = (tmp_path / "stub.log").read_text().splitlines()
    assert log[0] == "scontrol show hostnames n[1-2]"
    steps = [x for x in log if " srun " in f" {x}"]
    names = [_srun_options(x)["job-name"] for x in steps]
    assert names[0] == "pretrain", "the base model is built before any stage starts"
    assert sorted(names[1:]) == sorted(["trainer", "feeder", "exporter", "gen-0", "gen-1", "ver-0", "ver-1"])
    assert all(x.startswith("REDIS_URL=redis://redis.example:6379/0 RUN_ID=exp1 srun ") for x in steps)
    assert all("--metrics" not in x for x in steps), "METRICS_PORT=0 serves none"
    node = {_srun_options(x)["job-name"]: _srun_options(x)["nodelist"] for x in steps}
    assert node["trainer"] == node["feeder"] == "n1" and node["gen-0"] == node["ver-1"] == "n2"
    assert "trainer exited with 0" in p.stderr
    # Once the trainer step ended, every other step got SIGTERM (a stage's graceful stop).
    termed = {x.split()[1] for x in log if x.startswith("TERM ")}
    assert termed == {"feeder", "exporter", "gen-0", "gen-1", "ver-0", "ver-1"}


@pytest.mark.parametrize("env, message", [
    ({"WEIGHTS_TRANSPORT": "shm"}, "WEIGHTS_TRANSPORT: must be tcp or ucx across hosts; got 'shm'"),
    ({"GENERATORS_PER_NODE": "two"}, "GENERATORS_PER_NODE: must be a non-negative integer; got 'two'"),
    ({"REDIS_ADDR": "10.0.0.1"}, "TRAINER_ADDR: cannot resolve node 'n2.invalid' to an IPv4 address; set TRAINER_ADDR"),
    ({"TRAINER_ADDR": "10.0.0.2"}, "REDIS_ADDR: cannot resolve node 'n1.invalid' to an IPv4 address; set REDIS_ADDR"),
    ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST: unset"),
    ({"CONFIG": "missing.toml", "DRY_RUN": "0"}, "CONFIG: no such file 'missing.toml'"),
])
def test_the_slurm_template_refuses_bad_settings_naming_the_variable(tmp_path, env, message):
    p = _sbatch(tmp_path, **{"DRY_RUN": "1", "FAKE_HOSTNAMES": "n1.invalid n2.invalid n3.invalid", **env})
    assert p.returncode == 2, p.stdout
    assert message in p.stderr
    assert not (tmp_path / "stub.log").exists() or " srun " not in (tmp_path / "stub.log").read_text()
