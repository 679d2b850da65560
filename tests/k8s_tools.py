"""The tools the manifest and monitoring tests run, as `deploy/tools/build.sh` builds them
(waited for while `make test` builds them in the background: tests/built_tools.py), and the
rendered manifests. A tool that cannot be built fails the test with build.sh's reason."""

from __future__ import annotations

import copy
import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.built_tools import ToolNotBuilt, built

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("sim", "gpu")
MONITORING = ROOT / "deploy" / "monitoring"


def tool(name: str) -> Path:
    """Path of a built tool (promtool, kustomize, etcd, kube-apiserver, keda-crds), waiting
    for its build if one is under way. A module whose fixtures call this carries
    `WAITS_FOR_BUILD`, so that the wait is not timed as a test."""
    try:
        return built(name)
    except ToolNotBuilt as exc:
        pytest.fail(str(exc), pytrace=False)


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
    crds: list[dict[str, Any]] = []
    for path in sorted(tool("keda-crds").glob("*.yaml")):
        crds.extend(d for d in yaml.load_all(path.read_text(), Loader=loader) if d)
    return tuple(crds)


def keda_crds() -> list[dict[str, Any]]:
    """KEDA's CRDs as its release ships them (github.com/kedacore/keda/v2 config/crd/bases)."""
    return copy.deepcopy(list(_keda_crds()))
