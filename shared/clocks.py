"""Comparing the clocks of two services (issue 38, item 4).

A record's timestamp is its writer's clock (Kafka's CreateTime), and one service reading
another's records compares that clock with its own, or with a third's. Hosts kept by NTP
agree within milliseconds; a host whose clock runs seconds behind must not make a reader
miss what it wrote. Every such comparison gives the other clock `SKEW_MARGIN_S` of benefit:
a search for records written "since" a time starts that much earlier. A clock further off
than that is a host to fix; what it costs then is named where the margin is used.
"""

from __future__ import annotations

SKEW_MARGIN_S = 30.0


def since_with_margin_ms(since_ms: int) -> int:
    """The earliest timestamp (ms) a record written at or after `since_ms` by another
    service's clock may carry: `since_ms` less the margin, never below 0."""
    return max(0, since_ms - int(SKEW_MARGIN_S * 1000))
