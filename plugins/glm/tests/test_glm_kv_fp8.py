"""glm5_next with fp8 KV pages (TF_KV_DTYPE=fp8: its MLA latent rows; the indexer rows keep the
model's dtype) on the demo checkpoint (fp32): every gate holds bit for bit within fp8 (concurrent
== solo, pages == windows with poisoned freed pages, resumed == fresh, from the device store and
from the host tier), and fp8 stays close to fp32 KV."""

from tensorfold import conformance
from tensorfold_glm.demo import build_demo


class TestKVFp8(conformance.KVFp8Gates):
    family, build_demo = "glm5_next", build_demo
    # the demo selects 4 pools of 16: the longer prompts are past the sparse point
    ids, lengths = (20, 800), (9, 130, 300, 2100)
    first_turn, later_turn, min_cached = 120, 15, 100
    # the thinking demo, trained on its replies alone, is sharper on these random prompts: 0.215
    # of the largest logit (under 0.05 before it); greedy tokens still agree throughout
    max_logit_error = 0.3
