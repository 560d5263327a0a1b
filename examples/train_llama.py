"""Train a small llama-style transformer for a few steps: FSDP2 x tensor parallel (x pipeline).

The same script runs three ways and, with the same ``--seed``, prints the same losses (float32,
within 1e-5 relative: the rounding of sums taken in another order):

    python examples/train_llama.py                                           # one process
    torchrun --standalone --nproc-per-node=8 examples/train_llama.py         # tp 2 x dp 4
    torchrun --standalone --nproc-per-node=8 examples/train_llama.py --pp 2  # pp 2 x dp 2 x tp 2

and on 8 simulated ranks in one process, with the same command line as torchrun's:

    meshsim run --nproc-per-node=8 examples/train_llama.py --pp 2    # prints each step's collectives

Every rank builds the whole model from ``--seed`` on the CPU, then keeps its part: its pipeline
stage's layers (``--pp``, torch.distributed.pipelining), its tensor-parallel shards (``--tp``,
parallelize_module) and its FSDP2 shard over the data-parallel ranks (fully_shard; dp = world
size / tp / pp). Each step draws one global batch from the seed and the step; each dp rank trains
on its slice. Rank 0 prints ``step {i} loss {loss:.6f}``, the mean loss over the global batch.
Without WORLD_SIZE in the environment (no torchrun) it runs as one process, with no parallelism.
"""

import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    from meshsim import region  # meshsim run's summary shows each step's collectives
except ImportError:  # without meshsim: the script runs the same
    from contextlib import nullcontext as region


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x):
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim), rotate-half form."""
    seq, half = x.shape[-2], x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, device=x.device, dtype=x.dtype) / half)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=x.dtype), freqs)
    x1, x2 = x[..., :half], x[..., half:]
    return x * angles.cos().repeat(1, 2) + torch.cat((-x2, x1), dim=-1) * angles.sin().repeat(1, 2)


def causal(batch, head, q_index, kv_index):
    return q_index >= kv_index


_block_masks = {}


def flex_causal(q, k, v):
    """Causal attention by flex attention, its block mask made once per length and device.

    Not compiled, even with ``--compile``: on the CPU (meshsim's CUDA emulation stores
    tensors there, and the compiler sees that storage) torch 2.13-2.14's flex attention
    refuses to compile for training ("FlexAttention does not support backward on CPU"),
    and Inductor's CPU flex attention is inference only. Eager flex attention (torch's
    own kernel, run by the emulation on the CPU) trains. On a GPU, compile it.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    key = (q.shape[-2], q.device)
    if key not in _block_masks:
        _block_masks[key] = create_block_mask(causal, None, None, key[0], key[0], device=q.device)
    return flex_attention(q, k, v, block_mask=_block_masks[key])


class Rotary(nn.Module):
    """Rotary embedding of the queries and the keys: a module, so that ``--compile`` can compile it alone."""

    def forward(self, q, k):
        return rotary(q), rotary(k)


class Attention(nn.Module):
    def __init__(self, dim, heads, attention="sdpa"):
        super().__init__()
        self.head_dim = dim // heads
        self.attention = attention
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.rotary = Rotary()

    def forward(self, x):
        b, s, _ = x.shape
        # Under tensor parallel wq, wk and wv give this rank's heads only: -1 counts them.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = self.rotary(q, k)
        if self.attention == "flex":
            out = flex_causal(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, attention="sdpa"):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, heads, attention)
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Tokens to logits. A pipeline stage keeps some of the parts: those it drops are None."""

    def __init__(self, vocab, dim, layers, heads, attention="sdpa"):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, attention) for i in range(layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, h):
        h = self.embed(h) if self.embed is not None else h
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step, args):
    """The global batch of ``step``, the same on every rank: arithmetic sequences mod vocab."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step)
    start = torch.randint(args.vocab, (args.batch, 1), generator=gen)
    stride = torch.randint(1, 8, (args.batch, 1), generator=gen)
    tokens = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    return tokens[:, :-1], tokens[:, 1:]


def compile_block(block):
    """torch.compile the block's attention and MLP (with flex attention: its projections and flex itself).

    Not the whole block: on torch 2.13 a whole compiled block under tensor parallel fails in
    backward with tp alone (AttributeError: 'Tensor' object has no attribute '_local_tensor'),
    and with FSDP too its losses leave eager's from the second step. With ``--attention flex``,
    the MLP only: flex attention runs eagerly (see :func:`flex_causal`), and so does the rest of
    the attention.
    """
    if block.attn.attention != "flex":
        block.attn.compile()
    block.mlp.compile()


def parallelize(model, mesh, args):
    """Tensor parallel over mesh["tp"], then FSDP2 over mesh["dp"], each where its degree is > 1."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if args.tp > 1:
        plan = {}
        if model.embed is not None:  # a pipeline stage may lack the embedding or the output
            plan["embed"] = RowwiseParallel(input_layouts=Replicate())
        if model.output is not None:
            plan["output"] = ColwiseParallel(output_layouts=Replicate())
        for i in model.layers:
            for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
                plan[f"layers.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.wo", "mlp.w2"):
                plan[f"layers.{i}.{name}"] = RowwiseParallel()
        # Every rank holds the same full weights: each keeps its shards, nothing is sent.
        parallelize_module(model, mesh["tp"], plan, src_data_rank=None)
    for block in model.layers.values():
        if args.compile:
            compile_block(block)
        if args.dp > 1:
            fully_shard(block, mesh=mesh["dp"])
    if args.dp > 1:
        fully_shard(model, mesh=mesh["dp"])
    return model


def pipeline(model, mesh, args, device):
    """Keep this rank's stage of ``model``, parallelized, and a schedule to train it."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage, n = mesh["pp"].get_local_rank(), args.pp
    keep = range(stage * args.layers // n, (stage + 1) * args.layers // n)
    for i in [i for i in model.layers if int(i) not in keep]:
        del model.layers[i]
    if stage > 0:
        model.embed = None
    if stage < n - 1:
        model.norm = model.output = None
    model = parallelize(model, mesh, args)
    pipe = PipelineStage(model, stage, n, device, group=mesh["pp"].get_group())
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    return model, schedule(pipe, n_microbatches=args.microbatches, loss_fn=loss_fn)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline degree (torch.distributed.pipelining)")
    p.add_argument("--microbatches", type=int, help="per pipeline step (default: pp)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    for flag, default in (("dim", 64), ("layers", 4), ("heads", 4), ("vocab", 256), ("seq", 32)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--batch", type=int, default=8, help="global batch, split over the dp ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile each block's attention and MLP")
    p.add_argument(
        "--attention",
        choices=("sdpa", "flex"),
        default="sdpa",
        help="scaled_dot_product_attention, or flex attention with a causal block mask (CUDA only: "
        "torch's flex attention refuses backward on CPU tensors)",
    )
    gpu = torch.cuda.is_available()
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if gpu else "cpu")
    p.add_argument("--print-full", action="store_true", help="also print: step {i} loss_full {repr(loss)}")
    args = p.parse_args()
    args.world = int(os.environ.get("WORLD_SIZE", 0))  # set by torchrun (and meshsim)
    if not args.world:
        args.tp = args.pp = 1  # one process: no parallelism
    if max(args.world, 1) % (args.tp * args.pp):
        p.error(f"world size {args.world} is not a multiple of tp {args.tp} x pp {args.pp}")
    if args.attention == "flex" and args.device != "cuda":
        p.error("--attention flex trains on --device cuda only: torch 2.13-2.14's flex refuses CPU backward")
    args.dp = max(args.world, 1) // (args.tp * args.pp)
    args.microbatches = args.microbatches or args.pp
    if args.heads % args.tp or args.layers < args.pp:
        p.error(f"--heads {args.heads} must be a multiple of tp {args.tp}, --layers at least pp {args.pp}")
    if args.batch % (args.dp * args.microbatches):
        p.error(f"--batch {args.batch} must be a multiple of dp {args.dp} x microbatches {args.microbatches}")
    return args


def main():
    args = parse_args()
    # Under tp the logits are the local view of an all-gathered DTensor; nothing changes them in
    # place, so FSDP2's warning about returning a view does not apply.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    device = torch.device(args.device)
    if args.world:
        if args.device == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")  # env://

    torch.manual_seed(args.seed)  # the whole model, the same on every rank, before it is split
    model = Transformer(args.vocab, args.dim, args.layers, args.heads, args.attention).to(device)
    schedule, stage, last_stage, dp_rank = None, 0, True, 0
    if args.world:
        from torch.distributed.device_mesh import init_device_mesh

        dims = (args.pp, args.dp, args.tp)
        mesh = init_device_mesh(device.type, dims, mesh_dim_names=("pp", "dp", "tp"))
        dp_rank, stage = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
        last_stage = stage == args.pp - 1
        if args.pp > 1:
            model, schedule = pipeline(model, mesh, args, device)
        else:
            model = parallelize(model, mesh, args)
    elif args.compile:
        for block in model.layers.values():
            compile_block(block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    rows = args.batch // args.dp
    for step in range(args.steps):
        inputs, targets = (t[dp_rank * rows : (dp_rank + 1) * rows].to(device) for t in batch(step, args))
        with region("step"):
            if schedule is None:
                loss = loss_fn(model(inputs), targets)
                loss.backward()
            else:  # the first stage takes the inputs; the last one the targets, and gives the losses
                losses = []
                first = (inputs,) if stage == 0 else ()
                schedule.step(*first, target=targets if last_stage else None, losses=losses)
                loss = torch.stack(losses).mean() if last_stage else torch.zeros((), device=device)
            optimizer.step()
            optimizer.zero_grad()
        loss = loss.detach()
        if args.world:  # the global batch's mean: a sum over the last stage's dp x tp ranks
            loss = loss / (args.dp * args.tp) if last_stage else torch.zeros_like(loss)
            dist.all_reduce(loss)
        if not args.world or dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            if args.print_full:
                print(f"step {step} loss_full {loss.item()!r}", flush=True)

    if args.world:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
