"""`tinylm explain moe`: the routing of a text and the experts' loads, checked on a model whose routing is worked out
by hand, against `route()` called directly, and through the real command on a tiny trained run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tinylm.cli import main
from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError
from tinylm.explain.moe import (ExpertLoad, expert_load, format_routing, moe_figure, moe_layers, plot_moe,
                                routing_of_text)
from tinylm.model import GPT, RecurrentLM
from tinylm.model.moe import Routing, expert_counts, route
from tinylm.run import load_run
from tinylm.tokenizers import BPETokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from trainkit import tiny_config, write_corpus  # noqa: E402 (the training tests' tiny runs)

# Embedding rows of RMS 1, so the norm before each MoE leaves them as they are (up to eps). The router of
# layer 0 reads dims 0..3 as the logits of experts 0..3; layer 1's reads them reversed (expert e gets dim 3 - e).
A = [2.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]  # "a": logits (2, 1, 0, 0) in layer 0, (0, 0, 1, 2) in layer 1
B = [0.0, 0.0, 1.0, 2.0, 1.0, 1.0, 1.0, 0.0]  # "b": the other way round
OTHER = [-1.0, 2.0, 0.0, -1.0, 1.0, 1.0, 0.0, 0.0]  # every other token, the start token too: (-1, 2, 0, -1)
SIG1, SIG2 = 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-2))  # two softmax scores e^1 apart (or e^2): gate sigmoid(1)


def hand_routed_model(**settings) -> tuple[GPT, BPETokenizer]:
    """Two layers of 4 experts, top 2, whose blocks add nothing to the stream (W_o and every W_2 are zero), so each
    MoE is given the token's own embedding row and routes it by the router rows set above."""
    tok = BPETokenizer([], pattern="gpt2")
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=2, d_model=8, n_head=2, positions="rope",
                       norm="rmsnorm", mlp="swiglu", bias=False, moe_experts=4, moe_top_k=2, **settings)
    model = GPT(config)
    a, b = tok.encode("ab")
    with torch.no_grad():
        model.E.weight[:] = torch.tensor(OTHER)
        model.E.weight[a], model.E.weight[b] = torch.tensor(A), torch.tensor(B)
        eye = torch.cat([torch.eye(4), torch.zeros(4, 4)], dim=1)  # (E, d): expert e reads dim e
        for layer, block in enumerate(model.blocks):
            block.attn.W_o.weight.zero_()
            for expert in block.mlp.experts:
                expert.W_2.weight.zero_()
            block.mlp.router.weight.copy_(eye if layer == 0 else eye.flip(0))
    return model, tok


def test_each_token_goes_to_the_experts_worked_out_by_hand():
    model, tok = hand_routed_model()
    routing = routing_of_text(model, tok, "ab", start_ids=[tok.eos_id])
    assert routing.tokens == ["<|eos|>", "a", "b"] and routing.n_experts == 4
    assert routing.experts == [[[1, 2], [0, 1], [3, 2]],   # layer 0: other, a, b
                               [[2, 1], [3, 2], [0, 1]]]   # layer 1: the routers' rows reversed
    expected = [[SIG2, 1 - SIG2], [SIG1, 1 - SIG1], [SIG1, 1 - SIG1]]
    for layer in range(2):
        np.testing.assert_allclose(routing.gates[layer], expected, atol=1e-5)
    assert routing.top1 == [[1, 0, 3], [2, 3, 0]]
    lines = format_routing(routing).splitlines()
    assert lines[1].split() == ["token", "layer", "0", "layer", "1"]
    assert lines[3].split() == ["'a'", "e0", "0.73", "/", "e1", "0.27", "e3", "0.73", "/", "e2", "0.27"]


def test_the_balancing_bias_picks_the_experts_and_the_gates_order_them():
    model, tok = hand_routed_model(moe_balance="bias")
    model.blocks[0].mlp.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 is always chosen in layer 0
    routing = routing_of_text(model, tok, "ab", start_ids=[tok.eos_id])
    # "a": scores softmax(2, 1, 0, 0); the bias makes expert 3 (score e^0) the first pick, expert 0 (e^2) the
    # second: gates e^2 / (e^2 + 1) and 1 / (e^2 + 1), the larger first
    assert routing.experts[0] == [[1, 3], [0, 3], [3, 2]]
    np.testing.assert_allclose(routing.gates[0], [[1 / (1 + math.exp(-3)), 1 / (1 + math.exp(3))],
                                                  [SIG2, 1 - SIG2], [SIG1, 1 - SIG1]], atol=1e-5)
    assert routing.experts[1] == [[2, 1], [3, 2], [0, 1]]  # layer 1 has no bias


def test_the_routing_shown_is_the_one_the_forward_pass_mixes_by():
    torch.manual_seed(0)
    tok = BPETokenizer([], pattern="gpt2")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=2, d_model=16, n_head=2,
                          moe_experts=4, moe_top_k=2, init_std=0.5))
    seen = []
    hooks = [block.mlp.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out)))
             for block in model.blocks]
    routing = routing_of_text(model, tok, "To be, or not", start_ids=[tok.eos_id])
    for hook in hooks:
        hook.remove()
    assert len(seen) == 2
    for layer, (moe, x, out) in enumerate(seen):
        shown = Routing(torch.tensor(routing.experts[layer]), torch.tensor(routing.gates[layer]), None)
        torch.testing.assert_close(moe.reference_dispatch(x[0], shown), out[0], atol=1e-5, rtol=0)
        assert all(g[0] >= g[1] for g in routing.gates[layer])  # largest gate first


def test_the_loads_are_the_counts_route_gives_and_sum_to_one_per_layer():
    model, tok = hand_routed_model()
    a, b = tok.encode("ab")
    rng = np.random.default_rng(0)
    tokens = rng.choice([a, b, 10, 33, 200], size=40, p=[0.5, 0.2, 0.1, 0.1, 0.1])
    load = expert_load(model, tokens)  # 40 tokens: windows of 16, 16 and 8
    assert load.tokens == 40 and load.top_k == 2
    n_a, n_b = int((tokens == a).sum()), int((tokens == b).sum())
    n_other = 40 - n_a - n_b
    assert load.counts == [[n_a, n_a + n_other, n_b + n_other, n_b], [n_b, n_b + n_other, n_a + n_other, n_a]]
    ids = torch.from_numpy(tokens)
    for layer, block in enumerate(model.blocks):
        with torch.no_grad():
            logits = block.mlp.router(block.norm_2(model.E(ids)))  # (40, E)
        direct = expert_counts(route(logits, 2).experts, 4)
        assert load.counts[layer] == direct.tolist()
        assert sum(load.loads[layer]) == pytest.approx(1.0)
        shares = np.array(load.counts[layer]) / (40 * 2)
        np.testing.assert_allclose(load.loads[layer], shares)
        assert load.cvs[layer] == pytest.approx(shares.std() / shares.mean())
    assert expert_load(model, np.tile(tokens, 4), n_tokens=32).tokens == 32  # two evenly spread windows of 16


def test_the_cv_is_numpys_std_over_mean():
    load = ExpertLoad(counts=[[10, 10, 10, 10], [40, 0, 0, 0], [5, 15, 12, 8]], tokens=20, top_k=2)
    for counts, cv in zip(load.counts, load.cvs):
        assert cv == pytest.approx(np.std(counts) / np.mean(counts))
    assert load.cvs[0] == 0 and load.cvs[1] == pytest.approx(math.sqrt(3))  # even; one expert takes all
    assert load.even_share == 0.25


def test_the_figure_shows_the_top1_grid_a_legend_and_a_bar_chart_per_layer(tmp_path):
    model, tok = hand_routed_model()
    routing = routing_of_text(model, tok, "abba", start_ids=[tok.eos_id])
    load = expert_load(model, np.array(tok.encode("abba" * 10)))
    fig = moe_figure(routing, load)
    grid = next(ax for ax in fig.axes if ax.images)
    np.testing.assert_array_equal(grid.images[0].get_array(), routing.top1)
    assert [t.get_text() for t in grid.get_legend().get_texts()] == ["e0", "e1", "e2", "e3"]
    bars = [ax for ax in fig.axes if ax.patches and not ax.images]
    assert len(bars) == 2
    for ax, shares, cv in zip(bars, load.loads, load.cvs):
        np.testing.assert_allclose([p.get_height() for p in ax.patches], shares)
        assert ax.get_title() == f"layer {bars.index(ax)}: CV {cv:.3f}"
        assert [line.get_ydata()[0] for line in ax.lines] == [0.25]  # the even share
    path = plot_moe(routing, load, tmp_path / "moe.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_model_without_experts_is_refused_in_one_line():
    tok = BPETokenizer([], pattern="gpt2")
    dense = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, d_model=16, n_head=2))
    with pytest.raises(TinyLMError, match="^this run has no experts: train with --moe-experts N$"):
        moe_layers(dense)
    lstm = RecurrentLM(GPTConfig(family="lstm", vocab_size=tok.vocab_size, block_size=16, n_layer=1, d_model=16))
    with pytest.raises(TinyLMError, match="an LSTM model, which has no experts"):
        routing_of_text(lstm, tok, "ab")


# ----- the command, on tiny runs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    """A tiny two-layer MoE run (4 experts, top 2), trained a few steps on the training tests' corpus."""
    from tinylm.train import train

    folder = tmp_path_factory.mktemp("moe-run")
    config = tiny_config(write_corpus(folder / "corpus"), folder / "data", moe_experts=4, moe_top_k=2, max_steps=3,
                         eval_interval=3)
    train(config, folder / "run", progress=False, log=lambda line: None)
    return folder / "run"


def explain_moe(capsys, *args: str) -> tuple[int, str, str]:
    """`tinylm explain moe ARGS` through the command line's own entry point: (exit status, stdout, stderr)."""
    capsys.readouterr()
    status = main(["explain", "moe", *args, "--threads", "1"])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_command_prints_the_table_and_writes_a_png(moe_run, tmp_path, capsys):
    out = tmp_path / "moe.png"
    status, stdout, stderr = explain_moe(capsys, "--run", str(moe_run), "--text", "the king", "--out", str(out),
                                         "--tokens", "256")
    assert status == 0, stderr
    run = load_run(moe_run)
    routing = routing_of_text(run.model, run.tokenizer, "the king", start_ids=run.start_ids)
    assert format_routing(routing) in stdout  # the same routing, computed here
    assert "load over 256 tokens (512 token-slots a layer)" in stdout and "CV" in stdout
    assert stdout.strip().splitlines()[-1] == f"picture: {out}"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    from matplotlib.image import imread

    height, width = imread(out).shape[:2]
    assert width > 500 and height > 400
    status, stdout, stderr = explain_moe(capsys, "--run", str(moe_run), "--text", "the", "--tokens", "64", "--json")
    assert status == 0, stderr
    report = json.loads(stdout)
    assert report["picture"] == str(moe_run / "moe.png") and (moe_run / "moe.png").is_file()  # the default place
    assert report["load"]["split"] == "val"
    assert [len(layer["experts"]) for layer in report["routing"]["layers"]] == [4, 4]  # the start token and "the"
    for layer in report["load"]["layers"]:
        assert sum(layer["counts"]) == 64 * 2 and sum(layer["loads"]) == pytest.approx(1.0)


def test_a_dense_run_is_refused_in_one_line(small_run_dir):
    proc = subprocess.run([sys.executable, "-m", "tinylm", "explain", "moe", "--run", str(small_run_dir), "--text",
                           "ab", "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr  # the dense run of conftest.py
    assert "this run has no experts: train with --moe-experts N" in proc.stderr


def test_an_lstm_run_is_refused_in_one_line(lstm_run_dir, capsys):
    status, stdout, stderr = explain_moe(capsys, "--run", str(lstm_run_dir), "--text", "ab")
    assert status != 0 and stdout == "" and stderr.count("\n") == 1, stderr
    assert "an LSTM model, which has no experts" in stderr
