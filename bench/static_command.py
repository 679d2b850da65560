"""`tokenbus bench static`: the simulation (bench/static.py), the live climbs
(bench/static_live.py) when asked, then the report, its JSON, plot and docs block
(bench/static_docs.py). Apart from bench/static.py so that the modules it runs import
bench/static.py's pieces without a circle."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from bench import static
from bench.static import SLO_MS, bus_rule_live, print_report, run_all
from bench.static_docs import plot, write_section
from bench.static_live import run_live


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=static.__doc__.splitlines()[0] if static.__doc__ else None
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="simulated, per run")
    parser.add_argument("--slo-ms", type=float, default=SLO_MS)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--docs", type=Path, help="rewrite its block in this Markdown file")
    parser.add_argument(
        "--live",
        action="store_true",
        help="also climb batch1 and fixed on real stacks of 4 static workers each, whose "
        "ceilings decide the bus-rule target (~3-4 min; KAFKA_BOOTSTRAP_SERVERS, else a "
        "private broker)",
    )
    args = parser.parse_args(argv)
    command = "tokenbus bench static" + "".join(
        f" --{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in vars(args).items()
        if v is not None and v is not False
    )
    report = run_all(args.seconds, args.slo_ms, command)
    if args.live:
        log_dir = Path("bench/out/logs")
        log_dir.mkdir(parents=True, exist_ok=True)
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        started = time.monotonic()
        report.setup["live_broker"] = bootstrap or "private (started by the bench)"
        simulated = {p: report.highest_rate[p] for p in ("batch1", "fixed")}
        climbs = asyncio.run(run_live(bootstrap, log_dir, simulated, args.seconds))
        report.live = [asdict(c) for c in climbs]
        ceilings = {c.policy: c.ceiling_rps for c in climbs}
        report.targets[0] = bus_rule_live(report.targets[0], ceilings["batch1"], ceilings["fixed"])
        report.elapsed_s = round(report.elapsed_s + time.monotonic() - started, 1)
    load = os.getloadavg()
    report.load_average = (round(load[0], 2), round(load[1], 2), round(load[2], 2))
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(report), indent=2))
    if args.plot:
        plot(report, args.plot)
    if args.docs:
        write_section(report, args.docs, args.plot)
    return 0  # a missed target is reported, not an exit status (`make bench` runs on)


if __name__ == "__main__":
    raise SystemExit(main())
