"""glm5_next's MTP layer as `--draft mtp` serves it (tensorfold_glm.mtp, model.py's
`mtp_rows`), through the Triton path on the CPU under TRITON_INTERPRET=1 at a tiny size: its rows
run inside the trunk's forward, and a decode round replayed from the graph runner's static pass
(device metadata only, what a CUDA graph captures) writes the same MTP rows and carry as a plain
pass."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold.engine.runner import ModelRunner, open_stream  # noqa: E402
from tensorfold_glm import config  # noqa: E402
from tensorfold_glm.config import GlmConfig  # noqa: E402
from tensorfold_glm.model import GlmModel  # noqa: E402

TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "linear_num_heads": 2,
    "linear_head_dim": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "index_topk": 8,
    "index_kpool": 4,
    "hc_sinkhorn_iters": 3,
}


def tiny_mtp_model() -> GlmModel:
    """One KDA layer and an MLA MTP layer with its own indexer (dense FFNs, dummy weights in
    bf16): the MTP's decoder layer is a two-layer dummy's second layer."""
    from tensorfold_glm.dummy import dummy_weights
    from tensorfold_glm.weights import MtpWeights

    kinds = {"layer_types": ["linear_attention", "indexed_attention"]}
    kinds["mlp_layer_types"] = ["dense", "dense"]
    both = GlmConfig.from_dict(
        {**TINY, **kinds, "num_hidden_layers": 2, "indexer_types": ["full", "full"]}, "test"
    )
    served = {**TINY, **kinds, "num_hidden_layers": 1, "num_nextn_predict_layers": 1}
    cfg = GlmConfig.from_dict({**served, config.SERVE_MTP_KEY: True}, "test")
    w = dummy_weights(both, "cpu", torch.bfloat16, seed=0, std=0.2)
    g = torch.Generator().manual_seed(1)
    h = cfg.hidden_size
    ones = torch.ones(h, dtype=torch.bfloat16)
    eh_proj = (torch.randn(h, 2 * h, generator=g) * 0.2).to(torch.bfloat16)
    mtp = MtpWeights(w.embed, ones, ones, eh_proj, w.layers[1], ones, w.lm_head)
    trunk = type(w)(w.embed, w.final_norm, w.lm_head, w.layers[:1], mtp)
    return GlmModel(cfg, trunk, "cpu", "bfloat16")


def test_served_mtp_rows_replayed_as_a_graph_equal_plain_passes(kernels_on_cpu: None) -> None:
    """With the MTP's rows on (as `--draft mtp` serves), decode rounds through the graph
    runner's static pass (its device meta only, what a CUDA graph captures) give the logits,
    the MTP's rows and its carry of plain passes, through the Triton path."""
    from tensorfold.engine.cuda_graphs import GraphRunner

    model = tiny_mtp_model()
    model.mtp_rows = True
    prompts = [list(range(3, 9)), [7, 9, 11], [40, 41]]  # in the bucket of 4: a padding row

    def rounds(runner: ModelRunner) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each pass's logits; then each stream's MTP rows (its latent and indexer keys, in
        position order) and its carry."""
        streams = [open_stream(runner, i, 64) for i in range(len(prompts))]
        out = runner.run([s.rows(p) for s, p in zip(streams, prompts)])
        logits = [torch.cat(out)]
        out = runner.run([s.rows([int(o[-1].argmax())]) for s, o in zip(streams, out)])
        logits.append(torch.cat(out))
        kept = []
        for s in streams:
            table = s.lease.pages
            flat = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(s.pos)])
            kept += [runner.rows.flat(n)[flat] for n in ("L1.latent", "L1.index_k")]
            kept.append(runner.slots.get("L1.carry")[s.slot])
        return logits, kept

    plain_runner = ModelRunner(model, num_pages=16, num_slots=3, page_rows=16)
    graph_runner = GraphRunner(model, num_pages=16, num_slots=4, page_rows=16, max_pages=4)
    (plain, plain_rows), (graphed, graphed_rows) = rounds(plain_runner), rounds(graph_runner)
    assert graph_runner.replays == 1
    for g, p in zip(graphed + graphed_rows, plain + plain_rows):
        assert torch.equal(g, p)
