"""Structural tags (vLLM's tool-call grammars, `response_format` `structural_tag`)
with bounded whitespace in their JSON.  Imports no vLLM.

A canvas has a fixed length, and a diffusion model fills the positions a grammar
leaves open with whatever it allows there: JSON that allows any whitespace between
its tokens may spend the canvas on it (server_config._compact_json).  vLLM compiles
a structural tag's JSON without its compact-JSON switch, but xgrammar's structural
tag format bounds the whitespace runs of each JSON content (`max_whitespace_cnt`, 1
at least): each JSON schema content that sets no bound gets one whitespace
character between two tokens at most.  String values keep their own spaces.
"""

from __future__ import annotations

import json
from typing import Any

# xgrammar's smallest bound (0 is refused).
MAX_WHITESPACE_RUN = 1


def bound_whitespace(structural_tag: str) -> str:
    """`structural_tag` (vLLM's JSON text) with MAX_WHITESPACE_RUN on each JSON
    schema content in JSON style that sets no bound.  The legacy form (`structures`
    of begin/schema/end, which has no such field) and text that is not a JSON object
    come back as they are."""
    try:
        tag = json.loads(structural_tag)
    except ValueError:
        return structural_tag
    if not isinstance(tag, dict) or "structures" in tag:
        return structural_tag
    return json.dumps(tag) if _bound(tag) else structural_tag


def _bound(node: Any) -> bool:
    """Set the bound on every JSON schema content under `node`; whether any was set."""
    changed = False
    if isinstance(node, dict):
        if (node.get("type") == "json_schema" and node.get("style", "json") == "json"
                and node.get("max_whitespace_cnt") is None):
            node["max_whitespace_cnt"] = MAX_WHITESPACE_RUN
            changed = True
        for key, value in node.items():
            if key != "json_schema":  # a schema's own keys are not formats
                changed |= _bound(value)
    elif isinstance(node, list):
        for value in node:
            changed |= _bound(value)
    return changed
