"""Settings for the whole test session.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (`tests/test_triton.py`). The interpreter is
chosen when ``triton`` is first imported (its own library functions are decorated then), by any module, so it is set
here, before any test module is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
