"""Root conftest: what every test directory shares.

The meshsim pytest plugin itself is registered through the package's ``pytest11``
entry point (``pip install -e .`` makes it active), not here.

Hypothesis profiles for the property tests (tests/property), registered here so
that ``--hypothesis-profile`` works from any path: ``property`` (the default there)
keeps the suite fast on 2 cores; ``thorough`` runs 1000 examples per property:

    pytest tests/property --hypothesis-profile=thorough

Worlds are threads and timing is noisy: no deadline.
"""

from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester"]

_COMMON = {
    "deadline": None,
    # A case draws many small choices (a program, then faults until one is observable).
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("property", max_examples=150, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
