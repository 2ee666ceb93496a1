"""`tinylm explain attention` and `tinylm explain forward`: the worked examples' numbers, the heatmaps'
pixels, the traced forward pass against the model's own logits and loss, and bad input through the real command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinylm.errors import TinyLMError
from tinylm.explain.attention import attention_figure, attention_of_text, plot_attention, worked_example
from tinylm.explain.forward import trace_forward, two_token_loss
from tinylm.generate.inspect import attention_maps
from tinylm.model.attention import sdpa_attention
from tinylm.run import load_run


@pytest.fixture(scope="module")
def run_dir(small_run_dir) -> Path:
    return small_run_dir  # the shared small run (tests/explain/conftest.py)


@pytest.fixture(scope="module")
def run(run_dir):
    return load_run(run_dir)


def test_the_worked_attention_example_gives_its_weights_and_output():
    ex = worked_example()
    torch.testing.assert_close(ex.weights, torch.tensor([[1.0, 0, 0], [0.269, 0.731, 0], [0.665, 0.090, 0.245]]),
                               atol=5e-4, rtol=0)
    torch.testing.assert_close(ex.output, torch.tensor([[1.0, 0], [0.269, 0.731], [0.910, 0.335]]), atol=5e-4, rtol=0)
    assert ex.scores[2].tolist() == [2.0, 0.0, 1.0]  # q_3 = (1, 0) against k_1, k_2, k_3
    # without the mask, row 2 would be softmax(0, 1, 1) = (0.155, 0.422, 0.422): the future leaks in
    torch.testing.assert_close(torch.softmax(ex.scores[1], -1), torch.tensor([0.155, 0.422, 0.422]), atol=5e-4, rtol=0)
    # the fused kernel agrees (c = 1: q scaled by sqrt(d_h) to cancel its division)
    y = sdpa_attention((ex.q * 2**0.5)[None, None], ex.k[None, None], ex.v[None, None])
    torch.testing.assert_close(y[0, 0], ex.output)


def test_the_two_token_loss_is_1_211():
    ex = two_token_loss()
    assert [round(x, 3) for x in ex.losses.tolist()] == [0.349, 0.862]
    assert round(ex.total, 3) == 1.211 and round(ex.mean, 3) == 0.606
    assert [round(x, 3) for x in ex.probabilities[0].tolist()] == [0.705, 0.259, 0.035]


def test_the_traced_forward_pass_is_the_models(run):
    ids = run.start_ids + run.tokenizer.encode("To be, or")
    trace = trace_forward(run.model, ids, position=4)
    logits, _ = run.model(torch.tensor([ids]))
    torch.testing.assert_close(trace.logits, logits[0], rtol=0, atol=0)
    _, loss = run.model(torch.tensor([ids[:-1]]), targets=torch.tensor([ids[1:]]))
    assert trace.loss == pytest.approx(float(loss.detach()), abs=1e-6)
    maps = attention_maps(run.model, ids)
    for layer in range(2):  # the recomputed softmax row is the reference path's
        step = next(s for s in trace.steps if s.name == f"softmax[{layer}]")
        torch.testing.assert_close(torch.tensor(step.values), maps[layer][0, 4].float(), atol=1e-5, rtol=0)
    step = next(s for s in trace.steps if s.name == "M[0]")
    assert step.values[:5] == [0.0] * 5 and all(v == float("-inf") for v in step.values[5:])
    assert [s.name for s in trace.steps][:3] == ["x", "E[x]", "h[0]"]
    assert trace.steps[1].values == run.model.E.weight[ids[4], :4].tolist()
    # the logits shown are the most likely tokens', largest first, with their ids: not those of ids 0..3
    step = next(s for s in trace.steps if s.name == "logits u")
    best = torch.topk(logits[0, 4], 4)
    assert trace.top_ids == best.indices.tolist() and step.values == best.values.tolist()
    assert f"ids {', '.join(map(str, trace.top_ids))}" in step.formula and trace.top_ids != [0, 1, 2, 3]


def test_the_heatmap_grid_has_a_panel_per_layer_and_head_and_an_empty_future(run, tmp_path):
    maps = attention_of_text(run.model, run.tokenizer, "To be", start_ids=run.start_ids)
    fig = attention_figure(maps)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 2 * 4
    one = attention_of_text(run.model, run.tokenizer, "To be", start_ids=run.start_ids, layer=1, head=2)
    torch.testing.assert_close(one.layers[0][0], maps.layers[1][2])
    fig = attention_figure(one)
    fig.canvas.draw()
    ax = next(a for a in fig.axes if a.images)
    path = plot_attention(one, tmp_path / "one.png")
    from matplotlib.image import imread

    pixels = imread(path)  # (H, W, 4), the same layout as the figure drawn above
    H, W = pixels.shape[:2]
    assert (W, H) == tuple(int(x) for x in fig.canvas.get_width_height())
    T = len(one.tokens)

    def cell(i: int, j: int):
        x, y = ax.transData.transform((j, i))  # column j, row i of the image
        return pixels[int(H - y), int(x), :3]

    for i in range(T):
        for j in range(T):
            white = bool((cell(i, j) > 0.99).all())
            assert white == (j > i), (i, j)  # the future is not drawn; every visible weight is colored


def test_maps_report_nulls_the_future(run):
    report = attention_of_text(run.model, run.tokenizer, "ab", start_ids=run.start_ids, layer=0, head=0).report()
    rows = report["panels"][0]["weights"]
    assert rows[0][1:] == [None, None] and sum(rows[2]) == pytest.approx(1, abs=1e-5)


def test_bad_input_is_an_error_in_the_library(run):
    with pytest.warns(UserWarning, match="longer than the model's context of 16: keeping its last 16 tokens"):
        assert len(attention_of_text(run.model, run.tokenizer, "x" * 40, start_ids=run.start_ids).tokens) == 16
    with pytest.raises(TinyLMError, match="--layer 2 is out of range"):
        attention_of_text(run.model, run.tokenizer, "ab", layer=2)
    with pytest.raises(TinyLMError, match="--position 9"):
        trace_forward(run.model, [1, 2, 3], position=9)


def tinylm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinylm", "explain", *args], capture_output=True, text=True,
                          timeout=120)


def test_the_commands_print_the_examples_and_a_run():
    out = tinylm("attention", "--example", "lecture")
    assert out.returncode == 0, out.stderr
    assert "0.665    0.090    0.245" in out.stdout and "0.910    0.335" in out.stdout
    out = tinylm("forward", "--example", "lecture", "--json")
    assert out.returncode == 0, out.stderr
    assert round(json.loads(out.stdout)["total"], 3) == 1.211


@pytest.mark.parametrize("args, message", [
    (["attention", "--run", "{missing}", "--text", "ab"], "does not exist"),
    (["attention", "--run", "{run}", "--text", "ab", "--layer", "5"], "--layer 5 is out of range"),
    (["attention", "--run", "{run}", "--text", "ab", "--head", "4"], "--head 4 is out of range"),
    (["forward", "--run", "{run}", "--text", "ab", "--position", "7"], "--position 7 is out of range"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(run_dir, tmp_path, args, message):
    out = tinylm(*[a.format(run=run_dir, missing=tmp_path / "nope") for a in args], "--threads", "1")
    assert out.returncode != 0
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


@pytest.mark.slow
def test_the_commands_draw_and_trace_a_run(run_dir, tmp_path):
    out = tinylm("attention", "--run", str(run_dir), "--text", "To be", "--out", str(tmp_path / "a.png"), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert len(report["panels"]) == 8 and (tmp_path / "a.png").stat().st_size > 10_000
    out = tinylm("forward", "--run", str(run_dir), "--text", "To be", "--position", "2")
    assert out.returncode == 0, out.stderr
    assert "q = h W^Q" in out.stdout and "loss" in out.stdout


@pytest.mark.slow
def test_a_run_without_attention_is_one_line(lstm_run_dir):
    for command in ("attention", "forward"):
        out = tinylm(command, "--run", str(lstm_run_dir), "--text", "ab", "--threads", "1")
        assert out.returncode != 0 and out.stderr.count("\n") == 1, out.stderr
        assert "LSTM" in out.stderr or "lstm" in out.stderr, out.stderr
