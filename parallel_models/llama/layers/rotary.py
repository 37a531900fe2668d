"""Rotary position embeddings with HF's scaling rules (linear, dynamic NTK, llama3, YaRN, longrope).

Inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` so every scaling rule
matches the reference bit for bit; cos/sin are computed in fp32 like transformers does.
"""

from __future__ import annotations

import torch

from parallel_models.config import ModelConfig


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.dim = config.head_dim
        inv_freq, self.attention_scaling = self._compute(None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _compute(self, seq_len: int | None):
        cfg = self.config
        if cfg.rope_type == "default":
            return _default_inv_freq(cfg.rope_theta, self.dim), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[cfg.rope_type](cfg.hf_config, None, seq_len=seq_len)
        return inv_freq.float(), float(scaling)

    def _inv_freq_for(self, position_ids: torch.Tensor,
                      max_position: int | None = None) -> torch.Tensor:
        if not self.config.rope_depends_on_length:
            return self.inv_freq
        # dynamic NTK / longrope: the frequencies depend on the longest position of the batch,
        # as in transformers' dynamic_rope_update (``max_position``: that of the whole batch
        # when ``position_ids`` are one context-parallel rank's share)
        seq_len = int(position_ids.max()) + 1 if max_position is None else max_position
        original = (self.config.rope_scaling or {}).get("original_max_position_embeddings",
                                                        self.config.max_position_embeddings)
        if seq_len <= original:
            return self.inv_freq
        if self.config.rope_type == "longrope":  # one long set for every length past original
            if getattr(self, "_long_inv_freq", None) is None:
                self._long_inv_freq, _ = self._compute(original + 1)
            return self._long_inv_freq.to(self.inv_freq.device)
        inv_freq, _ = self._compute(seq_len)
        return inv_freq.to(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype,
                max_position: int | None = None):
        """position_ids: any shape -> (cos, sin) of shape position_ids.shape + (head_dim,)."""
        inv_freq = self._inv_freq_for(position_ids, max_position).to(position_ids.device)
        freqs = position_ids.to(torch.float32)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, d]; cos/sin: [tokens, d]."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin
