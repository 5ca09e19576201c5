"""The OpenAI-compatible HTTP server: `create_app(sampler)` or `specsample serve`."""

from specsample.server.app import create_app

__all__ = ["create_app"]
