"""The scheduler's structured outputs: vLLM's grammars over diffusion canvases, step
by step (what is decided per grammar: scheduler/grammar.py and completion.py).

Before a step, `plan` sends the engine each scheduled constrained request's forced
tokens and frontier mask, and where the last step's tokens broke a grammar; after
it, `validate` cuts each request's new tokens to what its grammar accepts and can
still complete in the canvas, before vLLM streams and accepts them.
"""

from __future__ import annotations

from vllm.v1.request import Request

from vllm_dllm.serving.compat import output_rows
from vllm_dllm.engine.constraints import GrammarStep
from vllm_dllm.scheduler.completion import Alphabet, alphabet_of, need
from vllm_dllm.scheduler.grammar import (
    Frontier,
    canvas_block,
    canvas_blocks,
    ends_request,
    jump_tokens,
    plan_frontiers,
    rolls_back_deeply,
    stop_allowed_after,
)
from vllm_dllm.scheduler.track import RequestTrack


class StructuredOutputs:
    """What the scheduler keeps for constrained requests between steps."""

    def __init__(self, manager, max_rows: int):
        self.manager = manager  # vLLM's StructuredOutputManager: its tokenizer and bitmask allocator
        self.max_rows = max_rows
        self._returned: dict[str, int] = {}  # request -> first position back to the mask, sent with the next step
        self._bitmask = None
        self._forced = 0  # tokens forced this step (the step's stats)
        self._alphabet: Alphabet | None = None  # completion tokens (completion.py)

    def take_forced(self) -> int:
        forced, self._forced = self._forced, 0
        return forced

    def plan(self, scheduled: list[Request], tracks: dict[str, RequestTrack]) -> GrammarStep | None:
        """Forced tokens and frontier masks of the step's constrained requests, and
        the returns to the mask the last step's validation decided."""
        frontiers = []
        for request in scheduled:
            if not request.use_structured_output:
                continue
            track = tracks[request.request_id]
            options = track.options
            start = request.num_output_tokens
            first, length = canvas_blocks(options)
            end = min(first + (canvas_block(options, start) + 1) * length, options.output_length)
            # Token editing may rewrite a forced token (only the frontier is masked),
            # so a request that edits forces nothing.
            editing = getattr(options, "editing_threshold", None) is not None
            room = 0 if editing else max(end - start, 0)
            grammar = request.structured_output_request.grammar
            stop_ids = frozenset(request.sampling_params.all_stop_token_ids)
            left = options.output_length - start
            alphabet = None if editing or not rolls_back_deeply(grammar) else self._completion_alphabet(stop_ids)
            if alphabet is not None and self._prefix_need(request, track, left, alphabet) is None:
                alphabet = None  # the canvas is too short for any document: nothing to force
            frontiers.append(Frontier(request.request_id, grammar, room, stop_ids,
                                      jump_tokens(grammar, self.manager.tokenizer),
                                      left=left, alphabet=alphabet, need=track.grammar_need, close_now=track.grammar_close))
        if not frontiers and not self._returned:
            return None
        step = plan_frontiers(frontiers, self._bitmask_rows(len(frontiers))) if frontiers else GrammarStep()
        step.returned, self._returned = self._returned, {}
        self._forced = sum(len(tokens) for tokens in step.forced.values())
        return step

    def _completion_alphabet(self, stop_ids) -> Alphabet:
        if self._alphabet is None:
            self._alphabet = alphabet_of(self.manager.tokenizer)
        return self._alphabet.with_stops(stop_ids)

    def _completing_prefix(self, request: Request, track: RequestTrack | None, valid: list[int]) -> list[int]:
        """The longest prefix of a step's accepted tokens whose document can still
        complete in the canvas's positions after it (all of them, as a rule: the
        prefix before the step could), and what its grammar then needs.  A request
        that edits tokens, or whose canvas is too short for any document, keeps them."""
        grammar, req_id = request.structured_output_request.grammar, request.request_id
        if (track is None or track.grammar_short or getattr(track.options, "editing_threshold", None) is not None
                or not rolls_back_deeply(grammar)):
            return valid
        alphabet = self._completion_alphabet(request.sampling_params.all_stop_token_ids)
        left = track.options.output_length - request.num_output_tokens
        for keep in range(len(valid), 0, -1):
            if not grammar.accept_tokens(req_id, valid[:keep]):
                continue
            needed = need(grammar, req_id, alphabet, left - keep, self._bitmask_rows(1),
                          jump_tokens(grammar, self.manager.tokenizer))
            grammar.rollback(keep)
            if needed is not None:
                track.grammar_need = needed
                # Cut short: the model would choose the same tokens again, so the
                # document is completed from here.
                track.grammar_close = keep < len(valid)
                return valid[:keep]
        if track.grammar_need is None:
            track.grammar_short = True  # not even the prefix before the step could complete
            return valid
        track.grammar_close = True
        return []  # the prefix before the step completes in time (its need is kept)

    def _prefix_need(self, request: Request, track: RequestTrack, left: int, alphabet: Alphabet) -> int | None:
        """What a constrained request's grammar needs from its accepted prefix, worked
        out once when unknown; a canvas too short for any document is noted."""
        if track.grammar_need is None and not track.grammar_short:
            grammar = request.structured_output_request.grammar
            track.grammar_need = need(grammar, request.request_id, alphabet, left, self._bitmask_rows(1),
                                      jump_tokens(grammar, self.manager.tokenizer))
            track.grammar_short = track.grammar_need is None
        return track.grammar_need

    def _bitmask_rows(self, rows: int):
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            backend = self.manager.backend
            self._bitmask = backend.allocate_token_bitmask(max(rows, self.max_rows))
        return self._bitmask

    def validate(self, model_runner_output, requests: dict[str, Request], tracks: dict[str, RequestTrack]) -> int:
        """Cut each constrained request's new tokens to the prefix its grammar
        accepts (vLLM then streams and accepts only those), and note where the rest
        goes back to the mask.  Returns the tokens cut."""
        cut = 0
        for req_id, index in output_rows(model_runner_output).items():
            request = requests.get(req_id)
            if request is None or not request.use_structured_output:
                continue
            new = model_runner_output.sampled_token_ids[index]
            if not new or request.structured_output_request.grammar.is_terminated():
                continue
            # The grammar's own check: the manager's wrapper became a speculative-decoding
            # trim in vLLM 0.34 (it keeps one token past the valid prefix).
            valid = request.structured_output_request.grammar.validate_tokens(list(new))
            params = request.sampling_params
            stop_ids = frozenset(params.all_stop_token_ids)
            ends_early = False
            if len(valid) < len(new):
                rejected = new[len(valid)]
                if rejected in stop_ids and not ends_request(valid, stop_ids):
                    if stop_allowed_after(request.structured_output_request.grammar, req_id, valid, rejected,
                                          self._bitmask_rows(1)):
                        valid = [*valid, rejected]
                    else:
                        ends_early = not params.ignore_eos
            if ends_request(valid, stop_ids) and not params.ignore_eos:
                model_runner_output.sampled_token_ids[index] = valid
                continue
            track = tracks.get(req_id)
            valid = self._completing_prefix(request, track, valid)
            if ends_early and track is not None:
                # The model ends its answer where the document is still open: it is
                # completed from there, not decoded again until the model gives in.
                track.grammar_close = True
            if len(valid) == len(new):
                continue
            model_runner_output.sampled_token_ids[index] = valid
            self._returned[req_id] = request.num_output_tokens + len(valid)
            cut += len(new) - len(valid)
        return cut

    def restart_returned_blocks(self, tracks: dict[str, RequestTrack]) -> None:
        """A request whose tokens went back to the mask restarts the block holding
        the first of them (as the engine does: engine/constraints.py)."""
        for req_id, start in self._returned.items():
            track = tracks.get(req_id)
            if track is not None:
                track.block, track.block_step = canvas_block(track.options, start), 0
