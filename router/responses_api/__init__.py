"""The OpenAI Responses API (``/v1/responses``): request, output and endpoints."""
