"""FreeToken: serve Mixture-of-Experts language models on one machine whose GPU is too small."""

__version__ = "0.1.0"
