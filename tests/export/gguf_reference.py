"""A GGUF file run the way llama.cpp runs it, in a few lines of torch: an oracle for when llama.cpp is absent.

Everything comes from the file: the hyperparameters from its metadata (by llama.cpp's key names),
the weights by llama.cpp's tensor names, and the computation follows llama.cpp's graphs for
"gpt2", "llama" and "qwen3" (src/models/gpt2.cpp, llama.cpp and qwen3.cpp): in particular the
llama graph rotates *neighbouring* coordinates (2i, 2i+1) of each head (LLAMA_ROPE_TYPE_NORM),
with angle position * freq_base^(-2i / rope.dimension_count), while the qwen3 graph normalizes
each head's q and k (RMSNorm over the head, gains attn_q_norm and attn_k_norm) and then rotates
coordinate i with i + n_rot/2 (LLAMA_ROPE_TYPE_NEOX), at the same angles. Nothing here imports
tinylm's model code, so a wrong name, a missing key, a bad transpose or a wrong q/k permutation
in the exporter shows up as different logits. Computed in float64.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFReader


class GGUFModel:
    def __init__(self, path) -> None:
        reader = GGUFReader(path)
        self.meta = {name: field.contents() for name, field in reader.fields.items()}
        self.arch = self.meta["general.architecture"]
        self.t = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float64)) for t in reader.tensors}

    def hp(self, key: str, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)

    def logits(self, ids: list[int]) -> torch.Tensor:
        """(T, n_vocab) logits for one sequence of token ids."""
        t, T = self.t, len(ids)
        n_head = self.hp("attention.head_count")
        n_kv = self.hp("attention.head_count_kv", n_head)
        d = self.hp("embedding_length")
        hs = d // n_head
        assert len(ids) <= self.hp("context_length")
        x = t["token_embd.weight"][ids]  # (T, d)
        if self.arch == "gpt2":
            x = x + t["position_embd.weight"][:T]
        for i in range(self.hp("block_count")):
            p = f"blk.{i}."
            h = self.norm(x, p + "attn_norm")
            if self.arch == "gpt2":
                qkv = self.linear(h, p + "attn_qkv")
                q, k, v = qkv.split([n_head * hs, n_kv * hs, n_kv * hs], dim=-1)
            else:
                q, k, v = (self.linear(h, p + name) for name in ("attn_q", "attn_k", "attn_v"))
            q = q.view(T, n_head, hs).transpose(0, 1)  # (nh, T, hs)
            k = k.view(T, n_kv, hs).transpose(0, 1)
            v = v.view(T, n_kv, hs).transpose(0, 1)
            if self.arch == "llama":
                q, k = self.rope_neighbours(q), self.rope_neighbours(k)
            elif self.arch == "qwen3":
                q, k = self.norm(q, p + "attn_q_norm"), self.norm(k, p + "attn_k_norm")  # over each head's hs
                q, k = self.rope_halves(q), self.rope_halves(k)
            # ggml broadcasts kv head j over query heads j * (nh / n_kv) ... (j + 1) * (nh / n_kv) - 1
            k = k.repeat_interleave(n_head // n_kv, dim=0)
            v = v.repeat_interleave(n_head // n_kv, dim=0)
            scores = q @ k.transpose(-1, -2) / math.sqrt(hs)
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            att = scores.softmax(-1) @ v  # (nh, T, hs)
            x = x + self.linear(att.transpose(0, 1).reshape(T, n_head * hs), p + "attn_output")
            h = self.norm(x, p + "ffn_norm")
            if self.arch == "gpt2":
                ff = F.gelu(self.linear(h, p + "ffn_up"), approximate="tanh")  # ggml_gelu is the tanh form
            else:
                ff = F.silu(self.linear(h, p + "ffn_gate")) * self.linear(h, p + "ffn_up")
            x = x + self.linear(ff, p + "ffn_down")
        x = self.norm(x, "output_norm")
        head = t.get("output.weight", t["token_embd.weight"])  # llama.cpp's fallback for a tied head
        return x @ head.T

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        # a ggml matrix {in, out} is the numpy array (out, in): y = x W^T (+ b)
        y = x @ self.t[name + ".weight"].T
        bias = self.t.get(name + ".bias")
        return y if bias is None else y + bias

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.arch == "gpt2":
            eps = self.hp("attention.layer_norm_epsilon")
            return F.layer_norm(x, (x.shape[-1],), self.t[name + ".weight"], self.t[name + ".bias"], eps)
        eps = self.hp("attention.layer_norm_rms_epsilon")
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.t[name + ".weight"]

    def angles(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of pos * base^(-2i/n_rot) for pair i = 0 .. n_rot/2 - 1: (T, n_rot/2) each."""
        n_rot, base = self.hp("rope.dimension_count"), self.hp("rope.freq_base")
        theta = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)  # (n_rot/2,)
        angle = torch.arange(T, dtype=torch.float64)[:, None] * theta  # (T, n_rot/2)
        return angle.cos(), angle.sin()

    def rope_neighbours(self, x: torch.Tensor) -> torch.Tensor:
        """llama.cpp's NORM rope on (nh, T, hs): pair (2i, 2i+1) turned by pos * base^(-2i/n_rot)."""
        n_rot = self.hp("rope.dimension_count")
        cos, sin = self.angles(x.shape[1])
        even, odd = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out = x.clone()
        out[..., 0:n_rot:2] = even * cos - odd * sin
        out[..., 1:n_rot:2] = even * sin + odd * cos
        return out

    def rope_halves(self, x: torch.Tensor) -> torch.Tensor:
        """llama.cpp's NEOX rope on (nh, T, hs): pair (i, i + n_rot/2) turned by pos * base^(-2i/n_rot)."""
        half = self.hp("rope.dimension_count") // 2
        cos, sin = self.angles(x.shape[1])
        first, second = x[..., :half], x[..., half:2 * half]
        out = x.clone()
        out[..., :half] = first * cos - second * sin
        out[..., half:2 * half] = first * sin + second * cos
        return out
