"""Server-sent events survive every client's line splitter: httpx's `aiter_lines` and
requests' `iter_lines` split as str.splitlines does, on all of its line ends (not only SSE's
CR/LF), and a sampled token may hold any of them (a random tiny model samples them: CI once
saw a chaos-test stream cut so)."""

from __future__ import annotations

import json

from glm53.deployments.responses import sse

# every character str.splitlines ends a line at
SPLITLINES_ENDS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def test_each_event_is_one_line_for_splitlines_clients():
    texts = [f"a{c}b" for c in SPLITLINES_ENDS] + [SPLITLINES_ENDS, "Привет 中文 \u00e9"]
    events = [{"choices": [{"index": 0, "text": t}]} for t in texts]
    stream = "".join(sse(e) for e in events)
    data = [json.loads(line[len("data: "):]) for line in stream.splitlines() if line]
    assert data == events
    assert "中文" in stream  # other non-ASCII text stays raw UTF-8 (no 3x escaping)
