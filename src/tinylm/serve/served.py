"""The model a server serves, as its endpoints see it: a name, the model, its tokenizer, its context.

With adapters (`tinylm.serve.adapters`), each adapter is a model of its own name too: `ServedModel.check`
gives the one a request names, with the index of its adapter (0: the base) for the job it becomes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

import tinylm.serve.protocol as protocol
from tinylm.serve.protocol import APIError

T = TypeVar("T")


@dataclass
class ServedModel:
    """What the endpoints need from a loaded run (`tinylm.run.Run` or anything with these attributes)."""

    name: str
    model: torch.nn.Module
    tokenizer: Any
    start_ids: list[int]
    block_size: int
    created: int = field(default_factory=protocol.now)
    adapters: Any = None  # the `ServedAdapters` served beside the base, if any
    adapter: int = 0  # which one this is: 0 the base, k the adapter of index k
    parent: str | None = None  # an adapter's base, by name

    def check(self, requested: str | None) -> ServedModel:
        """The model a request names: this one (``requested`` None or this name), or one of its adapters; any
        other name is a 404."""
        if requested is None or requested == self.name:
            return self
        index = self.adapters.index(requested) if self.adapters is not None else None
        if index is None:
            raise APIError(404, f"The model '{requested}' does not exist; this server serves {self._names()}",
                           param="model", code="model_not_found")
        return replace(self, name=requested, adapter=index, parent=self.name)

    def _names(self) -> str:
        names = [f"'{name}'" for name in [self.name, *(self.adapters.names if self.adapters is not None else ())]]
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"

    def served(self) -> list[ServedModel]:
        """The base, then each adapter: every model this server serves (``/v1/models``)."""
        return [self, *(self.check(name) for name in (self.adapters.names if self.adapters is not None else ()))]

    def card(self) -> dict[str, Any]:
        card = {"id": self.name, "object": "model", "created": self.created, "owned_by": "tinylm",
                "max_model_len": self.block_size}
        return card if self.parent is None else {**card, "parent": self.parent}

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` with this model's adapter read by the model's forward passes in this thread (the base's
        own: nothing to choose)."""
        if self.adapter == 0:
            return fn(*args)
        with self.adapters.chosen(self.adapter):
            return fn(*args)


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
