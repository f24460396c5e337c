"""DP-LoRA fine-tuning (gaussdp.finetune) vs the same non-private LoRA training: tokens/s and memory.

Both runs live in one process and train the same LoRA adapters (peft, rank 8, on the attention
projections; the base frozen) of the same base model, built from a config (no download), on the same
data: the documents of gensim's Lee corpus, one record each, truncated to 64 tokens, with the same
per-record loss (``gaussdp.finetune.train.per_record_loss``) and Adam. Batches: every step draws one
Poisson batch (expected 16 records) from the DP job's loader (``PrivacyEngine.make_private``, noise
and sampling from the OS CSPRNG, as a real job), and BOTH methods train on that same batch, so data,
batch and steps are identical; the order of the two alternates from step to step.

Cases: (a) GPT-2 width 128, 2 blocks, word vocabulary 4000 (LoRA on the fused ``c_attn`` Conv1D);
(b) GPT-2 width 256, 4 blocks; (c) Llama width 256, 2 blocks (LoRA on ``q_proj``, ``v_proj`` Linear).
One row per architecture a user fine-tunes (issue 32), each width 256, 2 blocks, 4 query heads and
2 key/value heads (grouped-query attention), the default LoRA targets (``q_proj``, ``v_proj``):
(qwen2) Qwen2, (llama) Llama, (mistral) Mistral, (gemma) Gemma, (phi) Phi.

Time: per repetition, a block of consecutive steps; tokens/s = non-padding tokens / seconds of the
forward + backward + optimizer step (wall clock, and the thread's CPU time, which with one torch
thread is what the step costs whatever other processes do); the median over repetitions is shown,
and the ratio is median(DP time / non-private time) per block. Not timed: loading, tokenising, the
plan. A job that reports progress also computes epsilon after every step: its cost
(``_epsilon_after``, one PLD self-composition) is shown separately and in the "with progress" ratio.

Memory: peak bytes of live tensor storages during one step (parameters, gradients, optimizer state,
activations, temporaries; ``PeakMemory`` from ``bench_dpsgd.py``, a ``TorchDispatchMode`` that sees
every op's output), for each method on the same batch; and the peak above the state during
backward + optimizer step alone, where the DP work happens (the whole step's peak is the forward's,
with the logits, for these models). Not tracemalloc (it does not see torch's
allocations) and not the RSS (dominated by the libraries).

Run: ``.venv/bin/python benchmarks/bench_finetune.py [--reps 7] [--block 5] [--only a,b,c] [--profile]``;
the architecture rows: ``--only qwen2,llama,mistral,gemma,phi``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dpsgd import PeakMemory
from gaussdp.finetune import FinetuneConfig, plan_finetune, tiny_causal_lm
from gaussdp.finetune.train import (
    _epsilon_after,
    _trim,
    load_base_model,
    per_record_loss,
    tokenize_records,
    wrap_lora,
)
from gaussdp.inference.tiny_lm import corpus_documents
from gaussdp.torch import PrivacyEngine

warnings.filterwarnings("ignore")

CASES = {
    "a": ("gpt2", 128, 2, 4),
    "b": ("gpt2", 256, 4, 4),
    "c": ("llama", 256, 2, 4),
    **{arch: (arch, 256, 2, 4) for arch in ("qwen2", "llama", "mistral", "gemma", "phi")},
}
ARCH_EXTRA: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": None},
    "gemma": {"head_dim": 64},
    "phi": {"partial_rotary_factor": 0.5},
}


def build_base(case: str, tmp: Path) -> Path:
    arch, width, layers, heads = CASES[case]
    gpt2 = tiny_causal_lm(tmp / "gpt2", vocab_size=4000, n_embd=width, n_layer=layers, n_head=heads)
    if arch == "gpt2":
        return gpt2
    if case == arch:  # a row per architecture: grouped-query attention, from the model type's config
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gpt2, local_files_only=True)
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(
            arch, num_hidden_layers=layers, hidden_size=width, intermediate_size=4 * width,
            num_attention_heads=heads, num_key_value_heads=heads // 2, vocab_size=len(tok),
            max_position_embeddings=128, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, **ARCH_EXTRA.get(arch, {}),
        )  # fmt: skip
        out = tmp / arch
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
        tok.save_pretrained(out)
        return out
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(gpt2, local_files_only=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        intermediate_size=4 * width,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=len(tok),
        max_position_embeddings=128,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    out = tmp / "llama"
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


class Jobs:
    """The DP job and its non-private twin, stepping on the same batches."""

    def __init__(self, model_dir: Path, config: FinetuneConfig) -> None:
        from torch.utils.data import DataLoader, TensorDataset

        base, tok = load_base_model(model_dir)
        records = corpus_documents()
        ids, mask = tokenize_records(tok, records, config.max_seq_len)
        self.plan = plan_finetune(config, n_records=len(records))
        torch.manual_seed(0)
        self.dp_model, _ = wrap_lora(copy.deepcopy(base), config)
        torch.manual_seed(0)
        self.plain_model, _ = wrap_lora(copy.deepcopy(base), config)
        self.dp_model.train()
        self.plain_model.train()
        lr = config.learning_rate
        dp_opt = torch.optim.Adam([p for p in self.dp_model.parameters() if p.requires_grad], lr=lr)
        self.plain_opt = torch.optim.Adam(
            [p for p in self.plain_model.parameters() if p.requires_grad], lr=lr
        )
        loader = DataLoader(TensorDataset(ids, mask), batch_size=config.batch_size, collate_fn=_trim)
        self.engine = PrivacyEngine(accountant=self.plan.accountant)
        _, self.dp_opt, self.loader = self.engine.make_private(
            module=self.dp_model,
            optimizer=dp_opt,
            data_loader=loader,
            noise_multiplier=self.plan.noise_multiplier,
            max_grad_norm=self.plan.clip_norm,
            loss_reduction="sum",
        )
        self.n_trainable = sum(p.numel() for p in self.dp_model.parameters() if p.requires_grad)
        self.n_total = sum(p.numel() for p in self.dp_model.parameters())
        self._it = iter(self.loader)

    def next_batch(self) -> tuple[Any, Any]:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)

    def dp_step(self, batch: tuple[Any, Any]) -> None:
        per = per_record_loss(self.dp_model, *batch)
        per.sum().backward()
        self.dp_opt.step()
        self.dp_opt.zero_grad()

    def plain_step(self, batch: tuple[Any, Any]) -> None:
        per = per_record_loss(self.plain_model, *batch)
        per.mean().backward()
        self.plain_opt.step()
        self.plain_opt.zero_grad()

    def live(self, which: str, batch: tuple[Any, Any]) -> list[torch.Tensor]:
        model = self.dp_model if which == "dp" else self.plain_model
        opt = self.dp_opt.original_optimizer if which == "dp" else self.plain_opt
        out = [*batch, *model.parameters(), *model.buffers()]
        for st in opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out


def peak(jobs: Jobs, which: str, batch: tuple[Any, Any]) -> int:
    """Peak live bytes during one whole step (state included)."""
    tracker = PeakMemory(*jobs.live(which, batch))
    with tracker:
        (jobs.dp_step if which == "dp" else jobs.plain_step)(batch)
    return tracker.peak


def backward_peak(jobs: Jobs, which: str, batch: tuple[Any, Any]) -> int:
    """Peak live bytes above the state during backward + optimizer step only: where the DP work
    (per-sample norms, clipping, noise) happens; the whole step's peak is usually the forward's."""
    model = jobs.dp_model if which == "dp" else jobs.plain_model
    opt = jobs.dp_opt if which == "dp" else jobs.plain_opt
    per = per_record_loss(model, *batch)
    loss = per.sum() if which == "dp" else per.mean()
    tracker = PeakMemory(*jobs.live(which, batch))
    base = tracker.current
    with tracker:
        loss.backward()
        opt.step()
        opt.zero_grad()
    return tracker.peak - base


def run_case(case: str, reps: int, block: int, profile: bool) -> None:
    arch, width, layers, _ = CASES[case]
    config = FinetuneConfig(noise_multiplier=1.0, delta=1e-5, batch_size=16, max_seq_len=64)
    with tempfile.TemporaryDirectory() as tmp:
        jobs = Jobs(build_base(case, Path(tmp)), config)
    for _ in range(2):  # warm up both
        b = jobs.next_batch()
        jobs.dp_step(b)
        jobs.plain_step(b)
    wall: dict[str, list[float]] = {"dp": [], "plain": []}
    cpu: dict[str, list[float]] = {"dp": [], "plain": []}
    toks: list[int] = []
    records: list[int] = []
    for r in range(reps):
        w = {"dp": 0.0, "plain": 0.0}
        c = {"dp": 0.0, "plain": 0.0}
        n_tok = 0
        for s in range(block):
            b = jobs.next_batch()
            n_tok += int(b[1].sum())
            records.append(len(b[0]))
            order = ("dp", "plain") if (r * block + s) % 2 == 0 else ("plain", "dp")
            for m in order:
                if m == "plain" and len(b[0]) == 0:
                    continue  # an empty Poisson batch: the DP step still adds noise
                t0, c0 = time.perf_counter(), time.thread_time()
                (jobs.dp_step if m == "dp" else jobs.plain_step)(b)
                w[m] += time.perf_counter() - t0
                c[m] += time.thread_time() - c0
        for m in ("dp", "plain"):
            wall[m].append(w[m])
            cpu[m].append(c[m])
        toks.append(n_tok)
    # epsilon after each step, as a job reporting progress computes it
    ks = list(range(1, jobs.plan.steps + 1, max(1, jobs.plan.steps // 10)))
    t0 = time.thread_time()
    for k in ks:
        _epsilon_after(jobs.plan, k)
    eps_cost = (time.thread_time() - t0) / len(ks)
    b = jobs.next_batch()
    mem = {m: peak(jobs, m, b) for m in ("dp", "plain")}
    b = jobs.next_batch()
    bwd = {m: backward_peak(jobs, m, b) for m in ("dp", "plain")}

    ratio_w = statistics.median(d / p for d, p in zip(wall["dp"], wall["plain"], strict=True))
    ratio_c = statistics.median(d / p for d, p in zip(cpu["dp"], cpu["plain"], strict=True))
    ratio_prog = statistics.median(
        (d + block * eps_cost) / p for d, p in zip(cpu["dp"], cpu["plain"], strict=True)
    )
    print(
        f"\ncase ({case}) {arch} width {width}, {layers} blocks: {jobs.n_total / 1e6:.2f} M parameters, "
        f"{jobs.n_trainable} LoRA; {len(records)} Poisson batches (mean {statistics.mean(records):.1f} "
        f"records, {statistics.mean(toks) / block:.0f} tokens per step)"
    )
    print(f"{'method':<14}{'tokens/s (wall)':>17}{'tokens/s (CPU)':>16}{'ms/step (CPU)':>15}{'peak MiB':>10}")
    for m, label in (("plain", "non-private"), ("dp", "DP (gaussdp)")):
        tw = statistics.median(t / x for t, x in zip(toks, wall[m], strict=True))
        tc = statistics.median(t / x for t, x in zip(toks, cpu[m], strict=True))
        print(
            f"{label:<14}{tw:>17,.0f}{tc:>16,.0f}{statistics.median(cpu[m]) / block * 1e3:>15.1f}"
            f"{mem[m] / 2**20:>10.2f}"
        )
    print(
        f"time ratio DP / non-private: {ratio_w:.2f}x wall, {ratio_c:.2f}x CPU (goal <= 1.25x); "
        f"with per-step epsilon for progress ({eps_cost * 1e3:.1f} ms CPU each): {ratio_prog:.2f}x CPU"
    )
    print(
        f"peak memory ratio DP / non-private: {mem['dp'] / mem['plain']:.2f}x (live tensor storages, whole "
        f"step); backward + step alone: {bwd['dp'] / 2**20:.2f} vs {bwd['plain'] / 2**20:.2f} MiB above the "
        f"state = {bwd['dp'] / bwd['plain']:.2f}x"
    )
    if profile:
        profile_steps(jobs)


def profile_steps(jobs: Jobs) -> None:
    """Where a DP step's time goes, beside the non-private step's (torch profiler, self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    batches = []
    for m in ("dp", "plain"):  # the DP job draws each batch from its loader; the twin reuses them
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(5):
                if m == "dp":
                    batches.append(jobs.next_batch())
                    jobs.dp_step(batches[i])
                elif len(batches[i][0]):
                    jobs.plain_step(batches[i])
        print(f"\nprofile, 5 steps, {m}:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--block", type=int, default=5, help="consecutive steps per timed block")
    ap.add_argument("--only", default="a,b,c", help="cases: a,b,c and/or qwen2,llama,mistral,gemma,phi")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is meaningful)")
    ap.add_argument("--profile", action="store_true", help="print torch profiler tables")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.reps} reps x "
        f"{args.block} steps, batch: Poisson, expected 16 records of at most 64 tokens"
    )
    for case in args.only.split(","):
        run_case(case, args.reps, args.block, args.profile)


if __name__ == "__main__":
    main()
