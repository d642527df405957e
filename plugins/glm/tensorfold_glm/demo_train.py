"""Train the glm5_next demo's weights: `python -m tensorfold_glm.demo_train [--steps N]`, or only
its MTP layer on the shipped trunk: `python -m tensorfold_glm.demo_train mtp [--steps N]`.

Writes demo_weights.safetensors beside this module (float16; `demo.build_weights` reads it back
as float32) with tensorfold.family.demo_train, through transformers' `Glm5NextForConditionalGeneration`
(the reference the family's parity tests check the loader against), so it needs transformers;
serving never imports this module. Starts from demo_weights' random tensors, on one thread with
deterministic algorithms and seeded batches. About eight minutes on one core (transformers' KDA
and mHC run as reference code on the CPU).

What it learns (tensorfold.family.demo_text): each story paragraph as plain text after [gMASK]<sop>,
each question with its answer as plain text, and each question as a chat turn rendered by the
demo's template twice: thinking on (the prompt ends <think>; the reply is the thought, </think>,
the answer) and off (the prompt ends </think>; the reply is the answer), each reply ended by
<|user|>, where GLM stops.

Then the MTP layer (layer num_hidden_layers, mtp.py), with the trunk frozen: its tensors are
copied bit for bit from what the trunk's training wrote (or from the shipped file, for `mtp`).
The trunk's hidden states (the streams' mean before the final norm, captured at the reference's
`norm`) are computed once; the MTP layer (transformers' own decoder layer at index
num_hidden_layers, in a reference model one layer longer, plus enorm, hnorm, eh_proj and
shared_head.norm as transformers' MtpLayer has them; shared_head.head is the trunk's lm_head,
copied and not trained) learns the token two ahead on the same texts' learnt rows: its row j
reads (h_{j-1}, t_j) (zeros before row 0, as mtp.py runs it) and learns t_{j+1}; and, as
drafting's later steps feed it, the same from its own hidden g_{j-1} in place of h_{j-1} (the
loss is the two cross entropies' sum). Under a minute on one core.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tensorfold.family.demo_train import Replies, demo_texts, main, train_demo

from . import demo
from .demo_text import CHAT_TEMPLATE
from .demo_weights import SEED

if TYPE_CHECKING:
    import torch

STEPS = 400
MTP_STEPS = 300
BATCH = 8
REPLIES = Replies(thinking="{t}</think>{a}<|user|>", direct="{a}<|user|>")
REFERENCE = "Glm5NextForConditionalGeneration"
TEXT = "model.language_model."


def run(steps: int) -> tuple[dict[str, Any], Any]:
    """The trunk's training, then the MTP layer's on the trained trunk."""
    texts = demo_texts(demo.GMASK + demo.SOP, CHAT_TEMPLATE, REPLIES)
    weights, tok = train_demo(demo, REFERENCE, texts, demo.ENDOFTEXT, SEED, steps, batch=BATCH)
    return with_mtp(weights, MTP_STEPS), tok


def with_mtp(trunk: dict[str, "torch.Tensor"], steps: int) -> dict[str, "torch.Tensor"]:
    """`trunk` (float16, on-disk names; any MTP tensors in it dropped) with the MTP layer trained
    on it for `steps` steps: the trunk's tensors are returned as they came."""
    import torch

    tok = demo.build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in demo.SPECIAL_TOKENS}
    cfg = demo.config_dict(tok.get_vocab_size(), ids)
    mtp_prefix = f"{TEXT}layers.{cfg['text_config']['num_hidden_layers']}."
    trunk = {k: v for k, v in trunk.items() if not k.startswith(mtp_prefix)}
    start = {k: v for k, v in demo.random_weights(cfg).items() if k.startswith(mtp_prefix)}

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    texts = demo_texts(demo.GMASK + demo.SOP, CHAT_TEMPLATE, REPLIES)
    examples = [(encode(read), encode(learnt)) for read, learnt in texts]
    learnt = _train_mtp(cfg, trunk, start, examples, ids[demo.ENDOFTEXT], steps)
    return {**trunk, **{k: v.to(torch.float16).contiguous() for k, v in learnt.items()}}


def _train_mtp(
    cfg: dict[str, Any],
    trunk: dict[str, "torch.Tensor"],
    start: dict[str, "torch.Tensor"],
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    steps: int,
    lr: float = 3e-3,
) -> dict[str, "torch.Tensor"]:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    text = cfg["text_config"]
    n, hidden_size, eps = text["num_hidden_layers"], text["hidden_size"], text["rms_norm_eps"]
    p = f"{TEXT}layers.{n}."
    model_cls = getattr(transformers, REFERENCE)
    # the trunk, frozen; and a reference one layer longer whose last layer is the MTP's block
    longer = json.loads(json.dumps(cfg))
    t = longer["text_config"]
    t.pop("num_nextn_predict_layers", None)
    t["num_hidden_layers"] = n + 1
    t["layer_types"] = [*text["layer_types"], "indexed_attention"]
    t["mlp_layer_types"] = [*text["mlp_layer_types"], "sparse"]
    t["indexer_types"] = [*text["indexer_types"], "full"]
    block_tensors = {k: v for k, v in start.items() if not k[len(p) :].startswith(_OWN_MTP_TENSORS)}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.float() for k, v in trunk.items()}, f"{folder}/model.safetensors")
        ref = model_cls.from_pretrained(folder, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(longer))
        both = {**{k: v.float() for k, v in trunk.items()}, **block_tensors}
        save_file(both, f"{folder}/model.safetensors")
        big = model_cls.from_pretrained(folder, dtype=torch.float32)
    block = big.model.language_model.layers[n]
    norm_cls = type(ref.model.language_model.norm)

    width = max(len(read) + len(write) for read, write in examples)
    x = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(x, -100)
    mask = torch.zeros_like(x, dtype=torch.bool)
    for i, (read, write) in enumerate(examples):
        m = len(read) + len(write)
        x[i, :m] = torch.tensor([*read, *write])
        labels[i, len(read) : m] = torch.tensor(list(write))
        mask[i, :m] = True
    seen: list[torch.Tensor] = []
    hook = ref.model.language_model.norm.register_forward_pre_hook(
        lambda _, args: seen.append(args[0])
    )
    with torch.no_grad():
        ref(input_ids=x, attention_mask=mask.long())
    hook.remove()
    h = seen[0]  # [E, W, H]: the trunk's hidden state of each row
    embed = ref.model.language_model.embed_tokens.weight.detach()
    head = ref.lm_head.weight.detach()

    enorm, hnorm, out_norm = (norm_cls(hidden_size, eps) for _ in range(3))
    eh = torch.nn.Linear(2 * hidden_size, hidden_size, bias=False)
    with torch.no_grad():
        enorm.weight.copy_(start[f"{p}enorm.weight"])
        hnorm.weight.copy_(start[f"{p}hnorm.weight"])
        out_norm.weight.copy_(start[f"{p}shared_head.norm.weight"])
        eh.weight.copy_(start[f"{p}eh_proj.weight"])
    parts = torch.nn.ModuleList([enorm, hnorm, eh, block, out_norm])
    # the MTP's row j reads (h_{j-1}, t_j), zeros before row 0, and learns t_{j+1}
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    positions = torch.arange(width)[None]
    gen = torch.Generator().manual_seed(SEED + 1)
    opt = torch.optim.AdamW(parts.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    hc = text["hc_mult"]
    for step in range(steps):
        pick = torch.randperm(len(examples), generator=gen)[:BATCH]
        cut = int(mask[pick].sum(1).max())
        embedded = enorm(embed[x[pick, :cut]])
        # step 1 from the trunk's hidden; step 2 (drafting's later steps) from the MTP's own
        before, loss = h[pick, :cut], torch.zeros(())
        for _ in range(2):
            shifted = torch.nn.functional.pad(before[:, :-1], (0, 0, 1, 0))
            streams = eh(torch.cat([embedded, hnorm(shifted)], dim=-1))
            streams = streams.unsqueeze(2).expand(-1, -1, hc, -1).contiguous()
            streams, _ = block(
                streams,
                attention_mask=mask[pick, :cut],
                position_ids=positions[:, :cut],
                position_embeddings=None,
            )
            before = streams.mean(2)
            logits = out_norm(before) @ head.T
            loss = loss + torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets[pick, :cut].reshape(-1)
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parts.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            print(f"mtp step {step}: loss {loss.item():.4f}")
    with tempfile.TemporaryDirectory() as end:
        big.save_pretrained(end)
        saved = load_file(str(Path(end) / "model.safetensors"))
    out = {k: v for k, v in saved.items() if k.startswith(p)}
    out[f"{p}enorm.weight"] = enorm.weight.detach()
    out[f"{p}hnorm.weight"] = hnorm.weight.detach()
    out[f"{p}eh_proj.weight"] = eh.weight.detach()
    out[f"{p}shared_head.norm.weight"] = out_norm.weight.detach()
    out[f"{p}shared_head.head.weight"] = trunk["lm_head.weight"].clone()
    if set(out) != set(start) or any(out[k].shape != start[k].shape for k in start):
        raise RuntimeError("the trained MTP layer's tensors differ from demo_weights' names")
    return out


# the MTP layer's own tensors, beside its decoder layer's
_OWN_MTP_TENSORS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


def retrain_mtp(argv: Sequence[str]) -> None:
    """`mtp [--steps N] [--out PATH]`: the shipped file's trunk, its MTP layer trained anew."""
    from tensorfold.family.demo_build import save_trained

    from .demo import WEIGHTS

    parser = argparse.ArgumentParser(prog="python -m tensorfold_glm.demo_train mtp")
    parser.add_argument("--steps", type=int, default=MTP_STEPS)
    parser.add_argument("--out", type=Path, default=WEIGHTS)
    args = parser.parse_args(argv)
    from safetensors.torch import load_file

    weights = with_mtp(load_file(str(WEIGHTS)), args.steps)
    save_trained(weights, args.out, demo.build_tokenizer(), f"{parser.prog} --steps {args.steps}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    from . import config

    config.serve_mtp()  # the trainer reads and writes the MTP layer
    if sys.argv[1:2] == ["mtp"]:
        retrain_mtp(sys.argv[2:])
    else:
        main(__doc__.splitlines()[0], demo.WEIGHTS, STEPS, run)
