"""Export to and import from Hugging Face `transformers`, with `transformers` itself as the oracle.

Export: a tiny random tinylm model written by `export_hf` must load with
``AutoModelForCausalLM.from_pretrained`` (no weight missing or unexpected) and ``AutoTokenizer``
and give the same logits (within 1e-4, float32 on the CPU), the same 20-token greedy
continuation and the same token ids. Import: tiny random GPT2LMHeadModel, LlamaForCausalLM and
Qwen3ForCausalLM built with `transformers`' own config classes and ``save_pretrained`` must give
the same logits in tinylm. Export then import must give back every tensor bit for bit.
Configurations no architecture computes, and incomplete folders, must fail with messages that
say what is wrong.
"""

from __future__ import annotations

import dataclasses

import json

import pytest
import torch
from exportkit import CONFIGS, PROMPT, greedy, make_tokenizer, randomize, tiny_config, tiny_model
from safetensors import safe_open

from tinylm.errors import TinyLMError
from tinylm.export import architecture_for, export_hf, export_run, import_hf, import_hf_into_run
from tinylm.export.weights import hf_rules
from tinylm.model import GPT
from tinylm.tokenizers import CharTokenizer
from tinylm.tokenizers.base import generation_excluded
from tinylm.tokenizers.formats import BYTE_TO_UNICODE, save_hf_tokenizer_json, to_hf_tokenizer_json

import transformers
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ATOL = 1e-4

# the transformers class of each architecture, written out here rather than taken from the exporter
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def ours(model: GPT):
    return lambda ids: model(ids)[0]


def theirs(hf_model):
    return lambda ids: hf_model(ids).logits


# ----- export -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_loads_the_export_and_computes_the_same_logits_and_greedy_tokens(tmp_path, tokenizer, name):
    model = tiny_model(name)
    export_hf(model, tokenizer, tmp_path / "hf")
    hf, loading = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    hf.eval()
    assert type(hf).__name__ == CLASSES[name.split("-")[0]]
    assert hf.dtype == torch.float32
    # every weight it has came from the file (none left at its init) and every tensor in the file was used
    assert loading["missing_keys"] == loading["unexpected_keys"] == loading["mismatched_keys"] == set()

    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        a, b = model(ids)[0], hf(ids).logits
        assert a.abs().max() > 1.0  # not a degenerate model whose logits are all near zero
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
        start = tokenizer.encode("def ")
        ours_tokens = greedy(ours(model), start)
        assert greedy(theirs(hf), start) == ours_tokens
        assert len(set(ours_tokens[len(start):])) > 3  # the continuation varies, so equality says something


@pytest.mark.parametrize("cls", [AutoTokenizer, PreTrainedTokenizerFast])
def test_the_exported_tokenizer_gives_the_same_ids_and_special_tokens(tmp_path, tokenizer, cls):
    export_hf(tiny_model("gpt2"), tokenizer, tmp_path / "hf")
    hf_tok = cls.from_pretrained(tmp_path / "hf")
    # the BOS it declares (and adds) is the separator tinylm puts before a prompt of a packed run
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (
        tokenizer.eos_id, tokenizer.eos_id, tokenizer.pad_id)
    texts = [PROMPT, "Hello, world!  It's 2024...\n\n\ttabs and naïve café 中文 🙂", " leading and trailing  "]
    for text in texts:
        ids = hf_tok(text)["input_ids"]
        assert ids == [tokenizer.eos_id] + tokenizer.encode(text)
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
        assert hf_tok.decode(ids[1:]) == text and hf_tok.decode(ids, skip_special_tokens=True) == text
    # HF always reads special-token names as the specials, as tinylm does when they are allowed
    assert hf_tok("a<|eos|>b", add_special_tokens=False)["input_ids"] == tokenizer.encode("a<|eos|>b",
                                                                                          allowed_special="all")
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id,
                          "pad_token_id": tokenizer.pad_id, "suppress_tokens": generation_excluded(tokenizer)}


def test_transformers_generate_leaves_out_the_tokens_tinylm_never_samples(tmp_path, tokenizer):
    """A model whose head prefers PAD (as a barely trained one may): with the exported generation_config.json,
    transformers' generate never draws it, and greedy decoding gives tinylm's tokens."""
    from transformers import AutoModelForCausalLM

    from tinylm.generate import SamplingParams
    from tinylm.generate.engine import Engine

    model = tiny_model("gpt2")
    with torch.no_grad():  # the final norm's bias points along PAD's row of the (tied) head: PAD scores high
        direction = torch.randn(model.norm_f.bias.shape, generator=torch.Generator().manual_seed(0))
        model.norm_f.bias += 3 * direction / direction.norm()
        model.lm_head.weight[tokenizer.pad_id] = 3 * direction / direction.norm()
    export_hf(model, tokenizer, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    start = tokenizer.encode("def ")
    raw = greedy(ours(model), start)
    theirs_ids = hf.generate(torch.tensor([start]), max_new_tokens=12, do_sample=False)[0, len(start):].tolist()
    [mine] = Engine(model, SamplingParams(max_new_tokens=12, temperature=0), tokenizer).generate([start])
    assert theirs_ids[:len(mine.token_ids)] == mine.token_ids
    assert tokenizer.pad_id not in mine.token_ids and tokenizer.pad_id not in theirs_ids
    assert tokenizer.pad_id in raw  # without suppressing it, the model picks PAD: the check above says something


def test_the_safetensors_file_writes_tied_weights_once_and_gpt2_matrices_transposed(tmp_path, tokenizer):
    model = tiny_model("gpt2")
    export_hf(model, tokenizer, tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        c_attn = f.get_tensor("transformer.h.0.attn.c_attn.weight")
        c_fc = f.get_tensor("transformer.h.1.mlp.c_fc.weight")
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names  # the tied head is E, once
    assert len(names) == 2 + 2 * 12 + 2  # wte, wpe; 12 per block; ln_f weight and bias
    b0, b1 = model.blocks[0].attn, model.blocks[1].mlp
    # Conv1D stores (in, out): c_attn is [W_q | W_k | W_v] side by side, c_fc is W_1 transposed
    assert c_attn.shape == (32, 96)
    assert torch.equal(c_attn[:, :32], b0.W_q.weight.T) and torch.equal(c_attn[:, 64:], b0.W_v.weight.T)
    assert torch.equal(c_fc, b1.W_1.weight.T)


def test_qwen3_writes_the_q_and_k_norms_and_a_config_without_sliding_window(tmp_path, tokenizer):
    model = tiny_model("qwen3-mha-untied")
    export_hf(model, tokenizer, tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        q_norm = f.get_tensor("model.layers.1.self_attn.q_norm.weight")
        k_norm = f.get_tensor("model.layers.0.self_attn.k_norm.weight")
    assert names == {rule.theirs for rule in hf_rules(model.config)}
    assert len(names) == 1 + 2 * 11 + 2  # embed_tokens; 11 per block (9 of Llama's, q_norm, k_norm); norm, lm_head
    assert q_norm.shape == (16,) and torch.equal(q_norm, model.blocks[1].attn.q_norm.weight)
    assert torch.equal(k_norm, model.blocks[0].attn.k_norm.weight)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 16 and config["num_key_value_heads"] == 2 and config["intermediate_size"] == 80
    assert config["use_sliding_window"] is False and config["attention_bias"] is False
    assert config["layer_types"] == ["full_attention"] * 2
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.sliding_window is None and hf.config.rms_norm_eps == model.config.norm_eps


def test_untied_llama_writes_its_head_and_no_gpt2_names(tmp_path, tokenizer):
    model = tiny_model("llama-mha-bias-untied")
    export_hf(model, tokenizer, tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        head = f.get_tensor("lm_head.weight")
        q_bias = f.get_tensor("model.layers.1.self_attn.q_proj.bias")
    assert names == {rule.theirs for rule in hf_rules(model.config)}
    assert torch.equal(head, model.lm_head.weight) and torch.equal(q_bias, model.blocks[1].attn.W_q.bias)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is True
    assert config["head_dim"] == 16 and config["num_key_value_heads"] == 2 and config["intermediate_size"] == 80


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_then_import_gives_back_every_tensor_and_the_configuration(tmp_path, tokenizer, name):
    model = tiny_model(name)
    export_hf(model, tokenizer, tmp_path / "hf")
    back, tok, config = import_hf(tmp_path / "hf")
    assert tok.fingerprint() == tokenizer.fingerprint()
    mine, yours = model.state_dict(), back.state_dict()
    for key, t in mine.items():
        assert torch.equal(yours[key], t), key
    if model.config.bias or not name.startswith("gpt2"):
        # how the weights were first drawn is not part of the function; transformers has no field for it
        started = dataclasses.replace(model.config, zero_init_projections=False, head_init_std=None)
        assert config == started
        assert set(yours) == set(mine)
    else:
        # GPT-2 always has biases: a bias-free model comes back with zero biases, the same function
        assert config.bias and config == tiny_config(name, bias=True)
        extra = set(yours) - set(mine)
        assert extra and all(k.endswith(".bias") and not yours[k].any() for k in extra)
    if config.tie_embeddings:
        assert back.lm_head.weight is back.E.weight  # tied again, not two copies
    else:
        assert back.lm_head.weight is not back.E.weight


def test_a_bias_free_model_exported_as_gpt2_computes_the_same_with_zero_biases(tmp_path, tokenizer):
    model = tiny_model("gpt2-nobias-untied")
    export_hf(model, tokenizer, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert not hf.transformer.h[0].attn.c_attn.bias.any()
    assert hf.config.layer_norm_epsilon == 1e-6 and hf.config.n_inner == 48
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids)[0], atol=ATOL, rtol=0)


def test_export_refuses_to_overwrite_and_refuses_non_bpe_tokenizers(tmp_path, tokenizer):
    model = tiny_model("gpt2")
    export_hf(model, tokenizer, tmp_path / "hf")
    with pytest.raises(TinyLMError, match="already holds config.json, model.safetensors"):
        export_hf(model, tokenizer, tmp_path / "hf")
    export_hf(model, tokenizer, tmp_path / "hf", overwrite=True)
    char = CharTokenizer.train("abc")
    with pytest.raises(TinyLMError, match="a char tokenizer cannot be exported .* byte-level BPE only"):
        export_hf(tiny_model("gpt2", vocab_size=char.vocab_size), char, tmp_path / "char")
    # the weights alone are fine
    export_hf(tiny_model("gpt2", vocab_size=char.vocab_size), None, tmp_path / "weights")
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["config.json", "model.safetensors"]


# ----- configurations no architecture computes ---------------------------------------------------------


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(positions="sinusoidal"), ["positions = 'sinusoidal'", "learned", "rope"]),
        (dict(positions="none"), ["positions = 'none'"]),
        (dict(norm_position="post"), ["norm_position = 'post'"]),
        (dict(positions="rope"), ["positions = 'rope' (GPT-2", "norm = 'layernorm' (Llama", "mlp = 'gelu' (Llama"]),
        (dict(norm="rmsnorm"), ["norm = 'rmsnorm' (GPT-2 uses 'layernorm')"]),
        (dict(n_kv_head=2), ["n_kv_head = 2 (GPT-2 has no grouped-query attention"]),
        (dict(mlp="swiglu"), ["mlp = 'swiglu' (GPT-2's MLP is 'gelu')"]),
        (dict(mlp="swiglu", norm="rmsnorm", positions="learned"), ["positions = 'learned' (Llama rotates"]),
        (dict(mlp="relu2"), ["mlp = 'relu2' (GPT-2's MLP is 'gelu')", "mlp = 'relu2' (Llama's MLP is 'swiglu')"]),
        # QK-norm is Qwen3's: a QK-norm model is weighed against GPT-2 and Qwen3, and refused for what they lack
        (dict(qk_norm=True), ["neither GPT-2 nor Qwen3", "qk_norm = true (GPT-2 does not normalize q and k)",
                              "positions = 'learned' (Qwen3 rotates q and k: 'rope')", "mlp = 'gelu' (Qwen3's"]),
        (dict(qk_norm=True, mlp="swiglu", norm="rmsnorm", positions="rope"),
         ["neither GPT-2 nor Qwen3", "as Qwen3ForCausalLM: bias = true (Qwen3's MLP has no biases)"]),
        (dict(qk_norm=True, mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, norm_position="post"),
         ["norm_position = 'post' (Qwen3 normalizes each sublayer's input: 'pre')"]),
        (dict(qk_norm=True, mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, logit_softcap=30.0),
         ["as Qwen3ForCausalLM: logit_softcap = 30 (Qwen3 does not cap its logits; Gemma 2 does)"]),
        (dict(logit_softcap=30.0), ["logit_softcap = 30 (GPT-2 does not cap its logits; Gemma 2 does)"]),
        # Gemma's own settings on a model neither GPT-2 nor Llama computes
        (dict(attn_softcap=50.0, attn_scale_dim=16), ["attn_softcap = 50 (Llama does not cap its scores; Gemma 2 does)",
                                                      "attn_scale_dim = 16 (GPT-2 divides the scores by sqrt(d_h))"]),
        (dict(value_embed=True), ["value_embed = true (neither has value embeddings)"]),
        (dict(bigram_hash=64), ["bigram_hash = 64 (neither has a bigram-hash embedding)"]),
    ],
)
def test_configurations_neither_architecture_computes_are_refused_by_name(tmp_path, tokenizer, changes, named):
    model = tiny_model("gpt2", **changes)
    with pytest.raises(TinyLMError) as info:
        export_hf(model, tokenizer, tmp_path / "hf")
    message = str(info.value)
    weighed = "Qwen3" if changes.get("qk_norm") else "Llama"  # the Llama-shaped one the qk_norm switch picks
    assert message.startswith(f"this model cannot be exported: neither GPT-2 nor {weighed} computes it")
    assert "\n" not in message
    for words in named:
        assert words in message
    assert not (tmp_path / "hf").exists()  # refused before anything is written


def test_architecture_for_picks_the_one_that_fits():
    assert architecture_for(tiny_config("gpt2")) == "gpt2"
    assert architecture_for(tiny_config("llama-gqa")) == "llama"
    assert architecture_for(tiny_config("llama-gqa", bias=True, n_kv_head=1)) == "llama"
    assert architecture_for(tiny_config("qwen3-gqa")) == "qwen3"
    assert architecture_for(tiny_config("llama-gqa", qk_norm=True)) == "qwen3"
    assert architecture_for(tiny_config("qwen3-gqa", qk_norm=False)) == "llama"


# ----- import from transformers ----------------------------------------------------------------------


def hf_gpt2(tie: bool = True, **changes) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=302, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=297,
                        eos_token_id=298, tie_word_embeddings=tie, **changes)
    return randomize(GPT2LMHeadModel(config))


def hf_llama(tie: bool = False, **changes) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=302, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                         rope_theta=1000.0, tie_word_embeddings=tie, bos_token_id=297, eos_token_id=298, **changes)
    return randomize(LlamaForCausalLM(config))


def hf_qwen3(tie: bool = False, **changes) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=302, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         rms_norm_eps=1e-6, rope_theta=1000.0,
                         tie_word_embeddings=tie, bos_token_id=297, eos_token_id=298, **changes)
    return randomize(Qwen3ForCausalLM(config))  # q_norm and k_norm gains random too: "norm" is in their names


def save_hf(model, folder, tokenizer, **kwargs) -> None:
    model.save_pretrained(folder, **kwargs)
    save_hf_tokenizer_json(tokenizer, folder / "tokenizer.json")


@pytest.mark.parametrize(
    "make",
    [hf_gpt2, lambda: hf_gpt2(tie=False, n_inner=40, layer_norm_epsilon=1e-6), hf_llama, lambda: hf_llama(tie=True),
     lambda: hf_llama(attention_bias=True, mlp_bias=True), hf_qwen3, lambda: hf_qwen3(tie=True)],
    ids=["gpt2", "gpt2-untied", "llama-gqa", "llama-tied", "llama-bias", "qwen3-gqa", "qwen3-tied"],
)
def test_a_transformers_checkpoint_imports_with_the_same_logits(tmp_path, tokenizer, make):
    hf = make().eval()
    save_hf(hf, tmp_path / "hf", tokenizer)
    model, tok, config = import_hf(tmp_path / "hf")
    assert tok.fingerprint() == tokenizer.fingerprint()
    assert config.tie_embeddings == hf.config.tie_word_embeddings
    assert config.qk_norm == (hf.config.model_type == "qwen3")
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], hf(ids).logits, atol=ATOL, rtol=0)
        start = tokenizer.encode("def ")
        assert greedy(ours(model), start) == greedy(theirs(hf), start)


def test_a_sharded_checkpoint_imports(tmp_path, tokenizer):
    hf = hf_llama().eval()
    save_hf(hf, tmp_path / "hf", tokenizer, max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    model, _, _ = import_hf(tmp_path / "hf")
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], hf(ids).logits, atol=ATOL, rtol=0)


def test_openai_style_gpt2_names_without_the_transformer_prefix_import(tmp_path, tokenizer):
    """OpenAI's own upload names GPT2Model's tensors ("h.0.attn.c_attn.weight") and keeps the mask buffers."""
    from safetensors.torch import save_file

    hf = hf_gpt2().eval()
    save_hf(hf, tmp_path / "hf", tokenizer)
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        tensors = {name.removeprefix("transformer."): f.get_tensor(name) for name in f.keys()}
    tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))  # the causal-mask buffer: not a weight
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    model, _, _ = import_hf(tmp_path / "hf")
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], hf(ids).logits, atol=ATOL, rtol=0)


# ----- import errors -----------------------------------------------------------------------------------


@pytest.fixture
def gpt2_folder(tmp_path, tokenizer):
    save_hf(hf_gpt2(), tmp_path / "hf", tokenizer)
    return tmp_path / "hf"


def edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_missing_files_are_named(tmp_path, gpt2_folder):
    with pytest.raises(TinyLMError, match="is not a folder"):
        import_hf(tmp_path / "nowhere")
    (gpt2_folder / "model.safetensors").rename(gpt2_folder / "pytorch_model.bin")
    with pytest.raises(TinyLMError, match=r"has no model.safetensors .*pytorch_model.bin: pickle files"):
        import_hf(gpt2_folder)
    (gpt2_folder / "tokenizer.json").unlink()
    with pytest.raises(TinyLMError, match=r"has no tokenizer.json \(nor vocab.json"):
        import_hf(gpt2_folder)
    (gpt2_folder / "config.json").unlink()
    with pytest.raises(TinyLMError, match=r"config.json is missing"):
        import_hf(gpt2_folder)


def test_a_shard_missing_from_a_sharded_checkpoint_is_named(tmp_path, tokenizer):
    save_hf(hf_llama(), tmp_path / "hf", tokenizer, max_shard_size="20KB")
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(TinyLMError, match=f"{shard.name} is missing"):
        import_hf(tmp_path / "hf")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(model_type="bert", architectures=["BertForMaskedLM"]), "describes a bert model .* tinylm imports "
                                                                     "GPT2LMHeadModel, LlamaForCausalLM, "
                                                                     "Qwen3ForCausalLM, Qwen2ForCausalLM, "
                                                                     "MistralForCausalLM, Phi3ForCausalLM, "
                                                                     "Gemma2ForCausalLM, Gemma3ForCausalLM, "
                                                                     "MixtralForCausalLM and Qwen2MoeForCausalLM "
                                                                     "checkpoints only"),
        (dict(activation_function="gelu"), "activation_function is 'gelu'"),
        (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
        (dict(n_embd=48), r"'transformer.wte.weight' is \(302, 32\), but config.json implies \(302, 48\)"),
        (dict(n_layer=3), "has no tensor 'transformer.h.2.ln_1.weight'"),
        (dict(n_layer=1), "has tensors tinylm would not use .*transformer.h.1"),
    ],
)
def test_unsupported_architectures_and_mismatched_configs_are_clear_errors(gpt2_folder, changes, message):
    edit_config(gpt2_folder, **changes)
    with pytest.raises(TinyLMError, match=message):
        import_hf(gpt2_folder)


def test_llama_variants_tinylm_does_not_compute_are_refused(tmp_path, tokenizer):
    save_hf(hf_llama(), tmp_path / "hf", tokenizer)
    for changes, message in [
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 8.0}), "RoPE is scaled"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0}),
         "its 'llama3' RoPE scaling has no 'low_freq_factor'"),
        (dict(hidden_act="gelu"), "hidden_act is 'gelu'"),
        (dict(attention_bias=True), "attention_bias and mlp_bias differ"),
        # a head size of its own is d_head; weights that do not have it are named with both shapes
        (dict(head_dim=16), r"q_proj.weight' is \(32, 32\), but config.json implies \(64, 32\)"),
    ]:
        original = (tmp_path / "hf" / "config.json").read_text()
        edit_config(tmp_path / "hf", **changes)
        with pytest.raises(TinyLMError, match=message):
            import_hf(tmp_path / "hf")
        (tmp_path / "hf" / "config.json").write_text(original)


def test_qwen3_variants_tinylm_does_not_compute_are_refused(tmp_path, tokenizer):
    save_hf(hf_qwen3(), tmp_path / "hf", tokenizer)
    original = (tmp_path / "hf" / "config.json").read_text()
    without_head_dim = {k: v for k, v in json.loads(original).items() if k != "head_dim"}
    for changes, message in [
        (dict(use_sliding_window=True, sliding_window=16), "turns on a sliding window"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "turns on a sliding window"),
        (dict(attention_bias=True), "attention_bias is true, but its MLP has no biases"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0}), "RoPE is scaled"),
    ]:
        edit_config(tmp_path / "hf", **changes)
        with pytest.raises(TinyLMError, match=f"{message}.*variant of Qwen3ForCausalLM"):
            import_hf(tmp_path / "hf")
        (tmp_path / "hf" / "config.json").write_text(original)
    # Qwen3Config reads a missing head_dim as 128, not hidden_size / heads: so does the import (these weights
    # have heads of 8, so it names the shapes that disagree)
    assert Qwen3Config.from_dict(without_head_dim).head_dim == 128
    (tmp_path / "hf" / "config.json").write_text(json.dumps(without_head_dim))
    with pytest.raises(TinyLMError, match=r"q_proj.weight' is \(32, 32\), but config.json implies \(512, 32\)"):
        import_hf(tmp_path / "hf")


def test_a_tokenizer_in_gpt2s_byte_order_is_imported_with_its_ids(gpt2_folder, tokenizer):
    """OpenAI's GPT-2 vocab starts with '!' (byte 33) at id 0: not tinylm's layout, so it is read with its own ids
    (the embedding rows stay where they are) and encodes as the `tokenizers` library does with the same file."""
    from tokenizers import Tokenizer as HFTokenizer

    data = to_hf_tokenizer_json(tokenizer)
    order = sorted(range(256), key=lambda b: (b < 33 or 126 < b < 161 or b == 173, BYTE_TO_UNICODE[b]))
    for new_id, b in enumerate(order):
        data["model"]["vocab"][BYTE_TO_UNICODE[b]] = new_id
    (gpt2_folder / "tokenizer.json").write_text(json.dumps(data))
    _, imported, _ = import_hf(gpt2_folder)
    assert imported.kind == "bytelevel" and imported.token_bytes(0) == b"!"
    oracle = HFTokenizer.from_file(str(gpt2_folder / "tokenizer.json"))
    text = PROMPT + " naïve 😀 \x00\t\t  end"
    assert imported.encode(text) == oracle.encode(text, add_special_tokens=False).ids
    assert imported.decode(imported.encode(text)) == text


# ----- run directories ---------------------------------------------------------------------------------


def test_import_into_a_run_then_load_run_and_export_it_again(tmp_path, tokenizer):
    from tinylm.run import load_run

    hf = hf_llama().eval()
    save_hf(hf, tmp_path / "hf", tokenizer)
    run_dir = import_hf_into_run(tmp_path / "hf", tmp_path / "run")
    run = load_run(run_dir)
    assert run.step == 0 and run.info["status"] == "imported"
    assert run.tokenizer.fingerprint() == tokenizer.fingerprint()
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(run.model(ids)[0], hf(ids).logits, atol=ATOL, rtol=0)

    with pytest.raises(TinyLMError, match="already exists"):
        import_hf_into_run(tmp_path / "hf", run_dir)
    (tmp_path / "not-a-run").mkdir()
    (tmp_path / "not-a-run" / "notes.txt").write_text("mine")
    with pytest.raises(TinyLMError, match="not a tinylm run folder"):
        import_hf_into_run(tmp_path / "hf", tmp_path / "not-a-run", force=True)
    import_hf_into_run(tmp_path / "hf", run_dir, force=True)

    out = export_run(run_dir, tmp_path / "again", "hf")
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=0, rtol=0)


def test_export_run_refuses_a_configuration_before_loading_weights(tmp_path):
    from tinylm.config import Config, dump_toml

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text(dump_toml(Config(model=tiny_config("gpt2", positions="none")).to_dict()))
    with pytest.raises(TinyLMError, match="positions = 'none'"):
        export_run(tmp_path / "run", tmp_path / "out", "hf")
    with pytest.raises(TinyLMError, match="not a tinylm run"):
        export_run(tmp_path / "nowhere", tmp_path / "out", "hf")


def test_other_split_patterns_round_trip_through_transformers(tmp_path):
    tok = make_tokenizer("gpt2")
    model = tiny_model("llama-gqa")
    export_hf(model, tok, tmp_path / "hf")
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok(PROMPT)["input_ids"] == [tok.eos_id] + tok.encode(PROMPT)
    assert import_hf(tmp_path / "hf")[1].fingerprint() == tok.fingerprint()


def test_a_padded_output_layer_suppresses_the_ids_past_the_tokenizer(tmp_path, tokenizer):
    """An output layer rounded up past the tokenizer's ids (as for speed): tinylm never samples the extra ids, and
    neither does transformers with the exported generation config."""
    model = tiny_model("gpt2", vocab_size=tokenizer.vocab_size + 10)
    export_hf(model, tokenizer, tmp_path / "hf")
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    extra = list(range(tokenizer.vocab_size, tokenizer.vocab_size + 10))
    assert generation["suppress_tokens"] == generation_excluded(tokenizer) + extra
