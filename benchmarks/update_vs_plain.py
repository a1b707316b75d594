"""The actor update against megatron-core's own training step, on the same packed micro-batches.

    python benchmarks/update_vs_plain.py [--model cpu|tiny|qwen2.5-1.5b] [--tokens-per-microbatch N]
                                         [--microbatches M] [--rounds R] [--dtype bfloat16|float32]

World size 1 (gloo on the CPU, NCCL on CUDA).  One set of sequences (prompt + response, mixed
lengths) is cut into ``M`` packed micro-batches of up to ``N`` tokens, and these are timed:

* ``plain megatron-core step``: what ``pretrain_gpt`` runs -- megatron's ``GPTModel`` with its
  output layer and vocab-parallel cross-entropy (fused on CUDA), megatron DDP and optimizer,
  ``forward_backward_func`` over the micro-batches (built once, as a data loader hands them over),
  the per-token loss summed over the response mask, megatron's ``optimizer.step()``;
* our actor update with each RL piece switched on in turn, each through the trainer's own path
  (:func:`megatron_rl.engine.forward.run_sequences` + :meth:`Trainable.step`): ``log-probs`` (the
  chunked vocab-parallel head, loss = -mean log-prob), ``+ entropy`` (bonus from the same pass),
  ``+ PPO loss, masks`` (the registered clipped surrogate with its metrics), ``+ KL`` (k3 to the
  reference log-probs in the loss), ``+ metrics`` (the step's metric reduction, as ``_update`` does),
  and all of them again with the logits recomputed in backward (``batch.logprob_keep_logits_gib=0``,
  the least memory);
* the experience phase's forwards (no gradient): megatron's forward to the per-token loss, against
  our old-log-prob pass (log-prob + entropy) and reference pass (log-prob only).

Rounds are interleaved (every variant once per round, after one warm-up step each) and the median
is printed as tokens/s (real tokens, padding excluded) with its ratio to megatron's.  The first
step's losses are checked on the way: our ``log-probs`` loss equals megatron's cross-entropy on the
same weights (``loss parity``), so both sides compute the same thing.

``--build-and-load`` also times building a model and loading a checkpoint of its weights and optimizer
state, megatron's own way (``dist_checkpointing``) and ours (``load_checkpoint``).

Models: ``cpu`` (8 layers, hidden 1024, vocabulary 32k: the layers dominate, as on a GPU model),
``tiny`` (a check of the script), ``qwen2.5-1.5b`` (the shape of Qwen2.5-1.5B, random weights, for a
GPU).  ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # a GPU machine runs this from a copy of the tree, without installing it
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

MODELS = {
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                 vocab_size=256),
    "cpu": dict(num_layers=8, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16, num_query_groups=4,
                vocab_size=32768),
    "qwen2.5-1.5b": dict(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                         num_query_groups=2, vocab_size=151936, add_qkv_bias=True, tie_word_embeddings=True,
                         rotary_base=1000000.0),
}
PLAIN = "plain megatron-core step"
RL_PIECES = ("log-probs", "+ entropy", "+ PPO loss, masks", "+ KL", "+ metrics")
RECOMPUTED = "all pieces, logits recomputed in backward (logprob_keep_logits_gib=0)"
PLAIN_FORWARD = "plain megatron-core forward"
FORWARDS = ("old-log-prob pass (+ entropy)", "reference pass")


@dataclasses.dataclass
class Setup:
    device: torch.device
    model_cfg: object
    seqs: list  # per-sequence dicts with every field the RL losses read
    groups: list  # the micro-batches' sequence indices (the same for every variant)
    budget: int
    real_tokens: int
    response_tokens: int
    valid_lengths: list  # tokens in each sequence's loss


def init_world(device: torch.device) -> None:
    from megatron_rl.config.schema import DistributedConfig
    from megatron_rl.distributed.env import free_port
    from megatron_rl.distributed.runtime import init_distributed, init_model_parallel
    from megatron_rl.layout.sizes import ParallelLayout

    if not torch.distributed.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_distributed(DistributedConfig(backend=backend, device=device.type, timeout_s=600))
    init_model_parallel(ParallelLayout())


def make_sequences(num: int, mean_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """``num`` prompt + response sequences of ``mean_len/2 .. 3*mean_len/2`` tokens, a quarter prompt,
    with the fields the actor loss reads (response mask, advantages, old and reference log-probs)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(2, mean_len // 2), max(3, mean_len * 3 // 2)
    seqs = []
    for _ in range(num):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompt = max(1, n // 4)
        mask = torch.zeros(n)
        mask[prompt - 1 : n - 1] = 1.0  # position t predicts token t+1: the response's tokens
        seqs.append({
            "tokens": torch.randint(0, vocab, (n,), generator=g),
            "loss_mask": mask,
            "advantages": torch.randn(n, generator=g) * mask,
            "old_logprob": (-torch.rand(n, generator=g) * 8 - 2) * mask,
            "ref_logprob": (-torch.rand(n, generator=g) * 8 - 2) * mask,
        })
    return seqs


def build_setup(args, device: torch.device) -> Setup:
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.batching import plan_microbatches

    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model_cfg = ModelConfig(**MODELS[args.model], params_dtype=dtype, transformer_impl="local",
                            max_position_embeddings=max(4096, 2 * args.seq_len))
    per_mb = max(1, args.tokens_per_microbatch // args.seq_len)
    seqs = make_sequences(per_mb * args.microbatches, args.seq_len, model_cfg.vocab_size)
    lengths = [int(s["tokens"].numel()) for s in seqs]
    budget = max(max(lengths), args.tokens_per_microbatch)
    groups = plan_microbatches(lengths, list(range(len(seqs))), max_tokens_per_rank=budget, micro_batch_size=None,
                               cp=1, align=1, packed=True, dp_group=None)
    valid = [int(s["loss_mask"].sum()) for s in seqs]
    return Setup(device, model_cfg, seqs, groups, budget, sum(lengths), sum(valid), valid)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def optim_config():
    from megatron_rl.config.schema import OptimConfig

    return OptimConfig(lr=1e-7, clip_grad=1.0)


# ----------------------------------------------------------------------------- megatron's own step


class PlainStep:
    """megatron-core's training step as ``pretrain_gpt`` runs it, on pre-built micro-batches."""

    def __init__(self, setup: Setup):
        from megatron.core.models.gpt import GPTModel

        from megatron_rl.data.microbatch import build_microbatch
        from megatron_rl.engine.trainable import make_trainable
        from megatron_rl.layout.sizes import ParallelLayout
        from megatron_rl.models.builder import build_gpt_chunks

        chunks = build_gpt_chunks(setup.model_cfg, ParallelLayout(), setup.device, model_cls=GPTModel)
        if setup.device.type == "cuda":  # pretrain_gpt --cross-entropy-loss-fusion
            chunks[0].config.cross_entropy_loss_fusion = True
            chunks[0].config.cross_entropy_fusion_impl = "native"
        self.trainable = make_trainable(chunks, optim_config(), total_steps=1000)
        self.setup = setup
        fields = ["tokens", "position_ids", "labels", "loss_mask"]
        self.batches = []
        for g in setup.groups:
            mb = build_microbatch([{k: setup.seqs[i][k] for k in ("tokens", "loss_mask")} for i in g], g, packed=True)
            self.batches.append((mb.to(setup.device, fields), mb.packed_seq_params(setup.device)))
        self.losses: list[float] = []

    def _forward_step(self, data_iterator, model, *extra):
        tensors, packed = next(data_iterator)
        per_token = model(tensors["tokens"], tensors["position_ids"], None, labels=tensors["labels"],
                          packed_seq_params=packed)
        mask = tensors["loss_mask"]

        def loss_func(output):  # pretrain_gpt's loss_func with calculate_per_token_loss
            loss = torch.sum(output.float() * mask)
            tokens = mask.sum().to(torch.int)
            return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

        return per_token, loss_func

    def run(self, forward_only: bool = False) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        chunk = self.trainable.chunks[0]
        if not forward_only:
            self.trainable.zero_grad()
        ctx = torch.no_grad() if forward_only else torch.enable_grad()
        with ctx:
            logs = get_forward_backward_func()(
                forward_step_func=self._forward_step, data_iterator=iter(self.batches), model=chunk,
                num_microbatches=len(self.batches), seq_length=self.setup.budget, micro_batch_size=1,
                forward_only=forward_only,
            )
        if not forward_only:
            self.trainable.optimizer.step()
        return logs

    def step(self) -> None:
        logs = self.run()
        if not self.losses:
            total = torch.stack([log["lm loss"] for log in logs]).sum(0)
            self.losses.append(float(total[0] / total[1]))

    def forward(self) -> None:
        self.run(forward_only=True)


# ----------------------------------------------------------------------------- our actor update


def _pieces_loss(alg, den: float, lengths: list, with_entropy: bool):
    """``log-probs`` / ``+ entropy``: -mean log-prob (minus the entropy bonus), token-mean."""
    from megatron_rl.algorithms import losses
    from megatron_rl.trainer.update import per_sequence_rows

    def loss_fn(outs: dict, t: dict, mb):
        rows = lambda x: per_sequence_rows(mb, x)  # noqa: E731
        mask = rows(t["loss_mask"])
        num, _ = losses.aggregate_parts(-rows(outs["logprob"]), mask, "token-mean")
        logs = {"actor/pg_loss": (num / den).detach()}
        if with_entropy:
            ent, _ = losses.entropy_bonus_parts(rows(outs["entropy"]), mask, "token-mean")
            num = num - alg.entropy_coef * ent
            logs["actor/entropy_loss"] = (ent / den).detach()
        return num / den, logs

    return loss_fn


class OurUpdate:
    """The trainer's actor update (``trainer/policy_update.py::update_actor``) with RL pieces switched on in turn."""

    def __init__(self, setup: Setup, weights_from=None):
        from megatron_rl.engine.forward import BatchPlan
        from megatron_rl.engine.trainable import make_trainable
        from megatron_rl.layout.sizes import ParallelLayout
        from megatron_rl.models.builder import build_gpt_chunks

        chunks = build_gpt_chunks(setup.model_cfg, ParallelLayout(), setup.device)
        if weights_from is not None:  # megatron's model: both sides start from the same weights
            chunks[0].load_state_dict(weights_from.state_dict(), strict=True)
        self.trainable = make_trainable(chunks, optim_config(), total_steps=1000)
        self.plan = BatchPlan(max_tokens_per_rank=setup.budget, micro_batch_size=None, packed=True)
        self.setup = setup
        self.losses: dict[str, float] = {}

    def step(self, piece: str, keep_logits: bool = True) -> None:
        from megatron_rl.config.schema import AlgorithmConfig
        from megatron_rl.distributed.metrics import reduce_sum_count, reduce_sums
        from megatron_rl.engine.forward import run_sequences
        from megatron_rl.models.heads import LogProbHead
        from megatron_rl.trainer.metrics import optimizer_step_metrics
        from megatron_rl.trainer.update import actor_loss_fn, actor_metric_names, loss_denominator

        level = RL_PIECES.index(piece)
        alg = AlgorithmConfig(entropy_coef=0.001 if level >= 1 else 0.0)
        seqs = self.setup.seqs
        if level < 3:  # the KL term reads the reference log-probs; before it, the field is absent
            seqs = [{k: v for k, v in s.items() if k != "ref_logprob"} for s in seqs]
        if level < 2:
            seqs = [{k: v for k, v in s.items() if k in ("tokens", "loss_mask")} for s in seqs]
        lengths = self.setup.valid_lengths  # the trainer knows them from the responses, off the device
        den = loss_denominator("token-mean", lengths)
        if level >= 2:
            loss_fn = actor_loss_fn(alg, den, lengths, kl_loss_coef=0.01 if level >= 3 else 0.0, horizon=None)
        else:
            loss_fn = _pieces_loss(alg, den, lengths, with_entropy=level >= 1)
        head = LogProbHead(with_entropy=level >= 1, **({} if keep_logits else {"keep_logits_bytes": 0}))
        self.trainable.zero_grad()
        _, logs = run_sequences(self.trainable.chunks, seqs, head, self.plan, self.setup.device, loss_fn=loss_fn,
                                forward_only=False)
        result = self.trainable.step()
        if level >= 4:  # what _update does with the step's logs
            reduce_sums(logs, ["actor/pg_loss", "actor/entropy_loss", "actor/kl_loss"])
            reduce_sum_count(logs, actor_metric_names(alg))
            optimizer_step_metrics("actor", [result])
        if piece not in self.losses:
            self.losses[piece] = sum(float(log["actor/pg_loss"]) for log in logs)

    def forward(self, which: str) -> None:
        from megatron_rl.engine.forward import run_sequences
        from megatron_rl.models.heads import LogProbHead

        head = LogProbHead(with_entropy=which == FORWARDS[0])
        seqs = [{"tokens": s["tokens"]} for s in self.setup.seqs]
        with torch.no_grad():
            run_sequences(self.trainable.chunks, seqs, head, self.plan, self.setup.device)


# ----------------------------------------------------------------------------- build + load


def _build(setup: Setup, model_cls=None):
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.models.builder import build_gpt_chunks

    kwargs = {} if model_cls is None else {"model_cls": model_cls}
    chunks = build_gpt_chunks(setup.model_cfg, ParallelLayout(), setup.device, initialize=False, **kwargs)
    return make_trainable(chunks, optim_config(), total_steps=1000)


def _megatron_sharded(trainable, loading: bool) -> dict:
    from megatron_rl.compat.megatron_fixes import distributed_optimizer_checkpoint_metadata

    state = {"model": trainable.chunks[0].module.sharded_state_dict()}
    state["optimizer"] = trainable.optimizer.sharded_state_dict(state, is_loading=loading,
                                                                metadata=distributed_optimizer_checkpoint_metadata())
    return state


def build_and_load(setup: Setup, plain: PlainStep, ours: OurUpdate, tmp: str) -> dict:
    """Seconds to build a model with its DDP and optimizer and load a checkpoint of weights and
    optimizer state into it: megatron's own way (``GPTModel``, ``dist_checkpointing.save`` /
    ``load`` of the model's and the optimizer's sharded state) against ours (``save_checkpoint`` /
    ``load_checkpoint``: the same dist_checkpointing underneath, plus the manifest, sha256 of every
    file and the architecture check).  Each model saves its own trained state first."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.engine.checkpoint import ModelPart, load_checkpoint, save_checkpoint

    out = {}
    megatron_dir = os.path.join(tmp, "megatron")
    os.makedirs(megatron_dir, exist_ok=True)
    dist_checkpointing.save(_megatron_sharded(plain.trainable, loading=False), megatron_dir)
    sync(setup.device)
    began = time.perf_counter()
    fresh = _build(setup, GPTModel)
    loaded = dist_checkpointing.load(_megatron_sharded(fresh, loading=True), megatron_dir)
    fresh.chunks[0].module.load_state_dict(loaded["model"], strict=True)
    fresh.optimizer.load_state_dict(loaded["optimizer"])
    sync(setup.device)
    out["megatron"] = time.perf_counter() - began
    del fresh, loaded
    part = ModelPart(ours.trainable.chunks, ours.trainable.optimizer, ours.trainable.scheduler)
    path = save_checkpoint(os.path.join(tmp, "ours"), 1, {"actor": part})
    sync(setup.device)
    began = time.perf_counter()
    fresh = _build(setup)
    load_checkpoint(path, {"actor": ModelPart(fresh.chunks, fresh.optimizer, fresh.scheduler)}, load_rng=False)
    sync(setup.device)
    out["ours"] = time.perf_counter() - began
    same = all(torch.equal(a, b) for a, b in zip(fresh.chunks[0].parameters(), ours.trainable.chunks[0].parameters()))
    out["ours_weights_equal"] = same
    return out


# ----------------------------------------------------------------------------- timing


def memory_allocated(device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def max_memory_allocated(device) -> int:
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else 0


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def timed(fn, device) -> float:
    sync(device)
    began = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - began


def measure(args, setup: Setup, log=print) -> dict:
    """Interleaved rounds of every variant; returns name -> list of seconds, and the loss check."""
    from megatron_rl.models.heads import LogProbHead

    built = time.perf_counter()
    plain = PlainStep(setup)
    sync(setup.device)
    plain_build_s, built = time.perf_counter() - built, time.perf_counter()
    ours = OurUpdate(setup, weights_from=plain.trainable.chunks[0].module)
    sync(setup.device)
    ours_build_s = time.perf_counter() - built
    variants = {PLAIN: plain.step}
    for piece in RL_PIECES:
        variants[piece] = (lambda p=piece: ours.step(p))
    if "keep_logits_bytes" in {f.name for f in dataclasses.fields(LogProbHead)}:  # not in releases before it
        variants[RECOMPUTED] = lambda: ours.step(RL_PIECES[-1], keep_logits=False)
    if args.forwards:
        variants[PLAIN_FORWARD] = plain.forward
        for which in FORWARDS:
            variants[which] = (lambda w=which: ours.forward(w))
    times: dict[str, list] = {name: [] for name in variants}
    first: dict[str, float] = {}
    peaks: dict[str, float] = {}
    before: dict[str, float] = {}
    for name, fn in variants.items():  # warm-up: allocator, first-call paths, the first losses
        sync(setup.device)
        reset_peak(setup.device)
        before[name] = memory_allocated(setup.device)
        first[name] = timed(fn, setup.device)
        peaks[name] = max_memory_allocated(setup.device)
    for r in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(timed(fn, setup.device))
        log(f"[update_vs_plain] round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in variants), file=sys.stderr)
    parity = abs(ours.losses["log-probs"] - plain.losses[0])
    loads = None
    if args.build_and_load:
        import shutil
        import tempfile

        tmp = tempfile.mkdtemp(prefix="update_vs_plain_")
        try:
            loads = build_and_load(setup, plain, ours, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"times": times, "first": first, "loss_plain": plain.losses[0], "loss_ours": ours.losses["log-probs"],
            "loss_parity": parity, "build_s": {"plain": plain_build_s, "ours": ours_build_s},
            "peak_bytes": peaks, "allocated_before": before,
            "build_and_load_s": loads}


def report(args, setup: Setup, result: dict) -> dict:
    times = result["times"]
    med = {name: statistics.median(ts) for name, ts in times.items()}
    tokens = setup.real_tokens
    rows = []
    base = med[PLAIN]
    for name in [n for n in (PLAIN, *RL_PIECES, RECOMPUTED) if n in med]:
        rows.append((name, med[name], tokens / med[name], base / med[name]))
    fwd_rows = []
    if PLAIN_FORWARD in med:
        fbase = med[PLAIN_FORWARD]
        for name in [PLAIN_FORWARD, *FORWARDS]:
            fwd_rows.append((name, med[name], tokens / med[name], fbase / med[name]))
    return {"rows": rows, "forward_rows": fwd_rows, "update_ratio": base / med[RL_PIECES[-1]],
            "first": result["first"], "build_s": result["build_s"], "build_and_load_s": result["build_and_load_s"],
            "forward_ratio": (med[PLAIN_FORWARD] / max(med[n] for n in FORWARDS)) if fwd_rows else None,
            "loss_parity": result["loss_parity"], "medians": med}


def print_report(args, setup: Setup, out: dict) -> None:
    m = setup.model_cfg
    print(f"model {args.model}: {m.num_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}, {m.params_dtype}; "
          f"{len(setup.seqs)} sequences, {setup.real_tokens} tokens ({setup.response_tokens} in the loss) in "
          f"{len(setup.groups)} packed micro-batches of <= {setup.budget} tokens; device {setup.device.type}, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; "
          f"median of {args.rounds} interleaved rounds")
    print("| training step | s/step | tokens/s | vs megatron-core |\n|---|---|---|---|")
    for name, s, tps, ratio in out["rows"]:
        print(f"| {name} | {s:.3f} | {tps:.0f} | {ratio:.2f}x |")
    if out["forward_rows"]:
        print("| experience forward | s/pass | tokens/s | vs megatron-core |\n|---|---|---|---|")
        for name, s, tps, ratio in out["forward_rows"]:
            print(f"| {name} | {s:.3f} | {tps:.0f} | {ratio:.2f}x |")
    print(f"actor update (all pieces) / megatron-core step: {out['update_ratio']:.2f}x")
    if out["forward_ratio"] is not None:
        print(f"slowest experience forward / megatron-core forward: {out['forward_ratio']:.2f}x")
    print(f"loss parity (our -mean log-prob vs megatron's cross-entropy, first step): |d| = {out['loss_parity']:.2e}")
    loads = out["build_and_load_s"]
    if loads:
        print(f"build + load of weights and optimizer state: megatron's dist_checkpointing {loads['megatron']:.2f} s, "
              f"ours {loads['ours']:.2f} s ({loads['ours'] / loads['megatron']:.2f}x; weights restored exactly: "
              f"{loads['ours_weights_equal']})")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="cpu")
    p.add_argument("--tokens-per-microbatch", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256, help="mean sequence length (prompt + response)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--no-forwards", dest="forwards", action="store_false", help="skip the experience forwards")
    p.add_argument("--build-and-load", action="store_true",
                   help="also time building a model and loading a checkpoint into it, megatron's way and ours")
    p.add_argument("--json", help="also write the figures here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    init_world(device)
    setup = build_setup(args, device)
    result = measure(args, setup)
    out = report(args, setup, result)
    print_report(args, setup, out)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({k: v for k, v in out.items()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
