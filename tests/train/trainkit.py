"""Small, fast training set-ups shared by the training tests: a local corpus and a tiny config.

The corpus is a folder of a dozen documents of made-up English-like text, some shorter than
the test context (so document batches need padding) and some far longer (so they are cut);
the tokenizer is character-level, so preparing it takes milliseconds. The model has one or two
layers of width 32: a step takes a few milliseconds on one thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tinylm.config import Config, build_config, load_preset
from tinylm.config import apply_overrides as _apply

WORDS = ("the king and queen of night rode to war while bells rang out over quiet fields "
         "my lord speak soft for here is gold and there is blood upon the stair").split()


def write_corpus(folder: Path, n_docs: int = 12, seed: int = 0) -> Path:
    """A folder of ``n_docs`` .txt documents of varied length (deterministic)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        n_words = [3, 5, 300, 40, 1200, 8, 600, 90, 4, 2000, 150, 700][i % 12]
        words = rng.choice(WORDS, size=n_words)
        lines = [" ".join(words[j : j + 9]).capitalize() + "." for j in range(0, n_words, 9)]
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


TINY = {
    # [model]: two layers of width 32, context 32
    "n_layer": 2, "d_model": 32, "n_head": 2, "block_size": 32,
    # [train]: a char tokenizer, small batches, a few steps, one thread, no sample unless asked
    "tokenizer_kind": "char", "batch_size": 4, "max_steps": 8, "max_tokens": None, "warmup_steps": 2,
    "short_block_size": 0,  # every step at block_size unless a test asks for the sequence-length schedule
    "lr": 3e-3, "eval_interval": 4, "eval_tokens": 256, "log_interval": 1, "threads": 1,
    "sample_tokens": 0, "device": "cpu", "dtype": "float32", "val_fraction": 0.25,
    # the classic recipe (AdamW, cosine, tied head, no QK-norm): exact comparisons (accumulation, DDP) need
    # AdamW, which does not amplify rounding as Muon's orthogonalization does; Muon's tests ask for it
    "optimizer": "adamw", "decay": "cosine", "min_lr": None, "head_lr": None, "tie_embeddings": True,
    "head_init_std": None, "qk_norm": False,
}


def tiny_config(corpus: Path, data_dir: Path, **overrides) -> Config:
    """The tiny preset shrunk to test size and trained by the classic recipe (`TINY`), on ``corpus`` with
    shards in ``data_dir``."""
    settings = {**TINY, "corpus": str(corpus), "data_dir": str(data_dir), **overrides}
    return build_config(_apply(load_preset("tiny"), settings))


def cli_flags(corpus: Path, data_dir: Path, **overrides) -> list[str]:
    """The same settings as `tiny_config`, as `tinylm train` flags."""
    settings = {**TINY, "corpus": str(corpus), "data_dir": str(data_dir), **overrides}
    flags: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, "none" if value is None else str(value)]
    return flags


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 180, **popen) -> subprocess.CompletedProcess:
    """`python -m tinylm ...` in a fresh process, with one torch thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tinylm", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout, **popen)
