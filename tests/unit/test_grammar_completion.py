"""How a grammar completes from where it stands (scheduler/completion.py), on
xgrammar grammars over the tiny LLaDA's tokenizer: the completions end with a stop
token, the shortest search finds the fewest single-character tokens (checked
against a breadth-first search), and every search leaves the grammar where it
stood."""

from __future__ import annotations

import json

import pytest

from tests.engine.test_structured_outputs import grammar_kit  # noqa: F401 (a fixture)
from tests.unit.test_structural_tags import TEXT_ARGUMENT, TOOL_CALL, tool_call_tag
from vllm_dllm.scheduler.completion import (
    alphabet_of,
    closing,
    greedy_completion,
    need,
    shortest_completion,
    single_character_tokens,
)
from vllm_dllm.scheduler.grammar import jump_tokens, rolls_back_deeply
from vllm_dllm.serving.structural_tags import bound_whitespace

xgr = pytest.importorskip("xgrammar")

OBJECT = {"type": "object"}
SUM = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}


@pytest.fixture(scope="module")
def kit(grammar_kit):  # noqa: F811
    kit = dict(grammar_kit)
    tok = kit["tok"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=kit["vocab"]))
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    def grammar(schema, prefix: str, any_whitespace=False):
        ctx = compiler.compile_json_schema(json.dumps(schema), any_whitespace=any_whitespace,
                                           **({} if any_whitespace else {"separators": (",", ":")}))
        g = XgrammarGrammar(vocab_size=kit["vocab"], ctx=ctx,
                            matcher=xgr.GrammarMatcher(ctx, override_stop_tokens=[kit["eos"]]))
        ids = tok.encode(prefix, add_special_tokens=False)
        assert g.accept_tokens("r", ids), prefix
        return g

    kit["grammar"] = grammar

    def tag_grammar(structural_tag: str, prefix: str):
        ctx = compiler.compile_structural_tag(structural_tag)
        g = XgrammarGrammar(vocab_size=kit["vocab"], ctx=ctx,
                            matcher=xgr.GrammarMatcher(ctx, override_stop_tokens=[kit["eos"]]))
        assert g.accept_tokens("r", tok.encode(prefix, add_special_tokens=False)), prefix
        return g

    kit["tag_grammar"] = tag_grammar
    kit["alphabet"] = alphabet_of(tok).with_stops([kit["eos"]])
    kit["bitmask"] = xgr.allocate_token_bitmask(1, kit["vocab"])
    return kit


def text(kit, tokens):
    assert tokens[-1] == kit["eos"]
    return kit["tok"].decode(tokens[:-1])


def stands_at_prefix(kit, grammar, continuation: str) -> bool:
    ids = kit["tok"].encode(continuation, add_special_tokens=False)
    return grammar.validate_tokens(ids) == ids


def breadth_first(kit, grammar, limit):
    """The fewest single-character tokens (a stop token last) that end the document,
    by plain breadth-first search replaying each path from the prefix, over JSON's
    punctuation, a digit and the letters these cases need."""
    characters = single_character_tokens(kit["tok"], '{}[]",:0asum')
    frontier = [[]]
    for _ in range(limit):
        following = []
        for path in frontier:
            assert grammar.accept_tokens("r", path) or not path
            ends = grammar.validate_tokens([kit["eos"]])
            allowed = [t for t in characters if grammar.validate_tokens([t])]
            if path:
                grammar.rollback(len(path))
            if ends:
                return len(path) + 1
            following.extend([*path, t] for t in allowed)
        frontier = following
    return None


@pytest.mark.parametrize("schema, prefix, shortest", [
    (OBJECT, "", "{}"),
    (OBJECT, "{", "}"),
    (OBJECT, '{"', '":0}'),
    (OBJECT, '{"a":[{"b":"xx', '"}]}'),
    (OBJECT, '{"a":[1', "]}"),
    (SUM, "", '{"sum":0}'),
    (SUM, '{"sum":76', "}"),
    (SUM, '{"su', 'm":0}'),
])
def test_completions_end_the_document_and_leave_the_grammar(kit, schema, prefix, shortest):
    grammar = kit["grammar"](schema, prefix)
    greedy = greedy_completion(grammar, "r", kit["alphabet"], 40, kit["bitmask"])
    found = shortest_completion(grammar, "r", kit["alphabet"], 40, kit["bitmask"])
    assert json.loads(prefix + text(kit, greedy)) is not None
    assert text(kit, found) == shortest
    assert len(found) <= len(greedy)
    assert len(found) == breadth_first(kit, grammar, len(found))
    assert stands_at_prefix(kit, grammar, shortest)  # every search was rolled back


def test_a_grammar_with_whitespace_still_completes(kit):
    """Whitespace is allowed almost anywhere: the greedy path never falls back to the
    same token twice, so it cannot pad forever."""
    grammar = kit["grammar"](OBJECT, '{"a"', any_whitespace=True)
    greedy = greedy_completion(grammar, "r", kit["alphabet"], 40, kit["bitmask"])
    assert json.loads('{"a"' + text(kit, greedy)) is not None
    assert text(kit, shortest_completion(grammar, "r", kit["alphabet"], 40, kit["bitmask"])) == ":0}"


def test_need_and_closing_read_the_room_left(kit):
    grammar = kit["grammar"](SUM, '{"sum":7')
    alphabet, bitmask = kit["alphabet"], kit["bitmask"]
    assert need(grammar, "r", alphabet, 10, bitmask) == 2  # "}" and the stop token
    assert need(grammar, "r", alphabet, 1, bitmask) == 2  # the stop token may fall off the canvas
    assert need(grammar, "r", alphabet, 0, bitmask) is None
    assert closing(grammar, "r", alphabet, 3, bitmask) == []  # a position to spare: the model decodes
    assert text(kit, closing(grammar, "r", alphabet, 2, bitmask)) == "}"
    assert kit["tok"].decode(closing(grammar, "r", alphabet, 1, bitmask)) == "}"
    assert text(kit, closing(grammar, "r", alphabet, 3, bitmask, now=True)) == "}"
    start = kit["grammar"](SUM, "")
    assert closing(start, "r", alphabet, 4, bitmask) == []  # no document fits: nothing forced
    assert stands_at_prefix(kit, grammar, "1}") and stands_at_prefix(kit, start, '{"sum":1}')


def test_only_grammars_that_roll_back_deeply_are_searched(kit):
    assert rolls_back_deeply(kit["grammar"](SUM, ""))

    class OutlinesGrammar:  # named as vLLM's module names its backends
        __module__ = "vllm.v1.structured_output.backend_outlines"

    assert not rolls_back_deeply(OutlinesGrammar())


@pytest.mark.parametrize("arguments", [TEXT_ARGUMENT, True])
@pytest.mark.parametrize("prefix, then", [
    ("", "<tool_call>"),
    ("<tool", "_call>"),
    ('<tool_call>\n{"name": "reverse", "arguments": ', '{"text":"a"}'),
])
def test_a_tool_call_completes_through_the_strings_its_grammar_forces(kit, arguments, prefix, then):
    """A tool call's envelope is constant text that a byte-level vocabulary spells
    with tokens of several characters: the completions take what the grammar forces
    as it comes, so the document completes from anywhere, its whitespace bounded or
    not."""
    for tag in (tool_call_tag(arguments), bound_whitespace(tool_call_tag(arguments))):
        grammar = kit["tag_grammar"](tag, prefix)
        forced = jump_tokens(grammar, kit["tok"])
        greedy = greedy_completion(grammar, "r", kit["alphabet"], 80, kit["bitmask"], forced=forced)
        shortest = shortest_completion(grammar, "r", kit["alphabet"], 80, kit["bitmask"], forced=forced)
        # The exact search branches over JSON's characters at every free position and
        # may run out of its budget on a long envelope: closing() then takes the
        # greedy path.
        for tokens in (greedy, shortest) if shortest is not None else (greedy,):
            call = TOOL_CALL.fullmatch(prefix + text(kit, tokens))
            assert call is not None, prefix + text(kit, tokens)
            value = json.loads(call.group(1))
            assert arguments is True or isinstance(value["text"], str)
        assert shortest is None or len(shortest) <= len(greedy)
        assert need(grammar, "r", kit["alphabet"], 80, kit["bitmask"], forced) == len(greedy)
        assert stands_at_prefix(kit, grammar, then)  # every search was rolled back


NESTED = {"type": "object", "required": ["outer"], "properties": {
    "outer": {"type": "object", "required": ["inner"], "properties": {"inner": {"type": "string"}}}}}


@pytest.mark.parametrize("prefix", ["", '{"out', '{"outer":{'])
def test_the_exact_search_takes_forced_keys_whole(kit, prefix):
    """Required keys are strings the grammar forces: taken whole, the exact search
    reaches the shortest document within its budget, and closing commits it."""
    grammar = kit["grammar"](NESTED, prefix)
    forced = jump_tokens(grammar, kit["tok"])
    alphabet, bitmask = kit["alphabet"], kit["bitmask"]
    shortest = shortest_completion(grammar, "r", alphabet, 60, bitmask, forced=forced)
    greedy = greedy_completion(grammar, "r", alphabet, 60, bitmask, forced=forced)
    assert prefix + text(kit, shortest) == '{"outer":{"inner":""}}'
    assert len(shortest) <= len(greedy) and json.loads(prefix + text(kit, greedy))["outer"]["inner"] is not None
    assert closing(grammar, "r", alphabet, len(shortest), bitmask, forced=forced) == shortest
    assert closing(grammar, "r", alphabet, len(shortest) + 1, bitmask, forced=forced) == []  # a position to spare
    assert stands_at_prefix(kit, grammar, '{"outer":{"inner":"x"}}'[len(prefix):])
