"""The tools the manifest and monitoring tests run, as `deploy/tools/build.sh` cached them,
and the rendered manifests. A missing tool fails the test naming the command that builds
it (`make test` runs that command first, so only a bare `pytest` can meet this)."""

from __future__ import annotations

import copy
import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "deploy" / "tools" / "build.sh"
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("sim", "gpu")
MONITORING = ROOT / "deploy" / "monitoring"


@functools.cache
def _tools() -> tuple[dict[str, Path], str]:
    done = subprocess.run([str(BUILD), "--check"], capture_output=True, text=True, check=False)
    found = {}
    for line in done.stdout.splitlines():
        name, _, path = line.partition(" ")
        found[name] = Path(path)
    return found, done.stderr.strip()


def tool(name: str) -> Path:
    """Path of a built tool (promtool, kustomize, etcd, kube-apiserver, keda-crds)."""
    found, error = _tools()
    if name not in found:
        pytest.fail(
            f"{name} is not built: run deploy/tools/build.sh (make test does). {error}",
            pytrace=False,
        )
    return found[name]


def run(cmd: list[str], *, cwd: Path | None = None, timeout: float = 120) -> str:
    """Run a tool; a failure shows its whole output."""
    done = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


@functools.cache
def _render(overlay: str) -> str:
    return run([str(tool("kustomize")), "build", str(K8S / "overlays" / overlay)])


def rendered(overlay: str) -> list[dict[str, Any]]:
    """The overlay's manifests as `kustomize build` renders them, one dict per object."""
    return [d for d in yaml.safe_load_all(_render(overlay)) if d]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return found


@functools.cache
def _keda_crds() -> tuple[dict[str, Any], ...]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crds = []
    for path in sorted(tool("keda-crds").glob("*.yaml")):
        crds.extend(d for d in yaml.load_all(path.read_text(), Loader=loader) if d)
    return tuple(crds)


def keda_crds() -> list[dict[str, Any]]:
    """KEDA's CRDs as its release ships them (github.com/kedacore/keda/v2 config/crd/bases)."""
    return copy.deepcopy(list(_keda_crds()))
