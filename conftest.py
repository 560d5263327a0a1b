"""Root conftest: what every test directory shares.

The meshsim pytest plugin itself is registered through the package's ``pytest11``
entry point (``pip install -e .`` makes it active), not here.
"""

pytest_plugins = ["pytester"]
