"""MoE dist checkpoints in megatron-core's stacked layout (issue 38 item 1 and 2): megatron-core's
own GPTModel with an integer ``moe_layer_freq`` saves every-layer-MoE models with the layers
stacked under one key (``decoder.layers.mlp.experts.experts.linear_fc1.weight`` [L, E, 2F, H]),
as Megatron-Bridge does. Such checkpoints, saved by megatron-core itself at TP=1, TP=2 and EP=2,
convert back with ``mcore2hf`` bit for bit to the original HF weights, with ``--hf-config`` and
without (the settings then come from a Bridge ``run_config.yaml`` holding ``moe_layer_freq: 1``,
as Bridge writes it), and our model loads them at another TP / EP exactly as from the HF folder.
"""

import json
import os

import pytest
import torch

from parallel_models.testing import run_named_jobs
from tests.helpers import stacked_moe_checks
from tests.helpers.checkpoint_setup import assert_bit_exact
from tests.helpers.moe_checks import MOE_FAMILIES, save_moe_model

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, ep) megatron-core saves at
# every layer MoE (an integer moe_layer_freq stacks the layers only when they are all alike);
# a vocab of 256 is a multiple of megatron's padding (128 x TP), so the stored rows are the vocab
ALL_MOE = {"qwen3_moe": {"mlp_only_layers": []}, "qwen2_moe": {"mlp_only_layers": []},
           "mixtral": {}}


def _bridge_run_config(ours: str, folder: str) -> None:
    """The run_config.yaml Megatron-Bridge saves beside such a checkpoint: its model settings
    with the integer ``moe_layer_freq`` Bridge writes (the rest as our bridge format writes)."""
    import yaml

    from parallel_models.llama.checkpoint_utils.megatron_layout import bridge_run_config

    with open(os.path.join(ours, "mcore_config.json")) as f:
        run = bridge_run_config(json.load(f))
    run["model"]["moe_layer_freq"] = 1
    with open(os.path.join(folder, "run_config.yaml"), "w") as f:
        yaml.safe_dump(run, f, sort_keys=False)


@pytest.fixture(scope="module")
def stacked(tmp_path_factory):
    from conversion.hf2mcore import convert_hf_to_mcore

    root = tmp_path_factory.mktemp("stacked")
    hf, ours = {}, {}
    for family in MOE_FAMILIES:
        hf[family] = save_moe_model(str(root / family), family, vocab_size=256, **ALL_MOE[family])
        ours[family] = str(root / f"{family}_ours")
        convert_hf_to_mcore(hf[family], ours[family], progress=False, format="flat",
                            layer_spec="mcore-local")
    named = [(("save", tp, ep), tp * ep, (stacked_moe_checks.megatron_saves_stacked,
                                          (ours, str(root), tp, ep))) for tp, ep in LAYOUTS]
    saved = run_named_jobs(named, timeout=900)
    folders = {(tp, ep): saved[("save", tp, ep)][0] for tp, ep in LAYOUTS}
    for by_family in folders.values():
        for family, folder in by_family.items():
            _bridge_run_config(ours[family], folder)
    return {"root": root, "hf": hf, "folders": folders}


@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_megatron_core_saves_moe_layers_stacked(stacked, tp, ep):
    """The premise: megatron-core's own save of these models is the stacked layout."""
    from parallel_models.llama.checkpoint_utils.dcp import read_dcp_metadata

    for family, folder in stacked["folders"][(tp, ep)].items():
        md = read_dcp_metadata(folder).state_dict_metadata
        fc1 = md["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
        layers, experts = (3, 4) if family != "mixtral" else (2, 4)
        assert tuple(fc1.size)[:2] == (layers, experts), (family, fc1.size)
        assert not any(k.startswith("decoder.layers.0.") for k in md), family


@pytest.mark.parametrize("with_hf_config", [True, False], ids=["hf_config", "run_config"])
@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_mcore2hf_reads_stacked_moe_bit_exact(stacked, tp, ep, with_hf_config):
    from conversion.mcore2hf import convert_mcore_to_hf

    for family, folder in stacked["folders"][(tp, ep)].items():
        hf = stacked["hf"][family]
        out = str(stacked["root"] / f"{family}_{tp}_{ep}_{with_hf_config}_hf")
        convert_mcore_to_hf(folder, out, progress=False,
                            hf_config=hf if with_hf_config else None)
        assert_bit_exact(hf, out)


def test_from_pretrained_reads_stacked_moe_at_other_tp_ep(stacked):
    """Our model at TP=2 x EP=2 from the TP=1 stacked save, and at TP=1 from the EP=2 one: every
    shard equal to the one loaded from the HF folder."""
    cases = {(2, 2): stacked["folders"][(1, 1)], (1, 1): stacked["folders"][(1, 2)]}
    named = [(("load", tp, ep), tp * ep, (stacked_moe_checks.ours_load_stacked,
                                          ({f: (stacked["hf"][f], d) for f, d in by.items()},
                                           tp, ep)))
             for (tp, ep), by in cases.items()]
    results = run_named_jobs(named, timeout=900)
    for name, per_rank in results.items():
        for rank, res in enumerate(per_rank):
            for family, r in res.items():
                assert r["count"] > 0 and r["differ"] == [], (name, rank, family, r)


def test_stacked_reader_byte_ranges_cover_whole_tensors(stacked):
    """mcore2hf copies a stacked tensor's rows verbatim where the chunk stores them whole (TP=1):
    the byte ranges give exactly the tensor read through the general path."""
    from parallel_models.llama.checkpoint_utils.direct_io import RangeReader
    from parallel_models.llama.checkpoint_utils.mcore_reader import McoreCheckpoint
    from parallel_models.registry import weight_map_of

    folder = stacked["folders"][(1, 1)]["qwen3_moe"]
    cfg_src = stacked["hf"]["qwen3_moe"]
    from parallel_models.config import ModelConfig

    config = ModelConfig.from_hf(cfg_src)
    ckpt = McoreCheckpoint(folder, weight_map_of(config.architecture), config)
    reader = RangeReader()
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    ranges = ckpt.byte_ranges(name, reader)
    assert ranges is not None
    buf = bytearray(sum(n for _, _, n in ranges))
    pos = 0
    for path, off, n in ranges:
        reader.read_into(path, off, memoryview(buf)[pos:pos + n])
        pos += n
    got = torch.frombuffer(buf, dtype=torch.float32).reshape(ckpt.shape(name))
    assert torch.equal(got, ckpt(name, None, None, None))
    reader.close()
    ckpt.close()
