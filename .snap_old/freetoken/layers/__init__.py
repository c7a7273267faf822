"""Building blocks shared by every model family: the per-forward context, linear, norm,
rotary, attention, embedding, and dense matrices on the CPU pool."""
