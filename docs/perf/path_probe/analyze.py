"""Cut the first-token path at the stamps `sitecustomize.py` wrote; print p50/p90 per leg.

    .venv/bin/python docs/perf/path_probe/analyze.py DIR [--second-half]

`--second-half`: only the later half of each leg's samples (the second of two equal runs on
one stack, where the first warmed it).
"""

from __future__ import annotations

import bisect
import json
import sys
from pathlib import Path


def load(directory: Path, service: str) -> list[dict[str, float | str]]:
    files = sorted(directory.glob(f"{service}-*.jsonl"))
    if not files:
        sys.exit(f"no {service}-*.jsonl in {directory}")
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def line(name: str, values: list[float], later: bool) -> str:
    v = sorted(values[len(values) // 2 :] if later else values)
    if not v:
        return f"{name:40} -"
    return f"{name:40} n={len(v):5}  p50 {v[len(v) // 2]:6.3f}  p90 {v[int(len(v) * 0.9)]:6.3f} ms"


def next_after(times: list[float], t: float) -> float | None:
    i = bisect.bisect_left(times, t)
    return times[i] if i < len(times) else None


def main() -> None:
    directory, later = Path(sys.argv[1]), "--second-half" in sys.argv
    s, w, e = load(directory, "scheduler"), load(directory, "worker"), load(directory, "edge")
    ms = 1000.0
    s_writes = sorted(float(x["t"]) for x in s if x["e"] == "pw")
    w_writes = sorted(float(x["t"]) for x in w if x["e"] == "pw")
    outs = [x for x in s if x["e"] == "out"]
    write_of = {x["formed"]: next_after(s_writes, float(x["t"])) for x in outs}
    takes = [x for x in w if x["e"] == "take"]
    take_of = {x["formed"]: float(x["t"]) for x in takes}
    starts = [x for x in w if x["e"] == "start"]
    puts = {str(x["rid"]): float(x["t"]) for x in w if x["e"] == "first_put"}
    firsts = [x for x in e if x["e"] == "res0"]
    handed = {str(x["rid"]): float(x["t"]) for x in firsts}
    legs: list[tuple[str, list[float]]] = [
        ("scheduler: formed -> encoded", [(float(x["t"]) - float(x["formed"])) * ms for x in outs]),
        (
            "scheduler: encoded -> socket write",
            [(wr - float(x["t"])) * ms for x in outs if (wr := write_of[x["formed"]])],
        ),
        (
            "broker: scheduler write -> worker frame",
            [
                (float(x["frame"]) - wr) * ms
                for x in takes
                if (wr := write_of.get(x["formed"])) is not None
            ],
        ),
        (
            "worker: frame -> batch parsed",
            [(float(x["t"]) - float(x["frame"])) * ms for x in takes],
        ),
        (
            "worker: batch parsed -> run started",
            [(float(x["t"]) - take_of[x["formed"]]) * ms for x in starts if x["formed"] in take_of],
        ),
        (
            "= batch formed -> run started",
            [(float(x["t"]) - float(x["formed"])) * ms for x in starts],
        ),
        (
            "worker: first record put -> socket write",
            [(wr - t) * ms for t in puts.values() if (wr := next_after(w_writes, t))],
        ),
        (
            "broker: worker write -> edge frame",
            [
                (float(x["frame"]) - wr) * ms
                for x in firsts
                if (t := puts.get(str(x["rid"]))) is not None
                and (wr := next_after(w_writes, t)) is not None
            ],
        ),
        ("edge: frame -> gateway", [(float(x["t"]) - float(x["frame"])) * ms for x in firsts]),
        (
            "edge: gateway -> WebSocket written",
            [
                (float(x["t"]) - handed[str(x["rid"])]) * ms
                for x in e
                if x["e"] == "w0" and str(x["rid"]) in handed
            ],
        ),
    ]
    for name, values in legs:
        print(line(name, values, later))


if __name__ == "__main__":
    main()
