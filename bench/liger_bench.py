"""Training throughput against transformers AND transformers + Liger kernels, in ONE process on
the same weights, contenders alternated over rounds (``common.alternate``).

    python bench/liger_bench.py [--layers 16 --hidden 2048 ...] [--rounds 3] [--out r.json]

Contenders (bf16, one GPU, fwd+bwd, loss = mean token cross-entropy):
- ``hf``: transformers (SDPA), its own ``labels`` loss;
- ``hf_liger``: a second transformers model with Liger's kernels swapped in per instance (RMSNorm,
  SwiGLU MLP, RoPE, fused linear cross-entropy on the final hidden states) - what
  ``apply_liger_kernel_to_llama`` patches, without patching the plain contender (Liger's own
  helper patches module globals, which would turn the ``hf`` contender into Liger too);
- ``ours``: ``LlamaForCausalLMRmPad`` (packed, fused vocab-parallel log-probs) as it trains:
  in megatron-core DDP (``utils.optimizer.wrap_for_training``: fp32 gradient buffers, cleared
  by ``zero_grad_buffer()`` each step and written by its backward);
- ``ours_plain``: a second instance without DDP, gradients in ``.grad`` (bf16) as the
  transformers contenders' are.
Every step starts from cleared gradients, as training does (``zero_grad(set_to_none=True)`` for
the plain modules: their backward then writes ``.grad`` without an add);
- ``ours_fused_wgrad`` (with ``--wgrad-fusion``): ``ours`` with the weight-gradient GEMMs
  accumulating straight into the buffers (``utils/wgrad_fusion.py``, opt-in).
Cases: ``uniform`` (micro-batch x seq, no padding) and ``ragged`` (an RL-like batch, lengths
uniform in [256, seq], the HF contenders padded, ours packed; effective tokens/s counts real
tokens). Losses of the three are checked against each other first (bf16 tolerance).
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
from common import (add_llama_shape_args, alternate, gpu_state, kernel_table, ragged_batch,
                    report, save_llama_model)


def liger_model(folder, dev):
    """A transformers Llama with Liger's modules in place of its own (same weights)."""
    from liger_kernel.transformers import LigerRMSNorm, LigerSwiGLUMLP
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").to(dev)
    cfg = model.config

    def norm(old):
        new = LigerRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps).to(dev, torch.bfloat16)
        new.weight.data.copy_(old.weight.data)
        return new

    for layer in model.model.layers:
        layer.input_layernorm = norm(layer.input_layernorm)
        layer.post_attention_layernorm = norm(layer.post_attention_layernorm)
        mlp = LigerSwiGLUMLP(cfg).to(dev, torch.bfloat16)
        mlp.load_state_dict(layer.mlp.state_dict())
        layer.mlp = mlp
    model.model.norm = norm(model.model.norm)
    return model


@contextlib.contextmanager
def liger_rope():
    """Liger's RoPE kernel in transformers' Llama attention, only while the Liger contender runs."""
    from liger_kernel.transformers import liger_rotary_pos_emb
    from transformers.models.llama import modeling_llama

    saved = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = liger_rotary_pos_emb
    try:
        yield
    finally:
        modeling_llama.apply_rotary_pos_emb = saved


def main():
    p = argparse.ArgumentParser()
    add_llama_shape_args(p)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cases", default="uniform,ragged")
    p.add_argument("--out", default=None)
    p.add_argument("--clock-log-ms", type=int, default=50,
                   help="nvidia-smi sampling period beside the timed steps (0: off)")
    p.add_argument("--wgrad-fusion", action="store_true",
                   help="add the contender ours_fused_wgrad (utils/wgrad_fusion.py)")
    p.add_argument("--profile", default=None,
                   help="folder: a kernel table per case and contender (one step each)")
    args = p.parse_args()

    import parallel_models as pm
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    from parallel_models.utils import wgrad_fusion
    from parallel_models.utils.optimizer import wrap_for_training
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits
    from transformers import AutoModelForCausalLM

    pm.init_parallel()
    dev = pm.compute_device()
    cfg, folder = save_llama_model(args, max_positions=max(8192, args.seq))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                              attn_implementation="sdpa").to(dev)
    hfl = liger_model(folder, dev)
    ours_plain = pm.LlamaForCausalLMRmPad.from_pretrained(folder, dtype=torch.bfloat16)
    [ours] = wrap_for_training(pm.LlamaForCausalLMRmPad.from_pretrained(folder,
                                                                         dtype=torch.bfloat16))
    lce = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "args": vars(args), "gpu_state_start": gpu_state()}

    def hf_loss(ids, mask):
        labels = ids.masked_fill(mask == 0, -100)
        return hf(input_ids=ids, attention_mask=mask, labels=labels).loss

    def liger_loss(ids, mask):
        with liger_rope():
            hidden = hfl.model(input_ids=ids, attention_mask=mask).last_hidden_state
        labels = ids.masked_fill(mask == 0, -100)[:, 1:]
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        return lce(hfl.lm_head.weight, h, labels.reshape(-1))

    def ours_loss(ids, cu, model=ours):
        logits = model(ids, cu).logits
        n = int(cu[-1]) - (len(cu) - 1)  # predicted tokens: every token but each sequence's first
        return -log_probs_from_packed_logits(logits, ids, cu).sum() / n

    def fresh(model, loss):
        """``loss().backward()`` from cleared (None) gradients, as a training step runs."""
        model.zero_grad(set_to_none=True)
        loss().backward()

    def ours_step(packed, fuse: bool = False):
        """Ours in DDP: a training step starts from ``zero_grad_buffer()`` (the buffers' first
        backward writes them, utils/grad_first_write.py)."""
        if args.wgrad_fusion:
            wgrad_fusion.enable([ours], on=fuse)
        ours.zero_grad_buffer()
        ours_loss(packed.input_ids, packed.cu_seqlens).backward()

    def contenders(ids, mask, packed):
        out = {"hf": lambda: fresh(hf, lambda: hf_loss(ids, mask)),
               "hf_liger": lambda: fresh(hfl, lambda: liger_loss(ids, mask)),
               "ours": lambda: ours_step(packed),
               "ours_plain": lambda: fresh(ours_plain, lambda: ours_loss(
                   packed.input_ids, packed.cu_seqlens, ours_plain))}
        if args.wgrad_fusion:
            out["ours_fused_wgrad"] = lambda: ours_step(packed, fuse=True)
        return out

    def run_case(name, ids, mask, real_tokens):
        packed = pm.pack_padded_batch(ids, mask)
        with torch.no_grad():
            losses = {"hf": float(hf_loss(ids, mask)), "hf_liger": float(liger_loss(ids, mask)),
                      "ours": float(ours_loss(packed.input_ids, packed.cu_seqlens))}
        spread = max(losses.values()) - min(losses.values())
        assert spread < 2e-2 * abs(losses["hf"]), f"{name}: losses disagree {losses}"
        timing = alternate(contenders(ids, mask, packed), rounds=args.rounds, warmup=2, iters=5,
                           clock_log_ms=args.clock_log_ms)
        if args.profile:  # after the timed rounds: the profiler does not disturb them
            os.makedirs(args.profile, exist_ok=True)
            for c, fn in contenders(ids, mask, packed).items():
                if c in ("ours", "hf_liger"):  # the pair the targets compare
                    kernel_table(fn, os.path.join(args.profile, f"{name}_{c}.txt"))
        r = {"real_tokens": real_tokens, "padded_tokens": ids.numel(), "losses": losses,
             "gpu_state_per_round": timing.pop("gpu_state_per_round")}
        for c, t in timing.items():
            r[c] = {"tok_s_median": real_tokens / t["median_s"], "spread": t["spread"],
                    "step_s_rounds": t["rounds_s"],
                    "clock_normalized_spread": t.get("clock_normalized_spread"),
                    "rounds": t["rounds"]}
        r["ours_over_hf"] = timing["hf"]["median_s"] / timing["ours"]["median_s"]
        r["ours_over_hf_liger"] = timing["hf_liger"]["median_s"] / timing["ours"]["median_s"]
        if args.wgrad_fusion:
            r["fused_wgrad_over_ours"] = (timing["ours"]["median_s"]
                                          / timing["ours_fused_wgrad"]["median_s"])
        for m in (hf, hfl, ours_plain):
            m.zero_grad(set_to_none=True)
        ours.zero_grad_buffer()
        res[name] = r

    B, S = args.micro_batch, args.seq
    if "uniform" in args.cases:
        ids = torch.randint(0, args.vocab, (B, S), device=dev)
        run_case("uniform", ids, torch.ones_like(ids), B * S)
    if "ragged" in args.cases:  # as many real tokens as 2 uniform batches, lengths in [256, S]
        lengths, ids, mask = ragged_batch(B * S * 2, S, args.vocab, dev)
        run_case("ragged", ids, mask, sum(lengths))
    res["gpu_state_end"] = gpu_state()
    report(res, args.out)
    pm.destroy_parallel()


if __name__ == "__main__":
    main()
