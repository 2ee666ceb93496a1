"""`tinylm explain sampling`: the worked temperature example exactly, the filters' stages, the picture, bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from matplotlib.image import imread

from tinylm.errors import TinyLMError
from tinylm.explain.sampling import explain_logits, explain_run, format_sampling, plot_sampling
from tinylm.generate.sampling import SamplingParams, sampling_distribution
from tinylm.run import load_run


def explain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinylm", "explain", *args], capture_output=True, text=True)


def test_softmax_of_2_1_minus_1_at_three_temperatures():
    table = explain_logits([2, 1, -1], temperatures=[1, 2, 0.01])
    by_t = {t: stages["temperature"] for t, stages in zip(table.temperatures, table.stages)}
    assert [round(p, 3) for p in by_t[1]] == [0.705, 0.259, 0.035]
    assert [round(p, 3) for p in by_t[2]] == [0.547, 0.331, 0.122]
    # by hand, from the definition: e^u / sum e^u
    z = math.exp(2) + math.exp(1) + math.exp(-1)
    assert by_t[1] == pytest.approx([math.exp(2) / z, math.exp(1) / z, math.exp(-1) / z], rel=1e-12)
    # tau = 0.01: logits (200, 100, -100); the second token gets e^100 / (e^200 + e^100 + e^-100), about e^-100
    assert by_t[0.01][0] == 1.0
    assert by_t[0.01][1] == pytest.approx(1 / (math.exp(100) + 1 + math.exp(-200)), rel=1e-12)
    assert by_t[0.01][1] == pytest.approx(3.72e-44, rel=1e-3)


def test_each_stage_is_what_the_sampler_draws_from_with_those_filters():
    logits = [2.0, 1.0, -1.0, 0.5]
    table = explain_logits(logits, temperatures=[1, 0.5], top_k=3, top_p=0.8)
    for t, stages in zip(table.temperatures, table.stages):
        assert list(stages) == ["temperature", "top_k", "top_p"]
        params = SamplingParams(temperature=t, top_k=3, top_p=0.8)
        expected = sampling_distribution(torch.tensor([logits], dtype=torch.float64), params)[0].tolist()
        assert stages["top_p"] == expected
        for probs in stages.values():
            assert sum(probs) == pytest.approx(1.0)
    # at tau = 1, top-k 3 drops the -1 logit, and the three left are renormalised
    k3 = table.stages[0]["top_k"]
    assert k3[2] == 0.0 and k3[0] == pytest.approx(math.exp(2) / (math.exp(2) + math.exp(1) + math.exp(0.5)))


def test_the_picture_has_a_panel_per_temperature(tmp_path):
    for n in (1, 3):
        table = explain_logits([2, 1, -1], temperatures=[1, 2, 0.01][:n], top_k=2)
        image = imread(plot_sampling(table, tmp_path / f"s{n}.png"))
        assert image.shape[1] == round((3.2 * n + 0.6) * 110)  # the figure is as wide as its panels
        assert image[..., :3].std() > 0.05  # something is drawn, not a blank canvas


def test_a_run_s_next_token(small_run_dir):
    run = load_run(small_run_dir)
    table = explain_run(run, "To be", temperatures=[1], top_k=5, top=7)
    assert len(table.labels) == 7 and len(table.stages[0]["top_k"]) == 7
    assert sum(table.stages[0]["top_k"][:5]) == pytest.approx(1.0, abs=1e-9)  # top-k 5: all mass on the first 5
    assert "T=1 top-k 5" in format_sampling(table)
    with pytest.warns(UserWarning, match="longer than the model's context of 16: keeping its last 16 tokens"):
        long = explain_run(run, "x" * 40, temperatures=[1])  # the text's end, as `tinylm next-token` reads it
        longer = explain_run(run, "yy" + "x" * 40, temperatures=[1])  # another start, the same last 16 tokens
    assert long.labels == longer.labels and long.stages == longer.stages


def test_the_command(tmp_path):
    out = explain("sampling", "--logits", "2,1,-1", "--temperatures", "1,2,0.01", "--json", "--out",
                  str(tmp_path / "s.png"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [round(p, 3) for p in report["temperatures"][0]["stages"]["temperature"]] == [0.705, 0.259, 0.035]
    assert (tmp_path / "s.png").stat().st_size > 1000
    text = explain("sampling", "--logits", "2,1,-1", "--temperatures", "1,2,0.01")
    assert "3.72e-44" in text.stdout and "0.7054" in text.stdout


@pytest.mark.parametrize("args, message", [
    (["--run", "no/such/run", "--text", "hi"], "run folder no/such/run does not exist"),
    (["--logits", "2,x"], "--logits expects numbers"),
    (["--logits", "2,1", "--temperatures", "-1"], "--temperatures expects numbers >= 0"),
])
def test_bad_input_is_one_line(args, message):
    out = explain("sampling", *args)
    assert out.returncode != 0 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_text_longer_than_the_context_keeps_its_end_with_one_warning_line(small_run_dir):
    out = explain("sampling", "--run", str(small_run_dir), "--text", "y" * 40, "--threads", "1")
    assert out.returncode == 0, out.stderr
    [warning] = [line for line in out.stderr.splitlines() if line.startswith("tinylm: warning:")]
    assert "longer than the model's context" in warning and "keeping its last" in warning


def test_the_command_on_a_run(small_run_dir, tmp_path):
    out = explain("sampling", "--run", str(small_run_dir), "--text", "To be", "--temperatures", "0.5,1",
                  "--top-k", "3", "--top-p", "0.9", "--top", "5", "--json", "--out", str(tmp_path / "r.png"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert len(report["tokens"]) == 5 and [t["temperature"] for t in report["temperatures"]] == [0.5, 1]
    for t in report["temperatures"]:
        assert list(t["stages"]) == ["temperature", "top_k", "top_p"]
        assert t["stages"]["top_k"][3:] == [0.0, 0.0]  # top-k 3 leaves nothing to the 4th and 5th tokens
    assert imread(tmp_path / "r.png").shape[1] == round((3.2 * 2 + 0.6) * 110)
