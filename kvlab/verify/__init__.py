"""`kvlab verify`: every cache schedule (and the engine's paged, batched path) against a full recompute."""

from kvlab.verify.verifier import (ERROR_UNITS_PER_LAYER, CheckResult, Tolerance, default_tolerance,
                                   fixed_tolerance, schedules, verify_model)

__all__ = ["ERROR_UNITS_PER_LAYER", "CheckResult", "Tolerance", "default_tolerance", "fixed_tolerance",
           "schedules", "verify_model"]
