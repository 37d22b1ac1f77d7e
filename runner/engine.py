"""The decode engine: a target model, an optional draft, and the request loop.

``Engine.generate`` is a generator of ``Round`` objects, one per round of a
decoder (``runner.decoders``): a plain round emits one token; a speculative
round has a drafter (``runner.drafting.drafters``: the draft model or n-gram lookup)
propose up to k tokens (k from the per-runner depth controller,
``runner.drafting.depth``), the target checks them in one forward pass, the accepted
prefix plus one target token is emitted, and the caches are rewound past the
rejected part. After every round the release rule (``runner.release``) decides
whether the round crossed a multiple of the release interval and, if so,
empties MLX's buffer pool.

mlx-lm provides the model classes and KV caches; the loop is our own because
mlx-lm's ``speculative_generate_step`` never releases the pool while decoding
(and has no n-gram drafter, adaptive depth or rewinding of recurrent layers).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import psutil
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from common.defaults import DEFAULT_NUM_DRAFT_TOKENS
from common.errors import InvalidRequest, ModelLoadError, TokenizerMismatch
from common.footprint import ModelFootprint, default_prompt_cache_bytes, resolve_dtype
from common.images import Limits
from common.reasoning import detect as detect_reasoning
from common.reasoning import of_setting
from common.settings import CACHE_LIMIT_DEFAULT, CACHE_LIMIT_UNBOUNDED, RunnerSettings, adapter_folders
from common.tool_calls import detect

from .batch_memory import CacheCost
from .constraint import Grammars
from .decoders import LAYER_SLOTS, Decoder, PlainDecoder, SpeculativeDecoder
from .drafting.depth import DepthController, FixedDepth
from .drafting.drafters import ModelDrafter, NgramDrafter
from .drafting.mtp import HiddenModel, MTPDrafter
from .kv_quant import KVQuantization
from .loading.adapters import AdaptedModel, with_adapters
from .loading.load import LoadedModel, load_model
from .malloc import malloc_trim
from .mrope import PositionedModel, rope_delta
from .penalties import Penalties
from .platform import auto_dtype, device_name
from .prefill import PrefillPlanner
from .prompt_cache import Hit, PromptCache, trimmed_copy
from .release import ReleaseSchedule
from .request import GenerationRequest, PreparedRequest, end_of_turn_ids, prepare
from .results import Round, token_logprobs
from .session import Session

log = logging.getLogger("runner")
KEEP_PREFILL_TOKENS = 512  # a prompt longer than this leaves its prefilled caches too, where they cannot be trimmed


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
        raise TokenizerMismatch(
            draft.path,
            f"the draft's tokenizer differs from the target's ({target.path}): "
            f"{len(draft_vocab)} vs {len(target_vocab)} tokens, {differing} entries differ",
        )


def apply_cache_limit(setting: str | int) -> int:
    """Sets MLX's pool cap; returns the cap now in force."""
    if setting == CACHE_LIMIT_UNBOUNDED:
        limit = mx.get_memory_limit()
    elif setting == CACHE_LIMIT_DEFAULT:
        previous = mx.set_cache_limit(0)  # read the current value back...
        mx.set_cache_limit(previous)  # ...and restore it
        return previous
    else:
        limit = int(setting)
    mx.set_cache_limit(limit)
    return limit


@dataclass(frozen=True)
class Released:
    cache_before: int  # MLX's pool, bytes
    cache_after: int
    evicted_entries: int = 0  # prompt-cache entries emptied first
    evicted_bytes: int = 0
    cooled_entries: int = 0  # prompt-cache entries quantized instead (the cold tier)
    cooled_bytes: int = 0  # what that saved


def reasoning_of(tokenizer):
    """The reasoning format the tokenizer's chat template writes (common.reasoning.detect), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not getattr(tokenizer, "has_chat_template", False):
        return None
    try:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that needs more than one message: the template's text alone
        prompt = ""
    return detect_reasoning(template, prompt if isinstance(prompt, str) else "")


class Engine:
    """A loaded target (and optional draft), its drafters, depth controllers and prompt cache; ``generate``
    runs one request alone (``runner.worker`` interleaves and batches them)."""

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None,
        settings: RunnerSettings,
        dtype_reason: str = "",
        group=None,
    ):
        self.group = group  # a runner.group.Group when the target is split across processes
        self.rank_memory: list[int] = []  # in a group: MLX's active bytes of each rank after loading
        self.target = target
        self.draft = draft
        self.settings = settings
        self.tokenizer = target.tokenizer
        self.vocab_size = target.vocab_size
        # Constrained output (runner.constraint): a complete grammar allows every token that ends an answer.
        ends = frozenset(self.tokenizer.eos_token_ids) | end_of_turn_ids(self.tokenizer)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, ends)
        # How the model writes tool calls: the setting, else the family its chat template writes, else the
        # generic layout (common.tool_calls).
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_format = settings.tool_format or detect(template if isinstance(template, str) else None) or "generic"
        # How its reasoning is kept apart from its answer (common.reasoning): the setting, else the template's.
        self.reasoning = of_setting(settings.reasoning_format, reasoning_of(self.tokenizer))
        # A model that sees (runner.vision): its images' limits are the settings'.
        self.vision = target.vision
        self.image_limits = Limits(
            images=settings.max_images,
            bytes=settings.max_image_bytes,
            pixels=settings.max_image_pixels,
            seen=settings.image_pixels,
            urls=settings.image_urls,
            url_hosts=tuple(host.strip() for host in settings.image_url_hosts.split(",") if host.strip()),
        )
        self.device = device_name()
        self.dtype_reason = dtype_reason or f"dtype = {target.dtype!r}"
        self.cache_limit = apply_cache_limit(settings.cache_limit)
        self.total_releases = 0
        self.kv = self._kv_quantization(settings)
        budget = default_prompt_cache_bytes() if settings.prompt_cache is None else settings.prompt_cache
        if group is not None:  # the same entries on every rank: the same budget
            budget = group.share_int(budget)
        self.prompt_cache = PromptCache(
            budget,
            self._disk_tier(settings),
            cold_after=0.0 if self.kv is not None else settings.prompt_cache_cold_after,
            measure=self._entry_measure(target, group),
        )
        # LoRA adapters over the target (runner.loading.adapters): one copy of the base, an adapter chosen per request.
        folders = {name: Path(folder) for name, folder in adapter_folders(settings.adapters).items()}
        self.adapters, self._adapter_rows = with_adapters(target.model, folders) if folders else ([], None)
        self.adapter_names = tuple(adapter.name for adapter in self.adapters)
        self._adapted: dict[int, AdaptedModel] = {}  # adapter index -> the target as a session calls it
        # What a request's cache costs, per token (quantized with kv_bits) and per row.
        self.cache_cost = CacheCost.measure(target.model, self.kv)
        # Whether the target's caches can be trimmed back to a shorter prefix (not a sliding window's).
        self.trimmable = all(type(layer) is KVCache for layer in make_prompt_cache(target.model))
        # A drafter head trained here for the target (runner.drafting.head) and a block drafter (runner.drafting.block),
        # where the settings name them.
        self.head, self.head_problem = self._load_learned("head", settings.head)
        self.block, self.block_problem = self._load_learned("block", settings.block)
        self.drafters = self._available_drafters()
        self.default_drafter = self._default_drafter()
        # Per runner and drafter: round time by depth, and the acceptance by position a request starts from.
        self.depth = {
            name: DepthController(
                settings.max_draft_tokens, start=min(DEFAULT_NUM_DRAFT_TOKENS, settings.max_draft_tokens)
            )
            for name in self.drafters
            if name != "none"
        }
        if self.block is not None:  # one pass drafts any depth up to the block's: that cost shape, that deepest
            depth = min(settings.max_draft_tokens, self.block.config.block_size - 1)
            self.depth["block"] = DepthController(depth, start=min(DEFAULT_NUM_DRAFT_TOKENS, depth), one_pass=True)

    def _kv_quantization(self, settings: RunnerSettings):
        """The target's KV cache quantization (runner.kv_quant), or None; a group size that does not divide the
        heads' width is a ModelLoadError naming it."""
        if not settings.kv_bits:
            return None
        kv = KVQuantization(settings.kv_bits, settings.kv_group_size, settings.quantized_kv_start)
        args = self.target.model.args
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        problem = kv.check_heads([head_dim])
        if problem:
            raise ModelLoadError(self.target.path, problem)
        return kv

    @staticmethod
    def _entry_measure(target, group):
        """How the prompt cache counts an entry's bytes: as they are, or on a rank of a pipeline, as if it held
        every layer (``layer_scaled``): ranks with runs of different lengths still keep the same entries."""
        if group is None or group.mode != "pipeline":
            return None
        from common.footprint import text_config

        from .prompt_cache import layer_scaled

        return layer_scaled(int(text_config(target.config)["num_hidden_layers"]))

    def _disk_tier(self, settings: RunnerSettings):
        """The prompt cache's disk tier in ``prompt_cache_dir`` (runner.prompt_disk), keyed by both models and the
        dtype they compute in; None when unset, or (logged) when the folder cannot be used."""
        if settings.prompt_cache_dir is None or settings.prompt_cache == 0:
            return None
        from .prompt_disk import DiskTier, identity_of

        dtype = "/".join(m.compute_dtype for m in filter(None, (self.target, self.draft)))
        if self.kv is not None:  # quantized entries are another layout
            dtype += f"; kv {self.kv.bits}-bit, group {self.kv.group_size}, from {self.kv.start}"
        identity = identity_of(self.target.path, self.draft.path if self.draft else None, dtype)
        try:
            return DiskTier(settings.prompt_cache_dir, settings.prompt_cache_disk, identity)
        except OSError as error:
            log.warning("prompt cache: %s cannot be used (%s): memory only", settings.prompt_cache_dir, error)
            return None

    def _load_learned(self, kind: str, folder):
        """(the drafter head or block drafter in ``folder``, "") or (None, why not); (None, "") where none is set."""
        if folder is None:
            return None, ""
        if self.group is not None:
            return None, "not in a runner group"
        if kind == "head":
            from .drafting.head import load_head as load

            what, errors = "drafter head", (OSError, ValueError)
        else:
            if self.target.vision is not None:
                return None, "not for a model that sees"
            from .drafting.block import load_block as load

            what, errors = "block drafter", (OSError, ValueError, KeyError)
        try:
            return load(folder, self.target), ""
        except errors as error:
            log.warning("%s %s not used: %s", what, folder, error)
            return None, f"{folder}: {error}"

    def _available_drafters(self) -> dict[str, str]:
        """drafter -> "" when usable, else why not."""
        reasons = {"none": ""}
        target_ok = self.target.rewindable
        why_not_target = (
            ""
            if target_ok
            else (f"{self.target.path.name}'s cache cannot be rewound ({self.target.cache_description()})")
        )
        reasons["ngram"] = why_not_target
        if self.draft is None:
            reasons["model"] = "no draft model"
        elif not self.draft.rewindable:
            reasons["model"] = f"{self.draft.path.name}'s cache cannot be rewound ({self.draft.cache_description()})"
        else:
            reasons["model"] = why_not_target
        # The drafters that read the target's hidden states: not under LoRA adapters.
        for name, layer, missing in (
            ("mtp", self.target.mtp, f"{self.target.path.name} has no MTP layers (runner.drafting.mtp)"),
            ("head", self.head, self.head_problem or "no drafter head (the head setting)"),
            ("block", self.block, self.block_problem or "no block drafter (the block setting)"),
        ):
            if layer is None:
                reasons[name] = missing
            elif self.adapters:
                reasons[name] = "not with LoRA adapters"
            else:
                reasons[name] = why_not_target
        return reasons

    @property
    def wanted_drafter(self) -> str:
        """The configured drafter, or the default one: the draft model when there is one, else the target's MTP
        layer where it has one, else the drafter head where one is set, else n-gram."""
        if self.settings.drafter:
            return self.settings.drafter
        if self.draft is not None:
            return "model"
        if self.target.mtp is not None:
            return "mtp"
        return "head" if self.settings.head is not None else ("block" if self.settings.block is not None else "ngram")

    def _default_drafter(self) -> str:
        wanted = self.wanted_drafter  # one of DRAFTERS: RunnerSettings checked it
        return wanted if not self.drafters[wanted] else "none"

    @property
    def speculative(self) -> bool:
        return self.default_drafter != "none"

    @property
    def speculative_note(self) -> str:
        """How the runner decodes by default, in words."""
        if self.default_drafter == "none":
            why = self.drafters.get(self.wanted_drafter) or 'drafter = "none"'
            return f"plain decoding: {why}"
        depth = (
            f"k = {self.settings.num_draft_tokens}"
            if self.settings.num_draft_tokens is not None
            else f"adaptive depth up to {self.settings.max_draft_tokens}"
        )
        source = {
            "model": "draft model",
            "mtp": "the target's MTP layer",
            "block": f"the block drafter {self.settings.block}",
            "head": f"the drafter head {self.settings.head}",
        }.get(self.default_drafter, f"n-gram lookup (n = {self.settings.ngram_max}..{self.settings.ngram_min})")
        return f"speculative: {source}, {depth}"

    @classmethod
    def load(cls, target_dir, draft_dir=None, settings: RunnerSettings | None = None, group=None) -> Engine:
        settings = settings or RunnerSettings()
        folders = [Path(target_dir)] + ([Path(draft_dir)] if draft_dir else [])
        weighed = folders + ([Path(settings.head)] if settings.head else [])  # the head's weights and cache too
        weighed += [Path(settings.block)] if settings.block else []  # a block drafter's too
        dtype, reason = settings.dtype, ""
        if dtype == "auto":
            try:
                footprints = [ModelFootprint.of(folder) for folder in weighed]
            except (OSError, ValueError):
                footprints = None  # load_model reports what is wrong with the folder
            if footprints is not None:
                dtype, reason = resolve_dtype(
                    "auto",
                    device_name(),
                    footprints,
                    psutil.virtual_memory().available,
                    context=settings.max_context or None,
                )
            else:
                dtype = auto_dtype()
        if group is not None:  # every rank loads in rank 0's dtype (free memory differs between them)
            dtype, reason = group.share((dtype, reason))
        target = load_model(folders[0], dtype, settings.max_context or None, group=group)
        draft = load_model(folders[1], dtype, settings.max_context or None) if draft_dir else None
        if draft is not None:
            check_same_vocabulary(target, draft)
        engine = cls(target, draft, settings, reason, group)
        if group is not None:  # what each rank holds once loaded (Info.rank_memory): its share of the weights
            engine.rank_memory = group.gather_int(mx.get_active_memory())
        return engine

    @property
    def context_length(self) -> int:
        return self.target.context_length

    @property
    def default_num_draft_tokens(self) -> int:
        """The pinned k, the adaptive depth's current best, or 0 without drafting."""
        if not self.speculative:
            return 0
        if self.settings.num_draft_tokens is not None:
            return self.settings.num_draft_tokens
        return self.depth[self.default_drafter].best()

    def warm_up(self) -> None:
        """Short generations, so the first real request does not pay for first-use setup. On a GPU, one per
        draft depth the adaptive depth may choose: MLX's CUDA backend compiles a kernel for each new shape
        (seconds the first time; later starts read them from ``MLX_PTX_CACHE_DIR``, docs/gpu.md)."""
        depths = (2,) if self.device == "cpu" else range(1, self.settings.max_draft_tokens + 1)
        for drafter in [name for name, why in self.drafters.items() if not why]:
            for k in (0,) if drafter == "none" else depths:
                for _ in self.generate(
                    GenerationRequest(
                        prompt_ids=(0, 5, 6, 7, 5, 6, 7, 5),
                        max_tokens=8,
                        ignore_eos=True,
                        cache_prompt=False,
                        drafter=drafter,
                        num_draft_tokens=k,
                    )
                ):
                    pass

    def release_memory(self, prompt_cache: bool = False) -> Released:
        """Empty the pool now (after the prompt cache, when asked): its buffers go back to the system.

        With a cold tier, asking for the prompt cache first quantizes its float entries (about 3.5x less
        for float32) and empties it only when they are all cold already: the memory policy asks again if
        that was not enough, so pressure costs warm prefixes only when quantizing them did not do."""
        entries = evicted = cooled = saved = 0
        if prompt_cache:
            cooled, saved = self.prompt_cache.cool_all()
            if not cooled:
                entries, evicted = self.prompt_cache.clear()
        before = mx.get_cache_memory()
        mx.clear_cache()
        if self.settings.malloc_trim:
            malloc_trim()
        self.total_releases += 1
        return Released(before, mx.get_cache_memory(), entries, evicted, cooled, saved)

    def keeps_prefills(self, session: Session) -> bool:
        """Whether ``keep_prefill`` is worth it for this request: its caches cannot be trimmed back (a sliding
        window's), its prompt is long, and it may use the prompt cache."""
        return (
            self.prompt_cache.enabled
            and session.prepared.cache_prompt
            and len(session.prepared.prompt_ids) > KEEP_PREFILL_TOKENS
            and not self.trimmable
        )

    def keep_prefill(self, session: Session) -> None:
        """A copy of ``session``'s caches as they are once its prompt is in, into the prompt cache. A sliding
        window's cache cannot be trimmed back, so the entry a request leaves at its end (prompt and answer) serves
        only a prompt that repeats all of it; the next turn of a conversation repeats the prompt, then the answer
        as the template lays it out, which is not always the tokens decoded (a grammar's forced tokens). This
        entry serves it whole: Claude Code's second turn on Gemma 3 found nothing without it."""
        tokens, caches = session.prefilled_state()
        copies = [copy.deepcopy(layers) if layers else layers for layers in caches]
        self.prompt_cache.store(list(tokens), copies, namespace=session.prepared.adapter)

    def share_prefill(self, session: Session) -> None:
        """A copy of ``session``'s prefilled caches in the prompt cache, for the other choices of its request
        (n > 1): they find its prompt there and prefill only its last token."""
        tokens, caches = session.prefilled_state()
        if tokens and self.prompt_cache.enabled:
            self.prompt_cache.store(
                list(tokens),
                [trimmed_copy(layers, len(tokens)) if layers else layers for layers in caches],
                namespace=session.prepared.adapter,
            )

    def prepare(self, request: GenerationRequest, counting: bool = False) -> PreparedRequest:
        """Validate and tokenize a request once (raises InvalidRequest naming the field); ``counting``: only to
        count its prompt (a prompt past the context is counted, not refused)."""
        if self.drafters.get(request.drafter):  # an unknown name is the request check's (prepare)
            raise InvalidRequest("drafter", f"{request.drafter!r} is not available: {self.drafters[request.drafter]}")
        return prepare(
            request,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            default_num_draft_tokens=self.default_num_draft_tokens,
            can_draft=self.speculative or bool(request.drafter and request.drafter != "none"),
            grammars=self.grammars,
            tool_format=self.tool_format,
            counting=counting,
            max_output_tokens=self.settings.max_output_tokens,
            adapters=self.adapter_names,
            reasoning=self.reasoning,
            vision=self.vision,
            image_limits=self.image_limits,
        )

    def target_model(self, adapter: int = 0):
        """The target as a request with LoRA adapter ``adapter`` calls it (setting its rows' adapter before each
        pass; one object per adapter, so requests of one adapter prefill together); the model itself when the
        runner has no adapters."""
        if self._adapter_rows is None:
            return self.target.model
        if adapter not in self._adapted:
            self._adapted[adapter] = AdaptedModel(self.target.model, self._adapter_rows, lambda: (adapter,))
        return self._adapted[adapter]

    def batch_model(self, batch):
        """The target as ``batch`` calls it: each row with its own request's adapter, and its own positions' delta
        where the model's image tokens take positions of their own (runner.mrope)."""
        model = self.target.model
        if self._adapter_rows is not None:
            model = AdaptedModel(model, self._adapter_rows, lambda: [s.prepared.adapter for s in batch.rows])
        if self.vision is not None and self.vision.positions is not None:
            model = PositionedModel(model, self.vision.positions, lambda: [rope_delta(s.prepared) for s in batch.rows])
        return model

    def _request_model(self, prepared: PreparedRequest):
        """The target as one request's decoder calls it: with its adapter, and an image request on a model with
        M-RoPE with its positions (runner.mrope)."""
        model = self.target_model(prepared.adapter)
        if prepared.vision_input is not None and self.vision.positions is not None:
            delta = rope_delta(prepared)
            model = PositionedModel(model, self.vision.positions, lambda: delta)
        return model

    def prefill_planner(self) -> PrefillPlanner:
        heads = max(
            getattr(m.model.args, "num_attention_heads", 1) or 1 for m in filter(None, (self.target, self.draft))
        )
        planner = PrefillPlanner(
            heads,
            self.settings.prefill_chunk_on(self.device),
            self.settings.prefill_seconds,
            self.settings.prefill_score_bytes if self.device == "cpu" else None,
        )
        if self.group is not None:  # chunk sizes come from measured times: rank 0's are everyone's
            planner.share = self.group.share_int
        return planner

    def session(self, prepared: PreparedRequest) -> Session:
        """A session for one prepared request, from its parts: the decoder (on the caches a prompt-cache hit
        gives), the release schedule, the prefill planner, and the prompt cache to keep its caches at the end."""
        reuse = (
            self.prompt_cache.lookup(prepared.prompt_ids, prepared.adapter) if prepared.cache_prompt else Hit(0, None)
        )
        return Session(
            prepared,
            self.decoder(prepared, reuse),
            tokenizer=self.tokenizer,
            cached_tokens=reuse.tokens,
            schedule=ReleaseSchedule(
                self.release_memory, self.settings.release_interval, self.settings.release_enabled
            ),
            planner=self.prefill_planner(),
            keep=functools.partial(self.prompt_cache.store, namespace=prepared.adapter)
            if prepared.cache_prompt
            else None,
        )

    def decoder(self, prepared: PreparedRequest, reuse: Hit) -> Decoder:
        """The decoder for one request: plain, or speculative with its drafter and depth; with its grammar."""
        decoder = self._decoder(prepared, reuse)
        decoder.constraint = prepared.constraint
        if prepared.vision_input is not None:
            decoder.seen = (self.vision, prepared.vision_input)
        decoder.kv = self.kv
        decoder.group = self.group
        decoder.stop_ids = prepared.eos_ids
        decoder.set_logit_bias(prepared.request.logit_bias, self.vocab_size)
        request = prepared.request
        if request.prompt_logprobs:
            decoder.prompt_scores = []

            def score(logits, tokens, decoder=decoder):
                decoder.prompt_scores += token_logprobs(self.tokenizer, logits, tokens, prepared.top_logprobs)

            decoder.score_prompt = score
        penalties = (request.presence_penalty, request.frequency_penalty, request.repetition_penalty)
        if Penalties.wanted(*penalties):
            prompt = prepared.vision_input.real_ids if prepared.vision_input is not None else prepared.prompt_ids
            decoder.penalties = Penalties(self.vocab_size, prompt, *penalties)
            decoder.penalties.count(list(request.resume_ids))  # a resumed answer's tokens so far
        return decoder

    @staticmethod
    def _layer_state(reuse: Hit, drafter: str) -> tuple:
        """(the drafter layer's cache, the positions it holds pairs for) that a prompt-cache hit brings for a request
        drafting with ``drafter`` ("mtp", "head"): the pairs of the positions before the hit's last token, which
        the request runs again (so its target cache must be trimmable); (None, 0) when it brings none."""
        slot = LAYER_SLOTS[drafter]
        if not reuse.caches or len(reuse.caches) <= slot or not reuse.caches[slot]:
            return None, 0
        if not can_trim_prompt_cache(reuse.caches[0]):
            return None, 0
        layer = reuse.caches[slot][0]
        pairs = min(layer.offset, reuse.tokens - 1)
        if layer.offset > pairs:
            layer.trim(layer.offset - pairs)
        return layer, pairs

    def _decoder(self, prepared: PreparedRequest, reuse: Hit) -> Decoder:
        request = prepared.request
        drafter = request.drafter or self.default_drafter
        pinned = request.num_draft_tokens if request.num_draft_tokens is not None else self.settings.num_draft_tokens
        key = mx.random.key(prepared.seed)
        cache, held = (reuse.caches[0], reuse.tokens) if reuse.caches else (None, 0)
        seeded_sampling = request.seed is not None and not prepared.params.greedy
        seen = prepared.vision_input  # an image request: its prompt's images go in as embeddings (a draft model
        # reads the image tokens as text: it drafts the answer's text, the target verifies)
        if drafter == "none" or pinned == 0 or (seeded_sampling and request.num_draft_tokens is None):
            # A seeded sample draws one key per token, the same alone or in a batch: no drafting unless pinned.
            return PlainDecoder(self._request_model(prepared), prepared.prompt_ids, prepared.params, key, cache, held)
        depth = FixedDepth(pinned) if pinned is not None else self.depth[drafter].for_request()
        if drafter == "model":
            kept = reuse.caches[1] if reuse.caches and len(reuse.caches) > 1 else None  # empty: no draft's cache
            draft_cache, draft_held = (kept, reuse.tokens) if kept else (None, 0)
            source = ModelDrafter(self.draft.model, draft_cache, draft_held)
        elif drafter in ("mtp", "head"):
            layer, pairs = self._layer_state(reuse, drafter)
            if layer is not None:  # the prefix's last token runs again: its hidden state continues the layer's pairs
                trim_prompt_cache(cache, 1)
                held -= 1
            if drafter == "mtp":
                source = MTPDrafter(self.target.model, self.target.mtp, layer, pairs)
            else:
                from .drafting.head import HeadDrafter

                source = HeadDrafter(self.target.model, self.head, layer, pairs)
            # The target as this request calls it: mlx-lm's inner model, then its head, the hidden states kept.
            target = HiddenModel(self._request_model(prepared), source.hidden)
            return SpeculativeDecoder(target, prepared.prompt_ids, prepared.params, key, source, depth, cache, held)
        elif drafter == "block":
            from .drafting.block import BlockDrafter, TappedModel

            source = BlockDrafter(self.target.model, self.block)
            # The target as this request calls it: mlx-lm's own call, its tapped layers' outputs kept by position.
            target = TappedModel(self._request_model(prepared), source.taps, source.features)
            return SpeculativeDecoder(target, prepared.prompt_ids, prepared.params, key, source, depth, cache, held)
        else:
            context = seen.real_ids if seen is not None else prepared.prompt_ids
            source = NgramDrafter(context, self.settings.ngram_max, self.settings.ngram_min)
        return SpeculativeDecoder(
            self._request_model(prepared), prepared.prompt_ids, prepared.params, key, source, depth, cache, held
        )

    # -- generation ---------------------------------------------------------

    def generate(self, request: GenerationRequest | PreparedRequest, cancelled=lambda: False) -> Iterator[Round]:
        """Stream the rounds of one request, alone (``runner.worker`` interleaves and batches sessions).

        ``cancelled()`` is called between prefill chunks and between rounds: it is
        where the caller shows progress, and it ends the generation by returning True.
        """
        prepared = request if isinstance(request, PreparedRequest) else self.prepare(request)
        session = self.session(prepared)
        last = None
        try:
            while not session.prefill_chunk():
                if cancelled():
                    session.cancel()
                    break
            if not session.done and cancelled():
                session.cancel()
            while not session.done:
                round_ = session.solo_round()
                if session.done:
                    last = round_
                    break
                yield round_
                if cancelled():
                    session.cancel()
        except BaseException:
            session.abandon()
            raise
        yield session.final_round(last)
