"""Mixture-of-Experts models out to Mixtral, Qwen2-MoE and llama.cpp, and in from Mixtral and Qwen2-MoE, with
`transformers` and llama.cpp as the oracles.

Export: a tiny random tinylm MoE model (2 layers, width 32, 4 or 5 experts, top-1 to top-3) written by
`export_hf` must load in ``AutoModelForCausalLM`` as the expected class with no weight missing or unexpected and
give the same logits (1e-4, float32); written by `export_gguf`, llama.cpp must continue a prompt with the same
20 greedy tokens in f32 and f16. Import: Mixtral and Qwen2-MoE models built by `transformers`' own classes
(random weights) must import with the same logits and decode, sample and evaluate as a tinylm run the way
`transformers` computes them. What neither architecture computes is refused in one line naming the setting.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from exportkit import PROMPT, greedy, randomize, save
from safetensors import safe_open
from safetensors.torch import save_file

from tinylm.cli import main
from tinylm.config import Config, GPTConfig, dump_toml
from tinylm.errors import TinyLMError
from tinylm.export import architecture_for, export_gguf, export_hf, export_run, import_hf, import_hf_into_run
from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams
from tinylm.model import GPT
from tinylm.run import load_run

import gguf
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

ATOL = 1e-4
MOE = dict(vocab_size=302, block_size=64, n_layer=2, d_model=32, n_head=4, n_kv_head=2, mlp="swiglu", norm="rmsnorm",
           positions="rope", bias=False, norm_eps=1e-6, rope_theta=500.0, moe_experts=4, moe_top_k=2, moe_d_ff=16)
# name -> (the settings over MOE, the transformers class that computes them), the class written out here
MODELS = {
    "mixtral": (dict(), "MixtralForCausalLM"),
    "mixtral-top3-of-5-untied": (dict(moe_experts=5, moe_top_k=3, tie_embeddings=False, n_kv_head=None),
                                 "MixtralForCausalLM"),
    "qwen2moe-scores-as-gates": (dict(moe_norm_topk=False), "Qwen2MoeForCausalLM"),
    "qwen2moe-top1": (dict(moe_top_k=1, moe_norm_topk=False), "Qwen2MoeForCausalLM"),
    "qwen2moe-shared-qkv-bias-untied": (dict(moe_shared_experts=1, qkv_bias=True, tie_embeddings=False),
                                        "Qwen2MoeForCausalLM"),
}
HF_SHAPE = dict(vocab_size=302, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=297, eos_token_id=298,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0})


def tiny_moe(name: str, seed: int = 0) -> GPT:
    with torch.random.fork_rng(devices=[]):
        model = GPT(GPTConfig(**{**MOE, **MODELS[name][0]}))
    return randomize(model, seed)


def token_batch(tokenizer) -> torch.Tensor:
    """Two rows of real text: enough tokens that every expert of every layer is chosen by some."""
    ids = tokenizer.encode(PROMPT)[:40]
    return torch.tensor([ids, ids[::-1]])


# ----- export to transformers -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_loads_the_export_with_the_same_logits(tmp_path, tokenizer, name):
    model = tiny_moe(name)
    export_hf(model, tokenizer, tmp_path / "hf")
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(hf).__name__ == MODELS[name][1]
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    x = token_batch(tokenizer)
    inputs = []  # each MoE layer's input: the test would prove little if some expert were never chosen
    hooks = [layer.mlp.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for layer in model.blocks]
    with torch.no_grad():
        ours, theirs = model(x)[0], hf.eval()(x).logits
        for layer, h in zip(model.blocks, inputs):
            chosen = layer.mlp.route(h.reshape(-1, h.size(-1)))[1].experts
            assert set(chosen.flatten().tolist()) == set(range(model.config.moe_experts))
    for hook in hooks:
        hook.remove()
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_the_mixtral_config_and_tensors_are_the_hub_layout(tmp_path, tokenizer):
    model = tiny_moe("mixtral-top3-of-5-untied")
    export_hf(model, tokenizer, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"],
            config["intermediate_size"], config["sliding_window"]) == ("mixtral", 5, 3, 16, None)
    state = model.state_dict()
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert torch.equal(f.get_tensor("model.layers.1.block_sparse_moe.gate.weight"),
                           state["blocks.1.mlp.router.weight"])
        for theirs, ours in (("w1", "W_1"), ("w3", "W_3"), ("w2", "W_2")):
            assert torch.equal(f.get_tensor(f"model.layers.1.block_sparse_moe.experts.4.{theirs}.weight"),
                               state[f"blocks.1.mlp.experts.4.{ours}.weight"])
    assert not any(".mlp." in n for n in names)  # no dense MLP, and no selection bias: neither is Mixtral's


def test_qwen2_moe_gates_the_shared_expert_by_exactly_one_half(tmp_path, tokenizer):
    """tinylm's shared expert is ungated; Qwen2-MoE's is scaled by sigmoid(x w_g): w_g = 0 and W_2 doubled."""
    model = tiny_moe("qwen2moe-shared-qkv-bias-untied")
    export_hf(model, tokenizer, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["shared_expert_intermediate_size"], config["moe_intermediate_size"], config["norm_topk_prob"],
            config["qkv_bias"], config["decoder_sparse_step"], config["mlp_only_layers"]) == (16, 16, True, True, 1, [])
    state = model.state_dict()
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert not f.get_tensor("model.layers.0.mlp.shared_expert_gate.weight").any()
        assert torch.equal(f.get_tensor("model.layers.0.mlp.shared_expert.down_proj.weight"),
                           2 * state["blocks.0.mlp.shared.W_2.weight"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        hf.model.layers[0].mlp.shared_expert_gate.weight.fill_(0.01)  # any other gate is another model
        x = token_batch(tokenizer)
        assert (model(x)[0] - hf(x).logits).abs().max() > 1e-2


@pytest.mark.parametrize("changes, named", [
    (dict(moe_router="sigmoid"), "moe_router = 'sigmoid'"),
    (dict(moe_balance="bias"), "moe_balance = 'bias'"),
    (dict(mlp="gelu"), "mlp = 'gelu'"),
    (dict(qk_norm=True), "qk_norm = true"),
    (dict(bias=True), "bias = true"),
    (dict(moe_norm_topk=False, sliding_window=8), "sliding_window = 8"),
])
def test_what_neither_mixtral_nor_qwen2_moe_computes_is_refused_in_one_line(tmp_path, tokenizer, changes, named):
    model = GPT(GPTConfig(**{**MOE, **changes}))
    with pytest.raises(TinyLMError, match="neither Mixtral nor Qwen2-MoE") as info:
        export_hf(model, tokenizer, tmp_path / "hf")
    assert named in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "hf").exists()


def test_tinylm_export_refuses_a_sigmoid_router_run_with_a_nonzero_exit(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    config = Config(model=GPTConfig(**{**MOE, "moe_router": "sigmoid"}))
    (tmp_path / "run" / "config.toml").write_text(dump_toml(config.to_dict()))
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) != 0
    err = capsys.readouterr().err.strip()
    assert "moe_router = 'sigmoid'" in err and len(err.splitlines()) == 1


def test_a_dense_architecture_is_never_chosen_for_an_moe_model():
    assert architecture_for(GPTConfig(**MOE)) == "mixtral"
    assert architecture_for(GPTConfig(**{**MOE, "moe_norm_topk": False})) == "qwen2_moe"
    assert architecture_for(GPTConfig(**{k: v for k, v in MOE.items() if not k.startswith("moe_")})) == "llama"
    with pytest.raises(TinyLMError, match="moe_experts = 4 .Llama's MLP is dense"):
        architecture_for(GPTConfig(**MOE, export_as="llama"))


# ----- export to llama.cpp ---------------------------------------------------------------------------------


def llama_cpp_greedy(path, start: list[int], steps: int = 20) -> list[int]:
    from llama_cpp import Llama

    # a float32 KV cache (GGML_TYPE_F32 = 0), so that only the file's own precision differs
    llm = Llama(model_path=str(path), n_ctx=64, logits_all=True, n_threads=1, type_k=0, type_v=0, verbose=False)
    llm.eval(start)
    tokens = list(start)
    for _ in range(steps):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    return tokens


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("name", ["mixtral", "mixtral-top3-of-5-untied"])
def test_llama_cpp_continues_the_gguf_export_greedily_as_tinylm_does(tmp_path, tokenizer, name, dtype):
    model = tiny_moe(name)
    export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype=dtype)
    start = tokenizer.encode("def ")
    with torch.no_grad():
        expected = greedy(lambda x: model(x)[0], start)
    assert len(set(expected[len(start):])) > 5
    assert llama_cpp_greedy(tmp_path / "m.gguf", start) == expected


def test_the_gguf_file_stacks_the_experts_and_keeps_the_router_in_float32(tmp_path, tokenizer):
    model = tiny_moe("mixtral-top3-of-5-untied")
    export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f16")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    meta = {name: field.contents() for name, field in reader.fields.items()}
    assert (meta["general.architecture"], meta["llama.expert_count"], meta["llama.expert_used_count"],
            meta["llama.feed_forward_length"]) == ("llama", 5, 3, 16)
    tensors = {t.name: t for t in reader.tensors}
    state = model.state_dict()
    router = tensors["blk.1.ffn_gate_inp.weight"]
    assert router.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(np.array(router.data), state["blocks.1.mlp.router.weight"].numpy())
    for theirs, ours in (("gate", "W_1"), ("up", "W_3"), ("down", "W_2")):
        t = tensors[f"blk.1.ffn_{theirs}_exps.weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.F16
        stacked = np.stack([state[f"blocks.1.mlp.experts.{e}.{ours}.weight"].numpy() for e in range(5)])
        assert np.array_equal(np.array(t.data), stacked.astype(np.float16))  # (E, out, in), expert e at e
    assert not any(".ffn_gate.weight" in n or "ffn_up.weight" in n for n in tensors)


@pytest.mark.parametrize("name", ["qwen2moe-scores-as-gates", "qwen2moe-shared-qkv-bias-untied"])
def test_a_model_only_qwen2_moe_computes_is_refused_for_llama_cpp_in_one_line(tmp_path, tokenizer, name):
    named = "moe_norm_topk = false" if name == "qwen2moe-scores-as-gates" else "moe_shared_experts = 1"
    with pytest.raises(TinyLMError, match="but not to llama.cpp") as info:
        export_gguf(tiny_moe(name), tokenizer, tmp_path / "m.gguf")
    assert named in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "m.gguf").exists()


# ----- import from transformers ---------------------------------------------------------------------------


def hf_mixtral(**changes) -> MixtralForCausalLM:
    torch.manual_seed(0)
    config = MixtralConfig(**{**HF_SHAPE, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                              **changes})
    return randomize(MixtralForCausalLM(config)).eval()


def hf_qwen2_moe(shared: bool, gate: float = 0.0, **changes) -> Qwen2MoeForCausalLM:
    """A Qwen2-MoE model whose shared expert (of the routed experts' width, or none) has a constant gate weight."""
    torch.manual_seed(0)
    config = Qwen2MoeConfig(**{**HF_SHAPE, "intermediate_size": 64, "moe_intermediate_size": 16,
                               "shared_expert_intermediate_size": 16 if shared else 0, "num_experts": 4,
                               "num_experts_per_tok": 2, **changes})
    model = randomize(Qwen2MoeForCausalLM(config)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.shared_expert_gate.weight.fill_(gate)
    return model


# name -> (the transformers model, the class its export back is: Mixtral where both compute it, Mixtral first)
IMPORTS = {
    "mixtral": (hf_mixtral, "MixtralForCausalLM"),
    "qwen2moe-shared": (lambda: hf_qwen2_moe(True), "Qwen2MoeForCausalLM"),
    "qwen2moe-no-shared-qkv-bias": (lambda: hf_qwen2_moe(False), "Qwen2MoeForCausalLM"),
    "qwen2moe-no-shared-no-bias-renormalised": (lambda: hf_qwen2_moe(False, qkv_bias=False, norm_topk_prob=True),
                                                "MixtralForCausalLM"),
}


@pytest.mark.parametrize("name", list(IMPORTS))
def test_a_transformers_moe_checkpoint_imports_with_the_same_logits_and_exports_back(tmp_path, tokenizer, name):
    make, back_class = IMPORTS[name]
    hf = make()
    save(hf, tmp_path / "hf", tokenizer)
    model, _, config = import_hf(tmp_path / "hf")
    assert (config.moe_experts, config.moe_top_k, config.moe_hidden_dim) == (4, 2, 16)
    assert config.moe_shared_experts == (name == "qwen2moe-shared")
    x = token_batch(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], hf(x).logits, atol=ATOL, rtol=0)
    export_hf(model, tokenizer, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [back_class]
    if back_class == type(hf).__name__:
        assert import_hf(tmp_path / "back")[2] == config
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=ATOL, rtol=0)


def test_an_imported_mixtral_run_decodes_samples_and_evaluates_as_transformers_computes(tmp_path, tokenizer, capsys):
    hf = hf_mixtral()
    save(hf, tmp_path / "hf", tokenizer)
    run_dir = import_hf_into_run(tmp_path / "hf", tmp_path / "run")
    run = load_run(run_dir)
    start = tokenizer.encode("def ")
    with torch.no_grad():
        expected = greedy(lambda x: hf(x).logits, start, steps=24)
    params = SamplingParams(max_new_tokens=24, temperature=0, stop_ids=[])
    [completion] = Engine(run.model, params).generate([start])  # prefill, then one cached step per token
    assert start + completion.token_ids == expected

    text = "def wrap(text, width=70):\n    return [line for line in text]\n"
    (tmp_path / "text.txt").write_text(text)
    capsys.readouterr()
    assert main(["eval", "--run", str(run_dir), "--corpus", str(tmp_path / "text.txt"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ids = torch.tensor([run.start_ids + tokenizer.encode(text) + [tokenizer.eos_id]])  # each document ends with EOS
    with torch.no_grad():
        loss = F.cross_entropy(hf(ids[:, :-1]).logits[0], ids[0, 1:]).item()
    assert report["tokens"] == ids.size(1) - 1
    assert report["loss"] == pytest.approx(loss, abs=ATOL)
    assert main(["sample", "--run", str(run_dir), "--prompt", "def ", "--temperature", "0",
                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_transformers_5s_fused_expert_tensors_import_too(tmp_path, tokenizer):
    """A file of the in-memory layout (experts.gate_up_proj (E, 2 d_e, d), experts.down_proj (E, d, d_e)) reads as the
    Hub's per-expert one."""
    hf = hf_mixtral()
    save(hf, tmp_path / "hf", tokenizer)
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    model = import_hf(tmp_path / "hf")[0]
    x = token_batch(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], hf(x).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("make, changes, named", [
    (lambda: hf_qwen2_moe(True, gate=0.25), {}, "shared_expert_gate gates the shared expert"),
    (lambda: hf_qwen2_moe(True), dict(shared_expert_intermediate_size=32), "shared_expert_intermediate_size is 32"),
    (lambda: hf_qwen2_moe(False), dict(mlp_only_layers=[1]), "mlp_only_layers makes some layers dense"),
    (lambda: hf_qwen2_moe(False), dict(decoder_sparse_step=2), "decoder_sparse_step makes some layers dense"),
    (lambda: hf_qwen2_moe(False), dict(use_sliding_window=True, layer_types=None), "use_sliding_window is true"),
    (hf_mixtral, dict(hidden_act="gelu"), "hidden_act is 'gelu'"),
    (hf_mixtral, dict(num_experts_per_tok=1), "num_experts_per_tok is 1"),
], ids=["gated-shared-expert", "wider-shared-expert", "dense-layers", "sparse-step", "window", "gelu", "top-1"])
def test_moe_variants_tinylm_does_not_compute_are_refused_in_one_line(tmp_path, tokenizer, make, changes, named):
    save(make(), tmp_path / "hf", tokenizer)
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    with pytest.raises(TinyLMError, match=named) as info:
        import_hf(tmp_path / "hf")
    assert "\n" not in str(info.value)


def test_missing_mixtral_keys_mean_what_mixtralconfig_reads_them_as(tmp_path, tokenizer):
    hf = hf_mixtral(num_key_value_heads=8, num_attention_heads=8, rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    save(hf, tmp_path / "hf", tokenizer)
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    for key in ("num_key_value_heads", "rms_norm_eps", "rope_parameters", "rope_theta", "sliding_window",
                "num_experts_per_tok"):
        config.pop(key, None)
    path.write_text(json.dumps(config))
    read = MixtralConfig.from_dict(config)
    ours = import_hf(tmp_path / "hf")[2]
    assert (ours.kv_heads, ours.norm_eps, ours.rope_theta, ours.sliding_window, ours.moe_top_k) == \
        (read.num_key_value_heads, read.rms_norm_eps, read.rope_parameters["rope_theta"], read.sliding_window,
         read.num_experts_per_tok)


def test_an_moe_run_exports_through_export_run(tmp_path, tokenizer):
    hf = hf_mixtral()
    save(hf, tmp_path / "hf", tokenizer)
    run_dir = import_hf_into_run(tmp_path / "hf", tmp_path / "run")
    out = export_run(run_dir, tmp_path / "again", "hf")
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    x = token_batch(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, hf(x).logits, atol=0, rtol=0)
    gguf_path = export_run(run_dir, tmp_path / "m.gguf", "gguf")
    start = tokenizer.encode("def ")
    with torch.no_grad():
        assert llama_cpp_greedy(gguf_path, start) == greedy(lambda x: hf(x).logits, start)


def test_the_bias_buffer_of_an_aux_balanced_model_is_not_exported(tmp_path, tokenizer):
    """moe_balance "aux" leaves the selection bias unused: a nonzero one changes nothing, in tinylm or the export."""
    model = tiny_moe("mixtral")
    x = token_batch(tokenizer)
    with torch.no_grad():
        before = model(x)[0]
        for layer in model.blocks:
            layer.mlp.bias.fill_(3.0)
        assert torch.equal(model(x)[0], before)
    export_hf(model, tokenizer, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, before, atol=ATOL, rtol=0)
