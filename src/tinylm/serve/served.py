"""The model a server serves, as its endpoints see it: a name, the model, its tokenizer, its context."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import tinylm.serve.protocol as protocol
from tinylm.serve.protocol import APIError


@dataclass
class ServedModel:
    """What the endpoints need from a loaded run (`tinylm.run.Run` or anything with these attributes)."""

    name: str
    model: torch.nn.Module
    tokenizer: Any
    start_ids: list[int]
    block_size: int
    created: int = field(default_factory=protocol.now)

    def check(self, requested: str | None) -> None:
        if requested is not None and requested != self.name:
            raise APIError(404, f"The model '{requested}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")

    def card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "tinylm",
                "max_model_len": self.block_size}


def served_context(run: Any) -> int:
    """The most tokens a request may hold (prompt plus max_tokens): the model's context window.

    An n-gram model has no window of its own (it reads its last n-1 tokens), so the run's
    configured ``block_size`` bounds its requests instead, which also keeps a chat reply without
    ``max_tokens`` from running on without end.
    """
    config = getattr(run, "config", None)
    if config is not None and config.model.family == "ngram":
        return config.model.block_size
    return run.model.config.block_size
