"""A run folder for a model built in a test: what `tinylm train` leaves (config.toml, run.json, checkpoints/best)."""

from __future__ import annotations

from pathlib import Path

from tinylm.config import Config, TrainConfig, dump_toml
from tinylm.run import checkpoint_path, save_checkpoint, write_run_info


def write_model_run(folder: Path, model, tokenizer) -> Path:
    """Save ``model`` (a Transformer, LSTM or RNN) and ``tokenizer`` as a complete run folder in ``folder``."""
    config = Config(model.config, TrainConfig())
    save_checkpoint(checkpoint_path(folder, "best"), model_state=model.state_dict(), optimizer_state=None,
                    rng_state={}, state={"step": 0}, config=config, tokenizer=tokenizer)
    (folder / "config.toml").write_text(dump_toml(config.to_dict()), encoding="utf-8")
    write_run_info(folder, {"status": "complete"})
    return folder
