"""Errors of the OpenAI-compatible API: the client's (RequestError), the body OpenAI and vLLM give
them, and pydantic's validation errors turned into one readable message naming the field."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

_ERROR_TYPES = {  # the names of the openai client's exception classes where it has one
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    """The OpenAI/vLLM error type for an HTTP status, e.g. 400 -> "BadRequestError"."""
    return _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"


def escaped(text: str) -> str:
    """text as valid UTF-8: a client's input may hold lone surrogates (valid JSON, not valid UTF-8),
    escaped here."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(
    message: str, type: str, param: str | None = None, code: int | None = None
) -> dict[str, Any]:
    """The JSON body of an error response, shaped as OpenAI and vLLM shape it. A message may quote
    the client's input, which may hold lone surrogates (valid JSON, not valid UTF-8): they are
    escaped, not sent."""
    message = escaped(message)
    if param is not None:
        param = escaped(param)
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ANTHROPIC_PATHS = "/v1/messages"  # Anthropic's API: its own error shape
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    """An error as Anthropic's API shapes it: {"type": "error", "error": {"type", "message"}}."""
    message = escaped(message)
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(
    path: str, message: str, status: int, param: str | None = None
) -> dict[str, Any]:
    """The error body for a request to path: Anthropic's shape under /v1/messages, else OpenAI's."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_body(message, status)
    return error_body(message, error_type(status), param, status)


class RequestError(Exception):
    """An error the client caused (or must wait out); the API answers it with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = error_type(status)
        self.code = status

    def body(self) -> dict[str, Any]:
        """This error as a response body."""
        return error_body(self.message, self.type, self.param, self.code)


# The tags of the request unions the routes take (tokenize_api.TokenizeRequest): pydantic puts the
# member in an error's location, which is no field of the body.
UNION_TAGS: set[str] = set()


def validation_error_message(
    exc: ValidationError | RequestValidationError,
) -> tuple[str, str | None]:
    """Turn pydantic's (or FastAPI's) errors into one readable message and the first bad field.

    The field is a dotted path into the body, e.g. "messages.0.content".
    """
    messages: list[str] = []
    params: list[str] = []
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ())]
        if loc[:1] == ["body"]:  # FastAPI prefixes where the value came from
            loc = loc[1:]
        if loc[:1] and (loc[0] in UNION_TAGS or "[" in loc[0]):  # which member of a union
            loc = loc[1:]
        if error.get("type") == "json_invalid":
            detail = error.get("ctx", {}).get("error", error.get("msg", ""))
            return f"The request body is not valid JSON: {detail}", None
        if error.get("type") == "missing" and not loc:
            return "The request needs a JSON body", None
        if error.get("type") == "value_error" and "error" in error.get("ctx", {}):
            msg = str(
                error["ctx"]["error"]
            )  # our own message, without pydantic's "Value error, " prefix
        else:
            msg = error.get("msg", "invalid value")
        param = ".".join(loc)
        params.append(param)
        messages.append(f"{param or 'request body'}: {msg}")
    return "; ".join(messages) or "invalid request", next((p for p in params if p), None)
