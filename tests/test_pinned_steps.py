"""Three training steps of every Digits-M method config, pinned to the numbers recorded in `pinned_steps.json`.

Each case runs `main_pretrain.py fit` (or `main_linear.py fit`) on its shipped config as a user does, for three
optimizer steps, and records the last training loss and, per top-level module of the state dict (trunk, heads,
momentum encoder, queue, memory bank, class centres, ...), its parameters and its buffers apart, the fingerprint of
`tests/fingerprint.py`: a SHA-256 of the tensors' bytes, and the norms and random projections of the state and of
its change over the steps. A
change that is meant to keep every method's computation (a refactor, a move of plumbing) keeps these bit for
bit. The steps run in fp32 (`--trainer.precision 32-true`): the Digits-M configs' bf16 autocast is emulated on a
CPU without bf16 units, and rounds as the CPU's kernels do.

On the machine kind that recorded them (`torch.backends.cpu.get_cpu_capability()`, the CPU's maker and the torch
version) the loss and the bytes must be equal. An AVX-512 machine of the same maker checks the AVX2 recordings bit for
bit too: it computes every case in one process held to the AVX2 kernels (`fingerprint.HELD_TO_AVX2`, `ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`: the capability then reads AVX2), shared by the parallel workers. Elsewhere kernels
round differently: the loss and the fingerprints are compared to `TOLERANCE` (its comment says how it was
measured and what it cannot see), the tensors' names, shapes and dtypes and the integer tensors exactly, and, on a kind
that recorded its own bits in the file's `kinds` (`fingerprint.kernel_kind`), the loss and every part's SHA-256 bit for bit.

To record them anew, when a change is meant to alter the numbers (say why in its commit; an AVX-512 machine of the
recording's maker records them as its held process computes them, the AVX2 kernels'):

    CONTRASTLAB_REPIN=1 uv run --locked pytest tests/test_pinned_steps.py

`-k <case>` records some cases only; on a machine of another kind than the recording's that is refused (the file holds
one kind's numbers, and recording there starts it anew). Parallel workers add their cases under a lock on the file.
A case recorded anew loses every kind's bits. On a machine of another kind, once its numbers agree with the recording
to the tolerances (a case that does not is refused), this adds its own bits, which it then compares bit for bit:

    CONTRASTLAB_REPIN=kind uv run --locked pytest tests/test_pinned_steps.py tests/test_old_checkpoints.py
"""

import fcntl
import json
import multiprocessing
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import fingerprint
import torch
from fingerprint import (HELD_TO_AVX2, RECORDED_THREADS, bit_differences, differences, forget_kind_bits, held_like, initial_state, kernel_bits,
                         kernel_kind, loss_differs, machine, module_fingerprints, record_kind_bits)

import main_linear
import main_pretrain

ROOT = Path(__file__).parents[1]
PINNED = Path(__file__).with_name("pinned_steps.json")
STEPS = 3
# config, extra overrides: the Digits-M configs, and the method variants that have no Digits-M config of their own
CASES = {
    "moco_digits": ("moco_digits.yaml", []),
    "sce_digits": ("sce_digits.yaml", []),
    "ressl_digits": ("ressl_digits.yaml", []),
    "npid_digits": ("npid_digits.yaml", []),
    "npid_hard_digits": ("npid_digits.yaml", ["--model.init_args.loss=hard", "--model.init_args.num_hard=255"]),
    "simclr_digits": ("simclr_digits.yaml", []),
    "simclr_hard_digits": ("simclr_digits.yaml", ["--model.init_args.num_hard=64"]),
    "jcl_digits": ("jcl_digits.yaml", []),
    "supcon_digits": ("supcon_digits.yaml", []),
    "tcl_digits": ("tcl_digits.yaml", []),
    "tcl_ssl_digits": ("tcl_ssl_digits.yaml", []),
    "ce_digits_lt": ("ce_digits_lt.yaml", []),
    "balanced_softmax_digits_lt": ("balanced_softmax_digits_lt.yaml", []),
    "paco_digits_lt": ("paco_digits_lt.yaml", []),
    "paco_ride_digits_lt": ("paco_ride_digits_lt.yaml", []),
    "multitask_digits_lt": ("paco_digits_lt.yaml", ["--model.class_path=methods.MultiTaskContrast", "--model.init_args.classifier_loss=balanced_softmax"]),
    "barlow_twins_digits": ("barlow_twins_digits.yaml", []),
    "vicreg_digits": ("vicreg_digits.yaml", []),
    "swav_digits": ("swav_digits.yaml", []),
    "dino_digits": ("dino_digits.yaml", []),
    "linear_digits": ("linear_digits.yaml", ["--model.random_init=true", "--model.backbone.name=timm:test_resnet"]),
    "linear_tcl_digits": ("linear_tcl_digits.yaml", ["--model.random_init=true", "--model.backbone.name=timm:test_resnet"]),
    "byol_digits": ("byol_digits.yaml", []),
    "simsiam_digits": ("simsiam_digits.yaml", []),
    "mocov3_digits": ("mocov3_digits.yaml", []),
    # a quarter of the config's batch: the same computation, and a quarter of its 17 s in fp32 on one thread
    "mocov3_vit_digits": ("mocov3_vit_digits.yaml", ["--data.init_args.batch_size=32"]),
    "nnclr_digits": ("nnclr_digits.yaml", []),
}


# How far the numbers of another CPU kind may be from the recorded ones, relative to the recorded loss and to the
# recorded norms of each part (`fingerprint.differences`). Measured on an AVX512 machine by `tests/pinned_spread.py`
# (2026-11-27) against oneDNN held to SSE4.1 and MKL to SSE4.2, the largest differences over all cases were 6.0e-4 of
# the loss (barlow_twins_digits), 2.1e-3 of a state's norm, 1.8e-3 of a buffers' change and 5.6e-2 of a parameters'
# change (tcl_digits' trunk; barlow_twins 5.2e-2, vicreg 4.5e-2, supcon 4.3e-2); against the AVX2 recording 1.8e-5,
# 8.5e-4, 9.9e-4 and 5.3e-2 (tcl_digits); an Intel Xeon (AVX-512, AMX; 2026-11-28) against it 1.6e-5, 9.8e-4,
# 1.0e-3 and 6.0e-2 (tcl_digits). The tolerances are about 5 times those. So another kind sees a parameter
# update only to 30%: an EMA not applied or a swapped method, not an lr 10% off or a weight decay left out (its
# share of three steps' update is a few percent); the bit-for-bit comparisons above see every change. Two methods
# differ by far more: the change of CE's and Balanced Softmax's classifiers by 1.5 times its norm, of linear_digits'
# and linear_tcl_digits' probes by 1.2 (test_swapped_cases_fail_on_any_machine).
TOLERANCE = {"loss": 3e-3, "state": 1e-2, "change": 1e-2, "parameter_change": 0.3}


def three_steps(config: str, overrides: list[str], run_dir: Path) -> dict:
    """The loss after three steps of `config` and the fingerprint of every top-level module."""
    entry = main_linear if config.startswith("linear_") else main_pretrain
    cli = entry.cli_main([
        "fit", "--config", str(ROOT / "configs" / config), *overrides, f"--trainer.max_steps={STEPS}",
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", "--trainer.precision=32-true", f"--trainer.default_root_dir={run_dir}",
        "--trainer.callbacks+=fingerprint.InitialState", "--checkpoint.save_top_k=0",  # last.ckpt only: the numbers count here
    ])  # fmt: skip
    assert cli.trainer.global_step == STEPS
    return {
        "loss": cli.trainer.callback_metrics["train/loss"].item(),
        "modules": module_fingerprints(cli.model, initial_state(cli.trainer)),
    }


def recorded() -> dict:
    return json.loads(PINNED.read_text()) if PINNED.is_file() else {"machine": machine(), "cases": {}}


def mismatches(found: dict, expected: dict, same_machine: bool) -> list[str]:
    """How a case's numbers differ from the pinned ones: bit for bit on the recording machine, else to TOLERANCE."""
    if same_machine:
        problems = [] if found["loss"] == expected["loss"] else [f"loss {found['loss']!r} instead of {expected['loss']!r}"]
        if sorted(found["modules"]) != sorted(expected["modules"]):
            return problems + [f"modules {sorted(found['modules'])} instead of {sorted(expected['modules'])}"]
        return problems + [f"{name}: differs from the pinned state" for name, module in found["modules"].items() if module != expected["modules"][name]]
    problems = [f"loss {found['loss']!r} instead of {expected['loss']!r}"] if loss_differs(found["loss"], expected["loss"], TOLERANCE["loss"]) else []
    return problems + differences(found["modules"], expected["modules"], TOLERANCE)


def run_cases(out: Path, environment: dict[str, str]) -> dict:
    """Every case's loss and fingerprints, computed in a fresh process with `environment` added (read when torch
    loads), with the recording's threads and deterministic algorithms, as `three_steps` in the tests."""
    here = Path(__file__).parent
    code = (
        "import json, sys, tempfile, pathlib, torch, lightning as L\n"
        f"sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]\n"
        "import test_pinned_steps as pinned\n"
        f"torch.set_num_threads({RECORDED_THREADS}); torch.use_deterministic_algorithms(True)\n"
        "found = {}\n"
        "for case, (config, overrides) in pinned.CASES.items():\n"
        "    L.seed_everything(0, verbose=False)\n"
        "    with tempfile.TemporaryDirectory() as run:\n"
        "        found[case] = pinned.three_steps(config, overrides, pathlib.Path(run) / 'run')\n"
        f"pathlib.Path({str(out)!r}).write_text(json.dumps(found))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "WANDB_MODE": "disabled", **environment}, cwd=here.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:  # every case's test reports it: say why
        raise RuntimeError(f"the pinned cases' process ({' '.join(f'{key}={value}' for key, value in environment.items()) or 'this machine'}) failed:\n{result.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def held_results(tmp_path_factory) -> dict | None:
    """On a machine that can compute as the recording one (`fingerprint.held_like`), every case computed so, once
    for all parallel workers (the first takes the lock and writes the file; the others wait and read it)."""
    environment = held_like(recorded()["machine"])
    if environment is None:
        return None
    shared = tmp_path_factory.getbasetemp().parent if "PYTEST_XDIST_WORKER" in os.environ else tmp_path_factory.getbasetemp()
    results = shared / "pinned_steps_held.json"
    with (shared / "pinned_steps_held.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return json.loads(results.read_text()) if results.is_file() else run_cases(results, environment)


def record(case: str, found: dict, recording: dict) -> None:
    """Write one case's numbers as `recording`'s machine computes them into PINNED, read and written under a lock (the
    parallel workers each add their cases), without the other kinds' bits of the case. A file of another machine kind
    starts anew."""
    with os.fdopen(os.open(PINNED, os.O_RDWR | os.O_CREAT), "r+") as stream:
        fcntl.flock(stream, fcntl.LOCK_EX)
        text = stream.read()
        pinned = json.loads(text) if text else {"machine": recording, "cases": {}}
        pinned = forget_kind_bits(pinned, case) if pinned["machine"] == recording else {"machine": recording, "cases": {}}
        pinned["cases"][case] = found
        stream.seek(0)
        stream.truncate()
        stream.write(json.dumps(pinned, indent=1, sort_keys=True) + "\n")


def partial_repin(recording: dict, here: dict, selected: set[str]) -> str | None:
    """Why recording only the `selected` cases on `here` is refused: the file holds one machine kind's numbers, and a
    recording on another kind replaces them all."""
    missing = set(CASES) - selected
    if recording == here or not missing:
        return None
    return (f"CONTRASTLAB_REPIN=1 of some cases on {here}: {PINNED.name} holds every case as {recording} computes them, which "
            f"recording here would discard ({len(missing)} cases not selected, e.g. {min(missing)}): record them on a machine "
            "of that kind, or every case here (no -k)")


def selected_cases(session) -> set[str]:
    return {item.callspec.params["case"] for item in session.items if getattr(item, "originalname", None) == "test_three_training_steps_give_the_pinned_loss_and_state"}


def kind_on_its_recording(recording: dict) -> str:
    return f"CONTRASTLAB_REPIN=kind on {recording}, the kind that recorded {PINNED.name}: its numbers are compared bit for bit already"


@pytest.mark.parametrize("case", CASES)
def test_three_training_steps_give_the_pinned_loss_and_state(case, tmp_path, recorded_threads, held_results, request):
    pinned = recorded()
    repin = os.environ.get("CONTRASTLAB_REPIN")
    if held_results is not None:  # computed as the recording machine computes: bit for bit, or recorded as it
        if repin == "kind":
            pytest.fail(kind_on_its_recording(pinned["machine"]), pytrace=False)
        if repin == "1":
            record(case, held_results[case], pinned["machine"])
            return
        assert case in pinned["cases"], f"{case} is not pinned: record it with CONTRASTLAB_REPIN=1"
        assert mismatches(held_results[case], pinned["cases"][case], same_machine=True) == []
        return
    if repin == "1" and (refused := partial_repin(pinned["machine"], machine(), selected_cases(request.session))):
        pytest.fail(refused, pytrace=False)
    if repin == "kind" and pinned["machine"] == machine():
        pytest.fail(kind_on_its_recording(pinned["machine"]), pytrace=False)
    config, overrides = CASES[case]
    found = three_steps(config, overrides, tmp_path / "run")
    if repin == "1":
        record(case, found, machine())
        return
    assert case in pinned["cases"], f"{case} is not pinned: record it with CONTRASTLAB_REPIN=1"
    problems = mismatches(found, pinned["cases"][case], pinned["machine"] == machine())
    if repin == "kind":
        record_kind_bits(PINNED, case, found, problems)
        return
    kind_bits = pinned.get("kinds", {}).get(kernel_kind(), {})  # this kind's own bits, where it recorded them
    assert problems + (bit_differences(found, kind_bits[case]) if case in kind_bits else []) == []


def test_recording_some_cases_on_another_machine_kind_is_refused_and_every_case_or_on_its_own_kind_is_not():
    recording, here = {"torch": "2.15.0+cu132", "cpu_capability": "AVX2", "cpu_vendor": "AuthenticAMD"}, machine()
    other = here | {"cpu_vendor": "GenuineIntel" if here["cpu_vendor"] != "GenuineIntel" else "AuthenticAMD"}
    refused = partial_repin(recording, other, {"moco_digits"})
    assert refused.startswith("CONTRASTLAB_REPIN=1 of some cases on ") and f"{len(CASES) - 1} cases not selected" in refused
    assert partial_repin(recording, other, set(CASES)) is None  # the whole file recorded anew on this kind
    assert partial_repin(recording, recording, {"moco_digits"}) is None  # one case replaced among its own kind's


def test_recordings_of_parallel_workers_each_add_their_cases_to_the_file(tmp_path, monkeypatch):
    recording = machine()
    monkeypatch.setattr(sys.modules[__name__], "PINNED", tmp_path / "pinned.json")
    record("kept", {"loss": 1.0}, recording)
    context = multiprocessing.get_context("fork")  # the workers see the patched file
    workers = [context.Process(target=lambda w=w: [record(f"w{w}_{i}", {"loss": float(i)}, recording) for i in range(40)]) for w in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    pinned = json.loads((tmp_path / "pinned.json").read_text())
    assert pinned["machine"] == recording and set(pinned["cases"]) == {"kept", *(f"w{w}_{i}" for w in range(2) for i in range(40))}
    record("other", {"loss": 2.0}, recording | {"cpu_capability": "other"})  # another kind starts the file anew
    assert set(json.loads((tmp_path / "pinned.json").read_text())["cases"]) == {"other"}


def test_a_kinds_own_bits_are_compared_bit_for_bit_and_a_case_recorded_anew_loses_them(tmp_path, monkeypatch):
    pinned = recorded()
    moco, sce = pinned["cases"]["moco_digits"], pinned["cases"]["sce_digits"]
    monkeypatch.setattr(sys.modules[__name__], "PINNED", tmp_path / "pinned.json")
    PINNED.write_text(json.dumps({"machine": pinned["machine"], "cases": {"moco_digits": moco, "sce_digits": sce}}))
    record_kind_bits(PINNED, "moco_digits", moco, [])
    record_kind_bits(PINNED, "sce_digits", sce, [])
    kinds = json.loads(PINNED.read_text())["kinds"]
    assert kinds == {kernel_kind(): {"moco_digits": kernel_bits(moco), "sce_digits": kernel_bits(sce)}}
    bits = kinds[kernel_kind()]["moco_digits"]
    assert bit_differences(moco, bits) == []
    part = sorted(moco["modules"])[0]
    changed = {**moco, "modules": {**moco["modules"], part: {**moco["modules"][part], "sha256": "0" * 64}}}
    assert bit_differences(changed, bits) == [f"{part}: not the bits this machine kind recorded"]
    assert bit_differences({**moco, "loss": moco["loss"] * (1 + 2**-20)}, bits)[0].startswith("loss ")
    assert len(bit_differences(sce, bits)) == 1 + len(set(moco["modules"]) | set(sce["modules"]))  # the loss and every part
    record("moco_digits", moco, pinned["machine"])  # recorded anew: every kind's bits of it are gone, the others stay
    assert json.loads(PINNED.read_text())["kinds"] == {kernel_kind(): {"sce_digits": kernel_bits(sce)}}


def test_the_bits_of_numbers_beyond_the_tolerances_of_the_recording_are_not_recorded(tmp_path):
    pinned = recorded()
    path = tmp_path / "pinned.json"
    path.write_text(json.dumps(pinned))
    swapped = pinned["cases"]["balanced_softmax_digits_lt"]
    problems = mismatches(swapped, pinned["cases"]["ce_digits_lt"], same_machine=False)
    with pytest.raises(ValueError, match="^ce_digits_lt: this machine kind's bits not recorded, its numbers differ from pinned.json's"):
        record_kind_bits(path, "ce_digits_lt", swapped, problems)
    assert json.loads(path.read_text()) == pinned


def test_another_kernel_instruction_set_or_cache_size_is_another_machine_kind(tmp_path, monkeypatch):
    def kind(flags: str, l1_size: str) -> str:
        caches = tmp_path / l1_size
        (caches / "index0").mkdir(parents=True, exist_ok=True)
        for name, value in (("level", "1"), ("type", "Data"), ("size", l1_size)):
            (caches / "index0" / name).write_text(value + "\n")
        monkeypatch.setattr(fingerprint, "CACHES", caches)
        monkeypatch.setattr(fingerprint, "cpuinfo", lambda key: flags if key == "flags" else "GenuineIntel")
        return kernel_kind()

    assert kind("fma avx2 sse4_1", "48K") == kind("fma avx2", "48K")  # no kernel chooses by sse4_1 on these CPUs
    assert kind("fma avx2", "48K").endswith(f", GenuineIntel, {torch.backends.cpu.get_cpu_capability()}, fma avx2, L1d 48K")
    assert len({kind("fma avx2", "48K"), kind("fma avx2 avx512f", "48K"), kind("fma avx2", "32K")}) == 3


def test_an_unknown_repin_value_is_refused_before_any_test_runs(monkeypatch):
    import conftest

    monkeypatch.setenv("CONTRASTLAB_REPIN", "yes")
    with pytest.raises(pytest.UsageError, match="^CONTRASTLAB_REPIN='yes' \\(environment\\): 1 records the pinned numbers anew, kind adds"):
        conftest.pytest_configure(types.SimpleNamespace(option=types.SimpleNamespace()))


@pytest.mark.parametrize("case, other", [("ce_digits_lt", "balanced_softmax_digits_lt"), ("linear_digits", "linear_tcl_digits"), ("sce_digits", "ressl_digits")])
def test_swapped_cases_fail_on_any_machine(case, other):
    """Two methods' pinned numbers, swapped, fail the comparison on the recording machine and, to the tolerance, on
    any other (CE and Balanced Softmax share trunk and initialisation: their trunks differ only in the change)."""
    pinned = recorded()["cases"]
    for same_machine in (True, False):
        assert mismatches(pinned[other], pinned[case], same_machine)
        assert mismatches(pinned[case], pinned[other], same_machine)


def test_only_an_avx512_cpu_of_the_recording_maker_and_torch_is_held_to_the_avx2_kernels(monkeypatch):
    recording = {"torch": "2.15.0+cu132", "cpu_capability": "AVX2", "cpu_vendor": "AuthenticAMD"}
    for here, held in [
        ({**recording, "cpu_capability": "AVX512"}, HELD_TO_AVX2),
        ({**recording, "cpu_capability": "AVX512", "cpu_vendor": "GenuineIntel"}, None),  # other kernels held or not
        ({**recording, "cpu_capability": "AVX512", "torch": "2.16.0+cpu"}, None),
        (recording, None),  # the recording kind: compared as it is
    ]:
        monkeypatch.setattr(fingerprint, "machine", lambda here=here: here)
        assert held_like(recording) == held, here
