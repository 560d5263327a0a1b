"""torch.compile of functions that take and return ShardTensors: forward, backward, uneven shards.

Every function compiles with ``fullgraph=True`` (a graph break would raise), runs on
4 simulated ranks, and must give eager's values and gradients, with each gradient in
its leaf's layout. Collectives inside compiled graphs are functional collectives.

``dynamic=False``: simulated ranks share one process and so Dynamo's cache, and ranks
whose shards differ in shape would otherwise look like a shape change (a recompile
with symbolic sizes), which no single process of a real job sees.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from shardtensor import ShardTensor

from .op_cases import Layout, replicated
from .shardtensor_cases import global_tensor


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Each test compiles from an empty cache, reset here, before its ranks start.

    Not in the rank bodies: gloo ranks run at once, and a reset in one rank while
    another runs or compiles a graph frees what that rank is using (a segfault, or
    garbage values). A function-scoped fixture that needs no per-rank value runs once
    in the pytest process.
    """
    torch._dynamo.reset()


def _mlp_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (F.gelu(x @ w) ** 2).mean() + x.sum(-1).amax(-1).sum()


def _norm_softmax(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = F.layer_norm(x, (x.shape[-1],)) * w.sum()
    return F.softmax(y, dim=-1).transpose(-1, -2).flatten(-2).sum()


def _reshard(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    moved = x.redistribute(placements=[Replicate()] * x.device_mesh.ndim)  # type: ignore[attr-defined]
    return (moved * w.sum()).pow(2).sum()


def _to_local(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.to_local() * 2.0 + 1.0).pow(2).sum()  # type: ignore[attr-defined]


FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mlp": _mlp_loss,
    "norm-softmax": _norm_softmax,
    "reshard": _reshard,
    "to-local": _to_local,
}


def _run(
    fn: Callable[..., torch.Tensor], x: ShardTensor, w: torch.Tensor
) -> tuple[torch.Tensor, ShardTensor]:
    leaf = x.detach().requires_grad_()
    loss = fn(leaf, w)
    (loss.full_tensor() if isinstance(loss, ShardTensor) else loss).backward()
    value = loss.full_tensor() if isinstance(loss, ShardTensor) else loss
    assert isinstance(leaf.grad, ShardTensor)
    return value.detach(), leaf.grad


@pytest.mark.world(4)
@pytest.mark.parametrize("layout_id", ["1d-even", "1d-uneven", "2d-empty"])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_aot_eager_matches_eager(distributed_mesh, distributed_mesh_2d, layout_id, name) -> None:
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    x = layout.shard(layout.full(4, 3))
    w = global_tensor((3, 3), torch.float32, layout.mesh.device_type)
    fn = FUNCTIONS[name]
    eager_value, eager_grad = _run(fn, x, w)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)
    for _ in range(2):  # the second call runs the cached graph
        value, grad = _run(compiled, x, w)
        torch.testing.assert_close(value, eager_value)
        assert grad.spec == x.spec
        torch.testing.assert_close(grad.to_local(), eager_grad.to_local())


# Inductor compiles C++ (half a minute from a cold cache on 2 cores): the slow tier (aot_eager: the fast one).
@pytest.mark.slow
@pytest.mark.world(4)
@pytest.mark.parametrize("layout_id", ["1d-uneven", "2d-empty"])
def test_inductor_matches_eager(distributed_mesh, distributed_mesh_2d, layout_id) -> None:
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    x = layout.shard(layout.full(4, 3))
    w = global_tensor((3, 3), torch.float32, layout.mesh.device_type)
    eager_value, eager_grad = _run(_mlp_loss, x, w)
    compiled = torch.compile(_mlp_loss, backend="inductor", fullgraph=True, dynamic=False)
    value, grad = _run(compiled, x, w)
    torch.testing.assert_close(value, eager_value, rtol=1e-4, atol=1e-5)
    assert grad.spec == x.spec
    torch.testing.assert_close(grad.to_local(), eager_grad.to_local(), rtol=1e-4, atol=1e-5)


@pytest.mark.world(4)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_compiled_function_returns_shard_tensors(distributed_mesh, backend) -> None:
    layout = Layout("1d-empty", distributed_mesh, None)
    full = layout.full(4, 3)
    x = layout.shard(full).detach().requires_grad_()

    def step(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(t) * 3.0, t.sum(0)

    y, total = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)(x)
    assert isinstance(y, ShardTensor) and y.spec == x.spec
    assert isinstance(total, ShardTensor) and total.placements == (Partial("sum"),)
    torch.testing.assert_close(y.full_tensor(), torch.tanh(full) * 3.0)
    torch.testing.assert_close(total.full_tensor(), full.sum(0))
    (y.full_tensor().sum() + total.full_tensor().sum()).backward()
    reference = full.clone().requires_grad_()
    ((torch.tanh(reference) * 3.0).sum() + reference.sum(0).sum()).backward()
    assert x.grad.spec == x.spec
    torch.testing.assert_close(x.grad.full_tensor(), reference.grad)


@pytest.mark.world(4)
def test_a_replicated_weight_gets_its_pending_gradient_through_a_compiled_graph(distributed_mesh) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    full = layout.full(3)
    x = layout.shard(full)
    weight_full = torch.linspace(-1.0, 1.0, 3, device=layout.mesh.device_type)

    def scale(w: torch.Tensor) -> torch.Tensor:
        return torch.sin(w) * 2.0

    compiled = torch.compile(scale, backend="aot_eager", fullgraph=True, dynamic=False)
    local = weight_full.clone().requires_grad_()
    weight = ShardTensor.from_local(local, distributed_mesh, [Replicate()])
    seen: list[object] = []
    produced = compiled(weight)
    produced.register_hook(lambda g: seen.append(g.placements))
    (x * produced).full_tensor().sum().backward()
    reference = weight_full.clone().requires_grad_()
    (full * scale(reference)).sum().backward()
    assert seen == [(Partial("sum"),)]  # the product with sharded rows leaves a pending sum
    torch.testing.assert_close(local.grad, reference.grad)  # reduced at from_local


@pytest.mark.world(4)
def test_compiling_unbind_and_view_keeps_the_graph_whole(distributed_mesh) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    full = layout.full(3, 4)
    x = layout.shard(full).detach().requires_grad_()

    def f(t: torch.Tensor) -> torch.Tensor:
        a, b, c = torch.unbind(t, 1)
        return (a * 2 + b * b + c).view(-1).sum()

    loss = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=False)(x)
    loss.full_tensor().backward()
    reference = full.clone().requires_grad_()
    f(reference).backward()
    torch.testing.assert_close(loss.full_tensor(), f(full))
    torch.testing.assert_close(x.grad.full_tensor(), reference.grad)


@pytest.mark.world(4)
def test_flatten_unflatten_and_tangent_coercion(distributed_mesh) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    x = layout.shard(layout.full(3))
    names, context = x.__tensor_flatten__()
    rebuilt = ShardTensor.__tensor_unflatten__(
        {"_local_tensor": x._local_tensor}, context, x.shape, x.stride()
    )
    assert names == ["_local_tensor"] and rebuilt.spec == x.spec
    # a runtime tangent in another layout moves to the recorded one, uneven sizes included
    replicated_x = x.redistribute(placements=[Replicate()])
    coerced = replicated_x.__coerce_same_metadata_as_tangent__(context)
    assert coerced.spec == x.spec
    torch.testing.assert_close(coerced.to_local(), x.to_local())
    pending = x.sum(0)
    resolved = pending.__coerce_tangent_metadata__()
    assert resolved.placements == (Replicate(),)
    with pytest.raises(RuntimeError, match="recorded a Partial tangent target"):
        x.__coerce_same_metadata_as_tangent__(pending.__tensor_flatten__()[1])
    assert x.__coerce_same_metadata_as_tangent__(context, expected_type=torch.Tensor) is None
    whole = replicated(layout.full(3), distributed_mesh)
    local = whole.__coerce_same_metadata_as_tangent__(
        whole.__tensor_flatten__()[1], expected_type=torch.Tensor
    )
    assert type(local) is torch.Tensor
    assert Shard(0) in x.placements
