"""Mixture-of-experts execution: where experts live and how a routed batch is computed."""
