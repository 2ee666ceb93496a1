"""The per-position feed-forward network of a Transformer block, one MLP of four kinds.

`MLP` is the dense layer every block has by default; a Mixture-of-Experts layer
(`tinylm.model.moe`) is several of them, each at its own (smaller) width, behind a router.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.config import GPTConfig


class MLP(nn.Module):
    """The per-position feed-forward network: GELU (GPT-2), SwiGLU (Llama), GeGLU (Gemma) or ReLU^2 (modded-nanogpt).

    gelu:   y = GELU(x W_1) W_2, with GELU in GPT-2's tanh approximation ("gelu_new" in Hugging
            Face), so GPT-2 weights give GPT-2's outputs.
    swiglu: y = (SiLU(x W_1) * (x W_3)) W_2: a gated unit, x W_3 scaled elementwise by a gate.
    geglu:  y = (GELU(x W_1) * (x W_3)) W_2: the same with GELU's tanh form as the gate.
    relu2:  y = ReLU(x W_1)^2 W_2 (So et al., 2021, "Primer"): as cheap as GELU, sparser.

    ``d_ff`` sets the hidden width (an expert's, in a Mixture of Experts); by default the config's.
    """

    def __init__(self, config: GPTConfig, d_ff: int | None = None) -> None:
        super().__init__()
        d, d_ff = config.d_model, d_ff or config.hidden_dim
        self.kind = config.mlp
        self.gated = config.gated
        self.W_1 = nn.Linear(d, d_ff, bias=config.bias)
        if self.gated:
            self.W_3 = nn.Linear(d, d_ff, bias=config.bias)
        self.W_2 = nn.Linear(d_ff, d, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        hidden = mlp_activation(self.kind, self.W_1(x), self.W_3(x) if self.gated else None)  # (B, T, d_ff)
        return self.W_2(hidden)  # (B, T, d)


def mlp_activation(kind: str, a: Tensor, b: Tensor | None = None) -> Tensor:
    """The MLP's hidden layer from a = x W_1 (and, gated, b = x W_3): SiLU(a) * b, GELU(a) * b, ReLU(a)^2 or GELU(a)."""
    if kind == "swiglu":
        return F.silu(a) * b
    if kind == "geglu":
        return F.gelu(a, approximate="tanh") * b
    if kind == "relu2":
        return F.relu(a).square()
    return F.gelu(a, approximate="tanh")
