"""Plain tensors meeting ShardTensors (the promotion mode), registered handlers, grad_placements."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch.distributed.tensor import Partial, Shard

import meshsim
from shardtensor import ShardTensor, TensorPromotionMode

from .op_cases import Layout, replicated


@pytest.fixture
def restore_mode() -> Iterator[None]:
    previous = ShardTensor.get_promotion_mode()
    yield
    ShardTensor.set_promotion_mode(previous)


def test_the_default_mode_is_silent() -> None:
    assert ShardTensor.get_promotion_mode() is TensorPromotionMode.SILENT


@pytest.mark.parametrize("mode", list(TensorPromotionMode), ids=[m.value for m in TensorPromotionMode])
def test_set_takes_a_mode_or_its_value(restore_mode, mode) -> None:
    ShardTensor.set_promotion_mode(mode.value)
    assert ShardTensor.get_promotion_mode() is mode
    ShardTensor.set_promotion_mode(TensorPromotionMode.SILENT)
    ShardTensor.set_promotion_mode(mode)
    assert ShardTensor.get_promotion_mode() is mode


def test_an_unknown_mode_names_the_choices(restore_mode) -> None:
    with pytest.raises(ValueError, match=r"one of 'disabled', 'warn', 'silent', got 'loud'"):
        ShardTensor.set_promotion_mode("loud")


def test_the_context_restores_the_mode_even_on_error(restore_mode) -> None:
    ShardTensor.set_promotion_mode("warn")
    with pytest.raises(KeyError), ShardTensor.promotion_mode("disabled"):
        assert ShardTensor.get_promotion_mode() is TensorPromotionMode.DISABLED
        raise KeyError("boom")
    assert ShardTensor.get_promotion_mode() is TensorPromotionMode.WARN


# On sim: warnings.catch_warnings swaps process-wide state (Python before 3.14), so
# gloo thread ranks, which run at once, would record each other's warnings and could
# leave another rank's recorder installed (README: limits of gloo thread ranks). Simulated
# ranks run one at a time, each with its own warnings state.
@pytest.mark.world(4, backend="sim")
@pytest.mark.parametrize("mode", ["silent", "warn"])
def test_a_plain_weight_is_promoted(distributed_mesh, restore_mode, mode) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    full = layout.full(3)
    weight = torch.tensor([1.0, 2.0, 3.0], device=distributed_mesh.device_type)
    ShardTensor.set_promotion_mode(mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = layout.shard(full) * weight
    promoted = [w for w in caught if "auto-promoting a plain torch.Tensor (shape=(3,)" in str(w.message)]
    assert len(promoted) == (1 if mode == "warn" else 0)
    torch.testing.assert_close(out.full_tensor(), full * weight)


@pytest.mark.world(2)
def test_disabled_refuses_to_mix(distributed_mesh, restore_mode) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    x = layout.shard(layout.full(3))
    # set and put back in the rank: on spawn, restore_mode runs in the pytest process, and the
    # rank's kept process runs later tests
    with ShardTensor.promotion_mode("disabled"):
        with pytest.raises(
            RuntimeError, match=r"aten.mul.Tensor: got a plain torch.Tensor of shape \(3,\) mixed"
        ):
            x * torch.ones(3, device=distributed_mesh.device_type)
        assert (x * 2.0).placements == x.placements  # scalars are not tensors to promote
        assert (x * torch.tensor(2.0)).placements == x.placements  # nor are 0-dim tensors


@pytest.mark.world(4)
@pytest.mark.parametrize("shape", [(), (3,)], ids=["scalar-gate", "weight"])
def test_a_plain_leaf_gets_a_plain_reduced_gradient(distributed_mesh, shape) -> None:
    layout = Layout("1d-empty", distributed_mesh, None)
    full = layout.full(3)
    x = layout.shard(full)

    def loss(a: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        w = torch.sigmoid(gate)
        out = w * a + (1 - w) * a.exp()
        return out.full_tensor().mean() if isinstance(out, ShardTensor) else out.mean()

    gate = torch.full(shape, 0.3, device=distributed_mesh.device_type, requires_grad=True)
    with meshsim.record() as ledger:
        loss(x, gate).backward()
    reference = torch.full(shape, 0.3, device=distributed_mesh.device_type, requires_grad=True)
    loss(full, reference).backward()
    assert type(gate.grad) is torch.Tensor
    torch.testing.assert_close(gate.grad, reference.grad)
    assert ledger.count("all_reduce") >= 1  # each rank's contribution to the gradient is summed


# On sim: ShardTensor's handler registries are class attributes, one per process, so gloo
# thread ranks, which run at once, would register into and restore each other's (a rank's op
# reaching the other rank's handler, or none once the other restored the registry: README,
# limits of gloo thread ranks). Simulated ranks run one at a time, each with its own.
@pytest.mark.world(2, backend="sim")
def test_function_and_dispatch_handlers(distributed_mesh) -> None:
    seen: list[str] = []

    def on_mul(func, types, args, kwargs):  # type: ignore[no-untyped-def]
        seen.append(f"function {func.__name__} {[type(a).__name__ for a in args]}")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def on_neg(tensor):  # type: ignore[no-untyped-def]
        seen.append("dispatch neg")
        return ShardTensor(torch.zeros_like(tensor._local_tensor), tensor.spec)

    x = replicated(torch.ones(2, 3, device=distributed_mesh.device_type), distributed_mesh)
    saved = ShardTensor._function_registry.copy(), ShardTensor._dispatch_registry.copy()
    try:
        ShardTensor.register_function_handler(torch.mul, on_mul)
        ShardTensor.register_dispatch_handler(torch.ops.aten.neg.default, on_neg)
        product = torch.mul(x, torch.full((3,), 2.0, device=distributed_mesh.device_type))
        negated = -x
        plain = torch.mul(torch.ones(2), 3.0)
    finally:
        ShardTensor._function_registry, ShardTensor._dispatch_registry = saved
    # the plain weight reached the handler promoted; plain tensors alone never reach it
    assert seen == ["function mul ['ShardTensor', 'ShardTensor']", "dispatch neg"]
    assert torch.equal(product.full_tensor(), torch.full((2, 3), 2.0))
    assert torch.equal(negated.to_local(), torch.zeros(2, 3))
    assert torch.equal(plain, torch.full((2,), 3.0))
    with pytest.raises(TypeError, match="register_function_handler needs a callable handler, got 3"):
        ShardTensor.register_function_handler(torch.mul, 3)  # type: ignore[arg-type]


@pytest.mark.world(4)
def test_partial_grad_placements_declare_a_pending_sum(distributed_mesh, rank) -> None:
    value = replicated(torch.zeros(2, 3, device=distributed_mesh.device_type), distributed_mesh)
    value = value.detach().requires_grad_()
    (value.to_local(grad_placements=[Partial()]) * float(rank + 1)).sum().backward()
    assert value.grad.placements == (Partial("sum"),)
    assert torch.equal(value.grad.to_local(), torch.full((2, 3), float(rank + 1)))
    assert torch.equal(value.grad.full_tensor(), torch.full((2, 3), 10.0))


@pytest.mark.world(4)
def test_grad_placements_of_full_tensor_and_of_a_new_shard_layout(distributed_mesh, rank) -> None:
    layout = Layout("1d-uneven", distributed_mesh, None)
    full = layout.full(3)
    x = layout.shard(full).detach().requires_grad_()
    # every rank's gradient is the whole one: each declares it a share of a pending sum
    (x.full_tensor(grad_placements=[Partial()]) / 4).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), torch.ones_like(full))
    # a Shard grad placement the tensor does not have: the sizes come from the gradients'
    # shapes (one all_gather in backward), so each rank's gradient must be its shard, and
    # a replicated tensor's local gradients are whole
    y = replicated(full, distributed_mesh).detach().requires_grad_()
    with pytest.raises(ValueError, match=r"grad_placements \[Shard\(dim=0\)\]: .* \(10, 10, 10, 10\)"):
        y.to_local(grad_placements=[Shard(0)]).sum().backward()
    # the tensor's own placements: its sizes, no collective
    with meshsim.record() as ledger:
        x.grad = None
        x.to_local(grad_placements=[Shard(0)]).sum().backward()
    assert ledger.counts() == {}
    assert x.grad.spec == x.spec
