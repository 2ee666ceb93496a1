"""What the serving tests share: a small run folder, servers on free localhost ports, and toy models.

- `make_run`: a run folder like `tinylm train` writes, holding a 2-layer GPT with random weights
  (init_std 0.25, so greedy continuations vary) and a byte-level BPE tokenizer trained on text
  with accents, CJK and emoji, whose tokens often end inside a character.
- `CommandServer`: the real `tinylm serve` command in a subprocess on a free port.
- `ThreadServer`: `create_app` under uvicorn in a thread, for servers with a toy model or options.
- `counted_ngram`: a trigram model counted on `TEXT` by maximum likelihood (unseen continuations
  have probability 0: log-probabilities of -inf), behind the neural models' interface.
- `ScriptedLM`: says a fixed token sequence whatever the prompt (known token boundaries: split
  characters, stop strings). `SlowLM`: a model that sleeps in every forward pass, so a test can
  act while a generation is surely still running.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from torch import nn

from tinylm.config import Config, GPTConfig, TrainConfig, dump_toml
from tinylm.model import GPT, NGramLM, NGramModel
from tinylm.run import checkpoint_path, save_checkpoint, write_run_info
from tinylm.tokenizers import train_bpe

TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
        "the slings and arrows of outrageous fortune. Naïve café owners in Zürich smile 🙂; "
        "東京 and 京都 are cities. Ça va? Très bien! ") * 8


def make_run(folder: Path, block_size: int = 64, seed: int = 0) -> Path:
    """Write a loadable run folder (config.toml, run.json, checkpoints/best) with a random tiny GPT."""
    tok = train_bpe([TEXT], vocab_size=300, pattern="gpt4", workers=1)
    model_config = GPTConfig(vocab_size=tok.vocab_size, block_size=block_size, n_layer=2, d_model=32, n_head=4,
                             mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, init_std=0.25)
    config = Config(model_config, TrainConfig())
    torch.manual_seed(seed)
    model = GPT(model_config)
    save_checkpoint(checkpoint_path(folder, "best"), model_state=model.state_dict(), optimizer_state=None,
                    rng_state={}, state={"step": 0}, config=config, tokenizer=tok)
    (folder / "config.toml").write_text(dump_toml(config.to_dict()), encoding="utf-8")
    write_run_info(folder, {"status": "complete"})
    return folder


def counted_ngram(tokenizer, block_size: int = 64) -> NGramLM:
    ids = [t for line in TEXT.split(". ") for t in tokenizer.encode(line) + [tokenizer.eos_id]]
    counted = NGramModel.fit(ids, 3, tokenizer=tokenizer, smoothing="mle")
    return NGramLM(counted, GPTConfig(family="ngram", vocab_size=tokenizer.vocab_size, block_size=block_size, order=3))


def wait_for(condition, timeout: float = 5.0, poll: float = 0.01) -> bool:
    """Whether ``condition()`` came true within ``timeout`` seconds: every wait in these tests has an end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return False


def wait_healthy(base_url: str, timeout: float = 60.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no healthy server at {base_url} after {timeout}s")


class CommandServer:
    """`python -m tinylm serve --run DIR --port 0 ...` in a subprocess; the port comes from its first line."""

    def __init__(self, run_dir: Path, log_dir: Path, *flags: str) -> None:
        self.stdout = log_dir / "serve.out"
        self.stderr = log_dir / "serve.err"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop(("TINYLM_API_KEY"), None)
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tinylm", "serve", "--run", str(run_dir), "--port", "0", "--threads", "1",
                 "--log-level", "warning", *flags], stdout=out, stderr=err, env=env)
        self.base_url = self._wait_for_address()
        wait_healthy(self.base_url, process=self.process)

    def _wait_for_address(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"at (http://\S+:\d+) ", self.stdout.read_text())
            if found:
                return found.group(1)
            if self.process.poll() is not None:
                raise RuntimeError(f"tinylm serve exited ({self.process.returncode}): {self.stderr.read_text()}")
            time.sleep(0.05)
        raise TimeoutError("tinylm serve printed no address")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ThreadServer:
    """`create_app(run, **options)` served by uvicorn on a free localhost port, in a background thread.

    With ``graceful_timeout``, the server is the one `tinylm serve` runs (`graceful_server`), which ends the
    generations still running before that timeout of a shutdown (`close`) runs out.
    """

    def __init__(self, run: Any, graceful_timeout: float | None = None, **options: Any) -> None:
        import uvicorn

        from tinylm.serve.app import create_app
        from tinylm.serve.server import graceful_server

        self.app = create_app(run, **options)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        if graceful_timeout is None:
            self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        else:
            config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=graceful_timeout)
            self.server = graceful_server(config, self.app.state.scheduler.end_all)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_healthy(self.base_url)

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> ThreadServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- toy models ------------------------------------------------------------------------------------


class ScriptedLM(nn.Module):
    """Predicts ``script[k]`` (with probability ~1) as the k-th new token, whatever the prompt.

    It counts new tokens from the position ids: the first new token is predicted at the last
    prompt position, so ``prompt_len`` must be the (fixed) prompt length the test uses.
    Follows the model protocol the engine and scheduler need: forward(idx, attention_mask,
    position_ids, kv_cache) -> (logits, None), a config with the cache sizes, a parameter.
    """

    def __init__(self, script: list[int], vocab_size: int, prompt_len: int, block_size: int = 64) -> None:
        super().__init__()
        self.config = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=1, d_model=2, n_head=1)
        self.script = torch.tensor(script)
        self.prompt_len = prompt_len
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, idx, targets=None, attention_mask=None, position_ids=None, kv_cache=None):
        B, T = idx.shape
        if kv_cache is not None:
            for layer in kv_cache:  # store something so the cache length advances as attention's would
                layer.update(torch.zeros(B, 1, T, 2), torch.zeros(B, 1, T, 2))
        k = (position_ids.expand(B, T) - self.prompt_len + 1).clamp(0, len(self.script) - 1)  # (B, T)
        return nn.functional.one_hot(self.script[k], self.config.vocab_size).float() * 50.0, None


class SlowLM(nn.Module):
    """A model that sleeps ``delay`` seconds in every forward pass (a stand-in for a big model)."""

    def __init__(self, model: nn.Module, delay: float) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        self.delay = delay

    def forward(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner(*args, **kwargs)
