"""The Responses API's store: responses kept in memory for `previous_response_id`, GET,
DELETE and cancel, bounded in count and bytes.

    StoredResponse   the response object as last reported, the conversation that made its
                     prompt (history + this request's input items), its output items, and,
                     for a background response, the task that runs it and the events it has
                     sent (for a stream that attaches or resumes)
    ResponseStore    id -> StoredResponse, least recently used first out: past
                     --max-stored-responses responses or --max-stored-response-bytes bytes
                     (each counted by the JSON of its own items and history), the oldest go;
                     a background response still running is never evicted, nor the one
                     just stored (a single response over the byte bound is kept alone)

The store is the server's memory (as vLLM's is); a restart forgets it. A chain of responses
shares its items (the history lists hold the same objects), so the byte count, which
counts each response's whole history, over-counts: memory stays under the bound.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]
    history: list[dict[str, Any]]  # the previous response's conversation, input and output
    input_items: list[dict[str, Any]]
    task: asyncio.Task | None = None  # a background response while it runs
    events: list[dict[str, Any]] = field(default_factory=list)  # a background stream's
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set on each new event
    nbytes: int = 0

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a response chained to this one starts from."""
        return [*self.history, *self.input_items, *self.response["output"]]

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def add_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self.changed.set()
        self.changed = asyncio.Event()


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._items: dict[str, dict[str, Any]] = {}  # item id -> the item
        self._item_ids: dict[str, list[str]] = {}  # response id -> its items' ids

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    @property
    def items(self) -> dict[str, dict[str, Any]]:
        """Stored items by id (input items referenced by `item_reference`); read only."""
        return self._items

    def running(self) -> list[StoredResponse]:
        return [stored for stored in self._responses.values() if stored.running]

    def put(self, stored: StoredResponse) -> None:
        """Adds (or re-counts, once its output is in) a response, then evicts past the
        bounds."""
        response_id = stored.response["id"]
        old = self._responses.pop(response_id, None)
        if old is not None:
            self.nbytes -= old.nbytes
        stored.nbytes = _size(stored)
        self._responses[response_id] = stored
        self.nbytes += stored.nbytes
        ids = self._item_ids[response_id] = []
        for item in (*stored.input_items, *stored.response["output"]):
            if isinstance(item.get("id"), str):
                self._items[item["id"]] = item
                ids.append(item["id"])
        self._evict()

    def delete(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.pop(response_id, None)
        if stored is not None:
            self.nbytes -= stored.nbytes
            for item_id in self._item_ids.pop(response_id, ()):
                self._items.pop(item_id, None)
        return stored

    def _evict(self) -> None:
        """Oldest first; never one still running, nor the one just put."""
        for response_id in list(self._responses)[:-1]:
            if len(self._responses) <= self.max_responses and self.nbytes <= self.max_bytes:
                return
            if not self._responses[response_id].running:
                self.delete(response_id)


def _size(stored: StoredResponse) -> int:
    parts = (stored.response, stored.history, stored.input_items)
    return sum(len(json.dumps(part, ensure_ascii=False, default=str)) for part in parts)
