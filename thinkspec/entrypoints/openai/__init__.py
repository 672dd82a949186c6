"""OpenAI-compatible HTTP server; needs the server extras (pip install 'thinkspec[server]')."""
