"""LoRA adapters in PEFT's layout, with the `peft` library itself, `transformers` and llama.cpp as the oracles.

For every family tinylm exports, a tiny random `transformers` model is imported as a tinylm run and a LoRA run is
made on it with random A and B (both nonzero: a fresh adapter's B is zero and would hide any mistake in B or in
the scale), on every projection and, where the head is untied, on the token embedding and the head too. Its adapter written by `export_peft` must give, in ``PeftModel.from_pretrained`` on the original
model, the logits tinylm's merged model gives (float32, within 1e-4), and so must the run's merged hf export in
`transformers` and its gguf export in llama.cpp (the same greedy tokens). The other way, adapters that PEFT
itself makes (``get_peft_model`` with ``init_lora_weights=False``: random B), with other ranks and alphas per
module, a subset of modules or layers, GPT-2's and Phi-3's fused matrices, rank-stabilised scaling and LoRA on
embed_tokens and lm_head, import as LoRA runs with PEFT's logits. A chat fine-tuning's ``adapter/`` folder
is PEFT's model on the Hugging Face export of its grown base. What does not map is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import numpy as np
import pytest
import torch
from diskkit import refused
from exportkit import PROMPT, greedy, randomize, save

from tinylm.cli import main
from tinylm.errors import TinyLMError
from tinylm.finetune import finetune
from tinylm.export import export_hf, export_run, import_hf_into_run
from tinylm.export.peft import export_peft, import_peft_into_run, matrix_modules, peft_adapter, read_peft
from tinylm.model import build_model
from tinylm.model.lora import LoraSettings, adapter_state, add_lora
from tinylm.run import (LORA_BASE, checkpoint_path, load_checkpoint, load_run, lora_base_record, save_checkpoint,
                        write_run_files)

import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ATOL = 1e-4
SHAPE = dict(vocab_size=302, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=297, eos_token_id=298, pad_token_id=299)
ROPE = {"rope_type": "default", "rope_theta": 1000.0}


def hf_model(family: str) -> torch.nn.Module:
    """A tiny random model of ``family`` as `transformers` builds it (every weight random, biases and gains too)."""
    torch.manual_seed(0)
    if family in ("gpt2", "gpt2-untied"):
        config = transformers.GPT2Config(vocab_size=302, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                         bos_token_id=297, eos_token_id=298, tie_word_embeddings=family == "gpt2")
        return randomize(transformers.GPT2LMHeadModel(config))
    if family == "gemma2":
        config = transformers.Gemma2Config(**SHAPE, head_dim=8, query_pre_attn_scalar=8, sliding_window=6,
                                           attn_logit_softcapping=2.0, final_logit_softcapping=8.0,
                                           tie_word_embeddings=False, rope_parameters=ROPE)
        return randomize(transformers.Gemma2ForCausalLM(config))
    if family == "gemma3":
        rope = {"full_attention": ROPE, "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}
        config = transformers.Gemma3TextConfig(**SHAPE, head_dim=8, query_pre_attn_scalar=12, sliding_window=6,
                                               layer_types=["sliding_attention", "full_attention"],
                                               rope_parameters=rope, tie_word_embeddings=False)
        return randomize(transformers.Gemma3ForCausalLM(config))
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q, k, v biases
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),  # q_norm, k_norm
               "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
               "phi3": ("Phi3Config", "Phi3ForCausalLM", {})}  # fused qkv_proj and gate_up_proj
    config_class, model_class, extra = classes[family]
    config = getattr(transformers, config_class)(**SHAPE, rope_parameters=ROPE, **extra)
    return randomize(getattr(transformers, model_class)(config))


FAMILIES = ["gpt2", "gpt2-untied", "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"]
TIED = {"gpt2"}  # GPT-2's head is its embedding: LoRA corrects neither


@pytest.fixture(scope="module")
def bases(tmp_path_factory, tokenizer):
    """family -> (its Hugging Face folder, the tinylm run imported from it), made once per module."""
    made = {}

    def base(family: str):
        if family not in made:
            folder = tmp_path_factory.mktemp(family)
            save(hf_model(family).eval(), folder / "hf", tokenizer)
            made[family] = folder / "hf", import_hf_into_run(folder / "hf", folder / "base")
        return made[family]

    return base


def reload(folder) -> torch.nn.Module:
    """The Hugging Face model of ``folder``, loaded anew (PEFT changes the model it is given)."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def lora_run(base_run, out, settings: LoraSettings, seed: int = 1):
    """A LoRA run on ``base_run``'s best checkpoint as training writes one, its A and B random (B too)."""
    base = load_checkpoint(checkpoint_path(base_run, "best"))
    model = add_lora(base.build_model(), settings)
    g = torch.Generator().manual_seed(seed)
    adapter = {name: 0.2 * torch.randn(t.shape, generator=g) for name, t in adapter_state(model).items()}
    train = dataclasses.replace(base.config.train, lora_rank=settings.rank, lora_alpha=settings.alpha,
                                lora_targets=settings.targets)
    config = dataclasses.replace(base.config, train=train)
    write_run_files(out, config, base.tokenizer, {"status": "complete", "step": 0})
    for name in ("latest", "best"):
        path = checkpoint_path(out, name)
        save_checkpoint(path, model_state=adapter, optimizer_state=None, rng_state={}, config=config,
                        tokenizer=base.tokenizer, state={"step": 0, LORA_BASE: lora_base_record(base, path)})
    return out


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out[0]


@pytest.fixture(scope="module")
def ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer.encode(PROMPT)])


# ----- tinylm -> PEFT -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_lora_runs_adapter_loads_in_peft_and_its_merged_export_in_transformers_with_our_logits(
        family, bases, ids, tmp_path):
    hf_dir, base = bases(family)
    targets = "all" if family in TIED else "all,outer"
    run = lora_run(base, tmp_path / "lora", LoraSettings(rank=4, alpha=12.0, targets=targets))
    ours = logits(load_run(run).model, ids)
    plain = reload(hf_dir)
    assert (ours - logits(plain, ids)).abs().max() > 0.1  # the adapter changes the model a lot
    export_peft(run, tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert ("lm_head" in written) == (family not in TIED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # e.g. a rank_pattern key that matches no module
        adapted = PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(adapted, ids), ours, atol=ATOL, rtol=0)
    export_run(run, tmp_path / "merged", "hf")
    torch.testing.assert_close(logits(reload(tmp_path / "merged"), ids), ours, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family, targets", [("gpt2", "W_q,W_v,W_2"), ("phi3", "W_k,W_v,W_3"), ("phi3", "W_1")])
def test_fused_modules_with_some_parts_adapted_get_zero_blocks(family, targets, bases, ids, tmp_path):
    """GPT-2's c_attn and Phi-3's qkv_proj and gate_up_proj with only some of their matrices adapted."""
    hf_dir, base = bases(family)
    run = lora_run(base, tmp_path / "lora", LoraSettings(rank=3, alpha=5.0, targets=targets), seed=2)
    export_peft(run, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    fused = {"W_q,W_v,W_2": "attn.c_attn", "W_k,W_v,W_3": "self_attn.qkv_proj"}.get(targets)
    assert {k.split(".", 3)[-1] for k in config["rank_pattern"]} == ({fused} if fused else set())
    assert set(config["rank_pattern"].values()) <= {6} and set(config["alpha_pattern"].values()) <= {10}
    adapted = PeftModel.from_pretrained(reload(hf_dir), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(adapted, ids), logits(load_run(run).model, ids), atol=ATOL, rtol=0)


def test_a_lora_run_that_tinylm_trained_exports_for_peft(bases, ids, tmp_path):
    """The adapter as training writes it (three steps of `train` with lora_rank on GPT-2): PEFT computes its model."""
    import inspect
    import textwrap

    from tinylm.config import Config, TrainConfig
    from tinylm.train import train

    hf_dir, base = bases("gpt2")
    (tmp_path / "corpus.txt").write_text(inspect.getsource(textwrap))
    settings = TrainConfig(corpus=str(tmp_path / "corpus.txt"), data_dir=str(tmp_path / "data"), max_steps=3,
                           batch_size=2, lr=1e-2, warmup_steps=1, eval_interval=3, eval_tokens=256,
                           final_eval_tokens=256, sample_tokens=0, threads=1, device="cpu", lora_rank=4,
                           lora_targets="attention,W_1")
    result = train(Config(model=load_run(base).config.model, train=settings), tmp_path / "tuned", init_from=base,
                   progress=False, log=lambda line: None)
    assert result.status == "complete"
    export_run(tmp_path / "tuned", tmp_path / "adapter", "peft")
    ours = logits(load_run(tmp_path / "tuned").model, ids)
    assert (ours - logits(reload(hf_dir), ids)).abs().max() > 1e-3  # three steps of lr 1e-2 moved it
    adapted = PeftModel.from_pretrained(reload(hf_dir), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(adapted, ids), ours, atol=ATOL, rtol=0)


QUIET = {"log": lambda line: None, "progress": False}
TUNE = {"max_steps": 3, "batch_size": 4, "eval_interval": 3, "sample_tokens": 0, "lora_rank": 8}


def test_a_chat_fine_tuning_writes_its_adapter_for_peft_on_its_grown_base(bases, tmp_path):
    """`tinylm finetune --lora-rank 8` on tasks adds the chat tokens (its base is the grown init) and corrects the
    embedding and the head instead of training their rows: its adapter/ is PEFT's model on that base's export."""
    hf_dir, base = bases("llama")
    finetune(base, "tasks:add", tmp_path / "chat", overrides=TUNE, data_dir=tmp_path / "data", **QUIET)
    tuned = load_run(tmp_path / "chat")
    assert (tuned.config.train.lora_targets, tuned.config.train.lora_new_tokens) == ("all,outer", 0)
    grown = tuned.checkpoint.base()
    assert grown.config.model.vocab_size == load_run(base).config.model.vocab_size + 2  # the chat markers
    export_hf(grown.build_model(), grown.tokenizer, tmp_path / "grown-hf")
    config = json.loads((tmp_path / "chat" / "adapter" / "adapter_config.json").read_text())
    assert {"model.embed_tokens", "lm_head"} <= set(config["target_modules"])
    ids = torch.tensor([tuned.tokenizer.encode(PROMPT)[:12] + [grown.config.model.vocab_size - 1, 5, 9]])
    ours = logits(tuned.model, ids)
    assert (ours - logits(grown.build_model(), ids)).abs().max() > 1e-3  # three steps moved it
    adapted = PeftModel.from_pretrained(reload(tmp_path / "grown-hf"), tmp_path / "chat" / "adapter").eval()
    torch.testing.assert_close(logits(adapted, ids), ours, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family, targets", [("gpt2", None), ("llama", "attention")], ids=["tied", "no-tables"])
def test_a_fine_tuning_that_trains_the_new_rows_writes_no_peft_copy_and_says_why(family, targets, bases, tmp_path):
    """A tied head (its recipe leaves the tables out) or targets without them: the chat markers' rows train
    beside the adapter, which PEFT's layout has no place for, so adapter/ is not written and the log says so."""
    _, base = bases(family)
    lines: list[str] = []
    overrides = {**TUNE, **({"lora_targets": targets} if targets else {})}
    finetune(base, "tasks:add", tmp_path / "chat", overrides=overrides, data_dir=tmp_path / "data",
             log=lines.append, progress=False)
    assert load_run(tmp_path / "chat").config.train.lora_new_tokens == 2
    assert not (tmp_path / "chat" / "adapter").exists()
    [said] = [line for line in lines if "PEFT" in line]
    assert said.startswith("no PEFT copy of the adapter:") and "rows of 2 new tokens" in said


def test_the_pattern_keys_match_their_own_module_alone_by_peft_s_rule(bases):
    """PEFT's own matcher on twelve layers (layer 1's key must not match layer 11 or 10)."""
    from peft.utils.other import get_pattern_key

    config = dataclasses.replace(load_run(bases("phi3")[1]).config.model, n_layer=12)
    settings = LoraSettings(rank=2, alpha=4.0)
    model = add_lora(build_model(config), settings)
    _, peft_config = peft_adapter(adapter_state(model), config, settings, "base")
    keys = list(peft_config["rank_pattern"])
    assert len(keys) == 24  # qkv_proj and gate_up_proj of every layer
    for module in matrix_modules(config):
        assert get_pattern_key(keys, module) == module  # its own key, or none: the module's name itself
    assert set(peft_config["target_modules"]) == set(matrix_modules(config))


# ----- PEFT -> tinylm -----------------------------------------------------------------------------------


PEFT_CASES = {
    "llama-subset-patterns": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            rank_pattern={"model.layers.1.self_attn.q_proj": 6},
                                            alpha_pattern={"v_proj": 3}), "W_q,W_v"),
    "gpt2-fused-c_attn": ("gpt2", dict(r=4, lora_alpha=16, target_modules=["c_attn", "c_fc"],
                                       rank_pattern={"h.1.attn.c_attn": 2}), "W_q,W_k,W_v,W_1"),
    "phi3-fused": ("phi3", dict(r=3, lora_alpha=5, target_modules=["qkv_proj", "gate_up_proj", "o_proj"],
                                alpha_pattern={"gate_up_proj": 7}), "W_q,W_k,W_v,W_o,W_1,W_3"),
    "qwen3-rslora-all-linear": ("qwen3", dict(r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True),
                                "all"),
    "gemma3-one-layer": ("gemma3", dict(r=2, lora_alpha=4, target_modules=["down_proj", "k_proj"],
                                        layers_to_transform=[1]), "W_k,W_2"),
    # the tables: PEFT saves its copy of each beside them (base_layer.weight), the base's own numbers
    "llama-embedding-head-patterns": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens",
                                                                                      "lm_head"],
                                                    rank_pattern={"embed_tokens": 2}, alpha_pattern={"lm_head": 5}),
                                      "W_q,outer"),
    "gpt2-untied-wte-head": ("gpt2-untied", dict(r=2, lora_alpha=4, target_modules=["c_attn", "wte", "lm_head"]),
                             "W_q,W_k,W_v,outer"),
    "gemma3-scaled-embedding": ("gemma3", dict(r=3, lora_alpha=6, target_modules=["embed_tokens"]), "E"),
    "qwen2-all-linear-and-head": ("qwen2", dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj", "gate_proj", "up_proj",
                                                                                  "down_proj", "lm_head"]),
                                  "all,lm_head"),
}


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_an_adapter_peft_made_imports_as_a_lora_run_with_peft_s_logits(case, bases, ids, tmp_path):
    family, options, targets = PEFT_CASES[case]
    hf_dir, base = bases(family)
    adapted = get_peft_model(reload(hf_dir), LoraConfig(**options, init_lora_weights=False, task_type="CAUSAL_LM"))
    adapted.eval().save_pretrained(tmp_path / "adapter")
    theirs = logits(adapted, ids)
    assert (theirs - logits(reload(hf_dir), ids)).abs().max() > 0.1
    # the Hugging Face folder as the base: imported into <out>.base first
    run = import_peft_into_run(tmp_path / "adapter", hf_dir, tmp_path / "run")
    tuned = load_run(run)
    assert tuned.config.train.lora_targets == targets and tuned.info["status"] == "complete"
    assert tuned.checkpoint.state["imported_from"]["format"] == "peft"
    torch.testing.assert_close(logits(tuned.model, ids), theirs, atol=ATOL, rtol=0)
    # and back: tinylm's export of the imported adapter is PEFT's model again, a fused module's A kept once
    export_peft(run, tmp_path / "back")
    back = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert back["rank_pattern"] == {} and back["r"] == tuned.config.train.lora_rank
    again = PeftModel.from_pretrained(reload(hf_dir), tmp_path / "back").eval()
    torch.testing.assert_close(logits(again, ids), theirs, atol=ATOL, rtol=0)


def test_other_ranks_are_padded_and_other_scales_folded_into_b(bases, tmp_path):
    _, options, _ = PEFT_CASES["llama-subset-patterns"]
    hf_dir, base = bases("llama")
    get_peft_model(reload(hf_dir), LoraConfig(**options, init_lora_weights=False)).save_pretrained(tmp_path / "a")
    adapter, settings = read_peft(tmp_path / "a", load_run(base).config.model)
    assert settings == LoraSettings(rank=6, alpha=12.0, dropout=0.0, targets="W_q,W_v")  # alpha / r stays 8 / 4
    assert adapter["blocks.0.attn.W_q.lora_A"].shape == (6, 32)
    assert not adapter["blocks.0.attn.W_q.lora_A"][4:].any() and not adapter["blocks.0.attn.W_q.lora_B"][:, 4:].any()
    assert set(adapter) == {f"blocks.{i}.attn.{w}.lora_{x}" for i in range(2) for w in ("W_q", "W_v") for x in "AB"}


# ----- llama.cpp ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_llama_cpp_runs_a_lora_runs_gguf_export_with_our_greedy_tokens(family, bases, tokenizer, tmp_path):
    from llama_cpp import Llama

    _, base = bases(family)
    run = lora_run(base, tmp_path / "lora", LoraSettings(rank=4, alpha=8.0, targets="all"))
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 0
    model = load_run(run).model
    llm = Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=64, logits_all=True, n_threads=1, type_k=0, type_v=0,
                verbose=False)
    start = tokenizer.encode(PROMPT)[:8]
    llm.eval(start)
    tokens = list(start)
    for _ in range(20):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    assert tokens == greedy(lambda x: logits(model, x), start, steps=20)
    assert len(set(tokens[len(start):])) > 3
    np.testing.assert_allclose(np.array(llm.scores[: len(tokens)]), logits(model, torch.tensor([tokens]))[0].numpy(),
                               atol=1e-3, rtol=0)


# ----- the command line ---------------------------------------------------------------------------------


def test_export_format_peft_and_import_with_base_through_the_command(bases, ids, tmp_path, capsys):
    hf_dir, base = bases("llama")
    run = lora_run(base, tmp_path / "lora", LoraSettings(rank=2, alpha=3.0, targets="attention"))
    out = tmp_path / "adapter"
    assert main(["export", "--run", str(run), "--format", "peft", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_dir.resolve()) and config["r"] == 2
    # the same adapter twice gives the same bytes
    assert main(["export", "--run", str(run), "--format", "peft", "--out", str(tmp_path / "again")]) == 0
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    assert main(["import", "--from", str(out), "--base", str(base), "--out", str(tmp_path / "imported")]) == 0
    assert "LoRA run" in capsys.readouterr().out
    torch.testing.assert_close(logits(load_run(tmp_path / "imported").model, ids), logits(load_run(run).model, ids),
                               atol=1e-6, rtol=0)
    refused(capsys, ["import", "--from", str(out), "--out", str(tmp_path / "x")],
            "give the model it adapts with --base")
    refused(capsys, ["import", "--from", str(hf_dir), "--base", str(base), "--out", str(tmp_path / "x")],
            "is not an adapter")
    refused(capsys, ["export", "--run", str(run), "--format", "peft", "--out", str(out)], "already exists")
    assert main(["export", "--run", str(run), "--format", "peft", "--out", str(out), "--force"]) == 0
    refused(capsys, ["export", "--run", str(base), "--format", "peft", "--out", str(tmp_path / "y")],
            "is not a LoRA run", "--format hf or --format gguf")
    refused(capsys, ["export", "--run", str(run), "--format", "peft", "--out", str(tmp_path / "y"), "--quant", "f16"],
            "--format gguf only")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# ----- what is refused ----------------------------------------------------------------------------------


def one_line(call, match: str) -> str:
    with pytest.raises(TinyLMError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("options, match", [
    (dict(target_modules=["q_proj"], use_dora=True), r"sets use_dora: DoRA"),
    (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), r"sets modules_to_save"),
    (dict(target_modules=["q_proj"], bias="lora_only"), r"trains biases \(bias = 'lora_only'\)"),
    (dict(target_modules=["q_proj"], trainable_token_indices=[3, 5]), r"sets trainable_token_indices"),
], ids=["dora", "modules-to-save", "bias", "token-rows"])
def test_what_tinylm_does_not_compute_is_refused_in_one_line(options, match, bases, tmp_path):
    hf_dir, base = bases("llama")
    get_peft_model(reload(hf_dir), LoraConfig(r=2, init_lora_weights=False, **options)).save_pretrained(tmp_path / "a")
    one_line(lambda: import_peft_into_run(tmp_path / "a", base, tmp_path / "run"), match)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("module, match", [
    ("wte", r"transformer.wte.lora_embedding_A, a correction of transformer.wte, but this base's output head is its "
            r"embedding \(tied\)"),
    ("lm_head", r"lm_head.lora_A.weight, a correction of lm_head, but this base's output head is its embedding"),
    ("wpe", r"transformer.wpe.lora_embedding_A, which is no LoRA matrix of a module of this base model"),
])
def test_a_tied_head_and_the_position_embeddings_are_refused(module, match, bases, tmp_path):
    hf_dir, base = bases("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own warnings about a tied table
        adapted = get_peft_model(reload(hf_dir), LoraConfig(r=2, target_modules=["c_attn", module],
                                                            init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "a")
    one_line(lambda: import_peft_into_run(tmp_path / "a", base, tmp_path / "run"), match)
    assert not (tmp_path / "run").exists()


def test_a_saved_table_that_is_not_the_bases_is_refused(bases, tmp_path):
    """PEFT saves its copy of the embedding beside its LoRA: other numbers there (a table trained too) are refused,
    since the adapter alone would leave them out."""
    hf_dir, base = bases("llama")
    get_peft_model(reload(hf_dir), LoraConfig(r=2, target_modules=["embed_tokens"],
                                              init_lora_weights=False)).save_pretrained(tmp_path / "a")
    weights = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(weights)
    assert import_peft_into_run(tmp_path / "a", base, tmp_path / "run").is_dir()  # the base's own copy: fine
    tensors["base_model.model.model.embed_tokens.base_layer.weight"][7] += 0.5
    save_file(tensors, weights)
    one_line(lambda: import_peft_into_run(tmp_path / "a", base, tmp_path / "again"),
             r"holds its own model.embed_tokens \(other numbers than the base's: the table was trained too\)")
    tensors["base_model.model.model.embed_tokens.base_layer.weight"] = torch.zeros(310, 32)
    save_file(tensors, weights)
    one_line(lambda: import_peft_into_run(tmp_path / "a", base, tmp_path / "again"),
             r"holds its own model.embed_tokens \(\(310, 32\) where the base's is \(302, 32\): its vocabulary")


def test_a_missing_or_wrong_base_and_folders_that_are_no_adapter_are_refused(bases, ids, tmp_path):
    hf_dir, base = bases("llama")
    adapter = tmp_path / "adapter"
    get_peft_model(reload(hf_dir), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(
        adapter)
    one_line(lambda: import_peft_into_run(adapter, tmp_path / "nowhere", tmp_path / "r"), r"--base .*nowhere: no such")
    one_line(lambda: import_peft_into_run(hf_dir, base, tmp_path / "r"),
             r"has no adapter_config.json: it holds a model")
    one_line(lambda: import_peft_into_run(tmp_path, base, tmp_path / "r"), r"it is not a PEFT adapter")
    gpt2_hf, _ = bases("gpt2")  # the adapter's matrices are not GPT-2's
    one_line(lambda: import_peft_into_run(adapter, gpt2_hf, tmp_path / "r"),
             r"which is no LoRA matrix of a module of this base model")
    (adapter / "adapter_model.safetensors").rename(tmp_path / "weights")
    one_line(lambda: read_peft(adapter, load_run(base).config.model), r"has no adapter_model.safetensors")
    (tmp_path / "weights").rename(adapter / "adapter_model.safetensors")

    # a base that moved away, then one whose weights changed: loading the LoRA run says so
    moved = tmp_path / "base"
    shutil.copytree(base, moved)
    run = import_peft_into_run(adapter, moved, tmp_path / "run")
    expected = logits(load_run(run).model, ids)
    moved.rename(tmp_path / "elsewhere")
    one_line(lambda: load_run(run), r"is a LoRA adapter of the model .* which is not there any more")
    (tmp_path / "elsewhere").rename(moved)
    torch.testing.assert_close(logits(load_run(run).model, ids), expected, atol=0, rtol=0)
    best = load_checkpoint(checkpoint_path(moved, "best"))
    state = {name: t + 0.01 for name, t in best.model_state().items()}
    save_checkpoint(best.path, model_state=state, optimizer_state=None, rng_state={}, state=best.state,
                    config=best.config, tokenizer=best.tokenizer)
    one_line(lambda: load_run(run), r"that model has changed since the adapter was trained on it")
