"""schedule.png draws every learning rate a run uses, each once: groups on one schedule share a line and a
label, so no line hides another."""

from __future__ import annotations

import dataclasses

import tinylm.explain.plots as plots
from tinylm.config import resolve_config
from tinylm.model import build_model
from tinylm.train.optim import make_optimizer, optimizers_of
from tinylm.train.progress import plot_schedule_of


def test_each_rate_is_one_visible_line_naming_every_group_on_it(tmp_path, monkeypatch):
    drawn = []
    real = plots.save_figure

    def keep(fig, ax, path, title=None):
        drawn.append(ax)
        return real(fig, ax, path, title)

    monkeypatch.setattr(plots, "save_figure", keep)
    config = resolve_config(preset="tiny")  # Muon's matrices, AdamW's embeddings and gains at lr, the head apart
    model = build_model(dataclasses.replace(config.model, vocab_size=64, n_layer=1, d_model=32, n_head=2))
    optimizers = optimizers_of(make_optimizer(model, config.train))
    groups = [(type(opt).__name__, g["roles"], g["peak_lr"]) for opt in optimizers for g in opt.param_groups]
    assert len({peak for _, _, peak in groups}) < len(groups)  # two groups (weight decay or not) share a rate
    path = plot_schedule_of(optimizers, config.train, 60, tmp_path / "schedule.png", "run")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = drawn[0].get_lines()
    curves = [tuple(line.get_ydata()) for line in lines]
    assert len(set(curves)) == len(curves) == len({peak for _, _, peak in groups})  # one line per schedule
    labels = [line.get_label() for line in lines]
    for kind, roles, peak in groups:  # and each group is named on its line
        assert any(roles in label and kind in label and f"peak {peak:.3g}" in label for label in labels), (roles, labels)
