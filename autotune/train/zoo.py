"""The project's own model family: a deep target and cheap drafters sharing one tokenizer.

No model hub is reachable, so the family is trained here, reproducibly from a seed, and
saved as ordinary Hugging Face folders (safetensors + tokenizer) that `from_pretrained`
loads. The shape follows what makes speculation pay on an overhead-bound CPU, where a
forward costs roughly per layer: a deep target, a 1-layer drafter, a 2-layer drafter, and
the 1-layer drafter distilled from the target (KL to the target on corpus text and on text
the target generates).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from autotune.data.corpus import DOMAINS, shared_training_texts, stdlib_texts
from engine.identity import weights_hash
from engine.runner import cache_argument

EOS = "<|endoftext|>"
# Turns as Python comments, the assistant's left open: text a code model continues, and what
# /v1/chat/completions, LangChain's ChatOpenAI and guidellm's chat requests need a template for.
CHAT_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:\n{% endif %}")
DEFAULT_FAMILY_DIR = Path(__file__).parent / "family"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    steps: int
    lr: float = 2e-3
    distill_from_target: bool = False  # train on the target's distribution instead of text
    init_from: str | None = None  # start from another member's weights (distillation)


@dataclass(frozen=True)
class FamilySpec:
    vocab_size: int = 2048
    context: int = 1024
    seq_len: int = 256
    batch_size: int = 16
    seed: int = 0
    generated_fraction: float = 0.5  # share of distillation batches sampled from the target
    copy_examples: int = 1500  # rename-and-reproduce pairs from training files (teaches copying)
    members: tuple[ModelSpec, ...] = field(
        default_factory=lambda: (
            ModelSpec("target", layers=8, hidden=256, ffn=512, heads=4, steps=600),
            ModelSpec("small", layers=1, hidden=256, ffn=512, heads=4, steps=400),
            ModelSpec("medium", layers=2, hidden=256, ffn=512, heads=4, steps=600),
            ModelSpec(
                "distilled", layers=1, hidden=256, ffn=512, heads=4, steps=250,
                lr=1e-3, distill_from_target=True, init_from="small",
            ),
        )
    )

    def scaled(self, factor: float) -> FamilySpec:
        """The same family with every member's step count scaled (quick runs, GPU runs)."""
        members = tuple(replace(m, steps=max(1, int(m.steps * factor))) for m in self.members)
        return replace(self, members=members)


# A larger recipe for a GPU (the device tool): same shapes scaled up, more steps.
GPU_FAMILY = replace(
    FamilySpec(),
    vocab_size=8192,
    batch_size=64,
    members=(
        ModelSpec("target", layers=16, hidden=768, ffn=2048, heads=12, steps=20000, lr=6e-4),
        ModelSpec("small", layers=1, hidden=768, ffn=2048, heads=12, steps=8000, lr=1e-3),
        ModelSpec("medium", layers=4, hidden=768, ffn=2048, heads=12, steps=8000, lr=1e-3),
        ModelSpec("distilled", layers=1, hidden=768, ffn=2048, heads=12, steps=4000, lr=5e-4,
                  distill_from_target=True, init_from="small"),
    ),
)


def copy_texts(n: int, seed: int) -> list[str]:
    """Rename-and-reproduce documents from training files: without them a small target never
    learns to copy, and the workloads where n-gram lookup should shine would not exist."""
    import random

    from autotune.data.classes import edit_example, stdlib_functions

    examples = [edit_example(source, node) for _, source, node in stdlib_functions(held_out=False)]
    examples = [a + b + "\n" for a, b in (e for e in examples if e is not None)]
    return random.Random(seed).sample(examples, min(n, len(examples)))


def domain_texts(domain: str, family: FamilySpec, corpora: Path | None, held_out: bool = False) -> list[str]:
    """A drafter's training text: `code` (the standard library and the copy examples), `prose`
    (the shared corpora's English prose, maths, chat and creative text) or `all` (both)."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; one of {list(DOMAINS)}")
    code = stdlib_texts(held_out) if held_out else stdlib_texts(False) + copy_texts(family.copy_examples, family.seed)
    if domain == "code":
        return code
    if corpora is None:
        raise ValueError(f"the {domain} domain draws on the shared corpora, and none was found "
                         "(../shared/corpora or $AUTOTUNE_CORPORA)")
    prose = shared_training_texts(corpora, held_out)
    return prose if domain == "prose" else code + prose


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=EOS, chat_template=CHAT_TEMPLATE
    )


def build_model(spec: ModelSpec, family: FamilySpec, eos_id: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=family.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=family.context,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return LlamaForCausalLM(config)


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, separated by EOS, for random-window training."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()])


def lr_at(step: int, total: int, peak: float, warmup: int = 30) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def held_out_loss(model, windows: torch.Tensor) -> float:
    model.eval()
    logits = model(windows[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    model.train()
    return float(loss)


@torch.no_grad()
def sample_from(model, prompts: torch.Tensor, new_tokens: int, gen: torch.Generator,
                greedy: bool = False) -> torch.Tensor:
    """Text the target generates after `prompts` [B, P] (temperature 1, or `greedy`), for training
    drafters on its own distribution."""
    model.eval()
    cache = {cache_argument(model): DynamicCache(config=model.config)}
    seq = prompts
    logits = model(seq, **cache, use_cache=True).logits[:, -1]
    for _ in range(new_tokens):
        nxt = logits.argmax(-1, keepdim=True) if greedy else \
            torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen)
        seq = torch.cat([seq, nxt], dim=1)
        logits = model(nxt, **cache, use_cache=True).logits[:, -1]
    return seq


def train_member(
    spec: ModelSpec,
    family: FamilySpec,
    stream: torch.Tensor,
    eval_windows: torch.Tensor,
    eos_id: int,
    trained: dict[str, LlamaForCausalLM],
    progress: bool,
) -> tuple[LlamaForCausalLM, dict]:
    index = len(trained)  # members train in a fixed order, each from its own seed
    torch.manual_seed(family.seed * 1000 + index)
    gen = torch.Generator().manual_seed(family.seed * 1000 + index)
    model = build_model(spec, family, eos_id)
    if spec.init_from:
        model.load_state_dict(trained[spec.init_from].state_dict())
    teacher = trained["target"] if spec.distill_from_target else None
    generated = None
    if teacher is not None:
        n_gen = max(1, int(family.batch_size * family.generated_fraction))
        prompts = random_windows(stream, n_gen * 4, 32, gen)[:, :32]
        generated = sample_from(teacher, prompts, family.seq_len - 32 + 1, gen)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    started = time.perf_counter()
    bar = tqdm(range(spec.steps), desc=f"train {spec.name}", disable=not progress, mininterval=2)
    loss_value = float("nan")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec.steps, spec.lr)
        batch = random_windows(stream, family.batch_size, family.seq_len, gen)
        if teacher is None:
            logits = model(batch[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        else:
            n_gen = int(family.batch_size * family.generated_fraction)
            if n_gen:
                pick = torch.randint(0, generated.shape[0], (n_gen,), generator=gen)
                batch = torch.cat([batch[n_gen:], generated[pick][:, : batch.shape[1]]])
            inputs = batch[:, :-1]
            with torch.no_grad():
                teacher_logp = F.log_softmax(teacher(inputs).logits.float(), -1)
            student_logp = F.log_softmax(model(inputs).logits.float(), -1)
            loss = F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean") / inputs.shape[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = loss.item()
        bar.set_postfix(loss=f"{loss_value:.3f}")
    report = {
        "spec": asdict(spec),
        "params": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(time.perf_counter() - started, 1),
        "final_train_loss": round(loss_value, 4),
        "held_out_loss": round(held_out_loss(model, eval_windows), 4),
    }
    if progress:
        print(f"{spec.name}: held-out loss {report['held_out_loss']}, {report['train_seconds']} s")
    return model.eval(), report


def train_family(
    out_dir: Path,
    family: FamilySpec = FamilySpec(),
    corpora: Path | None = None,
    progress: bool = True,
    dtype: torch.dtype = torch.float16,
) -> dict:
    """Train tokenizer + every member and save them under out_dir/<name>; returns the report."""
    torch.manual_seed(family.seed)
    texts = domain_texts("code" if corpora is None else "all", family, corpora)
    started = time.perf_counter()
    tokenizer = train_tokenizer(texts, family.vocab_size)
    stream = encode_stream(tokenizer, texts)
    held = encode_stream(tokenizer, stdlib_texts(held_out=True))
    eval_windows = random_windows(held, 16, family.seq_len, torch.Generator().manual_seed(1234))
    if progress:
        print(f"tokenizer: {family.vocab_size} tokens; training stream {stream.numel():,} tokens")
    trained: dict[str, LlamaForCausalLM] = {}
    reports = {}
    for spec in family.members:
        model, reports[spec.name] = train_member(
            spec, family, stream, eval_windows, tokenizer.eos_token_id, trained, progress
        )
        trained[spec.name] = model
    out_dir = Path(out_dir)
    for name, model in trained.items():
        folder = out_dir / name
        model.to(dtype).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        model.float()
    manifest = {
        "family": asdict(family),
        "corpora": corpora is not None,
        "training_tokens": stream.numel(),
        "total_seconds": round(time.perf_counter() - started, 1),
        "members": reports,
        "target": "target",
        "drafters": [name for name in trained if name != "target"],
    }
    (out_dir / "family.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def train_drafter(folder: Path | None, name: str, domain: str, corpora: Path | None = None,
                  steps: int | None = None, progress: bool = True) -> dict:
    """Distil a one-layer drafter from the target of the family in `folder` (the committed one by
    default) on one domain's text and on what the target writes after that text's prompts, as the
    recipe's `distilled` member is trained on all of it; saved as `folder/name` and listed among
    the family's drafters. Returns its report."""
    folder = family_dir(folder)
    manifest = json.loads((folder / "family.json").read_text())
    if name == manifest["target"] or name in manifest.get("feature_heads", []):
        raise ValueError(f"{name!r} is already the family's target or a feature head")
    family = recipe_of(manifest)
    general = next(ModelSpec(**m) for m in manifest["family"]["members"] if m["name"] == "distilled")
    spec = replace(general, name=name, steps=steps or general.steps)

    def load(member: str) -> LlamaForCausalLM:
        return AutoModelForCausalLM.from_pretrained(folder / member, dtype=torch.float32).eval()

    trained = {"target": load(manifest["target"]), spec.init_from: load(spec.init_from)}
    tokenizer = AutoTokenizer.from_pretrained(folder / manifest["target"])
    stream = encode_stream(tokenizer, domain_texts(domain, family, corpora))
    held = encode_stream(tokenizer, domain_texts(domain, family, corpora, held_out=True))
    eval_windows = random_windows(held, 16, family.seq_len, torch.Generator().manual_seed(1234))
    model, report = train_member(spec, family, stream, eval_windows, tokenizer.eos_token_id, trained, progress)
    model.to(torch.float16).save_pretrained(folder / name)
    tokenizer.save_pretrained(folder / name)
    manifest["members"][name] = {**report, "domain": domain, "training_tokens": stream.numel()}
    manifest["drafters"] = [d for d in manifest["drafters"] if d != name] + [name]
    (folder / "family.json").write_text(json.dumps(manifest, indent=2))
    return manifest["members"][name]


def recipe_of(manifest: dict) -> FamilySpec:
    """The recipe a family was trained with, its members aside (from its family.json)."""
    return FamilySpec(**{k: v for k, v in manifest["family"].items() if k != "members"})


def family_dir(path: Path | None = None) -> Path:
    """The committed default family, or a folder given by the user."""
    folder = Path(path) if path is not None else DEFAULT_FAMILY_DIR
    if not (folder / "family.json").exists():
        raise FileNotFoundError(
            f"no model family at {folder} (family.json missing); train one with `autotune zoo train`"
        )
    return folder


def load_engine(folder: Path | None = None, device: str = "cpu", drafters: list[str] | None = None,
                ngram: bool = True, compile: bool | None = None, dtype: torch.dtype | None = None,
                prefix_cache_tokens: int = 0):
    """An engine over a trained family: its target, its drafters (all by default: the model
    drafters and its feature heads), n-gram lookup and, with each drafter distilled from the
    target and each feature head, a hybrid (`ngram+distilled`, `ngram+feature`, ...)."""
    from engine import HybridDrafter, NGramDrafter, SpeculativeEngine

    folder = family_dir(folder)
    manifest = json.loads((folder / "family.json").read_text())
    heads = manifest.get("feature_heads", [])
    available = manifest["drafters"] + heads
    names = available if drafters is None else drafters
    unknown = set(names) - set(available)
    if unknown:
        raise ValueError(f"unknown drafter(s) {sorted(unknown)}; this family has {available}")
    engine = SpeculativeEngine(folder / manifest["target"], device=device, dtype=dtype, compile=compile,
                               prefix_cache_tokens=prefix_cache_tokens)
    for name in names:
        engine.add_drafter(name, folder / name)
    if ngram:
        engine.add_drafter("ngram", NGramDrafter(max_ngram=3))
        for name in names:
            if name in heads:  # one head: requests take turns on it
                engine.add_drafter(f"ngram+{name}", HybridDrafter(engine.drafters[name], max_ngram=3))
            elif manifest["members"][name]["spec"]["distill_from_target"]:  # the same weights, a cache of its own
                engine.add_drafter(f"ngram+{name}", HybridDrafter(engine.drafters[name].model, max_ngram=3))
    hashes = {name: weights_hash(folder / name) for name in [manifest["target"], *names]}
    engine.identity = ";".join(f"{n}@{h}" for n, h in hashes.items())
    engine.model_records = [
        {"name": name, "role": "target" if name == manifest["target"] else "drafter", "path": str(folder / name),
         "content_hash": h, "params": _params(folder, manifest, name),
         "size_bytes": sum(f.stat().st_size for f in (folder / name).glob("*.safetensors"))}
        for name, h in hashes.items()
    ]
    return engine


def _params(folder: Path, manifest: dict, name: str) -> int:
    """A member's parameter count, from the family's manifest (a head's from its own report)."""
    if name in manifest["members"]:
        return manifest["members"][name]["params"]
    return json.loads((folder / name / "head.json").read_text())["training"]["params"]
