"""The training loop through the library: exact resume, accumulation, document batches, failures."""

from __future__ import annotations

import math

import pytest
import torch
from trainkit import tiny_config

from tinylm.errors import TinyLMError
from tinylm.tokenizers import CharTokenizer
from tinylm.run import checkpoint_path, load_checkpoint, load_run, read_metrics
from tinylm.train import train
from tinylm.train.loop import _Trainer

QUIET = dict(progress=False, log=lambda line: None)


def tensors(path):
    """Every tensor of a checkpoint: weights and optimizer state, by name."""
    ckpt = load_checkpoint(path)
    out = {f"model/{k}": v for k, v in ckpt.model_state().items()}
    opt = ckpt.optimizer_state()
    for key, entry in opt["state"].items():
        out.update({f"opt/{key}/{k}": v for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return out


def train_losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"}


def test_stop_and_resume_ends_with_bitwise_identical_weights(tmp_path, corpus, data_dir):
    # dropout on, so the saved random state matters; two micro-batches, so accumulation is resumed too
    cfg = tiny_config(corpus, data_dir, dropout=0.1, grad_accum=2, checkpoint_interval=3)
    straight = train(cfg, tmp_path / "straight", **QUIET)
    assert straight.status == "complete" and straight.step == 8
    first = train(cfg, tmp_path / "halves", stop_after=4, **QUIET)
    assert first.status == "stopped" and load_checkpoint(checkpoint_path(tmp_path / "halves")).step == 4
    second = train(None, tmp_path / "halves", resume=True, **QUIET)  # the run's own configuration
    assert second.status == "complete" and second.step == 8
    a, b = tensors(straight.checkpoint), tensors(second.checkpoint)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert train_losses(tmp_path / "straight") == train_losses(tmp_path / "halves")  # the log was rewound too
    assert second.val["loss"] == straight.val["loss"]


def test_two_micro_batches_of_half_the_rows_equal_one_batch(tmp_path, corpus, data_dir):
    one = train(tiny_config(corpus, data_dir, batch_size=8, max_steps=4), tmp_path / "one", **QUIET)
    two = train(tiny_config(corpus, data_dir, batch_size=4, grad_accum=2, max_steps=4), tmp_path / "two", **QUIET)
    la, lb = train_losses(one.run_dir), train_losses(two.run_dir)
    assert la.keys() == lb.keys() == {1, 2, 3, 4}
    for step in la:
        assert lb[step] == pytest.approx(la[step], rel=1e-5)
    a, b = tensors(one.checkpoint), tensors(two.checkpoint)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


def test_document_batches_and_sgd_train(tmp_path, corpus, data_dir):
    result = train(tiny_config(corpus, data_dir, batch_mode="documents", optimizer="sgd", lr=0.3, max_steps=6,
                               sample_tokens=10, sample_temperature=0.0),
                   tmp_path / "docs", **QUIET)
    losses = list(train_losses(result.run_dir).values())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    run = load_run(result.run_dir)
    assert run.start_ids == [run.tokenizer.bos_id]  # document rows start with BOS
    assert isinstance(result.sample, str)


def test_a_run_folder_is_never_overwritten_without_force(tmp_path, corpus, data_dir):
    cfg = tiny_config(corpus, data_dir, max_steps=2)
    train(cfg, tmp_path / "run", **QUIET)
    with pytest.raises(TinyLMError, match="already exists; continue that run with --resume") as refused:
        train(cfg, tmp_path / "run", **QUIET)
    # a Python caller is told its own arguments too, not only the command's flags
    assert all(word in str(refused.value) for word in ("resume=True", "force=True", "out_dir=")), refused.value
    assert train(cfg, tmp_path / "run", force=True, **QUIET).status == "complete"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    with pytest.raises(TinyLMError, match="not a tinylm run folder"):
        train(cfg, tmp_path / "mine", force=True, **QUIET)
    assert (tmp_path / "mine" / "thesis.tex").exists()


def test_resuming_with_another_configuration_is_refused(tmp_path, corpus, data_dir):
    cfg = tiny_config(corpus, data_dir)
    train(cfg, tmp_path / "run", stop_after=4, **QUIET)
    with pytest.raises(TinyLMError, match=r"another configuration \(\[model\] n_layer: 2 -> 3"):
        train(tiny_config(corpus, data_dir, n_layer=3), tmp_path / "run", resume=True, **QUIET)
    with pytest.raises(TinyLMError, match=r"\[train\] lr"):
        train(tiny_config(corpus, data_dir, lr=1e-2), tmp_path / "run", resume=True, **QUIET)
    # settings that change only logging and evaluation may change
    done = train(tiny_config(corpus, data_dir, eval_interval=2, log_interval=2), tmp_path / "run", resume=True, **QUIET)
    assert done.status == "complete"
    again = train(None, tmp_path / "run", resume=True, **QUIET)  # already complete: nothing to do
    assert again.step == 8 and again.val == done.val


def test_a_non_finite_loss_stops_at_the_bad_step_and_keeps_the_last_good_checkpoint(tmp_path, corpus, data_dir,
                                                                                     monkeypatch):
    real_step = _Trainer._train_step

    def poisoned(self, step):
        loss_sum, n, norm = real_step(self, step)
        return (loss_sum * float("nan") if step == 5 else loss_sum), n, norm  # step index 5 is the 6th step

    monkeypatch.setattr(_Trainer, "_train_step", poisoned)
    cfg = tiny_config(corpus, data_dir, checkpoint_interval=2, eval_interval=100)
    with pytest.raises(TinyLMError, match=r"loss became nan at step 6 .*checkpoints/latest \(step 4\), is kept") as e:
        train(cfg, tmp_path / "run", **QUIET)
    assert "\n" not in str(e.value)
    assert load_checkpoint(checkpoint_path(tmp_path / "run")).step == 4
    assert max(train_losses(tmp_path / "run")) == 5  # step 5 was good and logged; nothing of step 6 was


def test_an_absurd_learning_rate_is_caught_as_a_non_finite_loss(tmp_path, corpus, data_dir):
    cfg = tiny_config(corpus, data_dir, optimizer="sgd", lr=1e30, warmup_steps=0, grad_clip=0.0)
    with pytest.raises(TinyLMError, match=r"became (nan|inf|-inf) at step \d+ .*no checkpoint had been saved yet"):
        train(cfg, tmp_path / "run", **QUIET)


def test_out_of_memory_says_what_to_lower(tmp_path, corpus, data_dir, monkeypatch):
    def too_big(self, step):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(_Trainer, "_train_step", too_big)
    with pytest.raises(TinyLMError, match=r"out of memory .* batch_size 4 x block_size 32: lower batch_size "
                                          r"\(--batch-size 2 --grad-accum 2"):
        train(tiny_config(corpus, data_dir), tmp_path / "run", **QUIET)


def test_init_from_starts_from_another_runs_weights(tmp_path, corpus, data_dir):
    base = train(tiny_config(corpus, data_dir, max_steps=12), tmp_path / "base", **QUIET)
    tuned = train(tiny_config(corpus, data_dir, max_steps=1, lr=1e-9, warmup_steps=0), tmp_path / "tuned",
                  init_from=base.run_dir, **QUIET)
    fresh = train(tiny_config(corpus, data_dir, max_steps=1), tmp_path / "fresh", **QUIET)
    assert tuned.val["loss"] == pytest.approx(base.val["loss"], rel=1e-3)  # the same weights (lr ~ 0)
    assert tuned.val["loss"] < fresh.val["loss"]
    with pytest.raises(TinyLMError, match="another model"):
        train(tiny_config(corpus, data_dir, d_model=48), tmp_path / "other", init_from=base.run_dir, **QUIET)
    other_tokenizer = tmp_path / "other.json"
    CharTokenizer.train("another alphabet entirely: qxz").save(other_tokenizer)
    with pytest.raises(TinyLMError, match="does not match the one .* was trained with"):
        train(tiny_config(corpus, data_dir, tokenizer=str(other_tokenizer)), tmp_path / "other",
              init_from=base.run_dir, **QUIET)


def test_muon_stops_and_resumes_bitwise(tmp_path, corpus, data_dir):
    cfg = tiny_config(corpus, data_dir, optimizer="muon", muon_lr=0.05, muon_momentum_warmup=6, decay="wsd",
                      embed_lr=0.01, checkpoint_interval=3)
    straight = train(cfg, tmp_path / "straight", **QUIET)
    # the schedule's picture is in the run folder beside the loss curve, a real PNG
    assert (tmp_path / "straight" / "schedule.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "straight" / "loss.png").exists()
    train(cfg, tmp_path / "halves", stop_after=4, **QUIET)
    second = train(None, tmp_path / "halves", resume=True, **QUIET)
    a, b = tensors(straight.checkpoint), tensors(second.checkpoint)
    assert a.keys() == b.keys() and any("momentum_buffer" in k for k in a)  # Muon's state is in the checkpoint
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert train_losses(tmp_path / "straight") == train_losses(tmp_path / "halves")
