"""The rollout server's OpenAI-compatible API, driven by the official ``openai`` client against
the real server (a subprocess on a free port, the tiny built-in-tokenizer model, fp32 on CPU).

Oracles: the server's native ``/generate`` (greedy tokens and text), a ``transformers`` forward
of the same weights (top-k log-probs, 1e-4), the ``openai`` client's own parsing and exception
classes (response / chunk / error shapes).
"""

import httpx
import pytest

openai = pytest.importorskip("openai")

from parallel_models.distributed import free_port  # noqa: E402

from tests.helpers.server_launch import start_server, stop_server  # noqa: E402

KEY = "openai-test-key"
MAX_NEW = 8
PROMPTS = ["hello world", "the cat sat on", "abc"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from parallel_models.tokenizer import build_builtin_tokenizer
    from parallel_models.testing import save_tiny_hf_model

    root = tmp_path_factory.mktemp("openai")
    path = str(root / "tiny")
    save_tiny_hf_model(path, "llama", seed=3, vocab_size=74)  # the builtin tokenizer's vocab
    tokenizer = build_builtin_tokenizer()
    tokenizer.save_pretrained(path)
    port = free_port()
    proc = start_server(path, port, api_key=KEY, log_path=str(root / "server.log"),
                        extra=("--max-new-tokens", "32", "--max-n", "4",
                               "--batch-window-ms", "5", "--max-body-bytes", "100000"))
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
    native = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    yield {"client": client, "native": native, "base": base, "model": path,
           "tokenizer": tokenizer, "path": path}
    native.close()
    client.close()
    stop_server(proc)


def _native_greedy(served, prompt, max_new=MAX_NEW):
    r = served["native"].post("/generate", json={"prompts": [prompt], "greedy": True,
                                                 "max_new_tokens": max_new})
    assert r.status_code == 200, r.text
    res = r.json()["results"][0]
    return res["prompt_token_ids"], res["samples"][0]


def _chat_ids(served, messages):
    tok = served["tokenizer"]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _hf_log_softmax(served, ids):
    """log_softmax of a transformers forward (fp32) of ``ids``: [len(ids), vocab]."""
    import torch
    from transformers import AutoModelForCausalLM

    if "hf" not in served:
        served["hf"] = AutoModelForCausalLM.from_pretrained(served["path"], dtype=torch.float32)
    with torch.no_grad():
        logits = served["hf"](torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def test_models(served):
    c = served["client"]
    ids = [m.id for m in c.models.list().data]
    assert ids == [served["model"]]
    assert c.models.retrieve(served["model"]).id == served["model"]
    with pytest.raises(openai.NotFoundError) as err:
        c.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"


def test_completions_greedy_equal_native(served):
    c, tok = served["client"], served["tokenizer"]
    for prompt in PROMPTS + [[1, 10, 20, 30]]:
        prompt_ids, ref = _native_greedy(served, prompt)
        got = c.completions.create(model=served["model"], prompt=prompt, max_tokens=MAX_NEW,
                                   temperature=0, logprobs=0)
        choice = got.choices[0]
        assert choice.text == ref["text"]
        assert choice.logprobs.tokens == [tok.decode([t]) for t in ref["token_ids"]]
        assert choice.logprobs.token_logprobs == pytest.approx(ref["log_probs"], abs=1e-5)
        assert choice.finish_reason == ref["finish_reason"]
        assert got.usage.prompt_tokens == len(prompt_ids)
        assert got.usage.completion_tokens == len(ref["token_ids"])
        assert got.usage.total_tokens == len(prompt_ids) + len(ref["token_ids"])
        assert got.object == "text_completion" and got.model == served["model"]


def test_several_prompts_in_one_request(served):
    got = served["client"].completions.create(model=served["model"], prompt=PROMPTS, n=2,
                                              max_tokens=MAX_NEW, temperature=0)
    assert [ch.index for ch in got.choices] == list(range(2 * len(PROMPTS)))
    for i, prompt in enumerate(PROMPTS):
        ref = _native_greedy(served, prompt)[1]
        assert got.choices[2 * i].text == got.choices[2 * i + 1].text == ref["text"]


def test_chat_greedy_equal_native(served):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi there"}]
    prompt_ids, ref = _native_greedy(served, _chat_ids(served, messages))
    got = served["client"].chat.completions.create(model=served["model"], messages=messages,
                                                   max_completion_tokens=MAX_NEW, temperature=0)
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref["text"]
    assert choice.finish_reason == ref["finish_reason"]
    assert got.usage.prompt_tokens == len(prompt_ids)
    assert got.usage.completion_tokens == len(ref["token_ids"])
    # text parts are joined like a string content
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi "},
                                          {"type": "text", "text": "there"}]}]
    got2 = served["client"].chat.completions.create(model=served["model"], messages=parts,
                                                    max_tokens=MAX_NEW, temperature=0)
    ref2 = _native_greedy(served, _chat_ids(served, [{"role": "user", "content": "hi there"}]))
    assert got2.choices[0].message.content == ref2[1]["text"]


def test_completion_top_logprobs_vs_transformers(served):
    tok = served["tokenizer"]
    prompt = [1, 25, 17, 30, 9]
    got = served["client"].completions.create(model=served["model"], prompt=prompt, max_tokens=6,
                                              temperature=0, logprobs=5)
    lp = got.choices[0].logprobs
    ids = [tok.convert_tokens_to_ids(t) for t in lp.tokens]
    ref = _hf_log_softmax(served, prompt + ids)
    for i, top in enumerate(lp.top_logprobs):
        row = ref[len(prompt) - 1 + i]
        values, order = row.topk(5)
        want = {tok.decode([int(t)]): float(v) for t, v in zip(order, values)}
        assert set(top) == set(want), f"step {i}: {top} vs {want}"
        for key, value in want.items():
            assert abs(top[key] - value) < 1e-4, (i, key, top[key], value)
        assert ids[i] == int(order[0])  # greedy = the most likely token
        assert abs(lp.token_logprobs[i] - float(values[0])) < 1e-4
    offsets = lp.text_offset
    assert offsets[0] == 0 and all(b >= a for a, b in zip(offsets, offsets[1:]))


def test_chat_top_logprobs_vs_transformers(served):
    messages = [{"role": "user", "content": "count: 1 2 3"}]
    prompt = _chat_ids(served, messages)
    got = served["client"].chat.completions.create(
        model=served["model"], messages=messages, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3)
    content = got.choices[0].logprobs.content
    tok = served["tokenizer"]
    ids = [tok.convert_tokens_to_ids(e.token) for e in content]
    ref = _hf_log_softmax(served, prompt + ids)
    for i, entry in enumerate(content):
        values, order = ref[len(prompt) - 1 + i].topk(3)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([int(t)]) for t in order]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [float(v) for v in values], abs=1e-4)
        assert entry.logprob == pytest.approx(float(values[0]), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())


def test_n_with_seed_reproducible(served):
    c = served["client"]
    kw = dict(model=served["model"], prompt="once upon", n=3, max_tokens=MAX_NEW,
              temperature=1.0, top_p=0.95, seed=1234)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert len(a.choices) == 3 and len({ch.text for ch in a.choices}) > 1
    chat = dict(model=served["model"], messages=[{"role": "user", "content": "hey"}], n=2,
                max_tokens=MAX_NEW, seed=99)
    x, y = c.chat.completions.create(**chat), c.chat.completions.create(**chat)
    assert [ch.message.content for ch in x.choices] == [ch.message.content for ch in y.choices]


def _long_greedy(served):
    """A prompt whose greedy continuation (16 tokens) has a character at j >= 2 seen nowhere
    before it (so stop strings starting there cut after some text), that continuation and j."""
    for prompt in PROMPTS + ["zzz", "12345", "what is", "xyz", "9 + 8 ="]:
        full = _native_greedy(served, prompt, 16)[1]["text"]
        for j in range(2, len(full) - 2):
            if full[j] not in full[:j]:
                return prompt, full, j
    pytest.fail("no prompt of the tiny model continues with a new character after 2")


def _generated_tokens(served) -> int:
    return served["native"].get("/info").json()["stats"]["generated_tokens"]


def test_stop_strings(served):
    c = served["client"]
    prompt, full, j = _long_greedy(served)
    # a two-token stop string, a single-token one (generation ends there), a list of them
    for stop, stop_len in ((full[j:j + 2], 2), (full[j], 1), ([full[j], "never-there"], 1)):
        before = _generated_tokens(served)
        got = c.completions.create(model=served["model"], prompt=prompt, max_tokens=16,
                                   temperature=0, stop=stop)
        assert got.choices[0].text == full[:j], stop
        assert got.choices[0].finish_reason == "stop"
        # one token per character: the tokens up to the one completing the stop string count
        assert got.usage.completion_tokens == j + stop_len
        if stop_len == 1:  # a one-token stop string ends generation at once
            assert _generated_tokens(served) - before == j + 1
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=served["model"], prompt=prompt, max_tokens=16, temperature=0, stop=full[j:j + 2],
        stream=True) if ch.choices)
    assert streamed == full[:j]
    chat = c.chat.completions.create(model=served["model"], max_tokens=16, temperature=0,
                                     messages=[{"role": "user", "content": "hi"}], stop=["\n"])
    assert "\n" not in chat.choices[0].message.content


def test_max_tokens_and_finish_reason(served):
    prompt, full, _ = _long_greedy(served)
    got = served["client"].completions.create(model=served["model"], prompt=prompt, max_tokens=3,
                                              temperature=0)
    assert got.choices[0].text == full[:3]
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 3


def test_streaming_completions(served):
    c = served["client"]
    kw = dict(model=served["model"], prompt=PROMPTS[:2], n=2, max_tokens=MAX_NEW, temperature=0,
              logprobs=2)
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": True}))
    texts, finish, tokens = {}, {}, {}
    for ch in chunks[:-1]:
        assert ch.usage is None
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs is not None:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert finish[choice.index] == choice.finish_reason
        assert tokens[choice.index] == choice.logprobs.tokens


def test_streaming_chat(served):
    c = served["client"]
    kw = dict(model=served["model"], messages=[{"role": "user", "content": "tell me"}],
              max_tokens=MAX_NEW, temperature=0)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == \
        whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    # without include_usage: no usage chunk, every chunk has a choice
    plain = list(c.chat.completions.create(**kw, stream=True))
    assert all(ch.choices and ch.usage is None for ch in plain)


BAD_CALLS = [
    ("max_tokens_zero", "completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens_over_limit", "completions", {"prompt": "hi", "max_tokens": 33}, "max_tokens"),
    ("n_over_limit", "completions", {"prompt": "hi", "n": 5}, "n"),
    ("temperature_negative", "completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("frequency_penalty", "completions", {"prompt": "hi", "frequency_penalty": 0.5},
     "frequency_penalty"),
    ("logit_bias", "completions", {"prompt": "hi", "logit_bias": {"5": 10}}, "logit_bias"),
    ("echo", "completions", {"prompt": "hi", "echo": True}, "echo"),
    ("token_out_of_vocab", "completions", {"prompt": [1, 74]}, "prompt"),
    ("tools_on_completions", "completions", {"prompt": "hi", "extra_body": {"tools": [
        {"type": "function", "function": {"name": "f"}}]}}, "tools"),
    ("tool_choice_unknown_function", "chat", {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("top_logprobs_without_logprobs", "chat", {"top_logprobs": 2}, "top_logprobs"),
    ("image_content", "chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages"),
    ("stream_options_without_stream", "chat", {"stream_options": {"include_usage": True}},
     "stream_options"),
]


@pytest.mark.parametrize("name,endpoint,kwargs,param", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_request(served, name, endpoint, kwargs, param):
    c = served["client"]
    if endpoint == "chat":
        call = c.chat.completions.create
        kwargs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kwargs}
    else:
        call = c.completions.create
    with pytest.raises(openai.BadRequestError) as err:
        call(model=served["model"], **kwargs)
    assert err.value.status_code == 400
    body = err.value.body  # the "error" object
    assert body["type"] == "invalid_request_error" and body["param"] == param, body
    assert isinstance(body["message"], str) and body["message"], body


def test_model_not_found_and_wrong_key(served):
    c = served["client"]
    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert err.value.code == "model_not_found" and err.value.param == "model"
    wrong = openai.OpenAI(base_url=served["base"] + "/v1", api_key="wrong", max_retries=0)
    for call in (lambda: wrong.models.list(),
                 lambda: wrong.completions.create(model=served["model"], prompt="hi"),
                 lambda: wrong.chat.completions.create(
                     model=served["model"], messages=[{"role": "user", "content": "hi"}])):
        with pytest.raises(openai.AuthenticationError) as err:
            call()
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    wrong.close()


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/completions", b'{"model": ', 400),
    ("POST", "/v1/completions", b'[1, 2]', 400),
    ("POST", "/v1/completions", b'{"model": "m", "prompt": "hi", "bogus": 1}', 400),
    ("GET", "/v1/completions", None, 405),
    ("GET", "/v1/nope", None, 404),
    ("POST", "/v1/chat/completions", b'{"model": "m", "pad": "%s"}' % (b"x" * 200000), 413),
])
def test_error_body_shape(served, method, path, body, status):
    r = httpx.request(method, served["base"] + path, content=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}",
                               "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if b"bogus" in (body or b""):
        assert err["param"] == "bogus"
    # the native API keeps its own shape
    native = httpx.post(served["base"] + "/generate", content=b'{"prompts": [', timeout=30,
                        headers={"Authorization": f"Bearer {KEY}",
                                 "Content-Type": "application/json"})
    assert native.status_code == 400 and isinstance(native.json()["error"], str)


def _byte_level_bpe():
    """A small byte-level BPE (GPT-2 / Qwen style) trained here: multi-byte characters are
    split over tokens, so single tokens decode to incomplete characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["naïve café ☕ 日本語のテキスト 🙂🙃 stop here. STOP!"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def test_token_pieces_and_stop_cut_byte_level():
    from parallel_models.inference.server.openai_text import finish_text, token_pieces

    tok = _byte_level_bpe()
    text = "naïve café ☕ 日本語 🙂🙃 stop here"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the case the pieces must handle
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces) and pieces[-1] == ""  # EOS adds no text
    fin = finish_text(tok, ids, "stop", ["zzz", "🙃 s", "here"])
    assert fin.text == "naïve café ☕ 日本語 🙂" and fin.finish_reason == "stop"
    assert "".join(fin.pieces) == fin.text and len(fin.pieces) == fin.n_tokens
    # the kept tokens are exactly those needed to complete the stop string
    assert "🙃 s" in tok.decode(ids[:fin.n_tokens])
    assert "🙃 s" not in tok.decode(ids[:fin.n_tokens - 1])
    untouched = finish_text(tok, ids, "length", ["not in it"])
    assert untouched.text == text and untouched.n_tokens == len(ids)
    assert untouched.finish_reason == "length"


def test_stream_holds_back_possible_stop_strings():
    from parallel_models.inference.server.openai_stream import ChoiceText
    from parallel_models.tokenizer import build_builtin_tokenizer

    tok = build_builtin_tokenizer()
    choice = ChoiceText(tok, ["cd!", "xy"])
    sent = []
    for ch in "abcdeacd!zz":
        sent.append(choice.add(tok.convert_tokens_to_ids(ch))[0])
        if choice.done:
            break
    # 'c', 'cd' may start "cd!": held until 'e' shows they do not; "acd!" ends the choice
    assert sent == ["a", "b", "", "", "cde", "a", "", "", ""] and choice.done
    assert "".join(sent) == "abcdea"


def test_generate_top_logprobs_tp2_sampled(served):
    """generate(top_logprobs=k) at TP=2, sampled at temperature 0.7: the top-k ids and
    log-probs equal log_softmax(transformers logits / 0.7) (1e-4), every rank returns the same,
    and asking for them does not change the draws."""
    from parallel_models.testing import run_distributed
    from tests.helpers import openai_checks

    ranks = run_distributed(openai_checks.top_logprobs_vs_transformers, 2, served["path"], 4, 0.7)
    for r in ranks:
        assert r["same_draws"] and r["ranks_agree"], r
        assert r["shape"][0] == 3 and r["shape"][2] == 4
        assert r["ids_mismatch"] == 0 and r["max_err"] < 1e-4 and r["chosen_err"] < 1e-4, r
