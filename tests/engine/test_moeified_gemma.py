"""A real MoE on real text: Gemma-3 270M with every MLP made E permuted copies (``moeify``).

The MoE computes the dense model's function (see ``freetoken/checkpoint/moeify.py``), so every
MoE strategy must follow the dense model. Strategies that run the experts in float32 must give
its logits to float summation order and its greedy tokens. Strategies whose experts run on the
CPU executor (weights kept as bf16, activations possibly quantised) must stay close and pick the
dense model's token wherever the dense model is clear about it. An expert computed from the
wrong rows (another expert's projection, another token's input) is far outside both.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from freetoken.checkpoint import default_model_path
from freetoken.checkpoint.moeify import moeify_gguf
from freetoken.config import CacheSizing, EngineConfig
from freetoken.engine.runner import ModelRunner
from freetoken.errors import CheckpointError
from freetoken.layers.context import Segment
from freetoken.models.blocks import MoEBlock
from freetoken.moe.registry import strategy_names
from freetoken.moe.resident import ResidentExperts

NUM_EXPERTS, TOP_K = 4, 2
CACHE_SLOTS = 8  # of 18 layers x 4 experts: offloaded experts are evicted and fetched again
MAX_SEQ_LEN = 128
NEW_TOKENS = 24

REFERENCE = json.loads((Path(__file__).parent.parent / "data" / "gemma3_270m_llamacpp.json")
                       .read_text())
# prompts on which llama.cpp's greedy run never had a top-2 margin below 0.25
PROMPTS = [c["prompt_ids"] for c in REFERENCE["cases"] if min(c["margins"]) >= 0.25][:3]

# Strategies whose experts run on the CPU executor, with their tolerance below; every other
# strategy must match the dense logits to EXACT_RTOL.
APPROXIMATE = {"cpu", "hybrid"}
EXACT_RTOL = 1e-3  # of the largest logit
APPROX_KL = 0.02  # KL divergence of a step's next-token distribution (the cpu strategy's: 0.003)
# A dense top-2 margin from which an approximate strategy must pick the dense token (the cpu
# strategy moves a top-2 gap by <= 0.55 on these prompts; 83 % of the steps are this clear).
CLEAR = 1.5


pytestmark = pytest.mark.slow


def engine_config(model: Path, strategy: str, device: str) -> EngineConfig:
    """How ``strategy`` runs in this file; a strategy's own options are set here. Hybrid layers
    fetch one miss per call and compute the others on the CPU, the same split on every run.
    On CUDA, decode steps run as graphs (pieces around host-planned experts), captured for one
    row more than the prompts so that a padded row rides along."""
    return EngineConfig(model=str(model), device=device, dtype="float32", moe_strategy=strategy,
                        max_seq_len=MAX_SEQ_LEN, moe_cache=CacheSizing("size", CACHE_SLOTS),
                        moe_hybrid_max_fetch=1, moe_hybrid_online=False,
                        cuda_graph_max_bs=len(PROMPTS) + 1 if device == "cuda" else 0)


class Model:
    """The prompts as one batch through a model runner: the engine's forward, batched like the
    server's, without a tokenizer."""

    def __init__(self, cfg: EngineConfig, batch: int = len(PROMPTS)) -> None:
        # one page more: decode graphs keep a scratch page for padded rows
        self.runner = ModelRunner(cfg, kv_tokens=(batch + 1) * cfg.max_seq_len, progress=False)
        self.pages = [self.runner.kv.allocate(self.runner.pages_for(cfg.max_seq_len))
                      for _ in range(batch)]

    def forward(self, chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Logits (batch, vocab) of the last token of each chunk, run at positions start..,
        copied to the host (with CUDA graphs the runner's are a buffer the next step reuses)."""
        segments = [Segment(p, s, len(c)) for p, s, c in zip(self.pages, starts, chunks,
                                                              strict=True)]
        return self.runner.forward(chunks, segments).float().cpu()

    def follow(self, prompts: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
        """Logits (batch, n, vocab) before each of ``tokens`` (n per prompt), fed one by one
        after the prompts (teacher forcing)."""
        out = [self.forward(prompts, [0] * len(prompts))]
        for i in range(len(tokens[0]) - 1):
            out.append(self.forward([[t[i]] for t in tokens], [len(p) + i for p in prompts]))
        return torch.stack(out, dim=1)

    def greedy(self, prompts: list[list[int]], n: int) -> tuple[list[list[int]], torch.Tensor]:
        """``n`` greedy tokens after each prompt, and the logits (batch, n, vocab) before each."""
        out = [self.forward(prompts, [0] * len(prompts))]
        tokens = [[int(t)] for t in out[-1].argmax(-1)]
        for i in range(n - 1):
            out.append(self.forward([t[-1:] for t in tokens], [len(p) + i for p in prompts]))
            for t, nxt in zip(tokens, out[-1].argmax(-1).tolist(), strict=True):
                t.append(nxt)
        return tokens, torch.stack(out, dim=1)


@dataclass
class Runs:
    """Greedy runs of the prompts, and the logits along the dense model's runs."""

    tokens: list[list[int]]  # (batch, NEW_TOKENS) greedy
    logits: torch.Tensor  # (batch, NEW_TOKENS, vocab) before each token of the dense runs
    margins: torch.Tensor  # (batch, NEW_TOKENS) top-1 minus top-2 of those logits


def greedy_runs(model: Model, dense: Runs | None = None) -> Runs:
    """The model's greedy runs; its logits are teacher-forced along ``dense``'s tokens if the
    runs part."""
    tokens, logits = model.greedy(PROMPTS, NEW_TOKENS)
    if dense is not None and tokens != dense.tokens:
        logits = model.follow(PROMPTS, dense.tokens)
    top = logits.topk(2, dim=-1).values
    return Runs(tokens, logits, top[..., 0] - top[..., 1])


@pytest.fixture(scope="module", autouse=True)
def no_host_profile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Hybrid's split comes from engine_config, never from this host's bandwidth profile."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path_factory.mktemp("profile") / "none.json"))
        yield


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moeified") / f"gemma3-270m-moe{NUM_EXPERTS}.gguf"
    try:
        source = default_model_path()
    except CheckpointError as e:
        if not torch.cuda.is_available():  # CI installs the package: its absence is a failure
            raise
        pytest.skip(f"{e} (a GPU machine without the default model package)")
    return moeify_gguf(source, path, NUM_EXPERTS, TOP_K, seed=0)


@pytest.fixture(scope="module")
def dense(device: str) -> Runs:
    return greedy_runs(Model(engine_config(default_model_path(), "resident", device)))


@pytest.fixture(scope="module")
def resident_moe(moe_path: Path, device: str) -> Model:
    return Model(engine_config(moe_path, "resident", device))


@pytest.fixture(scope="module", params=strategy_names())
def moe(request: pytest.FixtureRequest, moe_path: Path, dense: Runs,
        device: str) -> tuple[str, Runs]:
    """Each strategy's runs on the MoE file; its model is dropped once they are made."""
    strategy = request.param
    model = (request.getfixturevalue("resident_moe") if strategy == "resident"
             else Model(engine_config(moe_path, strategy, device)))
    return strategy, greedy_runs(model, dense)


def test_every_layer_is_an_moe_block(resident_moe: Model):
    cfg = resident_moe.runner.model_config
    assert (cfg.num_experts, cfg.top_k, cfg.norm_topk_prob) == (NUM_EXPERTS, TOP_K, True)
    assert len(_moe_blocks(resident_moe)) == cfg.num_layers


def test_logits_follow_dense(moe: tuple[str, Runs], dense: Runs):
    strategy, got = moe
    if strategy not in APPROXIMATE:
        assert float(_max_error(got.logits, dense.logits).max()) <= EXACT_RTOL
        return
    assert float(_kl(got.logits, dense.logits).max()) <= APPROX_KL
    clear = dense.margins >= CLEAR
    picked = got.logits.argmax(-1) == torch.tensor(dense.tokens)
    assert picked[clear].all(), f"other tokens at clear steps {(clear & ~picked).nonzero()}"


def test_greedy_tokens_equal_dense(moe: tuple[str, Runs], dense: Runs):
    strategy, got = moe
    for b, (mine, theirs) in enumerate(zip(got.tokens, dense.tokens, strict=True)):
        if strategy not in APPROXIMATE:
            assert mine == theirs
            continue
        # the two runs may part only where the dense model nearly tied
        split = next((i for i, (a, c) in enumerate(zip(mine, theirs, strict=True)) if a != c),
                     None)
        if split is not None:
            margin = float(dense.margins[b, split])
            assert margin < CLEAR, f"prompt {b} parted at step {split} (dense margin {margin})"


def test_a_bank_mixup_is_far_outside_the_tolerances(resident_moe: Model, dense: Runs):
    """The checks above can fail: with expert 0's down paired with expert 1's gate and up (and
    the other way round) the next-token distributions are far from the dense model's."""
    blocks = _moe_blocks(resident_moe)
    experts = [e for b in blocks if isinstance(e := b.experts, ResidentExperts)]
    assert len(experts) == len(blocks)
    with torch.no_grad():
        for e in experts:
            e.down_proj[[0, 1]] = e.down_proj[[1, 0]]
        try:
            wrong = resident_moe.follow(PROMPTS, dense.tokens)
        finally:
            for e in experts:
                e.down_proj[[0, 1]] = e.down_proj[[1, 0]]
    assert float(_kl(wrong, dense.logits).median()) > 50 * APPROX_KL
    assert float((wrong.argmax(-1) == torch.tensor(dense.tokens)).float().mean()) < 0.5
    again = resident_moe.forward(PROMPTS, [0] * len(PROMPTS))
    assert float(_max_error(again, dense.logits[:, 0]).max()) <= EXACT_RTOL


def _moe_blocks(model: Model) -> list[MoEBlock]:
    return [m for m in model.runner.model.modules() if isinstance(m, MoEBlock)]


def _max_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Largest difference of each step's logits, relative to that step's largest logit."""
    return (got - want).abs().amax(-1) / want.abs().amax(-1)


def _kl(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """KL(want || got) of each step's next-token distribution."""
    p, q = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    return (p.exp() * (p - q)).sum(-1)



REPEATS = 10
# the reference cases whose first 13+ steps llama.cpp took with top-2 margins of CLEAR or more
CLEAR_PROMPTS = [c["prompt_ids"] for c in REFERENCE["cases"]
                 if min(c["margins"][:13]) >= CLEAR][:3]
CLEAR_TOKENS = 8  # on --device cpu a hybrid step of these prompts takes ~0.5 s


def test_greedy_tokens_do_not_depend_on_the_online_split(moe_path: Path, device: str):
    """Hybrid with its split moved online by measured times: which misses the CPU computes
    (int8 or bf16 activations) and which the device computes (float32) differs from run to run,
    so the bits do. On prompts the dense model is clear about, the greedy tokens of 10 repeated
    runs on one engine (the split moving between them) are the dense model's, as offload's and
    cpu's are, up to each prompt's first step with a dense top-2 margin under CLEAR (the cpu
    strategy moves a margin by at most 0.55 on these prompts)."""
    from dataclasses import replace

    from freetoken.moe.hybrid import HybridExperts
    from freetoken.moe.offload import offload_stats

    assert len(CLEAR_PROMPTS) == 3

    def greedy(model: Model) -> list[list[int]]:
        return model.greedy(CLEAR_PROMPTS, CLEAR_TOKENS)[0]

    dense = Model(engine_config(default_model_path(), "resident", device))
    tokens, logits = dense.greedy(CLEAR_PROMPTS, CLEAR_TOKENS)
    top = logits.topk(2, dim=-1).values
    unclear = (top[..., 0] - top[..., 1]) < CLEAR  # (prompt, step)
    clear = [int(u.int().argmax()) if u.any() else CLEAR_TOKENS for u in unclear]
    assert sum(clear) >= 2 * CLEAR_TOKENS, clear  # the check reaches most steps
    want = [t[:n] for t, n in zip(tokens, clear, strict=True)]
    del dense
    # offload is bitwise resident's (test_logits_follow_dense): two runs of it suffice
    for strategy, online, repeats in (("offload", False, 2), ("cpu", False, REPEATS),
                                      ("hybrid", True, REPEATS)):
        cfg = replace(engine_config(moe_path, strategy, device), moe_hybrid_online=online,
                      moe_hybrid_max_fetch="auto")
        model = Model(cfg, batch=len(CLEAR_PROMPTS))
        for i in range(repeats):
            got = [t[:n] for t, n in zip(greedy(model), clear, strict=True)]
            assert got == want, f"{strategy} run {i}"
        if strategy == "hybrid":  # the CPU had a share, and the split moved
            stats = offload_stats(model.runner.model)
            assert stats is not None
            assert sum(s["cpu_experts"] for s in stats["layers"].values()) > 0
            fractions = {m.policy.fraction for m in model.runner.model.modules()
                         if isinstance(m, HybridExperts)}
            assert len(fractions) > 1, fractions
