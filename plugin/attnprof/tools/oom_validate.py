"""The OOM prediction checked by a run: ``attnprof profile --validate`` runs the model at the
predicted maximum length and compares the measured peak with the predicted one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from attnprof.analyze import memory, oom
from attnprof.contracts.profile import OomPrediction, Validation
from attnprof.tools import memory_measure, model_inputs

__all__ = ["validate_prediction"]


def validate_prediction(pred: OomPrediction, model: Any, cfg: Any, vocab: int, B: int,
                        static: int, model_error: float | None,
                        say: Callable[[str], None]) -> None:
    """Run the model at the predicted maximum length when the prediction planned it and the
    model can take that length; ``pred.validation`` and ``pred.confidence`` say how it
    went (a failed run is a skipped validation, never a traceback)."""
    if pred.validation is None or not pred.validation.planned:
        return
    length = int(pred.max_seq_len or 0)
    if not model_inputs.can_run(cfg, length):
        pred.validation = Validation(planned=False, skipped=(
            f"a vision model's sequence is n^2 patches + 1; L={pred.max_seq_len} is not "
            "one, so it cannot be run as predicted"))
        return
    positions = model_inputs.position_limit(model)
    if positions is not None and length > positions:
        pred.validation = Validation(planned=False, skipped=(
            f"L={pred.max_seq_len} is past the model's {positions} learned absolute "
            "positions, so it cannot be run as predicted"))
        return
    say(f"validating at L={length}")
    try:
        v = pred.validation = _validate(model, vocab, B, length, static, pred)
    except Exception as exc:  # a minutes-long profile never ends in a traceback here
        msg = (str(exc).strip().splitlines() or [""])[0][:200]
        pred.validation = Validation(planned=False, skipped=(
            f"the run at L={length} failed: {type(exc).__name__}: {msg}"))
        return
    pred.confidence = oom.confidence(
        pred.extrapolation_factor,
        validated=bool(v.fits_budget and (v.rel_error or 0.0) <= 0.05),
        model_error=model_error)


def _validate(model: Any, vocab: int, B: int, L: int, static: int,
              pred: OomPrediction) -> Validation:
    """The run at the predicted maximum length ``L``: its measured peak against ``pred``."""
    ids = model_inputs.random_ids(vocab, B, L, seed=7)
    t0 = time.perf_counter()
    out, extra = memory_measure.measure_peak(lambda: model_inputs.forward(model, ids))
    del out
    measured = int(static + extra)
    predicted = float(pred.predicted_peak_bytes_at_max or 0.0)
    return Validation(
        planned=True, seq_len=L, measured_peak_bytes=measured, predicted_peak_bytes=predicted,
        rel_error=round(memory.rel_err(predicted, measured), 4),
        fits_budget=measured <= pred.memory_budget_bytes,
        seconds=round(time.perf_counter() - t0, 2))
