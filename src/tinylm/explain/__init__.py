"""Explaining a model: parameter, FLOP and memory accounting (`tinylm.explain.accounting`), and
pictures such as the loss curves of a run (`tinylm.explain.plots`).

What `tinylm explain` shows, one module each, every one a table and a PNG: how a text splits into tokens
(`tokens`), how temperature, top-k and top-p reshape a next-token distribution (`sampling`), and what a
configuration costs in parameters, FLOPs and memory, and how that grows with the context (`cost`)."""
