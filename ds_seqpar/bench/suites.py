"""The one list of ``ds-seqpar bench`` suites: name -> what it measures, in one line. Each suite is the module
of that name beside this one (``main(argv) -> int``), and the rows it writes carry that name as their suite
(report/rows.py). Everything else that names the suites reads them from here: bench/main.py's dispatch and
``ds-seqpar bench --list``, the attention suite's help, cli.py's help; docs/benchmarks.md gives each its
command (tests/tools/test_bench_suites.py holds all of them to this table).
"""
from __future__ import annotations

DEFAULT = "attention"         # ``ds-seqpar bench [options]`` with no suite named

SUITES = {
    "attention": "every strategy vs the single-process kernels and DeepSpeed's Ulysses, bytes vs the closed forms, "
                 "the training step (--preset quick, full, ring, lasp, ulysses)",
    "packed": "packed documents vs one document per strategy, masked vs sub-blocks",
    "window": "sliding windows, softcap and sinks vs plain attention, work ratios, bytes",
    "hybrid": "one layer per hybrid family sharded vs unsharded, bytes; a hybrid's training step vs an equal Llama",
    "gpu": "one device: each local kernel alone, one rank's share of each strategy eager vs compiled",
    "trainer": "the HF Trainer with every strategy vs plain data parallelism and DeepSpeed's ALST; its overhead",
    "memory": "peak memory per rank of a training step, with and without the memory features, P = 1, 2, 4",
    "dynamic": "size \"dynamic\" vs every static size on real document lengths",
    "posttrain": "a DPO and a GRPO step P=2 vs 1; the log-prob path's peak, fused vs full logits",
    "generate": "model.generate over the sharded KV cache: prefill and decode P=2 vs 1, cache and merge bytes",
    "compile": "torch.compile vs eager: the main job's training step (own LM, tiny Llama) and the attention alone",
    "models": "long-context model kinds (DeepSeek sparse attention, a video-language model): a training step "
              "P ranks vs the unsharded model, bytes vs the closed forms",
}


def listing() -> str:
    """One line per suite, as ``ds-seqpar bench --list`` prints it."""
    width = max(map(len, SUITES))
    return "\n".join(f"{name:<{width}}  {what}" for name, what in SUITES.items())


__all__ = ["DEFAULT", "SUITES", "listing"]
