"""A structural tag's JSON whitespace bounded (serving/structural_tags.py): where the
bound goes, what it leaves alone, and what xgrammar then accepts."""

from __future__ import annotations

import json
import re

import pytest

from vllm_dllm.serving.structural_tags import MAX_WHITESPACE_RUN, bound_whitespace

TEXT_ARGUMENT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
# A Hermes tool call as vLLM's tool parsers format it (group 1: the arguments' JSON).
TOOL_CALL = re.compile(r'<tool_call>\n?\{"name": "reverse", "arguments": (.*)\}\n?</tool_call>', re.S)


def tool_call_tag(arguments) -> str:
    """A structural tag of the shape vLLM builds for a Hermes-format tool call (its
    tool parser's structural tag, tool_choice "required"): one or more tags, each a
    constant envelope around the arguments' JSON (True: any JSON, a tool without
    `strict`)."""
    content = {"type": "json_schema", "json_schema": arguments, "style": "json", "max_whitespace_cnt": None}
    tags = [{"type": "tag", "begin": begin + '{"name": "reverse", "arguments": ', "content": content, "end": end}
            for begin, end in (("<tool_call>\n", "}\n</tool_call>"), ("<tool_call>", "}</tool_call>"))]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True, "stop_after_first": False}})


def contents(tag: str) -> list[dict]:
    return [t["content"] for t in json.loads(tag)["format"]["tags"]]


def test_every_json_content_gets_the_bound_and_nothing_else_changes():
    tag = tool_call_tag(TEXT_ARGUMENT)
    bounded = bound_whitespace(tag)
    assert [c["max_whitespace_cnt"] for c in contents(bounded)] == [MAX_WHITESPACE_RUN] * 2
    unbounded = json.loads(bounded)
    for each in unbounded["format"]["tags"]:
        each["content"]["max_whitespace_cnt"] = None
    assert unbounded == json.loads(tag)
    # Nested formats, a schema whose own keys look like a format, a bound already set.
    nested = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<a>"},
        {"type": "json_schema", "json_schema": {"type": "object", "properties": {"type": {"const": "json_schema"}}}},
        {"type": "or", "elements": [{"type": "json_schema", "json_schema": True, "max_whitespace_cnt": 4},
                                    {"type": "json_schema", "json_schema": True, "style": "qwen_xml"}]}]}}
    got = json.loads(bound_whitespace(json.dumps(nested)))["format"]["elements"]
    assert got[1]["max_whitespace_cnt"] == MAX_WHITESPACE_RUN
    assert got[1]["json_schema"] == nested["format"]["elements"][1]["json_schema"]
    assert got[2]["elements"][0]["max_whitespace_cnt"] == 4  # the client's own bound
    assert "max_whitespace_cnt" not in got[2]["elements"][1]  # XML parameters are not JSON


@pytest.mark.parametrize("tag", [
    json.dumps({"structures": [{"begin": "<f>", "schema": TEXT_ARGUMENT, "end": "</f>"}], "triggers": ["<f>"]}),
    "not json", "[1, 2]", json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}),
])
def test_what_has_no_json_content_to_bound_comes_back_unchanged(tag):
    assert bound_whitespace(tag) is tag


def test_xgrammar_allows_one_whitespace_between_tokens_and_any_in_strings(tiny_dirs):
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dirs("llada"))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok))
    begin = '<tool_call>\n{"name": "reverse", "arguments": '
    for tag, runs_allowed in ((tool_call_tag(TEXT_ARGUMENT), True), (bound_whitespace(tool_call_tag(TEXT_ARGUMENT)), False)):
        ctx = compiler.compile_structural_tag(tag)
        for arguments, spaced in (('{"text":"a  b"}', False), ('{ "text": "a" }', False), ('{  "text":"a"}', True),
                                  ('{"text":"a"\n\t}', True)):
            matcher = xgr.GrammarMatcher(ctx)
            accepted = matcher.accept_string(begin + arguments + "}\n</tool_call>")
            assert accepted == (runs_allowed or not spaced), (tag, arguments)
