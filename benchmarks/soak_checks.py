"""The chaos soak's bookkeeping: batches submitted under chaos and checked item by item, and the
usage rows matched against the requests the clients saw answered (exactly once)."""

from __future__ import annotations

import io
import json
import threading
import time
from typing import Any

import openai
from sqlalchemy import create_engine, text

from benchmarks.soak_load import Outcome


class Batches:
    """Submits a batch of `items` chat requests every `every_s` seconds (a thread), then checks
    every batch once it ended: each custom_id exactly once in its output, none failed."""

    def __init__(self, sdk: openai.OpenAI, items: int, every_s: float, model: str) -> None:
        self.sdk, self.items, self.every_s, self.model = sdk, items, every_s, model
        self.submitted: list[str] = []
        self.submit_errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-batches")

    def start(self) -> None:
        if self.items > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(120)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            lines = [
                {
                    "custom_id": f"b{n}-item-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": self.model,
                        "max_tokens": 4,
                        "messages": [{"role": "user", "content": f"Story {i}"}],
                    },
                }
                for i in range(self.items)
            ]
            data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
            try:
                upload = self.sdk.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
                batch = self.sdk.batches.create(
                    input_file_id=upload.id,
                    completion_window="24h",
                    endpoint="/v1/chat/completions",
                )
                self.submitted.append(batch.id)
            except openai.APIError as exc:
                self.submit_errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
            self._stop.wait(self.every_s)  # the pace of submissions

    def settle(self, timeout: float) -> dict[str, Any]:
        """Wait (bounded) for every submitted batch to end; then count items lost/duplicated."""
        deadline = time.monotonic() + timeout
        report: dict[str, Any] = {
            "submitted": len(self.submitted),
            "items_per_batch": self.items,
            "submit_errors": self.submit_errors,
            "unfinished": [],
            "items_expected": 0,
            "items_answered": 0,
            "items_lost": 0,
            "items_duplicated": 0,
            "items_failed": 0,
            "item_request_ids": [],
        }
        for batch_id in self.submitted:
            batch = None
            while time.monotonic() < deadline:
                try:
                    batch = self.sdk.batches.retrieve(batch_id)
                except openai.APIError:
                    batch = None
                if batch is not None and batch.status in (
                    "completed",
                    "failed",
                    "expired",
                    "cancelled",
                ):
                    break
                time.sleep(0.5)  # a poll's interval
            if batch is None or batch.status != "completed":
                report["unfinished"].append(f"{batch_id}: {batch.status if batch else '?'}")
                continue
            out = self._lines(batch.output_file_id)
            err = self._lines(batch.error_file_id)
            ids = [x["custom_id"] for x in out + err]
            prefix = ids[0].split("-item-")[0] if ids else ""
            expected = {f"{prefix}-item-{i}" for i in range(self.items)}
            report["items_expected"] += self.items
            report["items_answered"] += len(out)
            report["items_failed"] += len(err)
            report["items_lost"] += len(expected - set(ids)) if ids else self.items
            report["items_duplicated"] += len(ids) - len(set(ids))
            report["item_request_ids"] += [
                x["response"]["request_id"] for x in out if x.get("response")
            ]
        return report

    def _lines(self, file_id: str | None) -> list[dict[str, Any]]:
        if not file_id:
            return []
        content = self.sdk.files.content(file_id).text
        return [json.loads(x) for x in content.splitlines() if x]


def usage_rows(database_url: str, tenant_id: str) -> list[tuple[str, str, bool]]:
    """(request_id, status, batch) of every usage row of the soak's tenant."""
    engine = create_engine(database_url, connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("select request_id, status, batch from usage_records where tenant_id = :t"),
                {"t": tenant_id},
            ).all()
    finally:
        engine.dispose()
    return [(str(r[0]), str(r[1]), bool(r[2])) for r in rows]


def metering(
    outcomes: list[Outcome], rows: list[tuple[str, str, bool]], batch_request_ids: list[str]
) -> dict[str, Any]:
    """Answered request ids against usage rows.

    - every answered request has exactly one row (`answered_unmetered` = 0);
    - no logical request is metered twice: of one request's SDK attempts, at most one has an
      `ok` row (`metered_twice` = 0);
    - an `ok` row without an answer is allowed only for an attempt whose response never reached
      the client (its connection cut by a kill after the row was journaled; the SDK retried it,
      or gave up): `ok_rows_without_answer` counts them, and `ok_rows_unexplained` those that
      are not even matched by a cut attempt (an id never seen, up to the number of attempts
      that got no response at all)."""
    interactive = [r for r in rows if not r[2]]
    ids = [r[0] for r in interactive]
    by_id = {r[0]: r for r in interactive}
    answered = [o.request_id for o in outcomes if o.ok and o.request_id]
    answered_set = set(answered)
    seen = {a.request_id for o in outcomes for a in o.attempts if a.request_id}
    no_response = sum(1 for o in outcomes for a in o.attempts if a.status is None)
    ok_rows = {r[0] for r in interactive if r[1] == "ok"}
    twice = 0
    for o in outcomes:
        billed = {a.request_id for a in o.attempts if a.request_id in ok_rows}
        twice += len(billed) > 1
    without_answer = ok_rows - answered_set
    never_seen = without_answer - seen
    batch_rows = [r[0] for r in rows if r[2]]
    return {
        "answered": len(answered),
        "answered_without_id": sum(1 for o in outcomes if o.ok and not o.request_id),
        "usage_rows": len(interactive),
        "usage_rows_by_status": {
            s: sum(1 for r in interactive if r[1] == s) for s in sorted({r[1] for r in interactive})
        },
        "duplicate_row_ids": len(ids) - len(set(ids)),
        "answered_unmetered": len([i for i in answered if i not in by_id]),
        "answered_metered_not_ok": len([i for i in answered if i in by_id and by_id[i][1] != "ok"]),
        "metered_twice": twice,
        "ok_rows_without_answer": len(without_answer),
        "ok_rows_never_seen_by_a_client": len(never_seen),
        "attempts_without_response": no_response,
        "ok_rows_unexplained": max(0, len(never_seen) - no_response),
        "batch_usage_rows": len(batch_rows),
        "batch_duplicate_row_ids": len(batch_rows) - len(set(batch_rows)),
        "batch_items_unmetered": len(set(batch_request_ids) - set(batch_rows)),
        "batch_rows_without_item": len(set(batch_rows) - set(batch_request_ids)),
    }


def exactly_once(m: dict[str, Any]) -> bool:
    return (
        m["answered_unmetered"] == 0
        and m["duplicate_row_ids"] == 0
        and m["metered_twice"] == 0
        and m["ok_rows_unexplained"] == 0
        and m["answered_without_id"] == 0
        and m["batch_items_unmetered"] == 0
        and m["batch_rows_without_item"] == 0
    )
