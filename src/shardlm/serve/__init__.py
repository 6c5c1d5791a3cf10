"""The HTTP side: an OpenAI-compatible API over the engine (app.py), run on uvicorn (server.py)."""
