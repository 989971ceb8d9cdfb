"""The one error hierarchy. Raised anywhere, rendered once at the HTTP edge (server.py).

The wire shape is OpenAI's: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

# NOTE: a message or param built from client input (a field name, a logit_bias key, a huge id)
# is clipped when rendered, so an error never echoes a whole prompt or body back.
MAX_MESSAGE_CHARS = 1000
MAX_PARAM_CHARS = 200


def clip(text: str | None, limit: int) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"... ({len(text) - limit} more characters)"


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
        code = clip(self.code, MAX_PARAM_CHARS) if isinstance(self.code, str) else self.code
        return {"error": {"message": clip(self.message, MAX_MESSAGE_CHARS), "type": self.type,
                          "param": clip(self.param, MAX_PARAM_CHARS), "code": code}}


class InvalidRequest(FreeTokenError, ValueError):
    """The client's request is wrong: a 400 naming the field and position in `param`.

    Also a ValueError: the checks of protocol/limits.py raise it from SamplingParams too, whose
    contract is ValueError for a bad value (STYLE.md 8.5), and keep the field's name there."""
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


class RequestTimeout(FreeTokenError):
    """The request outlived `--request-timeout`: it was aborted (its KV freed). A 504, so
    clients and proxies see a timeout rather than a client error."""
    status = 504
    type = "timeout_error"

    def __init__(self, timeout_s: float):
        super().__init__(f"The request did not finish within the server's deadline of "
                         f"{timeout_s:g} s (--request-timeout); it was stopped.",
                         code="request_timeout")
