"""Which model of its route's cascade a request runs on (shared/cascades.py, ADR 0059).

Pure: the scheduler's intake asks `on_route` for each request it queues. A request that
names a route runs on the model at its `cascade_step`: the step its route's rules pick
(prompt length, the key's plan) when it is first queued, or the step a worker raised it to
when the answer of the model before failed the route's verifier. The step is written on
the request that rides in the batch, so a dead worker's recovery re-runs it on the same
model.
"""

from __future__ import annotations

from dataclasses import replace

from services.scheduler.admission import Waiting
from shared.cascades import Routes


def on_route(w: Waiting, model: str | None, routes: Routes) -> tuple[Waiting, str | None]:
    """The waiting request (its step set, if it names a route) and the model it runs on.

    `model`: what the request names (or the deployment's default); a model that is no
    route is returned as it is, with the request unchanged. A request for the default
    model, a route, is given its name: the worker finds its route by it.
    """
    route = routes.get(model) if model is not None else None
    if route is None or model is None:
        return w, model
    request = w.request
    step = request.cascade_step
    if step is None:
        step = route.start_step(request.prompt_tokens, request.plan)
    step = min(step, len(route.cascade) - 1)
    if (step, model) != (request.cascade_step, request.model):
        w = replace(w, request=request.model_copy(update={"cascade_step": step, "model": model}))
    return w, route.model_at(step)
