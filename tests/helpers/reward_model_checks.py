"""Builders and the gloo worker for the reward-model tests (importable by spawned processes).

Three tokenizers, all made locally:
- the actor's: the built-in lowercase character tokenizer (BOS/EOS, ``role: content`` template);
- ``rm_chat``: a BPE trained here on a few sentences (case-sensitive, merges, other ids), no BOS,
  a ChatML template with ``<|im_start|>``/``<|im_end|>``;
- ``rm_plain``: a character tokenizer with another vocabulary order, a ``<bos>`` added on encode
  and no chat template (plain concatenation);
- ``rm_bpe``: a lowercasing BPE with a Metaspace pre-tokenizer, saved next to a Qwen2 config
  (transformers 5's ``AutoTokenizer`` builds a ``Qwen2Tokenizer`` there and ignores it).
"""

from __future__ import annotations

import string

import torch

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CORPUS = [
    "the quick brown fox jumps over the lazy dog. " * 3,
    "what is two plus two? four. once upon a time there was a cat who liked to sleep in the sun.",
    "User: hello there\nAssistant: hi, how can I help you today?",
    "name a color: blue, like the sky. tell me a story about a cat.",
]

# (prompt text or chat messages, response text, response ends with the actor's EOS)
SAMPLES = [
    {"prompt": "what is two plus two?", "response": "four.", "eos": True},
    {"messages": [{"role": "system", "content": "be brief."},
                  {"role": "user", "content": "name a color"}],
     "response": "blue, like the sky.", "eos": True},
    {"prompt": "say nothing", "response": "", "eos": False},          # empty response
    {"prompt": "tell me a story about a cat",
     "response": "once upon a time there was a cat who liked to sleep in the sun all day long.",
     "eos": False},                                                     # cut at max_new_tokens
    {"prompt": "hi", "response": "", "eos": True},                    # only the stop token
]
# what the actor's chat template renders for sample 1, special tokens dropped
ACTOR_CHAT_PROMPT_1 = "system: be brief.\nuser: name a color\nassistant: "


def build_rm_chat_tokenizer():
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad = 0 = the RM's pad_token_id
    tok = Tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=180, special_tokens=specials,
                                  initial_alphabet=list(string.printable), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>", chat_template=CHATML,
                                   model_max_length=4096)


def build_rm_plain_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\r\x0b\x0c\t"), reverse=True)
    tokens = ["<pad>", "<bos>", "<eos>", "<unk>"] + chars
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                            special_tokens=[("<bos>", vocab["<bos>"])])
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>", "<unk>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=4096)


def build_rm_lowercase_bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials, show_progress=False,
                                  initial_alphabet=list(string.printable.lower()))
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=4096)


# ---- actor batches in every layout ---------------------------------------------------------------
def actor_ids(actor_tok):
    """(prompt ids, response ids, messages-or-None) per sample, as the PPO rollout makes them."""
    out = []
    for s in SAMPLES:
        if "messages" in s:
            text = actor_tok.apply_chat_template(s["messages"], tokenize=False,
                                                 add_generation_prompt=True)
            prompt = list(actor_tok(text, add_special_tokens=False)["input_ids"])
        else:
            prompt = list(actor_tok(s["prompt"])["input_ids"])
        resp = list(actor_tok(s["response"], add_special_tokens=False)["input_ids"])
        if s["eos"]:
            resp.append(actor_tok.eos_token_id)
        out.append((prompt, resp, s.get("messages")))
    return out


def make_batches(rows, pad_id: int = 0) -> dict[str, dict]:
    """The same rows as a PPO batch (left-padded prompt + right-padded response), a fully
    left-padded batch, a fully right-padded batch and a packed batch."""
    n = len(rows)
    messages = [m for _, _, m in rows]
    P = max(len(p) for p, _, _ in rows)
    R = max(max(len(r) for _, r, _ in rows), 1)
    seq = torch.full((n, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros(n, P + R, dtype=torch.long)
    resp_mask = torch.zeros(n, R, dtype=torch.long)
    for i, (p, r, _) in enumerate(rows):
        seq[i, P - len(p):P] = torch.tensor(p)
        attn[i, P - len(p):P] = 1
        if r:
            seq[i, P:P + len(r)] = torch.tensor(r)
            attn[i, P:P + len(r)] = 1
            resp_mask[i, :len(r)] = 1
    ppo = {"sequences": seq, "attention_mask": attn, "response_mask": resp_mask,
           "prompt_lengths": torch.tensor([len(p) for p, _, _ in rows]), "messages": messages}

    L = max(len(p) + len(r) for p, r, _ in rows) + 2
    batches = {"ppo": ppo}
    for side in ("left", "right"):
        seq = torch.full((n, L), pad_id, dtype=torch.long)
        attn = torch.zeros(n, L, dtype=torch.long)
        rmask = torch.zeros(n, L, dtype=torch.long)
        for i, (p, r, _) in enumerate(rows):
            full = p + r
            start = L - len(full) if side == "left" else 0
            seq[i, start:start + len(full)] = torch.tensor(full)
            attn[i, start:start + len(full)] = 1
            rmask[i, start + len(p):start + len(full)] = 1
        b = {"sequences": seq, "attention_mask": attn, "response_mask": rmask,
             "messages": messages}
        if side == "right":
            b["prompt_lengths"] = torch.tensor([len(p) for p, _, _ in rows])
        # left: prompt lengths are derived from response_mask
        batches[side] = b
    flat = [t for p, r, _ in rows for t in p + r]
    lengths = torch.tensor([len(p) + len(r) for p, r, _ in rows])
    packed_resp = torch.tensor([v for p, r, _ in rows for v in [0] * len(p) + [1] * len(r)])
    batches["packed"] = {"input_ids": torch.tensor(flat, dtype=torch.long),
                         "cu_seqlens": torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int(),
                         "prompt_lengths": torch.tensor([len(p) for p, _, _ in rows]),
                         "messages": messages}
    batches["packed_mask"] = {**batches["packed"], "response_mask": packed_resp}
    del batches["packed_mask"]["prompt_lengths"]
    return batches


# ---- the worker ----------------------------------------------------------------------------------
class CallCounter:
    """Wraps a tokenizer's decode-like methods (on the instance) and counts the calls."""

    NAMES = ("decode", "batch_decode", "convert_ids_to_tokens", "apply_chat_template", "encode")

    def __init__(self, tok):
        self.calls = {name: 0 for name in self.NAMES}
        for name in self.NAMES:
            original = getattr(tok, name)

            def wrapper(*args, _name=name, _orig=original, **kwargs):
                self.calls[_name] += 1
                return _orig(*args, **kwargs)

            setattr(tok, name, wrapper)

    @property
    def decodes(self) -> int:
        return self.calls["decode"] + self.calls["batch_decode"]


def _tensor_snapshot(rm):
    return [t.detach().clone() for t in rm.tensors()]


def _check_offload(rm_path, rm_tok, actor_tok_path, batch, device_type) -> dict:
    """Explicit offload/onload and the automatic mode (bookkeeping on CPU, device on CUDA)."""
    from transformers import AutoTokenizer

    from parallel_models.rl.rewards.model import RewardModel

    actor_tok = AutoTokenizer.from_pretrained(actor_tok_path)
    out = {}
    rm = RewardModel(rm_path, tokenizer=rm_tok, actor_tokenizer=actor_tok, dtype=torch.float32,
                     offload=False)
    base = rm.score(batch)
    before = _tensor_snapshot(rm)
    ptrs = [t.data_ptr() for t in rm.tensors()]
    params = [id(p) for c in rm.chunks for p in c.parameters()]
    out["initially_offloaded"] = rm.is_offloaded
    out["n_tensors"] = len(ptrs)
    out["n_params"] = sum(1 for c in rm.chunks for _ in c.parameters())
    out["n_buffers"] = sum(1 for c in rm.chunks for _ in c.buffers())
    out["moved_bytes"] = rm.offload()
    out["offloaded_flag"] = rm.is_offloaded
    out["on_compute_device_after_offload"] = sum(
        t.device.type == device_type and device_type != "cpu" for t in rm.tensors())
    out["same_storage_after_offload"] = sum(t.data_ptr() == p for t, p in zip(rm.tensors(), ptrs))
    out["pinned_after_offload"] = all(t.is_pinned() for t in rm.tensors()) \
        if device_type == "cuda" else None
    out["second_offload_bytes"] = rm.offload()  # idempotent
    while_off = rm.score(batch)
    out["offloaded_after_score"] = rm.is_offloaded  # the call restores the offloaded state
    out["score_while_offloaded_err"] = (while_off - base).abs().max().item()
    rm.onload()
    out["onloaded_flag"] = rm.is_offloaded
    out["bit_identical_after_onload"] = all(torch.equal(a.cpu(), b.cpu())
                                            for a, b in zip(rm.tensors(), before))
    out["same_parameter_objects"] = [id(p) for c in rm.chunks for p in c.parameters()] == params
    rm.score(batch)
    out["resident_after_score"] = not rm.is_offloaded  # offload=False keeps an onloaded model

    auto = RewardModel(rm_path, tokenizer=rm_tok, actor_tokenizer=actor_tok,
                       dtype=torch.float32, offload=True)
    out["auto_offloaded_at_setup"] = auto.is_offloaded
    auto_scores = auto.score(batch)
    out["auto_offloaded_after_score"] = auto.is_offloaded
    out["auto_err"] = (auto_scores - base).abs().max().item()
    return out


def run_checks(paths: dict, batches: dict, settings: list[tuple[int, int, bool]],
               trunc_lengths: list[int]) -> dict:
    """Every reward-model check at each (tp, pp, sequence_parallel) of ``settings``, one spawn."""
    from transformers import AutoTokenizer

    import parallel_models as pm
    from parallel_models.config import ConfigError
    from parallel_models.rl.config import RewardSection
    from parallel_models.rl.rewards.model import RewardModel

    results = {}
    device_type = pm.compute_device().type if torch.cuda.is_available() else "cpu"
    for tp, pp, sp in settings:
        pm.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp, sequence_parallel=sp)
        res: dict = {"scores": {}, "ids": {}, "token_level": {}, "decodes": {}}
        actor_tok = AutoTokenizer.from_pretrained(paths["actor_tok"])
        counter = CallCounter(actor_tok)
        for name in ("chat", "plain"):
            rm = RewardModel(paths[f"rm_{name}"], tokenizer=paths.get(f"tok_{name}"),
                             actor_tokenizer=actor_tok, dtype=torch.float32, offload=False,
                             micro_batch_tokens=64, tensor_parallel_size=tp,
                             pipeline_parallel_size=pp)
            res[f"same_tokenizer_{name}"] = rm.same_tokenizer
            before = counter.decodes
            for layout, batch in batches.items():
                res["scores"][(name, layout)] = rm.score(batch)
                res["ids"][(name, layout)] = rm.encode_batch(batch)[0]
                res["token_level"][(name, layout)] = rm.token_level_rewards(batch)
            res["decodes"][name] = counter.decodes - before
            res[f"metrics_{name}"] = dict(rm.metrics)

        # same tokenizer: the actor's ids go in as they are, nothing decoded
        same_actor = AutoTokenizer.from_pretrained(paths["actor_tok"])  # another object
        same_rm_tok = AutoTokenizer.from_pretrained(paths["actor_tok"])
        c_actor, c_rm = CallCounter(same_actor), CallCounter(same_rm_tok)
        rm = RewardModel(paths["rm_chat"], tokenizer=same_rm_tok, actor_tokenizer=same_actor,
                         dtype=torch.float32, offload=False)
        res["fast_path"] = rm.same_tokenizer
        res["fast_scores"] = {k: rm.score(b) for k, b in batches.items()}
        res["fast_calls"] = {"actor": dict(c_actor.calls), "rm": dict(c_rm.calls)}

        # truncation policies and the metric
        for policy in ("left", "right"):
            for m in trunc_lengths:
                rm = RewardModel(paths["rm_chat"], actor_tokenizer=actor_tok, dtype=torch.float32,
                                 offload=False, max_length=m, truncation=policy)
                res[("trunc", policy, m)] = {"scores": rm.score(batches["ppo"]),
                                             "ids": rm.encode_batch(batches["ppo"])[0],
                                             "metrics": dict(rm.metrics),
                                             "total": rm.num_truncated}

        res["offload"] = _check_offload(paths["rm_chat"], paths.get("tok_chat"), paths["actor_tok"],
                                        batches["ppo"], device_type)

        # the trainer's entry point, and the clear error for a reward TP/PP unlike the actor's
        section = RewardSection(type="model", model_path=paths["rm_chat"],
                                tensor_parallel_size=tp, pipeline_parallel_size=pp, offload=True)
        rm = RewardModel.from_config(section, actor_tok, dtype=torch.float32)
        res["from_config_scores"] = rm.score(batches["ppo"])
        res["from_config_offloaded"] = rm.is_offloaded
        for key, bad in (("tp", RewardSection(type="model", model_path=paths["rm_chat"],
                                              tensor_parallel_size=tp + 1,
                                              pipeline_parallel_size=pp)),
                         ("pp", RewardSection(type="model", model_path=paths["rm_chat"],
                                              tensor_parallel_size=tp,
                                              pipeline_parallel_size=pp + 1))):
            try:
                RewardModel.from_config(bad, actor_tok)
                res[f"bad_{key}_error"] = None
            except ConfigError as err:
                res[f"bad_{key}_error"] = str(err)
        res["sequence_parallel"] = [c.sequence_parallel for c in rm.chunks]
        res["n_chunks_layers"] = [len(c.model.layers) for c in rm.chunks]
        res.update(_check_sharp_edges(paths, batches, actor_tok, pp))
        results[(tp, pp, sp)] = res
    return results


def _check_sharp_edges(paths: dict, batches: dict, actor_tok, pp: int) -> dict:
    """Issue 21: the saved tokenizer is the one used, the fast path needs no tokenizer files, and
    an uneven layer split over the pipeline stages."""
    from parallel_models.config import ConfigError
    from parallel_models.rl.config import RewardSection
    from parallel_models.rl.rewards.model import RewardModel

    out = {}
    # a Qwen2 RM with its own lowercasing BPE, both loaded by path
    rm = RewardModel(paths["rm_bpe"], actor_tokenizer=actor_tok, dtype=torch.float32,
                     offload=False)
    out["bpe"] = {"ids": rm.encode_batch(batches["ppo"])[0], "scores": rm.score(batches["ppo"]),
                  "same_tokenizer": rm.same_tokenizer}
    # the fast path with an RM folder that holds no tokenizer files (rm_plain)
    notok = {}
    rm = RewardModel(paths["rm_plain"], actor_tokenizer=actor_tok, same_tokenizer=True,
                     dtype=torch.float32, offload=False)
    notok["with_actor"] = {k: rm.score(b) for k, b in batches.items()}
    notok["tokenizer_is_actor"] = rm.tokenizer is actor_tok
    rm = RewardModel(paths["rm_plain"], dtype=torch.float32, offload=False)
    notok["ids_only"] = rm.score(batches["ppo"])
    notok["ids_only_tokenizer"] = rm.tokenizer
    try:
        RewardModel(paths["rm_plain"], actor_tokenizer=actor_tok, offload=False)
        notok["undecided_error"] = None
    except ConfigError as err:
        notok["undecided_error"] = str(err)
    out["notok"] = notok
    # 5 layers: [3, 2] over PP=2, all 5 at PP=1
    split = [3, 2] if pp == 2 else None
    rm = RewardModel(paths["rm_uneven"], dtype=torch.float32, offload=False,
                     layers_per_stage=split)
    out["uneven"] = {"scores": rm.score(batches["ppo"]),
                     "layers": [[layer.layer_id for layer in c.model.layers] for c in rm.chunks]}
    # the same through the trainer's reward section (the RM folder has no tokenizer files)
    section = RewardSection(type="model", model_path=paths["rm_uneven"], layers_per_stage=split,
                            same_tokenizer=True)
    rm = RewardModel.from_config(section, actor_tok, dtype=torch.float32)
    out["uneven"]["from_config_scores"] = rm.score(batches["ppo"])
    out["uneven"]["from_config_layers"] = [[layer.layer_id for layer in c.model.layers]
                                           for c in rm.chunks]
    try:
        RewardModel(paths["rm_uneven"], offload=False, layers_per_stage=[2, 2] if pp == 2 else [4])
        out["uneven"]["bad_split_error"] = None
    except ConfigError as err:
        out["uneven"]["bad_split_error"] = str(err)
    return out


# ---- GPU (run by hand on a CUDA machine; the CPU tests cannot see device memory) -----------------
def gpu_offload_report(root: str) -> dict:
    """One process, TP=1 on the current GPU: scores vs transformers on the GPU, and the device
    memory an offloaded reward model frees. Returns plain numbers (MiB, seconds, errors)."""
    import time

    from transformers import AutoModelForSequenceClassification

    import parallel_models as pm
    from parallel_models.rl.rewards.model import RewardModel
    from parallel_models.tokenizer import build_builtin_tokenizer
    from parallel_models.testing import save_tiny_hf_model

    assert torch.cuda.is_available()
    pm.init_parallel(tensor_parallel_size=1)
    actor_tok, chat_tok = build_builtin_tokenizer(), build_rm_chat_tokenizer()
    small = save_tiny_hf_model(f"{root}/rm_small", "llama", head="value", seed=3)
    chat_tok.save_pretrained(small)
    big = save_tiny_hf_model(f"{root}/rm_big", "llama", head="value", seed=5, hidden_size=1024,
                             intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                             num_key_value_heads=4)
    chat_tok.save_pretrained(big)
    rows = actor_ids(actor_tok)
    batch = {k: v for k, v in make_batches(rows)["ppo"].items()}
    mib = lambda: torch.cuda.memory_allocated() / 2**20  # noqa: E731
    out = {"device": torch.cuda.get_device_name()}

    rm = RewardModel(small, actor_tokenizer=actor_tok, dtype=torch.float32, offload=True)
    got = rm.score(batch)
    ids = rm.encode_batch(batch)[0]
    hf = AutoModelForSequenceClassification.from_pretrained(small, dtype=torch.float32)
    hf = hf.cuda().eval()
    with torch.no_grad():
        want = torch.tensor([hf(torch.tensor([s], device="cuda")).logits[0, 0].item() for s in ids])
    out["small_max_abs_err_vs_hf"] = (got - want).abs().max().item()
    out["small_on_cuda_after_score"] = sum(t.is_cuda for t in rm.tensors())
    del hf, rm
    torch.cuda.empty_cache()

    base = mib()
    rm = RewardModel(big, actor_tokenizer=actor_tok, dtype=torch.float32, offload=False)
    out["param_mib"] = sum(t.numel() * t.element_size() for t in rm.tensors()) / 2**20
    out["resident_mib"] = mib() - base
    ref = rm.score(batch)
    was_on_gpu = [t.is_cuda for t in rm.tensors()]
    t0 = time.perf_counter()
    moved = rm.offload()
    out["offload_s"] = time.perf_counter() - t0
    out["moved_mib"] = moved / 2**20
    out["after_offload_mib"] = mib() - base
    out["freed_mib"] = out["resident_mib"] - out["after_offload_mib"]
    out["on_cuda_after_offload"] = sum(t.is_cuda for t in rm.tensors())
    moved_ids = {k for k, on_gpu in enumerate(was_on_gpu) if on_gpu}
    out["moved_tensors"] = len(moved_ids)
    out["unpinned_moved"] = [k for k in moved_ids if not rm.tensors()[k].is_pinned()]
    out["never_on_gpu"] = [tuple(rm.tensors()[k].shape) for k in range(len(rm.tensors()))
                           if k not in moved_ids]  # built on the host (e.g. rotary inv_freq)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    again = rm.score(batch)  # onload, score, offload again
    out["score_with_onload_s"] = time.perf_counter() - t0
    out["peak_during_score_mib"] = torch.cuda.max_memory_allocated() / 2**20 - base
    out["after_score_mib"] = mib() - base
    out["offloaded_after_score"] = rm.is_offloaded
    out["score_diff_after_round_trip"] = (again - ref).abs().max().item()
    t0 = time.perf_counter()
    rm.onload()
    out["onload_s"] = time.perf_counter() - t0
    out["after_onload_mib"] = mib() - base
    t0 = time.perf_counter()
    rm.offload()
    out["second_offload_s"] = time.perf_counter() - t0
    return out
