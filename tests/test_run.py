"""The run directory: checkpoints saved and loaded exactly, atomically, with clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import tinylm.checkpoint as checkpoint_module
from tinylm.config import Config, GPTConfig, TrainConfig
from tinylm.errors import TinyLMError
from tinylm.model import GPT
from tinylm.run import (
    checkpoint_path,
    find_checkpoint,
    flatten_optimizer_state,
    load_checkpoint,
    load_run,
    read_metrics,
    save_checkpoint,
    unflatten_optimizer_state,
    write_run_info,
)
from tinylm.tokenizers import CharTokenizer
from tinylm.train.optim import make_optimizer


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TOKENIZER = CharTokenizer.train("to be or not to be, that is the question")


def config(**model) -> Config:
    shape = dict(vocab_size=TOKENIZER.vocab_size, block_size=16, n_layer=2, d_model=16, n_head=2)
    return Config(GPTConfig(**{**shape, **model}), TrainConfig())


def trained(cfg: Config, steps: int = 3) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(cfg.model)
    optimizer = make_optimizer(model, cfg.train)
    for _ in range(steps):  # a few real steps, so the weights and AdamW's moments are not their initial values
        idx = torch.randint(0, cfg.model.vocab_size, (3, 16))
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def save(path, model, optimizer, cfg, step=3):
    return save_checkpoint(path, model_state=model.state_dict(), optimizer_state=optimizer.state_dict(),
                           rng_state={"torch_cpu/rank0": torch.get_rng_state()}, state={"step": step},
                           config=cfg, tokenizer=TOKENIZER)


@pytest.mark.parametrize("model_settings", [
    {},  # tied head, RoPE-free learned positions, LayerNorm with biases (GPT-2 style)
    {"tie_embeddings": False, "positions": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False},
])
def test_a_saved_checkpoint_gives_exactly_the_same_logits(tmp_path, model_settings):
    cfg = config(**model_settings)
    model, optimizer = trained(cfg)
    path = save(tmp_path / "ckpt", model, optimizer, cfg)
    loaded = load_checkpoint(path)
    assert loaded.config == cfg and loaded.step == 3
    assert loaded.tokenizer.fingerprint() == TOKENIZER.fingerprint()
    copy = loaded.build_model()
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16))
    model.eval()
    assert torch.equal(model(idx)[0], copy(idx)[0])  # bit for bit
    if cfg.model.tie_embeddings:
        assert copy.lm_head.weight is copy.E.weight  # still one tensor, stored once
        assert "lm_head.weight" not in checkpoint_module._read_safetensors(path / checkpoint_module.MODEL_FILE)[0]


def test_optimizer_state_survives_the_round_trip_exactly(tmp_path):
    cfg = config()
    model, optimizer = trained(cfg)
    tensors, rest = flatten_optimizer_state(optimizer.state_dict())
    json.dumps(rest)  # the non-tensor part is plain JSON
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    path = save(tmp_path / "ckpt", model, optimizer, cfg)
    ckpt = load_checkpoint(path)
    twin = ckpt.build_model().train()
    twin_optimizer = make_optimizer(twin, cfg.train)
    twin_optimizer.load_state_dict(ckpt.optimizer_state())
    # one more identical step on both: identical weights after it
    idx = torch.randint(0, cfg.model.vocab_size, (3, 16))
    for m, opt in ((model.train(), optimizer), (twin, twin_optimizer)):
        _, loss = m(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name
    restored = unflatten_optimizer_state(tensors, rest)
    assert restored["param_groups"][0]["betas"] == optimizer.state_dict()["param_groups"][0]["betas"]


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = config()
    model, optimizer = trained(cfg)
    latest = checkpoint_path(tmp_path, "latest")
    save(latest, model, optimizer, cfg, step=3)
    before = (latest / "model.safetensors").read_bytes()
    calls = []

    def dies_on_the_second_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save_safetensors(tensors, filename, metadata)

    real_save_safetensors = checkpoint_module.save_safetensors
    monkeypatch.setattr(checkpoint_module, "save_safetensors", dies_on_the_second_file)
    with pytest.raises(OSError, match="disk full"):
        save(latest, model, optimizer, cfg, step=6)
    monkeypatch.undo()
    assert load_checkpoint(latest).step == 3
    assert (latest / "model.safetensors").read_bytes() == before
    assert not (tmp_path / "checkpoints" / ".latest.new").exists()


def test_a_crash_between_the_two_renames_is_recovered(tmp_path):
    cfg = config()
    model, optimizer = trained(cfg)
    latest = checkpoint_path(tmp_path, "latest")
    save(latest, model, optimizer, cfg, step=3)
    old = latest.with_name(".latest.old")
    latest.rename(old)  # the instant after the old checkpoint moved aside, before the new one moved in
    assert find_checkpoint(latest) == old
    assert load_checkpoint(latest).step == 3
    save(latest, model, optimizer, cfg, step=4)  # the next save puts things right
    assert load_checkpoint(latest).step == 4 and not old.exists()


def test_a_truncated_or_corrupt_file_is_a_one_line_error_naming_it(tmp_path):
    cfg = config()
    model, optimizer = trained(cfg)
    path = save(tmp_path / "ckpt", model, optimizer, cfg)
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:200])  # cut short, as by a full disk
    with pytest.raises(TinyLMError, match=rf"model\.safetensors has 200 of the {size:,} bytes written \(truncated, "
                       r"or another checkpoint's file\); use another checkpoint, or train again") as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value)
    path = save(tmp_path / "ckpt", model, optimizer, cfg)
    optimizer_file = path / "optimizer.safetensors"
    data = bytearray(optimizer_file.read_bytes())
    data[-5] ^= 0x10  # one bit of one moment: a file safetensors itself reads without complaint
    optimizer_file.write_bytes(bytes(data))
    with pytest.raises(TinyLMError, match=r"optimizer\.safetensors is corrupt \(its SHA-256 differs"):
        load_checkpoint(path)


def without_checksums(path):
    """The checkpoint as tinylm wrote it before checksums: no checksums.json, and no mention of it."""
    (path / "checksums.json").unlink()
    state = json.loads((path / "state.json").read_text())
    del state["checksums"]
    (path / "state.json").write_text(json.dumps(state))


def test_a_checkpoint_from_before_checksums_loads_unchecked_and_its_errors_stay_one_line(tmp_path):
    cfg = config()
    model, optimizer = trained(cfg)
    path = save(tmp_path / "ckpt", model, optimizer, cfg)
    without_checksums(path)
    idx = torch.randint(0, cfg.model.vocab_size, (1, 8))
    assert torch.equal(load_checkpoint(path).build_model()(idx)[0], model.eval()(idx)[0])
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(TinyLMError, match=r"model\.safetensors is corrupt or truncated.*another checkpoint") as e:
        load_checkpoint(path).build_model()  # only safetensors' own checks are left to catch it
    assert "\n" not in str(e.value)


def test_a_deleted_checksums_file_is_an_error_not_an_old_checkpoint(tmp_path):
    cfg = config()
    model, optimizer = trained(cfg)
    path = save(tmp_path / "ckpt", model, optimizer, cfg)
    (path / "checksums.json").unlink()
    with pytest.raises(TinyLMError, match=r"checksums\.json is missing \(its state\.json says it was written\)"):
        load_checkpoint(path)


def test_the_same_checkpoint_is_saved_as_the_same_bytes(tmp_path):
    """safetensors orders the metadata of each file by a fresh hash seed, even within one process."""
    cfg = config()
    model, optimizer = trained(cfg)
    files = {}
    for i in range(8):
        path = save(tmp_path / f"ckpt{i}", model, optimizer, cfg)
        for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors"):
            files.setdefault(name, set()).add((path / name).read_bytes())
    assert {name: len(versions) for name, versions in files.items()} == dict.fromkeys(files, 1)


def test_save_safetensors_writes_a_safetensors_file_with_sorted_metadata(tmp_path):
    tensors = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.tensor([1, 2], dtype=torch.int64),
               "c": torch.ones(3, dtype=torch.bfloat16)}
    metadata = {"zeta": "1", "alpha": "2", "mid": "3"}
    checkpoint_module.save_safetensors(tensors, tmp_path / "t.safetensors", metadata)
    data = (tmp_path / "t.safetensors").read_bytes()
    header_size = int.from_bytes(data[:8], "little")
    assert header_size % 8 == 0
    assert list(json.loads(data[8:8 + header_size])["__metadata__"]) == ["alpha", "mid", "zeta"]
    with safe_open(tmp_path / "t.safetensors", framework="pt") as f:  # safetensors' own reader
        assert f.metadata() == metadata
        read = {name: f.get_tensor(name) for name in f.keys()}
    assert read.keys() == tensors.keys() and all(torch.equal(read[k], t) for k, t in tensors.items())


def test_weights_of_another_shape_are_rejected_clearly(tmp_path):
    cfg = config()
    model, optimizer = trained(cfg)
    path = save(tmp_path / "ckpt", model, optimizer, cfg)
    other = GPT(config(d_model=32).model)
    with pytest.raises(TinyLMError, match="another configuration"):
        load_checkpoint(path).load_weights(other)


def test_load_run_takes_best_then_latest_and_reads_the_metrics(tmp_path):
    cfg = config()
    model, optimizer = trained(cfg)
    with pytest.raises(TinyLMError, match="does not exist"):
        load_run(tmp_path / "nope")
    run_dir = tmp_path / "run"
    save(checkpoint_path(run_dir, "latest"), model, optimizer, cfg, step=7)
    (run_dir / "config.toml").write_text((checkpoint_path(run_dir, "latest") / "config.toml").read_text())
    write_run_info(run_dir, {"status": "complete"})
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 3.0}\n{"kind": "tra')  # torn
    run = load_run(run_dir)  # no best yet: latest
    assert run.step == 7 and run.metrics == [{"kind": "train", "step": 1, "loss": 3.0}]
    assert read_metrics(run_dir) == run.metrics
    idx = torch.randint(0, cfg.model.vocab_size, (1, 8))
    assert torch.equal(run.model(idx)[0], model.eval()(idx)[0])
    assert run.start_ids == [TOKENIZER.eos_id]  # packed training: documents start after an EOS
