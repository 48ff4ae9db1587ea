"""Supervised fine-tuning with TRL's SFTTrainer on ODB batches (ODBSFTTrainer); nothing downloaded.

    python docs/examples/trl_sft.py                                    # conversations, one process
    python docs/examples/trl_sft.py --data text                        # plain text
    torchrun --nproc-per-node 2 docs/examples/trl_sft.py               # DDP over Gloo on CPU
    torchrun --nproc-per-node 2 docs/examples/trl_sft.py --resume      # continue from the last checkpoint

A tiny Llama built from a config and a word-level tokenizer built in code (with a chat
template that marks the assistant's turns for ``assistant_only_loss``) stand in for a real
model and tokenizer; the conversations and texts are synthetic. TRL applies the chat
template, tokenizes and masks; ODB batches. Needs ``pip install "odb-verified[trl]"``.
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # no network needed (TRL pings the Hub otherwise)

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig  # noqa: E402

from odb_torch.integrations.trl import ODBSFTTrainer  # noqa: E402

WORDS = ("the a and to of in is it that for on with as this was you he she we they can will not but or "
         "what how why when where who ask tell show model data batch token budget rank loss train step epoch "
         "long short sample shard group buffer queue worker fast slow yes no please thanks hello "
         "answer question sure maybe here there").split()
SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }} "
    "{%- if message['role'] == 'assistant' %} {% generation %}{{ message['content'] }} <|im_end|>{% endgeneration %}"
    "{%- else %} {{ message['content'] }} <|im_end|>{%- endif %} {% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over :data:`WORDS`, with ChatML-like special tokens and a chat template."""
    vocab = {token: i for i, token in enumerate(SPECIAL + ROLES + WORDS + [".", "?", ","])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def sentence(rng: random.Random, long: bool) -> str:
    """Words and punctuation; mostly short, sometimes long (heavy-tailed, like chat data)."""
    n = rng.randint(20, 50) if long else rng.randint(2, 12)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + rng.choice([" .", " ?"])


def conversations(n: int, seed: int = 0) -> Dataset:
    """``n`` conversations of 1-3 user/assistant exchanges (a ``"messages"`` column)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns.append({"role": "user", "content": sentence(rng, long=False)})
            turns.append({"role": "assistant", "content": sentence(rng, long=i % 5 == 0)})
        rows.append({"messages": turns})
    return Dataset.from_list(rows)


def texts(n: int, seed: int = 0) -> Dataset:
    """``n`` plain texts of 1-4 sentences (a ``"text"`` column)."""
    rng = random.Random(seed)
    return Dataset.from_list([{"text": " ".join(sentence(rng, long=i % 5 == 0) for _ in range(rng.randint(1, 4)))}
                              for i in range(n)])


def tiny_llama(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A 2-layer Llama of width 32 over the tokenizer's vocabulary (random weights, seed 0)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None))


def make_trainer(out_dir: str, data: str = "conversational", epochs: float = 2, accum: int = 2,
                 save_steps: int = 0, samples: int = 64, trainer_cls: type[ODBSFTTrainer] = ODBSFTTrainer,
                 sft_args: dict[str, Any] | None = None, model: Any = None, **kwargs: Any) -> ODBSFTTrainer:
    """The example's trainer. ``sft_args`` add or override ``SFTConfig`` settings; ``model`` replaces the Llama."""
    tokenizer = make_tokenizer()
    model = model if model is not None else tiny_llama(tokenizer)
    settings: dict[str, Any] = dict(
        output_dir=out_dir, num_train_epochs=epochs, gradient_accumulation_steps=accum,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=0.1,   # warmup: 10% of all samples
        max_length=256, assistant_only_loss=data == "conversational",      # loss on the assistant's turns only
        logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=True, bf16=False, activation_checkpointing=False, dataloader_num_workers=1, report_to=[], seed=0,
        disable_tqdm=True,
    )
    args = SFTConfig(**{**settings, **(sft_args or {})})
    dataset = conversations(samples) if data == "conversational" else texts(samples)
    return trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                       token_budget=256, odb_kwargs={"buffer_size": 32, "timeout": 120}, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/trl_example")
    parser.add_argument("--data", choices=["conversational", "text"], default="conversational")
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    a = parser.parse_args()
    trainer = make_trainer(a.out, a.data, a.epochs, a.accum, a.save_steps)
    result = trainer.train(resume_from_checkpoint=True if a.resume else None)
    if trainer.is_world_process_zero():
        m = result.metrics
        print(f"trained {m['train_samples_per_second'] * m['train_runtime']:.0f} samples in "
              f"{result.global_step} updates: {m['train_samples_per_second']:.1f} samples/s, "
              f"loss {m['train_loss']:.3f}")


if __name__ == "__main__":
    main()
