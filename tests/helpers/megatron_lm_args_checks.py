"""Loading our ``--format megatron-lm`` output the way Megatron-LM and Megatron-Bridge's
Megatron-LM compatibility path do (issue 38 item 3), on gloo ranks.

Neither Megatron-LM's ``megatron/training`` nor Megatron-Bridge is installed here (megatron-core
ships neither), so this runs megatron-core's own pieces they call, on the attributes they read:

- the common state through ``dist_checkpointing.load_common_state_dict`` (what Bridge's
  ``mlm_compat/arguments.py::_load_args_from_checkpoint`` calls; Megatron-LM's
  ``_load_base_checkpoint`` reads ``args``, ``iteration``, ``checkpoint_version`` from it);
- the ``TransformerConfig`` as Bridge's ``_transformer_config_from_args`` builds it: every
  ``TransformerConfig`` field the args carry, then its explicit reads (``READ_BY_BRIDGE``);
  megatron-core validates it in ``__post_init__``;
- the ``GPTModel`` as Bridge's ``mlm_compat/model.py::_gpt_provider`` builds it (MoE: the
  decoder block spec for ``args.transformer_impl``) from the args, loading the weights under
  ``"model"`` as Megatron-LM's ``generate_state_dict`` declares them.
"""

from __future__ import annotations

import dataclasses

# attributes read without a default (an AttributeError when absent), cited from
# Megatron-LM megatron/training/checkpointing.py (check_checkpoint_args: num_layers, hidden_size,
# num_attention_heads; with --vocab-file: max_position_embeddings, make_vocab_size_divisible_by,
# tokenizer_type) and Megatron-Bridge src/megatron/bridge/training/mlm_compat/{arguments,model}.py
READ_BY_MEGATRON_LM = ("num_layers", "hidden_size", "num_attention_heads",
                       "max_position_embeddings", "make_vocab_size_divisible_by", "tokenizer_type")
READ_BY_BRIDGE = (
    # _transformer_config_from_args
    "multi_latent_attention", "heterogeneous_layers_config_path", "no_persist_layer_norm",
    "apply_layernorm_1p", "norm_epsilon", "params_dtype", "overlap_p2p_comm", "num_experts",
    "rotary_interleaved", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "fp8_param_gather", "swiglu", "bias_swiglu_fusion", "bias_gelu_fusion", "squared_relu",
    "init_method_xavier_uniform", "group_query_attention", "num_query_groups",
    "config_logger_dir", "cp_comm_type", "is_hybrid_model",
    # _gpt_provider / _get_transformer_layer_spec / _get_model
    "transformer_impl", "normalization", "qk_l2_norm", "moe_grouped_gemm", "qk_layernorm",
    "mtp_num_layers", "padded_vocab_size", "max_position_embeddings", "fp16_lm_cross_entropy",
    "untie_embeddings_and_output_weights", "position_embedding_type", "rotary_percent",
    "rotary_base", "use_rope_scaling", "init_model_with_meta_device", "fp16", "bf16")
# settings that need transformer-engine / GPU kernels, turned off to build on the CPU (they change
# no parameter or key): Bridge's grouped GEMM (TEGroupedMLP; the keys are SequentialMLP's) and
# fused permutation
CPU_OFF = {"moe_grouped_gemm": False, "moe_permute_fusion": False}


def bridge_transformer_config(args):
    """Bridge's ``_transformer_config_from_args`` steps, on megatron-core's TransformerConfig."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig)
          if hasattr(args, f.name)}
    kw.update(persist_layer_norm=not args.no_persist_layer_norm,
              layernorm_zero_centered_gamma=args.apply_layernorm_1p,
              layernorm_epsilon=args.norm_epsilon, deallocate_pipeline_outputs=True,
              pipeline_dtype=args.params_dtype, batch_p2p_comm=not args.overlap_p2p_comm,
              num_moe_experts=args.num_experts, rotary_interleaved=args.rotary_interleaved,
              num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
              num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
              fp8_param=args.fp8_param_gather, config_logger_dir=args.config_logger_dir)
    if args.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True,
                  bias_activation_fusion=args.bias_swiglu_fusion)
    else:
        kw["bias_activation_fusion"] = args.bias_gelu_fusion
    kw["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    if len(args.cp_comm_type) == 1:
        kw["cp_comm_type"] = args.cp_comm_type[0]
    # the CPU: no fused kernels, CPU initialization
    kw.update(CPU_OFF, use_cpu_initialization=True, bias_activation_fusion=False,
              bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
              persist_layer_norm=False, gradient_accumulation_fusion=False,
              perform_initialization=False)
    return TransformerConfig(**kw)


def load_as_megatron_lm(cases: dict) -> dict:
    """Each case name -> (run folder written with --format megatron-lm, HF folder): the checks
    above; returns {name: {"missing": attributes absent, "iteration", "version", "logits"}}."""
    import os

    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import parallel_models as pm
    from parallel_models import cpu_shim, megatron_fixes
    from tests.helpers.checkpoint_checks import _megatron_logits, hf_logits, token_batch

    megatron_fixes.apply()
    pm.init_parallel(tensor_parallel_size=1)
    out = {}
    for name, (root, hf) in cases.items():
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            folder = os.path.join(root, f"iter_{int(f.read().strip()):07d}")
        common = dist_checkpointing.load_common_state_dict(folder)
        args = common["args"]
        missing = [a for a in READ_BY_MEGATRON_LM + READ_BY_BRIDGE if not hasattr(args, a)]
        res = {"missing": missing, "iteration": common.get("iteration"),
               "version": common.get("checkpoint_version"), "impl": args.transformer_impl}
        if not missing:
            with cpu_shim.cuda_to_cpu():
                model_parallel_cuda_manual_seed(0)
                config = bridge_transformer_config(args)
                use_te = args.transformer_impl == "transformer_engine"
                spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                   normalization=args.normalization,
                                                   qk_l2_norm=args.qk_l2_norm)
                        if args.num_experts else
                        get_gpt_layer_local_spec(num_experts=args.num_experts,
                                                 moe_grouped_gemm=False,
                                                 qk_layernorm=args.qk_layernorm,
                                                 normalization=args.normalization))
                model = GPTModel(
                    config=config, transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=False,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                    rope_scaling=args.use_rope_scaling).eval()
                loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)
                model.load_state_dict(loaded["model"])
                cfg = pm.ModelConfig.from_hf(hf)
                ids = token_batch(cfg.vocab_size)
                got = _megatron_logits(model, ids, cfg.vocab_size)
            res["logits"] = (got - hf_logits(hf, ids)).abs().max().item()
            res["moe"] = {k: getattr(config, k) for k in (
                "moe_layer_freq", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                "moe_router_dtype")} if args.num_experts else {}
        out[name] = res
    return out
