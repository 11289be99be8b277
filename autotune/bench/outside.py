"""Outside workloads: requests files (autotune/data/requests_file.py) built from public prompt
sets that no built-in class draws from and the model family did not train on, for
`autotune bench controller --requests-file`.

    python -m autotune.bench.outside spec-bench question.jsonl spec-bench.jsonl
    python -m autotune.bench.outside answers ../shared/corpora answers.jsonl

`spec-bench`: Spec-Bench's 480 questions (github.com/hemingkx/Spec-Bench,
data/spec_bench/question.jsonl), 13 classes: MT-Bench's eight categories, German-English
translation, CNN/DailyMail summarization, Natural Questions, GSM8K reasoning and retrieval-augmented
QA, their category as the class, the first turn as a chat prompt (long documents keep their last
`MAX_CHARS` characters, so that prompt and output fit the family's context).
`answers`: 8 classes of 12 from GPTeacher's code instructions and HumanEval in ../shared/corpora:
instructions with and without input, HumanEval completions and explanations, and four built on a
larger model's answers (rewrite it, fix its typos, TL;DR, continue it).
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

MAX_CHARS = 2000


def chat(text: str) -> str:
    return f"User: {text}\nAssistant:"


def spec_bench(questions: Path) -> list[dict]:
    rows = [json.loads(line) for line in questions.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [{"class": row["category"], "prompt": chat(row["turns"][0][-MAX_CHARS:])} for row in rows]


def _typos(text: str, rng: random.Random) -> str:
    """One word in twelve with two neighbouring letters swapped."""
    words = text.split(" ")
    for i in rng.sample(range(len(words)), max(1, len(words) // 12)):
        word = words[i]
        if len(word) > 3:
            j = rng.randrange(len(word) - 1)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2:]
    return " ".join(words)


def answers(corpora: Path, per_class: int = 12, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    codegen = json.loads((corpora / "gpteacher_codegen.json").read_text(encoding="utf-8"))
    with gzip.open(corpora / "humaneval.jsonl.gz", "rt", encoding="utf-8") as f:
        humaneval = [json.loads(line) for line in f]
    rng.shuffle(codegen)
    unused = iter(codegen)  # each row serves one class at most

    def take(n: int, keep) -> list[dict]:
        out = []
        for row in unused:
            if keep(row):
                out.append(row)
                if len(out) == n:
                    break
        return out

    n = per_class
    rows = [{"class": "code-instruct", "prompt": chat(r["instruction"])}
            for r in take(n, lambda r: not r["input"].strip())]
    rows += [{"class": "code-instruct-input", "prompt": chat(f"{r['instruction']}\n{r['input'][:1200]}")}
             for r in take(n, lambda r: r["input"].strip())]
    rows += [{"class": "rewrite-code", "prompt": chat(f"Rewrite this with clearer names.\n{r['response']}")}
             for r in take(n, lambda r: 200 < len(r["response"]) < 1400 and "\n" in r["response"])]
    functions = rng.sample(humaneval, 2 * n)
    rows += [{"class": "humaneval", "prompt": r["prompt"][-MAX_CHARS:]} for r in functions[:n]]
    answered = take(3 * n, lambda r: 300 < len(r["response"]) < 1600)
    rows += [{"class": "fix-typos", "prompt": chat(f"Fix the typos in this text.\n{_typos(r['response'], rng)}")}
             for r in answered[:n]]
    rows += [{"class": "tldr", "prompt": f"{r['response']}\n\nTL;DR:"} for r in answered[n:2 * n]]
    rows += [{"class": "continue", "prompt": chat(f"Continue this text.\n{r['response'][:len(r['response']) // 2]}")}
             for r in answered[2 * n:]]
    rows += [{"class": "explain-code",
              "prompt": chat(f"Explain what this code does.\n{(r['prompt'] + r['canonical_solution'])[-1600:]}")}
             for r in functions[n:]]
    return rows


def main(argv: list[str]) -> None:
    if len(argv) != 3 or argv[0] not in ("spec-bench", "answers"):
        sys.exit(__doc__)
    kind, source, out = argv[0], Path(argv[1]), Path(argv[2])
    rows = spec_bench(source) if kind == "spec-bench" else answers(source)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} requests in {len({r['class'] for r in rows})} classes to {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
