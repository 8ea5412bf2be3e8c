"""The OpenAI-compatible HTTP server (`specmoe serve`)."""
