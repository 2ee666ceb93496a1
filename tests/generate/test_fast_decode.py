"""The decoding layout (`tinylm.generate.fast`): the model's numbers, for every option a GPT has.

The model's own full forward pass, without a cache, is the oracle: the static decoder's prefill
and one-token steps must give its logits at every position, for left-padded batches too, and
the engine's greedy tokens must be the reference generator's.
"""

from __future__ import annotations

import time

import pytest
import torch

import tinylm.generate.fast as fast
from tinylm.generate.engine import Engine
from tinylm.generate.fast import DecodeWeights, StaticDecoder, decode_weights, make_decoder, supports
from tinylm.generate.reference import reference_generate
from tinylm.generate.sampling import SamplingParams
from tinylm.generate.speculative import PromptLookupDraft, speculative_generate
from tinylm.generate.steps import CachedDecoder

from toys import BigramLM, tiny_gpt

VARIANTS = {
    "rope, rmsnorm, swiglu": {},
    "learned, layernorm, gelu, biases (GPT-2)": dict(positions="learned", norm="layernorm", mlp="gelu", bias=True,
                                                    tie_embeddings=True),
    "sinusoidal, relu2": dict(positions="sinusoidal", mlp="relu2"),
    "no positions, post-norm": dict(positions="none", norm_position="post"),
    "GQA, qk-norm, qkv bias (Qwen)": dict(n_kv_head=2, qk_norm=True, qkv_bias=True),
    "MQA, head size of its own": dict(n_kv_head=1, d_head=16),
    "sliding window 5": dict(sliding_window=5),
    "value embeddings, softcap": dict(value_embed=True, logit_softcap=3.0),
    "llama3 rope scaling": dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                                rope_high_freq_factor=4.0, rope_original_context=16),
    "Gemma 2: sandwich norms, geglu, capped scores, alternating window": dict(
        norm_position="sandwich", mlp="geglu", embed_scale=True, attn_softcap=2.0, logit_softcap=5.0,
        attn_scale_dim=24, sliding_window=4, sliding_window_pattern=2, n_kv_head=2),
    "Gemma 3: qk-norm, a local RoPE base on the windowed layers": dict(
        norm_position="sandwich", mlp="geglu", embed_scale=True, qk_norm=True, sliding_window=3,
        sliding_window_pattern=2, rope_theta=1e6, rope_local_theta=100.0),
}
GREEDY = SamplingParams(max_new_tokens=30, temperature=0, stop_ids=[])


def full_logits(model, rows: list[list[int]]) -> list[torch.Tensor]:
    """Each row's logits (T, V), from the model alone on that row: no cache, no padding."""
    with torch.no_grad():
        return [model(torch.tensor([row]))[0][0] for row in rows]


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_and_steps_give_the_models_logits(variant):
    model = tiny_gpt(**VARIANTS[variant])
    rows = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], [27, 18, 28, 18, 28]]
    prompt_len = [6, 2]  # row 1 is left-padded by 4 in the prefill
    oracle = full_logits(model, rows)
    decoder = StaticDecoder(model, batch=2, capacity=model.config.block_size)
    width = max(prompt_len)
    idx = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.bool)
    for b, (row, n) in enumerate(zip(rows, prompt_len)):
        idx[b, width - n:] = torch.tensor(row[:n])
        mask[b, width - n:] = True
    with torch.inference_mode():
        last = decoder.start(idx, mask)  # (2, V)
        for b, n in enumerate(prompt_len):
            torch.testing.assert_close(last[b], oracle[b][n - 1], atol=1e-4, rtol=1e-4)
        for t in range(3):  # three steps: each row gets its own next token
            tokens = torch.tensor([rows[b][prompt_len[b] + t] for b in range(2)])
            last = decoder.step(tokens)
            for b in range(2):
                torch.testing.assert_close(last[b], oracle[b][prompt_len[b] + t], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_engines_greedy_tokens_are_the_reference_generators(variant):
    model = tiny_gpt(**VARIANTS[variant])
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    expected = [c.token_ids for c in reference_generate(model, prompts, GREEDY)]
    assert [c.token_ids for c in Engine(model, GREEDY).generate(prompts)] == expected


def test_a_window_longer_than_the_context_is_cut_and_recomputed_as_the_reference_does():
    model = tiny_gpt(block_size=16)
    params = SamplingParams(max_new_tokens=40, temperature=0, stop_ids=[], window_keep=6)
    with pytest.warns(UserWarning, match="exceed the model's context"):
        got = Engine(model, params).generate([[4, 5, 6]])[0].token_ids
    with pytest.warns(UserWarning):
        assert got == reference_generate(model, [[4, 5, 6]], params)[0].token_ids


def test_run_then_truncate_forgets_the_slots_past_the_cut():
    """Rolling back is setting the length: what the forgotten slots held never reaches a later query."""
    model = tiny_gpt()
    seq = [3, 14, 15, 92, 65, 35]
    oracle = full_logits(model, [seq + [7]])[0][-1]
    decoder = StaticDecoder(model, batch=1, capacity=32)
    with torch.inference_mode():
        decoder.run(torch.tensor([seq]), torch.arange(6)[None])
        decoder.run(torch.tensor([[50, 51, 52]]), torch.arange(6, 9)[None])  # a draft that gets rejected
        decoder.truncate(6)
        got = decoder.run(torch.tensor([[7]]), torch.tensor([[6]]))[0, -1]
    torch.testing.assert_close(got, oracle, atol=1e-4, rtol=1e-4)
    with pytest.raises(Exception, match="cannot truncate"):
        decoder.truncate(9)


@pytest.mark.slow
def test_the_compiled_steps_give_the_eager_steps_tokens_in_the_engine_and_in_speculative_rounds(monkeypatch, tmp_path):
    """Compiles four graphs (tens of seconds): one token and four greedy tokens a call (the engine's, ahead of time),
    and the padded round and one token of speculative decoding; each computes what the eager step does (used even
    where it is slower)."""
    monkeypatch.setenv("TINYLM_CACHE", str(tmp_path))
    monkeypatch.setattr(fast, "MEASURE_COMPILED", False)
    model = tiny_gpt(n_kv_head=2, qk_norm=True)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8]
    params = SamplingParams(max_new_tokens=24, temperature=0, stop_ids=[])
    eager = Engine(model, params).generate([prompt])[0]
    compiled = Engine(model, params, compile=True).generate([prompt])[0]
    assert compiled.token_ids == eager.token_ids
    assert compiled.logprobs == pytest.approx(eager.logprobs, abs=1e-4)
    assert list(fast.decode_weights(model, compiled=True).ahead_faster.values()) == [True]  # 4 tokens a call ran
    # a stop token inside a call of 4: the same tokens, and the cache keeps exactly the tokens before it
    # (the first token comes from the prompt's logits, the next four from one call)
    at = next(j for j, token in enumerate(eager.token_ids) if j >= 2 and token not in eager.token_ids[:j])
    stopping = SamplingParams(max_new_tokens=24, temperature=0, stop_ids=[eager.token_ids[at]])
    engine = Engine(model, stopping, compile=True)
    got = engine.generate([prompt])[0]
    assert got.token_ids == Engine(model, stopping).generate([prompt])[0].token_ids == eager.token_ids[:at + 1]
    assert engine.decoder.length == len(prompt) + at
    spec, stats = speculative_generate(model, prompt, params, PromptLookupDraft(), k=3, compile=True, adaptive=False)
    assert spec.token_ids == eager.token_ids and stats.proposed > stats.accepted > 0
    assert spec.logprobs == pytest.approx(eager.logprobs, abs=1e-4)
    assert all(fast.decode_weights(model, compiled=True).faster.values())  # the compiled graphs did run


def _one_token_args(decoder: StaticDecoder, token: int) -> tuple:
    """The inputs `StaticDecoder.run` gives a one-token step after the cached tokens (the slot marked real)."""
    decoder.mask[:, decoder.length] = True
    slots = torch.tensor([decoder.length])
    return (torch.tensor([[token]]), slots, decoder.next_position.clone(), decoder._written(decoder.length + 1),
            decoder.k, decoder.v)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rope, rmsnorm, swiglu", "learned, layernorm, gelu, biases (GPT-2)", "int8"])
def test_the_ahead_of_time_step_computes_the_eager_step_and_is_kept_on_disk_by_its_weights(monkeypatch, tmp_path,
                                                                                             name):
    """The package's logits and cache writes are the eager step's (written to an empty slot); a second decoder of
    the same weights loads the package without building; changed weights build another."""
    from tinylm.generate import aot
    from tinylm.model.quant import quantize_int8

    monkeypatch.setenv("TINYLM_CACHE", str(tmp_path))
    model = tiny_gpt(n_kv_head=2, qk_norm=True) if name == "int8" else tiny_gpt(**VARIANTS[name])
    if name == "int8":
        quantize_int8(model)

    def step_and_eager(model):
        decoder = StaticDecoder(model, 1, 16, compile=True)
        with torch.inference_mode():
            decoder.start(torch.tensor([[3, 1, 4, 1, 5]]), torch.ones(1, 5, dtype=torch.bool))
            args = _one_token_args(decoder, 9)
            step = decoder.compiled_weights.compiled_step(decoder._shape(args[0]), args)
            eager_k = decoder.k.clone()
            # (int8: the eager kernels quantize activations too; the oracle is then the same weight-only sum, eager)
            oracle = decoder.compiled_weights if name == "int8" else decoder.weights
            eager = oracle.step(*args[:4], eager_k, decoder.v.clone(), written_out=name == "int8")
            got = step(*args)
        return step, got, eager, decoder.k, eager_k

    step, got, eager, k, eager_k = step_and_eager(model)
    assert isinstance(step, aot.AOTStep)
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k, eager_k)  # the new token's keys written in place, at its slot
    assert k[:, :, :, 5].abs().sum() > 0
    packages = list((tmp_path / "decode").glob("*.pt2"))
    assert packages == [step.path]

    built = []
    monkeypatch.setattr(aot, "_build", lambda *a: built.append(a))
    fast._LAYOUTS.clear()  # a fresh layout of the same weights: the package on disk serves it
    again, got_again, _, _, _ = step_and_eager(model)
    assert not built and again.path == step.path
    torch.testing.assert_close(got_again, got)
    with torch.no_grad():
        model.E.weight[9] += 1.0  # changed weights: another digest, another package
    with pytest.warns(UserWarning):  # (the stub builds nothing, so it cannot be loaded: torch.compile instead)
        step_and_eager(model)
    assert len(built) == 1


@pytest.mark.slow
def test_where_the_ahead_of_time_step_cannot_be_built_torch_compile_decodes_with_one_warning(monkeypatch, tmp_path):
    from tinylm.generate import aot

    monkeypatch.setenv("TINYLM_CACHE", str(tmp_path))
    monkeypatch.setattr(fast, "MEASURE_COMPILED", False)

    def no_compiler(*args):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(aot, "_build", no_compiler)
    model = tiny_gpt()
    params = SamplingParams(max_new_tokens=10, temperature=0, stop_ids=[])
    with pytest.warns(UserWarning, match="ahead-of-time decoding step could not be built .*no C.. compiler"):
        got = Engine(model, params, compile=True).generate([[4, 5, 6]])[0].token_ids
    assert got == Engine(model, params).generate([[4, 5, 6]])[0].token_ids
    assert not any(isinstance(s, aot.AOTStep) for s in decode_weights(model, compiled=True)._compiled.values())


def test_large_matrices_move_to_huge_pages_unchanged_and_small_ones_stay():
    big, small = torch.randn(1024, 1024), torch.randn(16, 16)  # 4 MiB and 1 KiB
    moved = fast.on_huge_pages(big)
    assert torch.equal(moved, big) and moved.shape == big.shape
    assert fast.on_huge_pages(small) is small
    if hasattr(__import__("mmap"), "MADV_HUGEPAGE"):
        assert moved.data_ptr() != big.data_ptr()  # a copy, in its own mapping (on Linux)
    model = tiny_gpt(d_model=512, vocab_size=2048)  # a head of 4 MiB
    weights = decode_weights(model)
    torch.testing.assert_close(weights.head, model.lm_head.weight.T)


def test_the_package_digest_changes_with_the_weights_shapes_and_threads():
    from tinylm.generate.aot import package_key

    model = tiny_gpt()
    decoder = StaticDecoder(model, 1, 16)
    with torch.inference_mode():
        args = _one_token_args(decoder, 3)
    weights = decode_weights(model, compiled=True)
    key = package_key(weights, args)
    assert package_key(weights, args) == key
    assert package_key(weights, (*args[:3], decoder._written(9), *args[4:])) == key  # any width read: one package
    longer = StaticDecoder(model, 1, 20)
    with torch.inference_mode():
        assert package_key(weights, _one_token_args(longer, 3)) != key  # another cache size
    threads = torch.get_num_threads()
    shape = decoder._shape(args[0])
    try:
        torch.set_num_threads(threads + 1)
        assert package_key(weights, args) != key
        assert decoder._shape(args[0]) != shape  # so the decoder keeps (and chooses) a step per thread count
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1e-3
    assert package_key(decode_weights(model, compiled=True), args) != key


def test_with_compile_the_faster_of_the_compiled_and_the_eager_step_is_used_after_timing_both(monkeypatch):
    model = tiny_gpt()
    weights = fast.decode_weights(model, compiled=True)
    calls = []
    # a compiled step that is slow (and marks its calls): the eager one must be chosen, and used
    slow = lambda *args: (calls.append(1), time.sleep(0.01), weights.step(*args))[2]  # noqa: E731
    monkeypatch.setattr(weights, "compiled_step", lambda shape, args=None: slow)
    params = SamplingParams(max_new_tokens=12, temperature=0, stop_ids=[])
    got = Engine(model, params, compile=True).generate([[4, 5, 6]])[0].token_ids
    assert got == Engine(model, params).generate([[4, 5, 6]])[0].token_ids
    assert list(weights.faster.values()) == [False]
    assert len(calls) == 1 + fast.COMPARE_ROUNDS  # compiling and timing; never afterwards


def test_the_layout_is_rebuilt_when_the_weights_change():
    model = tiny_gpt()
    first = decode_weights(model)
    assert decode_weights(model) is first  # kept while nothing changes
    with torch.no_grad():
        model.blocks[0].attn.W_q.weight.mul_(2.0)  # a training step changes weights in place
    second = decode_weights(model)
    assert second is not first
    torch.testing.assert_close(second.layers[0]["qkv"][0][:, :32], model.blocks[0].attn.W_q.weight.T)


def test_models_the_layout_does_not_cover_decode_through_their_own_forward():
    bigram = tiny_gpt(bigram_hash=64)
    assert not supports(bigram)
    assert isinstance(make_decoder(bigram, 1, 16), CachedDecoder)
    assert isinstance(make_decoder(BigramLM(torch.full((5, 5), 0.2)), 1, 16), CachedDecoder)
    assert isinstance(make_decoder(tiny_gpt(), 1, 16), StaticDecoder)
    with pytest.raises(Exception, match="bigram-hash"):
        DecodeWeights(bigram)


def test_the_package_folder_keeps_the_most_recently_used_packages_within_its_budget(tmp_path):
    import os

    from tinylm.generate.aot import prune

    paths = []
    for i in range(5):  # 0 used longest ago ... 4 most recently
        path = tmp_path / f"{i}.pt2"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + i, 1000 + i))
        paths.append(path)
    (tmp_path / "notes.txt").write_bytes(b"y" * 1000)  # not a package: never touched
    removed = prune(tmp_path, keep=paths[0], budget=250)  # the one just made is kept, however old its time
    assert removed == paths[1:4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.pt2", "4.pt2", "notes.txt"]
    assert prune(tmp_path, keep=paths[4], budget=250) == []
