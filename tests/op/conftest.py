"""The op tests run through Triton's interpreter on the CPU, or compiled on a GPU when there is one.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a kernel, so it must be set before the op
module is imported: this conftest is loaded before the test modules of this directory.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
