"""Serving: a trained run behind an OpenAI-compatible HTTP API, and a playground page.

- `serve` (server.py): load a run and serve it with uvicorn; what `tinylm serve --run DIR` calls.
- `create_app` (app.py): the FastAPI app, for embedding or testing: the endpoints, streaming by
  server-sent events, OpenAI-shaped errors, the optional API key, the page at ``/``.
- `Scheduler` (scheduler.py): the background thread that decodes every request in flight
  together through one KV cache (continuous batching), each row with its own sampling settings;
  a `Job` (jobs.py) is one request to it, and the events it sends back.
- `ServedAdapters` (adapters.py): LoRA adapters served beside their base, each as a model of its
  own name (``tinylm serve --run BASE --adapter NAME=DIR``), the base loaded once and rows of any
  adapters decoded in one batch.
- `chat_prompt` (chat.py): the plain-text chat template ("System: ...", "User: ...",
  "Assistant:") that lets a base model answer `/v1/chat/completions`; a model whose tokenizer has
  a chat template reads its own (`ChatFormat`, `tinylm.tokenizers.chat_template`).

FastAPI and uvicorn are dependencies of tinylm; still, importing this package does not load
them (the scheduler and the chat template are plain Python), only `create_app` and `serve` do.

    from tinylm.serve import serve
    serve("runs/tiny-shakespeare", port=8000)      # then: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
"""

from __future__ import annotations

from typing import Any

from tinylm.serve.chat import chat_prompt
from tinylm.serve.jobs import Job
from tinylm.serve.scheduler import Scheduler
from tinylm.serve.server import serve


def create_app(*args: Any, **kwargs: Any):
    """`tinylm.serve.app.create_app`, imported on first use (it needs FastAPI)."""
    from tinylm.serve.app import create_app as create

    return create(*args, **kwargs)


__all__ = ["Job", "Scheduler", "chat_prompt", "create_app", "serve"]
