"""The engine: forward context, model runner, sampling, the generate loop."""
