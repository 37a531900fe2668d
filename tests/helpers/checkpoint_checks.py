"""Worker functions run on gloo ranks by tests/checkpoint/test_checkpoint.py (importable by spawned
processes). They return plain data; the parent test asserts."""

from __future__ import annotations

import os

import torch

SEQ_IDS_SEED = 7


def token_batch(vocab: int, batch: int = 2, seq: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEQ_IDS_SEED)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model(input_ids=ids).logits


# ---- our models: save_pretrained / save_mcore / from_pretrained(mcore) ---------------------------------
def save_roundtrips(jobs: list[dict], tp: int, busy: str | None = None) -> dict:
    """Each job: {"src", "head", "out", "kind": "hf"|"mcore"}: from_pretrained(src) at TP=``tp``
    (in the checkpoint's dtype), then save_pretrained (kind hf; the model method) or save_mcore
    (kind mcore) to out. ``busy``: a non-empty folder both savers must refuse, on every rank."""
    import parallel_models as pm
    from parallel_models.llama.checkpoint_utils import save_mcore

    pm.init_parallel(tensor_parallel_size=tp)
    out = {}
    for job in jobs:
        cls = pm.AutoModelForValue if job["head"] == "value" else pm.AutoModelForCausalLM
        model = cls.from_pretrained(job["src"], dtype=job.get("dtype"))
        if job["kind"] == "hf":
            stats = model.save_pretrained(job["out"], max_shard_size=job.get("shard", "5GB"))
        else:
            stats = save_mcore(model, job["out"], layer_spec=job.get("layer_spec", "te"),
                               format=job.get("format", "flat"))  # flat: checks read the folder
        out[job["out"]] = {"seconds": stats["seconds"], "report": model.load_report}
    if busy is not None:
        from parallel_models.llama.checkpoint_utils import save_pretrained

        errors = []
        for fn in (save_pretrained, save_mcore):
            try:
                fn(model, busy)
                errors.append("no error")
            except pm.CheckpointError as err:
                errors.append(str(err))
        out["busy_errors"] = errors
    return out


# ---- megatron-core GPTModel ---------------------------------------------------------------------------
def _build_megatron(mcore_dir_or_json, layer_spec="local", keys_map=True):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from parallel_models import cpu_shim

    cpu_shim.apply()  # also routes megatron's CUDA RNG tracker to the CPU generator
    from parallel_models.llama.checkpoint_utils import build_gpt_model

    model_parallel_cuda_manual_seed(0)
    if not keys_map:  # a local spec that saves its norms under their module names
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        layer_spec.submodules.sharded_state_dict_keys_map = {}
    model = build_gpt_model(mcore_dir_or_json, layer_spec=layer_spec, parallel_output=False,
                            transformer_config={"perform_initialization": False})
    return model.eval()


def _megatron_logits(model, ids, vocab):
    seq = ids.shape[1]
    pos = torch.arange(seq).unsqueeze(0).expand_as(ids)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, attention_mask=mask)
    return logits[..., :vocab].float()


def megatron_loads(cases: list[dict], tp: int) -> dict:
    """Each case: {"name", "mcore", "hf", "keys_map"(opt)}: a megatron-core GPTModel (local spec,
    built from the emitted JSON) at TP=``tp`` loads the dist checkpoint with
    ``dist_checkpointing.load(model.sharded_state_dict(), dir)``; max |logits - HF logits|."""
    from megatron.core import dist_checkpointing

    import parallel_models as pm
    from parallel_models import cpu_shim

    pm.init_parallel(tensor_parallel_size=tp)
    out = {}
    for case in cases:
        with cpu_shim.cuda_to_cpu():
            model = _build_megatron(case["mcore"], keys_map=case.get("keys_map", True))
            # as Megatron-LM loads it: the model under "model", the common state beside it
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, case["mcore"])
            model.load_state_dict(loaded["model"])
            cfg = pm.ModelConfig.from_hf(case["hf"])
            ids = token_batch(cfg.vocab_size)
            got = _megatron_logits(model, ids, cfg.vocab_size)
        want = hf_logits(case["hf"], ids)
        out[case["name"]] = (got - want).abs().max().item()
    return out


def _set_megatron_weights_from_hf(model, hf_path: str, tp: int, rank: int) -> None:
    """Fill a megatron GPTModel's TP shard straight from HF tensors, written out by hand (not
    with the weight map) so the test checks our layout against megatron's own semantics."""
    from safetensors import safe_open

    import parallel_models as pm

    cfg = pm.ModelConfig.from_hf(hf_path)
    tensors = {}
    for f in os.listdir(hf_path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(hf_path, f), "pt") as h:
                tensors.update({k: h.get_tensor(k) for k in h.keys()})
    nh, g, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qpg = nh // g

    def rows(t, parts):  # this rank's rows of a column-parallel tensor
        return t.chunk(parts, dim=0)[rank]

    def qkv(kind, i):
        q = tensors[f"model.layers.{i}.self_attn.q_proj.{kind}"]
        k = tensors[f"model.layers.{i}.self_attn.k_proj.{kind}"]
        v = tensors[f"model.layers.{i}.self_attn.v_proj.{kind}"]
        groups = []
        for j in range(g):
            groups += [q[j * qpg * d:(j + 1) * qpg * d], k[j * d:(j + 1) * d], v[j * d:(j + 1) * d]]
        return rows(torch.cat(groups), tp)

    state = {}
    emb = tensors["model.embed_tokens.weight"]
    vp = model.embedding.word_embeddings.weight.shape[0] * tp
    padded = torch.zeros(vp, emb.shape[1], dtype=emb.dtype)
    padded[: emb.shape[0]] = emb
    state["embedding.word_embeddings.weight"] = rows(padded, tp)
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        h = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = tensors[h + "input_layernorm.weight"]
        state[p + "self_attention.linear_qkv.weight"] = qkv("weight", i)
        if cfg.qkv_bias:
            state[p + "self_attention.linear_qkv.bias"] = qkv("bias", i)
        state[p + "self_attention.linear_proj.weight"] = tensors[h + "self_attn.o_proj.weight"].chunk(
            tp, dim=1)[rank]
        state[p + "pre_mlp_layernorm.weight"] = tensors[h + "post_attention_layernorm.weight"]
        state[p + "mlp.linear_fc1.weight"] = torch.cat(
            [rows(tensors[h + "mlp.gate_proj.weight"], tp), rows(tensors[h + "mlp.up_proj.weight"], tp)])
        state[p + "mlp.linear_fc2.weight"] = tensors[h + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
    state["decoder.final_layernorm.weight"] = tensors["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        head = tensors["lm_head.weight"]
        padded = torch.zeros(vp, head.shape[1], dtype=head.dtype)
        padded[: head.shape[0]] = head
        state["output_layer.weight"] = rows(padded, tp)
    params = dict(model.named_parameters())
    missing = set(params) - set(state)
    if missing:
        raise AssertionError(f"test does not set {sorted(missing)}")
    with torch.no_grad():
        for k, v in state.items():
            params[k].copy_(v)


def megatron_saves(cases: list[dict], tp: int) -> dict:
    """Each case: {"name", "hf", "mcore_json", "out"}: a megatron-core GPTModel at TP=``tp`` with
    weights set from the HF model saves itself with megatron-core's default
    ``dist_checkpointing.save``. Returns its max |logits - HF logits| (the weights are right)."""
    import multiprocessing

    from megatron.core import dist_checkpointing, parallel_state as mpu

    import parallel_models as pm
    from parallel_models import cpu_shim

    # megatron-core's default save forks writer processes, which a daemon process may not do
    multiprocessing.current_process()._config["daemon"] = False
    pm.init_parallel(tensor_parallel_size=tp)
    rank = mpu.get_tensor_model_parallel_rank()
    out = {}
    for case in cases:
        with cpu_shim.cuda_to_cpu():
            model = _build_megatron(case["mcore_json"])
            _set_megatron_weights_from_hf(model, case["hf"], tp, rank)
            cfg = pm.ModelConfig.from_hf(case["hf"])
            ids = token_batch(cfg.vocab_size)
            got = _megatron_logits(model, ids, cfg.vocab_size)
            if torch.distributed.get_rank() == 0:
                os.makedirs(case["out"])
            torch.distributed.barrier()
            dist_checkpointing.save(model.sharded_state_dict(), case["out"])
        want = hf_logits(case["hf"], ids)
        out[case["name"]] = (got - want).abs().max().item()
    return out


def megatron_checks(load_cases: list[dict], save_cases: list[dict], tp: int) -> dict:
    """Both megatron-core checks in one spawn (they are slow to start)."""
    out = {"loads": megatron_loads(load_cases, tp) if load_cases else {}}
    out["saves"] = megatron_saves(save_cases, tp) if save_cases else {}
    return out


def pp_save_roundtrips(jobs: list[dict], tp: int, pp: int, vpp: int | None = None) -> dict:
    """As :func:`save_roundtrips` with pipeline parallelism: each rank builds its PP chunks
    (``build_pipeline_chunks``) from ``src`` (HF or mcore folder) and saves them."""
    import parallel_models as pm
    from parallel_models.llama.checkpoint_utils import save_mcore
    from parallel_models.llama.checkpoint_utils import save_pretrained
    from parallel_models.registry import architecture_of

    pm.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                     virtual_pipeline_parallel_size=vpp)
    out = {}
    for job in jobs:
        cls = pm.get_model_class(architecture_of(job["src"]), job["head"], pp=True)
        chunks = pm.build_pipeline_chunks(cls, job["src"], dtype=job.get("dtype"))
        fn = save_pretrained if job["kind"] == "hf" else save_mcore
        if job.get("perturb_tied"):  # the last stage's copy of a tied embedding drifts
            out[job["out"] + ":errors"] = _save_with_drifted_tied_copy(chunks, fn, job["out"])
        stats = fn(chunks, job["out"])
        out[job["out"]] = {"seconds": stats["seconds"],
                           "reports": [c.load_report for c in chunks]}
    return out


def _save_with_drifted_tied_copy(chunks, fn, out_dir: str) -> list[str]:
    """Perturb one element of the last stage's head copy (TP rank 0 only), try to save (every
    rank must raise), then restore it. Returns the error message of each attempt on this rank."""
    import torch.distributed as dist

    from parallel_models.llama.checkpoint_utils import CheckpointError

    last = [c for c in chunks if c.post_process and not c.pre_process]
    errors = []
    for attempt in range(2):
        touched = last and dist.get_rank() % 2 == 0  # TP rank 0 of the last stage (TP=2)
        if touched:
            with torch.no_grad():
                last[0].lm_head.weight[0, 0] += 2.0 ** -4
        try:
            fn(chunks, out_dir)
            errors.append("")
        except CheckpointError as err:
            errors.append(str(err))
        finally:
            if touched:
                with torch.no_grad():
                    last[0].lm_head.weight[0, 0] -= 2.0 ** -4
    return errors
