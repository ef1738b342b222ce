"""Prompt files: JSON Lines, one `{"prompt": text}` or `{"messages": [{"role": ..., "content": ...}, ...]}` per
line (extra keys, such as an id or a category, are kept)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specair.models.errors import InputError


def read_prompt_file(path: str | os.PathLike, *, chat_only: bool = False) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line of a prompt file, each checked: "messages" a non-empty
    list of {"role": str, "content": str}, or (unless `chat_only`) "prompt" a string. InputError naming the
    file and line otherwise."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InputError(f"cannot read prompts file {path}: {e.strerror}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        msgs = rec.get("messages") if isinstance(rec, dict) else None
        ok_msgs = isinstance(msgs, list) and bool(msgs) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)
        ok_prompt = not chat_only and isinstance(rec, dict) and isinstance(rec.get("prompt"), str)
        if not (ok_msgs or ok_prompt):
            expected = '{"messages": [{"role": ..., "content": ...}, ...]}'
            raise InputError(f"{path}:{n}: expected {expected}" + ("" if chat_only else ' or {"prompt": "..."}'))
        out.append((n, rec))
    return out
