"""Whether a request's sampling fields can be honoured by the live workers of its model.

Pure: the capabilities are passed in (`ModelDirectory.capabilities`, from heartbeats). The
rule (README "Sampling fields"): a request that sets a sampling field (to other than its
neutral value) which no live worker of its model honours is refused with `invalid_request`,
naming the field and the engines that lack it. With no live worker known (a new edge, a
model whose workers have not started yet) nothing is refused here: the request waits in
line, and the worker that takes it refuses what its engine does not honour
(`services/worker/engines/base.py` `check_sampling`), so a field is never silently dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.messages import Capabilities, ChatRequest, not_honoured_message


def unhonoured(request: ChatRequest, workers: Sequence[Capabilities]) -> str | None:
    """Why no one worker of `workers` (the live workers that may run `request`) could honour
    every sampling field it sets, naming a field and the engines that lack it; None if one
    could, or none is known."""
    needs = request.sampling_needs()
    if not needs or not workers or any(needs <= w.sampling for w in workers):
        return None
    # Name a field that no worker honours if there is one, else one the first one lacks.
    lacking_everywhere = frozenset.intersection(*(needs - w.sampling for w in workers))
    field = min(lacking_everywhere or needs - workers[0].sampling)
    lacking = (w.engine for w in workers if field not in w.sampling)
    return not_honoured_message(field, lacking, request.model)
