"""The device the real-backend tests serve on.

The CPU by default (PyTorch reference path, or the Triton interpreter where a test asks for
Triton). The GPU check's `backends` section (scripts/gpu_check.py) runs the same tests with
``SERVELAB_BACKEND_DEVICE=cuda`` and the interpreter off, so that the engine, the MoE runner,
disaggregated prefill/decode (block copies between two caches), speculative decoding and the
CPU tier run over the compiled Triton kernels. The Hugging Face references stay on the CPU:
tests compare token ids, and logits moved to the CPU."""
from __future__ import annotations

import os

DEVICE = os.environ.get("SERVELAB_BACKEND_DEVICE", "cpu")
