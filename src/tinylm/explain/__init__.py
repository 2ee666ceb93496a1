"""Explaining a model: parameter, FLOP and memory accounting (`tinylm.explain.accounting`), and
pictures such as the loss curves of a run (`tinylm.explain.plots`)."""
