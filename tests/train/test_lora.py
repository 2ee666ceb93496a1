"""LoRA: a low-rank correction trained beside frozen weights, its run folder, and how it loads.

What is checked: the layer computes x W^T + (alpha / r) (x A^T) B^T (worked out with plain matrix
products); before the first step the adapted model is the base bit for bit (B starts at zero); training
moves A and B only, the base checkpoint's files stay byte for byte what they were, and the run's
checkpoints hold the adapter and optimizer state for it alone; the loaded run is the base with
W + (alpha / r) B A in place of each target; a run stopped part way and resumed ends with the adapter an
uninterrupted one has; a missing or changed base and impossible settings are one clear line. How a LoRA run
saves memory changes no number: under bfloat16 autocast the frozen matrices stored in bfloat16 and the blocks
recomputed give the step's loss and gradients bit for bit, a float32 pass after it reads the float32
matrices back (and notices a base changed under it), and a whole run trains the same adapter and evaluates
to the same losses as one without the savings.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from diskkit import refused
from trainkit import tiny_config

from tinylm.checkpoint import LORA_BASE, MODEL_FILE, OPTIMIZER_FILE, load_checkpoint
from tinylm.errors import TinyLMError
from tinylm.finetune import finetune
from tinylm.model import GPT
from tinylm.model.lora import (
    LoRALinear,
    LoraMemory,
    LoraSettings,
    adapter_size,
    adapter_state,
    add_lora,
    merge_adapter,
    prepare_training,
)
from tinylm.run import checkpoint_path, load_run
from tinylm.train import train

QUIET = {"log": lambda line: None, "progress": False}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, corpus, data_dir):
    out = tmp_path_factory.mktemp("base") / "run"
    train(tiny_config(corpus, data_dir, max_steps=6), out, **QUIET)
    return out


def lora_config(corpus, data_dir, **overrides):
    settings = {"max_steps": 6, "lr": 1e-2, "lora_rank": 4, "lora_alpha": 8.0, **overrides}
    return tiny_config(corpus, data_dir, **settings)


def files_digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_the_layer_is_the_frozen_product_plus_the_scaled_low_rank_one():
    torch.manual_seed(0)
    base = torch.nn.Linear(5, 3, bias=True)
    layer = LoRALinear(base, LoraSettings(rank=2, alpha=6.0))
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(3, 2))
    x = torch.randn(4, 5)
    W, b, A, B = base.weight, base.bias, layer.lora_A, layer.lora_B
    by_hand = x @ W.T + b + 3.0 * ((x @ A.T) @ B.T)  # alpha / r = 6 / 2
    assert torch.allclose(layer(x), by_hand, atol=1e-6)
    merged = merge_adapter({"m.weight": W.detach()}, {"m.lora_A": A.detach(), "m.lora_B": B.detach()}, 3.0)
    assert torch.allclose(x @ merged["m.weight"].T + b, by_hand, atol=1e-6)
    assert layer.weight is base.weight  # the frozen matrix is the base's own tensor, not a copy


def test_step_zero_is_the_base_exactly_and_only_the_targets_get_an_adapter(base_run):
    model = load_run(base_run).model
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    before, _ = model(idx)
    add_lora(model, LoraSettings(rank=4, alpha=8.0, targets="W_q,W_v,W_2"))
    after, _ = model(idx)
    assert torch.equal(before, after)  # B = 0: the correction adds exact zeros
    names = sorted(adapter_state(model))
    assert names == sorted(f"blocks.{i}.{m}.{ab}" for i in range(2) for m in ("attn.W_q", "attn.W_v", "mlp.W_2")
                           for ab in ("lora_A", "lora_B"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(names)
    # r (d_in + d_out) numbers per corrected matrix: W_q and W_v are 32 x 32, W_2 is 32 x d_ff
    d_ff = model.blocks[0].mlp.W_2.in_features
    assert adapter_size(model.config, LoraSettings(4, 8.0, targets="W_q,W_v,W_2"))[0] == \
        2 * (4 * 64 + 4 * 64 + 4 * (d_ff + 32))


def test_training_moves_the_adapter_only_and_the_run_keeps_just_the_adapter(base_run, corpus, data_dir, tmp_path):
    best = checkpoint_path(base_run, "best")
    base_files = files_digest(best)
    out = tmp_path / "lora"
    train(lora_config(corpus, data_dir), out, init_from=base_run, **QUIET)
    assert files_digest(best) == base_files  # the base's files are as they were, byte for byte
    ckpt = load_checkpoint(checkpoint_path(out, "latest"))
    assert ckpt.is_adapter and ckpt.base().path == best
    stored = ckpt.adapter_state()
    assert set(stored) == set(adapter_state(add_lora(GPT(ckpt.config.model), LoraSettings(4, 8.0))))
    assert all(n.endswith(("lora_A", "lora_B")) for n in stored)
    assert any(stored[n].abs().max() > 0 for n in stored if n.endswith("lora_B"))  # B has moved off zero
    optimizer = json.loads((ckpt.path / "state.json").read_text())["optimizer"]
    assert {n for g in optimizer["param_groups"] for n in g["params"]} == set(stored)  # moments for A and B only
    assert (ckpt.path / MODEL_FILE).stat().st_size < (best / MODEL_FILE).stat().st_size / 3
    assert (ckpt.path / OPTIMIZER_FILE).is_file()
    # loaded, the run is the base with W + (alpha / r) B A in place of each target, every other weight the base's
    merged, base = load_run(out).model.state_dict(), load_run(base_run).model.state_dict()
    for name, w in base.items():
        if name.replace(".weight", ".lora_A") in stored:
            a, b = stored[name.replace(".weight", ".lora_A")], stored[name.replace(".weight", ".lora_B")]
            assert torch.allclose(merged[name], w + 2.0 * b @ a, atol=1e-6)
            assert not torch.equal(merged[name], w)
        else:
            assert torch.equal(merged[name], w), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_stopped_and_resumed_run_ends_with_the_same_adapter(base_run, corpus, data_dir, tmp_path, dtype):
    config = lora_config(corpus, data_dir, lora_dropout=0.1, dtype=dtype)  # dropout draws must be restored too
    train(config, tmp_path / "whole", init_from=base_run, **QUIET)
    train(config, tmp_path / "parts", init_from=base_run, stop_after=3, **QUIET)
    assert load_checkpoint(checkpoint_path(tmp_path / "parts", "latest")).step == 3
    train(None, tmp_path / "parts", resume=True, **QUIET)
    whole = load_checkpoint(checkpoint_path(tmp_path / "whole", "latest")).adapter_state()
    parts = load_checkpoint(checkpoint_path(tmp_path / "parts", "latest")).adapter_state()
    assert whole.keys() == parts.keys() and all(torch.equal(whole[n], parts[n]) for n in whole)


def test_a_moved_run_finds_its_base_beside_it_and_a_changed_base_is_refused(base_run, corpus, data_dir, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(base_run, home / "base")
    train(lora_config(corpus, data_dir), home / "lora", init_from=home / "base", **QUIET)
    expected = load_run(home / "lora").model.state_dict()
    moved = tmp_path / "moved"
    shutil.move(home, moved)  # the run and its base move together: found by the path between them
    again = load_run(moved / "lora").model.state_dict()
    assert all(torch.equal(expected[n], again[n]) for n in expected)

    best = checkpoint_path(moved / "base", "best")
    (best / "config.toml").write_text((best / "config.toml").read_text())  # unchanged: still fine
    other = tmp_path / "other"
    train(tiny_config(corpus, data_dir, max_steps=2, seed=7), other, **QUIET)
    shutil.rmtree(best)
    shutil.copytree(checkpoint_path(other, "latest"), best)  # another model where the base was
    with pytest.raises(TinyLMError, match="has changed since the adapter was trained"):
        load_run(moved / "lora")
    shutil.rmtree(moved / "base")
    with pytest.raises(TinyLMError, match="which is not there any more"):
        load_run(moved / "lora")


def test_lora_without_a_model_to_adapt_or_on_an_lstm_is_refused(corpus, data_dir, tmp_path, capsys):
    with pytest.raises(TinyLMError, match="already trained: give it one with --init-from"):
        train(lora_config(corpus, data_dir), tmp_path / "a", **QUIET)
    with pytest.raises(TinyLMError, match="fine-tuned whole"):
        train(lora_config(corpus, data_dir, family="lstm"), tmp_path / "b", init_from=None, **QUIET)
    refused(capsys, ["train", "--lora-rank", "4", "--lora-targets", "W_z"], "unknown target 'W_z'")
    refused(capsys, ["train", "--lora-rank", "-1"], "lora_rank must be 0")
    assert not (tmp_path / "a").exists()


def test_finetune_takes_lora_on_chats_and_on_text(base_run, corpus, tmp_path, capsys):
    pairs = [("the king", "rode to war"), ("my lord", "speak soft"), ("quiet fields", "bells rang")]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs * 12))
    flags = {"max_steps": 4, "batch_size": 4, "eval_interval": 2, "sample_tokens": 0, "lora_rank": 2}
    said: list[str] = []
    result = finetune(base_run, str(chats), tmp_path / "chat", overrides=flags, data_dir=tmp_path / "d",
                      log=said.append, progress=False)
    assert result.status == "complete"
    assert any(line.startswith("lora: rank 2, alpha 4") for line in said)
    ckpt = load_checkpoint(checkpoint_path(tmp_path / "chat", "latest"))
    # the chat tokens' rows are new, so the base is the grown starting model in the data folder
    assert ckpt.state[LORA_BASE]["path"] == str((tmp_path / "d" / "init").resolve())
    assert load_run(tmp_path / "chat").tokenizer.vocab_size == load_run(base_run).tokenizer.vocab_size + 2
    # the chat markers' two rows of the embedding and the head train with the adapter; every other row is the base's
    assert ckpt.config.train.lora_new_tokens == 2
    merged, start = load_run(tmp_path / "chat").model.state_dict(), ckpt.base().model_state()
    for table in ("E.weight", "lm_head.weight"):
        assert torch.equal(merged[table][:-2], start[table][:-2])
        assert not torch.equal(merged[table][-2:], start[table][-2:])
    assert not (tmp_path / "chat" / "adapter").exists()  # PEFT's layout has no place for them here: said so
    assert any(line.startswith("no PEFT copy of the adapter") and "new tokens" in line for line in said)
    # a second fine-tuning on the same data reuses the grown base as it is: the first run's base is not rewritten
    init = tmp_path / "d" / "init" / MODEL_FILE
    written = init.stat().st_mtime_ns
    finetune(base_run, str(chats), tmp_path / "chat2", overrides=flags, data_dir=tmp_path / "d", **QUIET)
    assert init.stat().st_mtime_ns == written
    assert load_checkpoint(checkpoint_path(tmp_path / "chat", "latest")).base().path == tmp_path / "d" / "init"
    # text: continued pretraining on a corpus, through the command
    code = __import__("tinylm.cli", fromlist=["main"]).main(
        ["finetune", "--from", str(base_run), "--corpus", str(corpus), "--out", str(tmp_path / "text"),
         "--lora-rank", "2", "--max-steps", "3", "--eval-interval", "3", "--sample-tokens", "0", "--threads", "1",
         "--no-progress"])
    assert code == 0
    text = load_checkpoint(checkpoint_path(tmp_path / "text", "latest"))
    assert text.is_adapter and text.step == 3 and text.base().path == checkpoint_path(base_run, "best")
    peft_config = json.loads((tmp_path / "text" / "adapter" / "adapter_config.json").read_text())
    assert peft_config["peft_type"] == "LORA" and peft_config["r"] == 2 and peft_config["lora_alpha"] == 4
    capsys.readouterr()
    refused(capsys, ["finetune", "--from", str(base_run), "--corpus", str(corpus), "--epochs", "1"],
            "--epochs counts passes over conversations")


def adapted_pair(base_run, settings: LoraSettings) -> tuple[GPT, GPT, dict[str, torch.Tensor]]:
    """Two copies of the base adapted alike (B moved off zero, so the correction counts), and the base's weights."""
    base = load_run(base_run).model.state_dict()
    models = []
    for _ in range(2):
        torch.manual_seed(1)
        model = add_lora(load_run(base_run).model, settings)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.copy_(torch.randn_like(p) * 0.1)
        models.append(model.train())
    return *models, base


def step_of(model: GPT, idx: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step's loss (the head in slices) and the adapter's gradients, under autocast to ``dtype``."""
    torch.manual_seed(2)  # the same dropout draws
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        _, loss = model(idx[:, :-1], targets=idx[:, 1:], reduction="sum", return_logits=False)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same_step(plain: GPT, saving: GPT, idx: torch.Tensor, dtype: torch.dtype | None) -> None:
    (loss, grads), (loss_saving, grads_saving) = step_of(plain.train(), idx, dtype), step_of(saving.train(), idx, dtype)
    assert torch.equal(loss, loss_saving)
    assert grads.keys() == grads_saving.keys() and all(torch.equal(grads[n], grads_saving[n]) for n in grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_the_memory_savings_change_no_number_a_step_computes(base_run, dtype):
    plain, saving, base = adapted_pair(base_run, LoraSettings(rank=4, alpha=8.0, dropout=0.1))
    read = []
    prepare_training(saving, LoraMemory(recompute_every=1), dtype, lambda name: read.append(name) or base[name])
    layer = saving.blocks[0].attn.W_q
    assert layer.weight.dtype == (dtype or torch.float32) and layer.lora_A.dtype == torch.float32
    idx = torch.randint(0, plain.config.vocab_size, (3, 17))
    for _ in range(2):  # and again, after the first backward pass
        assert_same_step(plain, saving, idx, dtype)
    assert not read  # training never needs the full-precision matrices
    # a float32 pass (evaluation, sampling) computes with the base's float32 matrices, read back for that pass
    plain.eval(), saving.eval()
    with torch.no_grad():
        assert torch.equal(plain(idx)[0], saving(idx)[0])
    if dtype is not None:
        assert sorted(read) == sorted(n for n in base if n.startswith("blocks.") and "W_" in n)
        assert layer.weight.dtype == dtype  # and not kept: the next step trains with the bfloat16 ones
        assert_same_step(plain, saving, idx, dtype)


def test_a_base_changed_under_a_training_adapter_is_refused_when_read_back(base_run):
    _, saving, base = adapted_pair(base_run, LoraSettings(rank=4, alpha=8.0))
    changed = {name: t + 1.0 for name, t in base.items()}
    prepare_training(saving, LoraMemory(), torch.bfloat16, changed.__getitem__)
    with pytest.raises(TinyLMError, match="weights changed while its adapter was training"):
        saving(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_run_that_saves_memory_trains_the_adapter_one_without_would(base_run, corpus, data_dir, tmp_path,
                                                                      monkeypatch, dtype):
    config = lora_config(corpus, data_dir, lora_dropout=0.1, dtype=dtype, eval_interval=3, sample_tokens=4)
    train(config, tmp_path / "saving", init_from=base_run, **QUIET)
    monkeypatch.setattr(LoraMemory, "default", classmethod(lambda cls, compute_dtype: cls(False, False, 0)))
    train(config, tmp_path / "plain", init_from=base_run, **QUIET)
    saving, plain = (load_checkpoint(checkpoint_path(tmp_path / name, "latest")).adapter_state()
                     for name in ("saving", "plain"))
    evals = [[line["val_loss"] for line in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
              if line["kind"] == "eval"] for name in ("saving", "plain")]
    samples = [json.loads((tmp_path / name / "run.json").read_text())["sample"] for name in ("saving", "plain")]
    assert saving.keys() == plain.keys() and len(evals[0]) >= 2 and samples[0] == samples[1]
    if dtype == "bfloat16":  # the frozen matrices in bfloat16 and the blocks recomputed: bit for bit
        assert all(torch.equal(saving[n], plain[n]) for n in saving) and evals[0] == evals[1]
    else:  # float32: the head and loss in slices round differently from the whole head's
        assert all(torch.allclose(saving[n], plain[n], rtol=1e-3, atol=1e-6) for n in saving)
        assert evals[0] == pytest.approx(evals[1], rel=1e-5)
