"""GPU code on simulated ranks without a GPU: ``meshsim.run(..., cuda="cpu")`` and ``--mesh-cuda=cpu``."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import meshsim

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="these tests pin what the emulation does where CUDA is absent"
)


def _run(fn, world_size=2, **kwargs):
    return meshsim.run(fn, world_size, cuda="cpu", **kwargs)


def test_each_rank_sees_a_cuda_machine_with_its_own_current_device():
    def body():
        rank = dist.get_rank()
        before = torch.cuda.current_device()  # a new process's: 0
        torch.cuda.set_device(rank)
        with torch.cuda.device(0):
            inside = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(rank)
        return (
            torch.cuda.is_available(),
            torch.cuda.device_count(),
            before,
            inside,
            torch.cuda.current_device(),
            props.total_memory > 0 and props.major == torch.cuda.get_device_capability()[0],
            torch.cuda.get_device_name() == props.name,
        )

    assert _run(body) == [(True, 8, 0, 0, 0, True, True), (True, 8, 0, 0, 1, True, True)]
    assert not torch.cuda.is_available()  # the caller's torch.cuda is back


def test_cuda_tensors_report_their_device_and_move_as_on_a_gpu():
    def body():
        rank = dist.get_rank()
        torch.cuda.set_device(rank)
        made = [
            torch.empty(2, device="cuda"),
            torch.zeros(2, device=f"cuda:{rank}"),
            torch.ones(2, device=torch.device("cuda", rank)),
            torch.tensor([1.0, 2.0], device="cuda"),
            torch.ones(2).cuda(),
            torch.ones(2).to("cuda", non_blocking=True),
            torch.ones(2).pin_memory().cuda(non_blocking=True),
        ]
        host = torch.ones(2)
        on_gpu = host.cuda()
        on_gpu.add_(1)  # a copy: the host tensor keeps its values
        back = on_gpu.cpu()
        return (
            [str(t.device) for t in made],
            all(t.is_cuda and t.get_device() == rank for t in made),
            (host.tolist(), str(back.device), back.is_cuda, back.tolist()),
            (
                torch.ones(2).pin_memory().is_pinned(),
                torch.ones(2).is_pinned(),
                torch.ones(2, pin_memory=True).is_pinned(),
            ),
            str((made[0] * 2 + made[1]).sum().device),
            on_gpu.to("cuda") is on_gpu,  # already there: itself, as torch does
        )

    results = _run(body)
    for rank, (devices, all_cuda, moved, pinned, computed, same) in enumerate(results):
        assert devices == [f"cuda:{rank}"] * 7
        assert all_cuda
        assert moved == ([1.0, 1.0], "cpu", False, [2.0, 2.0])
        assert pinned == (True, False, True)
        assert computed == f"cuda:{rank}"
        assert same


def test_code_comparing_devices_behaves_as_on_a_gpu_machine():
    def body():
        torch.cuda.set_device(dist.get_rank())
        model = torch.nn.Linear(3, 2).cuda()
        x = torch.randn(4, 3, device="cuda")
        out = model(x)
        expected = torch.nn.functional.linear(x.cpu(), model.weight.cpu(), model.bias.cpu())
        torch.testing.assert_close(out.cpu(), expected)  # checks devices too
        model.extra = torch.nn.Parameter(torch.ones(1, device="cuda"))  # a parameter made from a cuda tensor
        return (
            model.extra.device == x.device and torch.ones(1, device="cuda").as_subclass(torch.Tensor).is_cuda,
            next(model.parameters()).device == x.device,
            out.device.type,
            model.weight.data.device.type,
            repr(out).endswith(f"device='cuda:{dist.get_rank()}', grad_fn=<AddmmBackward0>)"),
        )

    assert _run(body) == [(True, True, "cuda", "cuda", True)] * 2


def test_the_cuda_rng_is_per_rank_and_per_device_and_apart_from_the_cpu_rng():
    def body():
        rank = dist.get_rank()
        torch.cuda.manual_seed(rank)
        first = torch.randn(3, device="cuda")
        state = torch.cuda.get_rng_state()
        second = torch.randn(3, device="cuda")
        torch.cuda.set_rng_state(state)
        again = torch.randn(3, device="cuda")
        torch.manual_seed(7)
        cpu_before = torch.randn(2)
        torch.manual_seed(7)
        torch.randn(5, device="cuda")  # draws from the CUDA generator, not the CPU's
        cpu_after = torch.randn(2)
        user = torch.Generator(device="cuda").manual_seed(5)
        generator_type = torch.Generator
        own = (
            str(user.device),
            isinstance(torch.default_generator, generator_type),
            isinstance(user, generator_type),
        )
        drawn = torch.randn(3, device="cuda", generator=user)
        user.manual_seed(5)
        assert torch.equal(drawn, torch.randn(3, device="cuda", generator=user))
        assert own == ("cuda:0", True, True)
        with torch.random.fork_rng(devices=[0]):
            torch.randn(4, device="cuda")
        forked_back = torch.cuda.get_rng_state(0)
        cpu_kept = torch.equal(cpu_before, cpu_after)
        return first, second, again, cpu_kept, state.dtype, state.numel(), forked_back

    (f0, s0, a0, cpu0, dtype, numel, _), (f1, _, _, cpu1, _, _, _) = _run(body)
    assert torch.equal(s0, a0) and not torch.equal(f0, s0)
    assert not torch.equal(f0, f1)  # ranks seeded apart draw apart
    assert cpu0 and cpu1
    assert (dtype, numel) == (torch.uint8, 16)  # CUDA's layout: seed and offset


def test_a_bare_gpu_ordinal_names_that_gpu_as_on_a_cuda_build():
    """device=torch.cuda.current_device() (Megatron writes it over a hundred times): the CPU build
    refuses an int device while parsing, before any mode sees it; under emulation it is cuda:k."""

    def body():
        rank = dist.get_rank()
        torch.cuda.set_device(rank)
        here = torch.cuda.current_device()
        base = torch.ones(2, device="cuda")
        made = [
            torch.empty(3, device=here),
            torch.zeros(2, 2, device=here),
            torch.arange(4, device=here),
            torch.full((2,), 1.5, device=here),
            torch.randn(3, device=here),
            torch.empty_like(base, device=here),
            torch.tensor([1.0], device=here),
            base.new_zeros(3, device=here),
            base.new_empty((2,), device=here),
            torch.ones(2).to(here),
            torch.ones(2).to(device=here),
            torch.nn.Linear(2, 2).to(here).weight,
            torch.zeros(1, device=0),
        ]
        return [str(tensor.device) for tensor in made]

    assert _run(body) == [["cuda:0"] * 13, ["cuda:1"] * 12 + ["cuda:0"]]
    with pytest.raises(RuntimeError):  # outside a world, torch's own answer on this machine
        torch.empty(1, device=0)


def test_graph_safe_rng_states_are_shared_or_cloned_as_cuda_s_are():
    """Megatron's RNG tracker with CUDA graphs: graphsafe_get_state() shares the generator's state,
    clone_state() copies it, graphsafe_set_state() swaps it in, and a graph accepts a generator."""

    def body():
        generator = torch.cuda.default_generators[0]
        generator.manual_seed(11)
        shared, copied = generator.graphsafe_get_state(), generator.clone_state()
        torch.rand(8, device="cuda")
        offset = generator.get_offset()
        moved = (offset > 0, shared.get_offset() == offset, copied.get_offset())
        generator.graphsafe_set_state(copied)
        from_copy = torch.rand(8, device="cuda")
        generator.graphsafe_set_state(shared)
        after_swap_back = generator.get_offset() == shared.get_offset()
        fresh = torch.cuda.default_generators[0].clone_state()
        fresh.manual_seed(11)
        generator.graphsafe_set_state(fresh)
        again = torch.rand(8, device="cuda")
        torch.cuda.CUDAGraph().register_generator_state(shared)
        with pytest.raises(TypeError, match="takes a CUDA generator"):
            torch.cuda.CUDAGraph().register_generator_state(torch.Generator())
        with pytest.raises(TypeError, match="graphsafe_set_state takes a CUDA generator"):
            generator.graphsafe_set_state("state")
        return moved, after_swap_back, torch.equal(from_copy, again)

    assert _run(body) == [((True, True, 0), True, True)] * 2


@pytest.mark.parametrize("backend", ["sim", "gloo"])
def test_gather_and_scatter_into_tensors_match_by_element_count_as_on_nccl(backend):
    """Megatron's gather_split_1d_tensor gathers a (2, 4) shard into a flat buffer: NCCL matches by
    element count; gloo, serving the job's "nccl" groups under emulation, checks shapes."""

    def body():
        rank = dist.get_rank()
        shard = torch.full((2, 4), float(rank), device="cuda")
        flat = torch.empty(16, device="cuda")
        dist.all_gather_into_tensor(flat, shard)
        halves = torch.empty(2, 2, device="cuda")
        dist.reduce_scatter_tensor(halves, torch.arange(8.0, device="cuda"))
        return flat.tolist(), halves.tolist(), str(flat.device)

    expected = [0.0] * 8 + [1.0] * 8
    assert _run(body, backend=backend) == [
        (expected, [[0.0, 2.0], [4.0, 6.0]], "cuda:0"),
        (expected, [[8.0, 10.0], [12.0, 14.0]], "cuda:0"),
    ]


def test_torch_cuda_submodules_reach_the_emulation_as_torch_cuda_does():
    """torch.cuda.random.get_rng_state (which Megatron's RNG tracker calls) asks its own module's
    current_device: every torch.cuda submodule's binding of a replaced name is replaced too."""
    import torch.cuda.random as cuda_random

    real = cuda_random.current_device

    def body():
        torch.cuda.set_device(dist.get_rank())
        torch.cuda.manual_seed(3)
        state = cuda_random.get_rng_state()
        cuda_random.set_rng_state(state)
        return cuda_random.current_device(), state.dtype, torch.equal(state, torch.cuda.get_rng_state())

    assert _run(body) == [(0, torch.uint8, True), (1, torch.uint8, True)]
    assert cuda_random.current_device is real  # put back with the world


def test_streams_events_synchronize_and_memory_statistics():
    def body():
        rank = dist.get_rank()
        torch.cuda.set_device(rank)
        stream = torch.cuda.Stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before = torch.cuda.memory_allocated()
        start.record()
        with torch.cuda.stream(stream):
            inside = torch.cuda.current_stream() is stream
            x = torch.ones(1024 * (rank + 1), device="cuda")
        end.record(stream)
        torch.cuda.current_stream().wait_stream(stream)
        x.record_stream(torch.cuda.current_stream())
        end.synchronize()
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - before
        peak = torch.cuda.max_memory_allocated()
        del x
        left = torch.cuda.memory_allocated() - before
        restored = torch.cuda.current_stream() is not stream
        return inside, restored, start.elapsed_time(end) >= 0, grown, peak, left

    assert _run(body) == [(True, True, True, 4096, 4096, 0), (True, True, True, 8192, 8192, 0)]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


def _reference_losses(world_size):
    """The same data-parallel training, in one process on the CPU: every rank's batch, averaged gradients."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = {rank: [] for rank in range(world_size)}
    for _ in range(3):
        opt.zero_grad()
        grads = None
        for rank in range(world_size):
            x, y = _batch(rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            losses[rank].append(loss.item())
            step = torch.autograd.grad(loss, list(model.parameters()))
            grads = step if grads is None else [a + b for a, b in zip(grads, step)]
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad / world_size
        opt.step()
    return [losses[rank] for rank in range(world_size)]


def test_ddp_with_device_ids_trains_as_on_the_cpu():
    def body():
        rank = dist.get_rank()
        dist.init_process_group("nccl")
        torch.cuda.set_device(rank)
        model = _model().cuda()
        ddp = DistributedDataParallel(model, device_ids=[rank])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x, y = (t.cuda(non_blocking=True) for t in _batch(rank))
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, model[0].weight.grad.device

    results = _run(body)
    reference = _reference_losses(2)
    for rank, (losses, grad_device) in enumerate(results):
        assert losses == pytest.approx(reference[rank], rel=1e-5)
        assert grad_device == torch.device("cuda", rank)


def test_fsdp2_on_a_cuda_mesh_trains_as_on_the_cpu():
    def body():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        rank = dist.get_rank()
        torch.cuda.set_device(rank)
        mesh = init_device_mesh("cuda", (2,))
        model = _model().cuda()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = (t.cuda() for t in _batch(rank))
        losses = []
        with meshsim.record() as ledger:
            for _ in range(3):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return losses, mesh.device_type, model[0].weight.device, ledger.counts()

    results = _run(body)
    reference = _reference_losses(2)
    for rank, (losses, device_type, weight_device, counts) in enumerate(results):
        assert losses == pytest.approx(reference[rank], rel=1e-5)
        assert (device_type, weight_device) == ("cuda", torch.device("cuda", rank))
        assert counts == {"all_gather": 3 * 4, "reduce_scatter": 3 * 2}, counts


@pytest.mark.slow  # three Inductor compiles
def test_torch_compile_of_a_function_taking_cuda_tensors():
    def body():
        from torch._dynamo.testing import CompileCounter

        torch._dynamo.reset()
        counter = CompileCounter()

        @torch.compile(backend=counter)
        def f(x):
            return (x * 2).sin() + 1

        x = torch.ones(4, device="cuda")
        y = f(x)
        z = torch.compile(lambda t: t.cos() * 3)(x)  # Inductor
        leaf = torch.ones(4, device="cuda", requires_grad=True)
        torch.compile(lambda t: (t * t).sum())(leaf).backward()  # Inductor's backward makes the gradient
        (grad,) = torch.autograd.grad(torch.compile(lambda t: (t * 3).sum())(leaf), [leaf])
        return (
            counter.frame_count,
            y.device.type,
            torch.allclose(y.cpu(), (torch.ones(4) * 2).sin() + 1),
            z.device.type,
            (str(leaf.grad.device), leaf.grad.tolist(), str(grad.device)),
        )

    assert _run(body, 1) == [(1, "cuda", True, "cuda", ("cuda:0", [2.0] * 4, "cuda:0"))]


class _Moving(torch.Tensor):
    """A subclass whose __torch_function__ moves plain tensors to the mesh's device, as ShardTensor's does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        moved = [a.to("cuda") if type(a) is torch.Tensor and not a.is_cuda else a for a in args]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*moved, **(kwargs or {}))


def test_a_subclass_handler_moving_tensors_to_cuda():
    def body():
        x = torch.ones(3, device="cuda").as_subclass(_Moving)
        out = x + torch.ones(3)  # the plain operand is on the CPU until the handler moves it
        return out.device.type, out.tolist()

    assert _run(body, 1) == [("cuda", [2.0, 2.0, 2.0])]


class _MakesCudaInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        extra = torch.ones(grad.shape, device="cuda")  # made inside autograd's engine
        return grad * 2 + extra


def test_a_backward_that_creates_cuda_tensors():
    def body():
        x = torch.ones(3, device="cuda", requires_grad=True)
        _MakesCudaInBackward.apply(x).sum().backward()
        (g,) = torch.autograd.grad((x * x).sum(), [x])
        return x.grad.device.type, x.grad.tolist(), g.device.type

    assert _run(body, 1) == [("cuda", [3.0, 3.0, 3.0], "cuda")]


def test_nccl_without_a_gpu_fails_naming_the_emulation():
    def body():
        dist.init_process_group("nccl")

    with pytest.raises(meshsim.RankError) as info:
        meshsim.run(body, 2)
    assert "--mesh-cuda=cpu" in str(info.value.__cause__)


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "cuda:0", "tpu:0"])
def test_bad_or_unavailable_cuda_values_are_refused_before_ranks_start(value):
    with pytest.raises(ValueError, match="cuda"):
        meshsim.run(lambda: None, 2, cuda=value)


def test_a_world_leaves_torch_as_it_found_it():
    device_descriptor = torch.Tensor.device
    to = torch.Tensor.to
    _run(lambda: torch.ones(1, device="cuda").sum().item())
    assert torch.Tensor.device is device_descriptor and torch.Tensor.to is to
    assert not torch.cuda.is_available()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.empty(1, device="cuda")


def test_a_device_ordinal_past_the_emulated_gpus_fails_as_cuda_does(monkeypatch):
    monkeypatch.setenv("MESHSIM_CUDA_DEVICES", "2")

    def body():
        seen = torch.cuda.device_count()
        for make in (lambda: torch.empty(1, device="cuda:2"), lambda: torch.cuda.set_device(5)):
            with pytest.raises(RuntimeError, match="invalid device ordinal"):
                make()
        return seen, str(torch.ones(1, device="cuda:1").device)

    assert _run(body) == [(2, "cuda:1")] * 2


def test_each_world_sees_the_gpus_of_its_own_ranks_per_node():
    """Issue 38: the GPU count follows the world that runs, not the first world of the process."""

    def body():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        return torch.cuda.device_count(), str(torch.ones(1, device="cuda").device)

    assert _run(body, 2) == [(8, f"cuda:{r}") for r in range(2)]
    assert _run(body, 16) == [(16, f"cuda:{r}") for r in range(16)]
    # two nodes of 8 ranks: 8 GPUs each, as torchrun's LOCAL_RANK addresses them
    assert _run(body, 16, nnodes=2) == [(8, f"cuda:{r % 8}") for r in range(16)]


def test_a_thread_a_rank_starts_sees_its_world_s_gpus():
    """A thread no world entered (a DataLoader's pin-memory thread) answers with the newest emulation."""

    def body():
        seen = []
        thread = threading.Thread(target=lambda: seen.append(torch.cuda.device_count()))
        thread.start()
        thread.join(30)
        return seen

    assert _run(body, 12) == [[12]] * 12


def test_a_world_started_inside_an_emulating_world_is_sized_for_itself():
    """A world started from a rank emulates as its caller does, with its own GPU count (issue 38)."""

    def inner():
        torch.cuda.set_device(dist.get_rank())
        return torch.cuda.device_count()

    def outer():
        return torch.cuda.device_count(), meshsim.run(inner, 16)

    assert _run(outer, 2) == [(8, [16] * 16)] * 2


def test_the_environment_variable_turns_it_on_for_run(monkeypatch):
    monkeypatch.setenv("MESHSIM_CUDA", "cpu")
    assert meshsim.run(lambda: torch.cuda.is_available(), 2) == [True, True]
    monkeypatch.setenv("MESHSIM_CUDA", "off")
    assert meshsim.run(lambda: torch.cuda.is_available(), 2) == [False, False]


def _spawned_rank(rank, world_size, port):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import datetime

    dist.init_process_group(
        "nccl",
        rank=rank,
        world_size=world_size,
        device_id=torch.device("cuda", rank),
        timeout=datetime.timedelta(seconds=60),  # a lost peer fails the child, it does not hang it
    )
    try:
        torch.cuda.set_device(rank)
        x = torch.full((2,), float(rank), device="cuda")
        dist.all_reduce(x)
        if not (x.device == torch.device("cuda", rank) and x.tolist() == [1.0, 1.0]):
            raise AssertionError(f"rank {rank}: {x!r} on {x.device}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # mp.spawn: two fresh processes that import torch and join a gloo group
def test_processes_the_code_spawns_emulate_too():
    """torch.multiprocessing.spawn's children (PhysicsNeMo's dynamic tests) emulate; NCCL groups are gloo."""
    import socket

    import torch.multiprocessing as mp

    def body():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        children = mp.spawn(_spawned_rank, args=(2, port), nprocs=2, join=False)
        for _ in range(24):  # at most 120 s; join() raises if a child fails
            if children.join(timeout=5):
                return "joined"
        for process in children.processes:
            process.kill()
        raise AssertionError("the spawned children did not finish within 120 s")

    assert _run(body, 1, timeout=180) == ["joined"]


def _child_that_exits(folder, status):
    import atexit
    import sys

    atexit.register(lambda: (folder / "atexit").write_text("ran"))
    sys.stdout = open(folder / "stdout", "w", buffering=1 << 16)  # the exit flushes it
    print("written, not flushed")
    (folder / "cpus").write_text(repr(sorted(os.sched_getaffinity(0))))
    x = torch.ones(2, device="cuda")  # the child emulates
    sys.exit(status if x.is_cuda else 99)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs sched_getaffinity")
def test_a_spawned_child_ends_with_its_status_its_atexit_handlers_run_and_its_output_flushed(tmp_path):
    """A child spawned under emulation ends without finalizing the interpreter, and loses nothing.

    Started from a rank pinned to one CPU, it runs where the world's caller may, as a forked child does.
    """
    import multiprocessing

    caller = sorted(os.sched_getaffinity(0))

    def body():
        statuses = []
        for status in (0, 3):
            folder = tmp_path / str(status)
            folder.mkdir()
            spawn = multiprocessing.get_context("spawn")
            child = spawn.Process(target=_child_that_exits, args=(folder, status))
            child.start()
            child.join(timeout=60)
            if child.exitcode is None:
                child.kill()
            statuses.append(
                (
                    child.exitcode,
                    (folder / "atexit").read_text(),
                    (folder / "stdout").read_text(),
                    (folder / "cpus").read_text(),
                )
            )
        return statuses

    written = "written, not flushed\n"
    assert _run(body, 1, timeout=120) == [
        [(0, "ran", written, repr(caller)), (3, "ran", written, repr(caller))]
    ]


def test_cuda_only_attention_kernels_called_by_name_compute_on_the_cpu():
    """Ring attention (PhysicsNeMo's) calls CUDA's memory-efficient attention and its backward by name."""
    aten = torch.ops.aten

    def body():
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 3, 5, 8, device="cuda", requires_grad=True) for _ in range(3))
        bias = torch.randn(2, 3, 5, 5, device="cuda", requires_grad=True)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)
        grad = torch.randn_like(out)
        grads = aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, True]
        )
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        expected = torch.autograd.grad(reference, [q, k, v, bias], grad)
        close = [torch.allclose(a, b, atol=1e-5) for a, b in zip((out, *grads), (reference, *expected))]
        return close, out.device.type, grads[0].device.type

    assert _run(body, 1) == [([True] * 5, "cuda", "cuda")]


def test_dtensor_random_ops_on_a_cuda_mesh_use_the_offset_based_tracker():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def body():
        torch.cuda.set_device(dist.get_rank())
        mesh = init_device_mesh("cuda", (2,))
        torch.manual_seed(0)
        x = distribute_tensor(torch.empty(8, 4, device="cuda"), mesh, [Shard(0)])
        x.uniform_()  # each shard from its own offsets, as on GPUs
        full = x.full_tensor()
        offset = torch.cuda.get_rng_state()[8:].view(torch.int64).item()
        return full.device.type, bool((full[:4] != full[4:]).any()), offset

    assert _run(body) == [("cuda", True, 32)] * 2  # every rank's generator moves past the whole tensor
