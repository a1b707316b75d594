"""``rollout.engine=megatron``: megatron-core's ``DynamicInferenceEngine`` on the actor's own shards.

The actor's TP/PP chunk generates directly -- no weight copy, no reshard: a paged KV cache
(``rollout.kv_cache_memory``, blocks of ``rollout.kv_block_tokens``), continuous batching of up to
``rollout.max_batch_size`` requests, prefill chunked to ``rollout.prefill_chunk_tokens`` tokens
per step.  Between rollouts the engine is suspended (``release_weights``, which the trainer calls
after every rollout): its KV cache is freed while the actor trains.  The next rollout resumes it
at the same size when the budget is in bytes; a budget given as a fraction of free memory is
measured again, so the context is rebuilt for it.

What this package adds around megatron's engine, so its samples mean what the trainer expects:

* **Logits from our model.**  ``RLGPTModel`` returns hidden states (the log-prob and value heads
  replace the output layer); the inference wrapper (:mod:`.wrapper`) applies ``GPTModel``'s own output step to
  them on the last stage (last-token selection, sequence-parallel gather, TP gather).
* **Our sampler.**  The controller's sampling is replaced by
  :func:`megatron_rl.rollout.sampling.sample` on the true vocabulary (padded ids are never drawn):
  temperature, top-k and top-p together, greedy at T=0, and log-probs under the
  temperature-scaled full distribution -- the trainer's definition, not megatron's raw-logit one.
  The race noise is :func:`~megatron_rl.rollout.sampling.keyed_exponentials` of (seed, prompt,
  sample, position), so a seed gives the same samples whatever the KV budget, chunk size or
  scheduling (requests pausing, being evicted and re-prefilled).
* **Prefix caching** (``rollout.prefix_caching``).  Requests whose prompts share whole KV pages
  share those pages: the ``n`` samples of a prompt prefill it once, and each other sample
  computes only the tokens after its last whole page (at least 2, a page when the prompt ends on
  a page boundary).  The shared keys and values are the ones each sample would have computed,
  so samples do not change.  Pages are shared only while a request holds them (megatron's
  ``REF_ZERO`` eviction), so nothing is reused across rollouts, whose weights differ.  Off while
  routing is recorded (MoE routing replay): a reused token is never routed again, so its experts
  would be missing from the samples that reuse it.
* **Our stop rule.**  Every stop id and stop sequence ends a sample on the step that produced it
  (the stop token kept), through the engine's own termination path; ``n`` samples per prompt are
  ``n`` requests.

* **Partial rollouts** (``live_weights``, async generator ranks).  Before every step the engine
  asks whether newer weights were pushed; when they were, they are already in the shards it runs
  on, and megatron's own suspend / resume (``RECOMPUTE``) re-prefills every request in flight, so
  later tokens are the new policy's given the sample so far; each token records its version.

Layouts: TP, PP, SP, EP (with PP too) and CP -- each context-parallel rank generates on its own
as a replica of the TP/PP shards (megatron's inference has no context parallelism, so the model's
CP group is swapped for a one-rank group while it generates).  With VPP the engine generates on a
model of its own (:mod:`megatron_rl.rollout.refit`, refit from the interleaved chunks before every
rollout): megatron's inference refuses interleaved chunks.

Paged attention (``rollout.paged_attention``, :mod:`megatron_rl.compat.paged_attention`):
flash-attn's kernels where they import on CUDA, else the Triton kernel
(:mod:`megatron_rl.ops.paged_attention`); on a CPU the SDPA stand-in and the other shims of
:mod:`megatron_rl.compat.inference_cpu`.  On CUDA decode steps replay megatron's per-layer CUDA
graphs (``rollout.cuda_graphs``, :mod:`megatron_rl.compat.inference_graphs`), attached to the actor's
layers only while the engine builds, resumes and steps, so the training forward never sees them.

megatron-core 0.19's inference mode is a process-wide flag (``InferenceMode``) that changes
``GPTModel``'s pre- and post-processing (last-token logits among them); it is on only while this
engine steps, so the trainer's forwards between rollouts never see it.

One module per concern: :mod:`.weights` (which model generates: the actor's shards or a model of
its own, refit), :mod:`.dynamic` and :mod:`.static` (the two ways of batching), :mod:`.draws` (the
per-token bookkeeping both share), :mod:`.controller` and :mod:`.wrapper` (megatron's classes with
our sampler and logits), :mod:`.modes` (what the model switches while it generates), and
:mod:`.engine`, the class composing them.
"""

from __future__ import annotations

from megatron_rl.rollout.megatron.engine import MegatronRolloutEngine  # noqa: F401
