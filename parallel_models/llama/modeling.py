"""The one decoder family (Llama, Qwen2, ...) and its variants.

Variants are compositions, not copies:
- input: RmPad (packed tokens + ``cu_seqlens``) is the core path; the padded ``(batch, seq)`` path
  packs, runs it, and unpacks;
- head: CausalLM (vocab-parallel LM head) or Value (one scalar per token);
- pipeline stage: ``pre_process`` (has the embedding) / ``post_process`` (final norm + head) and the
  layers this stage owns.
Hidden states travel as ``[tokens, 1, hidden]`` (megatron's ``[s, b, h]``), split over the TP ranks
along tokens under sequence parallel. While the MoE load-balancing loss is recorded, a stage's
pipeline message has a few more rows: the router totals so far (``layers/moe_aux_carry.py``).
A model is built in one :class:`~parallel_models.parallel_layout.ParallelLayout` (``layout=``,
default the training layout of ``init_parallel``), kept as ``model.parallel_layout``: its layers
communicate over that layout's groups only.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from megatron.core import ModelParallelConfig
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.enums import ModelType
from megatron.core.transformer import TransformerConfig

from parallel_models.config import ConfigError, ModelConfig, resolve_dtype
from parallel_models.distributed import layout_or_training
from parallel_models.heads import ParallelLMHead, ValueHead
from parallel_models.heads.lm_output import causal_lm_head
from parallel_models.llama import checkpoint_utils as ckpt_io
from parallel_models.llama.layers import ParallelDecoderLayer, RMSNorm, RotaryEmbedding
from parallel_models.llama.layers import moe_aux_carry, moe_aux_loss, recompute
from parallel_models.llama.layers.fused_ops import add_rms_norm
from parallel_models.llama.layers.moe import moe_megatron_settings
from parallel_models.options import option
from parallel_models.utils.padding import (pack_padded_batch, position_ids_from_cu_seqlens,
                                           unpack_to_padded)


@dataclasses.dataclass
class CausalLMOutput:
    """``logits``: full vocab if ``full_vocab=True``, else this TP rank's vocab slice."""

    logits: torch.Tensor


@dataclasses.dataclass
class ValueOutput:
    values: torch.Tensor


def build_megatron_config(config: ModelConfig, dtype: torch.dtype, sequence_parallel: bool,
                          layout=None) -> TransformerConfig:
    """The megatron-core config our parallel layers and megatron's schedules/DDP read, for a
    model in ``layout`` (default: the training layout).

    A ``TransformerConfig`` (not just a ``ModelParallelConfig``) because the pipeline schedules
    read ``hidden_size`` and the loss/grad settings from it.
    """
    layout = layout_or_training(layout)
    tp = layout.tensor_parallel_size
    config.check_tensor_parallel(tp)
    config.check_expert_parallel(layout.expert_parallel_size)
    if config.is_moe and tp > 1:
        # megatron-core's MoE layer refuses to train with TP but without sequence parallel
        sequence_parallel = True
    mp_config = TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim,
        ffn_hidden_size=config.intermediate_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=layout.pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_parallel_size,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,  # weights are loaded or initialized by us
        gradient_accumulation_fusion=False,
        expert_model_parallel_size=layout.expert_parallel_size,
        **moe_megatron_settings(config),
        qk_layernorm=config.qk_norm,  # finalize_model_grads sums q/k_layernorm grads over TP
    )
    # packed microbatches differ in token count: pipeline p2p must send shapes first (set after
    # construction: the MoE-only validation in __post_init__ rejects it for dense models)
    mp_config.variable_seq_lengths = True
    if not torch.cuda.is_available():
        # gloo pairs p2p messages per peer in issue order; megatron's batched p2p issues
        # send-prev before send-next, which with PP=2 (prev == next) swaps activations and
        # gradients in the interleaved schedule. The unbatched path orders them safely.
        mp_config.batch_p2p_comm = False
    return mp_config


def fuse_residual_norm() -> bool:
    """Generation fuses each layer's residual sum into the next norm unless the option
    ``decode_fuse_norm`` is off (``PARALLEL_MODELS_DECODE_FUSE_NORM=0``; benches compare)."""
    return option("decode_fuse_norm")


class ParallelDecoder(torch.nn.Module):
    """Embedding (first stage) -> decoder layers of this stage -> final norm (last stage)."""

    recompute = "none"  # activation recomputation (layers/recompute.py: set_recompute)

    def __init__(self, config: ModelConfig, mp_config: ModelParallelConfig, layer_ids: list[int],
                 pre_process: bool = True, post_process: bool = True, layout=None):
        super().__init__()
        layout = layout_or_training(layout)
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.sequence_parallel = mp_config.sequence_parallel
        self.tp = mp_config.tensor_model_parallel_size
        if pre_process:
            std = config.initializer_range
            self.embed_tokens = VocabParallelEmbedding(
                config.padded_vocab_size(self.tp), config.hidden_size,
                init_method=lambda w: torch.nn.init.normal_(w, 0.0, std),
                reduce_scatter_embeddings=self.sequence_parallel, config=mp_config,
                tp_group=layout.tp_group)
            self.embed_tokens.weight.tensor_model_parallel = True
            self.embed_tokens.weight.partition_dim = 0
            self.embed_tokens.weight.partition_stride = 1
        self.layers = torch.nn.ModuleList(
            ParallelDecoderLayer(config, mp_config, layer_id, layout) for layer_id in layer_ids)
        if post_process:
            device = "cpu" if mp_config.use_cpu_initialization else torch.cuda.current_device()
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                sequence_parallel=self.sequence_parallel,
                                dtype=mp_config.params_dtype, device=device,
                                unit_offset=config.norm_unit_offset)
        self.rotary_emb = RotaryEmbedding(config)
        if not mp_config.use_cpu_initialization:  # keep inv_freq beside the weights (no H2D per step)
            self.rotary_emb.to(torch.cuda.current_device())
        self.input_tensor = None  # set by the pipeline schedule on later stages

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[tokens] -> [tokens(/tp under SP), 1, hidden]."""
        hidden = self.embed_tokens(input_ids.unsqueeze(0))  # [1, tokens, h] (or [t/tp, 1, h])
        if self.config.embedding_multiplier != 1.0:  # Gemma: as HF, the scale in the hidden dtype
            scale = torch.tensor(self.config.embedding_multiplier, dtype=torch.float32)
            hidden = hidden * scale.to(device=hidden.device, dtype=hidden.dtype)
        if not self.sequence_parallel:
            # a view, not transpose(): the same strides as every later [t, 1, h] activation (the
            # fused kernels would compile once more for the transposed layout)
            hidden = hidden.view(hidden.shape[1], 1, hidden.shape[2])
        return hidden

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen, hidden=None, kv_cache=None):
        if self.pre_process:
            hidden = self.embed(input_ids)
        elif hidden is None:
            hidden = self.input_tensor
        # under context parallelism cu_seqlens is this rank's ContextParallelShard
        cos, sin = self.rotary_emb(position_ids, hidden.dtype,
                                   getattr(cu_seqlens, "max_position", None))
        if kv_cache is not None and self.post_process and fuse_residual_norm():
            return self._forward_fused(hidden, cos, sin, cu_seqlens, max_seqlen, kv_cache)
        if self.recompute == "full" and kv_cache is None and torch.is_grad_enabled():
            return self._forward_recomputed(hidden, cos, sin, cu_seqlens, max_seqlen)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, cu_seqlens, max_seqlen, kv_cache, i)
        if self.post_process:
            hidden = self.norm(hidden)
        return hidden

    def _forward_recomputed(self, hidden, cos, sin, cu_seqlens, max_seqlen):
        """The layers with full activation recomputation (``layers/recompute.py``): only each
        layer's input is kept for the backward."""
        for layer in self.layers:
            hidden = recompute.decoder_layer(layer, hidden, cos, sin, cu_seqlens, max_seqlen)
        return self.norm(hidden) if self.post_process else hidden

    def _forward_fused(self, hidden, cos, sin, cu_seqlens, max_seqlen, kv_cache):
        """The layers with each residual sum fused into the next norm (one kernel instead of
        two per layer; the same values: the sum is rounded as before, then normed). Generation
        only (a KV cache): launch-bound decode steps gain; training keeps ``forward``."""
        normed = self.layers[0].input_layernorm(hidden)
        for i, layer in enumerate(self.layers):
            residual, mlp_out = layer.forward_parts(hidden, normed, cos, sin, cu_seqlens,
                                                    max_seqlen, kv_cache, i)
            norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            hidden, normed = add_rms_norm(mlp_out, residual, norm.weight, norm.eps,
                                          norm.unit_offset)
        return normed


class ParallelModel(torch.nn.Module):
    """Common part of every variant: config, decoder stack, packing, loading.

    Subclasses set ``head_kind`` ("causal_lm" or "value") and ``padded_input``.
    """

    head_kind: ClassVar[str] = "causal_lm"
    padded_input: ClassVar[bool] = False
    architecture: ClassVar[str | None] = None  # set by the registry's named subclasses
    weight_map: ClassVar[ckpt_io.WeightMap | None] = None  # set by the registry too
    pipeline_stage: ClassVar[bool] = False  # PP variants: built for one pipeline stage
    model_type = ModelType.encoder_or_decoder  # read by megatron's schedules

    def __init__(self, config: ModelConfig, *, dtype=None, sequence_parallel: bool | None = None,
                 pre_process: bool | None = None, post_process: bool | None = None,
                 layer_ids: list[int] | None = None, vpp_chunk: int | None = None,
                 layers_per_stage: list[int] | None = None, layout=None):
        super().__init__()
        layout = layout_or_training(layout)
        self.parallel_layout = layout  # the layout this model was built in (its groups)
        if layout.pipeline_parallel_size > 1 and not self.pipeline_stage:
            raise ValueError(
                f"pipeline_parallel_size={layout.pipeline_parallel_size}: use the PP variant "
                f"({type(self).__name__}PP) or parallel_models.pipeline.build_pipeline_chunks")
        self.config = config
        self.dtype = resolve_dtype(dtype, resolve_dtype(config.torch_dtype))
        if sequence_parallel is None:
            sequence_parallel = layout.sequence_parallel
        self.mp_config = build_megatron_config(config, self.dtype, sequence_parallel, layout)
        self.sequence_parallel = self.mp_config.sequence_parallel
        self.tp = layout.tensor_parallel_size
        if self.pipeline_stage:
            from parallel_models.pipeline import stage_of_this_rank

            stage = stage_of_this_rank(config.num_layers, vpp_chunk, layers_per_stage, layout)
            pre_process = stage.pre_process if pre_process is None else pre_process
            post_process = stage.post_process if post_process is None else post_process
            layer_ids = stage.layer_ids if layer_ids is None else layer_ids
            self.vp_stage = vpp_chunk
        self.pre_process = True if pre_process is None else pre_process
        self.post_process = True if post_process is None else post_process
        pre_process, post_process = self.pre_process, self.post_process
        layer_ids = list(range(config.num_layers)) if layer_ids is None else list(layer_ids)
        self.model = ParallelDecoder(config, self.mp_config, layer_ids, pre_process, post_process,
                                     layout)
        device = "cpu" if self.mp_config.use_cpu_initialization else torch.cuda.current_device()
        self.share_embeddings_and_output_weights = (
            config.tie_word_embeddings and self.head_kind == "causal_lm")
        if pre_process and self.share_embeddings_and_output_weights:
            self.model.embed_tokens.weight.shared_embedding = True
        if post_process:
            if self.head_kind == "causal_lm":
                tied_here = self.share_embeddings_and_output_weights and pre_process
                self.lm_head = ParallelLMHead(
                    config.hidden_size, config.vocab_size, config.padded_vocab_size(self.tp),
                    mp_config=self.mp_config, tied=tied_here, init_std=config.initializer_range,
                    layout=layout)
                if self.share_embeddings_and_output_weights and not pre_process:
                    # the last stage's copy of the tied embedding: its gradient is summed with
                    # the first stage's, and grad norms count the pair once (megatron's flags)
                    self.lm_head.weight.shared = True
                    self.lm_head.weight.shared_embedding = True
            else:
                self.value_head = ValueHead(config.hidden_size, sequence_parallel=self.sequence_parallel,
                                            dtype=self.dtype, device=device)
        if device != "cpu":
            # megatron-core builds a few weights on the host whatever its layout (the MoE
            # router, which it moves on first use, and the shared-expert gate, which it never
            # moves: Qwen2-MoE failed on the GPU with "mat2 is on cpu")
            for t in (*self.parameters(), *self.buffers()):
                if t.device.type == "cpu":
                    t.data = t.data.to(device)
        self.load_report = None

    @property
    def device(self) -> torch.device:
        """Where this rank's weights live (the compute device once loaded; the host while
        offloaded)."""
        return next(self.parameters()).device

    # ---- pipeline plumbing ------------------------------------------------------------------
    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.model.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self):
        """The tied embedding/head weight of this stage (megatron's finalize_model_grads sums
        its gradient over the embedding group: first and last pipeline stage)."""
        if self.pre_process:
            return self.model.embed_tokens.weight
        if self.post_process and self.head_kind == "causal_lm":
            return self.lm_head.weight
        return None

    def output_weight(self):
        if self.head_kind != "causal_lm":
            return None
        if self.share_embeddings_and_output_weights and self.pre_process:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    # ---- packed (RmPad) core ---------------------------------------------------------------------
    # set by the interleaved pipeline runner: every microbatch padded to one token count
    pad_tokens_to: int | None = None

    def _pad_for_sequence_parallel(self, input_ids, position_ids, cu_seqlens):
        """Make the token count divisible by TP under SP (and equal to ``pad_tokens_to`` when
        set): the extra tokens form their own sequence and are cut after the head."""
        total = input_ids.shape[0]
        pad = (-total) % self.tp if self.sequence_parallel else 0
        if self.pad_tokens_to is not None:
            if self.pad_tokens_to < total + pad:
                raise ValueError(f"pad_tokens_to={self.pad_tokens_to} < {total + pad} tokens")
            pad = self.pad_tokens_to - total
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)])
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([total + pad])])
        return input_ids, position_ids, cu_seqlens, pad

    def forward_hidden(self, input_ids, cu_seqlens, position_ids=None, max_seqlen=None,
                       kv_cache=None):
        """Packed tokens -> final hidden states ``[tokens(+pad)(/tp), 1, hidden]`` and the pad."""
        if max_seqlen is None:  # from the host copy when there is one (no device sync)
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
        cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
        if position_ids is None:
            position_ids = position_ids_from_cu_seqlens(cu_seqlens)
        self.last_token_count = input_ids.shape[0]  # before padding (MoE aux loss reads it)
        if self.parallel_layout.context_parallel_size > 1:
            from parallel_models.context_parallel import sharded_forward_hidden

            return sharded_forward_hidden(self, input_ids, position_ids, cu_seqlens, kv_cache)
        input_ids, position_ids, cu_seqlens, pad = self._pad_for_sequence_parallel(
            input_ids, position_ids, cu_seqlens)
        max_seqlen = max(max_seqlen, pad)
        if kv_cache is not None and pad:
            raise ValueError("KV-cached decoding runs without sequence-parallel padding; use "
                             "parallel_models.inference.generation (it switches SP off)")
        aux = self.moe_aux_recording and kv_cache is None and self.config.is_moe
        received, incoming = None, None
        if aux and not self.pre_process:  # the earlier stages' load-balancing totals ride along
            received, incoming = moe_aux_carry.strip(self.model.input_tensor,
                                                     self.config.num_experts)
        hidden = self.model(input_ids, position_ids, cu_seqlens, max_seqlen, hidden=received,
                            kv_cache=kv_cache)
        if aux:
            totals = moe_aux_loss.collect(self, incoming)
            if self.post_process:
                self.moe_aux_totals = totals  # for load_balancing_loss
            else:
                hidden = moe_aux_carry.append(hidden, totals)
        return hidden, pad

    def _head(self, hidden, pad, full_vocab):
        """Final hidden -> logits or values of the real tokens (``pad``: the padding count, or
        the CP shard whose outputs are gathered back to the original order). Under CP and for
        long inputs the LM head runs on first use (``heads/lm_output.py``)."""
        cp_shard = None if isinstance(pad, int) else pad
        if self.head_kind == "causal_lm":
            return causal_lm_head(self, hidden, pad, full_vocab)
        values = self.value_head(hidden)
        if cp_shard is not None:
            return cp_shard.gather_outputs(values)
        return values[: values.shape[0] - pad]

    def forward_packed(self, input_ids, cu_seqlens, position_ids=None, max_seqlen=None,
                       full_vocab: bool = False):
        if input_ids.dim() != 1:
            raise ValueError(f"packed input_ids must be 1-D (total_tokens,), got shape "
                             f"{tuple(input_ids.shape)}; use the padded variant for (batch, seq)")
        hidden, pad = self.forward_hidden(input_ids, cu_seqlens, position_ids, max_seqlen)
        if not self.post_process:
            return hidden
        out = self._head(hidden, pad, full_vocab)
        if self.head_kind == "causal_lm":
            return CausalLMOutput(out) if torch.is_tensor(out) else out
        return ValueOutput(out)

    def forward_padded(self, input_ids, attention_mask=None, position_ids=None,
                       full_vocab: bool = False):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        packed = pack_padded_batch(input_ids, attention_mask, position_ids)
        out = self.forward_packed(packed.input_ids, packed.cu_seqlens, packed.position_ids,
                                  packed.max_seqlen, full_vocab=full_vocab)
        if not self.post_process:
            return out
        if self.head_kind == "causal_lm":
            return CausalLMOutput(unpack_to_padded(out.logits, packed))
        return ValueOutput(unpack_to_padded(out.values, packed))

    # ---- MoE load-balancing loss (off by default) ------------------------------------------------
    moe_aux_recording: bool = False  # set by record_router_logits
    moe_aux_totals = None  # the last forward's RouterTotals (the last pipeline stage's)

    def pipeline_extra_rows(self) -> int:
        """Rows this chunk's pipeline messages carry beyond the tokens (per TP rank): the
        load-balancing totals while the router logits are recorded (``moe_aux_carry``)."""
        if not (self.moe_aux_recording and self.config.is_moe) or \
                (self.pre_process and self.post_process):
            return 0
        return moe_aux_carry.carry_rows(self.config.num_experts, self.config.hidden_size,
                                        self.mp_config.pipeline_dtype)

    def record_router_logits(self, enabled: bool = True) -> None:
        """Keep the router logits of the next forwards (for :meth:`router_aux_loss`)."""
        moe_aux_loss.record_router_logits(self, enabled)

    def router_aux_loss(self) -> torch.Tensor:
        """transformers' load-balancing loss of the last forward (see ``layers/moe_aux_loss``);
        the trainer scales it by ``config.router_aux_loss_coef``."""
        return moe_aux_loss.load_balancing_loss(self)

    # ---- loading -----------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, *, dtype=None, sequence_parallel: bool | None = None,
                        pre_process: bool | None = None, post_process: bool | None = None,
                        layer_ids: list[int] | None = None, vpp_chunk: int | None = None,
                        layers_per_stage: list[int] | None = None, value_head_seed: int = 0,
                        strict: bool = True, layout=None):
        """Build this rank's shard and fill it from an HF folder (or hub id) or a megatron-core
        dist checkpoint (the format is told from the folder, once).

        Each rank reads only its own slices of the checkpoint (PP variants: only the layers of
        their stage / virtual chunk ``vpp_chunk``). Value variants take ``score.weight`` of a
        ``*ForSequenceClassification`` checkpoint, or a fresh head. ``layout``: the
        ``ParallelLayout`` to build in (default: the training layout).
        """
        if cls.weight_map is None:
            raise ConfigError(f"{cls.__name__} has no weight map: load through a named class "
                              "(e.g. LlamaForCausalLM) or AutoModelForCausalLM")
        path = ckpt_io.resolve_model_path(path)
        config = ckpt_io.model_config_of(path)  # any format (Megatron-LM / Bridge layouts too)
        reader = ckpt_io.open_checkpoint(path, cls.weight_map, config)
        model = cls(config, dtype=dtype, sequence_parallel=sequence_parallel,
                    pre_process=pre_process, post_process=post_process, layer_ids=layer_ids,
                    vpp_chunk=vpp_chunk, layers_per_stage=layers_per_stage, layout=layout)
        model.load_report = ckpt_io.load_weights(model, reader, cls.weight_map,
                                                 value_head_seed=value_head_seed, strict=strict)
        model.name_or_path = path
        return model

    def save_pretrained(self, out_dir: str, **kwargs) -> dict:
        """Gather this model to an HF folder (call on every rank; rank 0 writes). See
        ``checkpoint_utils.saver.save_pretrained`` for the options."""
        return ckpt_io.save_pretrained(self, out_dir, **kwargs)

    def save_mcore(self, out_dir: str, **kwargs) -> dict:
        """Write a megatron-core GPTModel dist checkpoint (loadable at any TP/PP, also by
        ``from_pretrained``). Call on every rank. See ``checkpoint_utils.mcore_saver``."""
        return ckpt_io.save_mcore(self, out_dir, **kwargs)


class CausalLMRmPad(ParallelModel):
    """Packed input: ``model(input_ids[total], cu_seqlens)`` -> ``.logits [total, vocab(/tp)]``."""

    head_kind = "causal_lm"

    def forward(self, input_ids, cu_seqlens, position_ids=None, max_seqlen=None,
                full_vocab: bool = False):
        return self.forward_packed(input_ids, cu_seqlens, position_ids, max_seqlen, full_vocab)


class CausalLM(ParallelModel):
    """Padded input: ``model(input_ids, attention_mask)`` -> ``.logits [batch, seq, vocab(/tp)]``."""

    head_kind = "causal_lm"
    padded_input = True

    def forward(self, input_ids, attention_mask=None, position_ids=None, full_vocab: bool = False):
        return self.forward_padded(input_ids, attention_mask, position_ids, full_vocab)


class ValueRmPad(ParallelModel):
    """Packed input -> ``.values [total]`` (one scalar per token)."""

    head_kind = "value"

    def forward(self, input_ids, cu_seqlens, position_ids=None, max_seqlen=None):
        return self.forward_packed(input_ids, cu_seqlens, position_ids, max_seqlen)


class Value(ParallelModel):
    """Padded input -> ``.values [batch, seq]`` (zeros at padding)."""

    head_kind = "value"
    padded_input = True

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.forward_padded(input_ids, attention_mask, position_ids)
