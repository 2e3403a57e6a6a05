"""The engine's cost curve, measured once per machine, model and form of step, and kept in the model cache.

Measuring it takes seconds of a start (``Verifier.profile_cost``); it depends on the model, dtype, device,
CPU and compute threads, the batch budget and the step's form, so a start that matches all of them reads
the curve an earlier one kept. A curve that looks stalled (another process held the cores while it was
timed) is used for this start and not kept. Served steps correct whatever curve is used
(``served_costs``), so one kept from a start on a busy machine is put right within a few rounds.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from target_service.config import VerifierConfig
from target_service.cost_curve import CostCurve
from target_service.verifier import Verifier

log = logging.getLogger("target_service")


def kept_curve_path(cache_root: Path, model_name: str, verifier: Verifier, config: VerifierConfig) -> Path:
    """Where the curve of ``verifier`` serving ``model_name`` under ``config`` is kept (``cost-curves/``)."""
    return cache_root / "cost-curves" / f"{_curve_key(model_name, verifier, config)}.json"


def _curve_key(model_name: str, verifier: Verifier, config: VerifierConfig) -> str:
    """What the cost curve depends on: model, dtype, device, CPU and threads, the batch budget, the step's form."""
    from specserve.hardware import cpu_model
    from target_service.engine_threads import compute_threads

    parts = [model_name, verifier.dtype, str(verifier.device), cpu_model(), str(compute_threads())]
    # "engine-thread": timed where steps run; curves kept before that timed the serving thread and are stale.
    parts += [str(config.max_batch_tokens), verifier.step_form, "engine-thread"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def size_budgets(verifier: Verifier, cached: Path) -> None:
    """Use the cost curve measured on an earlier start on this machine, else measure it (seconds) and keep it."""
    try:
        verifier.use_cost_curve(CostCurve.from_json(cached.read_text()))
        log.info("cost curve from %s (delete it to measure again)", cached)
        return
    except (OSError, ValueError):
        pass
    log.info("measuring the engine's cost curve (once per machine, model and dtype)")
    curve = verifier.profile_cost()
    if not curve.plausible():
        log.warning("the cost curve looks stalled (another process held the cores?): used now, not kept")
        return
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(curve.to_json())
    except OSError as exc:
        log.warning("could not keep the cost curve in %s: %s", cached, exc)
