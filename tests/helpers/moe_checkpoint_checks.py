"""Worker functions of the MoE checkpoint tests (tests/models/test_moe.py) run on gloo ranks:
save_pretrained, hf2mcore / mcore2hf and save_mcore round trips, megatron-core's GPTModel loading
our megatron-core output."""

from __future__ import annotations

import torch

from tests.helpers.moe_checks import ARCH


def _folder_diff(want_folder: str, got_folder: str) -> dict:
    """Tensors of two HF folders: names that differ, are missing from / extra in ``got``."""
    from tests.helpers.ppo_runs import load_folder

    want, got = load_folder(want_folder), load_folder(got_folder)
    return {"differ": sorted(k for k in want.keys() & got.keys()
                             if not torch.equal(want[k], got[k])),
            "missing": sorted(want.keys() - got.keys()),
            "extra": sorted(got.keys() - want.keys()), "count": len(got)}


def check_moe_save_round_trip(folders: dict, out_root: str, tp: int, ep: int, pp: int = 1
                              ) -> dict:
    """HF -> ours (TP x EP x PP) -> save_pretrained -> HF: which tensors differ (bit-exact is
    the goal), which are missing or extra, on rank 0."""
    import torch.distributed as dist

    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=tp, expert_model_parallel_size=ep,
                     pipeline_parallel_size=pp)
    out = {}
    for (family, head), path in folders.items():
        cls = pm.get_model_class(ARCH[family], head, pp=pp > 1)
        layers = pm.ModelConfig.from_hf(path).num_layers
        kw = {}
        if pp == 2 and layers % 2:
            kw["layers_per_stage"] = [layers - layers // 2, layers // 2]
        model = cls.from_pretrained(path, dtype=torch.float32, **kw)
        target = f"{out_root}/{family}_{head}_tp{tp}_ep{ep}_pp{pp}"
        model.save_pretrained(target)
        if dist.get_rank() == 0:
            out[family] = _folder_diff(path, target)
    return out


def convert_round_trip(folders: dict, out_root: str) -> dict:
    """HF -> hf2mcore -> mcore2hf (one process): differing / missing / extra tensors."""
    from conversion.hf2mcore import convert_hf_to_mcore
    from conversion.mcore2hf import convert_mcore_to_hf

    out = {}
    for (family, head), path in folders.items():
        mcore = f"{out_root}/{family}_{head}_mcore"
        back = f"{out_root}/{family}_{head}_back"
        convert_hf_to_mcore(path, mcore, progress=False, format="flat")  # read as a folder below
        convert_mcore_to_hf(mcore, back, progress=False)
        out[family] = {**_folder_diff(path, back), "mcore": mcore}
    return out


def check_mcore_loads(cases: dict, tp: int, ep: int) -> dict:
    """Each case family -> (hf folder, mcore folder): (1) megatron-core's own GPTModel (MoE block
    spec, local, saving its norms under the transformer-engine spec's names as hf2mcore's default
    ``--layer-spec te`` writes them: ``moe_spec_names.rename_norms``) at TP x EP loads the dist
    checkpoint and its logits match transformers';
    (2) our model loads it (``from_pretrained`` on the mcore folder) and matches too."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import parallel_models as pm
    from parallel_models import cpu_shim
    from parallel_models.llama.checkpoint_utils import build_gpt_model
    from tests.helpers.checkpoint_checks import _megatron_logits, hf_logits, token_batch
    from tests.helpers.moe_spec_names import rename_norms

    pm.init_parallel(tensor_parallel_size=tp, expert_model_parallel_size=ep,
                     sequence_parallel=tp > 1)
    out = {}
    for family, (hf_path, mcore) in cases.items():
        cfg = pm.ModelConfig.from_hf(hf_path)
        ids = token_batch(cfg.vocab_size)
        want = hf_logits(hf_path, ids)
        with cpu_shim.cuda_to_cpu():
            model_parallel_cuda_manual_seed(0)
            model = build_gpt_model(mcore, layer_spec="local", parallel_output=False,
                                    transformer_config={"perform_initialization": False,
                                                        "expert_model_parallel_size": ep})
            # (eval mode: megatron's MoE layer asks for SP only when training, and its local
            # spec's torch norms refuse SP)
            rename_norms(model.eval(), "te")
            loaded = dist_checkpointing.load(model.sharded_state_dict(), mcore)
            model.load_state_dict(loaded)
            got = _megatron_logits(model, ids, cfg.vocab_size)
        ours = pm.AutoModelForCausalLM.from_pretrained(mcore, dtype=torch.float32)
        with torch.no_grad():
            mine = ours(ids, full_vocab=True).logits
        out[family] = {"megatron": (got - want).abs().max().item(),
                       "ours": (mine - want).abs().max().item()}
    return out


def check_save_mcore_round_trip(folders: dict, out_root: str, tp: int, ep: int) -> dict:
    """HF -> ours (TP x EP) -> save_mcore -> mcore2hf: tensors that differ (bit-exact is the
    goal), missing or extra, on rank 0."""
    import torch.distributed as dist

    import parallel_models as pm
    from conversion.mcore2hf import convert_mcore_to_hf

    pm.init_parallel(tensor_parallel_size=tp, expert_model_parallel_size=ep)
    out = {}
    for (family, head), path in folders.items():
        model = pm.get_model_class(ARCH[family], head).from_pretrained(path, dtype=torch.float32)
        mcore = f"{out_root}/{family}_{head}_saved_mcore_tp{tp}_ep{ep}"
        model.save_mcore(mcore, format="flat")
        if dist.get_rank() == 0:
            back = mcore + "_hf"
            convert_mcore_to_hf(mcore, back, progress=False)
            out[family] = _folder_diff(path, back)
    return out
