"""gemma4 with fp8 KV pages and rings (TF_KV_DTYPE=fp8: its full layers' K/V and its sliding
layers' rings) on the demo checkpoint (fp32): every gate holds bit for bit within fp8 (concurrent
== solo, pages == windows with poisoned freed pages, resumed == fresh past the sliding window,
from the device store and from the host tier), and fp8 stays close to fp32 KV."""

from tensorfold import conformance
from tensorfold_gemma4.demo import build_demo


class TestKVFp8(conformance.KVFp8Gates):
    family, build_demo = "gemma4", build_demo
    # resumed == fresh past the demo's 128-row sliding window: the kept rings carry the resume
    ids, lengths = (13, 700), (9, 200, 600, 2100)
    # q/k-normed scores at scale 1.0: wider than the other families'; the thinking demo, trained
    # on its replies alone, reaches 0.217 of the largest logit (0.2 held before it)
    max_logit_error = 0.3
