"""Worker functions of tests/conversion/test_stacked_moe.py, run on gloo ranks: megatron-core's
own GPTModel (MoE block spec, local) saving an MoE model in the layout it uses for an integer
``moe_layer_freq`` (every layer MoE: the layers stacked under one key, routed experts with a
leading [layer, expert] pair of axes), and our model loading such a checkpoint at other TP/EP."""

from __future__ import annotations

import torch


def megatron_saves_stacked(cases: dict, out_root: str, tp: int, ep: int) -> dict:
    """Each case family -> our per-layer dist checkpoint (hf2mcore, ``mcore-local`` names): a
    megatron-core GPTModel with the list ``moe_layer_freq`` of that checkpoint loads it, a second
    one built with the integer ``moe_layer_freq=1`` (the same modules) takes its weights and
    saves itself with megatron-core's default ``dist_checkpointing.save`` at TP=``tp``,
    EP=``ep``. Returns {family: saved folder}."""
    import multiprocessing
    import os

    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import parallel_models as pm
    from parallel_models import cpu_shim
    from parallel_models.llama.checkpoint_utils import build_gpt_model

    # megatron-core's default save forks writer processes, which a daemon process may not do
    multiprocessing.current_process()._config["daemon"] = False
    pm.init_parallel(tensor_parallel_size=tp, expert_model_parallel_size=ep)
    out = {}
    for family, ours in cases.items():
        target = f"{out_root}/{family}_stacked_tp{tp}_ep{ep}"
        with cpu_shim.cuda_to_cpu():
            model_parallel_cuda_manual_seed(0)
            tc = {"perform_initialization": False, "expert_model_parallel_size": ep}
            listed = build_gpt_model(ours, layer_spec="local", transformer_config=tc)
            listed.load_state_dict(dist_checkpointing.load(listed.sharded_state_dict(), ours))
            stacked = build_gpt_model(ours, layer_spec="local",
                                      transformer_config={**tc, "moe_layer_freq": 1})
            stacked.load_state_dict(listed.state_dict())
            if torch.distributed.get_rank() == 0:
                os.makedirs(target)
            torch.distributed.barrier()
            dist_checkpointing.save(stacked.sharded_state_dict(), target)
        out[family] = target
    return out


def ours_load_stacked(cases: dict, tp: int, ep: int) -> dict:
    """Each case family -> (HF folder, stacked dist checkpoint): our model at TP=``tp``,
    EP=``ep`` loaded from each; the names of the parameters whose shards differ."""
    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=tp, expert_model_parallel_size=ep)
    out = {}
    for family, (hf, stacked) in cases.items():
        want = dict(pm.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
                    .named_parameters())
        got = dict(pm.AutoModelForCausalLM.from_pretrained(stacked, dtype=torch.float32)
                   .named_parameters())
        out[family] = {"differ": sorted(k for k in want if not torch.equal(want[k], got[k])),
                       "count": len(got)}
    return out
