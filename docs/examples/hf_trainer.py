"""Fine-tune a tiny Llama (built from a config, no download) with ODBTrainer.

    python docs/examples/hf_trainer.py                             # one process
    torchrun --nproc-per-node 2 docs/examples/hf_trainer.py        # DDP over Gloo on CPU
    torchrun --nproc-per-node 2 docs/examples/hf_trainer.py --resume   # continue from the last checkpoint

Needs ``pip install "odb-verified[hf]"``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from odb_tools.demo.synthetic import TokenDataset
from odb_torch.integrations.hf import ODBTrainer


def make_trainer(out_dir: str, epochs: float = 2, accum: int = 1, save_steps: int = 0, samples: int = 96,
                 trainer_cls: type[ODBTrainer] = ODBTrainer, budget: str = "padded", shared_tail: float = 0.0,
                 **kwargs: Any) -> ODBTrainer:
    """``budget="packed"``: padding-free rows (``packed_collate``); sdpa keeps the sequences
    apart once the model runs without a cache (``docs/packing.md``). ``shared_tail``: the
    loader's pool fraction (README, "Large worlds: the shared tail")."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=256, use_cache=budget == "padded"))
    args = TrainingArguments(
        output_dir=out_dir, num_train_epochs=epochs, gradient_accumulation_steps=accum,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=0.1,   # warmup: 10% of all samples
        logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=True, dataloader_num_workers=1, report_to=[], seed=0,
        disable_tqdm=True,
    )
    return trainer_cls(model=model, args=args, train_dataset=TokenDataset(samples),
                       token_budget=256, odb_kwargs={"buffer_size": 32, "timeout": 120, "budget": budget,
                                                     "shared_tail": shared_tail}, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/hf_example")
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    parser.add_argument("--packed", action="store_true", help="padding-free rows under the packed budget")
    a = parser.parse_args()
    trainer = make_trainer(a.out, a.epochs, a.accum, a.save_steps, budget="packed" if a.packed else "padded")
    result = trainer.train(resume_from_checkpoint=True if a.resume else None)
    if trainer.is_world_process_zero():
        m = result.metrics
        print(f"trained {m['train_samples_per_second'] * m['train_runtime']:.0f} samples in "
              f"{result.global_step} updates: {m['train_samples_per_second']:.1f} samples/s, "
              f"loss {m['train_loss']:.3f}")


if __name__ == "__main__":
    main()
