"""Server-sent events framing: a pure encoder for the agent and an incremental decoder for clients.

Standard library only and no I/O, following the WHATWG ``text/event-stream`` format: fields ``id``,
``event``, ``data`` (one line each, joined with newlines), ``retry``, and comment lines starting with ``:``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SSEMessage:
    event: str
    data: str
    id: str | None = None
    retry: int | None = None


def encode(event: str, data: str, event_id: str | int | None = None, retry_ms: int | None = None) -> bytes:
    """One message; multi-line data becomes several ``data:`` lines."""
    if "\n" in event or "\r" in event:
        raise ValueError("event name must be one line")
    parts: list[str] = []
    if event_id is not None:
        text_id = str(event_id)
        if "\n" in text_id or "\r" in text_id or "\0" in text_id:
            raise ValueError("event id must be one line without NUL")
        parts.append(f"id: {text_id}\n")
    if retry_ms is not None:
        parts.append(f"retry: {int(retry_ms)}\n")
    parts.append(f"event: {event}\n")
    for line in data.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        parts.append(f"data: {line}\n")
    parts.append("\n")
    return "".join(parts).encode("utf-8")


def comment(text: str = "") -> bytes:
    """A comment line (heartbeat): ignored by every conforming client, keeps idle connections alive."""
    return f": {text}\n\n".encode() if text else b":\n\n"


class SSEDecoder:
    """Feed bytes as they arrive; get complete messages back. Comments are dropped."""

    def __init__(self, max_buffer: int = 4 * 1024 * 1024) -> None:
        self._buffer = b""
        self._max_buffer = max_buffer
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None
        self._retry: int | None = None
        self.last_event_id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEMessage]:
        self._buffer += chunk
        if len(self._buffer) > self._max_buffer:
            self._buffer = b""
            raise ValueError(f"event stream line longer than {self._max_buffer} bytes")
        messages: list[SSEMessage] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                break
            end, skip = cut
            raw = self._buffer[:end]
            self._buffer = self._buffer[end + skip :]
            message = self._line(raw.decode("utf-8", errors="replace"))
            if message is not None:
                messages.append(message)
        return messages

    def _line(self, line: str) -> SSEMessage | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry" and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> SSEMessage | None:
        if self._id is not None:
            self.last_event_id = self._id
        if not self._data:
            self._event, self._id, self._retry = "", None, None
            return None
        message = SSEMessage(
            event=self._event or "message", data="\n".join(self._data), id=self._id, retry=self._retry
        )
        self._event, self._data, self._id, self._retry = "", [], None, None
        return message


def _line_end(buffer: bytes) -> tuple[int, int] | None:
    lf = buffer.find(b"\n")
    cr = buffer.find(b"\r")
    if cr == -1 or (lf != -1 and lf < cr):
        return (lf, 1) if lf != -1 else None
    if cr + 1 == len(buffer):
        return None  # might be a CRLF split across chunks
    return cr, 2 if buffer[cr + 1] == 0x0A else 1
