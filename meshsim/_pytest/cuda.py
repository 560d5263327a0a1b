"""``--mesh-cuda``: GPU code on simulated ranks, with CUDA emulated on the CPU or every rank on one GPU.

The option (default ``MESHSIM_CUDA``; ``MESHSIM_CUDA_DEVICES`` sets the GPU count) is
resolved once, before any conftest configures, into a
:class:`meshsim._process.cuda.Spec`: the plugin's state keeps it
(:attr:`PluginState.cuda <meshsim._pytest.state.PluginState>`), and every world the
plugin starts is handed it (each sizes it to its own ranks per node; spawned ranks
get it as an argument). The pytest process emulates too, sized for ``--world-size``,
so that collection and the fixtures that run here see a CUDA machine.
``--mesh-cuda=cuda:0`` puts every rank's ``cuda:k`` on the one real GPU.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from meshsim._pytest.state import state_of

__all__: list[str] = []

_EMULATION = pytest.StashKey[Any]()  # the Spec --mesh-cuda asks for (None: off)
_HERE = pytest.StashKey[Any]()  # the Spec the pytest process emulates (sized), until unconfigure


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
    namespace = early_config.known_args_namespace
    _emulate(early_config, getattr(namespace, "mesh_cuda", None), getattr(namespace, "world_size", None))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if _EMULATION not in config.stash:  # pytest.main() with plugins given in-process
        _emulate(config, config.getoption("mesh_cuda"), config.getoption("world_size"))
    state_of(config).cuda = config.stash[_EMULATION]  # what every world of the run is handed


def _emulate(config: pytest.Config, value: str | None, world_size: int | None) -> None:
    """Resolve ``--mesh-cuda`` once, and emulate it in the pytest process."""
    from meshsim._engine import cuda, install_cuda

    try:
        spec = cuda.resolve(value) if value not in (None, "", "off") else None
    except (TypeError, ValueError) as exc:
        raise pytest.UsageError(f"--mesh-cuda: {exc}") from None
    config.stash[_EMULATION] = spec
    if spec is None:
        return
    here = spec.sized(world_size or 4)
    install_cuda(here)
    config.stash[_HERE] = here
    cuda.enter_rank(here, spec)  # the pytest process too: collection, hooks and fixtures that run here


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    here = config.stash.get(_HERE, None)
    if here is not None:
        from meshsim._engine import cuda, uninstall_cuda

        config.stash[_HERE] = None
        cuda.leave_rank()
        uninstall_cuda(here)
