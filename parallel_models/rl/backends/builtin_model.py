"""The built-in models of the main job, built on the spot with random weights: the default tiny
Llama (``model.path`` null) and a tiny Qwen3-MoE (``model.path=builtin-moe``). Their configs live
here, apart from the trainer, so config checks can read them (e.g. the expert count)."""

from __future__ import annotations

import os
import shutil

BUILTIN_MOE = "builtin-moe"  # model.path of the built-in tiny Qwen3-MoE


def builtin_model_config(vocab_size: int, tokenizer=None, moe: bool = False):
    """The default job's tiny Llama: 2 layers, hidden 64, 4 heads (2 KV heads); ``moe``: the
    same shape as a Qwen3-MoE with 4 experts (top-2, intermediate 64) in every layer."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    special = {} if tokenizer is None else dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    if moe:
        return Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=64, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[],
                              max_position_embeddings=512, tie_word_embeddings=False,
                              architectures=["Qwen3MoeForCausalLM"], **special)
    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"], **special)


def build_builtin_model(folder: str, tokenizer, seed: int = 0, moe: bool = False) -> str:
    """The default job's tiny Llama (or Qwen3-MoE; random weights) and its tokenizer, saved as
    an HF folder.

    The weights come from their own random stream, seeded by ``seed`` alone: the process's
    random state (torch, and so the trainer's sampling and value-head draws after it) is the
    same after this call as before, so a run does not depend on whether its folder already
    held the built-in model."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = builtin_model_config(len(tokenizer), tokenizer, moe=moe)
    with torch.random.fork_rng(devices=[]):  # the process's torch RNG is restored on exit
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar says nothing
    try:
        model.save_pretrained(tmp)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder
