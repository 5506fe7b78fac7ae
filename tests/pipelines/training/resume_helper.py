"""Train a small LoRA adapter with a checkpoint directory, in its own process (the SIGKILL test kills it).

python -m tests.pipelines.training.resume_helper CHECKPOINT_DIR OUT_DIR [EPOCHS]

Writes OUT_DIR/adapter (adapters.save) and OUT_DIR/result.json (fit's result) when training completes.
Exercises every stateful part of a resume: LoRA dropout (torch RNG), shuffling (the loop's
generator), AdamW moments, the LR schedule's step, best-epoch tracking, embeddings + LayerNorm biases.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pipelines.config import LoraTrainConfig
from pipelines.model import adapters
from pipelines.training.checkpoint import CheckpointStore
from pipelines.training.loop import LoopSettings, fit, seed_everything
from tests.pipelines.training.helpers import base, rows

LCFG = LoraTrainConfig(
    r=4, alpha=8, dropout=0.1, target_modules=("q_proj", "v_proj", "embeddings"), train_layernorm_bias=True
)


def main(ckpt: str, out: str, epochs: int) -> None:
    x, y = rows("2024-01-03", 3000)
    xv, yv = rows("2024-01-04", 400)
    seed_everything(7)
    model = adapters.attach(base(), LCFG)
    settings = LoopSettings(
        epochs=epochs, batch_size=64, lr=2e-3, weight_decay=0.01, warmup_steps=5, seed=7, patience=epochs
    )  # tracks and restores the best epoch, never stops early
    # The pause widens the window between a checkpoint landing and the next epoch, for the killer.
    result = fit(
        model, (x, y), settings, val=(xv, yv), checkpoint=CheckpointStore(ckpt), on_epoch=lambda m: time.sleep(0.2)
    )
    adapters.save(model, Path(out) / "adapter")
    (Path(out) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 6)
