"""Recurrent language models, the baselines before attention: an Elman RNN and an LSTM.

The language model is the Transformer's minus attention: token embeddings (no positions; order
is in the recursion), ``n_layer`` recurrent layers of width d, and a head tied to the embedding
or not. Training may truncate backpropagation through time at ``config.bptt`` steps; generation
carries the state in a `RecurrentState`, which stands where the Transformer's `KVCache` stands,
so the same engine drives both. The layers are PyTorch's fused `nn.RNN` / `nn.LSTM`;
`reference_forward` writes the equations out step by step and the tests pin the two equal.
docs/model.md has the equations and why the LSTM remembers longer.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError
from tinylm.model.cursor import CacheCursor
from tinylm.model.gpt import check_token_ids
from tinylm.model.head_loss import next_token_loss
from tinylm.model.memory import check_fits, count_recurrent_params

State = tuple[Tensor, ...]  # (h,) for an RNN, (h, c) for an LSTM; each (n_layer, B, d)

EMBEDDING_STD = 0.3  # the token vectors' initial scale: large enough to move the gates (see _init_weights)


class RecurrentState(CacheCursor):
    """The state of every layer for a batch of sequences: what an RNN remembers of the past.

    It plays the KV cache's part in generation: ``length`` counts the positions read so far,
    ``max_len`` is the window the engine may fill before it starts a new one, ``reorder`` and
    ``reset`` do what `tinylm.generate.cache.KVCache`'s do. Its size does not grow with the past.
    """

    def __init__(self, tensors: State, max_len: int) -> None:
        super().__init__(max_len)
        self.tensors = tensors

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def advance(self, tensors: State, steps: int) -> None:
        """Store the state after ``steps`` more positions."""
        self.tensors = tensors
        self._advance(steps)

    def reorder(self, rows: Tensor) -> None:
        """Row b becomes old row rows[b] (beam search; several samples of one prompt)."""
        self.tensors = tuple(t.index_select(1, rows) for t in self.tensors)

    def reset(self) -> None:
        """Back to the empty past: every state zero."""
        self.tensors = tuple(torch.zeros_like(t) for t in self.tensors)
        self._rewind()


class RecurrentLM(nn.Module):
    """An RNN or LSTM language model (``config.family`` "rnn" or "lstm"): ids (B, T) -> logits, loss.

    The forward signature is `tinylm.model.GPT`'s, so training, evaluation and generation call
    it the same way; ``position_ids`` are accepted and ignored (the recursion knows the order).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.family not in ("rnn", "lstm"):
            raise TinyLMError(f"RecurrentLM builds family 'rnn' or 'lstm', not {config.family!r}")
        check_fits(config)  # a size that cannot fit is refused before the first weight is allocated
        self.config = config
        d = config.d_model
        self.lstm = config.family == "lstm"
        self.E = nn.Embedding(config.vocab_size, d)
        layer = nn.LSTM if self.lstm else nn.RNN
        self.rnn = layer(d, d, num_layers=config.n_layer, batch_first=True,
                         dropout=config.dropout if config.n_layer > 1 else 0.0)
        self.dropout = nn.Dropout(config.dropout)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.E.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # The embedding is the recurrent layers' input. With the Transformer's 0.02 (init_std), the
        # first layer's gate pre-activations x W_ih start near 0.01: the gates sit at 0.5, the cell
        # barely moves, and training idles at the unigram loss for hundreds of steps; the wider
        # EMBEDDING_STD moves the gates from the first step.
        nn.init.normal_(self.E.weight, mean=0.0, std=EMBEDDING_STD)
        if not self.config.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=self.config.init_std)
        # PyTorch's recurrent init (uniform in +-1/sqrt(d)) is kept; an LSTM's forget-gate bias
        # starts at 1 so that the cell remembers by default (Jozefowicz et al., 2015)
        if self.lstm:
            d = self.config.d_model
            for name, p in self.rnn.named_parameters():
                if name.startswith("bias_ih"):
                    with torch.no_grad():
                        p[d : 2 * d].fill_(1.0)  # PyTorch's gate order: input, forget, cell, output
                elif name.startswith("bias_hh"):
                    with torch.no_grad():
                        p[d : 2 * d].zero_()

    # -- the state

    def zero_state(self, batch: int) -> State:
        p = self.E.weight
        shape = (self.config.n_layer, batch, self.config.d_model)
        h = torch.zeros(shape, dtype=p.dtype, device=p.device)
        return (h, torch.zeros_like(h)) if self.lstm else (h,)

    def new_cache(self, batch: int, max_len: int) -> RecurrentState:
        """The generation engine's cache for this model: a zero state for ``batch`` rows."""
        if max_len > self.config.block_size:
            raise TinyLMError(f"a window of {max_len} positions exceeds the model's context "
                              f"(block_size = {self.config.block_size})")
        return RecurrentState(self.zero_state(batch), max_len)

    def _layers(self, x: Tensor, state: State) -> tuple[Tensor, State]:
        """The recurrent layers over x (B, T, d) from ``state``: outputs (B, T, d) and the new state."""
        if self.lstm:
            out, (h, c) = self.rnn(x, state)
            return out, (h, c)
        out, h = self.rnn(x, state[0])
        return out, (h,)

    # -- the model

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: RecurrentState | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Logits (B, T, |V|) and, given ``targets``, the mean next-token loss (as `GPT.forward`).

        - ``attention_mask`` (B, T_past + T), False at padding: a padded position leaves the state
          as it was, so a left-padded row computes what it would alone. (Right padding, as in
          document batches, needs nothing: nothing after it is predicted.)
        - ``kv_cache``: a `RecurrentState` to start from and to advance (generation).
        """
        check_token_ids(idx)
        B, T = idx.shape
        state = kv_cache.tensors if kv_cache is not None else self.zero_state(B)
        mask = None
        if attention_mask is not None:
            mask = attention_mask.bool()[:, -T:]  # (B, T): only the new positions matter here
            if not bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                mask = None  # no real token after padding: nothing to hold the state for
        x = self.dropout(self.E(idx))  # (B, T, d)
        if mask is not None:
            out, state = self._masked(x, state, mask)
        elif self.training and self.config.bptt is not None and T > self.config.bptt:
            out, state = self._truncated(x, state, self.config.bptt)
        else:
            out, state = self._layers(x, state)
        if kv_cache is not None:
            kv_cache.advance(state, T)
        logits = self.lm_head(self.dropout(out))  # (B, T, |V|)
        loss = None
        if targets is not None:
            loss = next_token_loss(logits, targets)
        return logits, loss

    def _truncated(self, x: Tensor, state: State, bptt: int) -> tuple[Tensor, State]:
        """Chunks of ``bptt`` steps; the state passed between chunks is detached (no gradient flows back)."""
        outs = []
        for start in range(0, x.size(1), bptt):
            state = tuple(t.detach() for t in state)
            out, state = self._layers(x[:, start : start + bptt], state)
            outs.append(out)
        return torch.cat(outs, dim=1), state

    def _masked(self, x: Tensor, state: State, mask: Tensor) -> tuple[Tensor, State]:
        """One step at a time; where ``mask`` is False the state is kept (padding is not read)."""
        outs = []
        for t in range(x.size(1)):
            out, new = self._layers(x[:, t : t + 1], state)
            keep = mask[:, t].view(1, -1, 1)  # (1, B, 1), broadcast over layers and width
            state = tuple(torch.where(keep, n, s) for n, s in zip(new, state))
            outs.append(out)
        return torch.cat(outs, dim=1), state

    @torch.no_grad()
    def reference_forward(self, idx: Tensor) -> Tensor:
        """Logits (B, T, |V|) from the equations in the module docstring, one step and one layer at a time."""
        B, T = idx.shape
        d, L = self.config.d_model, self.config.n_layer
        x = self.E(idx)  # (B, T, d)
        for layer in range(L):
            W_ih = getattr(self.rnn, f"weight_ih_l{layer}").T  # (d, d) or (d, 4d): x_t W_ih
            W_hh = getattr(self.rnn, f"weight_hh_l{layer}").T
            b = getattr(self.rnn, f"bias_ih_l{layer}") + getattr(self.rnn, f"bias_hh_l{layer}")
            h = x.new_zeros(B, d)
            c = x.new_zeros(B, d)
            outs = []
            for t in range(T):
                z = x[:, t] @ W_ih + h @ W_hh + b  # (B, d) or (B, 4d)
                if self.lstm:
                    i, f, g, o = z.split(d, dim=-1)  # PyTorch's gate order
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                else:
                    h = torch.tanh(z)
                outs.append(h)
            x = torch.stack(outs, dim=1)  # (B, T, d): the next layer's input
        return self.lm_head(x)


def describe(config: GPTConfig) -> str:
    """One line for the start of a run: the recurrent model's shape and size."""
    kind = "LSTM" if config.family == "lstm" else "RNN (tanh)"
    if config.bptt is None or config.bptt >= config.block_size:
        bptt = ", backpropagation through the whole window"
    else:
        bptt = f", truncated BPTT over {config.bptt} steps"
    layers = f"{config.n_layer} layer{'s' if config.n_layer != 1 else ''}"
    return (f"{kind}, {layers} of width {config.d_model}, windows of {config.block_size}{bptt}: "
            f"{count_recurrent_params(config):,} parameters")
