"""The HTTP edge: an OpenAI-compatible Starlette app over one engine (docs/api.md).

app.py builds it (`create_app`, the route table); middleware.py wraps every request (id, auth,
access log, error rendering); body.py reads POST bodies; generation.py serves the two generation
routes; info.py, scaleout.py and openapi.py the rest; metrics.py holds the Prometheus registry;
loading.py answers 503 while the model loads. engine_client.py is all it asks of the engine.
"""

from freetoken.api.app import create_app

__all__ = ["create_app"]
