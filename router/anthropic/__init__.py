"""Anthropic's Messages API (``POST /v1/messages``) over the router's chat pipeline."""
