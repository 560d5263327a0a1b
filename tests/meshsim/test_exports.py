"""The public surface: every name in __all__ imports, and nothing private leaks."""

from __future__ import annotations

import types

import meshsim
import shardtensor


def test_meshsim_exports() -> None:
    for name in meshsim.__all__:
        assert getattr(meshsim, name) is not None
    public = {
        n for n, v in vars(meshsim).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public == set(meshsim.__all__)
    assert sorted(meshsim.__all__) == meshsim.__all__


def test_shardtensor_exports() -> None:
    for name in shardtensor.__all__:
        assert getattr(shardtensor, name) is not None
    public = {
        n
        for n, v in vars(shardtensor).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public == set(shardtensor.__all__)


def test_errors_share_a_base_class() -> None:
    for error in (meshsim.RankError, meshsim.CollectiveMismatchError, meshsim.DeadlockError):
        assert issubclass(error, meshsim.MeshError)
