"""Train a feature head (engine/feature.py) for a family's target, on the target's own states.

Each step runs the frozen target over a batch of windows and takes its features f_t (the
states its LM head reads) and its distributions p_t. The head is trained twice over each
window, as it is used:
- pass 1, from real features: pair t = (f_t, x_{t+1}) -> f̂_{t+1}, the first draft of a round;
- pass 2, from its own predictions: (f̂_t, x_{t+1}) -> f̂'_{t+1}, the later drafts of a round
  (EAGLE-3's "training-time test", one step deep).
Each pass's loss is the cross-entropy of the target's distribution p_{t+2} under the head's
(through the target's LM head) plus a smooth-L1 pull of the predicted feature towards the real
one (EAGLE-1), which keeps the feature fed to the next draft step in the target's space.

The windows are text of the head's domain (`autotune.zoo.domain_texts`: the family's code by
default) and text the target generates from that text's prompts, sampled at temperature 1 and
greedily (greedy requests draft along the target's greedy path), as the distilled drafter is
trained. Deterministic from the seed.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from autotune.train.zoo import domain_texts, encode_stream, family_dir, lr_at, random_windows, recipe_of, sample_from
from engine.feature import FeatureHead, HeadConfig
from engine.identity import weights_hash

HEAD_NAME = "feature"  # the head's folder in a family, and its drafter's name


@dataclass(frozen=True)
class HeadSpec:
    steps: int = 2400
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    ffn: int = 512
    feature_weight: float = 0.2  # smooth-L1 on features, against the cross-entropy
    generated: int = 192  # target-written windows, half sampled, half greedy
    domain: str = "code"  # the text it trains on (autotune.train.zoo.DOMAINS)
    seed: int = 0


@torch.no_grad()
def target_states(target, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's features [B, T, H] and log-probabilities [B, T, V] over `windows` [B, T]."""
    out = target(windows, output_hidden_states=True)
    return out.hidden_states[-1], F.log_softmax(out.logits.float(), -1)


def head_losses(head: FeatureHead, target, windows: torch.Tensor,
                feature_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The two passes' loss over `windows` [B, T], and each pass's top-1 agreement with the target."""
    features, logp = target_states(target, windows)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    length = windows.shape[1]
    positions = torch.arange(length - 2, device=windows.device)
    embeds = embed(windows[:, 1:-1])  # x_{t+1} for pairs t = 0..T-3
    wanted_features, wanted_logp = features[:, 1:-1], logp[:, 1:-1]  # f_{t+1}, p_{t+1} (predicts x_{t+2})

    def loss_of(predicted: torch.Tensor, wanted_f: torch.Tensor, wanted_lp: torch.Tensor):
        head_logp = F.log_softmax(lm_head(predicted).float(), -1)
        cross_entropy = -(wanted_lp.exp() * head_logp).sum(-1).mean()
        agreement = (head_logp.argmax(-1) == wanted_lp.argmax(-1)).float().mean()
        return cross_entropy + feature_weight * F.smooth_l1_loss(predicted, wanted_f), float(agreement)

    first = head(embeds, features[:, :-2], positions)
    loss_1, agree_1 = loss_of(first, wanted_features, wanted_logp)
    # Pass 2: the feature at t is the head's own f̂_t (pass 1's output at t - 1).
    second = head(embeds[:, 1:], first[:, :-1], positions[1:])
    loss_2, agree_2 = loss_of(second, wanted_features[:, 1:], wanted_logp[:, 1:])
    return loss_1 + loss_2, {"agree_1": agree_1, "agree_2": agree_2}


def train_head(folder: Path | None = None, spec: HeadSpec = HeadSpec(), progress: bool = True,
               out: Path | None = None, corpora: Path | None = None) -> dict:
    """Train a feature head for the target of the family in `folder` (the committed one by
    default) and save it as `folder/feature` (or `out`; a folder inside the family is listed among
    its feature heads); returns the report. `corpora` is where the prose domain's text is."""
    folder = family_dir(folder)
    manifest = json.loads((folder / "family.json").read_text())
    target_dir = folder / manifest["target"]
    family = recipe_of(manifest)
    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    started = time.perf_counter()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stream = encode_stream(tokenizer, domain_texts(spec.domain, family, corpora))
    held = encode_stream(tokenizer, domain_texts(spec.domain, family, corpora, held_out=True))
    prompt_len = 32
    prompts = random_windows(stream, spec.generated, prompt_len, gen)[:, :prompt_len]
    half = spec.generated // 2
    written = torch.cat([sample_from(target, prompts[:half], spec.seq_len - prompt_len, gen),
                         sample_from(target, prompts[half:], spec.seq_len - prompt_len, gen, greedy=True)])
    generated_s = time.perf_counter() - started
    config = HeadConfig(hidden=target.config.hidden_size, vocab_size=target.config.vocab_size,
                        heads=target.config.num_attention_heads, ffn=spec.ffn, target_hash=weights_hash(target_dir),
                        rope_theta=getattr(target.config, "rope_parameters", {}).get("rope_theta", 10000.0),
                        rms_eps=target.config.rms_norm_eps)
    head = FeatureHead(config).train()
    opt = torch.optim.AdamW(head.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.95))
    bar = tqdm(range(spec.steps), desc="train feature head", disable=not progress, mininterval=2)
    seen: dict[str, float] = {}
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec.steps, spec.lr)
        text = random_windows(stream, spec.batch_size // 2, spec.seq_len - 1, gen)
        picked = written[torch.randint(0, written.shape[0], (spec.batch_size - text.shape[0],), generator=gen)]
        loss, seen = head_losses(head, target, torch.cat([text, picked]), spec.feature_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", agree_1=f"{seen['agree_1']:.2f}", agree_2=f"{seen['agree_2']:.2f}")
    head.eval()
    with torch.no_grad():
        held_windows = random_windows(held, 16, spec.seq_len - 1, torch.Generator().manual_seed(1234))
        held_loss, held_agree = head_losses(head, target, held_windows, spec.feature_weight)
    report = {
        "spec": asdict(spec),
        "params": sum(p.numel() for p in head.parameters()),
        "generate_seconds": round(generated_s, 1),
        "train_seconds": round(time.perf_counter() - started - generated_s, 1),
        "final_train": {k: round(v, 3) for k, v in seen.items()},
        "held_out_loss": round(float(held_loss), 4),
        "held_out_top1_agreement": {k: round(v, 3) for k, v in held_agree.items()},
    }
    out = Path(out) if out is not None else folder / HEAD_NAME
    head.to(torch.float16).save(out, report)
    if out.parent == folder:
        manifest["feature_heads"] = [h for h in manifest.get("feature_heads", []) if h != out.name] + [out.name]
        (folder / "family.json").write_text(json.dumps(manifest, indent=2))
    if progress:
        print(f"feature head: held-out top-1 agreement {report['held_out_top1_agreement']},"
              f" {report['train_seconds']} s; saved to {out}")
    return report
