"""What "out of memory" means on a device, defined below both the budget (worker/memory/budget.py)
and the batch's compute (worker/batch/execute.py), which both need it: the test for an allocation
failure and the exception for a context that is no longer trusted. torch only inside functions."""

from __future__ import annotations

__all__ = ["OOM_MARKERS", "CudaContextLost", "is_oom"]

# Allocation failures of the CUDA libraries: out of memory in disguise, raised as a RuntimeError
# (or torch.AcceleratorError) with the library's status name in its text (cuBLAS: cublasStatus_t,
# cuDNN: cudnnStatus_t, cuRAND: curandStatus_t). cuDNN reports a handle it could not create for
# lack of memory as NOT_INITIALIZED.
OOM_MARKERS = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDNN_STATUS_NOT_INITIALIZED",
               "CURAND_STATUS_ALLOCATION_FAILED")


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` means the device ran out of memory: torch.cuda.OutOfMemoryError, or a CUDA
    library's allocation failure (OOM_MARKERS), which is split and retried like one."""
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in OOM_MARKERS)


class CudaContextLost(Exception):
    """The device context is not trusted any more (a non-OOM CUDA error, or OOM that persists).
    Not a client error: the worker leaves its batch un-acked and exits (ExitCode.CUDA_CONTEXT_LOST)."""
