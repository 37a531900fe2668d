"""Parallel building blocks of the Llama family (Qwen2 and others are configurations of it)."""

from parallel_models.llama.layers.attention import ParallelAttention
from parallel_models.llama.layers.attention_kernels import available_backend, varlen_causal_attention
from parallel_models.llama.layers.decoder_layer import ParallelDecoderLayer
from parallel_models.llama.layers.linear import (GateUpParallelLinear, ParallelRowLinear,
                                                 QKVParallelLinear)
from parallel_models.llama.layers.mlp import ParallelMLP
from parallel_models.llama.layers.norm import RMSNorm
from parallel_models.llama.layers.rotary import RotaryEmbedding, apply_rotary

__all__ = ["ParallelAttention", "available_backend", "varlen_causal_attention",
           "ParallelDecoderLayer", "GateUpParallelLinear", "ParallelRowLinear",
           "QKVParallelLinear", "ParallelMLP", "RMSNorm", "RotaryEmbedding", "apply_rotary"]
