"""Tiny random models and a throwaway BPE tokenizer, shared by the export tests.

The models are GPT-2-style, Llama-style and Qwen3-style (Llama with QK-norm) configurations of two
layers and width 32, with every parameter drawn at random (biases and norm gains included: a fresh
model has zero biases and unit gains, which would hide a bias or a norm, q_norm and k_norm among
them, written to the wrong place or not at all).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import textwrap
from collections.abc import Callable

import pytest
import torch

from tinylm.config import GPTConfig
from tinylm.export import import_hf
from tinylm.model import GPT
from tinylm.tokenizers import BPETokenizer, train_bpe
from tinylm.tokenizers.formats import save_hf_tokenizer_json

# A few hundred tokens: the 256 bytes, 41 merges, bos, eos, pad and two reserved tokens.
VOCAB_SIZE = 302
PROMPT = "def wrap(text, width=70):\n    \"\"\"Wrap a paragraph.\"\"\"\n    return [line for line in text]"


def make_tokenizer(pattern: str = "gpt4") -> BPETokenizer:
    """Byte-level BPE trained on textwrap's source (always on disk), with two reserved tokens."""
    return train_bpe([inspect.getsource(textwrap)], vocab_size=VOCAB_SIZE, pattern=pattern, n_reserved=2, workers=1)


# The configurations the exporters must handle exactly; every one maps to GPT-2, Llama or Qwen3, as the
# first word of its name says.
CONFIGS: dict[str, dict] = {
    "gpt2": dict(),  # learned positions, LayerNorm, GELU, bias, tied head
    "gpt2-nobias-untied": dict(bias=False, tie_embeddings=False, d_ff=48, norm_eps=1e-6),
    "llama-gqa": dict(mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, n_kv_head=2, norm_eps=1e-6,
                      rope_theta=500.0),
    "llama-mha-bias-untied": dict(mlp="swiglu", norm="rmsnorm", positions="rope", bias=True, tie_embeddings=False,
                                  n_head=2, d_ff=80),
    # the recipe's options that change only the starting weights export as they are
    "llama-recipe-inits": dict(mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, zero_init_projections=True,
                               tie_embeddings=False, head_init_std=0.0),
    "qwen3-gqa": dict(mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, n_kv_head=2, norm_eps=1e-6,
                      rope_theta=500.0, qk_norm=True),
    "qwen3-mha-untied": dict(mlp="swiglu", norm="rmsnorm", positions="rope", bias=False, qk_norm=True,
                             tie_embeddings=False, n_head=2, d_ff=80),
}


def tiny_config(name: str, vocab_size: int = VOCAB_SIZE, **changes) -> GPTConfig:
    base = GPTConfig(vocab_size=vocab_size, block_size=64, n_layer=2, d_model=32, n_head=4)
    return dataclasses.replace(base, **{**CONFIGS[name], **changes})


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random: matrices N(0, 0.3^2), biases N(0, 0.2^2), norm gains 1 + N(0, 0.2^2).

    At this scale the logits spread over several units, so greedy decoding has clear winners
    (with GPT-2's 0.02 they would be nearly flat and every next token a near-tie).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(0.3 * noise)
            elif "norm" in name or "ln" in name or "layernorm" in name:
                p.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            else:
                p.copy_(0.2 * noise)
    return model.eval()


def tiny_model(name: str, seed: int = 0, **changes) -> GPT:
    with torch.random.fork_rng(devices=[]):
        model = GPT(tiny_config(name, **changes))
    return randomize(model, seed)


def greedy(logits_of, ids: list[int], steps: int = 20) -> list[int]:
    """The simplest greedy loop: the whole sequence through the model at every step, argmax of the last logits."""
    ids = list(ids)
    for _ in range(steps):
        logits = logits_of(torch.tensor([ids]))  # (1, T, V)
        ids.append(int(logits[0, -1].argmax()))
    return ids


def save(hf, folder, tokenizer) -> None:
    """A transformers model and a tinylm tokenizer saved as a Hugging Face checkpoint folder."""
    hf.save_pretrained(folder, safe_serialization=True)
    save_hf_tokenizer_json(tokenizer, folder / "tokenizer.json")


def edit_config(folder, **changes) -> None:
    """Change some keys of a checkpoint folder's config.json, as a user editing it would."""
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def imported_fixture(makers: dict[str, Callable[[], torch.nn.Module]]):
    """A module-scoped fixture, once for each of ``makers``: (name, the transformers model, tinylm's import of it).

    Each maker's model is saved with the session's tokenizer as a Hugging Face checkpoint folder and read back
    with `import_hf`. A test module takes it as ``imported = imported_fixture(MAKERS)``.
    """

    @pytest.fixture(scope="module", params=list(makers))
    def imported(request, tmp_path_factory, tokenizer):
        hf = makers[request.param]().eval()
        folder = tmp_path_factory.mktemp(request.param) / "hf"
        save(hf, folder, tokenizer)
        return request.param, hf, import_hf(folder)[0]

    return imported
