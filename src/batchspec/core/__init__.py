"""The pure layer: parameters, the method table, sequences, sampling, acceptance, draft trees,
statistics, detokenization, logprobs and the tuning cache. No model, no batch layout: every other
layer may import it, and its math is property-tested on plain tensors."""

__version__ = "0.1.0"  # the package's version (pyproject.toml says the same)
