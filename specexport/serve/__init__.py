"""Serving: the continuous batcher, shared metrics, and the OpenAI-compatible HTTP server."""
