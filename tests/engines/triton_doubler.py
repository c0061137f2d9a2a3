"""A real Triton Inference Server (through PyTriton, CPU only) serving `doubler`: FP32[4] in,
FP32[4] out, each value doubled, dynamic batching up to 64 rows. Runs in its own venv (PyTriton
needs a non-pyenv Python; the Makefile builds tests/.venv-triton from Debian's python3.11):

    tests/.venv-triton/bin/python tests/engines/triton_doubler.py HTTP_PORT GRPC_PORT METRICS_PORT WORKSPACE
"""

import signal
import sys

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


@batch
def double(INPUT):  # noqa: N803 - the tensor's name in Triton
    return {"OUTPUT": (INPUT * 2).astype(np.float32)}


def main() -> None:
    http_port, grpc_port, metrics_port = (int(p) for p in sys.argv[1:4])
    config = TritonConfig(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, exit_on_error=True)
    with Triton(config=config, workspace=sys.argv[4]) as triton:
        triton.bind(model_name="doubler", infer_func=double,
                    inputs=[Tensor(name="INPUT", dtype=np.float32, shape=(4,))],
                    outputs=[Tensor(name="OUTPUT", dtype=np.float32, shape=(4,))],
                    config=ModelConfig(max_batch_size=64))
        # SIGTERM stops the server through PyTriton, which then frees its workspace and shared memory.
        signal.signal(signal.SIGTERM, lambda *_: triton.stop())
        triton.serve()


if __name__ == "__main__":
    main()
