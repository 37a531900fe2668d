"""FP8 (e4m3) rollout: block-wise (128 x 128, DeepSeek-V3's recipe) or per-channel weight
quantization with per-token(-group) activation scales (:mod:`.quantize`), the FP8 GEMM through
``torch._scaled_mm`` on FP8 GPUs and its emulation elsewhere (:mod:`.gemm`), and the rollout
model's linears running on FP8 copies of their weights (:mod:`.rollout_linears`), which the
rollout engine refreshes after every weight sync or load (``RolloutEngine(weight_dtype="fp8")``).
"""

from parallel_models.inference.fp8.gemm import emulated_matmul, fp8_linear, gemm_backend
from parallel_models.inference.fp8.quantize import (BLOCK, E4M3, E4M3_MAX, GRANULARITIES,
                                                    QuantizedWeight, dequantize_activation,
                                                    dequantize_weight, quantize_activation,
                                                    quantize_weight, weight_scale_shape)
from parallel_models.inference.fp8.rollout_linears import (PROJECTIONS, Fp8Linears,
                                                           quantized_modules)

WEIGHT_DTYPES = ("bf16", "fp8")

__all__ = ["BLOCK", "E4M3", "E4M3_MAX", "GRANULARITIES", "PROJECTIONS", "WEIGHT_DTYPES",
           "Fp8Linears", "QuantizedWeight", "dequantize_activation", "dequantize_weight",
           "emulated_matmul", "fp8_linear", "gemm_backend", "quantize_activation",
           "quantize_weight", "quantized_modules", "weight_scale_shape"]
