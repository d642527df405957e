"""The weights of a GLM-5.3-Flash checkpoint under their on-disk names, shape-checked as they load.

On disk (as real checkpoints ship and transformers 5.23.0 saves): the text model under
`model.language_model.` (or `model.` in a flat text-only checkpoint), per-expert
gate/up/down projections, the KDA convolution split into q/k/v_conv1d, the forget gate's
f_a/f_b/dt_bias/A_log directly under `self_attn`, and the mHC weights as `hc_attn_*` /
`hc_ffn_*`. The reference keeps e_score_correction_bias, the convolutions, dt_bias, A_log and
the mHC base/scale in fp32 whatever the model dtype; so do we. A vision tower (`model.visual.`)
is not read here (vision_weights.py reads it). The MTP layer `layers.{num_hidden_layers}`
(DeepSeek-style: enorm, hnorm, eh_proj, the decoder layer's own tensors, shared_head.norm and
shared_head.head, optionally its own embed_tokens) is read into `ModelWeights.mtp` when config.json declares it
(num_nextn_predict_layers), the checkpoint has it and it runs at one rank; else mtp is None.

Under tensor parallel the checkpoint hands each tensor's slice for this rank (shards.py says how
each is cut; the shapes passed below are the whole tensors on disk; in the comments heads,
D, I and an FFN's E are one rank's, the router's E all experts), and only this rank's experts
are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from tensorfold.family.checkpoint import TensorReader
from tensorfold.ops.fp8 import Fp8Weight, cat_rows, empty_stack, put

from . import shards
from .config import DENSE, KDA, GlmConfig

if TYPE_CHECKING:
    from tensorfold.family.checkpoint import Checkpoint

F32 = torch.float32


Weight = torch.Tensor | Fp8Weight  # a linear's: fp8 when stored or quantized so (docs/fp8.md)


def joint_rows(weights: object, *names: str) -> Weight:
    """The named [*, H] maps of one input as one weight, their rows in the order named, each
    name re-pointed at its rows (a view): one product on the GPU instead of one a map, with no
    second copy. Not a dataclass field, so a census of the fields counts each byte once. fp8
    maps join as fp8 (cat_rows), plain ones as tensors."""
    joint = cat_rows([getattr(weights, n) for n in names])
    row = 0
    for n in names:
        rows = getattr(weights, n).shape[0]
        setattr(weights, n, joint[row : row + rows])
        row += rows
    return joint


@dataclass
class HcWeights:
    fn: torch.Tensor  # [(2+hc)*hc, hc*H] fp32 (the reference upcasts it in the op)
    base: torch.Tensor  # [(2+hc)*hc] fp32
    scale: torch.Tensor  # [3] fp32


@dataclass
class KdaWeights:
    qkv: Weight  # [3D, H]: q_proj, k_proj, v_proj rows
    conv: torch.Tensor  # [3D, K] fp32: q, k, v conv1d
    f_a: Weight  # [Dk, H]
    f_b: Weight  # [D, Dk]
    dt_bias: torch.Tensor  # [D] fp32
    decay: torch.Tensor  # [heads] fp32: exp(A_log)
    a_log: torch.Tensor  # [heads] fp32: A_log (the GPU kernel takes its exp itself)
    b: Weight  # [heads, H]
    g_a: Weight  # [Dk, H]
    g_b: Weight  # [D, Dk]
    o_norm: torch.Tensor  # [Dk]
    o: Weight  # [H, D]

    def __post_init__(self) -> None:
        self.x_maps = joint_rows(self, "f_a", "g_a", "b")  # [2Dk + heads, H]: one product of x
        self.fg_b = joint_rows(self, "f_b", "g_b")  # [2D, Dk]: f_b of f_a x, g_b of g_a x


@dataclass
class IndexerWeights:
    wq_b: torch.Tensor  # [nI*dI, q_lora_rank]
    wk: torch.Tensor  # [dI, H]
    k_norm: torch.Tensor  # [dI]
    k_bias: torch.Tensor  # [dI]
    weights_proj: torch.Tensor  # [nI, H]
    ape: torch.Tensor  # [kpool, dI]
    gate: torch.Tensor  # [dI, H]

    def __post_init__(self) -> None:
        self.x_maps = joint_rows(self, "wk", "gate", "weights_proj")  # [2dI + nI, H]


@dataclass
class MlaWeights:
    q_a: Weight  # [q_lora_rank, H]
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor  # [q_lora_rank]
    q_b: Weight  # [heads*dn, q_lora_rank]
    kv_a: Weight  # [r, H]
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor  # [r]
    w_uk: torch.Tensor  # [heads, r, dn]: kv_b_proj's key rows, transposed per head
    w_uv: torch.Tensor  # [heads, dv, r]: kv_b_proj's value rows
    o: Weight  # [H, heads*dv]
    o_bias: torch.Tensor | None
    indexer: IndexerWeights | None  # None: a "shared" layer


@dataclass
class DenseWeights:
    gate_up: Weight  # [2I, H]: gate rows, then up rows
    down: Weight  # [H, I]


@dataclass
class MoeWeights:
    router: torch.Tensor  # [E, H] fp32 (the reference upcasts it in the op)
    bias: torch.Tensor  # [E] fp32 e_score_correction_bias
    experts: Sequence[DenseWeights]  # E (under expert parallel: this rank's)
    shared: DenseWeights
    first_expert: int = 0  # experts[j] is expert first_expert + j
    # (gate_up [E, 2I, H], down [E, H, I]) that the experts view: the grouped kernels' operands
    stacks: tuple[Weight, Weight] | None = None


@dataclass
class LayerWeights:
    attn_hc: HcWeights
    ffn_hc: HcWeights
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    mixer: KdaWeights | MlaWeights
    ffn: DenseWeights | MoeWeights


@dataclass
class MtpWeights:
    embed: torch.Tensor  # [V, H]: the layer's own embed_tokens, else the trunk's (same tensor)
    enorm: torch.Tensor  # [H]: RMSNorm of the next token's embedding
    hnorm: torch.Tensor  # [H]: RMSNorm of the incoming hidden state
    eh_proj: Weight  # [H, 2H]: its input columns [enorm(e) | hnorm(h)]
    layer: LayerWeights
    norm: torch.Tensor  # [H]: shared_head.norm
    head: torch.Tensor  # [V, H]: shared_head.head, else the trunk's lm_head (same tensor)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    mtp: MtpWeights | None = None


def text_prefix(ckpt: "Checkpoint") -> str:
    """`model.language_model.` (composite checkpoints) or `model.` (flat text-only ones)."""
    for prefix in ("model.language_model.", "model."):
        if ckpt.has(f"{prefix}embed_tokens.weight"):
            return prefix
    return "model.language_model."  # the loader then names the tensor it misses


def load_weights(
    ckpt: "Checkpoint", cfg: GlmConfig, device: str, dtype: torch.dtype
) -> ModelWeights:
    read = TensorReader(ckpt, device, dtype)
    root = text_prefix(ckpt)
    h, v = cfg.hidden_size, cfg.vocab_size
    embed = read(f"{root}embed_tokens.weight", v, h)
    layers = [
        _layer(read, cfg, f"{root}layers.{i}", kind, cfg.mlp_layer_types[i], cfg.runs_indexer(i))
        for i, kind in enumerate(cfg.layer_types)
    ]
    split_vocab = shards.vocab_parallel(cfg, ckpt.shard.world)
    lm_head = read.lm_head(embed, cfg.tie_word_embeddings, split_vocab)
    weights = ModelWeights(embed, read(f"{root}norm.weight", h), lm_head, layers)
    if has_mtp(ckpt, cfg):
        weights.mtp = _mtp(read, cfg, f"{root}layers.{cfg.num_hidden_layers}", embed, lm_head)
    return weights


def has_mtp(ckpt: "Checkpoint", cfg: GlmConfig) -> bool:
    """Whether the MTP layer loads: declared by config.json, present, and at one rank."""
    p = f"{text_prefix(ckpt)}layers.{cfg.num_hidden_layers}"
    return cfg.mtp_layer is not None and ckpt.shard.world == 1 and ckpt.has(f"{p}.eh_proj.weight")


def _layer(
    read: TensorReader, cfg: GlmConfig, p: str, kind: str, ffn_kind: str, indexer: bool
) -> LayerWeights:
    h = cfg.hidden_size
    return LayerWeights(
        attn_hc=_hc(read, cfg, f"{p}.hc_attn"),
        ffn_hc=_hc(read, cfg, f"{p}.hc_ffn"),
        input_norm=read(f"{p}.input_layernorm.weight", h),
        post_norm=read(f"{p}.post_attention_layernorm.weight", h),
        mixer=_kda(read, cfg, p) if kind == KDA else _mla(read, cfg, p, indexer),
        ffn=(
            _dense(read, f"{p}.mlp", h, cfg.intermediate_size)
            if ffn_kind == DENSE
            else _moe(read, cfg, p)
        ),
    )


def _mtp(
    read: TensorReader, cfg: GlmConfig, p: str, embed: torch.Tensor, lm_head: torch.Tensor
) -> MtpWeights:
    """The MTP layer at prefix p: a decoder layer of config's MTP kinds (an MLA one runs its own
    indexer: no layer before it shares one), its input and head; embed_tokens and
    shared_head.head fall back on the trunk's when the checkpoint leaves them out."""
    h, v = cfg.hidden_size, cfg.vocab_size
    own = read.ckpt.has
    return MtpWeights(
        embed=read(f"{p}.embed_tokens.weight", v, h) if own(f"{p}.embed_tokens.weight") else embed,
        enorm=read(f"{p}.enorm.weight", h),
        hnorm=read(f"{p}.hnorm.weight", h),
        eh_proj=read.linear(f"{p}.eh_proj.weight", h, 2 * h),
        layer=_layer(read, cfg, p, cfg.mtp_layer_type, cfg.mtp_mlp_type, True),
        norm=read(f"{p}.shared_head.norm.weight", h),
        head=(
            read(f"{p}.shared_head.head.weight", v, h)
            if own(f"{p}.shared_head.head.weight")
            else lm_head
        ),
    )


def _hc(read: TensorReader, cfg: GlmConfig, p: str) -> HcWeights:
    n = cfg.hc_mult
    width = (2 + n) * n
    return HcWeights(
        fn=read.upcast(f"{p}_fn", width, n * cfg.hidden_size),
        base=read(f"{p}_base", width, dtype=F32),
        scale=read(f"{p}_scale", 3, dtype=F32),
    )


def _kda(read: TensorReader, cfg: GlmConfig, p: str) -> KdaWeights:
    h, dk, heads, d = cfg.hidden_size, cfg.linear_head_dim, cfg.linear_num_heads, cfg.kda_dim
    k = cfg.linear_conv_kernel_dim
    a = f"{p}.self_attn"
    a_log = read(f"{a}.A_log", heads, dtype=F32)
    return KdaWeights(
        qkv=cat_rows([read.linear(f"{a}.{x}_proj.weight", d, h) for x in "qkv"]),
        conv=torch.cat([read(f"{a}.{x}_conv1d.weight", d, 1, k, dtype=F32) for x in "qkv"]).reshape(
            -1, k
        ),
        f_a=read.linear(f"{a}.f_a_proj.weight", dk, h),
        f_b=read.linear(f"{a}.f_b_proj.weight", d, dk),
        dt_bias=read(f"{a}.dt_bias", d, dtype=F32),
        decay=torch.exp(a_log),
        a_log=a_log,
        b=read.linear(f"{a}.b_proj.weight", heads, h),
        g_a=read.linear(f"{a}.g_a_proj.weight", dk, h),
        g_b=read.linear(f"{a}.g_b_proj.weight", d, dk),
        o_norm=read(f"{a}.o_norm.weight", dk),
        o=read.linear(f"{a}.o_proj.weight", h, d),
    )


def _mla(read: TensorReader, cfg: GlmConfig, p: str, indexer: bool) -> MlaWeights:
    h, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
    qr, r, dn, dv = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    a = f"{p}.self_attn"
    kv_b = read(f"{a}.kv_b_proj.weight", heads * (dn + dv), r).view(-1, dn + dv, r)
    return MlaWeights(
        q_a=read.linear(f"{a}.q_a_proj.weight", qr, h),
        q_a_bias=read.bias(f"{a}.q_a_proj.bias", qr, bias),
        q_a_norm=read(f"{a}.q_a_layernorm.weight", qr),
        q_b=read.linear(f"{a}.q_b_proj.weight", heads * dn, qr),
        kv_a=read.linear(f"{a}.kv_a_proj_with_mqa.weight", r, h),
        kv_a_bias=read.bias(f"{a}.kv_a_proj_with_mqa.bias", r, bias),
        kv_a_norm=read(f"{a}.kv_a_layernorm.weight", r),
        w_uk=kv_b[:, :dn].transpose(1, 2).contiguous(),
        w_uv=kv_b[:, dn:].contiguous(),
        o=read.linear(f"{a}.o_proj.weight", h, heads * dv),
        o_bias=read.bias(f"{a}.o_proj.bias", h, bias),
        indexer=_indexer(read, cfg, f"{a}.indexer") if indexer else None,
    )


def _indexer(read: TensorReader, cfg: GlmConfig, p: str) -> IndexerWeights:
    h, n, d = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    return IndexerWeights(
        wq_b=read(f"{p}.wq_b.weight", n * d, cfg.q_lora_rank),
        wk=read(f"{p}.wk.weight", d, h),
        k_norm=read(f"{p}.k_norm.weight", d),
        k_bias=read(f"{p}.k_norm.bias", d),
        weights_proj=read(f"{p}.weights_proj.weight", n, h),
        ape=read(f"{p}.index_kpool_compress_ape", cfg.index_kpool, d),
        gate=read(f"{p}.index_kpool_compress_gate", d, h),
    )


def _dense(read: TensorReader, p: str, h: int, width: int) -> DenseWeights:
    gate_up = cat_rows([read.linear(f"{p}.{x}_proj.weight", width, h) for x in ("gate", "up")])
    return DenseWeights(gate_up, read.linear(f"{p}.down_proj.weight", h, width))


def _experts(read: TensorReader, m: str, local: range, h: int, width: int) -> list[DenseWeights]:
    """This rank's experts as views of two stacks, gate_up [E, 2I, H] and down [E, H, I], filled
    one expert at a time: the grouped kernels read the stacks without a copy (a copy at the
    first pass would hold a layer's experts twice after the pool was planned)."""
    gate_up: Weight | None = None
    down: Weight | None = None
    for i, j in enumerate(local):
        one = _dense(read, f"{m}.experts.{j}", h, width)
        if gate_up is None or down is None:
            gate_up, down = empty_stack(one.gate_up, len(local)), empty_stack(one.down, len(local))
        put(gate_up, i, one.gate_up)
        put(down, i, one.down)
    if gate_up is None or down is None:
        return []
    return [DenseWeights(gate_up[i], down[i]) for i in range(len(local))]


def _moe(read: TensorReader, cfg: GlmConfig, p: str) -> MoeWeights:
    h, e, width = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    m = f"{p}.mlp"
    local = read.ckpt.shard.experts(e)
    return MoeWeights(
        router=read.upcast(f"{m}.gate.weight", e, h),
        bias=read(f"{m}.gate.e_score_correction_bias", e, dtype=F32),
        experts=_experts(read, m, local, h, width),
        shared=_dense(read, f"{m}.shared_experts", h, width * cfg.n_shared_experts),
        first_expert=local.start,
    )
