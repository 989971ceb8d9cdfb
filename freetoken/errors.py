"""The one error hierarchy. Raised anywhere, rendered once at the HTTP edge (server.py).

The wire shape is OpenAI's: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations


class FreeTokenError(Exception):
    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


class InvalidRequest(FreeTokenError):
    """The client's request is wrong: a 400 naming the field and position in `param`."""
    status = 400
    type = "invalid_request_error"


class ContextTooLong(InvalidRequest):
    """Prompt plus max_tokens does not fit in the model's context."""


class Unauthorized(FreeTokenError):
    status = 401
    type = "authentication_error"


class NotFound(FreeTokenError):
    status = 404
    type = "not_found_error"


class BodyTooLarge(FreeTokenError):
    status = 413
    type = "invalid_request_error"


class Overloaded(FreeTokenError):
    """The waiting queue is full; the client should retry after `Retry-After` seconds."""
    status = 503
    type = "overloaded"

    def __init__(self, message: str = "The server is overloaded; retry later.",
                 retry_after_s: int = 1):
        super().__init__(message, code="overloaded", headers={"Retry-After": str(retry_after_s)})


class EngineDead(FreeTokenError):
    """The engine loop is not running: every request gets a 503 until restart."""
    status = 503
    type = "unavailable_error"


class ServerError(FreeTokenError):
    """FreeToken's own fault; carries the request id so the log line can be found."""
    status = 500
    type = "server_error"
