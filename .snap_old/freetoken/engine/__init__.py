"""The engine: flags resolved, the model runner, scheduling, CUDA graphs, sampling."""
