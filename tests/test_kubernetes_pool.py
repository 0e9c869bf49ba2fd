"""The Kubernetes work pool, with no cluster: its base job template
(deployments/kubernetes/gpu-job-template.json) rendered by prefect-kubernetes' own job
configuration as its worker renders it (`KubernetesWorkerJobConfiguration.from_template_and_values`
over a deployment's job variables, then `prepare_for_flow_run` with the flow run, deployment, flow
and pool), for the deployments of deployments/prefect.yaml pointed at such a pool. The Job it would
create is read back through the Kubernetes API's models (the `kubernetes` client's `V1Job`: every
field of the right type, none missing, none unknown), and holds what a run needs: the GPU, the
image, the run's environment, vLLM's compile cache on a volume, and no secret."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOYMENTS = Path(__file__).resolve().parents[1] / "deployments"
TEMPLATE = DEPLOYMENTS / "kubernetes" / "gpu-job-template.json"
CACHE_CLAIM = DEPLOYMENTS / "kubernetes" / "vllm-cache-pvc.yaml"
API_URL = "http://prefect.vlm-caption.svc:4200/api"  # the worker's, handed to each job
# prefect-kubernetes refuses a template without these under the pod's spec (its base manifest has
# them there); they are Job fields, not PodSpec ones, so the API server drops them (its field
# validation warns by default) and the Job keeps its own default of 1 for each.
WORKER_REQUIRED_EXTRAS = {"/spec/template/spec/parallelism", "/spec/template/spec/completions"}
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|API_KEY|ACCESS_KEY|AUTH_STRING|PRIVATE_KEY", re.IGNORECASE)
SECRET_VALUE = re.compile(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b|\bhf_[A-Za-z0-9]{30,}\b|-----BEGIN [A-Z ]*PRIVATE KEY")


def template() -> dict[str, Any]:
    return json.loads(TEMPLATE.read_text())


def deployment(name: str) -> dict[str, Any]:
    """A deployment of deployments/prefect.yaml, its anchors merged (the run's env with its own)."""
    spec = yaml.safe_load((DEPLOYMENTS / "prefect.yaml").read_text())
    return next(d for d in spec["deployments"] if d["name"] == name)


def render(name: str, base_job_template: dict | None = None, **job_variables) -> dict[str, Any]:
    """The Job manifest a Kubernetes worker would create for a flow run of deployment `name`, the
    deployment's job variables updated with `job_variables`."""
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import Flow, FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    base_job_template = base_job_template or template()
    spec = deployment(name)
    variables = {**spec["work_pool"]["job_variables"], **job_variables}
    pool = WorkPool(name="vlm-caption-k8s", type="kubernetes", base_job_template=base_job_template)
    flow = Flow(id=uuid.uuid4(), name="vlm-caption")
    api = DeploymentResponse(id=uuid.uuid4(), name=name, flow_id=flow.id, work_pool_name=pool.name,
                             job_variables=variables, parameters=spec.get("parameters") or {})
    flow_run = FlowRun(id=uuid.uuid4(), name="tidy-otter", flow_id=flow.id, deployment_id=api.id,
                       parameters=api.parameters, work_pool_name=pool.name)
    # The worker's own settings go into each job's environment: a worker of a self-hosted server.
    with temporary_settings(updates={PREFECT_API_URL: API_URL},
                            restore_defaults={PREFECT_API_KEY, PREFECT_API_AUTH_STRING}):
        # The client resolves the template's block and variable references (it has none), so it
        # is never called; given, so that none is made (without an API URL that starts a server).
        configuration = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(
            base_job_template, variables, client=PrefectClient(API_URL)))
        configuration.prepare_for_flow_run(flow_run, deployment=api, flow=flow, work_pool=pool,
                                           worker_name="gpu-node-1")
    return configuration.job_manifest


def container(manifest: dict) -> dict:
    (only,) = manifest["spec"]["template"]["spec"]["containers"]
    return only


def environment(manifest: dict) -> dict[str, str]:
    entries = container(manifest)["env"]
    assert all(set(entry) == {"name", "value"} for entry in entries), entries  # plain values, no valueFrom
    return {entry["name"]: entry["value"] for entry in entries}


def not_in_the_schema(manifest: dict, model) -> set[str]:
    """The paths of `manifest` that the Kubernetes API's model does not hold as given: unknown
    fields, or values read as another type. Validating raises for a missing required field or a
    value of the wrong type (the models are strict)."""
    from kubernetes.client import ApiClient

    given = copy.deepcopy(manifest)
    for resources in _resources(given):
        # A quantity may be a JSON number (apimachinery's resource.Quantity reads both); the model
        # types it as a string. `gpus` is an integer variable, rendered as a number.
        for kind in ("requests", "limits"):
            resources[kind] = {key: str(value) for key, value in resources.get(kind, {}).items()}
    read_back = ApiClient().sanitize_for_serialization(model.from_dict(given))
    return set(_differences(given, read_back))


def _resources(manifest: dict) -> list[dict]:
    pod = manifest.get("spec", {}).get("template", {}).get("spec", {})
    return [c["resources"] for c in pod.get("containers", []) if "resources" in c]


def _differences(given: Any, read_back: Any, path: str = "") -> list[str]:
    if isinstance(given, dict) and isinstance(read_back, dict):
        return [found for key in given.keys() | read_back.keys()
                for found in _differences(given.get(key), read_back.get(key), f"{path}/{key}")]
    if isinstance(given, list) and isinstance(read_back, list) and len(given) == len(read_back):
        return [found for i, (a, b) in enumerate(zip(given, read_back)) for found in _differences(a, b, f"{path}/{i}")]
    return [] if given == read_back else [path]


def secrets_in(manifest: dict) -> list[str]:
    """Where the manifest holds a value that looks like a secret, or a setting named like one."""
    found = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if set(node) >= {"name", "value"} and SECRET_NAME.search(str(node["name"])):
                found.append(f"{path}: {node['name']}")
            for key, value in node.items():
                if SECRET_NAME.search(str(key)) and not isinstance(value, (dict, list)):
                    found.append(f"{path}/{key}")
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}/{i}")
        elif isinstance(node, str) and SECRET_VALUE.search(node):
            found.append(path)

    walk(manifest, "")
    return found


@pytest.mark.parametrize("name", ["prod", "partition"])
def test_a_deployments_flow_run_becomes_a_job_the_kubernetes_api_accepts(name):
    from kubernetes.client import V1Job

    manifest = render(name)
    assert not_in_the_schema(manifest, V1Job) == WORKER_REQUIRED_EXTRAS
    assert (manifest["apiVersion"], manifest["kind"]) == ("batch/v1", "Job")
    defaults = {key: spec.get("default") for key, spec in template()["variables"]["properties"].items()}
    assert manifest["metadata"]["namespace"] == defaults["namespace"]
    assert manifest["metadata"]["generateName"] == "vlm-caption-"
    assert manifest["spec"]["backoffLimit"] == 0  # Prefect retries a run, not Kubernetes

    pod = manifest["spec"]["template"]["spec"]
    main = container(manifest)
    assert main["image"] == defaults["image"]
    assert main["args"] == ["prefect", "flow-run", "execute"]
    resources = main["resources"]
    assert str(resources["requests"]["nvidia.com/gpu"]) == str(resources["limits"]["nvidia.com/gpu"]) == "1"
    assert resources["limits"]["memory"] == defaults["memory"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]

    env = environment(manifest)
    own = deployment(name)["work_pool"]["job_variables"]["env"]  # prefect.yaml's run_env and the deployment's
    assert {key: env.get(key) for key in own} == own
    assert env["VLM_CAPTION_AWS_CREDENTIALS_BLOCK"] == "vlm-caption-s3"  # the block's name; its keys stay in Prefect
    assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"  # the zombie automation needs heartbeats
    assert env["VLM_CAPTION_HOME"] == "/opt/vlm-caption"  # prefect.yaml's pull step changes to it
    assert env["PREFECT_API_URL"] == API_URL

    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in main["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    cache = volumes[mounts[env["VLLM_CACHE_ROOT"]]]  # vLLM's compile cache, where vLLM looks for it
    assert cache["persistentVolumeClaim"]["claimName"] == defaults["compile_cache_claim"]

    assert secrets_in(manifest) == []


def test_a_secret_in_a_deployments_env_would_be_found():
    """The check above would see keys put in the spec (they belong in the credentials block)."""
    env = {**deployment("prod")["work_pool"]["job_variables"]["env"],
           "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "AWS_REGION": "AKIAIOSFODNN7EXAMPLE"}
    found = secrets_in(render("prod", env=env))
    assert len(found) == 2 and any("AWS_SECRET_ACCESS_KEY" in where for where in found), found


def test_the_compile_cache_claim_is_a_variable_and_its_manifest_makes_the_default():
    from kubernetes.client import V1PersistentVolumeClaim

    manifest = render("partition", compile_cache_claim="vllm-cache-h200")
    claims = [v["persistentVolumeClaim"]["claimName"] for v in manifest["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == ["vllm-cache-h200"]

    claim = yaml.safe_load(CACHE_CLAIM.read_text())
    assert not_in_the_schema(claim, V1PersistentVolumeClaim) == set()
    defaults = template()["variables"]["properties"]
    assert claim["metadata"]["name"] == defaults["compile_cache_claim"]["default"]
    assert claim["metadata"]["namespace"] == defaults["namespace"]["default"]


def test_the_template_is_one_prefect_accepts_for_a_work_pool_and_the_deployments_fit_its_variables():
    import jsonschema
    from prefect.server.schemas.actions import WorkPoolCreate

    # The server's own check: every placeholder of the job configuration is a declared variable.
    WorkPoolCreate(name="vlm-caption-k8s", type="kubernetes", base_job_template=template())
    for name in ("prod", "partition"):
        jsonschema.validate(deployment(name)["work_pool"]["job_variables"], template()["variables"])


def test_the_worker_refuses_the_template_without_the_fields_it_requires():
    """Why the template has two fields no pod has: without them prefect-kubernetes refuses every
    flow run. Should a release stop asking for them, this fails: take them out of the template."""
    from pydantic import ValidationError

    bare = template()
    pod = bare["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    for field in WORKER_REQUIRED_EXTRAS:
        del pod[field.rsplit("/", 1)[1]]
    with pytest.raises(ValidationError, match="completions.*parallelism"):
        render("prod", base_job_template=bare)
