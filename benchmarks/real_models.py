"""Models this project did not write, under every scheme, through the command line: the measured
step time of each (median over the run's steps, from its metrics.json), for the README's "models
tried" table.

    python benchmarks/real_models.py                 # every model, every scheme, 10 steps each
    python benchmarks/real_models.py --steps 4 --models llama --json out.json
    python benchmarks/real_models.py --steps 4 --schemes gpipe --models falcon timm
    PYTHONPATH=benchmarks python benchmarks/real_models.py --steps 4 --schemes gpipe --models traced
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEMES = {"ddp": [], "fsdp": [], "gpipe": [], "lpp": ["G=2", "R=2"], "fslpp": ["G=2", "R=2"]}
CHARS = ["data.batch_size=16", "data.seq_len=32"]
HF = ["model=hf", "model.config.num_hidden_layers=2"]
TRACED = ["model=hf_traced", "model.config.num_hidden_layers=2"]
MODELS = {
    # name: (overrides, lines of user code it needs)
    "gpt2 (tied)": ([*HF, "model.arch=gpt2", *CHARS], 0),
    "llama (RoPE, GQA)": ([*HF, "model.arch=llama", *CHARS], 0),
    "qwen2 (tied, RoPE)": ([*HF, "model.arch=qwen2", "+model.config.tie_word_embeddings=true", *CHARS], 0),
    "timm resnet10t (BatchNorm)": (["model=timm", "data=images", "data.batch_size=16"], 0),
    "lightning demo transformer": (["model=custom", "model._target_=lightning.pytorch.demos.LightningTransformer",
                                    "+model.vocab_size=128", "split=auto", *CHARS], 0),
    "gpt_neox (parallel residual, partial RoPE)": ([*HF, "model.arch=gpt_neox", *CHARS], 0),
    "opt (tied, offset learned positions)": ([*HF, "model.arch=opt", *CHARS], 0),
    "phi3 (fused qkv, partial RoPE)": ([*HF, "model.arch=phi3", *CHARS], 0),
    "stablelm (partial RoPE)": ([*HF, "model.arch=stablelm", *CHARS], 0),
    "falcon (tied, ALiBi)": ([*HF, "model.arch=falcon", "+model.config.alibi=true", *CHARS], 0),
    "mixtral (MoE, 8 experts, top 2)": ([*HF, "model.arch=mixtral", *CHARS], 0),
    "timm vit_tiny_patch16_224 (32 x 32)": (["model=timm", "model.name=vit_tiny_patch16_224",
                                             "model.kwargs.img_size=32", "data=images", "data.batch_size=16"], 0),
    "timm convnext_atto": (["model=timm", "model.name=convnext_atto", "data=images", "data.batch_size=16"], 0),
    "timm mobilenetv3_small_050 (BatchNorm)": (["model=timm", "model.name=mobilenetv3_small_050", "data=images",
                                                "data.batch_size=16"], 0),
    "timm efficientnet_b0 (BatchNorm)": (["model=timm", "model.name=efficientnet_b0", "data=images",
                                          "data.batch_size=16"], 0),
    # traced and cut (no self.stages): Hugging Face LMs model=hf cannot cut at their decoder layers
    "t5 (encoder-decoder, traced)": ([*TRACED, "model.arch=t5", *CHARS], 0),
    "bart (encoder-decoder, traced)": ([*TRACED, "model.arch=bart", *CHARS], 0),
    "mbart (encoder-decoder, traced)": ([*TRACED, "model.arch=mbart", *CHARS], 0),
    "rwkv (recurrent state, traced)": ([*TRACED, "model.arch=rwkv", *CHARS], 0),
    # user code in benchmarks/user_models.py (run with PYTHONPATH=benchmarks), traced and cut
    "LSTM, dropout 0.2 (user code, traced)": (["model=custom", "model._target_=user_models.RecurrentLM",
                                               "split=auto", *CHARS], 16),
    "GRU, dropout 0.2 (user code, traced)": (["model=custom", "model._target_=user_models.RecurrentLM",
                                              "model.kind=GRU", "split=auto", *CHARS], 16),
    "diffusers UNet2DModel, DDPM step (user code, traced)": (["model=custom", "model._target_=user_models.Diffusion",
                                                             "data=images", "data.size=16", "data.batch_size=16",
                                                             "split=auto"], 20),
}


def run(overrides: list[str], scheme: str, steps: int, where: Path) -> float | None:
    cmd = [sys.executable, "-m", "launcher", f"strategy={scheme}", *SCHEMES[scheme], "stages=4", "microbatches=4",
           f"trainer.max_steps={steps}", "trainer.val_check_interval=1000", "logger=none",
           "trainer.enable_checkpointing=false", *overrides, f"hydra.run.dir={where}"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, COLUMNS="200"))
    if p.returncode != 0:
        print(f"  {scheme}: failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
        return None
    metrics = json.loads((where / "metrics.json").read_text())
    return float(metrics["latency_s"]["measured"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", nargs="*", default=None, help="substrings of the model names to run")
    ap.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=list(SCHEMES), help="the schemes to run")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (overrides, lines) in MODELS.items():
            if args.models and not any(m in name for m in args.models):
                continue
            print(name, flush=True)
            times = {s: run(overrides, s, args.steps, Path(tmp) / f"{len(rows)}-{s}") for s in args.schemes}
            rows[name] = {"overrides": overrides, "lines": lines,
                          "step_ms": {s: t and 1e3 * t for s, t in times.items()}}
    print("\n| model | command (add strategy=...) | lines of user code | " + " | ".join(args.schemes) + " |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in args.schemes) + " |")
    for name, r in rows.items():
        cells = " | ".join("failed" if t is None else f"{t:.0f}" for t in r["step_ms"].values())
        print(f"| {name} | `python -m launcher {' '.join(r['overrides'])}` | {r['lines']} | {cells} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
