"""``--mesh-cuda``: GPU code on simulated ranks, with CUDA emulated on the CPU or every rank on one GPU.

``--mesh-cuda=cpu`` (or ``MESHSIM_CUDA=cpu``) installs the emulation of
:mod:`meshsim._process.cuda` before any conftest configures, so collection, fixtures
in the pytest process and every rank see a CUDA machine with one GPU per rank (at
least 8; ``MESHSIM_CUDA_DEVICES`` sets the count). ``--mesh-cuda=cuda:0`` puts every
rank's ``cuda:k`` on the one real GPU. The value reaches spawned ranks through
``MESHSIM_CUDA`` in their environment, so each installs it too.
"""

from __future__ import annotations

import os

import pytest

__all__: list[str] = []

_INSTALLED = pytest.StashKey[bool]()
_ENVIRON = pytest.StashKey["str | None"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("meshsim")
    group.addoption(
        "--mesh-cuda",
        default=os.environ.get("MESHSIM_CUDA") or None,
        metavar="cpu|cuda:N|off",
        help="run code written for CUDA and NCCL on simulated ranks: 'cpu' emulates one GPU per rank "
        "on the CPU; 'cuda:N' puts every rank's cuda:k on this machine's GPU N (default: "
        "$MESHSIM_CUDA, else off)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> None:
    # Before any conftest is imported: a conftest decides at import what runs on CUDA
    # (PhysicsNeMo's parametrizes its ``device`` fixture on torch.cuda.is_available()).
    _install(early_config, getattr(early_config.known_args_namespace, "mesh_cuda", None))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if not config.stash.get(_INSTALLED, False):  # pytest.main() with plugins given in-process
        _install(config, config.getoption("mesh_cuda"))


def _install(config: pytest.Config, value: str | None) -> None:
    if value in (None, "", "off"):
        return
    from meshsim._engine import cuda

    world_size = getattr(config.known_args_namespace, "world_size", None) or 4
    try:
        spec = cuda.parse(value, devices=cuda.devices_wanted(world_size))
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"--mesh-cuda: {exc}") from None
    if spec is None:
        return
    cuda.acquire(spec)
    cuda.enter_rank()  # the pytest process too: collection, hooks and fixtures that run here
    config.stash[_INSTALLED] = True
    config.stash[_ENVIRON] = os.environ.get("MESHSIM_CUDA")
    os.environ["MESHSIM_CUDA"] = value  # spawned ranks install it as well


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(_INSTALLED, False):
        from meshsim._engine import cuda

        config.stash[_INSTALLED] = False
        cuda.leave_rank()
        cuda.release()
        before = config.stash.get(_ENVIRON, None)
        if before is None:
            os.environ.pop("MESHSIM_CUDA", None)
        else:
            os.environ["MESHSIM_CUDA"] = before
