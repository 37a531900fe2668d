"""Workarounds for megatron-core bugs that are not about the CPU (those live in ``cpu_shim``).

``apply()`` is idempotent; model code (``llama/layers/moe.py``) and megatron-core's own
``GPTModel`` builder (``checkpoint_utils.megatron_format.build_gpt_model``) call it.
"""

from __future__ import annotations


def apply() -> None:
    # megatron-core 0.16 without transformer-engine never defines `te_general_gemm` in
    # moe_utils, which its MoE router's gating reads (NameError); None selects its torch path.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
