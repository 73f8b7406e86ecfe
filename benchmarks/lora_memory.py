"""What freezing saves: a Llama of 9.6 M parameters (``model=hf``, random weights, no download),
fully trained or with LoRA adapters (``model.lora.r=8``: 57,344 trainable parameters, the rest
frozen), under FSDP (W = 4) and FSLPP (G = 2, R = 2) in ``trainer.precision=bf16-mixed``, 5 steps.

Prints, from each run's ``metrics.json``: the whole model's gradient and optimizer-state bytes
(the profile's ``bytes.grads`` / ``bytes.optimizer``: trainable parameters only), the
weight-gradient sums and weight fetches of a step (received bytes summed over workers, predicted
and measured), and the largest worker's peak memory above its process's size before its stages
were materialised (``peak_memory_bytes`` minus ``base``, predicted and measured). docs/models.md
("Frozen weights and LoRA adapters") holds a run's table.

    python benchmarks/lora_memory.py            # four runs, about 2 minutes on 2 cores
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["model=hf", "model.arch=llama", "model.config.hidden_size=512", "model.config.intermediate_size=1024",
         "model.config.num_hidden_layers=4", "model.config.num_attention_heads=8",
         "model.config.num_key_value_heads=4", "stages=6", "microbatches=4", "data.batch_size=8", "data.seq_len=64",
         "trainer.max_steps=5", "trainer.precision=bf16-mixed", "logger=none"]
SCHEMES = {"fsdp": ["strategy=fsdp"], "fslpp G=2 R=2": ["strategy=fslpp", "G=2", "R=2"]}
TRAINED = {"all weights": [], "LoRA r=8": ["model.lora.r=8"]}
MIB = 2**20


def row(metrics: dict) -> list[str]:
    pw, by = metrics["per_worker"], metrics["profile"]["bytes"]
    mem, wgrad, weights = pw["peak_memory_bytes"], pw["traffic_bytes"]["wgrad"], pw["traffic_bytes"]["weights"]

    def pair(d: dict) -> str:
        return f"{sum(d['predicted']) / MIB:.2f} / {sum(d['measured']) / MIB:.2f} MiB"

    above = {k: max(x - b for x, b in zip(mem[k], mem["base"])) / MIB for k in ("predicted", "measured")}
    return [f"{sum(by['grads']) / MIB:.2f} / {sum(by['optimizer']) / MIB:.2f} MiB", pair(wgrad), pair(weights),
            f"{above['predicted']:.1f} / {above['measured']:.1f} MiB"]


def main() -> None:
    print("| scheme | trained | gradients / optimizer state (whole model) | weight-gradient sums, predicted / measured "
          "| weights fetched, predicted / measured | peak memory above base, predicted / measured |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (scheme, s_args) in enumerate(SCHEMES.items()):
            for j, (trained, t_args) in enumerate(TRAINED.items()):
                run = Path(tmp) / f"run{i}{j}"
                p = subprocess.run([sys.executable, "-m", "launcher", *s_args, *MODEL, *t_args,
                                    f"hydra.run.dir={run}"], capture_output=True, text=True)
                if p.returncode != 0:
                    sys.exit(p.stderr[-3000:])
                cells = row(json.loads((run / "metrics.json").read_text()))
                print("| " + " | ".join([scheme, trained, *cells]) + " |", flush=True)


if __name__ == "__main__":
    main()
