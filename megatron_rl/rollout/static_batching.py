"""megatron-core's static-batching inference driven with the project's sampler: the engine's loop
where megatron's paged kernels do not run (the CPU, a GPU without flash-attn).

megatron's dynamic engine pages its KV cache and schedules requests every step; on the CPU that
bookkeeping costs more than the model (``docs/rollout.md``).  Its static-batching API
(``StaticInferenceContext`` with ``GPTInferenceWrapper``) runs the same model -- megatron's layers,
TP, PP -- over one preallocated KV cache per layer, and this module steps it:

* **One prefill per prompt.**  The distinct prompts of a chunk are left-padded to the longest and
  prefilled once under megatron's boolean attention mask (no real query sees a pad key); the KV
  cache rows are then copied to the ``n`` samples of each prompt (``swap_key_value_dict``), so a
  GRPO group computes its prompt once -- the static counterpart of the dynamic engine's prefix
  caching, off with ``rollout.prefix_caching=false``.
* **One position a step.**  Every running sample decodes one token a step; RoPE is relative, so a
  row's shift by its padding leaves its attention unchanged.  Attention that ignores an explicit
  mask under a causal mask type (TransformerEngine's) gets no padding instead: prompts start at
  column 0, the prefill stops at the shortest, and a longer prompt's row is fed its own tokens one
  a step until it draws.  Once at most half of the rows are
  still running, the finished ones are dropped (their KV rows compacted), so late steps of a
  long-tailed batch do not pay for them.
* **Our sampler and stop rule**, as in the dynamic engine: keyed noise per (sample, position), so
  a seed gives the dynamic engine's samples token for token; log-probs under the
  temperature-scaled full distribution; stop ids and sequences end a sample with the stop kept.
* **Pipeline stages**: megatron's wrapper passes hidden states stage to stage; the last stage
  draws, and its tokens and log-probs are broadcast to the other stages of the replica.

What it does not do (the engine picks the dynamic engine for these, ``rollout.batching``): MoE
layers (expert-parallel ranks step together), weights that change mid-rollout (partial
rollouts), routing replay from the engine.  A model trained with sequence parallelism generates
with it switched off (megatron's static batching has none;
:func:`megatron_rl.rollout.megatron.modes.without_sequence_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.layout.kv import stage_kv_bytes
from megatron_rl.rollout.megatron.draws import SampleLog, keyed_draw
from megatron_rl.rollout.sampling import SamplingParams


@dataclass
class StaticRollout:
    """Per row of a chunk: the response, its log-probs; and what the chunk computed."""

    responses: list[list[int]]
    logprobs: list[list[float]]
    prefill_tokens: int  # prompt tokens prefilled (pads not counted)
    steps: int  # forward steps, the prefill included


def kv_bytes_per_row(model, width: int) -> int:
    """Bytes of K and V one row of ``width`` positions holds on this rank (its stage's layers, its
    TP share of the KV heads), as megatron's attention allocates them."""
    config = model.config
    layers = len(model.decoder.layers) if getattr(model, "decoder", None) is not None else 0
    element = torch.empty((), dtype=config.params_dtype).element_size()
    return stage_kv_bytes(config, width, element, layers=layers, tp=model.pg_collection.tp.size())


def _pad_mask(pads: torch.Tensor, first_query: int, queries: int, keys: int) -> torch.Tensor | None:
    """megatron's boolean mask (True = hidden) for rows left-padded by ``pads``: later keys, and pad
    keys from a real query (a pad query sees only pads, so no row of the softmax is empty).  None
    where no row is padded: then plain causal attention applies."""
    if not bool(pads.any()):
        return None
    q = torch.arange(first_query, first_query + queries).view(1, queries, 1)
    k = torch.arange(keys).view(1, 1, keys)
    p = pads.view(-1, 1, 1)
    return ((k > q) | ((k < p) & (q >= p))).unsqueeze(1)


class _LastStageDraws:
    """The tokens and log-probs the last pipeline stage drew, on every stage of the replica."""

    def __init__(self, pp_group):
        self.group = pp_group if pp_group is not None and pp_group.size() > 1 else None
        if self.group is not None:
            size = self.group.size()
            self.last = dist.get_process_group_ranks(self.group)[size - 1]
            self.is_last = self.group.rank() == size - 1

    def __call__(self, drawn):
        if self.group is None:
            return drawn
        tokens, logp = drawn if self.is_last else (None, None)
        rows = torch.stack([tokens.double(), logp.double()], dim=1) if self.is_last else None
        size = torch.tensor([0 if rows is None else rows.shape[0]], dtype=torch.long)
        dist.broadcast(size, src=self.last, group=self.group)
        if rows is None:
            rows = torch.empty(int(size), 2, dtype=torch.float64)
        dist.broadcast(rows, src=self.last, group=self.group)
        return rows[:, 0].long(), rows[:, 1].float()


def forward_step(wrapper, inputs: dict):
    """One forward of the chunk through megatron's wrapper: logits on the last stage, None elsewhere.
    (One function, so a workload can shape decode steps: ``megatron_rl.testing.workload``.)"""
    return wrapper.run_one_forward_step(inputs)


@dataclass
class _ChunkLayout:
    """Where each row's prompt sits in the chunk's token table, and what the prefill runs."""

    tokens: torch.Tensor  # [rows, width]: every row's prompt at its columns
    lengths: torch.Tensor  # each row's prompt length
    pads: torch.Tensor  # each row's left padding
    start: torch.Tensor  # each row's first new column
    prefill_prompts: list[int]  # the prompts the prefill runs (distinct ones when shared)
    prefill_rows: torch.Tensor  # a row of each of them
    expand: torch.Tensor | None  # prefill row -> chunk rows, when prompts are shared
    prefilled: int  # columns the prefill computes

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


def _lay_out(prompts: list[list[int]], row_prompt: list[int], max_new_tokens: int, share_prompts: bool,
             left_pad: bool) -> _ChunkLayout:
    if share_prompts:  # each distinct prompt prefilled once, then copied to its samples' rows
        order = list(dict.fromkeys(row_prompt))
        where = {p: i for i, p in enumerate(order)}
        expand = torch.tensor([where[p] for p in row_prompt])
    else:
        order, expand = list(row_prompt), None
    lengths = torch.tensor([len(prompts[p]) for p in row_prompt])
    longest = int(lengths.max())
    width = longest + max_new_tokens
    pads = longest - lengths if left_pad else torch.zeros_like(lengths)
    start = pads + lengths
    tokens = torch.tensor([[0] * int(pads[r]) + list(prompts[p]) + [0] * (width - int(start[r]))
                           for r, p in enumerate(row_prompt)], dtype=torch.long)
    prefilled = longest if left_pad else int(lengths.min())
    first = [row_prompt.index(p) for p in order]  # a row of each distinct prompt the prefill runs
    return _ChunkLayout(tokens, lengths, pads, start, order, torch.tensor(first), expand, prefilled)


class _Drawer:
    """One forward of the live rows through megatron's wrapper, and their next tokens drawn (on the
    last stage, then broadcast to every stage of the replica)."""

    def __init__(self, wrapper, device, params: SamplingParams, vocab: int, expand):
        self.wrapper, self.device, self.params, self.vocab, self.expand = wrapper, device, params, vocab, expand
        self.draws = _LastStageDraws(wrapper.pp_group)

    def __call__(self, window_tokens, window_positions, mask, live_keys, drawn_so_far):
        logits = forward_step(self.wrapper, {
            "tokens": window_tokens.to(self.device), "position_ids": window_positions.to(self.device),
            "attention_mask": None if mask is None else mask.to(self.device)})
        if logits is None:  # not the last pipeline stage
            return self.draws(None)
        last = logits[:, -1, : self.vocab]
        if live_keys.shape[0] != last.shape[0]:  # the prefill's rows are the distinct prompts
            last = last[self.expand.to(last.device)]
        drawn, logp = keyed_draw(last, self.params, live_keys, drawn_so_far, self.vocab)
        return self.draws((drawn.cpu(), logp.cpu()))


def generate_static(wrapper_class, model, prompts: list[list[int]], row_prompt: list[int], keys: list[int],
                    params: SamplingParams, vocab: int, share_prompts: bool, left_pad: bool = True) -> StaticRollout:
    """Generate one chunk: row ``r`` continues ``prompts[row_prompt[r]]`` with sample key ``keys[r]``.

    ``wrapper_class``: the engine's inference wrapper (hidden states -> logits on the last stage).
    ``left_pad``: prompts right-aligned under megatron's attention mask (one prefill of the longest
    prompt, every row then draws); else every prompt starts at column 0, the prefill stops at the
    shortest prompt and a longer prompt's row is fed its own tokens one a step until it draws --
    causal attention alone, for attention kernels that ignore an explicit mask under a causal mask
    type (TransformerEngine's).  Runs under the caller's inference mode."""
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    rows = len(row_prompt)
    lay = _lay_out(prompts, row_prompt, params.max_new_tokens, share_prompts, left_pad)
    device = next(model.parameters()).device
    context = StaticInferenceContext(rows, lay.width)
    step = _Drawer(wrapper_class(model, context), device, params, vocab, lay.expand)
    keys_t = torch.tensor(keys, dtype=torch.long)
    log = SampleLog(range(rows), params)
    prefill_pads = lay.pads[lay.prefill_rows]
    positions = (torch.arange(lay.prefilled).unsqueeze(0) - prefill_pads.unsqueeze(1)).clamp(min=0)
    mask = _pad_mask(prefill_pads, 0, lay.prefilled, lay.prefilled) if left_pad else None
    drawn, logp = step(lay.tokens[lay.prefill_rows, : lay.prefilled], positions, mask, keys_t,
                       torch.zeros(rows, dtype=torch.long))
    if lay.expand is not None:
        context.swap_key_value_dict(lay.expand.to(device))
    context.enable_decode_mode()
    steps = 1 + _decode(step, context, lay, log, keys_t, (drawn, logp), left_pad, device)
    # prompt tokens computed: the prefill's (pads not counted), then those fed one a step
    computed = (sum(min(len(prompts[p]), lay.prefilled) for p in lay.prefill_prompts)
                + int((lay.lengths - lay.prefilled).clamp(min=0).sum()))
    return StaticRollout([log.responses[r] for r in range(rows)], [log.logprobs[r] for r in range(rows)],
                         computed, steps)


def _decode(step: _Drawer, context, lay: _ChunkLayout, log: SampleLog, keys_t, first_draws, left_pad: bool,
            device) -> int:
    """Decode one position a step until every row finished; the forward steps it ran."""
    rows = lay.tokens.shape[0]
    drawn, logp = first_draws
    live = list(range(rows))  # batch row -> chunk row
    column = lay.prefilled  # the column the logits just computed predict
    finished = [False] * rows
    starts = lay.start.tolist()
    steps = 0
    while True:
        live_t = torch.tensor(live)
        past_prompt = lay.start[live_t] <= column  # the rows that drew (the others are fed their prompt)
        lay.tokens[live_t[past_prompt], column] = drawn[past_prompt]  # a finished row's column is never read
        running = _take_draws(live, drawn, logp, column, starts, finished, log)
        if not running:
            return steps
        if 2 * len(running) <= len(live):  # drop the finished rows: compact their KV rows to the front
            keep = torch.tensor(running + [running[-1]] * (rows - len(running)))
            context.swap_key_value_dict(keep.to(device))
            live = [live[b] for b in running]
        live_t = torch.tensor(live)
        live_pads = lay.pads[live_t]
        drawn, logp = step(lay.tokens[live_t, column].view(-1, 1), (column - live_pads).view(-1, 1),
                           _pad_mask(live_pads, column, 1, column + 1) if left_pad else None, keys_t[live_t],
                           torch.tensor(log.positions(live)))
        steps += 1
        column += 1


def _take_draws(live: list[int], drawn, logp, column: int, starts: list[int], finished: list[bool],
                log: SampleLog) -> list[int]:
    """Record the tokens the live rows drew at ``column``; the batch rows still running."""
    running = []
    max_new_tokens = log.params.max_new_tokens
    for b, (r, token, lp) in enumerate(zip(live, drawn.tolist(), logp.tolist())):
        if finished[r]:
            continue  # finished earlier, still in the batch
        if column < starts[r]:  # still inside its prompt: fed the prompt's token next
            running.append(b)
            continue
        log.record(r, token, lp)
        if len(log.responses[r]) == max_new_tokens or log.stop_rule_ends(r):
            finished[r] = True
        else:
            running.append(b)
    return running


def honours_attention_masks(model) -> bool:
    """Whether ``model``'s core attention applies megatron's boolean attention mask under a causal
    mask type (the local spec's :class:`~megatron_rl.models.core_attention.LocalCoreAttention`);
    TransformerEngine's ignores it there, so its rows are not left-padded."""
    from megatron_rl.models.core_attention import LocalCoreAttention

    return any(isinstance(m, LocalCoreAttention) for m in model.modules())
