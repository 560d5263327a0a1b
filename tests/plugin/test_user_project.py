"""meshsim installed the way a user installs it, in a project that turns warnings into errors.

The rest of the plugin's tests run inside this repository's own pytest session,
where meshsim is already imported and its configuration applies: they cannot see
what pytest does while it loads meshsim's ``pytest11`` entry point in someone
else's project. Here a throw-away project (its own ``pyproject.toml`` with
``filterwarnings = ["error"]``, one plain test and one world-marked test) runs
pytest in a fresh virtual environment holding torch and meshsim installed from a
copy of this checkout: editable, regular and as a built wheel, under the newest
pytest and the newest 8.x (meshsim supports ``pytest>=8``). Each run must pass
cleanly, with no warning at all, under the project's ``filterwarnings`` and under
``-W error``.

Slow (a fresh environment, torch installed into it): one environment per test
module and xdist worker, into which each test installs meshsim the way it
checks. torch comes first and pinned (``MESHSIM_TORCH_SPEC``, as ``./dev`` reads
it), so that nothing pulls another build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TORCH_SPEC = os.environ.get("MESHSIM_TORCH_SPEC", "torch==2.13.0")

PYPROJECT = """\
[tool.pytest.ini_options]
filterwarnings = ["error"]
"""

TESTS = """\
import pytest
import torch
import torch.distributed as dist


def test_plain():
    assert 1


@pytest.mark.world(2)
def test_sum(rank, world_size):
    t = torch.ones(1) * rank
    dist.all_reduce(t)
    assert t.item() == sum(range(world_size))
"""


def _environ() -> dict[str, str]:
    """This environment (pip's settings included), less what would steer the inner pytest or Python."""
    drop = ("PYTEST_", "MESHSIM_", "PYTHON", "VIRTUAL_ENV", "COV_CORE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(*args: str | Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=_environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{' '.join(result.args)} exited {result.returncode}:\n{result.stdout}"
    return result.stdout


class UserEnvironment:
    """A fresh virtual environment with torch, and a copy of this checkout to install meshsim from."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.source = base / "meshsim-src"
        # A copy: pip's builds write build/ and *.egg-info into the tree they build.
        shutil.copytree(
            ROOT,
            self.source,
            ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "dist"),
        )
        self.venv = base / "venv"
        _ok(_run(sys.executable, "-m", "venv", self.venv, cwd=base))
        self.python = self.venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        index = os.environ.get("MESHSIM_TORCH_INDEX_URL")
        _ok(self.pip("install", *(["--index-url", index] if index else []), TORCH_SPEC))
        purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
        self.site_packages = Path(_ok(_run(self.python, "-c", purelib, cwd=base)).strip())

    def pip(self, *args: str | Path) -> subprocess.CompletedProcess[str]:
        return _run(self.python, "-m", "pip", "--quiet", *args, cwd=self.base)

    def install(self, how: str, pytest_spec: str) -> Path:
        """Install meshsim (``editable``, ``regular``, ``wheel``) and ``pytest_spec``; return where it is."""
        # Whichever way the last test installed it; pip's uninstall leaves the folders
        # of a regular install behind where pytest wrote rewritten .pyc files there,
        # and such a folder would shadow an editable install as a namespace package.
        self.pip("uninstall", "--yes", "meshsim")
        for package in ("meshsim", "shardtensor"):
            shutil.rmtree(self.site_packages / package, ignore_errors=True)
        if how == "editable":
            _ok(self.pip("install", "--editable", self.source, pytest_spec))
        elif how == "regular":
            _ok(self.pip("install", self.source, pytest_spec))
        else:
            wheels = self.base / "wheels"
            shutil.rmtree(wheels, ignore_errors=True)
            _ok(self.pip("wheel", "--no-deps", "--wheel-dir", wheels, self.source))
            (wheel,) = wheels.glob("meshsim-*.whl")
            _ok(self.pip("install", wheel, pytest_spec))
        where = _ok(
            _run(
                self.python,
                "-c",
                "import importlib.util, pytest; print(importlib.util.find_spec('meshsim').origin); "
                "print(pytest.__version__)",
                cwd=self.base,
            )
        ).split()
        print(f"meshsim ({how}) at {where[0]}, pytest {where[1]}")
        return Path(where[0])


@pytest.fixture(scope="module")
def user_environment(tmp_path_factory: pytest.TempPathFactory) -> UserEnvironment:
    return UserEnvironment(tmp_path_factory.mktemp("user-environment"))


@pytest.mark.parametrize(
    ("how", "pytest_spec"),
    [
        ("editable", "pytest>=9"),
        ("regular", "pytest>=9"),
        ("wheel", "pytest>=9"),
        ("editable", "pytest>=8,<9"),
        ("regular", "pytest>=8,<9"),
    ],
)
def test_a_project_that_errors_on_warnings_passes_cleanly(
    user_environment: UserEnvironment, tmp_path: Path, how: str, pytest_spec: str
) -> None:
    where = user_environment.install(how, pytest_spec)
    installed_in_venv = where.is_relative_to(user_environment.venv)
    assert installed_in_venv == (how != "editable"), where

    project = tmp_path / "userproj"
    project.mkdir()
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "test_user.py").write_text(TESTS)
    runs = {
        "filterwarnings": [],
        "-W error": ["-W", "error"],
        "-W error only": ["-W", "error", "-o", "filterwarnings="],
    }
    for name, args in runs.items():
        result = _run(user_environment.python, "-m", "pytest", "-q", *args, cwd=project)
        out = result.stdout
        context = f"{how} install, {pytest_spec}, {name}: exit {result.returncode}\n{out}"
        assert result.returncode == 0, context
        assert "2 passed in" in out.splitlines()[-1], context
        assert "warning" not in out.lower(), context
        assert "meshsim" not in out, context
