"""One set of versions (issue 35 item 4): the venv the tests run in holds exactly the versions of
constraints/lock.txt, the file `make setup` / `make demo` and `make setup-verl` / `make test` all install with, so the
demo and the tests run the same code. And no code leans on how transformers wraps its functions (5.25 wraps the
gated-delta-rule functions of its Qwen3.5 / Qwen3-Next modeling in a kernel-hub module)."""

from __future__ import annotations

import re
import sysconfig
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "constraints" / "lock.txt"
NOT_PINNED = {"megatron-branch", "pip", "setuptools", "wheel"}
"""The project itself (editable) and the installer's own tools, which a venv brings."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _public(version: str) -> str:
    return version.split("+")[0]  # 2.13.0+cpu is 2.13.0 with a local label; `==2.13.0` matches it


def lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints/lock.txt: not a pin: {line!r}"
            pins[_norm(name)] = version
    return pins


def installed() -> dict[str, str]:
    """What `pip freeze` lists: the venv's site-packages only (not sys.path at large: once setuptools is imported,
    its vendored packages' metadata is on sys.path too)."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {
        _norm(d.metadata["Name"]): d.version for d in metadata.distributions(path=paths) if d.metadata["Name"]
    }


def test_the_venv_holds_the_locked_versions() -> None:
    pins, have = lock(), installed()
    unpinned = sorted(set(have) - set(pins) - NOT_PINNED)
    assert not unpinned, f"installed but not in constraints/lock.txt: {unpinned}"
    wrong = {n: (v, pins[n]) for n, v in have.items() if n in pins and _public(v) != pins[n]}
    assert not wrong, f"installed version != constraints/lock.txt: {wrong}"
    assert {"torch", "transformers", "megatron-core"} <= set(have)


def test_the_makefile_installs_with_the_one_lock() -> None:
    make = (ROOT / "Makefile").read_text()
    assert "LOCK := constraints/lock.txt" in make and "-c $(LOCK)" in make
    installs = [
        ln.strip() for ln in make.splitlines() if "pip install" in ln or ln.strip().startswith("$(PIP)")
    ]
    ours = [ln for ln in installs if "LATEST_VENV" not in ln]  # test-latest is the unlocked canary
    assert ours and all(ln.startswith("$(PIP)") or "-c $(LOCK)" in ln for ln in ours), ours
    assert not (ROOT / "constraints" / "verl.txt").exists()  # one file, not two sets
    test_target = make[make.index("\ntest:") :].split("\n\n")[0]
    assert "test-latest" not in test_target  # the canary is not part of CI's `make test`


def test_no_code_leans_on_how_transformers_wraps_its_functions() -> None:
    """Names transformers wraps with use_kernel_func_from_hub_with_fallback (5.24 / 5.25): imported, patched or
    inspected from transformers' modeling modules, they change with its kernel hub. Our code and tests use
    megatron-core's torch_chunk_gated_delta_rule and HF models as a whole, never these."""
    wrapped = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
               "causal_conv1d_update", "causal_conv1d_forward", "use_kernel_func_from_hub")  # fmt: skip
    offenders = []
    for folder in ("megatron_branch", "tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__):
                continue
            text = path.read_text()
            for m in re.finditer(r"transformers\.models\.[\w.]+ import ([^\n]+)", text):
                offenders += [f"{path.relative_to(ROOT)}: {name}" for name in wrapped if name in m.group(1)]
            if "use_kernel_func_from_hub" in text:
                offenders.append(f"{path.relative_to(ROOT)}: use_kernel_func_from_hub")
    assert not offenders, offenders
