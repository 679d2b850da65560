"""Stamps along a request's way to its first token, written by each service as it runs.

Not part of tokenbus: a measuring aid. Python imports `sitecustomize` at start from any
directory on PYTHONPATH, so putting this directory there makes each service a bench starts
write, when PATH_PROBE_DIR is set, one JSON line per event to PATH_PROBE_DIR/<service>-<pid>.jsonl:

- every process: `pw` when aiokafka writes a produce request to its socket;
- scheduler: `out`, a batch formed (its `formed_at`) and encoded;
- worker: `take`, a batch record read and parsed (with the time the last Kafka frame
  arrived); `start`, a request's run begun (its `RequestState`); `first_put`, its first
  result record handed to the outbox;
- edge: `res0`, a request's first delta record handed to the gateway (with its frame's
  arrival); `w0`, its first delta frame written to the WebSocket.

`analyze.py` (beside this file) cuts the first-token path at these stamps. Usage in
docs/benchmarks.md ("Where the first token's time goes"). The patches wrap, and never change
what the wrapped code does; they cost some microseconds each, so the totals they measure read
a little higher than a run without them.
"""

import json
import os
import time
from pathlib import Path

_ROLE = next(
    (
        part.decode().split(".")[1]
        for part in Path("/proc/self/cmdline").read_bytes().split(b"\0")
        if part in (b"services.worker", b"services.scheduler", b"services.edge")
    ),
    None,
)

if _ROLE and os.environ.get("PATH_PROBE_DIR"):
    _out = open(  # noqa: SIM115 (open for the process's life, line-buffered)
        Path(os.environ["PATH_PROBE_DIR"]) / f"{_ROLE}-{os.getpid()}.jsonl", "a", buffering=1
    )

    def _emit(**fields: object) -> None:
        _out.write(json.dumps(fields) + "\n")

    from aiokafka import conn as _conn

    _last = {"frame": 0.0}
    _send, _frame = _conn.AIOKafkaConnection.send, _conn.AIOKafkaConnection._handle_frame

    def _send_stamped(self, request, expect_response=True):  # type: ignore[no-untyped-def]
        result = _send(self, request, expect_response)
        if type(request).__name__.startswith("ProduceRequest"):
            _emit(e="pw", t=time.time())
        return result

    def _frame_stamped(self, resp):  # type: ignore[no-untyped-def]
        _last["frame"] = time.time()
        return _frame(self, resp)

    _conn.AIOKafkaConnection.send = _send_stamped
    _conn.AIOKafkaConnection._handle_frame = _frame_stamped

    if _ROLE == "scheduler":
        from services.scheduler import dispatch as _dispatch

        _outgoing = _dispatch.Dispatcher.outgoing

        def _outgoing_stamped(self, d, now):  # type: ignore[no-untyped-def]
            out = _outgoing(self, d, now)
            _emit(e="out", formed=out.batch.formed_at, t=time.time())
            return out

        _dispatch.Dispatcher.outgoing = _outgoing_stamped

    if _ROLE == "worker":
        from services.worker import intake as _intake
        from services.worker import replies as _replies
        from services.worker import request_state as _state

        _take = _intake.BatchIntake.take

        async def _take_stamped(self, consumer):  # type: ignore[no-untyped-def]
            taken = await _take(self, consumer)
            now = time.time()
            for _, parsed in taken:
                if parsed.batch is not None:
                    _emit(e="take", formed=parsed.batch.formed_at, frame=_last["frame"], t=now)
            return taken

        _intake.BatchIntake.take = _take_stamped
        _init = _state.RequestState.__init__

        def _init_stamped(self, request, batch_size, formed_at, *args, **kwargs):  # type: ignore[no-untyped-def]
            _init(self, request, batch_size, formed_at, *args, **kwargs)
            _emit(e="start", formed=formed_at, t=time.time(), rid=request.request_id)

        _state.RequestState.__init__ = _init_stamped
        _put = _replies.ReplyWriter.send_encoded

        def _put_stamped(self, value, headers=None):  # type: ignore[no-untyped-def]
            if not getattr(self, "_probe_sent", False):
                self._probe_sent = True
                _emit(e="first_put", t=time.time(), rid=self._request_id)
            return _put(self, value, headers)

        _replies.ReplyWriter.send_encoded = _put_stamped

    if _ROLE == "edge":
        from services.edge import gateway as _gateway

        _seen: set[str] = set()
        _written: set[str] = set()
        _on_results, _on_written = _gateway.Gateway.on_results, _gateway.Gateway.written

        def _on_results_stamped(self, results):  # type: ignore[no-untyped-def]
            now = time.time()
            for _, result in results:
                if getattr(result, "kind", None) == "delta" and result.request_id not in _seen:
                    _seen.add(result.request_id)
                    _emit(e="res0", frame=_last["frame"], t=now, rid=result.request_id)
            return _on_results(self, results)

        def _written_stamped(self, frame, stream):  # type: ignore[no-untyped-def]
            if getattr(frame, "type", "") == "chat.delta" and frame.request_id not in _written:
                _written.add(frame.request_id)
                _emit(e="w0", t=time.time(), rid=frame.request_id)
            return _on_written(self, frame, stream)

        _gateway.Gateway.on_results = _on_results_stamped
        _gateway.Gateway.written = _written_stamped
