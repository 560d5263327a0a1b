"""The real CUDA runtime's entries that torch's own Python reaches under emulation, and who answers each.

On PyPI's CUDA build of torch with no GPU (``pip install torch`` on most laptops; every
torch 2.14+ wheel there) these functions exist and call the CUDA driver, which fails
(``CUDA driver version is insufficient for CUDA runtime version``). On the CPU build
they are stubs, so the same program passed there and failed on the CUDA build (issue 38).

The list was made by running the emulation's tests (``tests/meshsim/test_cuda.py``,
``test_cuda_compile.py``, ``test_compile.py`` under ``--mesh-cuda=cpu``,
``tests/plugin/test_cuda_option.py``), ``torch.compile`` with Inductor in its default,
``reduce-overhead`` and ``max-autotune-no-cudagraphs`` modes, and flex attention forward
and backward, on torch 2.14.1 (CUDA 13 build, no GPU, triton 3.8.0) and 2.13.0+cpu (with
and without triton 3.8.0), on simulated, gloo thread and spawned ranks; the emulation's
tests (``tests/meshsim/test_cuda*.py``) also on 2.11.0 (PyPI's CUDA 13 build, no GPU,
triton 3.6.0), the torch GPU machines carry. A test checks that each
name listed is a stand-in while emulated (``torch.accelerator``'s only on a build whose
accelerator is CUDA: on the CPU build torch has none and never reaches them).
"""

from __future__ import annotations

__all__ = ["NOT_COVERED", "REACHED"]

REACHED: tuple[tuple[str, str, str], ...] = (
    # (the entry, who reaches it, what answers it under emulation)
    (
        "torch.cuda.is_current_stream_capturing",
        "Dynamo before each frame it compiles (convert_frame.trace_frame, torch 2.14.1); "
        "batch norm's helpers; torch.cuda.memory",
        "graphs.is_current_stream_capturing: the thread's capture",
    ),
    (
        "torch.cuda.graphs.is_current_stream_capturing",
        "torch.cuda's own modules by that name",
        "graphs.is_current_stream_capturing",
    ),
    (
        "torch.cuda.is_available",
        "Inductor asks before its CUDA-only checks: cudagraph_utils.check_caching_allocator_for_cudagraphs "
        "then calls torch._C._cuda_cudaCachingAllocator_is_enabled (reduce-overhead); "
        "torch.utils._triton.has_triton then opens triton's CUDA driver",
        "compiler.is_available: True to the program, the real answer to the compiler's modules",
    ),
    (
        "torch.cuda.current_device",
        "Dynamo's CudaInterface (bound when torch._dynamo.device_interface is first imported)",
        "api's stand-in; the compiler's modules are imported before the stand-ins are set",
    ),
    (
        "torch.cuda._lazy_init, get_device_properties, device_count, synchronize",
        "torch.cuda's own helpers and torch.distributed (DeviceMesh, FSDP2)",
        "api's stand-ins",
    ),
    (
        "torch.accelerator.current_device_index, current_stream",
        "Dynamo as it starts tracing each frame (variables/streams.py SymbolicStreamState, "
        "torch 2.14.1: torch.accelerator.is_available() asks torch.cuda.is_available, which "
        "is True while emulated) and its guards on the current stream (utils.get_current_stream); "
        "only on a build whose accelerator is CUDA",
        "api.accelerator_stand_ins: the calling rank's current device, and the stream "
        "torch.cuda.current_stream gives; the CPU build keeps its own (no accelerator there)",
    ),
    (
        "torch.accelerator.set_device_index, set_stream, synchronize, device_index",
        "programs and torch.distributed written for any accelerator (not seen reached by torch "
        "itself in the runs above)",
        "api.accelerator_stand_ins, on a build whose accelerator is CUDA",
    ),
)


NOT_COVERED: tuple[tuple[str, str], ...] = (
    # (the entry, who reaches it): found, not answered yet (issue 38). None left from the runs above.
)
