"""Explaining a model: parameter, FLOP and memory accounting (`tinylm.explain.accounting`)."""
