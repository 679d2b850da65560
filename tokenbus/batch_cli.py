"""`tokenbus batch`: run an OpenAI batch without writing code (issue 39 item 5).

  tokenbus batch submit requests.jsonl     upload, create, show progress until it ends,
                                           then download its output and error files
  tokenbus batch status BATCH_ID           the batch, as JSON
  tokenbus batch list                      your batches, newest first
  tokenbus batch cancel BATCH_ID
  tokenbus batch download BATCH_ID         its output and error files, to --out

It speaks the edge's OpenAI API (`/v1/files`, `/v1/batches`): `--base-url` (default
$OPENAI_BASE_URL, else http://127.0.0.1:8000/v1, where `make run` serves it) and
`--api-key` (default $OPENAI_API_KEY, else $TOKENBUS_API_KEY), as the `openai` SDK reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tokenbus.commands import Subcommands

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
ENDED = ("completed", "failed", "expired", "cancelled")
POLL_S = 2.0
# Without a terminal (CI, a pipe), a progress line is printed at most this often.
QUIET_LINE_S = 15.0
BAR = 30


class ApiError(Exception):
    """The edge answered an error: its OpenAI message, said once."""


def register(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "batch",
        help="submit, follow, cancel and download OpenAI batches",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--base-url",
        default=os.environ.get("OPENAI_BASE_URL", DEFAULT_BASE_URL),
        help="the edge's OpenAI API",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY") or os.environ.get("TOKENBUS_API_KEY"),
        help="an API key (default: $OPENAI_API_KEY, else $TOKENBUS_API_KEY)",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    submit = actions.add_parser("submit", help="upload FILE, create its batch, follow it")
    submit.add_argument("file", type=Path, help="a JSONL file of requests")
    submit.add_argument(
        "--endpoint",
        choices=("/v1/chat/completions", "/v1/completions"),
        help="default: the first line's url",
    )
    submit.add_argument("--no-wait", action="store_true", help="create it and return")
    submit.add_argument("--out", type=Path, default=Path("."), help="where its files go")
    for name, text in (("status", "show a batch"), ("cancel", "cancel a batch")):
        action = actions.add_parser(name, help=text)
        action.add_argument("batch_id")
    actions.add_parser("list", help="your batches, newest first")
    download = actions.add_parser("download", help="a batch's output and error files")
    download.add_argument("batch_id")
    download.add_argument("--out", type=Path, default=Path("."), help="where they go")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if not args.api_key:
        print("tokenbus batch: no API key: pass --api-key or set OPENAI_API_KEY", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"}
    with httpx.Client(base_url=args.base_url.rstrip("/"), headers=headers, timeout=60) as api:
        try:
            return _ACTIONS[args.action](api, args)
        except ApiError as exc:
            print(f"tokenbus batch: {exc}", file=sys.stderr)
            return 1
        except httpx.HTTPError as exc:
            print(f"tokenbus batch: cannot reach {args.base_url}: {exc}", file=sys.stderr)
            return 1


def _call(api: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    response = api.request(method, path, **kwargs)
    if response.is_success:
        return response
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    raise ApiError(f"{method} {path}: {response.status_code}: {message}")


def _submit(api: httpx.Client, args: argparse.Namespace) -> int:
    path: Path = args.file
    try:
        endpoint = args.endpoint or _first_url(path)
    except (OSError, ValueError) as exc:
        raise ApiError(f"{path}: {exc}") from exc
    with path.open("rb") as source:
        uploaded = _call(
            api, "POST", "/files", files={"file": (path.name, source)}, data={"purpose": "batch"}
        ).json()
    print(f"uploaded {path} as {uploaded['id']} ({uploaded['bytes']} bytes)", file=sys.stderr)
    body = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h"}
    batch = _call(api, "POST", "/batches", json=body).json()
    print(f"created {batch['id']}", file=sys.stderr)
    if args.no_wait:
        print(json.dumps(batch, indent=2))
        return 0
    batch = _follow(api, batch["id"])
    print(json.dumps(batch, indent=2))
    _download_files(api, batch, args.out)
    return 0 if batch["status"] == "completed" else 1


def _first_url(path: Path) -> str:
    with path.open("rb") as source:
        for raw in source:
            if raw.strip():
                url = json.loads(raw).get("url")
                if not isinstance(url, str):
                    raise ValueError("its first line names no url")
                return url
    raise ValueError("it holds no request")


def _follow(api: httpx.Client, batch_id: str) -> dict[str, Any]:
    """Poll the batch until it ends, showing its request_counts as a bar."""
    tty = sys.stderr.isatty()
    shown_at = 0.0
    while True:
        batch: dict[str, Any] = _call(api, "GET", f"/batches/{batch_id}").json()
        line = _progress(batch)
        ended = batch["status"] in ENDED
        if tty:
            print(f"\r{line}", end="\n" if ended else "", file=sys.stderr, flush=True)
        elif ended or time.monotonic() - shown_at >= QUIET_LINE_S:
            print(line, file=sys.stderr, flush=True)
            shown_at = time.monotonic()
        if ended:
            return batch
        time.sleep(POLL_S)


def _progress(batch: dict[str, Any]) -> str:
    counts = batch.get("request_counts") or {}
    total, done = counts.get("total", 0), counts.get("completed", 0) + counts.get("failed", 0)
    filled = BAR * done // total if total else 0
    return (
        f"[{'#' * filled}{'.' * (BAR - filled)}] {done}/{total}"
        f" ({counts.get('failed', 0)} failed) {batch['status']}"
    )


def _download_files(api: httpx.Client, batch: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for field, suffix in (("output_file_id", "output"), ("error_file_id", "errors")):
        file_id = batch.get(field)
        if not file_id:
            continue
        target = out / f"{batch['id']}_{suffix}.jsonl"
        with api.stream("GET", f"/files/{file_id}/content") as response:
            if not response.is_success:
                response.read()
                raise ApiError(f"GET /files/{file_id}/content: {response.status_code}")
            with target.open("wb") as sink:
                for chunk in response.iter_bytes():
                    sink.write(chunk)
        print(f"wrote {target}", file=sys.stderr)


def _status(api: httpx.Client, args: argparse.Namespace) -> int:
    print(json.dumps(_call(api, "GET", f"/batches/{args.batch_id}").json(), indent=2))
    return 0


def _list(api: httpx.Client, args: argparse.Namespace) -> int:
    for batch in _call(api, "GET", "/batches").json()["data"]:
        print(f"{batch['id']}  {batch['status']:<11}  {_progress(batch).split('] ')[1]}")
    return 0


def _cancel(api: httpx.Client, args: argparse.Namespace) -> int:
    batch = _call(api, "POST", f"/batches/{args.batch_id}/cancel").json()
    print(f"{batch['id']} {batch['status']}")
    return 0


def _download(api: httpx.Client, args: argparse.Namespace) -> int:
    batch = _call(api, "GET", f"/batches/{args.batch_id}").json()
    if batch["status"] not in ENDED:
        raise ApiError(f"{args.batch_id} is {batch['status']}: its files come when it ends")
    _download_files(api, batch, args.out)
    return 0


_ACTIONS = {
    "submit": _submit,
    "status": _status,
    "list": _list,
    "cancel": _cancel,
    "download": _download,
}
