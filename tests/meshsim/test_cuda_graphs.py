"""CUDA graphs under CUDA emulation (issue 38): capture records, replay runs again, as eager code would."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import meshsim


def _run(fn, world_size=2):
    return meshsim.run(fn, world_size, cuda="cpu")


def test_a_graph_replayed_with_new_inputs_gives_the_eager_results():
    def body():
        torch.manual_seed(dist.get_rank())
        layer = torch.nn.Linear(4, 3).cuda()
        static_in = torch.zeros(2, 4, device="cuda")
        layer(static_in)  # warm-up, as frameworks do before a capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_in).relu() * 2 + static_in.sum()
        same = []
        for _ in range(3):
            x = torch.randn(2, 4, device="cuda")
            static_in.copy_(x)
            graph.replay()
            same.append(torch.equal(static_out, layer(x).relu() * 2 + x.sum()))
        return same, str(static_out.device)

    assert _run(body) == [([True] * 3, "cuda:0")] * 2


def test_in_place_updates_captured_in_a_graph_happen_at_every_replay_and_not_at_the_capture():
    def body():
        state = torch.zeros(3, device="cuda")
        step = torch.ones(3, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            state.add_(step)  # a capture launches nothing on CUDA: state stays 0 until a replay
            doubled = state * 2
        after_capture = state.tolist()
        for _ in range(3):
            graph.replay()
        return after_capture, state.tolist(), doubled.tolist()

    assert _run(body, 1) == [([0.0] * 3, [3.0] * 3, [6.0] * 3)]


def test_is_current_stream_capturing_answers_truthfully():
    def body():
        graph = torch.cuda.CUDAGraph()
        seen = [torch.cuda.is_current_stream_capturing()]
        with torch.cuda.graph(graph):
            seen.append(torch.cuda.is_current_stream_capturing())
            seen.append(torch.cuda.graphs.is_current_stream_capturing())
        seen.append(torch.cuda.is_current_stream_capturing())
        return seen

    assert _run(body, 1) == [[False, True, True, False]]


def test_make_graphed_callables_on_a_module_gives_eager_outputs_and_gradients():
    def body():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)).cuda()
        eager = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)).cuda()
        eager.load_state_dict(model.state_dict())
        sample = torch.randn(3, 4, device="cuda", requires_grad=True)
        graphed = torch.cuda.make_graphed_callables(model, (sample,))
        checks = []
        for _ in range(3):
            x = torch.randn(3, 4, device="cuda", requires_grad=True)
            x_eager = x.detach().clone().requires_grad_()
            y = graphed(x)
            y.square().sum().backward()
            y_eager = eager(x_eager)
            y_eager.square().sum().backward()
            grads = zip(model.parameters(), eager.parameters())
            checks.append(
                (
                    torch.allclose(y, y_eager),
                    torch.allclose(x.grad, x_eager.grad),
                    all(torch.allclose(p.grad, q.grad) for p, q in grads),
                    y.device == x.grad.device == torch.device("cuda", 0),
                )
            )
            model.zero_grad()
            eager.zero_grad()
        return checks

    assert _run(body, 1) == [[(True, True, True, True)] * 3]


@pytest.mark.parametrize("backend", ["sim", "gloo"])
def test_collectives_captured_in_a_graph_run_again_at_every_replay(backend):
    """As NCCL's, a captured collective runs at every replay; each run (the capture's too) is recorded.

    The capture's own run changes no value: ``t`` is as before it until the first replay.
    """

    def body():
        t = torch.ones(2, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with meshsim.record() as ledger:
            with torch.cuda.graph(graph):
                t.mul_(2)
                dist.all_reduce(t)
            after_capture = t.tolist()
            graph.replay()
            graph.replay()
        return after_capture, t.tolist(), ledger.counts()

    expected = ([1.0, 1.0], [16.0, 16.0], {"all_reduce": 3})
    assert meshsim.run(body, 2, cuda="cpu", backend=backend) == [expected] * 2


def test_functional_collectives_captured_in_a_graph_are_replayed():
    import torch.distributed._functional_collectives as funcol

    def body():
        x = torch.full((2,), float(dist.get_rank() + 1), device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = funcol.all_reduce(x, "sum", dist.group.WORLD) * 10
        x.fill_(5.0)
        graph.replay()
        return y.tolist()

    assert _run(body) == [[100.0, 100.0]] * 2


def test_misuse_of_a_graph_is_refused_with_what_to_do():
    def body():
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="holds no capture: capture it first"):
            graph.replay()
        with pytest.raises(RuntimeError, match="without capture_begin"):
            graph.capture_end()
        with torch.cuda.graph(graph):
            with pytest.raises(RuntimeError, match="capturing a graph already"):
                torch.cuda.CUDAGraph().capture_begin()
        with pytest.raises(RuntimeError, match="reset\\(\\) it first"):
            graph.capture_begin()
        graph.reset()
        with pytest.raises(RuntimeError, match="no cudaGraph_t"):
            graph.raw_cuda_graph()
        return "refused"

    assert _run(body, 1) == ["refused"]


def test_graphs_are_torch_s_own_again_after_the_world():
    real = torch.cuda.CUDAGraph
    _run(lambda: torch.cuda.CUDAGraph().pool(), 1)
    assert torch.cuda.CUDAGraph is real and torch.cuda.graphs.CUDAGraph is real


@pytest.mark.parametrize(
    "make_optimizer",
    [
        pytest.param(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), id="sgd"),
        pytest.param(lambda params: torch.optim.Adam(params, lr=0.01, capturable=True), id="adam"),
    ],
)
def test_a_whole_training_step_captured_in_a_graph_trains_as_eager_code(make_optimizer):
    """torch's whole-network capture recipe: forward, backward and optimizer step in one graph."""

    def body():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).cuda()
        eager = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).cuda()
        eager.load_state_dict(model.state_dict())
        optimizer, eager_optimizer = make_optimizer(model.parameters()), make_optimizer(eager.parameters())
        batches = [(torch.randn(5, 4, device="cuda"), torch.randn(5, 1, device="cuda")) for _ in range(4)]
        static_x, static_y = (t.clone() for t in batches[0])

        def step(net, opt, x, y):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            return loss

        step(model, optimizer, static_x, static_y)  # warm-up (the optimizer makes its state)
        step(eager, eager_optimizer, *batches[0])
        graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_loss = torch.nn.functional.mse_loss(model(static_x), static_y)
            static_loss.backward()
            optimizer.step()
        # no eager step for the capture: on CUDA a capture launches nothing, so the
        # parameters and the optimizer's state are as before it until the first replay
        losses = []
        for x, y in batches[1:]:
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
            eager_loss = step(eager, eager_optimizer, x, y)
            losses.append(torch.allclose(static_loss, eager_loss))
        same = all(torch.allclose(p, q, atol=1e-6) for p, q in zip(model.parameters(), eager.parameters()))
        return losses, same

    assert _run(body, 1) == [([True] * 3, True)]


def test_a_step_captured_and_replayed_at_once_accumulates_its_gradients_once():
    """Megatron's full-iteration graph: capture one training step, then replay it for that step.

    Gradients go into a static buffer that exists before the capture (zeroed before every
    step) and are all-reduced in place. On CUDA the capture launches nothing, so the step's
    gradients are the replay's alone; before, the capture's eager pass added them too.
    """

    def body():
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(3, 4, device="cuda"))
        main_grad = torch.zeros(3, 4, device="cuda")  # DDP's static gradient buffer
        static_x = torch.zeros(2, 4, device="cuda")

        def accumulate(grad):
            main_grad.add_(grad)  # returns nothing: the gradient itself is unchanged

        hook = weight.register_hook(accumulate)

        def step():
            loss = (static_x @ weight.t()).square().sum()
            loss.backward()
            dist.all_reduce(main_grad)  # in place, on the buffer made before the capture

        grads = []
        graph = None
        for i in range(4):
            static_x.copy_(torch.full((2, 4), float(i + dist.get_rank() + 1), device="cuda"))
            main_grad.zero_()
            if i == 0:
                step()  # warm-up, eager
            else:
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                graph.replay()
            grads.append(main_grad.clone())
        hook.remove()
        expected = []
        for i in range(4):  # the same steps, eagerly
            x = torch.full((2, 4), float(i + dist.get_rank() + 1), device="cuda")
            loss = (x @ weight.t()).square().sum()
            expected.append(torch.autograd.grad(loss, weight)[0])
            dist.all_reduce(expected[-1])
        return [torch.equal(g, e) for g, e in zip(grads, expected)]

    assert _run(body) == [[True] * 4] * 2


def test_a_capture_leaves_the_generator_offsets_as_they_were():
    def body():
        torch.cuda.manual_seed(3)
        before = torch.cuda.default_generators[0].get_offset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            noise = torch.rand(8, device="cuda")
        after_capture = torch.cuda.default_generators[0].get_offset()
        graph.replay()
        torch.cuda.manual_seed(3)
        return before == after_capture, torch.equal(noise, torch.rand(8, device="cuda"))

    assert _run(body, 1) == [(True, True)]


def test_random_ops_captured_under_a_swapped_in_state_draw_from_it_at_replay():
    """Megatron's RNG tracker with CUDA graphs: its own state is swapped in around the ops it captures."""

    def body():
        torch.cuda.manual_seed(1)
        generator = torch.cuda.default_generators[0]
        tracked = generator.clone_state().manual_seed(123)  # the tracker's state
        reference = tracked.clone_state()
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(tracked)
        with torch.cuda.graph(graph):
            default = generator.graphsafe_get_state()
            generator.graphsafe_set_state(tracked)  # tracker.fork()
            noise = torch.rand(6, device="cuda")
            generator.graphsafe_set_state(default)
        default_offset = generator.get_offset()
        replayed = []
        for _ in range(2):
            graph.replay()
            replayed.append(noise.clone())
        eager = []
        for _ in range(2):
            generator.graphsafe_set_state(reference)
            eager.append(torch.rand(6, device="cuda"))
            generator.graphsafe_set_state(default)
        return (
            [torch.equal(r, e) for r, e in zip(replayed, eager)],
            generator.get_offset() == default_offset,
            tracked.get_offset() == reference.get_offset(),
        )

    assert _run(body, 1) == [([True, True], True, True)]


def test_tensor_type_names_the_cuda_type():
    """Megatron's optimizer asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``."""

    def body():
        x = torch.ones(2, device="cuda")
        half = x.type("torch.cuda.HalfTensor")
        on_cpu = x.type(torch.FloatTensor)
        return (
            x.type(),
            torch.ones(1).type(),
            half.type(),
            str(half.device),
            on_cpu.type(),
            x.type(torch.float64).type(),
            torch.ones(1).type("torch.cuda.FloatTensor").is_cuda,
        )

    expected = (
        "torch.cuda.FloatTensor",
        "torch.FloatTensor",
        "torch.cuda.HalfTensor",
        "cuda:0",
        "torch.FloatTensor",
        "torch.cuda.DoubleTensor",
        True,
    )
    assert _run(body, 1) == [expected]

    def refused():
        with pytest.raises(
            ValueError, match=r"a tensor type such as 'torch\.cuda\.FloatTensor' or a dtype, got 'f32'"
        ):
            torch.ones(1, device="cuda").type("f32")
        return "refused"

    assert _run(refused, 1) == ["refused"]
