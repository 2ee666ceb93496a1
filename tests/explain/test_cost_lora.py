"""LoRA's cost against full fine-tuning: the adapter's size worked out by hand and against built models, the
`tinylm explain cost --lora-rank` table, `check_fits` taking a LoRA run that fits, and the memory estimate
against what a small training step holds (what autograd saves, and the peak resident memory it reaches)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tinylm.cli import main
from tinylm.config import GPTConfig, list_presets, resolve_config
from tinylm.errors import TinyLMError
from tinylm.explain.cost import lora_cost_report
from tinylm.model import build_model
from tinylm.model import memory
from tinylm.model.lora import LoraSettings, adapter_size, add_lora, count_adapter
from tinylm.model.memory import check_fits, count_params, lora_params, memory_parts

TINY = GPTConfig(vocab_size=97, block_size=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48, mlp="swiglu")


def test_the_adapter_is_r_times_d_in_plus_d_out_per_matrix_worked_by_hand():
    # d = 32, 4 heads of 8, 2 kv heads: W_q 32 -> 32, W_k and W_v 32 -> 16, W_o 32 -> 32;
    # the swiglu MLP of 48: W_1 and W_3 32 -> 48, W_2 48 -> 32
    r = 4
    by_hand = {"W_q": r * (32 + 32), "W_k": r * (32 + 16), "W_v": r * (32 + 16), "W_o": r * (32 + 32),
               "W_1": r * (32 + 48), "W_3": r * (32 + 48), "W_2": r * (48 + 32)}
    assert by_hand == {"W_q": 256, "W_k": 192, "W_v": 192, "W_o": 256, "W_1": 320, "W_3": 320, "W_2": 320}
    for targets, names in (("all", by_hand), ("attention", ("W_q", "W_k", "W_v", "W_o")), ("W_q,W_v", ("W_q", "W_v")),
                           ("mlp", ("W_1", "W_2", "W_3"))):
        expected = 2 * sum(by_hand[name] for name in names)  # two layers
        assert lora_params(TINY, r, targets) == expected
        model = build_model(TINY)
        add_lora(model, LoraSettings(r, 8.0, 0.0, targets))
        assert count_adapter(model)[0] == expected  # what training would train
        report = lora_cost_report(TINY, LoraSettings(r, 8.0, 0.0, targets), batch_size=2, seq_len=8)
        assert report["lora"]["trainable_params"] == expected
        assert report["full"]["trainable_params"] == sum(p.numel() for p in build_model(TINY).parameters())
        assert report["lora"]["gradients"] == 4 * expected and report["lora"]["optimizer_state"] == 8 * expected


@pytest.mark.parametrize("preset", [p for p in list_presets() if resolve_config(preset=p).model.family == "gpt"])
def test_the_formula_is_the_built_adapter_s_for_every_preset(preset):
    config = resolve_config(preset=preset).model
    for targets in ("all", "attention", "mlp", "W_q,W_v"):
        assert lora_params(config, 8, targets) == adapter_size(config, LoraSettings(8, 16.0, 0.0, targets))[0]


def test_gpt2_small_at_rank_8_trains_about_one_percent():
    config = resolve_config(preset="gpt2-124m").model
    report = lora_cost_report(config, LoraSettings(8, 16.0), batch_size=4, seq_len=256)
    assert report["lora"]["trainable_params"] == 12 * (4 * 8 * (768 + 768) + 2 * 8 * (768 + 3072)) == 1_327_104
    assert report["ratio"]["trainable_params"] < 0.015
    # the optimizer state and gradients go, the activations stay
    assert report["ratio"]["optimizer_state"] < 0.015 and 1.0 <= report["ratio"]["activations"] < 1.01
    assert report["ratio"]["peak"] < 0.75


def explain_cost(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["explain", "cost", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_prints_the_table_beside_the_usual_report(capsys):
    tiny = ["--n-layer", "2", "--d-model", "32", "--n-head", "4", "--n-kv-head", "2", "--d-ff", "48", "--mlp",
            "swiglu", "--vocab-size", "97", "--block-size", "16", "--batch", "2"]
    code, out, err = explain_cost(capsys, *tiny, "--lora-rank", "4", "--lora-targets", "W_q,W_v", "--lora-alpha", "4")
    assert code == 0, err
    assert "FLOPs per token" in out  # what it printed before, still there
    table = out[out.index("LoRA against full fine-tuning"):]
    assert "rank 4, alpha 4 (scale 1) on W_q, W_v" in table
    rows = {line[2:28].strip(): line[28:].split() for line in table.splitlines()[2:8]}
    assert list(rows) == ["trainable parameters", "weights", "gradients", "Muon state", "activations", "step's peak"]
    full = count_params(resolve_config(preset="tiny", overrides=tiny[:-2]).model)  # the tiny preset's other settings
    assert rows["trainable parameters"] == [f"{full:,}", f"{2 * (256 + 192):,}", f"{896 / full:.2%}"]
    assert "frozen W needs no gradient of its own" in table
    code, out, _ = explain_cost(capsys, *tiny, "--lora-rank", "4", "--json")
    lora = json.loads(out)["lora"]
    assert code == 0 and lora["lora"]["trainable_params"] == lora_params(TINY, 4, "all")
    code, out, _ = explain_cost(capsys, *tiny)
    assert code == 0 and "LoRA" not in out  # no LoRA asked for, no table


def test_a_run_is_explained_with_lora_flags_and_other_settings_are_refused(capsys, small_run_dir):
    code, out, err = explain_cost(capsys, "--run", str(small_run_dir), "--lora-rank", "2")
    assert code == 0, err
    assert "rank 2, alpha 4 (scale 2) on W_q, W_k, W_v, W_o, W_1, W_2, W_3" in out
    code, _, err = explain_cost(capsys, "--run", str(small_run_dir), "--lora-rank", "2", "--n-layer", "3")
    assert code == 2 and "leave out --preset, --config and settings" in err
    code, _, err = explain_cost(capsys, "--lora-rank", "2", "--lora-targets", "W_x")
    assert code == 2 and "unknown target 'W_x'" in err


def test_check_fits_takes_a_lora_run_that_fits_where_full_training_would_not(monkeypatch):
    config = resolve_config(preset="gpt2-124m")
    full, lora = config.train, dataclasses.replace(config.train, lora_rank=8, lora_targets="all")
    full_bytes = sum(memory_parts(config.model, full).values())
    lora_bytes = sum(memory_parts(config.model, lora).values())
    weights = memory_parts(config.model)["weights"]
    adapter = lora_params(config.model, 8, "all") * 4
    # full: W weights, W gradients, 2 W of AdamW moments; LoRA: W + a weights, a gradients, 2 a moments
    assert lora_bytes - full_bytes == 4 * adapter - 3 * weights
    monkeypatch.setattr(memory, "machine_memory", lambda: lora_bytes)
    check_fits(config.model, lora)
    with pytest.raises(TinyLMError, match="training the model with adamw would need"):
        check_fits(config.model, full)


def saved_bytes(model: torch.nn.Module, idx: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of a float32 step (each storage once)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, _ = model(idx[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    return sum(kept.values())


def test_lora_keeps_about_the_activations_full_fine_tuning_keeps_as_the_estimate_says():
    config = dataclasses.replace(TINY, mlp="gelu", d_ff=None, n_kv_head=None, vocab_size=256, block_size=64)
    idx = torch.randint(0, config.vocab_size, (4, 65), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    full = saved_bytes(build_model(config).train(), idx)
    lora = saved_bytes(add_lora(build_model(config).train(), LoraSettings(4, 8.0)), idx)
    assert 0.9 < lora / full < 1.1  # the frozen weights' inputs are kept all the same
    report = lora_cost_report(config, LoraSettings(4, 8.0), batch_size=4, seq_len=64)
    est = {name: report[name]["activation_parts"] for name in ("full", "lora")}
    # what autograd keeps: the estimate's parts with the log-softmax the loss keeps, one of the logits' copies
    for name, measured in (("full", full), ("lora", lora)):
        kept = est[name]["layers"] + est[name]["attention_scores"] + est[name].get("adapter", 0)
        kept += est[name]["logits"] // 4
        assert 0.75 < measured / kept < 1.25, (name, measured, kept)


MEASURE = textwrap.dedent('''
    import dataclasses, json, sys
    from pathlib import Path
    import torch, torch.nn.functional as F
    from tinylm.config import GPTConfig, TrainConfig
    from tinylm.model import build_model
    from tinylm.model.lora import LoraSettings, add_lora
    from tinylm.train.optim import make_optimizer

    def kib(field):
        lines = Path("/proc/self/status").read_text().splitlines()
        return next(int(line.split()[1]) for line in lines if line.startswith(field + ":"))

    def steps(config, rank, batch, context, n):
        idx = torch.randint(0, config.vocab_size, (batch, context + 1), generator=torch.Generator().manual_seed(0))
        model = build_model(config).train()
        if rank:
            add_lora(model, LoraSettings(rank, 2.0 * rank))
        optimizer = make_optimizer(model, TrainConfig(optimizer="adamw"), fused=True)
        for _ in range(n):  # the float32 training step: the whole head, then the loss
            logits, _ = model(idx[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten(), reduction="sum")
            (loss / idx[:, 1:].numel()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del logits, loss

    torch.set_num_threads(1)
    config, rank = GPTConfig(**json.loads(sys.argv[1])), int(sys.argv[2])
    # the imports and the kernels' first calls, on a throwaway model, before the peak is reset
    steps(dataclasses.replace(config, n_layer=1, d_model=32, n_head=2, vocab_size=64), rank, 2, 8, 2)
    Path("/proc/self/clear_refs").write_text("5")
    before = kib("VmRSS")
    steps(config, rank, 8, 128, 3)
    print((kib("VmHWM") - before) * 1024)
''')


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc to measure the peak")
def test_the_estimated_peak_is_within_a_factor_of_one_and_a_half_of_a_measured_small_run():
    config = GPTConfig(vocab_size=4096, block_size=128, n_layer=4, d_model=128, n_head=4)
    report = lora_cost_report(config, LoraSettings(8, 16.0), batch_size=8, seq_len=128)
    shape = json.dumps({f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                        if f.name in ("vocab_size", "block_size", "n_layer", "d_model", "n_head")})
    for name, rank in (("full", 0), ("lora", 8)):
        done = subprocess.run([sys.executable, "-c", MEASURE, shape, str(rank)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        measured = int(done.stdout.strip().splitlines()[-1])  # the model, its optimizer and the steps
        assert 1 / 1.5 < measured / report[name]["peak"] < 1.5, (name, measured, report[name]["peak"])
