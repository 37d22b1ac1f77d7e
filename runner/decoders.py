"""Decoders: the model-side state of one request, and how it advances by one round.

A ``Decoder`` owns the target's KV cache for one request, what that cache
holds, and the ``pending`` token: the last token chosen, which the target has
not seen yet (unless the plain decoder has already fed it, see below). Two
implementations of ``step``, after Ollama's x/mlxrunner:

- ``PlainDecoder``: one token a round, pipelined as mlx-lm's ``generate_step``
  is: the forward pass for the token after next is queued (``mx.async_eval``)
  before the host reads the next token, so the host's work on a token (text,
  stop strings, the gRPC send) overlaps the device's work on the following one.
- ``SpeculativeDecoder``: a ``Drafter`` proposes up to k tokens (k from the
  depth controller, or pinned), the target verifies them in one forward pass,
  the accepted prefix plus one target token is emitted, and the caches are
  rewound past the rejected part (``runner.rewind``: trimmed, or restored and
  fed again for recurrent layers). A drafted round is not pipelined as a plain
  one is (the next pass's place in the cache depends on the verdict), but its
  drafter queues the next round's first draft, for every outcome at once, on
  the verification before the host reads it (``Drafter.queue_next``): the
  device runs it while the host reads the verdict, takes the round's tokens
  and builds the next verification.

Both prefill the prompt (from wherever a prompt-cache hit left the caches) in
chunks a ``PrefillPlanner`` sizes, and report the state they end in for the
prompt cache.

A request under a grammar (``runner.constraint``) takes ``_constrained_round``
instead, in both decoders: the tokens the grammar forces go into the forward
pass as certain drafts (no drafter, no verification); otherwise the drafter's
proposal (if any) is walked through the grammar and cut after its first
forbidden token (which the target then rejects, as it would); every verified
row is masked, the grammar takes back the rejected drafts. A position's mask
needs the token before it on the host, so the token a round chooses cannot be
queued with the pass after it as plain decoding queues it; but the pass that
feeds it can be queued before the host reads it (``_pass``): the device runs
that pass while the host reads the token, hands it to the grammar and works out
the next mask, and the next round chooses from the queued pass's row. Tokens
forced after a queued one need a pass of their own, where unqueued they go into
the pass of the token before them, so rounds queue only inside long free runs
(``_queues_pass``).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .constraint import Constraint, apply_masks
from .drafting.depth import DepthController, FixedDepth
from .drafting.drafters import ModelDrafter, Proposal
from .penalties import Penalties
from .prefill import PrefillPlanner
from .rewind import Rewinder
from .sampling import SamplingParams, filtered_probs, point_mass, sample, verify_greedy, verify_sampled

QUEUE_CONSTRAINED_PASSES = True  # constrained rounds queue their token's pass before reading it (bench/structured.py)
# ... from this many free tokens into a run without forced ones, or where this request's runs are that long (see
# ``Decoder._queues_pass``).
LONG_RUN = 8
# Where a prompt-cache entry keeps a drafter layer's own cache (runner.drafting.mtp's, runner.drafting.head's), after
# the target's (index 0) and the draft model's (1, empty when there is none): one place per kind, so a request
# drafting with one never takes the other's.
LAYER_SLOTS = {"mtp": 2, "head": 3}


@dataclass
class Step:
    tokens: list[int]  # what the round chose, in order (the caller may emit fewer: stop conditions)
    drafted: int = 0
    accepted: int = 0
    logits: mx.array | None = None  # row i chose tokens[i] (the target's raw logits)
    forced: int = 0  # tokens a grammar forced ahead of the chosen one (certain: no drafter, not in ``drafted``)


@dataclass
class DecoderStats:
    depths: collections.Counter = field(default_factory=collections.Counter)  # drafted per round -> rounds


class Decoder:
    def __init__(self, model, prompt_ids: list[int], params: SamplingParams, key, cache=None, held: int = 0):
        self.model = model
        self.params = params
        self.key = key
        self.prompt_ids = prompt_ids
        self.tokens = list(prompt_ids)  # the prompt, then every token a round chose
        self.cache = cache if cache is not None else make_prompt_cache(model)
        self.held = held  # tokens the target's cache holds
        self.pending = prompt_ids[-1]
        self.stats = DecoderStats()
        self._queued: tuple[mx.array, mx.array] | None = None  # (token, logits) a pipelined round queued
        self._pass: mx.array | None = None  # the logits of a queued pass of ``pending`` (a constrained round's)
        self._free_run = 0  # tokens chosen since the grammar last forced any (constrained rounds)
        self._typical_run = 0.0  # this request's free runs' length, decayed (constrained rounds)
        self.constraint: Constraint | None = None  # the request's grammar (set by the engine)
        self.stop_ids: frozenset[int] = frozenset()  # tokens that end the request: never forced ahead
        self.bias: mx.array | None = None  # added to every row the request chooses from (logit_bias)
        self.penalties: Penalties | None = None  # presence, frequency and repetition penalties (runner.penalties)
        self.group = None  # a runner.group.Group: rank 0's depth choices are every rank's (set by the engine)
        self.kv = None  # a runner.kv_quant.KVQuantization: the target's cache is quantized once due (set by the engine)
        # score(logits, tokens): the prompt's positions as the target prefills them (prompt logprobs), or None
        self.score_prompt = None
        # An image request (runner.vision): (Vision, VisionInput). Its prompt_ids are the prompt cache's keys
        # (each image's tokens an id of its digest); the target is fed the real ids, and embeddings where images are.
        self.seen = None
        self._embedded: tuple | None = None  # (embeddings, deepstack features or None): runner.vision

    # -- prefill --------------------------------------------------------------------------------------

    def _prefill_models(self):
        """(model, cache, held, advance) for every model that reads the prompt."""
        yield self.model, self.cache, self.held, self._advance_target

    def _advance_target(self, held: int) -> None:
        self.held = held

    def prefill_parts(self) -> list[tuple]:
        """What each model still lacks of the prompt (all but its last token), for a prefill shared with other
        requests (``runner.batch.prefill_jointly``): (model, cache, tokens, done), ``done()`` once they are in."""
        context = self.prompt_ids[:-1]
        return [
            (model, cache, context[held:], lambda advance=advance: advance(len(context)))
            for model, cache, held, advance in self._prefill_models()
            if held < len(context)
        ]

    def _forward_prompt(self, model, cache, context: list[int], start: int, end: int) -> mx.array:
        """The prompt's tokens ``start:end`` through ``model``: an image request's as their embeddings while a
        part holds images (computed once, mlx-vlm's vision tower and projector), else as ids."""
        if self.seen is None:
            return model(mx.array(context[start:end])[None], cache=cache)
        vision, seen = self.seen
        inputs = mx.array(seen.real_ids[start:end])[None]
        if model is not self.model or start > seen.last_image:
            return model(inputs, cache=cache)  # a draft model (it does not see: the image tokens as text), or text
        if self._embedded is None:
            self._embedded = vision.embeddings(seen)
        embedded, deepstack = self._embedded
        # M-RoPE (runner.mrope): a part that holds image tokens takes their positions, and Qwen3-VL's deepstack
        # features (the model is then a PositionedModel); the text after the last image is at its index plus the
        # request's delta.
        extra = {} if seen.positions is None else {"positions": seen.positions[:, start:end]}
        if deepstack is not None:
            extra["deepstack"] = deepstack[:, start:end]
        return model(inputs, cache=cache, input_embeddings=embedded[:, start:end], **extra)

    def prefill_step(self, planner: PrefillPlanner, sizes: list | None = None) -> bool:
        """Run one planned chunk of the prompt (all but its last token) through the models, each from
        where its cache already is; True once the whole prompt is in."""
        context = self.prompt_ids[:-1]
        offset = min(held for _, _, held, _ in self._prefill_models())
        if offset >= len(context):
            return True
        size = planner.next_chunk(offset, len(context) - offset)
        started = time.perf_counter()
        for model, cache, held, advance in list(self._prefill_models()):
            if held < offset + size:
                start = max(held, offset)
                logits = self._forward_prompt(model, cache, context, start, offset + size)
                mx.eval([c.state for c in cache])
                if self.score_prompt is not None and model is self.model:
                    # Row j scores the token after position start + j (the last row: the next chunk's first).
                    self.score_prompt(logits[0], self.prompt_ids[start + 1 : offset + size + 1])
                advance(offset + size)
        self.quantize_due()
        mx.clear_cache()
        planner.record(offset, size, time.perf_counter() - started)
        if sizes is not None:
            sizes.append(size)
        if offset + size >= len(context):
            self._embedded = None  # the images are in the cache now
        return offset + size >= len(context)

    def _choose_depth(self) -> int:
        """The adaptive controller's depth for the next round; in a group, rank 0's (it times rounds)."""
        depth = self.depth.choose()
        return depth if self.group is None else self.group.share_int(depth)

    def quantize_due(self) -> None:
        """Quantize the target's cache in place once it holds more than ``kv.start`` tokens (``kv_bits``)."""
        if self.kv is not None:
            self.kv.apply(self.cache)

    # -- rounds ---------------------------------------------------------------------------------------

    def _keys(self, n: int):
        self.key, *keys = mx.random.split(self.key, n + 1)
        return keys

    def set_logit_bias(self, pairs, vocab: int) -> None:
        """OpenAI's logit_bias: ``pairs`` of (token id, value) added to those tokens' logits before any choice."""
        if pairs:
            tokens, values = zip(*pairs)
            self.bias = mx.zeros(vocab).at[mx.array(tokens)].add(mx.array(values))

    def process(self, logits: mx.array, before=None) -> mx.array:
        """The rows a choice is made from: the raw logits plus the request's bias, penalised (the raw ones feed
        logprobs). ``before``: the tokens fed ahead of each row in this round (``Penalties.apply``)."""
        rows = logits if self.bias is None else logits + self.bias.astype(logits.dtype)
        return rows if self.penalties is None else self.penalties.apply(rows, before)

    @property
    def plain_choice(self) -> bool:
        """Greedy on the raw logits: a batch may take the argmax of its rows at once."""
        return self.params.greedy and self.bias is None and self.constraint is None and self.penalties is None

    def _count(self, tokens) -> None:
        """The answer grew by ``tokens`` (a list, or a token still on the device): the penalties count them."""
        if self.penalties is not None:
            self.penalties.count(tokens)

    def choose(self, logits: mx.array, key) -> mx.array:
        """The token after raw ``logits`` (the bias added here)."""
        return self._pick(self.process(logits), key)

    def _pick(self, rows: mx.array, key) -> mx.array:
        if self.params.greedy:
            return mx.argmax(rows, axis=-1)
        return sample(filtered_probs(rows, self.params), key)

    def choose_next(self, logits: mx.array) -> mx.array:
        """The token after ``logits`` (lazy), drawing this request's next random key when it samples:
        one key per token, alone or in a batch; under a grammar, among the tokens it allows here."""
        if self.constraint is not None:
            logits = apply_masks(logits[None], [self.constraint.mask()])[0]
        chosen = self.choose(logits, None if self.params.greedy else self._keys(1)[0])
        self._count(chosen)
        return chosen

    def _queue(self, token) -> tuple[mx.array, mx.array]:
        """Queue the forward pass of ``token`` (an int, or a lazy array still on the device) and the
        choice after it: (chosen, logits), evaluated asynchronously."""
        inputs = mx.array([token], dtype=mx.uint32) if isinstance(token, int) else token.reshape(1)
        logits = self.model(inputs[None], cache=self.cache)[0, -1]
        chosen = self.choose_next(logits)
        mx.async_eval(chosen)
        return chosen, logits

    def _take(self, tokens: list[int]) -> None:
        """``pending`` was fed and a round chose ``tokens``: the last one is pending now."""
        self.tokens += tokens
        self.pending = tokens[-1]
        self.held = len(self.tokens) - 1
        if self.constraint is not None and self.constraint.spent:  # a reasoning phase with no grammar after it
            self.constraint = None

    @property
    def drafter_name(self) -> str:
        """What proposes its drafts: "none" for a plain decoder."""
        return "none"

    def step(self, budget: int) -> Step:
        """One round: never more than ``budget`` tokens."""
        raise NotImplementedError

    def _pipelined_step(self, budget: int) -> Step:
        """One plain token: read the token a pass queued (queue it first if none is), after queueing the
        pass that feeds it - built from the device's token, not the host's, so the device never waits on
        the host's work on a token."""
        if self._queued is None:
            self._queued = self._queue(self.pending)
        token, logits = self._queued
        self._queued = self._queue(token) if budget > 1 else None
        tokens = [token.item()]
        self._take(tokens)
        if self._queued is not None:  # the queued pass has fed it already
            self.held = len(self.tokens)
        return Step(tokens, 0, 0, logits[None])

    def cached_state(self) -> tuple[list[int], list]:
        """What the caches hold, for the prompt cache (the request is over)."""
        return self.tokens[: self.held], [self.cache]

    def close(self) -> None:
        self.cache = None
        self._pass = None

    def _unqueue_pass(self) -> None:
        """A pass a constrained round queued while the request has no grammar any more (a reasoning phase that
        ended with nothing after it): the unconstrained choice after it, as a plain round queues it."""
        if self._pass is not None and self.constraint is None:
            logits, self._pass = self._pass, None
            chosen = self.choose_next(logits)
            mx.async_eval(chosen)
            self._queued = (chosen, logits)

    # -- batching (runner.batch) ----------------------------------------------------------------------

    def settle(self, budget: int = 1) -> Step | None:
        """Read a token a pipelined round has queued, so the cache holds exactly all but ``pending``; a
        constrained round's queued pass: the round that chooses from it (at most ``budget`` tokens)."""
        self._unqueue_pass()
        if self._pass is not None:
            return self._constrained_round(budget, 0, pipeline=False)
        if self._queued is None:
            return None
        tokens, logits = self._read_queued()
        self.stats.depths[0] += 1
        return Step(tokens, 0, 0, logits)

    def _read_queued(self) -> tuple[list[int], mx.array]:
        """Read the token a pipelined round queued and take it: ([token], its logits row (1, vocab))."""
        token, logits = self._queued
        self._queued = None
        tokens = [token.item()]
        self._take(tokens)
        return tokens, logits[None]

    def hand_over(self) -> list:
        """The target's cache, to be merged into a batch (after ``settle``)."""
        cache, self.cache = self.cache, None
        return cache

    def take_back(self, cache: list) -> None:
        """Its own cache again, extracted from a batch: it holds every token but ``pending``."""
        self.cache = cache
        self.held = len(self.tokens) - 1

    def fed_by_batch(self, tokens: list[int]) -> None:
        """A batched step fed ``pending`` and chose ``tokens``."""
        if self.constraint is not None:
            for token in tokens:
                self.constraint.consume(token)
        self._take(tokens)

    # -- under a grammar (runner.constraint) ----------------------------------------------------------

    def _propose(self, k: int, key) -> Proposal | None:
        """A drafter's proposal for a constrained round (none for a plain decoder)."""
        return None

    def _rewind(self, fed: list[int], keep: int) -> None:
        """The target saw ``fed`` in a constrained round and keeps the first ``keep`` of it."""
        if keep != len(fed):
            raise AssertionError("a plain decoder never has drafts to take back")

    def _constrained_round(self, budget: int, k: int, pipeline: bool | None = None) -> Step:
        """One round under the grammar: forced tokens, or up to ``k`` drafts walked through it, verified on
        masked rows; never more than ``budget`` tokens. A pass of ``pending`` the last round queued gives its
        first row. ``pipeline``: a round with neither forced tokens nor drafts queues the pass of its token
        before reading it (see the module's docstring)."""
        constraint = self.constraint
        queued, self._pass = self._pass, None
        forced, mask = constraint.forced(budget - 1, self.stop_ids)
        drafts, masks, proposal = [], [mask], None
        consumed = []  # per draft: whether the matcher took it (an end token after the grammar's end is a no-op)
        draft_key, verify_key = (None, None) if self.params.greedy else self._keys(2)
        if not forced and k > 0 and budget > 1:
            proposal = self._propose(min(k, budget - 1), draft_key)
            for token in proposal.tokens.tolist() if proposal is not None else []:
                drafts.append(token)
                if not constraint.allows(masks[-1], token):
                    consumed.append(False)
                    break  # the target will reject it: its row's mask allows it nothing
                ended = constraint.finished
                if not ended:
                    constraint.consume(token)
                consumed.append(not ended)
                masks.append(constraint.mask())
                if ended:
                    break  # nothing follows the grammar's end
        fed = ([] if queued is not None else [self.pending]) + forced + drafts
        if drafts:
            self._snapshot()
        logits = self.model(mx.array(fed, dtype=mx.uint32)[None], cache=self.cache)[0] if fed else None
        if queued is not None:  # row 0: after pending, from the queued pass
            logits = queued[None] if logits is None else mx.concatenate([queued[None], logits])
        self._count(forced)
        # Rows len(forced).. verify the drafts; a row after a forbidden draft is never reached (no mask).
        rows = self.process(logits[len(forced) :], before=drafts)
        rows = apply_masks(rows, masks + [None] * (len(drafts) + 1 - len(masks)))
        if not drafts:
            verdict_accepted, next_token = 0, self._pick(rows[0], verify_key)
            mx.async_eval(next_token)
            if pipeline is None:
                pipeline = self._queues_pass(forced)
            if pipeline and not forced and budget > 1:  # the pass of next_token, queued before it is read
                self._pass = self.model(next_token.reshape(1, 1).astype(mx.uint32), cache=self.cache)[0, -1]
                mx.async_eval(self._pass)
        else:
            if self.params.greedy:
                verdict = verify_greedy(rows, mx.array(drafts, dtype=mx.uint32))
            else:
                p = filtered_probs(rows, self.params)
                proposed = mx.array(drafts, dtype=mx.uint32)
                q = proposal.probs[: len(drafts)] if proposal.probs is not None else point_mass(proposed, p.shape[-1])
                verdict = verify_sampled(p, q, proposed, verify_key)
            mx.eval(verdict.accepted, verdict.next_token)
            verdict_accepted, next_token = verdict.accepted.item(), verdict.next_token
        token = next_token.item()
        constraint.rollback(sum(consumed[verdict_accepted:]))
        if not constraint.finished:
            constraint.consume(token)
        tokens = forced + drafts[:verdict_accepted] + [token]
        self._count(tokens[len(forced) :])
        if drafts:
            self._rewind(fed, len(fed) - len(drafts) + verdict_accepted)
            self._drafts_kept(proposal, verdict_accepted)
        self._take(tokens)
        if self._pass is not None:  # the queued pass feeds the new pending token
            self.held = len(self.tokens)
        return Step(tokens, len(drafts), verdict_accepted, logits, len(forced))

    def _queues_pass(self, forced: list[int]) -> bool:
        """Whether a constrained round that chose its token after ``forced`` queues that token's pass. A queued pass
        saves the host's share of a round (~12% on a 2-core CPU: building the pass while the last one runs), but
        when the grammar then forces tokens, they take a pass of their own (unqueued, they ride on the pass of the
        token before them): a whole pass lost at the end of each free run. So only inside long free runs (strings,
        free text): this run has gone on for ``LONG_RUN`` tokens, or this request's runs are that long."""
        if forced:
            if self._free_run:
                self._typical_run = 0.5 * (self._typical_run + self._free_run)
            self._free_run = 0
            return False
        self._free_run += 1
        return QUEUE_CONSTRAINED_PASSES and max(self._free_run, self._typical_run) >= LONG_RUN

    def _snapshot(self) -> None:
        pass

    def _drafts_kept(self, proposal: Proposal, accepted: int) -> None:
        pass


class PlainDecoder(Decoder):
    """One token a round, the next forward pass queued before the host reads this one (under a grammar: the
    tokens it forces and one more)."""

    def step(self, budget: int) -> Step:
        if self.constraint is not None:
            step = self._constrained_round(budget, 0)
            self.stats.depths[step.drafted] += 1
            return step
        self._unqueue_pass()
        self.stats.depths[0] += 1
        return self._pipelined_step(budget)


class SpeculativeDecoder(Decoder):
    """Draft, verify in one forward pass, keep the accepted prefix plus one target token, rewind.

    A round of depth 0 is ``PlainDecoder``'s step: the pass after its token is
    queued from the device's token before the host reads it; so is every round
    while the drafter is not ready (``Drafter.ready``: for the n-gram lookup,
    the context's end never occurred before). A round that wanted to draft but
    got no proposal is a plain round too, but it has read its token first (the
    lookup needed it), so its next pass is queued after the read. Either way
    the next round starts by reading the queued token (``_queued``) - then
    drafts on top of it, or queues the next one.
    """

    def __init__(
        self, model, prompt_ids, params, key, drafter, depth: DepthController | FixedDepth, cache=None, held: int = 0
    ):
        super().__init__(model, prompt_ids, params, key, cache, held)
        self.drafter = drafter
        self.depth = depth
        self.rewinder = Rewinder(model, self.cache)
        self._last_end: float | None = None

    @property
    def drafter_name(self) -> str:
        return self.drafter.name

    def _prefill_models(self):
        yield from super()._prefill_models()
        if isinstance(self.drafter, ModelDrafter):
            drafter = self.drafter

            def advance(held: int) -> None:
                drafter.held = held

            yield drafter.model, drafter.cache, drafter.held, advance

    def _issue(self) -> tuple[mx.array, mx.array]:
        """Queue the forward pass of ``pending`` and the choice after it (the cache then holds pending)."""
        queued = self._queue(self.pending)
        self.held = len(self.tokens)
        return queued

    def _take(self, tokens: list[int]) -> None:
        super()._take(tokens)
        self.drafter.extend(tokens)

    def close(self) -> None:
        self.depth.finish()  # what this request kept informs the next request's starting depth
        super().close()

    def take_back(self, cache: list) -> None:
        super().take_back(cache)
        self.rewinder = Rewinder(self.model, self.cache)
        self._last_end = None  # its last solo round ended before the batch: the next one is not timed

    def _propose(self, k: int, key) -> Proposal | None:
        """The drafter's proposal, at most ``k`` tokens (a caller asks only when ``drafter.ready()``)."""
        proposal = self.drafter.propose(self.tokens, k, self.params, key)
        if proposal is not None and proposal.size > k:
            proposal = Proposal(proposal.tokens[:k], None if proposal.probs is None else proposal.probs[:k])
        return proposal

    def _snapshot(self) -> None:
        self.rewinder.snapshot()

    def _rewind(self, fed: list[int], keep: int) -> None:
        self.rewinder.rewind(fed, keep)

    def _drafts_kept(self, proposal: Proposal, accepted: int) -> None:
        if proposal is not None:
            self.drafter.accepted(proposal, accepted)

    def step(self, budget: int) -> Step:
        if self.constraint is not None:
            return self._constrained_step(budget)
        self._unqueue_pass()
        # A request's first round is not timed (None): it carries one-off costs, such as the cache's first
        # growth past the prompt.
        started = self._last_end
        # While the drafter would likely have nothing (the n-gram lookup finds no earlier occurrence of the
        # context's end), plain rounds keep the pipeline going; the depth controller is asked only when a
        # round could draft.
        wanted = self._choose_depth() if self.drafter.ready() else 0
        k = 0
        if wanted == 0:  # a plain round, pipelined
            step = self._pipelined_step(budget)
        else:
            head, rows = [], []
            if self._queued is not None:  # the token a plain round queued
                head, row = self._read_queued()
                rows = [row]
                budget -= 1
            k = max(0, min(wanted, budget - 1))  # none when the token read was the last the budget allows
            step = self._round(budget, k, head, rows) if budget > 0 else Step(head, 0, 0, rows[0])
        # A round whose drafter had nothing to offer counts, for the controller, as one at depth k whose first
        # draft was not kept: depth k's acceptance and time include its rounds without a proposal, and depth
        # 0's time stays that of pipelined plain rounds.
        self._last_end = time.perf_counter()
        self.depth.record(step.drafted or k, step.accepted, None if started is None else self._last_end - started)
        self.stats.depths[step.drafted] += 1
        return step

    def _constrained_step(self, budget: int) -> Step:
        """A round under the grammar; the depth controller learns only from rounds its drafter proposed (forced
        tokens are certain: they say nothing of the drafter)."""
        started = self._last_end
        k = self._choose_depth() if self.drafter.ready() else 0
        step = self._constrained_round(budget, k)
        self._last_end = time.perf_counter()
        if not step.forced:
            self.depth.record(step.drafted or k, step.accepted, None if started is None else self._last_end - started)
        self.stats.depths[step.drafted] += 1
        return step

    def _round(self, budget: int, k: int, head: list[int], rows: list) -> Step:
        """Draft up to ``k`` tokens on top of ``head`` (a token a plain round queued, now read) and verify
        them; with nothing to verify, a plain round."""
        # A greedy request draws no keys: never evaluated, they would grow a chain of lazy splits every round.
        draft_key, verify_key = (None, None) if self.params.greedy else self._keys(2)
        proposal = self._propose(k, draft_key) if k > 0 else None
        if proposal is None:
            if not head:  # start the pipeline: this round's token, then queue the next one
                token, logits = self._issue()
                head, rows = [token.item()], [logits[None]]
                self._take(head)
                budget -= 1
            if budget > 0:
                self._queued = self._issue()
            return Step(head, 0, 0, mx.concatenate(rows))
        drafted = proposal.size
        fed = [self.pending]
        self.rewinder.snapshot()
        logits = self.model(mx.concatenate([mx.array(fed, dtype=mx.uint32), proposal.tokens])[None], cache=self.cache)[
            0
        ]
        processed = self.process(logits, before=proposal.tokens)
        if self.params.greedy:
            verdict = verify_greedy(processed, proposal.tokens)
        else:
            p = filtered_probs(processed, self.params)
            q = proposal.probs if proposal.probs is not None else point_mass(proposal.tokens, p.shape[-1])
            verdict = verify_sampled(p, q, proposal.tokens, verify_key)
        # The device starts the verification while the host has the drafter queue the next round's first draft
        # on it, for every outcome (``Drafter.queue_next``): that draft then runs while the host reads this round.
        mx.async_eval(verdict.accepted, verdict.next_token)
        next_key = None if self.params.greedy else self._keys(1)[0]
        self.drafter.queue_next(self.tokens, proposal.tokens, verdict, self.params, next_key)
        mx.eval(verdict.accepted, verdict.next_token)
        accepted = verdict.accepted.item()
        drafts = proposal.tokens.tolist()
        tokens = drafts[:accepted] + [verdict.next_token.item()]
        self._count(tokens)
        # The target saw pending + every draft; it keeps pending + the accepted drafts.
        self.rewinder.rewind(fed + drafts, 1 + accepted)
        self.drafter.accepted(proposal, accepted)
        self._take(tokens)
        return Step(head + tokens, drafted, accepted, mx.concatenate(rows + [logits]))

    def cached_state(self) -> tuple[list[int], list]:
        held = self.held
        caches = [self.cache]
        if isinstance(self.drafter, ModelDrafter):
            drafter = self.drafter
            if drafter.held == held:
                caches.append(drafter.cache)
            elif held - drafter.held == 1 and self.rewinder.trimmable:  # its last draft: keep what both hold
                trim_prompt_cache(self.cache, 1)
                held = drafter.held
                caches.append(drafter.cache)
            elif drafter.held - held == 1 and drafter.rewinder.trimmable:  # it has fed the pending token (queue_next)
                trim_prompt_cache(drafter.cache, 1)
                drafter.held = held
                caches.append(drafter.cache)
            # else (plain or batched rounds it never saw): the target alone; a later draft prefills again
        slot = LAYER_SLOTS.get(self.drafter.name)
        layer = self.drafter.layer_state(held) if slot is not None else None
        if layer is not None:
            caches += [[] for _ in range(slot - len(caches))] + [[layer]]
        return self.tokens[:held], caches
