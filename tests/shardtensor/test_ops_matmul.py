"""matmul, linear, bmm, softmax and layer_norm on sharded activations.

The activations are ``(*sharded, 4, 3)`` as in the other op tests; weights are plain
tensors (promoted to ``Replicate``) or Replicate ShardTensors. A contraction over a
sharded dim leaves a pending ``Partial`` sum: one all_reduce resolves it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import meshsim
from shardtensor import ShardTensor

from .op_cases import LAYOUTS, Layout, assert_layout_is_true, close, distribute, replicated
from .shardtensor_cases import DTYPE_IDS, DTYPES, global_tensor

# name: op(activation, weight, bias); weights are (5, 3) or (3, 5), biases (5,) or (3,)
NN_OPS: dict[str, tuple[tuple[int, ...], tuple[int, ...], Callable[..., torch.Tensor]]] = {
    "matmul": ((3, 5), (5,), lambda x, w, b: x @ w),
    "linear": ((5, 3), (5,), lambda x, w, b: F.linear(x, w, b)),
    "linear-no-bias-relu": ((5, 3), (5,), lambda x, w, b: torch.relu(F.linear(x, w))),
    "softmax-last": ((3,), (3,), lambda x, w, b: F.softmax(x * w, dim=-1)),
    "log-softmax-last": ((3,), (3,), lambda x, w, b: F.log_softmax(x, dim=-1) + b),
    "layer-norm-last": ((3,), (3,), lambda x, w, b: F.layer_norm(x, (3,), w, b)),
    "layer-norm-last-two": ((4, 3), (4, 3), lambda x, w, b: F.layer_norm(x, (4, 3), w, b)),
}


KEEPS_2D = {"softmax-last", "log-softmax-last", "layer-norm-last", "layer-norm-last-two"}


@pytest.mark.world(4)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("weights", ["plain", "replicate"])
@pytest.mark.parametrize("layout_id", LAYOUTS)
@pytest.mark.parametrize("name", list(NN_OPS))
def test_nn_op(distributed_mesh, distributed_mesh_2d, layout_id, weights, dtype, name) -> None:
    weight_shape, bias_shape, op = NN_OPS[name]
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    device = layout.mesh.device_type
    full = layout.full(4, 3, dtype=dtype)
    full_w = global_tensor(weight_shape, dtype, device) + 1.0
    full_b = global_tensor(bias_shape, dtype, device)
    x = layout.shard(full).detach().requires_grad_()
    if weights == "plain":
        w, b = full_w.clone().requires_grad_(), full_b.clone().requires_grad_()
    else:
        w = replicated(full_w, layout.mesh).detach().requires_grad_()
        b = replicated(full_b, layout.mesh).detach().requires_grad_()
    with meshsim.record() as ledger:
        y = op(x, w, b)
    assert isinstance(y, ShardTensor)
    assert_layout_is_true(y)
    if layout.mesh.ndim == 1 or name in KEEPS_2D:
        assert ledger.counts() == {}
        assert y.placements == x.placements and y.spec.shard_sizes == x.spec.shard_sizes
    else:
        # torch folds the batch dims into one before a product, and a fold of two
        # sharded dims is not a per-rank layout: the second mesh dim is gathered.
        assert ledger.counts() == {"all_gather": 1}
        assert y.placements == (Shard(0), Replicate())
    ref_x, ref_w, ref_b = (t.clone().requires_grad_() for t in (full, full_w, full_b))
    expected = op(ref_x, ref_w, ref_b)
    close(y.full_tensor(), expected, dtype)

    probe = torch.linspace(0.5, 1.5, expected.numel(), device=device).reshape(expected.shape).to(dtype)
    (y.full_tensor() * probe).sum().backward()
    (expected * probe).sum().backward()
    assert x.grad.spec == x.spec
    close(x.grad.full_tensor(), ref_x.grad, dtype)
    for param, reference in ((w, ref_w), (b, ref_b)):
        if reference.grad is None:
            continue
        # A plain weight gets a plain gradient, its pending sum reduced; a replicated
        # ShardTensor weight keeps the pending sum (DTensor's semantics).
        grad = param.grad
        if weights == "plain":
            assert type(grad) is torch.Tensor
        else:
            assert isinstance(grad, ShardTensor)
            grad = grad.full_tensor()
        close(grad, reference.grad, dtype)


@pytest.mark.world(4)
@pytest.mark.parametrize("kind", ["even", "uneven", "empty"])
def test_a_sharded_contraction_is_one_reduction(distributed_mesh, kind) -> None:
    mesh = distributed_mesh
    sizes = {0: Layout(f"1d-{kind}", mesh, None).sizes[0]}
    k = sum(sizes[0])
    a_full = global_tensor((6, k), torch.float32, mesh.device_type)
    b_full = global_tensor((k, 5), torch.float32, mesh.device_type)
    a = distribute(a_full, mesh, [Shard(1)], sizes)
    b = distribute(b_full, mesh, [Shard(0)], sizes)
    with meshsim.record() as ledger:
        product = a @ b
    assert ledger.counts() == {}
    assert product.placements == (Partial("sum"),)
    with meshsim.record() as ledger:
        whole = product.full_tensor()
    assert ledger.counts() == {"all_reduce": 1}
    torch.testing.assert_close(whole, a_full @ b_full)


@pytest.mark.world(4)
def test_a_sharded_contraction_on_a_2d_mesh(distributed_mesh_2d) -> None:
    mesh = distributed_mesh_2d
    layout = Layout("2d-uneven", None, mesh)
    a_full = global_tensor(layout.shape(), torch.float32, mesh.device_type)  # (M, K), both sharded
    b_full = global_tensor((layout.extent(1), 4), torch.float32, mesh.device_type)
    a = layout.shard(a_full)
    b = distribute(b_full, mesh, [Replicate(), Shard(0)], layout.sizes)
    product = a @ b
    assert product.placements == (Shard(0), Partial("sum"))
    assert product.spec.shard_sizes[0] == layout.sizes[0]
    torch.testing.assert_close(product.full_tensor(), a_full @ b_full)


@pytest.mark.world(4)
@pytest.mark.parametrize("layout_id", LAYOUTS)
def test_bmm(distributed_mesh, distributed_mesh_2d, layout_id) -> None:
    # The batch is sharded on mesh dim 0; on the 2-D mesh the rows of a are sharded on
    # mesh dim 1 too (b's contraction dim is not sharded: b is Replicate there).
    layout = Layout(layout_id, distributed_mesh, distributed_mesh_2d)
    rows = layout.extent(1) if layout.mesh.ndim == 2 else 4
    a_full = layout.full(3) if layout.mesh.ndim == 2 else layout.full(rows, 3)
    b_full = global_tensor((layout.extent(0), 3, 2), torch.float32, layout.mesh.device_type)
    a = layout.shard(a_full).detach().requires_grad_()
    b_placements = [Shard(0)] + [Replicate()] * (layout.mesh.ndim - 1)
    b = distribute(b_full, layout.mesh, b_placements, layout.sizes).detach().requires_grad_()
    with meshsim.record() as ledger:
        out = torch.bmm(a, b)
    assert ledger.counts() == {}
    assert out.placements == a.placements and out.spec.shard_sizes == a.spec.shard_sizes
    torch.testing.assert_close(out.full_tensor(), torch.bmm(a_full, b_full))
    out.sum().backward()
    ref_a, ref_b = a_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    torch.bmm(ref_a, ref_b).sum().backward()
    torch.testing.assert_close(a.grad.full_tensor(), ref_a.grad)
    torch.testing.assert_close(b.grad.full_tensor(), ref_b.grad)


@pytest.mark.world(4)
def test_softmax_over_the_sharded_dim_gathers_it(distributed_mesh) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    full = layout.full(3)
    with meshsim.record() as ledger:
        y = F.softmax(layout.shard(full), dim=0)
    assert ledger.counts() == {"all_gather": 1}
    torch.testing.assert_close(y.full_tensor(), F.softmax(full, dim=0))
