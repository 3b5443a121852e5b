"""Conversations in SQLite (WAL): each user message and each finished or stopped reply is committed at once, so a
crash mid-reply loses at most that reply. A database that cannot be read is moved aside and a fresh one begins."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, system TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY, conversation INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, stats TEXT, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation, id);
"""


@dataclass
class Conversation:
    id: int
    title: str
    system: str = ""
    settings: dict = field(default_factory=dict)  # sampling settings: temperature, top_p, max_tokens ...


@dataclass
class Message:
    id: int
    role: str
    content: str
    stats: dict | None = None


class Store:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.recovered_from: Path | None = None  # where a damaged database was moved
        try:
            self.db = self._open()
        except sqlite3.DatabaseError:
            self.recovered_from = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
            self.path.rename(self.recovered_from)
            for suffix in ("-wal", "-shm"):
                Path(str(self.path) + suffix).unlink(missing_ok=True)
            self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA foreign_keys=ON")
            db.executescript(SCHEMA)
            db.execute("SELECT count(*) FROM conversations").fetchone()
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def close(self) -> None:
        self.db.close()

    def conversations(self, search: str = "") -> list[Conversation]:
        rows = self.db.execute("SELECT id, title, system, settings FROM conversations WHERE title LIKE ? "
                               "ORDER BY updated DESC, id DESC", (f"%{search}%",)).fetchall()
        return [Conversation(i, t, s, json.loads(st)) for i, t, s, st in rows]

    def get(self, conversation_id: int) -> Conversation:
        i, t, s, st = self.db.execute("SELECT id, title, system, settings FROM conversations WHERE id = ?",
                                      (conversation_id,)).fetchone()
        return Conversation(i, t, s, json.loads(st))

    def new(self, title: str = "New chat", system: str = "", settings: dict | None = None) -> Conversation:
        now = time.time()
        with self.db:
            cur = self.db.execute("INSERT INTO conversations (title, system, settings, created, updated) "
                                  "VALUES (?, ?, ?, ?, ?)", (title, system, json.dumps(settings or {}), now, now))
        return Conversation(cur.lastrowid, title, system, settings or {})

    def update(self, c: Conversation) -> None:
        with self.db:
            self.db.execute("UPDATE conversations SET title = ?, system = ?, settings = ?, updated = ? WHERE id = ?",
                            (c.title, c.system, json.dumps(c.settings), time.time(), c.id))

    def delete(self, conversation_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self.db.execute("SELECT id, role, content, stats FROM messages WHERE conversation = ? ORDER BY id",
                               (conversation_id,)).fetchall()
        return [Message(i, r, c, json.loads(s) if s else None) for i, r, c, s in rows]

    def add(self, conversation_id: int, role: str, content: str, stats: dict | None = None) -> Message:
        now = time.time()
        with self.db:
            cur = self.db.execute("INSERT INTO messages (conversation, role, content, stats, created) "
                                  "VALUES (?, ?, ?, ?, ?)",
                                  (conversation_id, role, content, json.dumps(stats) if stats else None, now))
            self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return Message(cur.lastrowid, role, content, stats)

    def delete_from(self, conversation_id: int, message_id: int) -> None:
        """Drop a message and everything after it (regenerate, edit and resend)."""
        with self.db:
            self.db.execute("DELETE FROM messages WHERE conversation = ? AND id >= ?", (conversation_id, message_id))
