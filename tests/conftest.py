"""pytest set-up shared by every test module (their shared helpers are in tests/helpers.py).

DeepSpeed picks its accelerator when first imported: without CUDA the suite runs it on the CPU (gloo), as
`.ci/run` asks, also when pytest is started from a plain shell.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
