"""Every rendered manifest of both overlays, applied with a server-side dry run to a real
kube-apiserver on a real etcd (both built by deploy/tools/build.sh), with KEDA's CRDs
installed: what no schema catches (selectors that miss their labels, KEDA's CEL rule that
minReplicaCount <= maxReplicaCount, immutable and defaulted fields) is refused here."""

from __future__ import annotations

import copy
import os
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from tests.built_tools import WAITS_FOR_BUILD
from tests.k8s_tools import OVERLAYS, keda_crds, named, rendered, tool
from tests.stack import free_port, wait_until

# The throw-away apiserver serves a self-signed certificate made at its start; its clients
# talk to it on 127.0.0.1 without verifying it (`verify_ssl = False` below).
pytestmark = [
    pytest.mark.integration,
    WAITS_FOR_BUILD,  # `apiserver` waits for etcd and kube-apiserver (10+ min cold)
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

TOKEN = "tokenbus-test-admin"
NAMESPACE = "tokenbus"


@dataclass
class ApiServer:
    url: str
    dynamic: DynamicClient

    def apply(self, doc: dict[str, Any], *, dry_run: bool = True) -> None:
        """`kubectl apply --server-side --validate=strict [--dry-run=server]`: a server-side
        apply PATCH (the dynamic client's own lacks `fieldValidation`, so it is sent here)."""
        resource = self.dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        namespace = doc["metadata"].get("namespace") if resource.namespaced else None
        query = [
            ("fieldManager", "tokenbus-test"),
            ("force", "true"),
            ("fieldValidation", "Strict"),
        ]
        if dry_run:
            query.append(("dryRun", "All"))
        api = self.dynamic.client
        method, url, headers, body, post = api.param_serialize(
            "PATCH",
            resource.path(name=doc["metadata"]["name"], namespace=namespace),
            query_params=query,
            header_params={
                "Content-Type": "application/apply-patch+yaml",
                "Accept": "application/json",
            },
            body=doc,
            auth_settings=["BearerToken"],
        )
        response = api.call_api(method, url, headers, body, post)
        response.read()
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(http_resp=response, body=None, data=None)


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _ready(url: str) -> bool:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _alive(proc: subprocess.Popen[bytes], log: Path) -> None:
    if proc.poll() is not None:
        pytest.fail(f"{proc.args[0]} exited {proc.returncode}:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    etcd_bin, apiserver_bin = tool("etcd"), tool("kube-apiserver")
    crds = keda_crds()
    home = tmp_path_factory.mktemp("apiserver")
    client_port, peer_port, secure_port = free_port(), free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{client_port}"
    peer_url = f"http://127.0.0.1:{peer_port}"
    etcd_log = home / "etcd.log"
    etcd = _start(
        [
            str(etcd_bin),
            "--name",
            "test",
            "--data-dir",
            str(home / "etcd"),
            "--listen-client-urls",
            etcd_url,
            "--advertise-client-urls",
            etcd_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"test={peer_url}",
            "--unsafe-no-fsync",
            "--log-level",
            "warn",
        ],
        etcd_log,
    )
    procs = [etcd]
    try:
        subprocess.run(
            ["openssl", "genrsa", "-out", str(home / "sa.key"), "2048"],
            check=True,
            capture_output=True,
        )
        (home / "tokens.csv").write_text(f'{TOKEN},admin,admin,"system:masters"\n')
        api_log = home / "kube-apiserver.log"
        api = _start(
            [
                str(apiserver_bin),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={secure_port}",
                f"--cert-dir={home / 'certs'}",
                f"--token-auth-file={home / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={home / 'sa.key'}",
                f"--service-account-signing-key-file={home / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                # No controllers run here: nothing would keep the endpoints of
                # `kubernetes` current, so nothing should try.
                "--endpoint-reconciler-type=none",
            ],
            api_log,
        )
        procs.append(api)
        url = f"https://127.0.0.1:{secure_port}"

        def ready() -> bool:
            _alive(etcd, etcd_log)
            _alive(api, api_log)
            return _ready(f"{url}/readyz")

        wait_until(ready, 180, "kube-apiserver /readyz", interval=0.5)
        config = client.Configuration()
        config.host = url
        config.verify_ssl = False
        config.api_key = {"authorization": f"Bearer {TOKEN}"}
        api_client = client.ApiClient(config)
        extensions = client.ApiextensionsV1Api(api_client)
        for crd in crds:
            extensions.create_custom_resource_definition(crd)

        def established() -> bool:
            for crd in crds:
                got = extensions.read_custom_resource_definition(crd["metadata"]["name"])
                conditions = {c.type: c.status for c in got.status.conditions or []}
                if conditions.get("Established") != "True":
                    return False
            return True

        wait_until(established, 60, "KEDA's CRDs established", interval=0.5)
        server = ApiServer(url, DynamicClient(api_client))
        # The namespace for real: a dry-run object in a namespace that does not exist is
        # refused by the NamespaceLifecycle admission plugin.
        server.apply(named(rendered("sim"), "Namespace", NAMESPACE), dry_run=False)
        yield server
    finally:
        for proc in reversed(procs):
            _stop(proc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_applies_with_a_server_side_dry_run(
    apiserver: ApiServer, overlay: str
) -> None:
    docs = rendered(overlay)
    refused = []
    for doc in docs:
        try:
            apiserver.apply(doc)
        except ApiException as exc:
            refused.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.status} {exc.body}")
    assert not refused, "\n".join(refused)
    assert len(docs) > 20


def _refusal(apiserver: ApiServer, doc: dict[str, Any], status: int = 422) -> str:
    """The API server's answer to a dry-run apply it must refuse."""
    with pytest.raises(ApiException) as refused:
        apiserver.apply(doc)
    assert refused.value.status == status, refused.value.body
    return str(refused.value.body)


def test_a_selector_that_misses_its_pod_labels_is_refused(apiserver: ApiServer) -> None:
    doc = copy.deepcopy(named(rendered("sim"), "Deployment", "edge"))
    doc["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "edges"
    assert "`selector` does not match template `labels`" in _refusal(apiserver, doc)


def test_keda_min_above_max_is_refused(apiserver: ApiServer) -> None:
    doc = copy.deepcopy(named(rendered("gpu"), "ScaledObject", "worker"))
    doc["spec"]["minReplicaCount"] = doc["spec"]["maxReplicaCount"] + 1
    assert "minReplicaCount must be less than or equal to maxReplicaCount" in _refusal(
        apiserver, doc
    )


def test_an_unknown_field_is_refused_under_strict_validation(apiserver: ApiServer) -> None:
    doc = copy.deepcopy(named(rendered("sim"), "Deployment", "worker"))
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    # Server-side apply builds a typed patch first, and refuses the field there (v1.37: 500).
    refusal = _refusal(apiserver, doc, status=500)
    assert 'containers[name=\\"worker\\"].readinesProbe: field not declared in schema' in refusal


def test_the_tools_are_the_pinned_versions() -> None:
    version = subprocess.run(
        [str(tool("kube-apiserver")), "--version"], capture_output=True, text=True, check=True
    ).stdout
    pinned = Path(__file__).resolve().parent.parent / "deploy/tools/kube-apiserver/go.mod"
    assert f"Kubernetes {_require(pinned, 'k8s.io/kubernetes')}" in version
    assert os.access(tool("etcd"), os.X_OK)


def _require(go_mod: Path, module: str) -> str:
    for line in go_mod.read_text().splitlines():
        parts = line.replace("require", "").split()
        if parts[:1] == [module]:
            return parts[1]
    raise AssertionError(f"{module} not required in {go_mod}")
