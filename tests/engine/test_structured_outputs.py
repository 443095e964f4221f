"""Structured outputs under diffusion decoding: vLLM's grammars enforced
at the frontier, rejected final tokens returned to the mask, forced tokens
committed without a step.

* the frontier mask and the planning of forced tokens against their definitions
  (packed bitmask bits, xgrammar's own matcher);
* LLaDA token for token against a plain constrained loop written from the
  definition (tests/oracle_grammar.py), on tie-free draws;
* every constrained output parses (regex, choice, JSON schema) for LLaDA and Dream
  under every decoding mode (fixed, a parallel rule over the dual cache, CFG,
  sampling, Dream's top-k/top-p), batched with unconstrained requests whose tokens
  do not change.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from tests import oracle, oracle_model, oracle_rules
from tests.conftest import close_engine, make_engine, random_prompt
from tests.oracle_grammar import constrained_llada
from tests.tie_free import compare_until
from tests.unit.test_structural_tags import TEXT_ARGUMENT, TOOL_CALL, tool_call_tag
from vllm_dllm.decoding.grammar_mask import allowed_tokens, mask_rows
from vllm_dllm.engine.constraints import block_of
from vllm_dllm.scheduler.grammar import Frontier, jump_tokens, plan_frontiers, sole_token, stop_allowed_after

xgr = pytest.importorskip("xgrammar")

REGEX = r"[a-d]{2}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma"]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "enum": ["x", "yy"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
# The structured-output settings a user gets by default: compact JSON for our models
# (a random checkpoint would otherwise fill any canvas with whitespace), the backend
# chosen per request.
ENGINE_STRUCTURED: dict = {}


# ---- the frontier mask and forced tokens, from their definitions ---------------


def test_mask_rows_keeps_exactly_the_allowed_bits():
    gen = torch.Generator().manual_seed(0)
    vocab, words = 77, 3  # logits wider than the mask's 96 bits? no: narrower, and not a multiple of 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(6, vocab, generator=gen)
    rows = torch.tensor([0, -1, 3, 2, -1, 0])
    got = mask_rows(logits.clone(), bitmask, rows)
    for i, r in enumerate(rows.tolist()):
        for v in range(vocab):
            allowed = r < 0 or (int(bitmask[r, v // 32]) >> (v % 32)) & 1
            assert got[i, v] == (logits[i, v] if allowed else float("-inf")), (i, v)
    # Logits columns past the mask's bits are never allowed.
    wide = allowed_tokens(torch.full((1, 1), -1, dtype=torch.int32), 40)
    assert wide[0, :32].all() and not wide[0, 32:].any()


def test_sole_token_reads_a_single_bit_or_stop_tokens_only():
    row = np.zeros(4, dtype=np.int32)
    assert sole_token(row, frozenset({5})) is None
    row[2] = 1 << 7
    assert sole_token(row, frozenset()) == 71
    row[0] = 1 << 5
    assert sole_token(row, frozenset({5})) is None  # 5 (stop) or 71
    assert sole_token(row, frozenset({5, 71})) == 5  # stop tokens only: the lowest
    row = np.full(4, -1, dtype=np.int32)
    assert sole_token(row, frozenset({5})) is None


@pytest.fixture(scope="module")
def grammar_kit(tiny_dirs):
    """The tiny LLaDA's tokenizer as xgrammar sees it, and vLLM's grammar wrapper."""
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    from vllm_dllm.families import register_hf_classes

    register_hf_classes()
    model_dir = tiny_dirs("llada")
    config = json.loads(open(f"{model_dir}/config.json").read())
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = config["vocab_size"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    eos = config["eos_token_id"]

    def matcher(kind: str, spec):
        if kind == "regex":
            ctx = compiler.compile_regex(spec)
        elif kind == "choice":
            ctx = compiler.compile_regex("(" + "|".join(re.escape(c) for c in spec) + ")")
        else:
            ctx = compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
        return xgr.GrammarMatcher(ctx, override_stop_tokens=[eos])

    def wrapped(kind, spec):
        m = matcher(kind, spec)
        return XgrammarGrammar(vocab_size=vocab, matcher=m, ctx=None), m

    return dict(model_dir=model_dir, tok=tok, vocab=vocab, eos=eos, mask=config["mask_token_id"],
                matcher=matcher, wrapped=wrapped)


def test_plan_frontiers_forces_what_the_grammar_allows_alone_and_rolls_back(grammar_kit):
    kit = grammar_kit
    tok = kit["tok"]
    literal, _ = kit["wrapped"]("regex", "ID-[0-9]")
    free, _ = kit["wrapped"]("regex", "[a-z]+")
    bitmask = xgr.allocate_token_bitmask(2, kit["vocab"])
    frontiers = [Frontier("lit", literal, 8, frozenset({kit["eos"]})), Frontier("free", free, 8, frozenset())]
    step = plan_frontiers(frontiers, bitmask)
    forced = step.forced["lit"]
    assert tok.decode(forced) == "ID-", forced  # single-character tokens: each allowed alone
    assert "free" not in step.forced and step.masked == ["lit", "free"]
    # The grammar stands where it stood (rolled back), and the row is the mask after "ID-".
    assert literal.validate_tokens(forced) == forced
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    row = step.bitmask[0]
    allowed = {v for v in range(kit["vocab"]) if (int(row[v // 32]) >> (v % 32)) & 1}
    assert allowed == digits
    # Room bounds the forcing: one position left forces one token.
    again, _ = kit["wrapped"]("regex", "ID-[0-9]")
    step = plan_frontiers([Frontier("lit", again, 1, frozenset())], bitmask)
    assert len(step.forced["lit"]) == 1


def test_plan_frontiers_commits_the_string_xgrammar_forces(grammar_kit):
    kit = grammar_kit
    tok = kit["tok"]
    grammar, _ = kit["wrapped"]("json", SCHEMA)
    bitmask = xgr.allocate_token_bitmask(1, kit["vocab"])
    jump = jump_tokens(grammar, tok)
    step = plan_frontiers([Frontier("j", grammar, 16, frozenset({kit["eos"]}), jump)], bitmask)
    # The keys come in the schema's order: the object's opening and first key are forced.
    assert tok.decode(step.forced["j"]) == '{"ok":', tok.decode(step.forced["j"])
    assert grammar.validate_tokens(step.forced["j"]) == step.forced["j"]  # rolled back
    assert jump_tokens(object(), tok) is None  # a backend without jump strings


def test_stop_allowed_after_reads_the_mask_behind_the_prefix_and_leaves_the_grammar(grammar_kit):
    kit = grammar_kit
    a, b = (kit["tok"].convert_tokens_to_ids(c) for c in "ab")
    grammar, _ = kit["wrapped"]("regex", "ab")
    bitmask = xgr.allocate_token_bitmask(1, kit["vocab"])
    assert stop_allowed_after(grammar, "r", [a, b], kit["eos"], bitmask)
    assert not stop_allowed_after(grammar, "r", [a], kit["eos"], bitmask)
    assert not stop_allowed_after(grammar, "r", [], kit["eos"], bitmask)
    assert grammar.validate_tokens([a, b]) == [a, b]  # still at the start


def test_block_of_aligns_block_causal_blocks_to_the_sequence():
    positions = np.array([0, 4, 5, 12, 13, 7, 8])
    prompt_len = np.array([11, 11, 11, 11, 11, 3, 3])  # blocks of 8: the canvas starts 3 into block 1
    segment = np.array([8, 8, 8, 8, 8, 0, 0])  # the last two: LLaDA's canvas blocks of 8
    block_length = np.array([8, 8, 8, 8, 8, 8, 8])
    assert block_of(positions, prompt_len, block_length, segment).tolist() == [0, 0, 1, 1, 2, 0, 1]


# ---- LLaDA against the constrained loop written from the definition ------------

# The constrained loop has no document completion: every grammar here allows only
# documents shorter than the canvas (SCHEMA's longest, '{"ok":false,"n":99,"tag":"yy"}',
# is 30 characters), so what a grammar needs to finish always fits in the positions
# left, and the scheduler never completes a document early in these cases.
EXACT_CASES = [
    # (name, grammar kind, spec, prompt length, gen length, steps, block length)
    ("regex, one token per step", "regex", REGEX, 6, 16, 16, 8),
    ("regex, two per step", "regex", REGEX, 5, 16, 8, 8),
    ("choice", "choice", CHOICES, 7, 16, 8, 8),
    ("json schema", "json", SCHEMA, 6, 32, 16, 8),
]


def request_params(kind: str, spec, **kw) -> SamplingParams:
    structured = {"regex": lambda: StructuredOutputsParams(regex=spec),
                  "choice": lambda: StructuredOutputsParams(choice=list(spec)),
                  "json": lambda: StructuredOutputsParams(json=spec)}[kind]()
    return SamplingParams(structured_outputs=structured, **kw)


def structured_engine(model_dir: str):
    llm = make_engine(model_dir, **ENGINE_STRUCTURED)
    yield llm
    close_engine(llm)


@pytest.fixture(scope="module")
def llada(grammar_kit):
    yield from structured_engine(grammar_kit["model_dir"])


def test_llada_matches_the_constrained_loop(llada, grammar_kit):
    check_constrained_loop(llada, grammar_kit)


def check_constrained_loop(llada, kit) -> None:
    """LLaDA under a grammar decodes as the constrained reference loop."""
    model = oracle_model.load_oracle(kit["model_dir"])
    rng = random.Random(11)
    totals = {"forced": 0, "returned": 0}

    def draw(_):
        prompts = [random_prompt(rng, case[3]) for case in EXACT_CASES]
        params = [request_params(kind, spec, max_tokens=gen, temperature=0.0,
                                 extra_args={"steps": steps, "block_length": block})
                  for _, kind, spec, _, gen, steps, block in EXACT_CASES]
        outs = llada.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        compared = 0
        for case, prompt, out in zip(EXACT_CASES, prompts, outs):
            name, kind, spec, _, gen, steps, block = case
            want, ties, forced, returned = constrained_llada(
                model, kit["matcher"](kind, spec), xgr, kit["tok"], prompt, gen_length=gen, steps=steps, block_length=block,
                mask_id=kit["mask"], stop_ids={kit["eos"]}, vocab=kit["vocab"])
            if ties:
                continue
            assert list(out.outputs[0].token_ids) == want, name
            totals["forced"] += forced
            totals["returned"] += returned
            compared += 1
        return compared

    compare_until(2 * len(EXACT_CASES), draw)
    # The comparison exercised both mechanisms, not only the frontier mask.
    assert totals["forced"] > 0 and totals["returned"] > 0, totals


# ---- every output parses, in every mode, beside unconstrained requests ---------

def parses(kind: str, spec, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool)
            and isinstance(value["n"], int) and 0 <= value["n"] <= 99 and value["tag"] in ("x", "yy"))


LLADA_MODES = [
    {"steps": 32, "block_length": 8},
    {"steps": 8, "block_length": 8, "decoding": "threshold", "threshold": 0.5, "cache": "dual"},
    {"steps": 16, "block_length": 16, "cfg_scale": 1.0},
    {"steps": 16, "block_length": 8, "cache": "prefix"},
]


def check_all_parse(llm, modes, temperatures, rng, gen=32, companion_reference=None) -> int:
    """Every grammar in every mode, beside one unconstrained request per mode
    (greedy, seeded).  With `companion_reference(prompt, mode) -> (tokens, ties)`
    each companion the reference decodes without an exact tie must have the
    reference's tokens (a comparison across batch compositions would not hold on
    every CPU: GEMM rounding changes with the row count); returns how many did."""
    grammars = [("regex", REGEX), ("choice", CHOICES), ("json", SCHEMA)]
    requests, expected = [], []
    for i, mode in enumerate(modes):
        for kind, spec in grammars:
            t = temperatures[i % len(temperatures)]
            # ASCII prompts: vLLM's incremental detokenizer decodes the first output
            # tokens together with the prompt's last ones, and random byte tokens
            # there would put stray characters into the text.
            requests.append(({"prompt_token_ids": random_prompt(rng, rng.randint(3, 9), 97, 123)},
                             request_params(kind, spec, max_tokens=gen, temperature=t, seed=i,
                                            extra_args=dict(mode))))
            expected.append((kind, spec))
    plain = [({"prompt_token_ids": random_prompt(rng, 6)},
              SamplingParams(max_tokens=gen, temperature=0.0, seed=7, extra_args=dict(mode))) for mode in modes]
    outs = llm.generate([p for p, _ in requests + plain], [s for _, s in requests + plain], use_tqdm=False)
    for (kind, spec), out in zip(expected, outs):
        text = out.outputs[0].text
        assert parses(kind, spec, text), (kind, text, out.outputs[0].finish_reason)
        assert out.outputs[0].finish_reason == "stop", (kind, text)
    compared = 0
    if companion_reference is not None:
        for (prompt, _), mode, out in zip(plain, modes, outs[len(requests):]):
            tokens, ties = companion_reference(prompt["prompt_token_ids"], mode)
            if not ties:
                assert list(out.outputs[0].token_ids) == tokens, mode
                compared += 1
    return compared


def test_llada_outputs_parse_in_every_mode(llada, grammar_kit):
    """... and the unconstrained requests beside them get the oracle's tokens."""
    kit = grammar_kit
    model = oracle_model.load_oracle(kit["model_dir"])
    eot = kit["tok"].get_vocab().get("<|eot_id|>")
    rng = random.Random(3)

    def reference(prompt, mode):
        mode = dict(mode)
        want = oracle.llada_generate(
            model, prompt, gen_length=32, steps=mode.pop("steps"), block_length=mode.pop("block_length"),
            cfg_scale=mode.pop("cfg_scale", 0.0), mask_id=kit["mask"], eos_id=kit["eos"], eot_id=eot, seed=7,
            **mode)
        return oracle_rules.trim_at_eos(want.tokens, kit["eos"]), want.ties

    compare_until(len(LLADA_MODES), lambda _: check_all_parse(llada, LLADA_MODES, [0.0, 0.7], rng,
                                                            companion_reference=reference))


SUM_SCHEMA = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}


def test_json_completes_whenever_the_canvas_has_room(llada, grammar_kit):
    """A JSON request ends with a complete, compact document whatever the model
    would have written: a random checkpoint writes digits or string content until
    the canvas ends unless the scheduler completes the document in time."""
    rng = random.Random(11)
    cases, requests = [], []
    for i in range(24):
        json_object = i % 2 == 0
        mode = {key: value for key, value in LLADA_MODES[i % len(LLADA_MODES)].items() if key != "steps"}
        mode["block_length"] = 8  # the default schedule: one token per step
        gen = rng.choice([16, 24, 32, 48])
        structured = StructuredOutputsParams(json_object=True) if json_object else StructuredOutputsParams(json=SUM_SCHEMA)
        cases.append((json_object, gen))
        requests.append(({"prompt_token_ids": random_prompt(rng, rng.randint(3, 9), 97, 123)},
                         SamplingParams(structured_outputs=structured, max_tokens=gen, temperature=[0.0, 0.8][i % 2],
                                        seed=i, extra_args=dict(mode))))
    outs = llada.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    for (json_object, gen), out in zip(cases, outs):
        text = out.outputs[0].text
        value = json.loads(text)  # raises: the document did not complete
        assert isinstance(value, dict), text
        if not json_object:
            assert re.fullmatch(r'\{"sum":-?[0-9]+\}', text), text  # compact, by default
        assert len(out.outputs[0].token_ids) <= gen


def test_tool_calls_complete_with_their_json_whitespace_bounded(llada):
    """What a client asking for a tool call gets (tool_choice "required": the tool
    parser's structural tag): a call that parses, its arguments' JSON with no two
    whitespace characters together, whenever the canvas has room for one.  Without
    the grammar's forced strings in the completion, a random checkpoint fills the
    canvas with whitespace or string content."""
    rng = random.Random(12)
    prompts = [{"prompt_token_ids": random_prompt(rng, rng.randint(3, 9), 97, 123)} for _ in range(3)]
    for arguments in (TEXT_ARGUMENT, True):
        for gen in (96, 128):
            params = SamplingParams(max_tokens=gen, temperature=0.0, structured_outputs=StructuredOutputsParams(
                structural_tag=tool_call_tag(arguments)))
            for out in llada.generate(prompts, params, use_tqdm=False):
                text = out.outputs[0].text
                assert "</tool_call>" in text, text
                call = TOOL_CALL.fullmatch(text[:text.index("</tool_call>") + len("</tool_call>")])
                assert call is not None, text
                value = json.loads(call.group(1))
                assert arguments is True or isinstance(value["text"], str), text
                assert not re.search(r"\s\s", re.sub(r'"(\\.|[^"\\])*"', '""', call.group(1))), text


@pytest.fixture(scope="module")
def dream(tiny_dirs):
    yield from structured_engine(tiny_dirs("dream"))


DREAM_MODES = [
    {"steps": 32},
    {"steps": 16, "alg": "entropy", "top_k": 20, "top_p": 0.9},
    {"steps": 8, "block_length": 16, "cache": "dual", "alg": "maskgit_plus", "decoding": "threshold", "threshold": 0.5},
]


def test_dream_outputs_parse_in_every_mode(dream):
    check_all_parse(dream, DREAM_MODES, [0.0, 0.5], random.Random(4))


def test_a_canvas_too_short_ends_with_length_and_the_valid_prefix(llada):
    out = llada.generate(
        [{"prompt_token_ids": [5, 6, 7]}],
        request_params("json", SCHEMA, max_tokens=8, temperature=0.0, extra_args={"steps": 8, "block_length": 8}),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert out.text.startswith('{"') and not parses("json", SCHEMA, out.text)


@pytest.fixture(scope="module")
def llada2(tiny_dirs):
    yield from structured_engine(tiny_dirs("llada2"))


LLADA2_MODES = [
    {"block_length": 8, "steps": 8},  # LLaDA2.0's threshold rule
    {"block_length": 8, "mode": "quality"},  # LLaDA2.1: token editing, nothing forced
    {"block_length": 8, "mode": "speed"},
    {"block_length": 8, "steps": 4, "decoding": "threshold", "threshold": 0.5},
]


def test_llada2_outputs_parse_in_every_mode(llada2):
    """Block-causal blocks aligned to the whole sequence (a prompt's partial last
    block shortens the first canvas block), and token editing, which may rewrite
    committed tokens until their block ends."""
    check_all_parse(llada2, LLADA2_MODES, [0.0, 0.7], random.Random(8))


@pytest.mark.parametrize("backend, grammars", [
    # Guidance's matcher stops as soon as its grammar cannot continue and then
    # validates nothing, not even the end of text its mask asks for.
    ("guidance", [("regex", REGEX), ("choice", CHOICES), ("json", SCHEMA)]),
    ("outlines", [("regex", REGEX), ("choice", CHOICES)]),  # no whitespace-free JSON there
])
def test_other_grammar_backends_are_enforced(tiny_dirs, backend, grammars):
    config = {"backend": backend}  # guidance's JSON is compact by default too
    llm = make_engine(tiny_dirs("llada"), structured_outputs_config=config)
    try:
        rng = random.Random(6)
        requests = [(kind, spec, mode) for kind, spec in grammars for mode in LLADA_MODES[:2]]
        outs = llm.generate(
            [{"prompt_token_ids": random_prompt(rng, 6, 97, 123)} for _ in requests],
            [request_params(kind, spec, max_tokens=32, temperature=0.0, extra_args=dict(mode))
             for kind, spec, mode in requests],
            use_tqdm=False,
        )
        for (kind, spec, _), out in zip(requests, outs):
            assert parses(kind, spec, out.outputs[0].text) and out.outputs[0].finish_reason == "stop", (
                backend, kind, out.outputs[0].text)
    finally:
        close_engine(llm)


def test_logprobs_of_forced_tokens_are_certain(llada, grammar_kit):
    """A forced token is the only one its constrained distribution allows: logprob 0,
    rank 1; the tokens the model chose keep their own logprobs."""
    tok = grammar_kit["tok"]
    out = llada.generate(
        [{"prompt_token_ids": [100, 101, 102, 103]}],
        request_params("regex", "ID-[0-9]{3}", max_tokens=16, temperature=0.0, logprobs=2,
                       extra_args={"steps": 16, "block_length": 8}),
        use_tqdm=False,
    )[0].outputs[0]
    assert re.fullmatch("ID-[0-9]{3}", out.text)
    tokens = list(out.token_ids)
    assert len(out.logprobs) == len(tokens)
    forced = len(tok.encode("ID-", add_special_tokens=False))
    for token, entry in zip(tokens[:forced], out.logprobs[:forced]):
        assert entry[token].logprob == 0.0 and entry[token].rank == 1
        assert len(entry) == 2 and sorted(e.logprob for e in entry.values()) == [float("-inf"), 0.0]
    digits = [(t, e) for t, e in zip(tokens[forced:], out.logprobs[forced:]) if tok.decode([t]).isdigit()]
    assert digits and all(e[t].logprob <= 0.0 and e[t].rank >= 1 for t, e in digits)
