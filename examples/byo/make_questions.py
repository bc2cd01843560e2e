"""The example's prompts: small sums as chat messages, with the answer in a column of its own.

    python examples/byo/make_questions.py --out byo/questions.jsonl             # one JSONL file
    python examples/byo/make_questions.py --out byo/questions --test 32         # a `datasets` folder: train, test

Each row is {"prompt": [{"role": "user", "content": "What is 7 + 8?"}], "answer": "15"}; the
`answer` column reaches the reward function as a keyword argument. With `--test N` the folder is a
DatasetDict saved with save_to_disk: `--rows` questions in its `train` split and N others in `test`,
which `hflow-plan run` evaluates on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from make_model import question


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument("--rows", type=int, default=512, help="questions (default 512)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument("--test", type=int, default=0, metavar="N", help="write a `datasets` folder with N held-out "
                   "questions in a test split (none of them in train)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.test:
        out.write_text("".join(json.dumps(question(rng)) + "\n" for _ in range(args.rows)))
        print(f"wrote {out}: {args.rows} questions")
        return
    import datasets

    test, seen = [], set()
    while len(test) < args.test:
        q = question(rng)
        if q["answer"] + json.dumps(q["prompt"]) not in seen:
            seen.add(q["answer"] + json.dumps(q["prompt"]))
            test.append(q)
    train = []
    while len(train) < args.rows:
        q = question(rng)
        if q["answer"] + json.dumps(q["prompt"]) not in seen:  # no held-out question in the training split
            train.append(q)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(out))
    print(f"wrote {out}: {len(train)} training and {len(test)} test questions")


if __name__ == "__main__":
    main()
