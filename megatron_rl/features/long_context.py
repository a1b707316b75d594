"""Long context: context parallelism, packed and unpacked sequences, token budgets, chunked log-probs."""

from __future__ import annotations

from megatron_rl.features.base import (
    GPU_UNTESTED,
    TESTED_CPU,
    Feature,
    Measured,
    _a2a_heads_fit,
    _a2a_size,
    _heads_kv,
    _product,
    _te_at_least,
    _uses_te,
    need,
)
from megatron_rl.layout.arch import attention_dims
from megatron_rl.ops.cp_attention import A2A_COMM_TYPES

AREA = "long context"
FEATURES = [
    Feature(
        "Chunked vocab-parallel log-probs and entropy", "long context", TESTED_CPU,
        "Output projection fused into the log-softmax, walked in token chunks with fp32 inside the chunk; never "
        "[tokens, vocab]; at most two [chunk, vocab/TP] fp32 buffers. A training micro-batch whose fp32 logits take "
        "at most batch.logprob_keep_logits_gib (1 GiB) keeps them for backward instead of running the output "
        "projection again (megatron's own cross-entropy always keeps them); the same bits either way, and the "
        "planner counts them.",
        ("tests/test_logprob_op.py::test_matches_naive_forward_and_gradients",
         "tests/test_logprob_op.py::test_extra_memory_below_a_quarter_of_naive_at_2k_tokens",
         "tests/test_logprob_op.py::test_kept_logits_give_the_recomputed_bits",
         "tests/test_logprob_op.py::test_kept_logits_give_the_recomputed_bits_on_tensor_parallel_shards",
         "tests/test_logprob_op.py::test_logits_are_kept_only_within_the_bound"),
        config="batch.logprob_chunk_size, batch.logprob_keep_logits_gib",
        measured=(Measured("peak extra memory 0.057x naive at 2k tokens x 16k vocab",
                           "pytest -s tests/test_logprob_op.py -k extra_memory"),),
    ),
    Feature(
        "Context parallelism: p2p ring (local path)", "long context", TESTED_CPU,
        "K/V travel around the CP ring in the model dtype, the next hop overlapping the current block; each block is a "
        "fused attention kernel (CPU flash / CUDA flash or memory-efficient) returning its log-sum-exp, merged "
        "exactly; no mask tensor (zigzag pairs are full, causal-diagonal or skipped), so every rank does the same work "
        "per step; backward uses the kernels' backward. Saved activations O(S/CP). Packed rows: one kernel call per "
        "sequence on the CPU; on CUDA in half precision one variable-length flash call per ring step (the packing is "
        "tested on CPU; on an H200 the call's forward and backward equal one call per sequence exactly, "
        "benchmarks/gpu_check.py; the ring between GPUs not yet run).",
        ("tests/test_context_parallel.py::test_cp_attention_matches_one_process",
         "tests/test_context_parallel.py::test_packed_matches_one_process",
         "tests/test_context_parallel.py::test_packed_rows_as_one_varlen_call_per_ring_step"),
        config="parallel.cp>1, parallel.cp_comm_type=p2p",
        measured=(Measured("32k tokens, per-rank peak RSS: scoring 0.507x CP=1 at CP=2, 0.361x at CP=4; training "
                           "0.337x "
                           "at CP=4; ring blocks 1.14x SDPA's CPU time per useful FLOP (forward+backward, CP=2)",
                           "python benchmarks/long_context_memory.py --lengths 32768 --cp 1,2,4 --comm "
                           "p2p,all_gather,a2a --modes score,train --attention"),),
    ),
    Feature(
        "Context parallelism: all_gather (local path)", "long context", TESTED_CPU,
        "K/V gathered over the CP group in the model dtype, then the same fused per-block kernel calls as the ring (no "
        "mask, no cache); backward gathers again and reduce-scatters the K/V gradients, so saved activations are 1/CP. "
        "While a layer runs it holds the whole sequence's K/V.",
        ("tests/test_context_parallel.py::test_cp_attention_matches_one_process",),
        config="parallel.cp_comm_type=all_gather",
        measured=(Measured("32k tokens, per-rank peak RSS: scoring 0.507x CP=1 at CP=2 (wall 0.68-0.80x), 0.361x at "
                           "CP=4; training 0.337x at CP=4", "python benchmarks/long_context_memory.py --lengths 32768 "
                                                            "--cp 1,2,4 --comm p2p,all_gather,a2a --modes score,train "
                                                            "--attention"),),
    ),
    Feature(
        "Context parallelism: a2a / Ulysses (local path)", "long context", TESTED_CPU,
        "An all-to-all turns sequence shards into head shards, one fused causal attention runs over the whole sequence "
        "(packed rows: per sequence), another all-to-all turns it back. K/V heads are split over CP when they divide, "
        "replicated when CP is a multiple of them.",
        ("tests/test_context_parallel.py::test_cp_attention_matches_one_process",),
        (
            need("parallel.cp",
                 lambda c, w: _a2a_heads_fit(c),
                 "a2a splits each TP rank's heads over {c.parallel.cp_comm_type}'s a2a group: it needs (heads/tp) "
                 "divisible by the a2a size, and (kv_heads/tp) divisible by it or dividing it",
                 "use parallel.cp_comm_type=p2p, or an a2a size that divides heads/tp",
                 "a2a (local): (heads/tp) % a2a == 0; kv_heads/tp split or replicated",
                 when=lambda c: not _uses_te(c) and c.parallel.cp > 1 and c.parallel.cp_comm_type in A2A_COMM_TYPES),
        ),
        config="parallel.cp_comm_type=a2a",
        measured=(Measured("32k tokens, per-rank peak RSS: scoring 0.508x CP=1 at CP=2 (wall 0.66x), 0.362x at CP=4; "
                           "training 0.324x at CP=4", "python benchmarks/long_context_memory.py --lengths 32768 --cp "
                                                      "1,2,4 --comm p2p,all_gather,a2a --modes score,train "
                                                      "--attention"),),
    ),
    Feature(
        "Context parallelism: a2a+p2p, hierarchical (local path)", "long context", TESTED_CPU,
        "a2a inside groups of consecutive CP ranks (parallel.hierarchical_context_parallel_sizes[0]), the ring across "
        "the groups: after the inner all-to-all a group holds exactly the zigzag halves of the outer ring, so the ring "
        "runs unchanged on head shards.",
        ("tests/test_context_parallel.py::test_cp_attention_matches_one_process",),
        config="parallel.cp_comm_type=a2a+p2p, parallel.hierarchical_context_parallel_sizes=[a2a, p2p]",
    ),
    Feature(
        "Context parallelism: TransformerEngine p2p / all_gather / a2a / a2a+p2p", "long context", GPU_UNTESTED,
        "TE's attention does the CP communication on the TE spec; a2a (Ulysses) splits each TP rank's query and KV "
        "heads over the a2a group.",
        (),
        (
            need("parallel.cp",
                 lambda c, w: (attention_dims(c.model)[0] // c.parallel.tp) % _a2a_size(c) == 0
                 and (_heads_kv(c) // c.parallel.tp) % _a2a_size(c) == 0,
                 "a2a splits each TP rank's heads over the a2a group: TransformerEngine needs (heads/tp) % cp == 0 "
                 "and (kv_heads/tp) % cp == 0",
                 "use parallel.cp_comm_type=p2p, or a cp dividing both heads/tp and kv_heads/tp",
                 "a2a needs (heads/tp) % cp == 0 and (kv_heads/tp) % cp == 0",
                 when=lambda c: _uses_te(c) and c.parallel.cp > 1 and c.parallel.cp_comm_type in A2A_COMM_TYPES),
            need("parallel.hierarchical_context_parallel_sizes",
                 lambda c, w: _product(c.parallel.hierarchical_context_parallel_sizes) == c.parallel.cp,
                 "the hierarchical CP sizes must multiply to parallel.cp",
                 "give sizes that multiply to {c.parallel.cp}, the a2a size first, or use cp_comm_type=p2p",
                 "a2a+p2p: product of hierarchical sizes == cp",
                 when=lambda c: c.parallel.cp_comm_type == "a2a+p2p" and c.parallel.cp > 1),
            need("parallel.cp_comm_type", lambda c, w: _te_at_least("2.18"),
                 "TransformerEngine before 2.18 has no all_gather context parallelism for packed (THD) sequences",
                 "set batch.packing=false, or parallel.cp_comm_type=p2p, or install transformer-engine>=2.18",
                 "TE all_gather CP with packed sequences needs TE >= 2.18",
                 when=lambda c: _uses_te(c) and c.parallel.cp > 1 and c.parallel.cp_comm_type == "all_gather"
                 and c.batch.packing),
            need("parallel.cp_comm_type", lambda c, w: _te_at_least("2.12"),
                 "TransformerEngine 2.9 and older have no a2a context parallelism for packed (THD) sequences",
                 "set batch.packing=false, or install transformer-engine>=2.12",
                 "TE a2a CP with packed sequences needs TE >= 2.12",
                 when=lambda c: (_uses_te(c) and c.parallel.cp > 1 and c.parallel.cp_comm_type == "a2a"
                                 and c.batch.packing)),
        ),
        config="model.transformer_impl=transformer_engine, parallel.cp_comm_type",
    ),
    Feature(
        "Host-side CP sharding", "long context", TESTED_CPU,
        "Each rank cuts its zigzag shard of every sequence on the host; only 1/CP of the tokens (and masks, labels, "
        "per-token fields) reach its device. Labels are shifted before the split.",
        ("tests/test_context_parallel.py::test_each_rank_receives_one_cp_th_of_the_tokens",),
        config="parallel.cp>1 (always on)",
    ),
    Feature(
        "Packed sequences (THD) with CP", "long context", TESTED_CPU,
        "Mixed lengths in one micro-batch, each padded to a multiple of 2*cp (x tp with SP), attention never crosses "
        "sequences, per-sequence outputs back in the original order.",
        ("tests/test_context_parallel.py::test_packed_matches_one_process",),
        config="batch.packing=true",
    ),
    Feature(
        "Packed attention without a per-sequence loop (CP=1)", "long context", TESTED_CPU,
        "Sequences of similar length share one fused causal SDPA call on a padded batch (padding at each sequence's "
        "end, hidden by the causal mask); short sequences always share one call; on CUDA in half precision one "
        "variable-length flash call (torch.nn.attention.varlen, called with the keywords the installed torch takes: "
        "2.11 has no enable_gqa; ran on an H200). The ring at CP>1 still calls the kernels per sequence of a packed "
        "row.",
        ("tests/test_packed_attention.py::test_packed_attention_matches_attention_per_sequence",
         "tests/test_torch_varlen.py::test_the_packed_flash_call_fits_each_signature_and_equals_the_cpu_path"),
        config="batch.packing=true (default)",
        measured=(Measured("attention fwd+bwd of 128 sequences of 12-19 tokens: 35 ms bucketed vs 34 ms padded rows vs "
                           "400 ms one call per sequence (2 CPU cores)",
                           "python benchmarks/packed_attention.py"),),
    ),
    Feature(
        "Unpacked (BSHD) input with CP", "long context", TESTED_CPU,
        "Right-padded rows, zigzag-split per row.",
        ("tests/test_context_parallel.py::test_unpacked_matches_one_process",),
        config="batch.packing=false",
    ),
    Feature(
        "Token-budget micro-batches", "long context", TESTED_CPU,
        "batch.max_tokens_per_rank: LPT-balanced on a cost with attention's quadratic term, same count on every DP "
        "rank, sequences up to budget x CP; a longer one is a clear error.",
        ("tests/test_context_parallel.py::test_token_budget_does_not_change_logprobs_or_gradients",
         "tests/test_context_parallel.py::test_sequence_longer_than_budget_times_cp_is_a_data_error"),
        config="batch.max_tokens_per_rank",
    ),
    Feature(
        "Token-budget micro-batches by default", "long context", TESTED_CPU,
        "With neither batch.max_tokens_per_rank nor batch.micro_batch_size set, the budget is derived: 64 sequences of "
        "data.max_prompt_tokens + rollout.max_new_tokens, at most what 4 GiB of activations per rank hold for the "
        "model and layout, at least one such sequence, at least pp micro-batches; rollout.max_batch_size likewise "
        "defaults to the step's whole batch per rank (within 4 GiB of KV cache). An explicit micro_batch_size still "
        "fixes the size; a budget takes precedence over it.",
        ("tests/test_ppo.py::test_default_configs_train_on_micro_batches_of_many_sequences",
         "tests/test_context_parallel.py::test_token_budget_does_not_change_logprobs_or_gradients"),
        config="batch.max_tokens_per_rank=null, batch.micro_batch_size=null (defaults)",
    ),
]
