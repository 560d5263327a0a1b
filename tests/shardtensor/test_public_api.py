"""Where shardtensor's names live, and its dependency rules: no meshsim, private torch in one module.

(That ``__all__`` is exactly the public namespace is checked in tests/meshsim/test_exports.py.)
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from torch.distributed.tensor import Shard

import shardtensor

PACKAGE = pathlib.Path(shardtensor.__file__).parent


@pytest.mark.parametrize("name", shardtensor.__all__)
def test_every_exported_name_is_defined(name: str) -> None:
    assert getattr(shardtensor, name).__module__.startswith("shardtensor._")


@pytest.mark.parametrize("module", sorted(p.name for p in PACKAGE.glob("*.py")))
def test_shardtensor_never_imports_meshsim(module: str) -> None:
    tree = ast.parse((PACKAGE / module).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [name for name in imported if name.split(".")[0] == "meshsim"]


@pytest.mark.parametrize(
    "module", sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "_torch_private.py")
)
def test_private_torch_apis_live_in_one_module(module: str) -> None:
    source = (PACKAGE / module).read_text()
    assert (
        "torch._C" not in source
        and "_make_wrapper_subclass(" not in source
        and "_mesh_resources" not in source
    )


@pytest.mark.parametrize("module", sorted(p.name for p in PACKAGE.glob("*.py")))
def test_no_module_imports_one_that_imports_it(module: str) -> None:
    """The package's modules import each other one way (type-only imports included)."""

    def imports(name: str) -> set[str]:
        tree = ast.parse((PACKAGE / name).read_text())
        found = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        found |= {
            f"shardtensor.{a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module == "shardtensor"
            for a in n.names
        }
        return {f.split(".", 1)[1] + ".py" for f in found if f.startswith("shardtensor.")}

    assert not [other for other in imports(module) if module in imports(other) and other != module]


@pytest.mark.world(2)
def test_spec_is_public_and_read_only(distributed_mesh) -> None:
    st = shardtensor.ShardTensor.from_local(torch.ones(2, 3), distributed_mesh, [Shard(0)])
    assert st.spec.shape == (4, 3) and st.spec.shard_sizes == ((2, 2),)
    assert st.spec is st._spec  # PhysicsNeMo's name for the same object
    with pytest.raises(AttributeError):
        st.spec = st.spec  # type: ignore[misc]
