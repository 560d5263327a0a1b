"""Pointwise operators: unary, binary, against plain tensors, scalars and Replicate ShardTensors.

Every case runs on 1-D and 2-D meshes with even, uneven and empty shards, in float32
and bfloat16, forward and backward, against the same computation on the whole
tensor in one process; no pointwise op issues a collective when its operands share
a layout.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import meshsim
from shardtensor import ShardTensor

from .op_cases import LAYOUTS, Layout, assert_layout_is_true, close, distribute, replicated
from .shardtensor_cases import DTYPE_IDS, DTYPES

UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg": torch.neg,
    "exp": torch.exp,
    "relu": torch.relu,
    "gelu": F.gelu,
    "tanh": torch.tanh,
    "square": lambda x: x**2,
    "clamp": lambda x: x.clamp(-0.5, 0.5),
    "to-float64": lambda x: x.to(torch.float64),
}


@pytest.mark.world(4)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout_id", LAYOUTS)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary(distributed_mesh, distributed_mesh_2d, layout_id, dtype, name) -> None:
    op = UNARY[name]
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    full = layout.full(3, dtype=dtype)
    weights = layout.full(3, dtype=dtype, offset=1.0).to(op(full).dtype)
    x = layout.shard(full).detach().requires_grad_()
    with meshsim.record() as ledger:
        y = op(x)
    assert ledger.counts() == {}
    assert isinstance(y, ShardTensor)
    assert y.placements == x.placements and y.spec.shard_sizes == x.spec.shard_sizes
    close(y.full_tensor(), op(full), dtype)

    (y.full_tensor() * weights).sum().backward()
    reference = full.clone().requires_grad_()
    (op(reference) * weights).sum().backward()
    assert x.grad is not None and x.grad.spec == x.spec
    close(x.grad.full_tensor(), reference.grad, dtype)


def _same_layout(layout: Layout, full: torch.Tensor) -> torch.Tensor:
    return layout.shard(full)


def _chunk_layout(layout: Layout, full: torch.Tensor) -> torch.Tensor:
    """The same placements with torch.chunk's sizes: realigned to the other operand's."""
    from shardtensor import chunk_sizes

    sizes = {m: chunk_sizes(full.shape[m], layout.mesh.size(m)) for m in range(layout.mesh.ndim)}
    return distribute(full, layout.mesh, layout.placements, sizes)


# name: (make the second operand from its global value, its global shape's trailing dims, op)
BINARY: dict[str, tuple[Callable[..., object], tuple[int, ...] | None, Callable[..., torch.Tensor]]] = {
    "add-same-layout": (_same_layout, None, torch.add),
    "mul-chunk-layout": (_chunk_layout, None, torch.mul),
    "sub-plain-broadcast": (lambda layout, full: full, (3,), torch.sub),
    "div-replicate-broadcast": (lambda layout, full: replicated(full, layout.mesh), (3,), torch.div),
    "mul-scalar": (lambda layout, full: 2.5, (), torch.mul),
    "pow-0dim-tensor": (lambda layout, full: full, (), torch.pow),
    "where": (_same_layout, None, lambda x, y: torch.where(x > 0, x, y)),
    "maximum": (_same_layout, None, torch.maximum),
}


@pytest.mark.world(4)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout_id", LAYOUTS)
@pytest.mark.parametrize("name", list(BINARY))
def test_binary(distributed_mesh, distributed_mesh_2d, layout_id, dtype, name) -> None:
    make_other, other_shape, op = BINARY[name]
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    full = layout.full(3, dtype=dtype).abs() + 0.5
    if other_shape is None:
        full_other = layout.full(3, dtype=dtype, offset=2.0)
    else:
        count = 3 if other_shape else 1
        full_other = torch.linspace(0.5, 1.5, count, dtype=dtype, device=full.device).reshape(other_shape)
    x = layout.shard(full).detach().requires_grad_()
    other = make_other(layout, full_other)
    if isinstance(other, ShardTensor):
        other = other.detach().requires_grad_()
    y = op(x, other)
    assert isinstance(y, ShardTensor)
    assert y.placements == x.placements and y.spec.shard_sizes == x.spec.shard_sizes
    assert_layout_is_true(y)
    expected = op(full, full_other if isinstance(other, torch.Tensor) else other)
    close(y.full_tensor(), expected, dtype)

    weights = layout.full(3, dtype=dtype, offset=1.0)
    (y.full_tensor() * weights).sum().backward()
    ref_x = full.clone().requires_grad_()
    ref_other = full_other.clone().requires_grad_() if isinstance(other, ShardTensor) else full_other
    (op(ref_x, ref_other if isinstance(other, torch.Tensor) else other) * weights).sum().backward()
    assert x.grad is not None and x.grad.spec == x.spec
    close(x.grad.full_tensor(), ref_x.grad, dtype)
    if isinstance(other, ShardTensor):
        assert other.grad is not None
        close(other.grad.full_tensor(), ref_other.grad, dtype)


@pytest.mark.world(4)
@pytest.mark.parametrize("layout_id", ["1d-uneven", "2d-empty"])
def test_operands_in_one_layout_need_no_collective(distributed_mesh, distributed_mesh_2d, layout_id) -> None:
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    x, y = layout.shard(layout.full(3)), layout.shard(layout.full(3, offset=1.0))
    weight = replicated(torch.ones(3, device=layout.mesh.device_type), layout.mesh)
    with meshsim.record() as ledger:
        z = torch.tanh(x * y + 1.0) / weight - x.exp()
    assert ledger.counts() == {}
    assert z.spec == x.spec


@pytest.mark.world(4)
def test_a_chunk_layout_operand_is_realigned_to_the_uneven_one(distributed_mesh) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    full = layout.full(3)
    x = layout.shard(full)
    y = _chunk_layout(layout, full)
    assert y.spec.shard_sizes != x.spec.shard_sizes
    with meshsim.record() as ledger:
        z = x + y
    # DTensor would see two Shard(0) operands as aligned; here y is realigned (one
    # gather, then each rank slices its rows), and the result keeps x's sizes.
    assert ledger.counts() == {"all_gather": 1}
    assert z.spec == x.spec
    torch.testing.assert_close(z.to_local(), 2 * x.to_local())


@pytest.mark.world(4)
def test_in_place_ops_keep_the_tensor_and_its_layout(distributed_mesh) -> None:
    layout = Layout("1d-empty", distributed_mesh, None)
    full = layout.full(3)
    x = layout.shard(full.clone())
    spec = x.spec
    with meshsim.record() as ledger:
        same = x.mul_(2.0)
        x.add_(layout.shard(full))
        x.clamp_(max=1.0)
    assert same is x and x.spec == spec and ledger.counts() == {}
    torch.testing.assert_close(x.full_tensor(), (3 * full).clamp(max=1.0))


@pytest.mark.world(2)
def test_an_in_place_op_that_would_change_the_layout_is_refused(distributed_mesh) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    pending = layout.shard(layout.full(3)).sum(0)  # Partial: exp of a pending sum needs the sum first
    with pytest.raises(RuntimeError, match=r"aten.exp_.default: .*in-place"):
        pending.exp_()


@pytest.mark.world(2)
def test_python_scalars_promote_by_their_own_type(distributed_mesh) -> None:
    # 2 == 2.0 and True == 1: one op with each in turn must still promote by type
    from torch.distributed.tensor import Shard

    full = torch.arange(8, device=distributed_mesh.device_type)
    x = ShardTensor.from_local(
        torch.chunk(full, 2)[distributed_mesh.get_local_rank()],
        distributed_mesh,
        [Shard(0)],
        "chunk",
        full.shape,
    )
    for scalar in (2, 2.0, True, 1, 0.5):
        y = x * scalar
        expected = full * scalar
        assert y.dtype == y.to_local().dtype == expected.dtype, scalar
        torch.testing.assert_close(y.full_tensor(), expected)


@pytest.mark.world(4)
@pytest.mark.parametrize("layout_id", LAYOUTS)
def test_casts_to_each_dtype_in_turn_on_one_layout(distributed_mesh, distributed_mesh_2d, layout_id) -> None:
    """One rank casting one layout to several dtypes in a row gets each dtype (one thread's
    DTensor propagation cache once answered the second cast with the first's dtype)."""
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    full = layout.full(3, dtype=torch.float64)
    x = layout.shard(full)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float32):
        y = x.to(dtype)
        assert y.dtype == dtype and y.to_local().dtype == dtype
        assert y.spec.shard_sizes == x.spec.shard_sizes
        torch.testing.assert_close(y.full_tensor(), full.to(dtype))
