"""The GPU suite's fp8 weights (`pytest -m gpu`, on a CUDA machine; docs/fp8.md): quantizing on
the GPU gives the CPU's bits, and each family's demo under `--quantization fp8` in bf16 holds the
gates (concurrent == solo, pages == windows with poison, resumed == fresh) and graph == eager,
through the fp8 kernels (tensorfold.ops.triton_fp8) that every fp8 product takes on the
device."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.ops.fp8 import quantize_blocks
from tensorfold.testing import close_even, tokens

pytestmark = pytest.mark.gpu

FAMILIES = {
    "lfm2_moe": "tensorfold_lfm2_moe",
    "gemma4": "tensorfold_gemma4",
    "glm5_next": "tensorfold_glm",
}
SPECS = {"lfm2_moe": "LFM2_MOE", "gemma4": "GEMMA4", "glm5_next": "GLM5_NEXT"}  # FamilySpecs
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=1234, max_tokens=8, ignore_eos=True)
FLAGS = {"device": "cuda", "dtype": "bfloat16", "memory_limit_gib": 4, "context": 4096}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    demo = importlib.import_module(f"{FAMILIES[request.param]}.demo")
    return request.param, demo.build_demo(tmp_path_factory.mktemp(request.param))


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(20, 700, (n,), generator=gen).tolist() for n in (5, 64, 700, 2100)]


def test_quantize_blocks_on_the_gpu_gives_the_cpus_bits() -> None:
    w = torch.randn(2, 700, 300, generator=torch.Generator().manual_seed(0)).bfloat16()
    cpu, gpu = quantize_blocks(w), quantize_blocks(w.cuda())
    assert torch.equal(cpu.q.view(torch.uint8), gpu.q.cpu().view(torch.uint8))
    assert torch.equal(cpu.scale, gpu.scale.cpu())


def test_fp8_through_the_kernels_is_bf16_on_the_dequantized_weights(
    family: tuple[str, Path], tmp_path: Path
) -> None:
    """The demo written as a block-scaled FP8 checkpoint and as its weights dequantized: in bf16
    on the GPU their prompt logits are the same bits, the fp8 kernels' products being the bf16
    kernels' over the dequantized weights. A product that left the kernels for another path
    (a silent fallback to separate linears, say) would change them."""
    name, folder = family
    model_module = importlib.import_module(f"{FAMILIES[name]}.model")
    spec = getattr(importlib.import_module(f"{FAMILIES[name]}.plugin"), SPECS[name])
    fp8, dequantized = testing.write_fp8_checkpoints(folder, tmp_path, spec.fp8_linears, "block")
    prompt = prompts()[2][:300]
    logits = []
    for path in (fp8, dequantized):
        model = model_module.load(Checkpoint.open(path), "cuda", "bfloat16")
        case = testing.ReferenceCase(name, path, None, model, prompt)
        logits.append(case.prompt_logits(cuts=[0, 200, 201, 300]))
        del model, case
    assert torch.equal(logits[0], logits[1])


def test_gates_within_fp8_weights(family: tuple[str, Path]) -> None:
    name, folder = family
    chats = [testing.chat_turns(c, 2, 300, 12) for c in range(3)]
    testing.assert_engine_gates(
        name, folder, prompts(), chats, GREEDY, SAMPLED, quantization="fp8", parallel=4, **FLAGS
    )


def test_fp8_graph_replay_equals_eager(family: tuple[str, Path]) -> None:
    name, folder = family
    out = []
    for graphs in (True, False):
        llm = testing.open_llm(
            name, folder, quantization="fp8", parallel=4, cuda_graphs=graphs, **FLAGS
        )
        try:
            assert "(fp8 linears)" in llm.served.plan.startup_line()
            out.append(tokens(llm, prompts(), SAMPLED))
        finally:
            close_even(llm)
    assert out[0] == out[1]
