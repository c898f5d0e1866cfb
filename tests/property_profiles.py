"""Hypothesis profiles for the chunked-logits property tests.

Select one with the environment variable ``HYPOTHESIS_PROFILE``:

    HYPOTHESIS_PROFILE=ci    (default) derandomized, few generated cases: the same
                             cases on every run, a few seconds on 2 CPU cores
    HYPOTHESIS_PROFILE=dev   random, a few more cases, the example database on
    HYPOTHESIS_PROFILE=long  random, many cases: deep runs (``make test-long``-like)

The profiles are registered here (not in tests/conftest.py) and applied per test
with ``@settings(PROFILE)``, so loading this module changes no global setting.
"""

from __future__ import annotations

import os
import warnings

from hypothesis import HealthCheck, Phase, settings

_COMMON = dict(
    deadline=None,  # a case traces with Dynamo: its time varies with the machine's load
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
    print_blob=True,
)

settings.register_profile(
    "chunked_logits.ci", derandomize=True, database=None, max_examples=40,
    phases=[Phase.explicit, Phase.generate, Phase.shrink], **_COMMON)
settings.register_profile("chunked_logits.dev", max_examples=100, **_COMMON)
settings.register_profile("chunked_logits.long", max_examples=1500, **_COMMON)

# How many generated cases also get full Inductor compiles (both backends) per profile:
# full compiles cost seconds each on CPU, so CI runs only the fixed subset.
FULL_COMPILE_EXAMPLES = {"ci": 0, "dev": 4, "long": 40}

NAME = os.environ.get("HYPOTHESIS_PROFILE", "ci").strip().lower() or "ci"
if NAME not in FULL_COMPILE_EXAMPLES:
    # Another suite's profile name: these tests run their CI profile.
    warnings.warn(f"HYPOTHESIS_PROFILE={NAME!r} is not a chunked_logits profile "
                  f"({', '.join(FULL_COMPILE_EXAMPLES)}); the property tests use 'ci'", stacklevel=1)
    NAME = "ci"
PROFILE = settings.get_profile(f"chunked_logits.{NAME}")
FULL_COMPILES = FULL_COMPILE_EXAMPLES[NAME]
