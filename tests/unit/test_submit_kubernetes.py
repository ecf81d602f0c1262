"""cluster/kubernetes.py: the TrainJob and JobSet manifests validate against the CRDs' schemas
(tests/data/k8s/README.md says how the structural schemas are read), every field meshrun sets is
what the job says, the container's command parses as `meshrun train`, bad input is one line, and
`kubectl apply` is run bounded (a fake kubectl on PATH)."""

from __future__ import annotations

import copy
import gzip
import json
import os
import re
import stat
import sys
from functools import cache
from pathlib import Path

import pytest
from conftest import requires

yaml = pytest.importorskip("yaml")
pytestmark = requires("jsonschema")  # imported where the schemas are checked: seconds at collection

from meshrun.cluster import kubernetes as k8s  # noqa: E402
from meshrun.cluster.job import RDZV_PORT, SubmitJob  # noqa: E402
from meshrun.errors import ConfigError, LaunchError, MeshrunError  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
SCHEMAS = {"trainjob": "trainjob.v1alpha1.schema.json.gz", "jobset": "jobset.v1alpha2.schema.json.gz"}
API = {"trainjob": ("trainer.kubeflow.org/v1alpha1", "TrainJob"), "jobset": ("jobset.x-k8s.io/v1alpha2", "JobSet")}
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def make_job(nodes: int = 2, **changes) -> SubmitJob:
    fields = dict(config=Path("/etc/meshrun/tiny.toml"), name="tiny-run", run_root=Path("/mnt/runs"), nodes=nodes,
                  nproc_per_node=4, gpus_per_node=0, max_restarts=3, image="registry.example.com/meshrun:0.1",
                  volume="meshrun-runs", namespace="training")
    fields.update(changes)
    return SubmitJob(**fields)


# --- the schema, read the way tests/data/k8s/README.md says ---------------------------------------

def _strict(node):
    """additionalProperties: false wherever an object lists its properties (kubectl --validate=strict)."""
    if isinstance(node, dict):
        node = {key: _strict(value) for key, value in node.items()}
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(item) for item in node]
    return node


def _jsonschema():
    import jsonschema

    return jsonschema


def _unique_map_keys(validator, keys, instance, schema):
    if not validator.is_type(instance, "array"):
        return
    seen = set()
    for item in instance:
        key = tuple(item.get(k) for k in keys) if isinstance(item, dict) else (item,)
        if key in seen:
            yield _jsonschema().ValidationError(f"duplicate entry for list map keys {keys}: {key}")
        seen.add(key)


def _list_type(validator, kind, instance, schema):
    if kind == "set" and validator.is_type(instance, "array"):
        dumped = [json.dumps(item, sort_keys=True) for item in instance]
        if len(set(dumped)) != len(dumped):
            yield _jsonschema().ValidationError("duplicate items in a list of type set")


@cache
def validator(kind: str):
    with gzip.open(DATA / SCHEMAS[kind], "rt") as f:
        stored = json.load(f)
    assert (f"{stored['group']}/{stored['version']}", stored["kind"]) == API[kind]
    schema = _strict(stored["openAPIV3Schema"])
    jsonschema = _jsonschema()
    cls = jsonschema.validators.extend(jsonschema.Draft4Validator, {
        "x-kubernetes-list-map-keys": _unique_map_keys, "x-kubernetes-list-type": _list_type})
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(kind: str, manifest: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(kind).iter_errors(manifest)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", k8s.KINDS)
@pytest.mark.parametrize("nodes,nproc,gpus", [(1, 1, 0), (2, 4, 0), (2, 8, 8), (16, 8, 8)])
def test_manifests_for_1_2_and_16_nodes_validate_against_the_crd_schema(kind, nodes, nproc, gpus):
    job = make_job(nodes, nproc_per_node=nproc, gpus_per_node=gpus, env={"NCCL_DEBUG": "WARN"},
                   overrides=("train.steps=100",))
    docs = list(yaml.safe_load_all(k8s.render(job, kind)))
    assert len(docs) == 1
    assert schema_errors(kind, docs[0]) == []


def _container(manifest: dict) -> dict:
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("kind,breaks", [
    ("trainjob", lambda m: m["spec"]["trainer"].__setitem__("numNode", 2)),  # an unknown (misspelled) field
    ("trainjob", lambda m: m["spec"]["trainer"].__setitem__("numNodes", "2")),  # a string for an int32
    ("trainjob", lambda m: m["spec"]["runtimeRef"].pop("name")),  # a required field
    ("trainjob", lambda m: m["spec"]["trainer"]["resourcesPerNode"]["requests"].__setitem__("cpu", "four")),
    ("jobset", lambda m: m["spec"]["network"].__setitem__("enableDNSHostnames", "yes")),  # a string for a bool
    ("jobset", lambda m: _container(m).pop("name")),  # a required field
    ("jobset", lambda m: _container(m).__setitem__("imageName", "x")),  # an unknown field
    ("jobset", lambda m: m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"].append(
        {"name": "run-root", "emptyDir": {}})),  # a duplicate list-map key
    ("jobset", lambda m: m["spec"]["replicatedJobs"][0].__setitem__("replicas", -1)),  # minimum 0
])
def test_the_schema_check_rejects_a_wrong_manifest(kind, breaks):
    manifest = yaml.safe_load(k8s.render(make_job(), kind))
    assert schema_errors(kind, manifest) == []
    broken = copy.deepcopy(manifest)
    breaks(broken)
    assert schema_errors(kind, broken), "the schema check let a wrong manifest through"


# --- every field meshrun sets ---------------------------------------------------------------------

def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion in a command ($$ is a literal $); enough for these manifests."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m.group(0) == "$$" else env[m.group(1)],
                  text)


def _check_command(cmd: list[str], job: SubmitJob, endpoint: str) -> None:
    from meshrun.cli.train import build_parser, split_launch_args
    from meshrun.launch.args import (
        build_parser as build_launch_parser,  # the flags meshrun train passes on
    )

    assert cmd[:2] == ["meshrun", "train"]
    launch, rest = split_launch_args(cmd[2:])
    args = build_parser().parse_args(rest)
    assert args.config == str(job.config)
    assert args.overrides == [f"train.name={job.name}", f"train.run_dir={job.run_root}", *job.overrides]
    options = build_launch_parser().parse_args([*launch, "-m", "meshrun.train.worker"])
    assert (options.nnodes, options.nproc_per_node, options.max_restarts) == (
        str(job.nodes), str(job.nproc_per_node), job.max_restarts)
    assert (options.rdzv_backend, options.rdzv_endpoint, options.rdzv_id) == ("c10d", endpoint, job.name)


def test_the_trainjob_sets_every_field_from_the_job():
    job = make_job(16, nproc_per_node=8, gpus_per_node=8, max_restarts=2, env={"NCCL_DEBUG": "WARN"},
                   overrides=("optim.lr=$(NOT_A_VAR)",))
    manifest = yaml.safe_load(k8s.render(job, "trainjob"))
    assert (manifest["apiVersion"], manifest["kind"]) == API["trainjob"]
    assert manifest["metadata"] == {"name": "tiny-run", "namespace": "training"}
    assert DNS1035.match(manifest["metadata"]["name"]) and len(manifest["metadata"]["name"]) <= 63  # a CEL rule
    spec = manifest["spec"]
    assert spec["runtimeRef"] == {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                                  "kind": "ClusterTrainingRuntime"}
    trainer = spec["trainer"]
    assert trainer["image"] == "registry.example.com/meshrun:0.1"
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (16, 8)
    assert trainer["numProcPerNode"] >= 1  # a CEL rule
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 8}}
    assert trainer["env"] == [{"name": "NCCL_DEBUG", "value": "WARN"}]
    assert "args" not in trainer
    # What Trainer's torch plugin injects into the `node` container; the kubelet expands the command.
    pet = {"PET_MASTER_ADDR": "tiny-run-node-0-0.tiny-run", "PET_MASTER_PORT": "29500"}
    command = [_expand(item, pet) for item in trainer["command"]]
    assert "optim.lr=$(NOT_A_VAR)" in command  # a user's $ stays literal
    _check_command(command, job, "tiny-run-node-0-0.tiny-run:29500")
    [patch] = spec["runtimePatches"]
    assert patch["manager"] == "meshrun/submit"
    [rjob] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node"  # the torch-distributed runtime's replicated Job and container
    pod = rjob["template"]["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "run-root", "persistentVolumeClaim": {"claimName": "meshrun-runs"}},
                              {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    assert pod["containers"] == [{"name": "node", "volumeMounts": [
        {"name": "run-root", "mountPath": "/mnt/runs"}, {"name": "dshm", "mountPath": "/dev/shm"}]}]
    assert set(manifest) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(spec) == {"runtimeRef", "trainer", "runtimePatches"}


def test_the_jobset_sets_every_field_from_the_job():
    job = make_job(2, nproc_per_node=4, max_restarts=5, namespace=None)
    manifest = yaml.safe_load(k8s.render(job, "jobset"))
    assert (manifest["apiVersion"], manifest["kind"]) == API["jobset"]
    assert manifest["metadata"] == {"name": "tiny-run"}
    spec = manifest["spec"]
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "tiny-run", "publishNotReadyAddresses": True}
    assert spec["failurePolicy"] == {"maxRestarts": 5}
    [rjob] = spec["replicatedJobs"]
    assert (rjob["name"], rjob["replicas"]) == ("node", 1)
    job_spec = rjob["template"]["spec"]
    assert (job_spec["completionMode"], job_spec["parallelism"], job_spec["completions"], job_spec["backoffLimit"]) \
        == ("Indexed", 2, 2, 0)
    pod = job_spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["volumes"] == [{"name": "run-root", "persistentVolumeClaim": {"claimName": "meshrun-runs"}},
                              {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    [container] = pod["containers"]
    assert container["name"] == "node" and container["image"] == "registry.example.com/meshrun:0.1"
    assert container["resources"] == {"requests": {"cpu": 4}}
    assert container["ports"] == [{"name": "rendezvous", "containerPort": RDZV_PORT}]
    assert container["volumeMounts"] == [{"name": "run-root", "mountPath": "/mnt/runs"},
                                         {"name": "dshm", "mountPath": "/dev/shm"}]
    assert "env" not in container
    # The first pod's name under the headless service: <jobset>-<job>-<job index>-<pod index>.<subdomain>
    _check_command(container["command"], job, f"tiny-run-node-0-0.tiny-run:{RDZV_PORT}")
    longest = k8s.pod_name(job.name, job.nodes - 1) + k8s.POD_SUFFIX
    assert DNS1035.match(longest) and len(longest) <= 63


# --- bad input: one line each ---------------------------------------------------------------------

@pytest.mark.parametrize("changes,kind,words", [
    ({"image": None}, "trainjob", "--image"),
    ({"image": "reg/meshrun: 1"}, "jobset", "--image"),
    ({"volume": None}, "trainjob", "--volume"),
    ({"volume": "My_Runs"}, "jobset", "'My_Runs'"),
    ({"run_root": Path("runs")}, "trainjob", "train.run_dir 'runs'"),
    ({"namespace": "Team A"}, "jobset", "--namespace 'Team A'"),
    ({"name": "7b-run"}, "trainjob", "train.name '7b-run'"),
    ({"name": "x" * 50, "nodes": 16}, "jobset", "at most 47 characters"),
    ({"env": {"PET_NNODES": "3"}}, "trainjob", "env PET_NNODES"),
    ({"overrides": tuple(f"a.b{i}=1" for i in range(60))}, "trainjob", "--set"),
    ({}, "pytorchjob", "--k8s-kind 'pytorchjob'"),
])
def test_bad_input_is_one_line_naming_the_key(changes, kind, words):
    with pytest.raises(ConfigError) as caught:
        k8s.render(make_job(**changes), kind)
    message = str(caught.value)
    assert words in message and "\n" not in message and caught.value.exit_code == 2


def test_a_jobset_may_set_pet_variables_and_a_name_fits_exactly():
    k8s.render(make_job(env={"PET_NNODES": "2"}), "jobset")  # only Trainer reserves them
    k8s.render(make_job(name="x" * 47, nodes=16), "jobset")  # 47 + len("-node-0-15-abcde") == 63


def test_gpus_no_process_would_use_are_one_line():
    with pytest.raises(ConfigError, match=r"--gpus-per-node 8: more GPUs than --nproc-per-node 2"):
        make_job(gpus_per_node=8, nproc_per_node=2)


def test_without_pyyaml_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    with pytest.raises(MeshrunError, match=r"needs yaml: pip install 'meshrun\[kubernetes\]'$"):
        k8s.render(make_job())


# --- kubectl apply ----------------------------------------------------------------------------------

def _fake_kubectl(tmp_path: Path, monkeypatch, body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "kubectl"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    return tmp_path


def test_submit_without_kubectl_says_install_it_or_dry_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match=r"kubectl is not on PATH: install it .* or add --dry-run"):
        k8s.submit(make_job(), "trainjob", "kind: TrainJob\n")


def test_submit_applies_the_text_in_the_namespace(tmp_path, monkeypatch):
    out = _fake_kubectl(tmp_path, monkeypatch, f'echo "$@" > {tmp_path}/argv; cat > {tmp_path}/stdin; '
                                               'echo "trainjob.trainer.kubeflow.org/tiny-run created"')
    text = k8s.render(make_job(), "trainjob")
    said = k8s.submit(make_job(), "trainjob", text)
    assert (out / "argv").read_text().split() == ["apply", "-f", "-", "--namespace", "training"]
    assert (out / "stdin").read_text() == text
    assert said == ("trainjob.trainer.kubeflow.org/tiny-run created; follow it with "
                    "kubectl get trainjob tiny-run -n training")


def test_submit_rejected_by_kubectl_is_one_line_with_its_message(tmp_path, monkeypatch):
    _fake_kubectl(tmp_path, monkeypatch, 'echo \'error: resource mapping not found for name: "tiny-run"\' >&2\n'
                                         "echo 'ensure CRDs are installed first' >&2; exit 1")
    with pytest.raises(LaunchError) as caught:
        k8s.submit(make_job(), "jobset", "kind: JobSet\n")
    assert str(caught.value) == ('kubectl apply rejected the jobset tiny-run: error: resource mapping not found '
                                 'for name: "tiny-run"; ensure CRDs are installed first')


@pytest.mark.timeout(30)
def test_submit_is_bounded_by_a_timeout(tmp_path, monkeypatch):
    _fake_kubectl(tmp_path, monkeypatch, "exec sleep 30")
    monkeypatch.setattr(k8s, "KUBECTL_TIMEOUT_S", 0.5)
    with pytest.raises(LaunchError, match=r"kubectl apply gave no answer within 0.5 s"):
        k8s.submit(make_job(), "trainjob", "kind: TrainJob\n")


def test_the_docs_page_shows_what_render_writes():
    """docs/cluster.md's example output is render's, byte for byte (a doc that drifts fails here)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text(encoding="utf-8")
    [shown_yaml] = re.findall(r"^```yaml\n(.*?)^```$", page, flags=re.DOTALL | re.MULTILINE)
    job = SubmitJob(config=Path("/workspace/configs/tiny.toml"), name="tiny", run_root=Path("/runs"), nodes=2,
                    nproc_per_node=2, max_restarts=1, image="registry.example.com/meshrun:0.1", volume="meshrun-runs")
    assert shown_yaml == k8s.render(job, "trainjob")


@pytest.mark.timeout(60)
def test_the_command_line_prints_the_manifests_with_the_paths_as_given(capsys):
    """`meshrun submit --scheduler kubernetes --dry-run`: the config path stays as written (the pod
    reads it inside its image, not on this machine) and a relative run_dir is one line, exit 2."""
    from conftest import REPO

    from meshrun.cli import main

    config = "examples/configs/tiny.toml"
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        base = ["submit", config, "--scheduler", "kubernetes", "--image", "reg/meshrun:0.1", "--volume", "runs-pvc",
                "--nodes", "2", "--nproc-per-node", "2", "--set", "train.name=tiny"]
        assert main([*base, "--set", "train.run_dir=/runs", "--dry-run"]) == 0
        manifest = yaml.safe_load(capsys.readouterr().out)
        command = manifest["spec"]["trainer"]["command"]
        assert command[:3] == ["meshrun", "train", config] and "train.run_dir=/runs" in command
        assert main([*base, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "train.run_dir 'runs'" in err[0] and "absolute path" in err[0], err
    finally:
        os.chdir(cwd)
