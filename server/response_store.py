"""Stored responses (OpenAI's Responses API, `store: true`): what a later turn's
previous_response_id continues.

A stored response keeps the response object (GET /v1/responses/{id}) and the conversation as token
ids: the exact prompt ids it ran and the output ids it generated, with the messages they stand for,
so that the next turn appends only its new input's tokens (server/conversation.py) and its prefix is
the previous turn's KV, block for block.

The store is bounded in bytes (--response-store-max-bytes) and drops the oldest first. In memory by
default; in an SQLite file with --response-store PATH, which survives a restart and is shared by
every API-server process (`--api-server-count`: without a path, their store is a file in the
server's runtime folder, gone at exit).
"""

from __future__ import annotations

import array
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

DEFAULT_MAX_BYTES = 256 * 1024 * 1024


@dataclass
class StoredResponse:
    """One stored response and the conversation up to its end."""

    id: str
    response: dict[str, Any]  # the response object as returned
    instructions: (
        str | None
    )  # its instructions (a system message before history, not carried to the next turn)
    history: list[
        dict[str, Any]
    ]  # the prompt's messages after the instructions, as OpenAI chat messages
    tools: list[dict[str, Any]] | None  # the tools as the chat template got them
    prompt_ids: list[int]
    output_ids: list[int]
    assistant: dict[str, Any]  # the answer as a chat message (content and/or tool_calls)
    exact: bool  # output_ids are exactly the answer's content (no stop string cut the text short)

    def to_bytes(self) -> bytes:
        row = {k: v for k, v in self.__dict__.items() if k not in ("prompt_ids", "output_ids")}
        row["prompt_ids"] = array.array("I", self.prompt_ids).tobytes()
        row["output_ids"] = array.array("I", self.output_ids).tobytes()
        return msgspec.msgpack.encode(row)

    @classmethod
    def from_bytes(cls, data: bytes) -> StoredResponse:
        row = msgspec.msgpack.decode(data)
        for key in ("prompt_ids", "output_ids"):
            row[key] = array.array("I", row[key]).tolist()
        return cls(**row)


class ResponseStore:
    """The in-memory store: one API server's own responses, oldest dropped first past max_bytes."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._rows: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        data = stored.to_bytes()
        if len(data) > self.max_bytes:
            return  # larger than the whole store: kept nowhere, as if evicted at once
        with self._lock:
            self._drop(stored.id)
            self._rows[stored.id] = data
            self._bytes += len(data)
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._rows)))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            data = self._rows.get(response_id)
        return None if data is None else StoredResponse.from_bytes(data)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        data = self._rows.pop(response_id, None)
        if data is not None:
            self._bytes -= len(data)
        return data is not None

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        pass


class SqliteResponseStore(ResponseStore):
    """The store in an SQLite file: kept across restarts, shared by processes (WAL), oldest dropped
    first."""

    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        super().__init__(max_bytes)
        self.path = path
        self._db = sqlite3.connect(path, timeout=30, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
            "id TEXT UNIQUE NOT NULL, created REAL NOT NULL, size INTEGER NOT NULL, data BLOB NOT "
            "NULL)"
        )

    def put(self, stored: StoredResponse) -> None:
        data = stored.to_bytes()
        if len(data) > self.max_bytes:
            return
        with self._lock:
            db = self._db
            db.execute(
                "BEGIN IMMEDIATE"
            )  # one writer at a time across processes: the size sum stays true
            try:
                db.execute("DELETE FROM responses WHERE id = ?", (stored.id,))
                db.execute(
                    "INSERT INTO responses (id, created, size, data) VALUES (?, ?, ?, ?)",
                    (stored.id, time.time(), len(data), data),
                )
                total = db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]
                while total > self.max_bytes:  # the oldest go first, a few at a time
                    for seq, size in db.execute(
                        "SELECT seq, size FROM responses ORDER BY seq LIMIT 16"
                    ).fetchall():
                        if total <= self.max_bytes:
                            break
                        db.execute("DELETE FROM responses WHERE seq = ?", (seq,))
                        total -= size
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT data FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        return None if row is None else StoredResponse.from_bytes(row[0])

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return (
                self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
            )

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]

    def close(self) -> None:
        self._db.close()


def open_store(path: str | None, max_bytes: int) -> ResponseStore:
    """The store --response-store asks for: in memory (None) or in an SQLite file."""
    return ResponseStore(max_bytes) if path is None else SqliteResponseStore(path, max_bytes)
