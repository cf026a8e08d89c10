"""OpenAI's Files API over the fake's `ProviderState`: a batch's input file goes up here, its output comes back.

Wire shapes (API reference "Files", checked with the search tool, 2026-12): `POST /v1/files` multipart (`purpose`,
`file`) -> File object `{id, object: "file", bytes, created_at, filename, purpose, status, expires_at,
status_details}`; `GET /v1/files?purpose=&limit=&after=&order=` (newest first by default; limit up to 10,000) ->
`{object: "list", data, first_id, last_id, has_more}`; `GET /v1/files/{id}/content`; `DELETE /v1/files/{id}` ->
`{id, object: "file", deleted: true}`. A batch's output and error files have purpose `batch_output`.
"""

from __future__ import annotations

import time
import uuid
from email import policy
from email.parser import BytesParser
from typing import Any

from oncelery.fake_provider.batch_records import BatchError, StoredFile, list_page, paginate, query_arg, query_limit
from oncelery.fake_provider.state import ProviderState

FILE_PURPOSES = frozenset({"assistants", "batch", "fine-tune", "vision", "user_data", "evals"})


class FakeFiles:
    """The files of the fake (`ProviderState.files`); a refused request raises `BatchError`, served as a 4xx."""

    def __init__(self, state: ProviderState) -> None:
        self.state = state

    def upload(self, content_type: str, raw: bytes) -> dict[str, Any]:
        """Store a multipart upload (`purpose`, `file`) and return its File object."""
        head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
        message = BytesParser(policy=policy.HTTP).parsebytes(head + raw)
        if not content_type.startswith("multipart/form-data") or not message.is_multipart():
            raise BatchError(400, "Expected a multipart/form-data body with 'purpose' and 'file'.")
        fields: dict[str, str] = {}
        upload: tuple[str, bytes] | None = None
        for part in message.walk():
            if part.is_multipart():
                continue
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True)
            data = payload if isinstance(payload, bytes) else b""
            if name == "file":
                upload = (part.get_filename() or "file", data)
            elif isinstance(name, str):
                fields[name] = data.decode(errors="replace")
        purpose = fields.get("purpose")
        if not purpose:
            raise BatchError(400, "Missing required parameter: 'purpose'.")
        if purpose not in FILE_PURPOSES:
            raise BatchError(400, f"Invalid value for 'purpose': {purpose!r}.")
        if upload is None:
            raise BatchError(400, "Missing required parameter: 'file'.")
        with self.state.lock:
            stored = self.store(upload[0], purpose, upload[1])
            self.state.stats.files_uploaded += 1
            return stored.as_json()

    def list_files(self, query: dict[str, list[str]]) -> dict[str, Any]:
        """Return a page of files, newest first unless `order=asc`, of one `purpose` if given."""
        purpose = query_arg(query, "purpose")
        limit = query_limit(query, "limit", 10_000, 10_000)
        order = query_arg(query, "order") or "desc"
        if order not in ("asc", "desc"):
            raise BatchError(400, f"Invalid value for 'order': {order!r}.")
        with self.state.lock:
            files = sorted(self.state.files.values(), key=lambda f: f.seq, reverse=order == "desc")
            rows = [f for f in files if purpose is None or f.purpose == purpose]
            page, more = paginate(rows, lambda f: f.id, query_arg(query, "after"), None, limit)
            return list_page([f.as_json() for f in page], more, openai=True)

    def file(self, file_id: str) -> StoredFile:
        """Return a stored file, or refuse with 404."""
        with self.state.lock:
            stored = self.state.files.get(file_id)
        if stored is None:
            raise BatchError(404, f"No such File object: {file_id}")
        return stored

    def delete_file(self, file_id: str) -> dict[str, Any]:
        """Delete a file (404 when there is none); return OpenAI's deletion answer."""
        with self.state.lock:
            if self.state.files.pop(file_id, None) is None:
                raise BatchError(404, f"No such File object: {file_id}")
            self.state.stats.files_deleted += 1
        return {"id": file_id, "object": "file", "deleted": True}

    def store(self, filename: str, purpose: str, content: bytes) -> StoredFile:
        """Keep a file and return it (the caller holds the state's lock)."""
        stored = StoredFile(
            id="file-" + uuid.uuid4().hex[:22],
            filename=filename,
            purpose=purpose,
            content=content,
            created_at=int(time.time()),
            seq=next(self.state.sequence),
        )
        self.state.files[stored.id] = stored
        return stored
