"""Peak memory of one training step (forward + backward, then the optimizer's step) on one shape.

* CPU: the step runs in a child forked from the process holding the built model; the figure
  is the parent's RSS plus the child's growth during the step (its ``VmHWM`` less its RSS
  at the start, the high-water mark reset through ``/proc/self/clear_refs``). The child first
  runs the step on one token, so code pages the parent already holds (a forked child's RSS
  counts only the pages it touches) are not counted twice. Each measurement starts from
  the same state, unpolluted by earlier ones; it runs on one thread (a forked process cannot
  use the parent's OpenMP pool), which changes no tensor's size. A child killed
  (out of memory) or raising counts as not fitting, with the reason.
* GPU: in process, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``
  (one step from an emptied cache: a training run's changing shapes also fragment the caching
  allocator, so a run needs room beyond it, README "odb tune");
  ``torch.cuda.OutOfMemoryError`` counts as not fitting.

With an optimizer, the step runs twice so the second runs with its state resident (AdamW:
two tensors per parameter), as every step after the first does in training.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import select
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from odb_tools.tune.model import call_loss
from odb_tools.tune.shapes import Shape

OPTIMIZERS = ("none", "sgd", "adamw")


@dataclass(frozen=True)
class Measurement:
    """One shape's peak (bytes; None when it failed) and the failure, if any."""

    shape: Shape
    peak: int | None
    error: str | None = None


def make_optimizer(model: nn.Module, optimizer: str) -> torch.optim.Optimizer | None:
    """The optimizer whose state a measured step keeps resident (:data:`OPTIMIZERS`; None for "none")."""
    if optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-6)
    if optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-6)
    return None


def train_step(model: nn.Module, shape: Shape, vocab_size: int, device: str, optimizer: str) -> None:
    """Forward + backward on ``shape`` (twice, each followed by a step, with an optimizer)."""
    batch = shape.tensors(vocab_size, device)
    opt = make_optimizer(model, optimizer)
    for _ in range(1 if opt is None else 2):
        call_loss(model, batch).backward()  # type: ignore[no-untyped-call]
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)


def measure_cpu(model: nn.Module, shape: Shape, vocab_size: int, optimizer: str = "none",
                timeout: float = 3600.0) -> Measurement:
    """This process's RSS plus the growth of a forked child that runs :func:`train_step` (Linux);
    ``TimeoutError`` (the child killed) when it gives no result within ``timeout`` seconds."""
    peak, error = peak_in_child(model, lambda: train_step(model, shape, vocab_size, "cpu", optimizer), vocab_size,
                                optimizer, shape, f"measuring {shape.label()}", timeout)
    return Measurement(shape, peak, error)


def peak_in_child(model: nn.Module, run: Callable[[], None], vocab_size: int, optimizer: str, like: Shape,
                  what: str, timeout: float = 3600.0) -> tuple[int | None, str | None]:
    """(this process's RSS plus the growth of a forked child over ``run()``, None) or (None, the
    failure: out of memory, or killed); :class:`ModelStepError` when the step failed otherwise; the
    child first runs a step on one token of ``like``'s kind, so the code pages the
    parent holds are not counted twice. ``TimeoutError`` naming ``what`` when the child gives no result in time."""
    parent = baseline_bytes("cpu")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report, exit without running the parent's cleanup
        os.close(read_fd)
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool did not survive the fork (using it hangs)
            train_step(model, Shape(like.kind, 1, 1, like.cutoff), vocab_size, "cpu", optimizer)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the high-water mark restarts at the current RSS
            start = baseline_bytes("cpu")
            run()
            report: dict[str, int | str | bool] = {"peak": parent + max(_vm_hwm() - start, 0)}
        except BaseException as exc:  # any failure is reported: out of memory is this measurement's result
            report = {"error": f"{type(exc).__name__}: {exc}"[:300], "memory": out_of_memory(exc)}
        os.write(write_fd, json.dumps(report).encode())
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        if not select.select([f], [], [], timeout)[0]:  # no report and no exit: a hung child
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"{what}: the forked child gave no result in {timeout:g} s")
        raw = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return None, f"child killed by {signal.Signals(sig).name} (out of memory?)"
    got = json.loads(raw or b'{"error": "child exited without a report"}')
    if not got.get("memory", True):
        raise ModelStepError(f"{what}: the model's training step failed, not for memory: {got['error']}")
    return got.get("peak"), got.get("error")


class ModelStepError(ValueError):
    """The model's training step raised something other than running out of memory (a shape it
    cannot take, inputs it refuses): no budget can fit, so ``odb tune`` reports it and stops."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed (``MemoryError``, torch's ``OutOfMemoryError``, a CPU
    allocator's "can't allocate memory"), rather than that the model cannot run the step."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "allocate" in str(exc).lower()


def measure_cuda(model: nn.Module, shape: Shape, vocab_size: int, optimizer: str = "none") -> Measurement:
    """``torch.cuda.max_memory_allocated`` over :func:`train_step` on the model's device."""
    device = str(next(model.parameters()).device)
    peak, error = peak_on_cuda(model, lambda: train_step(model, shape, vocab_size, device, optimizer),
                               torch.cuda.max_memory_allocated)
    return Measurement(shape, peak, error)


def peak_on_cuda(model: nn.Module, run: Callable[[], None], peak: Callable[[], int]) -> tuple[int | None, str | None]:
    """(``peak()``, None) after ``run()`` from an emptied cache with its peaks reset, or (None, the
    error) on ``torch.cuda.OutOfMemoryError``; :class:`ModelStepError` for any other failure; the
    model's gradients dropped and the cache emptied after. All on the model's device (the
    current device while it runs: a model on ``cuda:1`` is measured there, not on ``cuda:0``)."""
    with torch.cuda.device(next(model.parameters()).device):
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            run()
            torch.cuda.synchronize()
            return int(peak()), None
        except torch.cuda.OutOfMemoryError as exc:
            return None, f"OutOfMemoryError: {str(exc)[:200]}"
        except Exception as exc:  # the model cannot run the step: no budget will fit
            raise ModelStepError(f"the model's training step failed, not for memory: {type(exc).__name__}: "
                                 f"{str(exc)[:300]}") from exc
        finally:
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()


def cuda_fraction(device: torch.device | str, limit: int) -> tuple[int, float]:
    """(the device's index, ``limit`` as a fraction of its memory, at most 1) for
    ``torch.cuda.set_per_process_memory_fraction``; ValueError for a limit that is not positive."""
    if limit <= 0:
        raise ValueError(f"a memory limit must be positive, got {limit}")
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return index, min(limit / torch.cuda.get_device_properties(index).total_memory, 1.0)


@contextmanager
def capped_cuda(device: torch.device | str, limit: int) -> Iterator[None]:
    """Inside, the caching allocator on ``device`` holds at most ``limit`` bytes, as on a card of
    that size: past it, it frees its cache and retries, and raises ``OutOfMemoryError`` only when
    the blocks it holds cannot serve the request. Without a cap, it keeps a larger card's every
    freed block, and ``max_memory_reserved`` overstates what a run needs (an H200 replaying packed
    rows at L_max 11,264 held all its 142 GB). A cap the process already had stays the tighter
    one inside, and is restored after."""
    index, fraction = cuda_fraction(device, limit)
    current = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    before = float(current(index)) if current is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(min(fraction, before), index)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, index)


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def warm_up(model: nn.Module, vocab_size: int, device: str, optimizer: str) -> None:
    """One step on one token, so the process's baseline holds the code pages a step touches;
    :class:`ModelStepError` when it fails other than by running out of memory (which propagates)."""
    try:
        train_step(model, Shape("padded", 1, 1, 1), vocab_size, device, optimizer)
    except Exception as exc:
        if out_of_memory(exc):
            raise
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line: the CLI prints it as the error
        raise ModelStepError(f"warming up (one step on one token): the model's training step failed, not for "
                             f"memory: {cause[:300]}") from exc


def baseline_bytes(device: str) -> int:
    """What is held before any step: this process's RSS (CPU) or allocated bytes (GPU)."""
    if device == "cpu":
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return int(torch.cuda.memory_allocated())
