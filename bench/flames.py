"""Reading a py-spy (inferno) flame graph SVG back: the frames that hold the most samples.

Each frame is a `<g><title>NAME (N samples, P%)</title><rect fg:x=.. fg:w=.. y=..>`; a
frame's children are the frames one row further from the root within its `[x, x + w)`.
"""

from __future__ import annotations

import bisect
import re
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

SVG = "{http://www.w3.org/2000/svg}"
FG = "{http://github.com/jonhoo/inferno}"
_SAMPLES = re.compile(r"\s*\([\d,]+ samples?, [\d.]+%\)$")
_LINE = re.compile(r":\d+\)$")
# Frames where a thread waits, not works: py-spy's idle test misses some of them when it
# samples without stopping the process (--nonblocking), so they are left out of the shares.
WAITING = (
    "EpollSelector.select (selectors.py)",
    "_PollLikeSelector.select (selectors.py)",
    "Condition.wait (threading.py)",
    "Event.wait (threading.py)",
    "Thread._wait_for_tstate_lock (threading.py)",
    "Queue.get (queue.py)",
)


class FrameShare(BaseModel):
    """A function and the share of all samples in which it was the innermost frame."""

    model_config = ConfigDict(extra="forbid")

    frame: str
    samples: int
    share: float


@dataclass(frozen=True)
class _Frame:
    name: str
    y: float
    x: int
    w: int


def _frames(svg: Path) -> list[_Frame]:
    frames: list[_Frame] = []
    for g in ET.parse(svg).getroot().iter(f"{SVG}g"):
        title, rect = g.find(f"{SVG}title"), g.find(f"{SVG}rect")
        if title is None or rect is None or title.text is None:
            continue
        x, w = rect.get(f"{FG}x"), rect.get(f"{FG}w")
        if x is None or w is None:
            continue
        name = _LINE.sub(")", _SAMPLES.sub("", title.text))
        frames.append(_Frame(name, float(rect.get("y", "0")), int(x), int(w)))
    return frames


def top_frames(svg: Path, n: int) -> tuple[int, list[FrameShare]]:
    """Working samples, and the `n` functions with the most self samples (lines merged).

    Samples whose innermost frame is a wait (`WAITING`) are not counted at all.
    """
    working, own = self_samples(svg)
    return working, _shares(own, working, n)


def by_package(svg: Path, n: int = 12) -> list[FrameShare]:
    """Self samples summed by where the innermost frame's code lives: the top package of
    its file (`aiokafka`, `pydantic`, `services`), or the stdlib module (`asyncio`)."""
    working, own = self_samples(svg)
    packages: Counter[str] = Counter()
    for name, count in own.items():
        packages[_package(name)] += count
    return _shares(packages, working, n)


def _package(frame: str) -> str:
    where = frame.rsplit("(", 1)[-1].rstrip(")")
    top = where.split("/", 1)[0]
    return top.removesuffix(".py") if top else "?"


def _shares(counts: Counter[str], working: int, n: int) -> list[FrameShare]:
    total = max(1, working)
    return [
        FrameShare(frame=name, samples=count, share=round(count / total, 4))
        for name, count in counts.most_common(n)
    ]


def self_samples(svg: Path) -> tuple[int, Counter[str]]:
    """Working samples, and self samples per function (waiting frames taken out)."""
    frames = _frames(svg)
    if not frames:
        return 0, Counter()
    total = max(f.w for f in frames)
    rows: dict[float, list[_Frame]] = defaultdict(list)
    for f in frames:
        rows[f.y].append(f)
    ys = sorted(rows)
    # The root row is the one holding every sample; depth grows away from it.
    root_first = sum(f.w for f in rows[ys[0]]) >= sum(f.w for f in rows[ys[-1]])
    order = ys if root_first else ys[::-1]
    children_row = {order[i]: order[i + 1] for i in range(len(order) - 1)}
    starts = {y: sorted((f.x, f.w) for f in row) for y, row in rows.items()}
    own: Counter[str] = Counter()
    for f in frames:
        covered = 0
        below = children_row.get(f.y)
        if below is not None:
            row = starts[below]
            i = bisect.bisect_left(row, (f.x, -1))
            while i < len(row) and row[i][0] < f.x + f.w:
                covered += row[i][1]
                i += 1
        if f.name != "all":
            own[f.name] += f.w - covered
    waiting = sum(own.pop(name, 0) for name in WAITING)
    return total - waiting, own
