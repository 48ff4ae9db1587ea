"""odb_torch.packed_collate: the padding-free row Hugging Face models take, and
check_packed_attention, which refuses a model/attention combination that would let packed
sequences attend to each other (tests/test_packed_exactness.py compares the losses)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core.errors import ODBError, ODBWarning, PackedAttentionCostWarning, PackedAttentionError
from odb_torch import check_packed_attention, packed_collate
from odb_torch.losses import shifted_loss_tokens

transformers = pytest.importorskip("transformers")

from test_packed_exactness import VOCAB, one_thread, samples, tiny_model  # noqa: E402, F401 (one_thread: autouse)

rows = st.lists(st.lists(st.integers(-100, 1000), min_size=1, max_size=30), min_size=1, max_size=10)


@settings(max_examples=150, deadline=None)
@given(ids=rows, with_labels=st.booleans())
def test_the_row_concatenates_the_samples_with_positions_and_boundaries(ids, with_labels):
    """Every key the padding-free format needs, of the stated shape and dtype; positions
    restart at each boundary; each sample's first label is -100 and the rest are its own."""
    group = [{"input_ids": [abs(t) for t in r], **({"labels": r} if with_labels else {})} for r in ids]
    batch = packed_collate(group)
    total, lengths = sum(map(len, ids)), [len(r) for r in ids]
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, total)
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert batch[key].dtype == torch.int32 and batch[key].tolist() == cu
    assert batch["max_length_q"] == batch["max_length_k"] == max(lengths)
    assert batch["position_ids"][0].tolist() == [p for n in lengths for p in range(n)]
    for s, a, b in zip(group, cu, cu[1:], strict=False):
        assert batch["input_ids"][0, a:b].tolist() == s["input_ids"]
        expected = s.get("labels", s["input_ids"])
        assert batch["labels"][0, a:b].tolist() == [-100] + list(expected[1:])
    assert "attention_mask" not in batch
    assert int((batch["labels"][0, 1:] != -100).sum()) == sum(shifted_loss_tokens(s) for s in group)


def test_the_row_equals_hugging_faces_flattening_collator():
    flatten = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    group = samples()
    ours, theirs = packed_collate(group), flatten([{k: v.tolist() for k, v in s.items()} for s in group])
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert torch.equal(torch.as_tensor(ours[key]), torch.as_tensor(value)), key


def test_labels_of_another_length_name_the_sample():
    from odb_core.errors import InvalidSampleError

    with pytest.raises(InvalidSampleError, match="sample 1 of the group: 2 labels for 3 input_ids"):
        packed_collate([{"input_ids": [1]}, {"input_ids": [1, 2, 3], "labels": [1, 2]}])


@pytest.mark.parametrize("field, value, problem", [
    ("input_ids", torch.tensor([5.7, 9.2, 3.99]), "input_ids are torch.float32, not integer"),
    ("input_ids", torch.tensor([True, False, True]), "input_ids are torch.bool"),
    ("labels", [1, 9.6, 3.5], "labels are torch.float32"),
    ("labels", torch.tensor([[1, 2, 3]]), r"labels has shape \[1, 3\], not one row"),
    ("input_ids", torch.tensor([[1, 2, 3]]), r"input_ids has shape \[1, 3\], not one row"),
])
def test_ids_or_labels_that_are_not_one_row_of_integers_name_the_sample_and_field(field, value, problem):
    """A cast would truncate 5.7 to token 5 and a flattened [1, L] row would count its labels
    differently from shifted_loss_tokens (P7): each is refused, naming the sample and field."""
    from odb_core.errors import InvalidSampleError

    bad = {"input_ids": torch.tensor([4, 5, 6]), field: value}
    with pytest.raises(InvalidSampleError, match=f"sample 1 of the group: {problem}"):
        packed_collate([{"input_ids": [1, 2]}, bad])
    assert packed_collate([{"input_ids": []}, {"input_ids": [1, 2]}])["input_ids"].tolist() == [[1, 2]]


@pytest.mark.parametrize("bad, problem", [({"labels": [1, 2]}, "dict without input_ids"),
                                          ([1, 2], "list, not a mapping")])
def test_a_sample_without_input_ids_is_named(bad, problem):
    from odb_core.errors import InvalidSampleError

    with pytest.raises(InvalidSampleError, match=f"sample 1 of the group is a {problem}"):
        packed_collate([{"input_ids": [1, 2]}, bad])


def test_shifted_loss_tokens_refuses_labels_that_are_not_one_row():
    """Slicing [1, L] labels drops their one row, not the first position: 0 tokens counted where
    the collates' loss sums L - 1."""
    assert shifted_loss_tokens({"input_ids": [1, 2, 3], "labels": [1, 2, 3]}) == 2
    with pytest.raises(ValueError, match=r"labels has shape \[1, 3\]"):
        shifted_loss_tokens({"input_ids": [1, 2, 3], "labels": torch.tensor([[1, 2, 3]])})


def separated(model: torch.nn.Module) -> bool:
    """Whether the packed row's logits equal those of the sequences alone (forward only)."""
    group = samples()[:3]
    batch = packed_collate(group)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=s["input_ids"][None]).logits[0] for s in group])
    return bool((packed - alone).abs().max() < 1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_the_check_accepts_exactly_the_cpu_combinations_that_keep_sequences_apart(family, impl, use_cache):
    model = tiny_model(family, impl)
    model.config.use_cache = use_cache
    keeps_apart = separated(model)
    assert keeps_apart == (not use_cache)  # the cache switches transformers' per-sequence mask off
    if keeps_apart:
        assert check_packed_attention(model) == impl
    else:
        with pytest.raises(PackedAttentionError, match=f"{type(model).__name__}.*{impl}.*use_cache") as err:
            check_packed_attention(model)
        assert (err.value.model_class, err.value.attn_implementation) == (type(model).__name__, impl)
        assert isinstance(err.value, ODBError)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_bidirectional_config_is_refused_its_sequences_mix(family, impl):
    """``config.is_causal=False`` makes transformers' mask builder return a bidirectional mask
    built without position_ids: a packed sequence's logits moved by 0.08 with its neighbour's
    tokens, and the check accepted it."""
    model = tiny_model(family, impl)
    model.config.is_causal = False
    assert not separated(model)
    with pytest.raises(PackedAttentionError, match="is_causal=False") as err:
        check_packed_attention(model)
    assert (err.value.model_class, err.value.attn_implementation) == (type(model).__name__, impl)


def test_gemmas_bidirectional_attention_is_refused():
    """Gemma with ``use_bidirectional_attention``: alone, a sequence attends both ways; in a packed
    row it is masked causally, so the row's logits are not its sequences' (0.07 apart)."""
    config = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, use_cache=False,
                                      use_bidirectional_attention=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(config).double().eval()
    assert not separated(model)
    with pytest.raises(PackedAttentionError, match="use_bidirectional_attention"):
        check_packed_attention(model)


@pytest.mark.parametrize(("mode", "apart"), [(None, True), ("vision", True), ("all", False)])
def test_gemma4_is_refused_only_when_its_text_attends_both_ways(mode, apart):
    """Gemma 4's ``use_bidirectional_attention="vision"`` makes only image tokens attend both ways:
    its text model keeps packed sequences apart, yet was refused as bidirectional; ``"all"``
    mixes them and stays refused."""
    config = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, global_head_dim=8, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB, use_cache=False, use_bidirectional_attention=mode,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config).double().eval()
    assert separated(model) == apart
    if apart:
        assert check_packed_attention(model) == "sdpa"
    else:
        with pytest.raises(PackedAttentionError):
            check_packed_attention(model)


def test_flash_attention_is_accepted_whatever_the_cache():
    """Flash kernels read the boundaries from cu_seq_lens / position_ids (read from the code:
    transformers.modeling_flash_attention_utils; not run: no flash-attn here)."""
    model = tiny_model("llama", "sdpa")
    model.config.use_cache = True
    model.config._attn_implementation = "flash_attention_2"
    assert check_packed_attention(model) == "flash_attention_2"


def test_a_model_that_builds_its_own_mask_is_refused():
    """A transformers model whose modeling code does not use create_causal_mask (here one
    defined in this module) keeps a causal mask over the whole row: refused, and it does mix."""

    class OwnMask(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, position_ids=None, **kw):
            mask = torch.ones_like(input_ids)  # what a model building its own 2D mask passes on
            return super().forward(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **kw)

    model = tiny_model("llama", "sdpa")
    for module in model.modules():  # every configured module's code now lives in this test module
        if getattr(module, "config", None) is not None and module is not model:
            module.__class__ = type(f"Own{type(module).__name__}", (type(module),), {})
    model.__class__ = OwnMask
    assert not separated(model)
    with pytest.raises(PackedAttentionError, match="OwnMask.*create_causal_mask"):
        check_packed_attention(model)


def test_an_unknown_attention_implementation_is_refused_and_a_plain_module_is_the_callers():
    model = tiny_model("qwen2", "sdpa")
    model.config._attn_implementation = "my_kernel"
    with pytest.raises(PackedAttentionError, match="Qwen2ForCausalLM.*'my_kernel'"):
        check_packed_attention(model)
    assert check_packed_attention(torch.nn.Embedding(VOCAB, 4)) is None


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flex_attention", "flash_attention_2"])
def test_a_dense_mask_off_the_cpu_is_accepted_with_a_cost_warning(impl):
    """eager and sdpa keep packed sequences apart through a dense L_max x L_max mask: on the
    CPU silently, off it (here the meta device, where a model waits for its accelerator) with
    a PackedAttentionCostWarning naming the combination; flex and flash kernels skip the mask."""
    model = tiny_model("qwen2", "sdpa")
    model.config._attn_implementation = impl
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on the CPU
        assert check_packed_attention(model) == impl
    model.to("meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_packed_attention(model) == impl
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # where it will train, when given, decides: here the CPU
            assert check_packed_attention(model, "cpu") == impl
    costs = [w.message for w in caught if isinstance(w.message, PackedAttentionCostWarning)]
    if impl in ("eager", "sdpa"):
        assert len(costs) == 1 and "on meta" in str(costs[0]) and isinstance(costs[0], ODBWarning)
        assert (costs[0].model_class, costs[0].attn_implementation) == ("Qwen2ForCausalLM", impl)
    else:
        assert costs == []  # flex and flash kernels skip the mask (flash returns before the device matters)


def test_accelerate_checks_the_cost_on_the_accelerators_device():
    """A CPU model that Accelerate will move to its device: the warning names that device."""
    from odb_torch.integrations.accelerate import prepare

    with pytest.warns(PackedAttentionCostWarning, match="on meta"), pytest.raises(AcceleratorUntilPrepare.Stop):
        prepare(AcceleratorUntilPrepare("meta"), tiny_model("qwen2", "sdpa"), None, samples(), token_budget=64,
                budget="packed")


def test_other_fields_are_collated_and_a_carried_mask_is_left_out():
    batch = packed_collate([{"input_ids": [1, 2], "attention_mask": [1, 1], "idx": 4},
                            {"input_ids": [3], "attention_mask": [1], "idx": 2}])
    assert batch["idx"].tolist() == [4, 2] and "attention_mask" not in batch


class AcceleratorUntilPrepare:
    """An accelerator that only has a device: ``prepare`` stops the adapter (these tests end
    at the model check, which runs before it)."""

    class Stop(Exception):
        pass

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)

    def prepare(self, *objects: object) -> None:
        raise self.Stop


def refuse_hf(model: torch.nn.Module, tmp: str, use_cache: bool = True) -> Any:
    """Trainer sets ``model.config.use_cache = args.use_cache`` at init (default False), so the
    adapter checks the model after that: here the arguments keep the cache on."""
    from odb_torch.integrations.hf import ODBTrainer

    args = transformers.TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], warmup_steps=0.1,
                                          use_cache=use_cache)
    return ODBTrainer(model=model, args=args, train_dataset=samples(), token_budget=64,
                      odb_kwargs={"budget": "packed"})


def refuse_accelerate(model: torch.nn.Module, tmp: str) -> None:
    from odb_torch.integrations.accelerate import prepare

    prepare(AcceleratorUntilPrepare(), model, None, samples(), token_budget=64, budget="packed")  # checked first


def refuse_lightning(model: torch.nn.Module, tmp: str) -> None:
    pytest.importorskip("lightning")
    from odb_torch.integrations.lightning import ODBLightningCallback

    ODBLightningCallback(samples(), token_budget=64, budget="packed").on_fit_start(None, torch.nn.Sequential(model))


@pytest.mark.parametrize("start", [refuse_hf, refuse_accelerate, refuse_lightning])
def test_each_adapter_checks_the_model_before_training_packed_rows(start, tmp_path):
    model = tiny_model("llama", "sdpa")
    model.config.use_cache = True
    with pytest.raises(PackedAttentionError, match="LlamaForCausalLM.*sdpa.*use_cache"):
        start(model, str(tmp_path))


def test_the_hf_trainer_turns_the_cache_off_before_the_check(tmp_path):
    """With TrainingArguments' default use_cache=False the Trainer switches the model's cache
    off at init, so the same model is accepted and its packed rows stay apart."""
    model = tiny_model("llama", "sdpa")
    model.config.use_cache = True
    trainer = refuse_hf(model, str(tmp_path), use_cache=False)
    assert trainer.model.config.use_cache is False and separated(trainer.model)


def test_the_hf_trainer_checks_a_model_init_model_as_it_checks_a_model(tmp_path):
    """Trainer builds the model from ``model_init`` in ``__init__`` (and again in ``train()``): an
    architecture that mixes packed rows is refused there too, not trained silently."""
    from odb_torch.integrations.hf import ODBTrainer

    def model_init() -> torch.nn.Module:
        config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=16, ffn_dim=32, word_embed_proj_dim=16,
                                        num_hidden_layers=1, num_attention_heads=2, use_cache=False)
        return transformers.OPTForCausalLM(config)

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(PackedAttentionError, match="OPTForCausalLM.*'opt'"):
        ODBTrainer(model_init=model_init, args=args, train_dataset=samples(), token_budget=64,
                   odb_kwargs={"budget": "packed"})


def test_the_hf_trainer_refuses_a_forward_that_would_drop_the_packed_positions(tmp_path):
    """A wrapper whose forward names (input_ids, labels) only: the Trainer's input pruning would
    drop position_ids, so the row would reach the model as one sequence; padded, it is accepted."""
    from odb_torch.integrations.hf import ODBTrainer

    class Wrapper(torch.nn.Module):
        def __init__(self, lm: torch.nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, labels=None):
            return self.lm(input_ids=input_ids)

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    kw = dict(args=args, train_dataset=samples(), token_budget=64)
    with pytest.raises(PackedAttentionError, match=r"Wrapper.forward\(input_ids, labels\) takes no position_ids"):
        ODBTrainer(model=Wrapper(tiny_model("llama", "sdpa")), odb_kwargs={"budget": "packed"}, **kw)
    ODBTrainer(model=Wrapper(tiny_model("llama", "sdpa")), **kw)


def test_the_budget_keyword_reaches_the_config_through_from_dataloader_and_picks_the_adapters_collate():
    from torch.utils.data import DataLoader

    from odb_torch import from_dataloader, pad_collate
    from odb_torch.integrations.accelerate import odb_loader
    from odb_torch.integrations.lightning import ODBLightningCallback

    loader = from_dataloader(DataLoader(samples(), batch_size=2), token_budget=64, budget="packed", rank=0, world_size=1)
    assert loader.config.budget == "packed"
    accelerator = type("Acc", (), {"process_index": 0, "num_processes": 1})()
    for budget, collate in (("packed", packed_collate), ("padded", pad_collate)):
        assert odb_loader(accelerator, samples(), token_budget=64, budget=budget)._spec.collate_fn is collate
        assert ODBLightningCallback(samples(), token_budget=64, budget=budget).loader_kwargs["collate_fn"] is collate


def test_the_trl_adapter_refuses_the_packed_budget_naming_the_field():
    pytest.importorskip("trl")
    from odb_core.errors import UnsupportedSettingError
    from odb_torch.integrations.trl import ODBSFTTrainer

    with pytest.raises(UnsupportedSettingError, match="budget='packed'") as err:
        ODBSFTTrainer(model=None, args=object(), token_budget=64, odb_kwargs={"budget": "packed"})
    assert err.value.fields == ("budget",)
