"""GPU code on simulated ranks: CUDA emulated on the CPU, or every rank's ``cuda:k`` on one real GPU.

Code written for GPUs says ``device="cuda"``, ``torch.cuda.set_device(k)``,
``init_process_group("nccl")``, pins memory, seeds ``torch.cuda.manual_seed`` and
makes streams and events. :func:`acquire` makes such code run unchanged, with one
device story:

- **Storage is on the storage device, Python sees CUDA.** Every tensor's bytes live
  where ``spec`` says (the CPU for ``"cpu"``; the one real GPU for ``"cuda:0"``). A
  tensor made or moved to ``cuda:k`` carries a tag, and Python's view of it says
  ``cuda:k``: ``tensor.device``, ``is_cuda``, ``get_device()``, its repr, and a wrapper
  subclass (DTensor, ShardTensor) built over it. C++ sees the storage device, so
  kernels, wrapper subclasses made in C++ and process groups work on real storage.
  Code that compares devices (a parameter's against a mesh's, ``assert_close``)
  behaves as on a GPU machine.
- **Tags follow the data.** A dispatch mode in every rank thread (and in the caller
  while a pytest session emulates) sees every aten op, those that autograd's backward,
  DTensor's handlers and other subclasses run included: a factory asked for
  ``cuda:k`` makes its tensor on the storage device and tags it; an op's outputs take
  the tag of its first tagged input; ``.cpu()`` and ``.to("cpu")`` copy, untagged.
  ``torch.compile`` compiles with the mode off and runs its compiled code under it
  (torch's ``ignore_compile_internals``); the outputs of a compiled function take
  the device of its first CUDA input.
- **``torch.cuda`` answers as a CUDA machine** with ``devices`` GPUs (at least the
  world's ranks per node): availability, count, the current device (per rank, 0 until
  ``set_device``, as in a new process), names, properties and capability, streams
  and events (ordering kept, every kernel already done), per-rank memory statistics,
  and the CUDA RNG per rank and device (seed and offset, as CUDA's Philox state:
  16 bytes, so DTensor's offset-based RNG tracker works).

The setting is a value (:class:`Spec`), resolved once where options are (:func:`resolve`)
and carried into the world that uses it; a world sizes it to its ranks per node. Each
thread that emulates has its dispatch mode, which carries its spec, in its rank context
(``current().cuda``, :func:`enter_rank`); ``torch.cuda``'s stand-ins answer from it.
The per-rank part (the current device, each device's generator, the memory counters)
is one entry of the hand-over registry (:mod:`meshsim._process.handover`). What is
changed process-wide (``torch.cuda``'s functions, ``torch.Tensor``'s device
properties, ``.to``/``.cuda``/``.cpu``/``pin_memory``, ``_make_wrapper_subclass``) is
made by :func:`changes` for the one list of process-wide changes
(:func:`meshsim._process.patches.install_cuda`): by the first user, undone by the last.

Private torch names used, checked in torch 2.13: ``torch._C.TensorBase``'s ``device``,
``is_cuda`` and ``to`` descriptors, ``torch.Tensor._make_wrapper_subclass``,
``torch.cuda._lazy_init``, ``TorchDispatchMode.ignore_compile_internals`` (absent in
older releases: torch.compile then runs its function eagerly under emulation).

Modules: :mod:`.spec` (what is emulated: the value, resolved and sized), :mod:`.rank`
(each rank's GPUs, the registry entry), :mod:`.tensors` (tags, the dispatch mode,
torch.Tensor's Python face), :mod:`.api` (``torch.cuda``'s stand-ins), :mod:`.install`
(the process-wide changes, each thread's mode). Child processes:
:mod:`meshsim._process.children`.
"""

from __future__ import annotations

from meshsim._process.cuda.install import changes, emulated_here, enter_rank, leave_rank, take_local_device
from meshsim._process.cuda.spec import IN_USE, Spec, devices_from_environment, parse, resolve, spec_here
from meshsim._process.cuda.tensors import device_of

__all__ = [
    "IN_USE",
    "Spec",
    "changes",
    "device_of",
    "devices_from_environment",
    "emulated_here",
    "enter_rank",
    "leave_rank",
    "parse",
    "resolve",
    "spec_here",
    "take_local_device",
]
