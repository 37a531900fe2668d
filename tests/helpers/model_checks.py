"""Worker functions run on gloo ranks by the model tests (importable by spawned processes).

Each returns plain numbers so the parent test can assert them one by one.
"""

from __future__ import annotations

import torch

from parallel_models.testing import TensorDictReader


def _batch(vocab: int, side: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [17, 9, 13, 4]
    seq = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), seq), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, seq - n:] = 1
        else:
            mask[b, :n] = 1
    return ids, mask


def _hf_reference(path: str, head: str, ids, mask, pos):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    with torch.no_grad():
        if head == "causal_lm":
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            return hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        hidden = hf.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        return hf.score(hidden).squeeze(-1)  # per-token scores


def ours_and_reference(model, path: str, head: str, rmpad: bool, ids, mask):
    """(ours on the valid tokens, transformers' output on the whole padded batch) for a padded
    batch; ours runs it padded, or packed with ``rmpad``. Logits gathered over the vocab."""
    from parallel_models.utils.padding import pack_padded_batch, position_ids_from_attention_mask

    ref = _hf_reference(path, head, ids, mask, position_ids_from_attention_mask(mask))
    kw = dict(full_vocab=True) if head == "causal_lm" else {}
    with torch.no_grad():
        if rmpad:
            packed = pack_padded_batch(ids, mask)
            out = model(packed.input_ids, packed.cu_seqlens, **kw)
            got = out.logits if head == "causal_lm" else out.values
        else:
            out = model(ids, attention_mask=mask, **kw)
            got = (out.logits if head == "causal_lm" else out.values)[mask.bool()]
    return got, ref


def check_forward(folders: dict, tp: int, sp: bool) -> dict:
    """Max abs error vs transformers for every family x head x padding x layout."""
    import parallel_models as pm
    from parallel_models.llama.families import family_of_model_type

    pm.init_parallel(tensor_parallel_size=tp, sequence_parallel=sp)
    results, values = {}, {}
    for (family, head), path in folders.items():
        for rmpad in (False, True):
            cls = pm.get_model_class(f"{family_of_model_type(family).name}ForCausalLM", head,
                                     rmpad)
            model = cls.from_pretrained(path, dtype=torch.float32)
            for side in ("left", "right"):
                ids, mask = _batch(model.config.vocab_size, side)
                got, ref = ours_and_reference(model, path, head, rmpad, ids, mask)
                valid = mask.bool()
                key = f"{family}-{head}-{'rmpad' if rmpad else 'padded'}-{side}"
                results[key] = (got - ref[valid]).abs().max().item()
                if head == "value":
                    values[key] = got.clone()
                if head == "causal_lm" and not rmpad and side == "right":
                    # vocab-parallel logits: this rank's slice, padding rows never win a softmax
                    vp = model(ids, attention_mask=mask).logits
                    lo = model.lm_head.vocab_start
                    n = model.lm_head.num_real
                    results[key + "-vocab-slice"] = (vp[..., :n][valid] - ref[..., lo:lo + n][valid]
                                                     ).abs().max().item()
    return {"errors": results, "values": values}


def check_gradients(folders: dict, tp: int, sp: bool, families=("llama", "qwen2")) -> dict:
    """Relative gradient error vs transformers after one cross-entropy backward, per family."""
    import parallel_models as pm
    from megatron.core import parallel_state as mpu
    from transformers import AutoModelForCausalLM

    from parallel_models.llama.checkpoint_utils.weight_map import shard_from_hf, weight_rules
    from parallel_models.utils.grads import allreduce_sequence_parallel_grads
    from parallel_models.utils.padding import position_ids_from_attention_mask

    pm.init_parallel(tensor_parallel_size=tp, sequence_parallel=sp)
    out = {}
    for family in families:
        path = folders[(family, "causal_lm")]
        model = pm.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids, mask = _batch(model.config.vocab_size, "right", seed=3)
        pos = position_ids_from_attention_mask(mask)
        labels = ids[:, 1:].masked_fill(~mask[:, 1:].bool(), -100)

        def loss_of(logits):
            return torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

        loss_of(hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits).backward()
        ours_loss = loss_of(model(ids, attention_mask=mask, full_vocab=True).logits)
        ours_loss.backward()
        allreduce_sequence_parallel_grads(model)
        hf_grads = {n: p.grad for n, p in hf.named_parameters()}
        if hf.config.tie_word_embeddings:
            hf_grads.setdefault("lm_head.weight", hf_grads["model.embed_tokens.weight"])

        params = dict(model.named_parameters())
        worst = 0.0
        tp_rank = mpu.get_tensor_model_parallel_rank()
        for rule in weight_rules(model.config, "causal_lm"):
            layer_ids = range(model.config.num_layers) if rule.per_layer else [None]
            for i in layer_ids:
                ours = rule.ours.format(i=i)
                names = tuple(n.format(i=i) for n in rule.hf)
                want = shard_from_hf(rule, names, TensorDictReader(hf_grads), model.config, tp,
                                     tp_rank)
                got = params[ours].grad
                rel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
                worst = max(worst, rel)
        out[family] = {"worst_rel": worst, "loss_diff": abs(ours_loss.item() - 0.0)}
    return out


def check_bad_tp(path: str, tp: int) -> str:
    """Build a model whose heads do not divide TP; return the error message."""
    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=tp)
    try:
        pm.AutoModelForCausalLM.from_pretrained(path)
    except pm.ConfigError as err:
        return str(err)
    return "no error"


def check_load_memory(path: str, tp: int) -> dict:
    """Peak anonymous (private) memory of this rank while loading its shard."""
    import threading
    import time

    import parallel_models as pm

    def rss_anon() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    pm.init_parallel(tensor_parallel_size=tp)
    # import what loading imports (transformers config classes, rope utils) before the baseline
    pm.ModelConfig.from_hf(path)
    import transformers.modeling_rope_utils  # noqa: F401
    base = rss_anon()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    model = pm.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    done.set()
    t.join()
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak_delta": peak[0] - base, "shard_bytes": shard}
