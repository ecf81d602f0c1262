"""Kubernetes manifests for a `SubmitJob`: a Kubeflow Trainer TrainJob or a plain JobSet, applied with kubectl.

    meshrun submit my.toml --scheduler kubernetes --image REGISTRY/meshrun:TAG --volume runs --dry-run

Every node (pod) runs `meshrun train` once; its elastic agent starts `nproc_per_node` workers and
meets the other nodes through c10d rendezvous on the first pod (docs/cluster.md):

* TrainJob (trainer.kubeflow.org/v1alpha1, the `torch-distributed` ClusterTrainingRuntime): Trainer's
  torch plugin injects PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR
  (`<name>-node-0-0.<name>`) and PET_MASTER_PORT into the `node` container. meshrun passes
  `--rdzv-backend c10d --rdzv-endpoint $(PET_MASTER_ADDR):$(PET_MASTER_PORT)`, which the kubelet
  expands from those variables: c10d rather than the static PET_NODE_RANK rendezvous, because
  only c10d lets `--max-restarts` re-form the group after a failure.
* JobSet (jobset.x-k8s.io/v1alpha2): one Indexed Job of `nodes` pods under a headless service
  (`network.enableDNSHostnames`), the endpoint the first pod's name `<name>-node-0-0.<name>:29500`.

Restarts: `--max-restarts` restarts the workers inside each pod; the JobSet's
`failurePolicy.maxRestarts` (the same number) recreates every pod when one fails. A TrainJob
cannot set the runtime's failure policy: that is the ClusterTrainingRuntime's.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from meshrun.cluster.job import DNS_LABEL, RDZV_PORT, SubmitJob
from meshrun.errors import ConfigError, LaunchError, shown
from meshrun.extras import import_extra

KINDS = ("trainjob", "jobset")
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
RUNTIME = "torch-distributed"  # Kubeflow Trainer's ClusterTrainingRuntime for torchrun-style jobs
NODE = "node"  # the runtime's replicated Job and trainer container; the JobSet uses the same name
RUN_VOLUME = "run-root"  # the PersistentVolumeClaim, mounted at run_root
SHM_VOLUME = "dshm"  # a memory-backed /dev/shm: a container's default 64 MiB is too small for workers
PATCH_MANAGER = "meshrun/submit"  # the TrainJob's runtimePatches entry meshrun owns
GPU_RESOURCE = "nvidia.com/gpu"
PET_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
TRAINJOB_MAX_COMMAND = 128  # the TrainJob CRD's maxItems for trainer.command
KUBECTL_TIMEOUT_S = 120.0
POD_SUFFIX = "-abcde"  # the random suffix Kubernetes adds to a Job's pod names (JobSet checks with it)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # pod, Job, TrainJob and JobSet names
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # DNS-1123 subdomain


def render(job: SubmitJob, kind: str = "trainjob") -> str:
    """The manifests for `job` as YAML text (one document per resource)."""
    check(job, kind)
    yaml = import_extra("yaml", "meshrun submit --scheduler kubernetes")
    docs = [trainjob(job)] if kind == "trainjob" else [jobset(job)]
    head = f"# meshrun submit --scheduler kubernetes --k8s-kind {kind}: job {job.name} (docs/cluster.md)\n"
    return head + yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


def check(job: SubmitJob, kind: str) -> None:
    """What Kubernetes needs beyond SubmitJob's own rules: each one ConfigError line."""
    if kind not in KINDS:
        raise ConfigError(f"--k8s-kind {shown(kind)}: choose trainjob (a Kubeflow Trainer TrainJob) or jobset "
                          f"(a plain JobSet)")
    if not job.image or any(c.isspace() for c in job.image):
        raise ConfigError(f"--image {shown(job.image or '')}: --scheduler kubernetes needs the container image "
                          f"that holds meshrun and the config, e.g. --image registry.example.com/meshrun:0.1")
    if not job.volume or len(job.volume) > 253 or not _SUBDOMAIN.match(job.volume):
        raise ConfigError(f"--volume {shown(job.volume or '')}: give the name of a PersistentVolumeClaim "
                          f"(lowercase letters, digits, '-' and '.'; ReadWriteMany for several nodes): every "
                          f"node keeps the run directory there")
    if not job.run_root.is_absolute():
        raise ConfigError(f"train.run_dir {shown(job.run_root)}: the volume is mounted there on every node, "
                          f"so it must be an absolute path, e.g. --set train.run_dir=/runs")
    if job.namespace is not None and not (DNS_LABEL.match(job.namespace) and len(job.namespace) <= 63):
        raise ConfigError(f"--namespace {shown(job.namespace)}: a namespace is lowercase letters, digits and "
                          f"'-', at most 63, e.g. --namespace training")
    longest = pod_name(job.name, job.nodes - 1) + POD_SUFFIX
    if not job.name[0].isalpha():
        raise ConfigError(f"train.name {job.name!r}: Kubernetes job names start with a letter (DNS-1035); "
                          f"e.g. --set train.name=job-{job.name}")
    if len(longest) > 63:
        raise ConfigError(f"train.name {job.name!r}: its pods would be named like {longest!r}, over "
                          f"Kubernetes' 63 characters; use a name of at most "
                          f"{63 - len(longest) + len(job.name)} characters")
    assert _DNS1035.match(longest), longest
    if kind == "trainjob":
        reserved = sorted(set(job.env) & set(PET_ENV))
        if reserved:
            raise ConfigError(f"env {reserved[0]}: Kubeflow Trainer sets the PET_* variables itself and rejects "
                              f"a TrainJob that sets them; leave it out")
        if len(command(job, kind)) > TRAINJOB_MAX_COMMAND:
            raise ConfigError(f"--set: {len(job.overrides)} overrides make `meshrun train` longer than a "
                              f"TrainJob's {TRAINJOB_MAX_COMMAND} command items; put them in the config file")


def pod_name(name: str, index: int) -> str:
    """The pod of node `index` (without the random suffix): JobSet's `<jobset>-<job>-<job index>-<pod index>`."""
    return f"{name}-{NODE}-0-{index}"


def rendezvous_endpoint(job: SubmitJob, kind: str) -> str:
    """host:port of the c10d store, as the container's command line gives it."""
    if kind == "trainjob":
        return "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"  # expanded by the kubelet from Trainer's env
    return f"{pod_name(job.name, 0)}.{job.name}:{RDZV_PORT}"  # the headless service's name for pod 0


def command(job: SubmitJob, kind: str) -> list[str]:
    """The container's command: `meshrun train`, with the rendezvous on the first pod."""
    # The kubelet expands $(VAR) in a command; "$$" keeps a user's "$" literal.
    args = [arg.replace("$", "$$") for arg in job.train_args()]
    return ["meshrun", "train", *args, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", rendezvous_endpoint(job, kind), "--rdzv-id", job.name]


def resources(job: SubmitJob) -> dict:
    """One GPU per worker, or one CPU per worker (requested, not capped)."""
    if job.gpus_per_node:
        return {"limits": {GPU_RESOURCE: job.gpus_per_node}}
    return {"requests": {"cpu": job.nproc_per_node}}


def _env(job: SubmitJob) -> list[dict]:
    return [{"name": key, "value": value.replace("$", "$$")} for key, value in sorted(job.env.items())]


def _metadata(job: SubmitJob) -> dict:
    meta: dict = {"name": job.name}
    if job.namespace:
        meta["namespace"] = job.namespace
    return meta


def _volumes(job: SubmitJob) -> list[dict]:
    return [{"name": RUN_VOLUME, "persistentVolumeClaim": {"claimName": job.volume}},
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}]


def _mounts(job: SubmitJob) -> list[dict]:
    return [{"name": RUN_VOLUME, "mountPath": str(job.run_root)}, {"name": SHM_VOLUME, "mountPath": "/dev/shm"}]


def trainjob(job: SubmitJob) -> dict:
    """A Kubeflow Trainer TrainJob on the torch-distributed runtime; the volumes through runtimePatches."""
    trainer: dict = {"image": job.image, "command": command(job, "trainjob")}
    if job.env:
        trainer["env"] = _env(job)
    trainer.update(numNodes=job.nodes, numProcPerNode=job.nproc_per_node, resourcesPerNode=resources(job))
    pod_patch = {"volumes": _volumes(job), "containers": [{"name": NODE, "volumeMounts": _mounts(job)}]}
    patch = {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": NODE, "template": {"spec": {"template": {"spec": pod_patch}}}}]}}}}
    return {"apiVersion": TRAINER_API, "kind": "TrainJob", "metadata": _metadata(job),
            "spec": {"runtimeRef": {"name": RUNTIME, "apiGroup": "trainer.kubeflow.org",
                                    "kind": "ClusterTrainingRuntime"},
                     "trainer": trainer, "runtimePatches": [patch]}}


def jobset(job: SubmitJob) -> dict:
    """A JobSet: one Indexed Job of `nodes` pods, a headless service, JobSet-level restarts."""
    container: dict = {"name": NODE, "image": job.image, "command": command(job, "jobset")}
    if job.env:
        container["env"] = _env(job)
    container.update(ports=[{"name": "rendezvous", "containerPort": RDZV_PORT}], resources=resources(job),
                     volumeMounts=_mounts(job))
    pod = {"restartPolicy": "Never", "containers": [container], "volumes": _volumes(job)}
    # backoffLimit 0: a failed pod fails its Job, and failurePolicy restarts every pod together
    # (the c10d group re-forms from scratch), at most max_restarts times.
    job_spec = {"completionMode": "Indexed", "parallelism": job.nodes, "completions": job.nodes,
                "backoffLimit": 0, "template": {"spec": pod}}
    return {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": _metadata(job),
            "spec": {"network": {"enableDNSHostnames": True, "subdomain": job.name,
                                 "publishNotReadyAddresses": True},
                     "failurePolicy": {"maxRestarts": job.max_restarts},
                     "replicatedJobs": [{"name": NODE, "replicas": 1, "template": {"spec": job_spec}}]}}


def submit(job: SubmitJob, kind: str, text: str) -> str:
    """`kubectl apply -f -` of `text` (from `render`), bounded by KUBECTL_TIMEOUT_S; one line back."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise LaunchError("kubectl is not on PATH: install it (https://kubernetes.io/docs/tasks/tools/) and "
                          "point it at your cluster, or add --dry-run to print the manifests and apply them "
                          "yourself")
    argv = [kubectl, "apply", "-f", "-"]
    if job.namespace:
        argv += ["--namespace", job.namespace]
    try:
        done = subprocess.run(argv, input=text, capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"kubectl apply gave no answer within {KUBECTL_TIMEOUT_S:g} s: is the cluster "
                          f"reachable (kubectl cluster-info)? Nothing may have been created: check with "
                          f"kubectl get {kind} {job.name}") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = "; ".join(lines) if lines else f"exit code {done.returncode}"  # one line, every error in it
        raise LaunchError(f"kubectl apply rejected the {kind} {job.name}: {reason}")
    where = f" -n {job.namespace}" if job.namespace else ""
    said = next((line.strip() for line in done.stdout.splitlines() if line.strip()), f"{kind} {job.name} applied")
    return f"{said}; follow it with kubectl get {kind} {job.name}{where}"
