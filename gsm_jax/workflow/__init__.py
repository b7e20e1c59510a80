"""The GSM workflow (spec §6): profile (step 1), evaluate, calibrate (step 4), report.

    import gsm_jax
    from gsm_jax.workflow import calibrate_model, evaluate_model, profile_model

    params = gsm_jax.load("smollm2-135m")
    prof = profile_model(params, calibration_samples=512)       # -> Profile
    prof.save("prof/")                                            # profile.json + heat map
    cal = calibrate_model(params, profile="prof/profile.json")  # -> CalibrationResult
    cal.save("cal/")                                              # gsm.yaml + JSON + PNGs
    res = evaluate_model(params, cal.config)                      # -> EvalResult
    res.save("eval.json")

The public names are ``gsm_jax.profile``, ``gsm_jax.calibrate`` and
``gsm_jax.evaluate`` (the same functions, imported lazily by `gsm_jax`).
Inside this package they carry a ``_model`` suffix because the plain names are
the submodules (``gsm_jax.workflow.profile`` etc.). The command line is `gsm_jax.workflow.cli`:
``gsm-jax profile | calibrate | eval | report``.
"""

from gsm_jax.workflow.calibrate import BudgetNotMetError, CalibrationResult
from gsm_jax.workflow.calibrate import calibrate as calibrate_model
from gsm_jax.workflow.evaluate import EvalResult, Evaluator
from gsm_jax.workflow.evaluate import evaluate as evaluate_model
from gsm_jax.workflow.metrics import Budget
from gsm_jax.workflow.profile import Profile
from gsm_jax.workflow.profile import profile as profile_model

__all__ = [
    "Budget",
    "BudgetNotMetError",
    "CalibrationResult",
    "EvalResult",
    "Evaluator",
    "Profile",
    "calibrate_model",
    "evaluate_model",
    "profile_model",
]
