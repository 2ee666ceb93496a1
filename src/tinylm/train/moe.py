"""The training loop's side of a Mixture-of-Experts model: its balancing losses, bias updates, load metrics.

`tinylm.model.moe` says what the layers compute; here is what a step does with them
(`MoETraining`, a no-op for a dense model):

- after each micro-batch's forward pass, `MoETraining.penalty` is the term added to its loss:
  ``(moe_aux_weight * aux + moe_z_weight * z) / grad_accum``, aux and z the mean over the MoE
  layers of each layer's load-balancing loss and router z-loss. Over the micro-batches (and DDP's
  average over processes) the step's gradient is that of their mean;
- after the optimizer step, `MoETraining.after_step` sums the token-slots each expert got in the
  step over every process (an all-reduce) and, with ``moe_balance = "bias"``, moves each layer's
  selection bias by ``moe_bias_rate`` toward even loads. Every process makes the same update
  from the same counts, so the biases stay equal without being sent;
- every log line, `MoETraining.metrics` gives the training row its ``moe_aux`` and ``moe_z`` (the
  unweighted losses, averaged over the passes since the last row), each layer's load (the
  fraction of the token-slots each expert got, ``moe_load_l{layer}_e{expert}``) and its
  imbalance, the coefficient of variation std / mean of the loads (``moe_cv_l{layer}``,
  ``moe_cv_max``); `MoETraining.warnings` then names a layer that has collapsed: a CV above
  `COLLAPSE_CV`, or an expert below `DEAD_SHARE` of its even share, in `SUSTAINED` log windows in
  a row (one line when it happens, again only if it recovers and collapses anew).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tinylm.config import GPTConfig
from tinylm.model.moe import MoE, bias_update, load_cv
from tinylm.train.distributed import Distributed

COLLAPSE_CV = 1.0  # a layer's load CV above this is collapse (sqrt(E - 1) when one expert takes everything)
DEAD_SHARE = 0.02  # an expert below this fraction of its even share 1 / E is getting about nothing
SUSTAINED = 2  # log windows in a row a layer must look collapsed before the warning


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(block index, MoE layer) for every block of ``model`` whose MLP is a Mixture of Experts."""
    return [(i, block.mlp) for i, block in enumerate(getattr(model, "blocks", ())) if isinstance(block.mlp, MoE)]


class MoETraining:
    """What the training loop does for the MoE layers of ``model`` (module docstring); nothing for a dense model."""

    def __init__(self, model: nn.Module, config: GPTConfig, ctx: Distributed) -> None:
        self.layers = moe_layers(model)
        self.config, self.ctx = config, ctx
        self.window: Tensor | None = None  # (L, E) token-slots per expert since the last metrics row
        self.aux_sum: Tensor | float = 0.0  # summed over the passes since the last row, on the device (no sync)
        self.z_sum: Tensor | float = 0.0
        self.passes = 0
        self.suspect = [0] * len(self.layers)  # log windows in a row each layer has looked collapsed
        self.warned = [False] * len(self.layers)
        self._pending: list[str] = []

    def penalty(self, micro_batches: int) -> Tensor | None:
        """The balancing term to add to this micro-batch's loss (None for a dense model); clears what the layers kept."""
        if not self.layers:
            return None
        mc = self.config
        aux = [m.aux_loss for _, m in self.layers if m.aux_loss is not None]
        z = [m.z_loss for _, m in self.layers if m.z_loss is not None]
        for _, m in self.layers:
            m.aux_loss = m.z_loss = None
        total = None
        if aux:
            aux_mean = torch.stack(aux).mean()
            self.aux_sum = self.aux_sum + aux_mean.detach()
            total = mc.moe_aux_weight * aux_mean
        if z:
            z_mean = torch.stack(z).mean()
            self.z_sum = self.z_sum + z_mean.detach()
            if mc.moe_z_weight:
                total = mc.moe_z_weight * z_mean if total is None else total + mc.moe_z_weight * z_mean
        self.passes += 1
        return None if total is None else total / micro_batches

    def after_step(self) -> None:
        """Sum the step's counts over the processes, update the selection biases (moe_balance bias), keep the counts."""
        if not self.layers:
            return
        counts = torch.stack([self._take_counts(m) for _, m in self.layers]).double()  # (L, E)
        counts = self.ctx.all_reduce_sum(counts.to(self.ctx.device))
        if self.config.moe_balance == "bias":
            with torch.no_grad():
                for (_, m), c in zip(self.layers, counts):
                    bias_update(m.bias, c, self.config.moe_bias_rate)
        self.window = counts if self.window is None else self.window + counts

    @staticmethod
    def _take_counts(layer: MoE) -> Tensor:
        counts = layer.step_counts
        layer.step_counts = None
        return counts if counts is not None else torch.zeros(layer.n_experts, dtype=torch.long,
                                                             device=layer.bias.device)

    def metrics(self) -> dict[str, float]:
        """The MoE columns of a training metrics row (module docstring), over the steps since the last row."""
        if not self.layers or self.window is None:
            return {}
        row: dict[str, float] = {}
        if self.passes:
            if self.config.moe_balance == "aux":
                row["moe_aux"] = float(self.aux_sum) / self.passes
            row["moe_z"] = float(self.z_sum) / self.passes
        window = self.window.cpu()
        cvs = []
        for n, ((layer, _), counts) in enumerate(zip(self.layers, window)):
            loads = counts / counts.sum().clamp(min=1)
            cv = load_cv(counts)
            cvs.append(cv)
            row[f"moe_cv_l{layer}"] = cv
            row.update({f"moe_load_l{layer}_e{e}": float(load) for e, load in enumerate(loads)})
            self._watch(n, layer, cv, loads)
        row["moe_cv_max"] = max(cvs)
        self.window, self.aux_sum, self.z_sum, self.passes = None, 0.0, 0.0, 0
        return row

    def _watch(self, n: int, layer: int, cv: float, loads: Tensor) -> None:
        """Note a collapse of layer ``layer`` (the ``n``-th MoE layer) for `warnings`, once it has lasted."""
        E = len(loads)
        dead = [e for e, load in enumerate(loads.tolist()) if load < DEAD_SHARE / E]
        if cv <= COLLAPSE_CV and not dead:
            self.suspect[n], self.warned[n] = 0, False
            return
        self.suspect[n] += 1
        if self.suspect[n] >= SUSTAINED and not self.warned[n]:
            self.warned[n] = True
            starved = (f"; expert{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} got under "
                       f"{DEAD_SHARE:.0%} of an even share" if dead else "")
            self._pending.append(
                f"warning: MoE layer {layer} has collapsed onto few experts: load CV {cv:.2f} (even: 0, limit "
                f"{COLLAPSE_CV:g}){starved}, for {self.suspect[n]} log intervals; balance it with --moe-balance "
                "aux or bias (or a larger --moe-aux-weight / --moe-bias-rate)")

    def warnings(self) -> list[str]:
        """The collapse warnings the last `metrics` call found, each once."""
        lines, self._pending = self._pending, []
        return lines
