"""The OpenAI-compatible HTTP server and the engine process behind it."""
