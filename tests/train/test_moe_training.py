"""Training a Mixture-of-Experts model: the losses added, the bias moved, exact resume, loads logged, collapse named."""

from __future__ import annotations

import pytest
import torch
from trainkit import cli_flags, run_cli, tiny_config

from tinylm.config import GPTConfig
from tinylm.model import GPT
from tinylm.run import checkpoint_path, load_checkpoint, read_metrics
from tinylm.train import train
from tinylm.train.distributed import Distributed
from tinylm.train.moe import SUSTAINED, MoETraining
from tinylm.train.optim import make_optimizer, parameter_roles

QUIET = dict(progress=False, log=lambda line: None)
MOE = dict(moe_experts=4, moe_top_k=2)


def train_rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["kind"] == "train"]


def test_a_bias_balanced_run_stopped_and_resumed_ends_with_the_same_weights_and_biases(tmp_path, corpus, data_dir):
    cfg = tiny_config(corpus, data_dir, **MOE, moe_balance="bias", moe_bias_rate=0.01, checkpoint_interval=3,
                      grad_accum=2)
    straight = train(cfg, tmp_path / "straight", **QUIET)
    train(cfg, tmp_path / "halves", stop_after=4, **QUIET)
    second = train(None, tmp_path / "halves", resume=True, **QUIET)
    a = load_checkpoint(straight.checkpoint).model_state()
    b = load_checkpoint(second.checkpoint).model_state()
    assert a.keys() == b.keys() and "blocks.1.mlp.bias" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    bias = a["blocks.0.mlp.bias"]
    # eight steps of +-0.01 (or 0 at an exact tie): a multiple of 0.01 within 0.08, and not all zero
    assert bias.abs().max() <= 0.08 + 1e-6 and bias.abs().sum() > 0
    torch.testing.assert_close(bias * 100, (bias * 100).round(), atol=1e-4, rtol=0)
    rows_a, rows_b = train_rows(tmp_path / "straight"), train_rows(tmp_path / "halves")
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    assert [r["moe_cv_l1"] for r in rows_a] == [r["moe_cv_l1"] for r in rows_b]


def test_the_balancing_losses_join_the_training_loss_and_are_logged_apart(tmp_path, corpus, data_dir):
    on = train(tiny_config(corpus, data_dir, **MOE, max_steps=3), tmp_path / "on", **QUIET)
    off = train(tiny_config(corpus, data_dir, **MOE, max_steps=3, moe_aux_weight=0.0, moe_z_weight=0.0),
                tmp_path / "off", **QUIET)
    rows_on, rows_off = train_rows(on.run_dir), train_rows(off.run_dir)
    assert rows_on[0]["loss"] == rows_off[0]["loss"]  # "loss" is the next-token loss alone: equal before any update
    assert rows_on[2]["loss"] != rows_off[2]["loss"]  # the added terms changed the gradient
    row = rows_on[0]
    assert 1.0 <= row["moe_aux"] <= 4.0 and row["moe_z"] > 0  # E sum f P is 1 when even, E at most
    for layer in (0, 1):
        loads = [row[f"moe_load_l{layer}_e{e}"] for e in range(4)]
        assert sum(loads) == pytest.approx(1.0)
        mean = sum(loads) / 4
        cv = (sum((x - mean) ** 2 for x in loads) / 4) ** 0.5 / mean
        assert row[f"moe_cv_l{layer}"] == pytest.approx(cv)
    assert row["moe_cv_max"] == max(row["moe_cv_l0"], row["moe_cv_l1"])


def test_the_router_trains_with_adamw_and_the_experts_like_the_dense_mlp_under_muon():
    model = GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=1, d_model=16, n_head=2, **MOE))
    roles = parameter_roles(model)
    assert roles["blocks.0.mlp.router.weight"] == "router" and roles["blocks.0.mlp.experts.3.W_2.weight"] == "matrix"
    cfg = tiny_config("unused", "unused", optimizer="muon").train
    optimizer = make_optimizer(model, cfg)
    kinds = {type(opt).__name__: {id(p) for g in opt.param_groups for p in g["params"]} for opt in optimizer.optimizers}
    assert id(model.blocks[0].mlp.router.weight) in kinds["AdamW"]
    assert id(model.blocks[0].mlp.experts[0].W_1.weight) in kinds["Muon"]
    assert "blocks.0.mlp.bias" not in dict(model.named_parameters())  # a buffer: no optimizer touches it


def collapsed_window(training: MoETraining, counts: list[int]) -> list[str]:
    """One log window in which every MoE layer got ``counts`` token-slots per expert; the warnings it raised."""
    for _, layer in training.layers:
        layer.step_counts = torch.tensor(counts)
    training.after_step()
    training.metrics()
    return training.warnings()


def test_a_collapse_is_named_once_after_it_lasts_and_again_after_a_recovery():
    model = GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=2, d_model=16, n_head=2, **MOE, moe_balance="none"))
    training = MoETraining(model, model.config, Distributed())
    assert collapsed_window(training, [25, 25, 25, 25]) == []
    assert collapsed_window(training, [100, 0, 0, 0]) == []  # once could be chance
    for _ in range(SUSTAINED - 2):
        assert collapsed_window(training, [100, 0, 0, 0]) == []
    lines = collapsed_window(training, [100, 0, 0, 0])
    assert len(lines) == 2 and "MoE layer 0" in lines[0] and "MoE layer 1" in lines[1]
    assert "load CV 1.73" in lines[0] and "experts 1, 2, 3 got under 2%" in lines[0]
    assert collapsed_window(training, [100, 0, 0, 0]) == []  # said once
    assert collapsed_window(training, [30, 24, 23, 23]) == []  # recovered
    assert collapsed_window(training, [50, 50, 0, 0]) == []
    again = collapsed_window(training, [50, 50, 0, 0])  # a CV of 1, not above the limit, but two experts starve
    assert len(again) == 2 and "load CV 1.00" in again[0] and "experts 2, 3 got under" in again[0]


def test_an_unbalanced_run_whose_router_starts_on_two_experts_warns_of_collapse(tmp_path, corpus, data_dir,
                                                                             monkeypatch):
    init = GPT._init_weights

    def router_at_zero(self):  # every score tied, and kept so: every token takes the same two experts
        init(self)
        for block in self.blocks:
            torch.nn.init.zeros_(block.mlp.router.weight)
            block.mlp.router.weight.requires_grad_(False)

    monkeypatch.setattr(GPT, "_init_weights", router_at_zero)
    lines: list[str] = []
    cfg = tiny_config(corpus, data_dir, **MOE, moe_balance="none", max_steps=4)
    train(cfg, tmp_path / "run", progress=False, log=lines.append)
    warnings = [line for line in lines if "collapsed" in line]
    assert len(warnings) == 2 and "MoE layer 0" in warnings[0] and "MoE layer 1" in warnings[1], lines
    assert train_rows(tmp_path / "run")[-1]["moe_cv_max"] == pytest.approx(1.0)  # two of four experts: CV 1


def test_an_impossible_moe_setting_stops_tinylm_train_in_one_line(tmp_path, corpus, data_dir):
    done = run_cli("train", *cli_flags(corpus, data_dir, moe_experts=4, moe_top_k=5), "--out", str(tmp_path / "r"))
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "moe_top_k (5) must be between 1 and moe_experts (4)" in done.stderr


@pytest.mark.slow
def test_ddp_balances_by_the_loads_of_every_process(tmp_path, corpus, data_dir):
    from test_distributed import assert_same_training, torchrun

    settings = dict(max_steps=6, batch_size=4, eval_interval=3, dropout=0.0, **MOE, moe_balance="bias",
                    moe_bias_rate=0.01)
    one = train(tiny_config(corpus, data_dir, **settings), tmp_path / "one", **QUIET)
    torchrun(*cli_flags(corpus, data_dir, **settings), "--out", str(tmp_path / "two"))
    assert_same_training(one.run_dir, tmp_path / "two")
    a = load_checkpoint(checkpoint_path(one.run_dir)).model_state()
    b = load_checkpoint(checkpoint_path(tmp_path / "two")).model_state()
    assert torch.equal(a["blocks.0.mlp.bias"], b["blocks.0.mlp.bias"])  # the same counts, summed over processes
